"""A backward graph Inductor's FX graph cache holds is loaded under fpaudit, not compiled
again, once fpaudit has planned it (``fpaudit.capture.compiled_plans``).

Oracles that share no fpaudit code: Inductor's own compile function, counted (how many
graphs it really compiled: ``fx_codegen_and_compile`` runs only on a cache miss or with
the cache off), the plain ``torch.compile`` run's gradients bit for bit, and the module
names the model itself gives (``named_modules``). Each test starts from an empty Inductor
cache folder of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fpaudit
from fpaudit import torch_internals_compile as compile_internals
from fpaudit.capture import compiled_plans
from fpaudit.capture.compiled import COMPILED_NODE
from fpaudit.capture.compiled_plans import BackwardPlan, CompiledSite, GraphModulePath
from fpaudit.report.records import KIND_BACKWARD
from fpaudit.report.store import Report


class Named(nn.Module):
    """``nn.Sequential(Linear, GELU, Linear)`` with names of its own: the same graph code."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.act, self.fc_out = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


BATCH = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 24 - 1


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """An empty Inductor cache folder; each graph Inductor really compiles (forward or
    backward) is appended to the list returned."""
    from torch._inductor import compile_fx

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    seen: list[str] = []
    original = compile_fx.fx_codegen_and_compile

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append("backward" if kwargs.get("is_backward") else "forward")
        return original(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "fx_codegen_and_compile", counted)
    torch._dynamo.reset()
    yield seen
    torch._dynamo.reset()


def _plain(make: Callable[[], nn.Module]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = make()
    torch._dynamo.reset()
    torch.compile(net)(BATCH).square().mean().backward()
    return [p.grad.clone() for p in net.parameters() if p.grad is not None]


def _audited(make: Callable[[], nn.Module]) -> tuple[Report, list[torch.Tensor], nn.Module]:
    torch.manual_seed(0)
    net = make()
    torch._dynamo.reset()
    model = fpaudit.compile(net)
    with fpaudit.audit(model) as audit:
        model(BATCH).square().mean().backward()
        audit.step()
    return audit.report, [p.grad.clone() for p in net.parameters() if p.grad is not None], net


def _stored(report: Report) -> Any:
    """The records of the compiled backward's stored values."""
    records = report.records
    return records[(records["kind"] == KIND_BACKWARD) & (records["node"] == COMPILED_NODE)]


def test_a_graph_cached_by_plain_torch_compile_is_compiled_once_more_then_never(
    compiles: list[str],
) -> None:
    plain = _plain(_sequential)
    assert compiles == ["forward", "backward"]  # an empty cache: both compiled
    first, first_grads, _ = _audited(_sequential)
    # the forward is loaded; the backward, never planned by fpaudit, is compiled once
    assert compiles[2:] == ["backward"]
    second, second_grads, _ = _audited(_sequential)
    assert compiles[3:] == []  # both loaded from Inductor's cache: no compile at all
    for grads in (first_grads, second_grads):
        assert len(grads) == len(plain) == 4
        assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))
    for report in (first, second):
        info = report.info.compiled
        assert info is not None and info.observed_backward_runs == 1
    # the loaded graph is observed as the compiled one was: the same values, counted
    assert len(_stored(first)) > 0
    assert second.records.equals(first.records) and second.bins.equals(first.bins)
    assert second.info.compiled.fused_away == first.info.compiled.fused_away


def test_a_graph_fpaudit_compiled_first_is_loaded_by_both(compiles: list[str]) -> None:
    _audited(_sequential)
    assert compiles == ["forward", "backward"]
    _plain(_sequential)
    _audited(_sequential)
    assert compiles[2:] == []  # plain and fpaudit load what fpaudit's compile cached


def test_the_same_graph_under_other_module_names_is_named_as_its_own_model(
    compiles: list[str],
) -> None:
    # Inductor's cache key holds the graph's code, not the module names in its metadata:
    # both models share the backward's cache entry, never fpaudit's plan of it
    sequential, _, _ = _audited(_sequential)
    named, _, net = _audited(Named)
    assert compiles.count("backward") == 2  # the second one planned anew
    names = {name for name, _ in net.named_modules() if name}
    assert set(_stored(named)["module"]) <= names
    assert {"fc_in", "fc_out"} <= set(_stored(named)["module"])
    assert {"0", "2"} <= set(_stored(sequential)["module"])


# -- the plan store: a plan is recalled only for the code and names it was made for ------
PLAN = BackwardPlan(
    ("buf1", "buf4"),
    (
        CompiledSite(GraphModulePath("fc_in", False), "aten.mm.default", True),
        CompiledSite(GraphModulePath("act", True), "aten.mul.Tensor", True),
    ),
    {GraphModulePath("act", True): ("aten.erf.default",)},
    ("a compiled backward's buffer buf7 could not be read (...): its values are not observed",),
)


@pytest.fixture
def cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path / compiled_plans.FOLDER


def test_a_plan_is_recalled_for_its_key_code_and_module_names_only(cache_folder: Path) -> None:
    graph = compile_internals.CachedGraph("fkey", "code-digest")
    compiled_plans.remember(graph, "stacks", PLAN)
    assert compiled_plans.recall(graph, "stacks") == PLAN
    assert compiled_plans.recall(compile_internals.CachedGraph("fkey", "other"), "stacks") is None
    assert (
        compiled_plans.recall(compile_internals.CachedGraph("other", "code-digest"), "stacks")
        is None
    )
    assert compiled_plans.recall(graph, "other stacks") is None


def test_a_damaged_or_foreign_plan_file_is_not_recalled(cache_folder: Path) -> None:
    graph = compile_internals.CachedGraph("fkey", "code-digest")
    compiled_plans.remember(graph, "stacks", PLAN)
    [path] = cache_folder.glob("*.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # cut short
    assert compiled_plans.recall(graph, "stacks") is None
    for damaged in (
        text.replace('"format": 1', '"format": 2'),
        text.replace('"buf4"', "4"),
        text.replace('"names": ["buf1", "buf4"]', '"names": ["buf1"]'),  # a site without a name
        "[]",
    ):
        path.write_text(damaged)
        assert compiled_plans.recall(graph, "stacks") is None, damaged


def test_a_plan_that_cannot_be_kept_is_not_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    (tmp_path / compiled_plans.FOLDER).write_text("")  # the plans' folder is a file
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    graph = compile_internals.CachedGraph("fkey", "code-digest")
    compiled_plans.remember(graph, "stacks", PLAN)  # not kept, nothing raised
    assert compiled_plans.recall(graph, "stacks") is None
