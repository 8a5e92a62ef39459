"""torch.compile: what Inductor's compiled backward stores is what is counted.

Twins: a model file returning ``torch.compile(net)`` against its eager twin (the same
net, same seed and batches); the compiled run's own plain twin (``torch.compile`` with
no fpaudit) for bit identity. Dynamo's counters say how many graphs were compiled,
how many graph breaks and recompilations there were. Compiling is slow: each fixture
compiles once per module, and the models are tiny.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import fpaudit
from fpaudit.capture import compiled
from fpaudit.capture.clock import model_name
from fpaudit.report.records import KIND_BACKWARD, KIND_GRAD
from fpaudit.report.store import Report
from fpaudit.rules import gating
from fpaudit.run.scan import ScanOptions, scan
from tests.conftest import MODELS
from tests.reports import bins_per_module

MODEL_FILE = MODELS / "compiled_transformer.py"
STEPS = 3


def _reset_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture(scope="module")
def scans() -> Iterator[dict[str, Any]]:
    """The model file scanned eager (its twin) and compiled, with Dynamo's counters."""
    saved = os.environ.get("FPAUDIT_COMPILED")
    try:
        os.environ["FPAUDIT_COMPILED"] = "eager"
        eager = scan(MODEL_FILE, ScanOptions(steps=STEPS, seed=0))
        os.environ.pop("FPAUDIT_COMPILED")
        _reset_dynamo()
        compiled_report = scan(MODEL_FILE, ScanOptions(steps=STEPS, seed=0))
        seen = {
            "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values()),
        }
        yield {"eager": eager, "compiled": compiled_report, "counters": seen}
    finally:
        if saved is None:
            os.environ.pop("FPAUDIT_COMPILED", None)
        else:
            os.environ["FPAUDIT_COMPILED"] = saved
        _reset_dynamo()


def test_modules_keep_the_models_own_names(scans: dict[str, Any]) -> None:
    compiled_report: Report = scans["compiled"]
    modules = set(compiled_report.records["module"])
    assert not any("_orig_mod" in m for m in modules), modules
    assert set(compiled_report.info.modules) == set(scans["eager"].info.modules)
    assert model_name("_orig_mod.blocks.0.fc1") == "blocks.0.fc1"
    assert compiled.module_path("L['self']._modules['blocks']._modules['0'].fc1") == (
        "blocks.0.fc1"
    )


def test_parameter_gradient_counts_equal_the_eager_twins(scans: dict[str, Any]) -> None:
    """Same names, same parameters, same counts: per (module, parameter) the gradient's
    calls, elements, zeros and inf/NaN equal the eager twin's exactly. The binned values
    equal eager's where the kernels compute the same bits; where a compiled kernel rounds
    differently (the attention backward feeding qkv) a value may sit one bin over."""
    columns = ["calls", "elements", "zeros", "infs", "nans"]

    def counts(report: Report) -> dict[tuple[str, str], list[int]]:
        records = report.records
        grads = records[records["kind"] == KIND_GRAD].groupby(["module", "op"])[columns].sum()
        return {
            key: [int(v) for v in row] for key, row in zip(grads.index, grads.values, strict=True)
        }

    eager = counts(scans["eager"])
    assert len(eager) == 26  # weight and bias of 14 modules, but qkv has no bias
    assert counts(scans["compiled"]) == eager
    binned = bins_per_module(scans["compiled"], KIND_GRAD)
    same = {m for m, v in bins_per_module(scans["eager"], KIND_GRAD).items() if binned[m] == v}
    assert set(binned) - same <= {"blocks.0.qkv", "blocks.1.qkv"}


def test_every_module_with_eager_backward_values_has_compiled_ones(
    scans: dict[str, Any],
) -> None:
    """LayerNorm, GELU and attention backward (fused kernels) included; the values
    come from the compiled graph's stored buffers (node CompiledFunctionBackward)."""
    eager, compiled_report = scans["eager"].records, scans["compiled"].records
    eager_modules = set(eager[eager["kind"] == KIND_BACKWARD]["module"]) - {"<loss>"}
    stored = compiled_report[
        (compiled_report["kind"] == KIND_BACKWARD)
        & (compiled_report["node"] == compiled.COMPILED_NODE)
    ]
    assert {"blocks.0.ln1", "blocks.1.act", "blocks.0"} <= eager_modules
    assert eager_modules <= set(stored["module"])
    info = scans["compiled"].info.compiled
    assert info is not None and info.observed_backward_runs == STEPS
    assert info.not_covered == ()
    # GELU's backward (erf, exp) is computed in registers of a fused kernel
    assert {"aten.erf.default", "aten.exp.default"} <= set(info.fused_away["blocks.0.act"])


def test_one_graph_no_graph_break_no_recompilation(scans: dict[str, Any]) -> None:
    assert scans["counters"] == {"graph_breaks": 0, "unique_graphs": 1, "recompiles": 0}


def test_gate_judges_the_compiled_report(scans: dict[str, Any]) -> None:
    result = gating.gate(scans["compiled"], "fp16", 1.0)
    assert gating.NOTHING_MEASURED not in {c for f in result.failures for c in f.kinds}


# -- bit identity: the audit changes nothing the compiled code computes ---------------
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.ln(x))))


def _train(model: nn.Module, params: nn.Module, audited: bool) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(params.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=generator)
        optimizer.zero_grad()
        if audited and step % 2 == 0:  # open, closed, open: no recompilation either way
            with fpaudit.audit(model) as audit:
                loss = model(x).square().mean()
                loss.backward()
                audit.step(loss)
        else:
            model(x).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in params.parameters()]


def test_parameters_after_steps_are_bit_identical_with_and_without_the_audit() -> None:
    _reset_dynamo()
    torch.manual_seed(4)
    plain_net = Small()
    torch.manual_seed(4)
    audited_net = Small()
    plain = _train(torch.compile(plain_net), plain_net, audited=False)
    _reset_dynamo()
    model = compiled.compile(audited_net)
    after = _train(model, audited_net, audited=True)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    _reset_dynamo()
    for a, b in zip(plain, after, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


# -- extern kernels: equal to eager's where their inputs are equal ----------------------
def test_a_matmul_in_the_compiled_backward_equals_eagers() -> None:
    """loss = sum(fc(x) * c): the weight gradient is the one mm c^T @ x, of inputs that
    are the same in both modes (the batch, the constant c)."""
    x = torch.randn(32, 8)
    c = torch.randn(32, 16)

    def make() -> nn.Module:
        torch.manual_seed(6)
        return nn.Sequential(nn.Linear(8, 16, bias=False))

    def mm(report: Report) -> Any:
        records = report.records
        rows = records[(records["kind"] == KIND_BACKWARD) & (records["op"] == "aten.mm.default")]
        assert len(rows) == 1
        return rows

    eager_model = make()
    with fpaudit.audit(eager_model) as audit:
        (eager_model(x) * c).sum().backward()
        audit.step()
    eager = audit.report
    _reset_dynamo()
    model = compiled.compile(make())
    with fpaudit.audit(model) as audit:
        (model(x) * c).sum().backward()
        audit.step()
    _reset_dynamo()
    for report in (eager, audit.report):
        assert mm(report)["module"].tolist() == ["0"]
        assert mm(report)["elements"].tolist() == [16 * 8]
    assert mm(audit.report)["node"].tolist() == [compiled.COMPILED_NODE]
    assert (
        bins_per_module(audit.report, KIND_BACKWARD)["0"]
        == (bins_per_module(eager, KIND_BACKWARD)["0"])
    )


# -- an fp16 overflow that exists in one mode only ---------------------------------------
class Rescale(nn.Module):
    """In fp16: y = ((w * 2**-10) * 2**8) * 2**8 * x. Backward of the three scalings:
    eager rounds each intermediate gradient to fp16, the compiled backward fuses them in
    one kernel (fp32 registers) and stores only the result."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(64, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((self.w * 2.0**-10) * 2.0**8) * 2.0**8 * x


class Overflowing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Rescale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x)


def test_an_overflow_only_eager_has_is_caught_in_eager_and_not_compiled() -> None:
    """x = 2**8, seed 1: dL/dy = 1, times x: 2**8 (fp16, finite). Eager's next gradient
    2**8 * 2**8 = 2**16 > 65504 is inf in fp16, and so is every one after it: the
    parameter gradient is inf. Compiled: 2**8 * 2**8 * 2**8 * 2**-10 = 2**14 is computed
    in fp32 registers and stored as fp16 16384.0, finite; no stored value overflows,
    and the report names the ops kept in registers."""
    x = torch.full((64,), 2.0**8, dtype=torch.float16)

    def run(model: nn.Module) -> Report:
        with fpaudit.audit(model) as audit:
            model(x).sum().backward()
            audit.step()
        return audit.report

    eager = run(Overflowing())
    _reset_dynamo()
    net = Overflowing()
    compiled_report = run(compiled.compile(net))
    _reset_dynamo()
    assert net.scale.w.grad is not None
    assert net.scale.w.grad.tolist() == [16384.0] * 64
    eager_records = eager.records[eager.records["module"] == "scale"]
    compiled_records = compiled_report.records[compiled_report.records["module"] == "scale"]
    assert int(eager_records["infs"].sum()) > 0  # caught where it happens
    assert int(compiled_records["infs"].sum()) == 0
    assert set(compiled_records["dtype"]) == {"float16"}  # the dtype it stores
    info = compiled_report.info.compiled
    assert info is not None and "aten.mul.Tensor" in info.fused_away["scale"]


def test_gate_finds_a_compiled_report_that_observed_nothing_measured_nothing() -> None:
    """Inductor hides backward values in fused kernels: a report of an Inductor-compiled
    model with no observed compiled backward measured nothing, whatever else it holds.
    Another backend's aten ops (aot_eager) are captured as eager ones: its not-covered
    line is said, and the values are judged."""
    from fpaudit.report.runinfo import CompiledInfo
    from tests.reports import report_from

    def nothing(report: Report) -> list[gating.Failure]:
        failures = gating.gate(report, "fp16", 1.0).failures
        return [f for f in failures if gating.NOTHING_MEASURED in f.kinds]

    report = report_from({"fc": torch.tensor([1.0, 2.0**-3])})  # values, but eager's
    assert nothing(report) == []
    aot_eager = "'' is compiled with backend 'aot_eager': ..."
    report.update_info(compiled=CompiledInfo(inductor=False, not_covered=(aot_eager,)))
    assert nothing(report) == []
    line = "'' is compiled with Inductor outside fpaudit.compile: ..."
    report.update_info(compiled=CompiledInfo(inductor=True, not_covered=(line,)))
    failures = nothing(report)
    assert len(failures) == 1
    assert line in str(failures[0].reason)


# -- fpaudit run: a script that calls torch.compile -----------------------------------
def test_run_audits_a_scripts_compiled_backward_from_the_first_step(tmp_path: Any) -> None:
    """The script's own torch.compile goes through fpaudit's backend; every captured
    step, the first included (compiled inside it), has the compiled backward's stored
    values under the model's names; the parameters equal a plain python run's bit for
    bit (the same torch.compile, without fpaudit)."""
    import runpy
    import sys

    from fpaudit.run.training import RunOptions, run_script

    script = MODELS.parent / "scripts" / "train_compiled.py"
    _reset_dynamo()
    saved = sys.argv
    sys.argv = [str(script), "--params", str(tmp_path / "plain.pt")]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    _reset_dynamo()
    outcome = run_script(
        script, ["--params", str(tmp_path / "audited.pt")], RunOptions(capture_every=1)
    )
    _reset_dynamo()
    assert outcome.failure is None
    report = outcome.report
    stored = report.records[report.records["node"] == compiled.COMPILED_NODE]
    assert sorted(set(stored["step"])) == [0, 1, 2]
    assert {"0", "1", "2", "3"} <= set(stored["module"])  # LayerNorm, Linear, GELU, Linear
    info = report.info.compiled
    assert info is not None and info.observed_backward_runs == 3
    plain = torch.load(tmp_path / "plain.pt")
    audited = torch.load(tmp_path / "audited.pt")
    for a, b in zip(plain, audited, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


# -- scan --compile --------------------------------------------------------------------
def test_scan_compile_counts_the_stored_gradient_exactly_as_eager(cli, tmp_path: Any) -> None:
    """known_grads.py: the backward of sum(w * c) stores dL/dw = 1 * c, every edge value
    (ties, signed zeros, fp32 subnormals) exactly as eager makes it. `scan --compile`
    bins it under the model's name, probe, exactly as the eager scan does."""
    model_file = MODELS / "known_grads.py"
    _reset_dynamo()
    eager_out, compiled_out = tmp_path / "eager", tmp_path / "compiled"
    assert cli("scan", model_file, "--steps", "1", "--out", eager_out).code == 0
    result = cli("scan", model_file, "--compile", "--steps", "1", "--out", compiled_out)
    _reset_dynamo()
    assert result.code == 0, result.stderr
    compiled_report, eager = Report.read(compiled_out), Report.read(eager_out)
    records = compiled_report.records
    stored = records[(records["node"] == compiled.COMPILED_NODE)]
    assert set(stored["module"]) == {"probe"}
    assert compiled_report.info.compiled is not None
    assert compiled_report.info.compiled.observed_backward_runs == 1
    assert (
        bins_per_module(compiled_report, KIND_BACKWARD)["probe"]
        == (bins_per_module(eager, KIND_BACKWARD)["probe"])
    )
