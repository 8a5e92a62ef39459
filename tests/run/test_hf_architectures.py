"""Issue 24: scan, gate and fp16-plan give one consistent answer on real architectures.

Hugging Face Llama (with gradient checkpointing, as a user tried it), GPT-2 and BERT,
each built from a tiny config (nothing downloaded), scanned in fp32 for one step. Each
has a known answer for the recommended scale; the gate passes at it (values that no
loss scale fixes are reported apart, not hidden); fp16-plan's scale either equals the
recommendation or says why, and judges underflow by the same rule as the gate.
(That the predictions at a scale are what a real backward seeded with 2**k gives, and
that Llama's RMSNorm values overflow fp16 at every real scale, is tests/rules/test_scale_oracle.py.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fpaudit.report.store import Report
from fpaudit.rules import gating
from fpaudit.rules.gating import gate
from fpaudit.rules.recommendation import recommend
from fpaudit.run import fp16plan
from fpaudit.run.scan import ScanOptions, scan

from ..conftest import MODELS, SAMPLES

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs Hugging Face transformers: pip install 'fpaudit[huggingface]'",
)

LLAMA = MODELS / "hf_llama.py"
NORMS = [
    "model.layers.0.input_layernorm",
    "model.layers.0.post_attention_layernorm",
    "model.layers.1.input_layernorm",
    "model.layers.1.post_attention_layernorm",
    "model.norm",
]
# model file -> (recommended log2 S at 4 headroom bits, its limiting module), measured
# on one fp32 step (seed 0) and pinned
KNOWN = {
    "hf_llama": (LLAMA, 10, "model.layers.0.input_layernorm"),
    "hf_gpt2": (SAMPLES / "hf_gpt2.py", 15, "transformer.h.0.attn.c_proj"),
    "hf_bert": (SAMPLES / "hf_bert.py", 14, "bert.embeddings.word_embeddings"),
}

_reports: dict[str, Report] = {}


def scanned(name: str) -> Report:
    """One fp32 step with forward values (fp16-plan needs them), scanned once per session."""
    if name not in _reports:
        path = KNOWN[name][0]
        report = scan(path, ScanOptions(steps=1, forward=True, seed=0, device="cpu"))
        report.update_info(model_file=str(path))
        _reports[name] = report
    return _reports[name]


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_the_gate_passes_at_the_scale_scan_recommends(name: str) -> None:
    report = scanned(name)
    _, log2_scale, limiter = KNOWN[name]
    rec = recommend(report, "fp16")
    assert (rec.log2_scale, rec.limiting_module) == (log2_scale, limiter)
    result = gate(report, "fp16", 0.01)
    assert result.passed, result.reasons
    assert (result.log2_scale, result.scale_source) == (log2_scale, "recommended")
    # the gate and the recommendation judge the same values by the same rule
    assert result.underflow_fraction == rec.underflow_fraction
    assert (result.unscalable_overflow, result.unscalable_underflow) == (
        rec.unscalable_overflow,
        rec.unscalable_underflow,
    )


def test_llama_rmsnorm_values_that_overflow_at_every_scale_are_apart_not_hidden() -> None:
    report = scanned("hf_llama")
    rec = recommend(report, "fp16")
    # rsqrt(var + eps) ** 3 of the five RMSNorms, one value per token (4 x 32 = 128 per
    # norm, 640 in all), computed from forward values alone; 128 + 113 + 109 + 66 + 64 =
    # 480 of them pass 65504 (amax 1.6e5..2.2e5), so they overflow fp16 at every S
    assert rec.unscalable_overflow == 480 and rec.unscalable_underflow == 0
    assert [group.to_dict() for group in rec.unscalable] == [
        {"node": "RsqrtBackward0", "op": "aten.pow.Tensor_Scalar", "underflow": 0,
         "overflow": 480, "modules": NORMS},
    ]  # fmt: skip
    # shown by the gate, and judged when asked to
    strict = gate(report, "fp16", 0.01, fail_unscalable=True, per_module=True)
    assert not strict.passed
    unscalable = [f.subject for f in strict.failures if gating.UNSCALABLE in f.kinds]
    assert unscalable == [*NORMS, gating.OVERALL]
    # (per module, the q_proj layers also lose more than 1% to underflow at 2**10)


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_fp16_plan_agrees_with_scan_and_gate_or_says_why(name: str) -> None:
    report = scanned(name)
    log2_scale = KNOWN[name][1]
    plan = fp16plan.plan_from_report(report)
    assert plan.recommended_log2_scale == log2_scale  # the scan's scale, carried along
    assert plan.growth_interval == 2000  # 1/(N + 1) < 0.05%, never 2 on a short sample
    assert plan.log2_scale is not None
    if plan.log2_scale != log2_scale:
        why = plan.scales_differ_because()
        assert why is not None and why.startswith("recommend keeps 4 bits of headroom")
    # at the plan's scale only modules the plan keeps out of fp16 overflow
    per_module = gate(report, "fp16", plan.max_underflow, log2_scale=plan.log2_scale,
                      per_module=True)  # fmt: skip
    overflowing = {f.subject for f in per_module.failures if gating.OVERFLOW in f.kinds}
    assert overflowing - {gating.OVERALL} <= set(plan.keep_out), overflowing
    if not plan.keep_out:  # the same values, the same rule: the same verdict and underflow
        at_plan = gate(report, "fp16", plan.max_underflow, log2_scale=plan.log2_scale)
        assert at_plan.passed, at_plan.reasons
        assert plan.underflow_fraction == at_plan.underflow_fraction


def test_llama_plan_keeps_out_the_norms_that_limit_the_recommendation() -> None:
    plan = fp16plan.plan_from_report(scanned("hf_llama"))
    # the norms' loss-scaled amax 3.87 * 2**19 passes 65504 / 2: they must leave fp16
    # at the plan's larger scale, and the plan says that is why its S is not 2**10
    assert plan.keep_out == NORMS
    why = plan.scales_differ_because()
    assert why is not None
    assert "recommend's S is limited by model.layers.0.input_layernorm" in why


def test_scan_and_gate_print_the_values_apart(cli, tmp_path: Path) -> None:
    path = tmp_path / "llama"
    scanned("hf_llama").write(path)
    rec = cli("recommend", path)
    assert rec.code == 0, rec.stderr
    assert (
        "  Apart: 480 value(s) overflow fp16 at every scale: RsqrtBackward0 (pow.Tensor_Scalar) "
        "in 5 module(s): model.layers.0.input_layernorm, "
        "model.layers.0.post_attention_layernorm and 3 more."
    ) in rec.stdout
    passed = cli("gate", path, "--max-underflow", "0.01")
    assert passed.code == 0 and passed.stdout.startswith(
        "PASS: fp16 at S = 2^10 = 1024 (recommended)"
    )
    assert "  Apart: 480 value(s) overflow at every scale" in passed.stdout
    strict = cli("gate", path, "--max-underflow", "0.01", "--fail-unscalable")
    assert strict.code == 1
    assert "which fails the gate with --fail-unscalable" in strict.stdout


@pytest.mark.slow
def test_llama_fp16_plan_verifies_at_its_scale_and_names_the_scans() -> None:
    """The whole command: scan, plan, verify by running one fp16-autocast step."""
    plan = fp16plan.fp16_plan(LLAMA, steps=1, device="cpu", seed=0)
    assert plan.passed, plan.notes
    assert plan.recommended_log2_scale == 10 and plan.growth_interval == 2000
    assert plan.log2_scale is not None and plan.log2_scale > 10
    assert plan.scales_differ_because() is not None
    assert plan.unscalable_overflow == 480
