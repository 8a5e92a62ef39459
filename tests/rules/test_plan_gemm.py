"""`plan` models the recipes as frameworks apply them: only the operands of matrix
multiplies of modules that own a weight (a Linear's input, weight and output gradient)
are quantized, so only those modules are candidates, judged on those operands.

Oracles: a twin Linear (no hooks) that hands torchao's ``to_mx`` exactly the tensors a
torchao MX Linear quantizes in backward, and the module types of real Hugging Face
models built from configs (which modules are ``nn.Linear``/``Conv1D``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fpaudit
from fpaudit.report.store import Report
from tests.conftest import MODELS

HF = MODELS / "hf_arch.py"
COUNTS = ("zero", "flushed", "subnormal", "normal", "saturated")


class _TwinLinearFunction(torch.autograd.Function):
    """y = x @ w.T + b, whose backward hands each GEMM operand, with its contraction
    dimension last, to ``seen`` before it multiplies: the dgrad GEMM dX = dY @ W reads
    dY along the output features and W along its rows (W.T); the wgrad GEMM
    dW = dY.T @ X reads dY.T and X.T along the tokens (torchao's MXLinear quantizes
    grad_output, weight and input this way). No dgrad when x needs no gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: Any, seen: Any) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.seen = seen
        y = x @ w.t()
        return y + b if b is not None else y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = None
        if ctx.needs_input_grad[0]:
            ctx.seen += [dy2, w.t()]
            dx = (dy2 @ w).reshape(x.shape)
        ctx.seen += [x2.t(), dy2.t()]
        dw = x2.t() @ dy2
        db = dy2.sum(0) if ctx.needs_input_grad[2] else None
        return dx, dw.t(), db, None


class _TwinLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TwinLinearFunction.apply(x, self.weight, self.bias, self.seen)  # type: ignore[no-any-return]


def _block(linear: nn.Module) -> nn.Sequential:
    return nn.Sequential(linear, nn.LayerNorm(64), nn.GELU())


def test_operands_are_what_a_quantized_linear_quantizes() -> None:
    # A Linear with a bias on a 2-D batch (addmm; its input needs no gradient: no dgrad),
    # a LayerNorm and a GELU (not candidates), a bias-free Linear on a 3-D batch (mm
    # through views). Values span 2**-30..2**10 so that MX blocks flush some.
    pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao not installed")
    from tests.cli.test_blocks_cli import _padded_to_blocks
    from tests.kernels.test_blockstats_torchao import torchao_mx

    torch.manual_seed(0)
    model = nn.Sequential(_block(nn.Linear(40, 64)), nn.Linear(64, 32, bias=False))
    twin = nn.Sequential(
        _block(_TwinLinear(model[0][0])),
        _TwinLinear(model[1]),  # the same parameters
    )
    x = torch.randn(2, 8, 40) * torch.exp2(torch.randint(-30, 10, (2, 8, 40)).float())
    recipes = ["mxfp8-e4m3", "mxfp4"]
    with fpaudit.audit(model, recipes=recipes) as audit:
        loss = model(x).square().sum()
        loss.backward(torch.tensor(2.0**-10))
        audit.step(loss=loss)
    twin(x).square().sum().backward(torch.tensor(2.0**-10))
    blocks = audit.report.blocks
    assert blocks is not None
    operands = blocks[blocks["kind"] == "operand"]
    # only the two Linears own a weight: the LayerNorm's is a vector, GELU has none
    assert set(operands["module"]) == {"0.0", "1"}
    flushed = dict.fromkeys(recipes, 0)
    for module, linear in (("0.0", twin[0][0]), ("1", twin[1])):
        assert len(linear.seen) == (2 if module == "0.0" else 4)  # no dgrad for 0.0
        for recipe in recipes:
            expected = dict.fromkeys(COUNTS, 0)
            for tensor in linear.seen:
                padded, padding = _padded_to_blocks(tensor.contiguous())
                counts, _ = torchao_mx(padded, recipe)
                counts["zero"] -= padding
                for name in COUNTS:
                    expected[name] += counts[name]
            rows = operands[(operands["module"] == module) & (operands["recipe"] == recipe)]
            assert {name: int(rows[name].sum()) for name in COUNTS} == expected, (module, recipe)
            flushed[recipe] += expected["flushed"]
    # the check saw flushing (layer 0's spread input: mxfp8 306, mxfp4 1139 of 1664)
    assert all(count > 0 for count in flushed.values()), flushed


@pytest.fixture(scope="module")
def hf_reports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """One-step recipe scans of the tiny Llama, GPT-2 and BERT (tests/models/hf_arch.py)."""
    pytest.importorskip("transformers")
    from fpaudit.cli.commands import run

    out, before = {}, os.environ.get("FPAUDIT_ARCH")
    try:
        for arch in ("llama", "gpt2", "bert"):
            os.environ["FPAUDIT_ARCH"] = arch
            target = tmp_path_factory.mktemp(arch) / "report"
            args = ["scan", str(HF), "--steps", "1", "--recipe", "mxfp8-e4m3",
                    "--recipe", "mxfp8-e4m3-rceil", "--out", str(target)]  # fmt: skip
            assert run(args) == 0
            out[arch] = target
        yield out
    finally:
        if before is None:
            os.environ.pop("FPAUDIT_ARCH", None)
        else:
            os.environ["FPAUDIT_ARCH"] = before


def _gemm_modules(arch: str) -> set[str]:
    """The oracle: modules that are nn.Linear or Hugging Face's Conv1D."""
    from transformers.pytorch_utils import Conv1D

    from tests.models.hf_arch import build

    return {
        name
        for name, module in build(arch).named_modules()
        if isinstance(module, nn.Linear | Conv1D)
    }


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_plan_gives_recipes_to_gemm_modules_only(cli, hf_reports: dict[str, Path], arch: str):
    report = hf_reports[arch]
    planned = json.loads(cli("plan", report, "--max-flush", "0.001", "--json").stdout)
    candidates = {m["module"] for m in planned["modules"]}
    assert candidates == _gemm_modules(arch)
    # everything else with backward values is listed apart: norms, activations, embeddings
    backward = set(Report.read(report).info.modules) - {"<loss>"}
    assert set(planned["not_candidates"]) | candidates <= backward
    assert not set(planned["not_candidates"]) & candidates
    names = " ".join(planned["not_candidates"])
    assert "norm" in names.lower() or "ln_" in names
    # a non-empty plan at a realistic limit: the round-up rule never saturates, and at
    # most 0.1% flushed; each module kept in bf16 says what ruled it out, with no numbers
    proposed = [m for m in planned["modules"] if m["recipe"] != "bf16"]
    assert proposed
    for m in planned["modules"]:
        if m["recipe"] == "bf16":
            assert m["limiting"] and m["flush_fraction"] is None
        else:
            assert m["flush_fraction"] <= 0.001 and m["saturate_fraction"] == 0.0


def test_llama_plan_proposes_recipes_for_its_linear_layers(cli, hf_reports: dict[str, Path]):
    report = hf_reports["llama"]
    linears = _gemm_modules("llama")
    assert len(linears) == 15  # 2 layers x (q, k, v, o, gate, up, down) + lm_head
    text = cli("plan", report, "--max-flush", "0.001")
    assert text.code == 0, text.stderr
    assert "0 of 15 GEMM modules must stay in bf16." in text.stdout
    assert "Not candidates" in text.stdout and "model.layers.0.input_layernorm" in text.stdout
    planned = json.loads(cli("plan", report, "--max-flush", "0.001", "--json").stdout)
    assert {m["recipe"] for m in planned["modules"]} == {"mxfp8-e4m3-rceil"}
    # MXFP8's floor rule saturates each module's largest values: at the default
    # --max-saturate 0 it is ruled out by that limit alone, and the output says so and
    # names the round-up recipe that passes
    floor_only = cli("plan", report, "--recipe", "mxfp8-e4m3", "--max-flush", "0.001")
    assert floor_only.code == 0, floor_only.stderr
    assert "15 of 15 GEMM modules must stay in bf16" in floor_only.stdout
    out = " ".join(floor_only.stdout.split())
    assert "mxfp8-e4m3 is ruled out for every kept module by --max-saturate 0 alone" in out
    assert "--recipe mxfp8-e4m3-rceil" in out
    # a kept row shows no recipe's numbers
    rows = [line for line in floor_only.stdout.splitlines() if "lm_head" in line]
    assert rows and "bf16" in rows[0] and "%" not in rows[0].split("bf16")[1].split("│")[1]
