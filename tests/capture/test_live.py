"""Live mixed precision: real autocast runs, the fp32 shadow, verify, the forward phase."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from fpaudit.numerics.formats import FORMATS, Format

from ..conftest import MODELS, SAMPLES

TINY = MODELS / "tiny_grads.py"


def _rows(cli, report: Path, *args: str) -> list[dict]:
    result = cli("show", report, "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_live_fp16_shows_real_zeros_and_the_shadow_names_the_op_that_made_them(
    cli, tmp_path: Path
) -> None:
    out = tmp_path / "live"
    assert cli("scan", TINY, "--steps", "1", "--amp", "fp16", "--shadow", "--out", out).code == 0
    rows = {(r["module"], r["node"], r["op"]): r for r in _rows(cli, out, "--by", "op")}
    cast = rows[("", "ToCopyBackward0", "aten._to_copy.default")]  # the root module
    # 1e-8 <= 2**-25: every one of the 8 x 16 values the cast makes is lost, here.
    assert cast["dtype"] == "float16" and cast["elements"] == 128
    assert cast["zeros"] == 128 and cast["lost"] == 128 and cast["lost_fraction"] == 1.0
    linear = [r for key, r in rows.items() if key[0] == "linear"]
    assert linear, rows.keys()
    for row in linear:  # the Linear's gradient ops hold real zeros, inherited: nothing lost there
        assert row["zeros"] == row["elements"] and row["lost"] == 0
    records = pd.read_parquet(out / "records.parquet")
    grads = records[records["kind"] == "grad"]
    assert (grads["zeros"] == grads["elements"]).all()  # the parameters would not learn


def test_at_the_recommended_scale_nothing_is_lost(cli, tmp_path: Path) -> None:
    fp32 = tmp_path / "fp32"
    assert cli("scan", TINY, "--steps", "1", "--out", fp32).code == 0
    rec = json.loads(cli("recommend", fp32, "--format", "fp16", "--json").stdout)
    assert rec["underflow_fraction_at_1"] > 0.5 and rec["underflow_fraction"] == 0.0
    live = tmp_path / "live"
    scale = f"2^{rec['log2_scale']}"
    assert (
        cli(
            "scan",
            TINY,
            "--steps",
            "1",
            "--amp",
            "fp16",
            "--shadow",
            "--loss-scale",
            scale,
            "--out",
            live,
        ).code
        == 0
    )
    total = json.loads(cli("show", live, "--json", "--by", "op").stdout)
    lost = sum(r["lost"] for r in total)
    assert lost == 0, [r for r in total if r["lost"]]
    records = pd.read_parquet(live / "records.parquet")
    grads = records[records["kind"] == "grad"]
    assert (grads["zeros"] < grads["elements"]).all()  # now the parameters get gradients


def test_live_recommendation_counts_only_low_precision_values(cli, tmp_path: Path) -> None:
    out = tmp_path / "live"
    assert cli("scan", SAMPLES / "mlp.py", "--steps", "1", "--amp", "bf16", "--out", out).code == 0
    rec = json.loads(cli("recommend", out, "--format", "bf16", "--json").stdout)
    assert rec["live_dtype"] == "bfloat16"
    assert (
        "Live report: only values the device held in bfloat16 count" in cli("recommend", out).stdout
    )
    tiny = tmp_path / "tiny"
    assert cli("scan", TINY, "--steps", "1", "--amp", "fp16", "--out", tiny).code == 0
    assert "no nonzero float16 backward value" in cli("recommend", tiny, "--format", "fp16").stdout


def test_shadow_needs_amp(cli, tmp_path: Path) -> None:
    from ..conftest import one_error_line

    assert "--shadow compares low-precision ops with fp32: it needs --amp" in one_error_line(
        cli("scan", TINY, "--shadow", "--out", tmp_path / "r")
    )
    assert "--amp must be one of fp16, bf16" in one_error_line(
        cli("scan", TINY, "--amp", "fp8", "--out", tmp_path / "r")
    )


def test_verify_fails_at_scale_one_and_passes_at_the_recommended_scale(cli, tmp_path: Path) -> None:
    at_1 = cli("verify", TINY, "--scale", "1", "--json")
    assert at_1.code == 1, at_1.stderr
    data = json.loads(at_1.stdout)
    assert data["passed"] is False and data["skipped"] is False
    assert data["stalled"] == ["linear.weight", "linear.bias"]
    assert all(
        p["zeroed_fraction"] == 1.0 and p["changed_fp32"] and not p["changed_mixed"]
        for p in data["parameters"]
    )
    fp32 = tmp_path / "fp32"
    assert cli("scan", TINY, "--steps", "1", "--out", fp32).code == 0
    scale = json.loads(cli("recommend", fp32, "--format", "fp16", "--json").stdout)["log2_scale"]
    recommended = cli("verify", TINY, "--scale", f"2^{scale}", "--json")
    assert recommended.code == 0, recommended.stdout
    data = json.loads(recommended.stdout)
    assert data["passed"] and all(
        p["changed_mixed"] and p["zeroed_fraction"] == 0.0 for p in data["parameters"]
    )
    assert "PASS" in cli("verify", TINY, "--scale", f"2^{scale}").stdout


def test_verify_skips_the_step_when_the_scale_overflows(cli) -> None:
    # The sample MLP's gradients are about 1e-2 .. 1: at S = 2^30 they overflow fp16 (65504).
    result = cli("verify", SAMPLES / "mlp.py", "--scale", "2^30", "--json")
    assert result.code == 1
    data = json.loads(result.stdout)
    assert data["skipped"] and not any(p["changed_mixed"] for p in data["parameters"])


def test_verify_clips_the_unscaled_gradients(cli) -> None:
    # At S = 2^10 the scaled gradient norm is about 1024 times the unscaled one. A
    # threshold between the two leaves the unscaled gradients unclipped, as in fp32; had
    # the scaled gradients been clipped, every update would shrink about 100 times.
    free = json.loads(cli("verify", SAMPLES / "mlp.py", "--scale", "2^10", "--json").stdout)
    unscaled = free["grad_norm_fp32"]
    assert abs(free["grad_norm_mixed"] - unscaled) / unscaled < 1e-2  # unscaled, not x1024
    threshold = 10 * unscaled  # above the unscaled norm, far below the scaled one
    clipped = json.loads(
        cli(
            "verify", SAMPLES / "mlp.py", "--scale", "2^10", "--clip-norm", threshold, "--json"
        ).stdout
    )
    assert clipped["passed"]
    assert max(p["update_error"] for p in clipped["parameters"]) < 0.05
    # And below the unscaled norm both steps clip, alike: the same updates as each other.
    tight = json.loads(
        cli(
            "verify", SAMPLES / "mlp.py", "--scale", "2^10", "--clip-norm", unscaled / 10, "--json"
        ).stdout
    )
    assert max(p["update_error"] for p in tight["parameters"]) < 0.05


def test_verify_bad_input(cli) -> None:
    from ..conftest import one_error_line

    assert "verify needs --scale" in one_error_line(cli("verify", TINY))
    assert "--clip-norm must be a positive number" in one_error_line(
        cli("verify", TINY, "--scale", "8", "--clip-norm", "-1")
    )
    assert "is not a power of two" in one_error_line(cli("verify", TINY, "--scale", "3"))


def test_forward_phase_names_the_op_that_first_made_inf(cli, tmp_path: Path) -> None:
    out = tmp_path / "fwd"
    result = cli("scan", MODELS / "blowup.py", "--steps", "3", "--forward", "--out", out)
    assert result.code == 0, result.stderr
    # Step 1's batch is 1e30: the Linear's output is about 1e30 (finite), its square is inf.
    assert "The first forward op to produce inf or NaN: square aten.mul.Tensor." in result.stdout
    steps = pd.read_parquet(out / "steps.parquet")
    assert list(steps["first_nonfinite"]) == ["", "square aten.mul.Tensor", ""]
    forward = _rows(cli, out, "--kind", "forward")
    assert {"linear", "square"} <= {row["module"] for row in forward}
    # forward values are their own phase: not in the backward view
    assert {row["module"] for row in _rows(cli, out)} & {"linear", "square"}


def test_live_mode_and_forward_phase_together(cli, tmp_path: Path) -> None:
    out = tmp_path / "both"
    assert (
        cli(
            "scan",
            SAMPLES / "transformer.py",
            "--steps",
            "1",
            "--amp",
            "bf16",
            "--forward",
            "--out",
            out,
        ).code
        == 0
    )
    forward = _rows(cli, out, "--kind", "forward", "--by", "op")
    assert any(
        row["dtype"] == "bfloat16" for row in forward
    )  # the autocast ops, in their real dtype


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_shadow_re_runs_every_registered_format_in_fp32(fmt: Format) -> None:
    """``--shadow`` compares each op whose output is held in a registered format with its
    fp32 re-run: a format added to numerics/formats.py is shadowed without a second list.

    Forward holds a weight in the format and computes in fp32; in backward, the cast back
    (``ToCopyBackward0``) turns the gradient into the format. The gradient is a quarter of
    the format's smallest subnormal, 2**(min_normal_exp - mantissa_bits - 2) (fp16: 2**-26,
    bf16: 2**-135, an fp32 subnormal; fp8_e4m3fn: 2**-11; fp8_e5m2: 2**-18): below the
    round-to-zero edge (half the smallest subnormal), so the cast makes 0 of every one of the
    6 values, and the fp32 re-run keeps all 6 nonzero."""
    import torch

    from fpaudit import Audit

    tiny = math.ldexp(1.0, fmt.min_normal_exp - fmt.mantissa_bits - 2)
    assert torch.tensor(tiny).to(fmt.dtype).item() == 0.0  # the oracle: torch's own cast

    class Held(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(6))

        def forward(self) -> torch.Tensor:
            return (self.weight.to(fmt.dtype).to(torch.float32) * tiny).sum()

    model = Held()
    with Audit(model, shadow=True) as audit:
        model().backward()
        audit.step()
    records = audit.report.records
    cast = records[(records["dtype"] == fmt.dtype_name) & (records["kind"] == "backward")]
    assert len(cast) == 1, records[["node", "op", "dtype"]]
    row = cast.iloc[0]
    assert row["elements"] == 6 and row["zeros"] == 6  # the device's values: all zero
    assert row["shadow_calls"] == 1 and row["shadow_nonzero"] == 6  # fp32 kept all 6
