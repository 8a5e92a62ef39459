"""What an open audit's capture parts share, in one object the audit owns.

The dispatch mode (``mode.py``) reads it once per op; the engine wrapper
(``engine.py``) tells it when a backward starts and ends; the optimizer step hooks
(``optimizer_hooks.py``) tell it when an optimizer steps inside backward. Each part
changes it only through its methods, so a reader of one module sees every writer of
the state it reads here, and none of those modules imports another.

The fields the mode reads on every op are plain attributes (a property would cost a
call per op); only this module assigns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fpaudit.capture.origin_probe import OriginTracker


@dataclass(eq=False)
class CaptureContext:
    """The state an open audit's capture parts share.

    ``shadow``: also record low-precision backward outputs re-run in fp32 (``--shadow``).
    ``origins``: which op calls made inf/NaN (``scan --origins``; None unless asked for).
    ``grad_mode_means_recompute``: inside the running backward, grad mode on means
    activation checkpointing recomputing a forward (True unless the backward was asked
    for ``create_graph``, which turns grad mode on for the backward's own ops).
    ``optimizer_steps``: optimizer steps running now (an optimizer stepping inside
    backward), whose work is not the model's gradient.
    ``name_first_nonfinite``: also mark which backward op first made inf/NaN in a step
    (``fpaudit run``: where a skipped step's overflow came from).
    """

    shadow: bool = False
    origins: OriginTracker | None = None
    grad_mode_means_recompute: bool = False
    optimizer_steps: int = 0
    name_first_nonfinite: bool = False

    def backward_started(self, create_graph: bool) -> None:
        """An outermost backward starts; a step that raised never ran its post hook, so
        no optimizer step is running now."""
        self.grad_mode_means_recompute = not create_graph
        self.optimizer_steps = 0

    def backward_ended(self) -> None:
        self.grad_mode_means_recompute = False

    def optimizer_step_started(self) -> None:
        self.optimizer_steps += 1

    def optimizer_step_finished(self) -> None:
        self.optimizer_steps = max(self.optimizer_steps - 1, 0)
