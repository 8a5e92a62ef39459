"""What fpaudit learned of a compiled backward graph, kept beside Inductor's cache.

fpaudit observes a compiled backward by the buffers Inductor's scheduler stores, and the
scheduler runs only when Inductor compiles a graph. A graph Inductor loads from its FX
graph cache (a plain ``torch.compile`` run cached it, or an earlier fpaudit run) runs no
scheduler. So the compile that ran it remembers fpaudit's plan for the graph (the
buffers observed, each one's module, op and loss scaling, the ops fused away, the lines
about buffers it could not read) in a small JSON file under Inductor's cache folder, and
a later compile that loads the graph from the cache recalls it instead of compiling the
graph again.

A plan is keyed by everything it is a function of: Inductor's FX graph cache key (the
graph's code, its inputs, Inductor's options, torch), the module stacks in the graph's
node metadata (the model's names: Inductor's key leaves them out, two models with the
same code and other names share a cache entry) and the code of fpaudit's planning. It
is used only for the very generated code it was made for (the SHA-256 of the compiled
wrapper's source). A plan that cannot be written (a read-only cache folder) is not
kept: the next run compiles the graph once more, as without it.

Known limitation: a graph the cache holds from a plain ``torch.compile`` run, never
compiled under fpaudit, is compiled once more by the first fpaudit run that meets it
(its scheduler has to run once); every later run loads it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx

from fpaudit import torch_internals_compile as _compile_internals
from fpaudit.errors import UsageError
from fpaudit.report.outputs import write_atomically

FORMAT = 1
"""The version of a remembered plan's JSON (a plan of another version is not read)."""

FOLDER = "fpaudit-compiled-plans"
"""The folder under Inductor's cache folder that holds the plans."""


@dataclass(frozen=True)
class GraphModulePath:
    """A module as a compiled graph names it: ``path`` below the module whose frame
    Dynamo compiled (``L['self']``: whichever instance ran the graph, ``frame`` true),
    or below the module ``torch.compile`` was given (``frame`` false)."""

    path: str
    frame: bool


@dataclass(frozen=True)
class CompiledSite:
    """One stored value of a compiled backward: its module, the op that made it, and
    whether it scales with the loss."""

    module: GraphModulePath
    op: str
    scales_with_loss: bool


@dataclass(frozen=True)
class BackwardPlan:
    """What fpaudit observes of one compiled backward graph: the buffers (Inductor's
    names) and what each one's value is, per module the ops whose values stayed in a
    fused kernel's registers, and a line per buffer that could not be read."""

    names: tuple[str, ...]
    sites: tuple[CompiledSite, ...]
    fused_away: dict[GraphModulePath, tuple[str, ...]]
    unreadable: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "names": list(self.names),
            "sites": [
                [s.module.path, s.module.frame, s.op, s.scales_with_loss] for s in self.sites
            ],
            "fused_away": [[m.path, m.frame, list(ops)] for m, ops in self.fused_away.items()],
            "unreadable": list(self.unreadable),
        }

    @classmethod
    def from_dict(cls, data: Any) -> BackwardPlan | None:
        """The plan ``data`` holds, or None when it is not one of this format."""
        try:
            if data["format"] != FORMAT:
                return None
            names = tuple(_strings(data["names"]))
            sites = tuple(
                CompiledSite(
                    GraphModulePath(_string(path), _flag(frame)), _string(op), _flag(scales)
                )
                for path, frame, op, scales in data["sites"]
            )
            fused = {
                GraphModulePath(_string(path), _flag(frame)): tuple(_strings(ops))
                for path, frame, ops in data["fused_away"]
            }
            unreadable = tuple(_strings(data["unreadable"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if len(names) != len(sites):
            return None
        return cls(names, sites, fused, unreadable)


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(value)
    return value


def _strings(values: Any) -> list[str]:
    if not isinstance(values, list):
        raise TypeError(values)
    return [_string(value) for value in values]


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(value)
    return value


def module_stacks(gm: fx.GraphModule) -> str:
    """A digest of the module stacks in ``gm``'s node metadata (``fwd_nn_module_stack``,
    ``nn_module_stack``): the names a plan gives its values, which Inductor's cache key
    does not hold."""
    stacks = []
    for node in gm.graph.nodes:
        for key in ("fwd_nn_module_stack", "nn_module_stack"):
            if key in node.meta:
                stack = node.meta[key] or {}
                paths = [str(v[0] if isinstance(v, tuple) else v) for v in stack.values()]
                stacks.append([node.name, key, paths])
    return hashlib.sha256(json.dumps(stacks).encode()).hexdigest()


@functools.cache
def _planning_code() -> str:
    """A digest of the code that makes a plan (a changed fpaudit plans anew)."""
    digest = hashlib.sha256()
    for path in (Path(__file__).with_name("compiled.py"), Path(_compile_internals.__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _path(cached: _compile_internals.CachedGraph, stacks: str) -> Path | None:
    """Where the plan of the graph cached as ``cached`` with ``stacks`` is kept (None
    when Inductor's cache folder cannot be made)."""
    key = hashlib.sha256(f"{cached.key}\n{stacks}\n{_planning_code()}".encode()).hexdigest()
    try:
        folder = _compile_internals.inductor_cache_dir()
    except OSError:
        return None
    return Path(folder) / FOLDER / f"{key}.json"


def remember(cached: _compile_internals.CachedGraph, stacks: str, plan: BackwardPlan) -> None:
    """Keep ``plan`` for the graph Inductor's cache keeps as ``cached``, made from a
    graph whose module stacks are ``stacks`` (:func:`module_stacks`)."""
    path = _path(cached, stacks)
    if path is None:
        return
    text = json.dumps({**plan.to_dict(), "code": cached.code}, sort_keys=True).encode()
    with contextlib.suppress(UsageError):  # not kept: a later run compiles it once more
        write_atomically(path, lambda file: file.write(text), option=FOLDER)


def recall(cached: _compile_internals.CachedGraph, stacks: str) -> BackwardPlan | None:
    """The plan kept for the graph Inductor's cache keeps as ``cached`` (the very same
    generated code), made from a graph with these module stacks; None when there is none."""
    path = _path(cached, stacks)
    if path is None:
        return None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("code") != cached.code:
        return None
    return BackwardPlan.from_dict(data)
