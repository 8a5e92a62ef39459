"""An open audit's end of ``fpaudit.capture.compiled``: the values a ``torch.compile``d
backward stored, recorded under the model's module names, and what the audit cannot
observe of a compiled model (a line each), for the report's ``compiled`` metadata."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fpaudit import torch_internals_compile as _compile_internals
from fpaudit.capture import compiled
from fpaudit.capture.clock import ModuleClock, compiled_wrappers, model_name
from fpaudit.capture.recorder import Recorder
from fpaudit.report.records import KIND_BACKWARD
from fpaudit.report.runinfo import CompiledInfo

if TYPE_CHECKING:  # pandas: only once a report is built
    import pandas as pd


def _known_module(name: str, known: frozenset[str]) -> str:
    """``name``, or its nearest enclosing module the model has (a path Dynamo wrote that
    the model does not name, such as a function's local module, goes to its parent)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


class CompiledReceiver:
    """Receives what compiled backward graphs of ``model`` stored (a ``compiled.Receiver``)."""

    def __init__(self, model: nn.Module, clock: ModuleClock, recorder: Recorder) -> None:
        self._clock = clock
        self._recorder = recorder
        self._lock = threading.Lock()
        self._runs = 0  # observed compiled backward runs
        self._fused_away: dict[str, set[str]] = {}
        self._not_covered: list[str] = compiled.not_covered_modules(model)
        wrappers = compiled_wrappers(model)
        backends = [(_compile_internals.compiled_module_parts(m) or ("",))[0] for m in wrappers]
        # Inductor compiles part of the model out of fpaudit's sight, or a compiled backward
        # ran unobserved (a line said why): backward values hide in fused kernels, so a
        # step without an observed compiled backward measured nothing of them. A model
        # compiled by fpaudit whose backward had no compiled graph (Dynamo left it all to
        # eager) hides nothing: its values are the eager ones, captured.
        self._hidden = any(backend != compiled.BACKEND_NAME for backend in backends)
        # fpaudit's compiled modules, whose own eager ops (a graph break) carry their name
        self._observed_wrappers = sorted(
            clock.names[id(m)]
            for m, backend in zip(wrappers, backends, strict=True)
            if backend == compiled.BACKEND_NAME
        )

    def _naming(self, graph: compiled.CompiledGraph) -> tuple[str, frozenset[str]] | None:
        """The model's name of the module ``torch.compile`` was given for ``graph``, and
        the model's module names; None for a graph compiled from another model."""
        if graph.root is None:
            return "", self._clock.known_names
        root = graph.root()
        name = self._clock.names.get(id(root)) if root is not None else None
        return None if name is None else (name, self._clock.known_names)

    def _named(
        self,
        naming: tuple[str, frozenset[str]],
        frame: str | None,
        module: compiled.GraphModulePath,
    ) -> str:
        """The graph's module path, as the model names it: below the module whose compiled
        frame ran this backward (``frame``, when its run said so) or below the module
        ``torch.compile`` was given."""
        prefix, known = naming
        if module.frame and frame is not None:
            prefix = frame
        return _known_module(".".join(p for p in (prefix, model_name(module.path)) if p), known)

    def frame_starts(
        self, parameters: Sequence[tuple[compiled.FrameParameter, Any]]
    ) -> Callable[[], None] | None:
        """A compiled frame starts forward with these parameters of its module: the first
        that is the model's names the module (``experts.2``, whose ``up.weight`` it is),
        and the clock notes the run's backward as that module's. None when no parameter
        is the model's (a frame of another model)."""
        owners = self._clock.param_owner
        for parameter, tensor in parameters:
            owner = owners.get(id(tensor))
            if owner is None or owner[1] != parameter.name:
                continue
            held_by, below = owner[0], model_name(parameter.module)
            if below and not (held_by == below or held_by.endswith("." + below)):
                continue  # a tied parameter, first named by another module
            name = held_by[: len(held_by) - len(below)].rstrip(".") if below else held_by
            return self._clock.compiled_run_starts(name)
        return None

    def record_compiled(
        self, graph: compiled.CompiledGraph, site: compiled.CompiledSite, value: Any
    ) -> None:
        """Record one value a compiled backward stored (``fpaudit.capture.compiled``), under
        the model's module name; a graph compiled from another model is not this audit's."""
        naming = self._naming(graph)
        if naming is None or not isinstance(value, torch.Tensor):
            return
        module = self._named(naming, self._clock.compiled_run_now(), site.module)
        self._recorder.record(KIND_BACKWARD, module, compiled.COMPILED_NODE, site.op, 0,
                              site.scales_with_loss, value)  # fmt: skip

    def compiled_run(self, graph: compiled.CompiledGraph) -> None:
        """Count one observed run of a compiled backward of this model, and note the ops
        its fused kernels kept in registers."""
        naming = self._naming(graph)
        if naming is None:
            return
        with self._lock:
            self._runs += 1
        frame = self._clock.compiled_run_now()
        for module, ops in graph.fused_away.items():
            self._fused_away.setdefault(self._named(naming, frame, module), set()).update(ops)

    def note_not_covered(self, line: str) -> None:
        """Note what this audit cannot observe (a compiled backward without the observer)."""
        self._hidden = True
        if line not in self._not_covered:
            self._not_covered.append(line)

    def note_eager_inside(self, modules: Iterable[str]) -> None:
        """Note the compiled modules of which a step's backward ran aten ops eagerly
        (``modules``: every module a step recorded a backward op of, outside a compiled
        backward): Dynamo left part of their forward to eager (a graph break, or a
        module it does not trace, as ``nn.LSTM``), and those ops carry the compiled
        module's name, not their own submodule's (no hook runs inside a compiled module)."""
        for name in sorted(set(modules) & set(self._observed_wrappers)):
            shown = repr(name) if name else "the model"
            line = (
                f"Dynamo ran part of {shown} eagerly (a graph break, or a module it does not "
                "trace, as nn.LSTM): those backward ops are recorded under "
                f"{name or '(root)'}, not their own submodules"
            )
            if line not in self._not_covered:  # (captured, not hidden)
                self._not_covered.append(line)

    def info_for(self, records: pd.DataFrame) -> CompiledInfo | None:
        """:meth:`info` of a report whose records table is ``records``, after noting the
        compiled modules of which a step ran backward ops eagerly
        (:meth:`note_eager_inside`)."""
        eager = records[
            (records["kind"] == KIND_BACKWARD) & (records["node"] != compiled.COMPILED_NODE)
        ]
        self.note_eager_inside(eager["module"].unique())
        return self.info()

    def info(self) -> CompiledInfo | None:
        """The report's ``compiled`` metadata; None when nothing of the model is compiled."""
        if not (self._runs or self._not_covered or self._fused_away):
            return None
        return CompiledInfo(
            inductor=self._hidden or self._runs > 0,
            observed_backward_runs=self._runs,
            fused_away={m: tuple(sorted(ops)) for m, ops in sorted(self._fused_away.items())},
            not_covered=tuple(self._not_covered),
        )
