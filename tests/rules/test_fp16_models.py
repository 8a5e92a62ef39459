"""Decoders built from transformers configs that break in fp16 as real ones do (item 3 of
issue 16): fpaudit names the origin module and op of the first overflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fpaudit.numerics.formats import FP32
from fpaudit.report.store import Report
from fpaudit.rules import origins

from ..conftest import MODELS

pytest.importorskip("transformers", reason="needs Hugging Face transformers")
MODEL = MODELS / "fp16_breaking.py"


def scan_origins(cli, tmp_path: Path, monkeypatch, case: str, *extra: str) -> Report:
    monkeypatch.setenv("FP16_CASE", case)
    out = tmp_path / case
    result = cli("scan", MODEL, "--steps", "1", "--origins", "--out", out, *extra)
    assert result.code == 0, result.stderr
    return Report.read(out)


def first_origin(report: Report) -> tuple[str, str, str]:
    assert report.origins is not None
    found = origins.live(report.origins).origins
    assert not found.empty
    row = found.iloc[0]
    return str(row["phase"]), str(row["module"]), str(row["op"])


def test_forward_overflow_is_blamed_on_the_scaled_down_projection(cli, tmp_path, monkeypatch):
    # layer 1's down_proj output reaches ~8.3e4 in fp32 (> 65504): under fp16 autocast its
    # matmul makes the first inf; everything after it only carries it
    report = scan_origins(cli, tmp_path, monkeypatch, "forward", "--amp", "fp16")
    assert first_origin(report) == ("forward", "model.layers.1.mlp.down_proj", "aten.mm.default")
    assert len(origins.live(report.origins).origins) == 1  # type: ignore[arg-type]


def test_backward_overflow_with_a_quiet_forward(cli, tmp_path, monkeypatch):
    # forward stays below 350 (the attention mask's finfo(float32).min sentinel aside), but
    # at S = 2**16 the gradient leaving the final
    # norm's fp32 backward (4.5e5) is cast to fp16 entering layer 1's backward: inf there
    report = scan_origins(cli, tmp_path, monkeypatch, "backward", "--amp", "fp16",
                          "--loss-scale", "2^16")  # fmt: skip
    table = report.origins
    assert table is not None
    forward = table[(table["phase"] == "forward") & (table["amax"] != FP32.max_finite)]
    assert forward["amax"].max() < 350 and forward["nonfinite"].sum() == 0
    assert first_origin(report) == ("backward", "model.layers.1", "aten._to_copy.default")
    # the fp32 reference predicts a backward origin at 2**16 and none at 2**8
    reference = scan_origins(cli, tmp_path / "ref", monkeypatch, "backward")
    assert reference.origins is not None
    at_16 = origins.predicted(reference.origins, origins_format(), 2.0**16)
    assert (at_16["phase"] == "backward").any()
    assert not (origins.predicted(reference.origins, origins_format(), 2.0**8)["phase"]
                == "backward").any()  # fmt: skip


def origins_format():  # type: ignore[no-untyped-def]
    from fpaudit.numerics.formats import get_format

    return get_format("fp16")


def test_attention_backward_underflows_at_scale_one(cli, tmp_path, monkeypatch):
    from fpaudit.rules import analysis

    report = scan_origins(cli, tmp_path, monkeypatch, "attention")
    assert origins.live(report.origins).origins.empty  # type: ignore[arg-type]
    table = analysis.module_table(report, "fp16", 0).set_index("module")
    attention = table[table.index.str.endswith("self_attn")]
    assert (attention["underflow"] > 0).all() and len(attention) == 2
    # the two attention modules lose the most (about 4% each, the next module 0.5%)
    worst = table["underflow_fraction"].sort_values(ascending=False).index[:2]
    assert set(worst) == set(attention.index)
    # nothing that scales with the loss comes near 65520 at S = 1: no predicted origin
    assert origins.predicted(report.origins, origins_format(), 1.0).empty  # type: ignore[arg-type]


def test_gpt2_mask_constants_are_not_origins_the_mlp_matmul_is(cli, tmp_path):
    # the Hugging Face GPT-2: every attention's padding mask writes a -inf with
    # aten.scalar_tensor (by design), and layer 1's MLP down-projection overflows fp16
    model = MODELS / "gpt2_padded_overflow.py"
    out = tmp_path / "gpt2"
    scan = cli("scan", model, "--steps", "1", "--origins", "--amp", "fp16", "--out", out)
    assert scan.code == 0, scan.stderr
    expected = ("forward", "transformer.h.1.mlp.c_proj", "aten.addmm.default")
    assert (
        "The first forward op to produce inf or NaN: transformer.h.1.mlp.c_proj "
        "aten.addmm.default." in scan.stdout
    )
    report = Report.read(out)
    assert first_origin(report) == expected
    found = origins.live(report.origins)  # type: ignore[arg-type]
    assert not found.origins["module"].str.endswith(".attn").any()
    first = found.origins.iloc[0]
    # the oracle: the same addmm in plain fp16 torch, on the model's own weights
    assert first["largest_finite_input"] > 1e4 and first["nonfinite"] > 0
    deliberate = list(zip(found.deliberate["module"], found.deliberate["op"], strict=True))
    assert deliberate == [(f"transformer.h.{i}.attn", "aten.scalar_tensor.default")
                          for i in range(3)]  # fmt: skip
    shown = json.loads(cli("show", out, "--origins", "--json").stdout)
    first_shown = shown["origins"][0]
    assert (first_shown["phase"], first_shown["module"], first_shown["op"]) == expected
    assert len(shown["deliberate"]) == 3
    text = cli("show", out, "--origins").stdout
    assert "3 op call(s) wrote inf/NaN by design" in text
    # fp16-plan (an fp32 scan, by the same rule) keeps exactly that module out of fp16
    plan = cli("fp16-plan", model, "--json")
    assert plan.code == 0, plan.stderr
    assert json.loads(plan.stdout)["keep_out"] == ["transformer.h.1.mlp.c_proj"]
