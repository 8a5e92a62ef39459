"""Which parameters' gradients held inf/NaN when a loss scaler checked them: per step,
on the device, without a host sync.

``GradScaler.unscale_`` checks every gradient of an optimizer for inf/NaN and sums the
answer into one flag (``found_inf``). :class:`GradientFlags` keeps the per-parameter
answer: the largest ``|grad|`` of each gradient, which ``fpaudit run`` already takes in
one multi-tensor launch (``torch._foreach_norm(grads, inf)``: an inf or NaN element makes
it inf or NaN), is compared with ``isfinite``; closing the step reduces those flags, in
the order the backward produced the gradients, to a few numbers (how many parameters
held inf/NaN, the positions of the first :data:`NAMED_PARAMETERS`), still on the device.
They join ``steps.ScalarLog`` and are read with the rest when the run ends.

The order: :class:`BackwardOrder` replays the autograd engine's rule (a node runs when
every node that feeds it has run, the highest sequence number first; ``AccumulateGrad``
has the highest) on the first scaled backward's graph, once, so that the parameter
nearest the origin of an inf comes first (its gradient was produced first).

Known limitations: the order is the first backward's (a model whose graph changes
between steps keeps it; parameters it did not reach come last, in the optimizer's
order); parameters outside the top-level modules the script called are named by their
optimizer position (``<param 3>``); those of a top-level module other than the first
one called carry its class and call order (``Linear#1.weight``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fpaudit import torch_internals as _internals
from fpaudit.capture.clock import model_name, wrapped_paths
from fpaudit.capture.recorder import MadeNonfinite
from fpaudit.capture.torch_patches import gradient_maxima
from fpaudit.report.records import KIND_FORWARD, SKIP_COLUMNS

if TYPE_CHECKING:
    from fpaudit.run.steps import Step

__all__ = [
    "NAMED_PARAMETERS",
    "AfterSkip",
    "BackwardOrder",
    "GradientFlags",
    "ParameterFlags",
    "StepFlags",
    "skips_table",
]

NAMED_PARAMETERS = 5
"""Parameters named per skipped step (all of them are counted)."""


class BackwardOrder:
    """Parameters in the order a backward produced their gradients, learned from the first
    :data:`GRAPHS_LEARNED` backward graphs (a GAN's second model's too), then kept."""

    GRAPHS_LEARNED = 8

    def __init__(self) -> None:
        self._rank: dict[int, int] = {}
        self.learned = 0  # graphs replayed

    def learn(self, tensors: Any) -> None:
        """Replay the engine on the graph of ``tensors`` (what ``backward`` was given)."""
        if self.learned >= self.GRAPHS_LEARNED:
            return
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
        nodes = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not nodes:
            return
        self.learned += 1
        dependencies: dict[Any, int] = {}
        seen = set(nodes)
        stack = list(nodes)
        while stack:  # every node reachable, and how many edges lead into it
            node = stack.pop()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                dependencies[child] = dependencies.get(child, 0) + 1
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
        ready = [(-_internals.node_sequence_number(n), i, n) for i, n in enumerate(nodes)]
        heapq.heapify(ready)
        tie = len(ready)
        while ready:
            _, _, node = heapq.heappop(ready)
            variable = getattr(node, "variable", None)  # AccumulateGrad: its parameter
            if isinstance(variable, torch.Tensor) and id(variable) not in self._rank:
                self._rank[id(variable)] = len(self._rank)
            for child, _ in node.next_functions:
                if child is None:
                    continue
                dependencies[child] -= 1
                if dependencies[child] == 0:
                    tie += 1
                    heapq.heappush(ready, (-_internals.node_sequence_number(child), tie, child))

    def sort(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Positions of ``params`` in backward order (those never reached last, in order)."""
        unreached = len(self._rank)
        return sorted(range(len(params)), key=lambda i: self._rank.get(id(params[i]), unreached))


class AfterSkip:
    """Which steps are captured, with their forward, after a skip: the step after each
    skip once a step with a scaler went through (calibration is over), ``budget`` times."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.calibrated = False

    def due(self, scaled: bool, skipped: bool) -> bool:
        """A step ended (``scaled``: a scaler took part; ``skipped``: it skipped the
        optimizer): is the next one captured (does the inf persist, and from where)?"""
        if skipped and self.calibrated and self.budget > 0:
            self.budget -= 1
            return True
        self.calibrated |= scaled and not skipped
        return False


@dataclass
class StepFlags:
    """One step's flags: the parameters checked, in backward order, by name, and the
    slots of the scalar log that hold [count, first positions...] (-1 when none)."""

    names: list[str]
    slots: list[int]


@dataclass(frozen=True)
class ParameterFlags:
    """What the flags of a step said once read: how many parameters' gradients held
    inf/NaN, of how many checked, and the first ones by name, in backward order."""

    nonfinite: int
    checked: int
    first: tuple[str, ...]


class GradientFlags:
    """Per step, which parameters' gradients held inf/NaN when the scaler checked them
    (see the module docstring); device values only until the run ends."""

    def __init__(self) -> None:
        self.order = BackwardOrder()
        self._names: dict[int, str] = {}
        self._pending: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self._permutations: dict[tuple[int, ...], tuple[list[str], torch.Tensor]] = {}

    def note_gradients(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor | None:
        """Note the (parameter, gradient) ``pairs`` a scaler checks now; the largest
        ``|grad|`` of them all, from the same per-gradient maxima (None: none)."""
        found = gradient_maxima([grad for _, grad in pairs])
        if found is None:
            return None
        maxima, kept = found
        self.note([pairs[i][0] for i in kept], maxima)
        return maxima.max()

    def note(self, params: Sequence[torch.Tensor], maxima: torch.Tensor) -> None:
        """``maxima``: the largest ``|grad|`` of each of ``params`` (a device vector)."""
        self._pending.append((list(params), ~torch.isfinite(maxima)))

    def close(self, roots: Iterable[nn.Module], add: Any) -> StepFlags | None:
        """Reduce the step's flags on the device; ``add(vector)`` keeps a 1-D device
        tensor and gives its slots (``ScalarLog.add_vector``). None: nothing was checked."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        params = [p for part, _ in pending for p in part]
        device = pending[0][1].device
        flags = torch.cat([f.to(device, non_blocking=True) for _, f in pending])
        names, permutation = self._permutation(params, roots, device)
        ordered = flags[permutation]
        count = len(params)
        positions = torch.where(ordered, torch.arange(count, device=device), count)
        shown = min(NAMED_PARAMETERS, count)
        first = torch.topk(positions, shown, largest=False, sorted=True).values
        summary = torch.cat([ordered.sum().reshape(1), first]).double()
        return StepFlags(names, add(summary))

    def _permutation(
        self, params: list[torch.Tensor], roots: Iterable[nn.Module], device: torch.device
    ) -> tuple[list[str], torch.Tensor]:
        key = tuple(id(p) for p in params)
        known = self._permutations.get(key)
        if known is None or known[1].device != device:
            order = self.order.sort(params)
            names = [self._name(params[i], i, roots) for i in order]
            known = self._permutations[key] = (names, torch.tensor(order, device=device))
        return known

    def _name(self, param: torch.Tensor, position: int, roots: Iterable[nn.Module]) -> str:
        if id(param) not in self._names:
            for i, root in enumerate(roots):
                # the first model called names its own; another's are told apart by class
                prefix = f"{type(root).__name__}#{i}." if i else ""
                wrapped = wrapped_paths(root)
                for name, owned in root.named_parameters():
                    self._names.setdefault(id(owned), prefix + model_name(name, wrapped))
        return self._names.get(id(param), f"<param {position}>")

    @staticmethod
    def read(step: StepFlags, values: Sequence[float]) -> ParameterFlags:
        """The flags of ``step`` from the scalar log's ``values``."""
        count = int(values[step.slots[0]])
        checked = len(step.names)
        positions = [int(values[s]) for s in step.slots[1:]]
        first = tuple(step.names[p] for p in positions[:count] if p < checked)
        return ParameterFlags(count, checked, first)


def skips_table(
    steps: Sequence[Step], table: Mapping[str, Sequence[Any]], values: Any
) -> dict[str, list[Any]]:
    """The skips table (every column of ``SKIP_COLUMNS``): a row per step of ``steps``
    that ``table`` (their steps table) marks skipped, from its flags (read from the
    scalar log's ``values``) and the op a capture saw make inf/NaN, in that step or, when
    the next step was captured and broke too, in the next one. A step whose loss was
    inf/NaN takes a forward op only (its backward carried what the forward made)."""
    rows: dict[str, list[Any]] = {name: [] for name in SKIP_COLUMNS}
    broken = [
        bool(skipped) or not bool(finite)
        for skipped, finite in zip(table["skipped"], table["loss_finite"], strict=True)
    ]
    for i, step in enumerate(steps):
        if not table["skipped"][i]:
            continue
        flags = GradientFlags.read(step.flags, values) if step.flags is not None else None
        forward_only = not table["loss_finite"][i]
        seen, seen_at = _origin_op(step, forward_only), i
        if seen is None and i + 1 < len(steps) and broken[i + 1]:
            seen, seen_at = _origin_op(steps[i + 1], forward_only), i + 1
        row = {
            "step": step.index,
            "rank": table["rank"][i],
            "loss_scale": table["loss_scale"][i],
            "loss_finite": table["loss_finite"][i],
            "nonfinite_params": flags.nonfinite if flags is not None else -1,
            "params_checked": flags.checked if flags is not None else 0,
            "params": ", ".join(flags.first) if flags is not None else "",
            "op_step": steps[seen_at].index if seen is not None else -1,
            "op_phase": seen.key.kind if seen is not None else "",
            "op_module": seen.key.module if seen is not None else "",
            "op": seen.key.op if seen is not None else "",
            "op_amax": seen.amax if seen is not None else math.nan,
            "op_scale": table["loss_scale"][seen_at] if seen is not None else math.nan,
        }
        for name in SKIP_COLUMNS:
            rows[name].append(row[name])
    return rows


def _origin_op(step: Step, forward_only: bool) -> MadeNonfinite | None:
    made = step.made_nonfinite
    if made is None or (forward_only and made.key.kind != KIND_FORWARD):
        return None
    return made
