"""Optimizer steps inside backward (optimizer-in-backward, a post-accumulate-grad hook
that steps) are not the model's gradient: open audits' dispatch modes count the steps
running now, through torch's global optimizer step hooks, and record nothing meanwhile."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fpaudit.capture.context import CaptureContext

# The capture contexts of open audits, told of every optimizer step (optimizer_steps_counted).
_COUNTING: list[CaptureContext] = []
_step_hooks: list[Any] = []


def _optimizer_step_started(*_: Any) -> None:
    for context in _COUNTING:
        context.optimizer_step_started()


def _optimizer_step_finished(*_: Any) -> None:
    for context in _COUNTING:
        context.optimizer_step_finished()


@contextmanager
def optimizer_steps_counted(context: CaptureContext) -> Iterator[None]:
    """Count running optimizer steps (any optimizer, through torch's global step hooks),
    so that an optimizer stepping inside backward is not recorded as backward values.

    The two global hooks are registered once per process and stay (doing nothing while
    no audit is open): an audit may open or close inside another optimizer step hook
    (``fpaudit run`` closes its step in its own global pre hook, which torch calls before
    these), and registering or removing a hook while torch iterates over them raises
    "OrderedDict mutated during iteration". (The module registration hooks of
    ``recorder.registrations_watched`` are removed when the last audit closes: no audit
    closes while torch registers a parameter.)
    """
    if not _step_hooks:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        _step_hooks.append(register_optimizer_step_pre_hook(_optimizer_step_started))
        _step_hooks.append(register_optimizer_step_post_hook(_optimizer_step_finished))
    _COUNTING.append(context)
    try:
        yield
    finally:
        _COUNTING.remove(context)
