"""Origins of inf/NaN (scan --origins, show --origins): the rule pinned by tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from fpaudit.capture.audit import audit
from fpaudit.numerics.formats import get_format
from fpaudit.report.store import Report
from fpaudit.rules import origins

FP16 = get_format("fp16")


class Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


class Sum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


class MatMul(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((4, 4), value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class InfMinusInf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Exp()
        self.b = Exp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) - self.b(x)


class Scale(nn.Module):
    """y = x * w: backward multiplies the incoming gradient by w."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((4,), value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def run_once(model: nn.Module, x: torch.Tensor, loss_scale: float = 1.0) -> Report:
    """One audited step with origins: forward recorded, backward seeded with S."""
    x = x.detach().requires_grad_(True)
    with audit(model, loss_scale=loss_scale, origins=True) as session:
        with session.forward_pass():
            loss = model(x).float().sum()
        torch.autograd.backward(loss, grad_tensors=torch.full_like(loss, loss_scale))
        session.step(loss=loss)
    report = session.report
    assert report.origins is not None
    return report


def blamed(report: Report) -> list[tuple[str, str, str]]:
    assert report.origins is not None
    found = origins.live(report.origins).origins
    return list(zip(found["phase"], found["module"], found["op"], strict=True))


def test_inf_from_exp_is_blamed_on_exp_in_forward() -> None:
    # fp16: exp(12) = 162755 > 65504 -> inf; the input 12 is finite
    model = nn.Sequential(Exp()).half()
    report = run_once(model, torch.full((2, 4), 12.0, dtype=torch.float16))
    assert blamed(report)[0] == ("forward", "0", "aten.exp.default")
    first = origins.live(report.origins).origins.iloc[0]  # type: ignore[arg-type]
    assert first["nonfinite"] == 8 and first["largest_finite_input"] == 12.0


def test_inf_from_a_matmul_is_blamed_on_the_matmul() -> None:
    # 4 terms of 128 * 128 = 16384 each: 65536 > 65504 -> inf in fp16 (mm)
    model = nn.Sequential(MatMul(128.0)).half()
    report = run_once(model, torch.full((2, 4), 128.0, dtype=torch.float16))
    assert blamed(report)[0] == ("forward", "0", "aten.mm.default")


def test_inf_from_a_sum_is_blamed_on_the_sum() -> None:
    # 70000 ones, each finite, sum to 70000 > 65504 -> inf in fp16
    model = nn.Sequential(Sum()).half()
    report = run_once(model, torch.ones(70000, dtype=torch.float16))
    assert blamed(report)[0] == ("forward", "0", "aten.sum.default")


def test_nan_from_inf_minus_inf_is_propagation_not_an_origin() -> None:
    model = InfMinusInf().half()
    report = run_once(model, torch.full((4,), 12.0, dtype=torch.float16))
    assert report.origins is not None
    # exp(12) overflows in both branches: two origins; inf - inf = NaN is carried
    assert blamed(report) == [
        ("forward", "a", "aten.exp.default"),
        ("forward", "b", "aten.exp.default"),
    ]
    table = report.origins
    sub = table[table["op"] == "aten.sub.Tensor"]
    assert len(sub) == 1 and bool(sub["inputs_nonfinite"].iloc[0]) and sub["nonfinite"].iloc[0]
    result = origins.live(table)
    assert int(result.propagation["op_calls"].sum()) >= 1  # the sub, and what follows it


def test_backward_overflow_is_blamed_on_the_backward_op() -> None:
    # forward: 1 * 4 = 4, fine. Backward at S = 2**15: the gradient of x is S * w =
    # 32768 * 4 = 131072 > 65504 -> inf, made by MulBackward0's mul from finite inputs
    model = nn.Sequential(Scale(4.0)).half()
    x = torch.ones(4, dtype=torch.float16, requires_grad=True)
    report = run_once(model, x, loss_scale=2.0**15)
    origin = blamed(report)
    assert origin[0] == ("backward", "0", "aten.mul.Tensor")
    assert all(phase == "backward" for phase, _, _ in origin)


def test_a_finite_run_has_no_origins_and_predicts_the_same_op_at_a_scale() -> None:
    # fp32 reference of the backward case: S * 4 reaches 65520 at S >= 16380; at
    # S = 2**14 = 16384: 16384 * 4 = 65536 >= 65520 -> predicted origin; at 2**13: 32768, no.
    model = nn.Sequential(Scale(4.0))
    x = torch.ones(4, requires_grad=True)
    report = run_once(model, x)
    assert report.origins is not None
    assert blamed(report) == []
    at_14 = origins.predicted(report.origins, FP16, 2.0**14)
    first = at_14[at_14["first"]].iloc[0]
    assert (first["phase"], first["module"], first["op"]) == ("backward", "0", "aten.mul.Tensor")
    assert first["value_at_scale"] == 65536.0
    assert origins.predicted(report.origins, FP16, 2.0**13).empty
    # and the live fp16 run at 2**15 blames the same op (test above): prediction agrees
    live = run_once(nn.Sequential(Scale(4.0)).half(),
                    torch.ones(4, dtype=torch.float16, requires_grad=True), 2.0**15)  # fmt: skip
    assert blamed(live)[0] == (first["phase"], first["module"], first["op"])


def test_origins_survive_a_write_and_older_reports_have_none(tmp_path: Path) -> None:
    report = run_once(nn.Sequential(Exp()).half(), torch.full((2, 4), 12.0, dtype=torch.float16))
    report.write(tmp_path / "r")
    again = Report.read(tmp_path / "r")
    assert again.origins is not None
    pd.testing.assert_frame_equal(
        again.origins.reset_index(drop=True),
        report.origins.reset_index(drop=True),
        check_dtype=False,  # strings read back as pandas' string dtype
    )
    with audit(nn.Linear(2, 2)) as session:
        nn.Linear(2, 2)(torch.ones(2)).sum().backward()
        session.step()
    plain = session.report
    plain.write(tmp_path / "plain")
    assert Report.read(tmp_path / "plain").origins is None
    assert json.loads((tmp_path / "plain" / "meta.json").read_text())["files"].keys() == {
        "records.parquet",
        "bins.parquet",
        "steps.parquet",
    }


def test_show_origins_text_json_and_a_report_without_them(cli, tmp_path: Path) -> None:
    from ..conftest import one_error_line

    report = run_once(nn.Sequential(Exp()).half(), torch.full((2, 4), 12.0, dtype=torch.float16))
    report.write(tmp_path / "r")
    text = cli("show", tmp_path / "r", "--origins")
    assert text.code == 0, text.stderr
    assert "aten.exp.default" in text.stdout and "propagation" in text.stdout
    data = json.loads(cli("show", tmp_path / "r", "--origins", "--json").stdout)
    assert [(o["phase"], o["module"], o["op"]) for o in data["origins"]] == [
        ("forward", "0", "aten.exp.default")
    ]
    assert data["origins"][0]["nonfinite"] == 8 and data["predicted"]["scale"] == 1.0
    with audit(nn.Linear(2, 2)) as session:
        nn.Linear(2, 2)(torch.ones(2)).sum().backward()
        session.step()
    session.report.write(tmp_path / "plain")
    assert "--origins" in one_error_line(cli("show", tmp_path / "plain", "--origins"))


class MaskedScores(nn.Module):
    """Attention-like scores masked three ways Hugging Face does, then a matmul that
    overflows fp16: masked_fill(-inf), where(mask, x, -inf) (aten.scalar_tensor) and a
    full(-inf) mask made triangular and added."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.proj = MatMul(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x @ x.T  # (2, 2)
        causal = torch.ones(2, 2, dtype=torch.bool).triu(1)
        masked = scores.masked_fill(causal, float("-inf"))
        masked = torch.where(causal, float("-inf"), masked)
        masked = masked + torch.full_like(scores, float("-inf")).triu(1)
        return self.proj(torch.softmax(masked, dim=-1) @ x)


def deliberate_ops(report: Report) -> list[str]:
    assert report.origins is not None
    return list(origins.live(report.origins).deliberate["op"])


def test_masked_minus_inf_is_deliberate_and_the_overflowing_matmul_is_the_origin() -> None:
    # scores of x = 1 (2x4): 4 each, masked to -inf above the diagonal; softmax rows are
    # finite (1, 0) and (0.5, 0.5); @ x = ones; the proj's 4 terms of 1 * 2**14 = 65536
    # > 65504 -> inf in fp16 (checked with torch below): the only origin
    x = torch.ones(2, 4, dtype=torch.float16)
    oracle = torch.ones(2, 4, dtype=torch.float16) @ torch.full((4, 4), 2.0**14).half()
    assert torch.isinf(oracle).all()
    report = run_once(MaskedScores(2.0**14).half(), x)
    forward = [origin for origin in blamed(report) if origin[0] == "forward"]
    assert forward == [("forward", "proj", "aten.mm.default")] == blamed(report)[:1]
    assert deliberate_ops(report) == [
        "aten.masked_fill.Scalar",
        "aten.scalar_tensor.default",
        "aten.full_like.default",
    ]
    # the step's first non-finite forward op (scan's summary) follows the same rule
    assert list(report.steps["first_nonfinite"]) == ["proj aten.mm.default"]


def test_a_finite_run_with_masks_has_no_origin_and_no_first_nonfinite_op() -> None:
    # the same masks and a proj of 1s: 4 terms of 1 -> 4, finite; the loss is finite
    report = run_once(MaskedScores(1.0).half(), torch.ones(2, 4, dtype=torch.float16))
    assert blamed(report) == [] and len(deliberate_ops(report)) == 3
    assert list(report.steps["first_nonfinite"]) == [""]
    assert report.origins is not None
    assert origins.predicted(report.origins, FP16, 1.0).empty  # masks are never predicted


class Cast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half().float()


def test_a_finfo_sentinel_cast_is_deliberate_a_real_cast_overflow_is_an_origin() -> None:
    # finfo(float32).min cast to fp16 is -inf by design (a mask); 1e5 cast to fp16 is
    # inf because 1e5 > 65520 (round to nearest even): a real overflow of the cast
    sentinel = torch.full((4,), torch.finfo(torch.float32).min)
    assert torch.isinf(sentinel.half()).all() and torch.isinf(torch.tensor(1e5).half())
    report = run_once(nn.Sequential(Cast()), sentinel)
    assert blamed(report) == [] and deliberate_ops(report) == ["aten._to_copy.default"]
    assert list(report.steps["first_nonfinite"]) == [""]
    report = run_once(nn.Sequential(Cast()), torch.full((4,), 1e5))
    assert blamed(report) == [("forward", "0", "aten._to_copy.default")]
    assert list(report.steps["first_nonfinite"]) == ["0 aten._to_copy.default"]


class InPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1).mul_(1000.0)


def test_an_in_place_overflow_is_the_first_nonfinite_op() -> None:
    # (x * 1) = 100, then in place * 1000 = 1e5 > 65504 -> inf: the in-place mul's target
    # held 100 before it ran, so the op made the inf from finite inputs
    report = run_once(nn.Sequential(InPlace()).half(), torch.full((4,), 100.0).half())
    assert blamed(report) == [("forward", "0", "aten.mul_.Tensor")]
    assert list(report.steps["first_nonfinite"]) == ["0 aten.mul_.Tensor"]


def test_the_rule_on_an_older_table_reads_ops_and_sentinels_only() -> None:
    # origins tables of every schema version carry op and amax columns: the rule needs
    # nothing else
    table = origins.table_from_columns(
        {
            "step": [0, 0, 0], "sequence": [1, 2, 3], "phase": ["forward"] * 3,
            "module": ["a", "a", "b"], "node": [""] * 3,
            "op": ["aten.full.default", "aten._to_copy.default", "aten.mm.default"],
            "output": [0] * 3, "dtype": ["float16"] * 3, "scales_with_loss": [False] * 3,
            "loss_scale": [1.0] * 3, "elements": [4] * 3, "nonfinite": [4, 4, 1],
            "amax": [0.0, 0.0, 3.0], "inputs_nonfinite": [False] * 3,
            "input_amax_scaled": [0.0, float(torch.finfo(torch.float32).max), 0.0],
            "input_amax_fixed": [0.0, 0.0, 300.0],
        }
    )  # fmt: skip
    found = origins.live(table)
    assert list(found.origins["op"]) == ["aten.mm.default"]
    assert list(found.deliberate["op"]) == ["aten.full.default", "aten._to_copy.default"]
