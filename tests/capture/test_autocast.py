"""The fp16 autocast prediction of an fp32 scan (fpaudit.capture.autocast), against torch itself:
the op lists against what autocast does to each op, and the probe's per-module and
per-record prediction against a live ``scan --amp fp16`` of the same Llama."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fpaudit.capture import autocast
from fpaudit.report.store import Report
from tests.conftest import MODELS

HF = MODELS / "hf_arch.py"
Op = Callable[[torch.Tensor], torch.Tensor]


def _cube(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, 1, 2, 4, 4)


def _ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(x)


_LONG = torch.long
# One call per listed op on an fp16 input x of shape (4, 8) (a second input, where the op
# needs one, is made from x, so it is fp16 too).
SHARED: dict[str, Op] = {
    "prod": lambda x: x.prod(),
    "cdist": lambda x: torch.cdist(x, x),
    "mse_loss": lambda x: F.mse_loss(x, x * 0.5),
    "cosine_embedding_loss": lambda x: F.cosine_embedding_loss(x, x, torch.ones(4)),
    "nll_loss": lambda x: F.nll_loss(x, torch.zeros(4, dtype=_LONG)),
    "hinge_embedding_loss": lambda x: F.hinge_embedding_loss(x, _ones(x)),
    "poisson_nll_loss": lambda x: F.poisson_nll_loss(x, x.abs()),
    "smooth_l1_loss": lambda x: F.smooth_l1_loss(x, x * 0.5),
    "huber_loss": lambda x: F.huber_loss(x, x * 0.5),
    "margin_ranking_loss": lambda x: F.margin_ranking_loss(x[0], x[1], torch.ones(8)),
    "soft_margin_loss": lambda x: F.soft_margin_loss(x, _ones(x)),
    "triplet_margin_loss": lambda x: F.triplet_margin_loss(x, x * 0.5, x * 0.2),
    "multi_margin_loss": lambda x: F.multi_margin_loss(x, torch.zeros(4, dtype=_LONG)),
    "kl_div": lambda x: F.kl_div(x, x.abs(), reduction="batchmean"),
    "multilabel_margin_loss": lambda x: F.multilabel_margin_loss(x, torch.zeros(4, 8, dtype=_LONG)),
    "binary_cross_entropy_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, _ones(x)),
}
CPU: dict[str, Op] = {
    **SHARED,
    "avg_pool3d": lambda x: F.avg_pool3d(_cube(x), 2),
    "max_pool3d": lambda x: F.max_pool3d(_cube(x), 2),
    "adaptive_avg_pool3d": lambda x: F.adaptive_avg_pool3d(_cube(x), 1),
    "binary_cross_entropy": lambda x: F.binary_cross_entropy(torch.sigmoid(x), _ones(x)),
    "grid_sampler": lambda x: F.grid_sample(
        x.reshape(1, 1, 4, 8), torch.zeros(1, 2, 2, 2, dtype=x.dtype), align_corners=False
    ),
    "quantile": lambda x: torch.quantile(x.flatten(), 0.5),
    "nanquantile": lambda x: torch.nanquantile(x.flatten(), 0.5),
    "trace": lambda x: x[:, :4].trace(),
    "inverse": lambda x: torch.linalg.inv(torch.eye(4, dtype=x.dtype) + x[:, :4] * 0.01),
    "reflection_pad1d": lambda x: F.pad(x.reshape(1, 4, 8), (2, 2), mode="reflect"),
    "replication_pad1d": lambda x: F.pad(x.reshape(1, 4, 8), (2, 2), mode="replicate"),
    "ctc_loss": lambda x: F.ctc_loss(
        torch.log_softmax(x.reshape(4, 1, 8), -1),
        torch.ones(1, 2, dtype=_LONG),
        torch.tensor([4]),
        torch.tensor([2]),
    ),
    "fft_fft": lambda x: torch.fft.fft(x).real,
}
CUDA: dict[str, Op] = {
    **SHARED,
    **{name: getattr(torch, name) for name in ("acos", "asin", "cosh", "exp", "expm1", "sinh")},
    **{name: getattr(torch, name) for name in ("log", "log10", "log2", "log1p", "tan")},
    "erfinv": lambda x: torch.erfinv(x.clamp(-0.5, 0.5)),
    "reciprocal": torch.reciprocal,
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 1),
    "pow": lambda x: x.pow(2),
    "softplus": F.softplus,
    "layer_norm": lambda x: F.layer_norm(x, (8,)),
    "group_norm": lambda x: F.group_norm(x, 2),
    "norm": lambda x: torch.norm(x),
    "nuclear_norm": lambda x: torch.nuclear_norm(x),
    "cosine_similarity": lambda x: F.cosine_similarity(x, x * 0.5),
    "l1_loss": lambda x: F.l1_loss(x, x * 0.5),
    "dist": lambda x: torch.dist(x, x * 0.5),
    "pdist": F.pdist,
    "renorm": lambda x: x.renorm(2, 0, 1.0),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "cumprod": lambda x: x.cumprod(0),
    "cumsum": lambda x: x.cumsum(0),
    "sum": lambda x: x.sum(),
}
DEVICES = {"cpu": CPU, "cuda": CUDA}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_listed_op_runs_in_fp32_under_autocast(device: str) -> None:
    # The oracle is torch: each op of fpaudit's list, on fp16 inputs under
    # torch.autocast(device, float16), gives fp32; and the list is the tested list
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    calls = DEVICES[device]
    assert set(calls) == autocast.FP32_OPS[device]
    x = torch.randn(4, 8, device=device).to(torch.float16)
    with torch.autocast(device, dtype=torch.float16):
        dtypes = {name: call(x).dtype for name, call in calls.items()}
    assert {name for name, dtype in dtypes.items() if dtype != torch.float32} == set()
    # and autocast is on: a matrix multiply runs in fp16
    with torch.autocast(device, dtype=torch.float16):
        assert (x.float() @ x.float().t()).dtype == torch.float16


def test_node_and_op_names_match() -> None:
    assert autocast.node_forward_name("RsqrtBackward0") == "rsqrt"
    assert autocast.node_forward_name("ToCopyBackward0") == "to_copy"
    assert autocast.node_forward_name("LogSoftmaxBackward0") == "log_softmax"
    assert autocast.node_forward_name("seed") == ""
    assert autocast.forward_name("aten._to_copy.default") == "to_copy"
    assert autocast.forward_name("aten.nll_loss_forward.default") == "nll_loss"
    assert autocast.forward_name("aten._log_softmax.default") == "log_softmax"


def test_the_probe_leaves_the_model_as_it_was() -> None:
    pytest.importorskip("transformers")
    from tests.models.hf_arch import batches, build, loss

    model = build("llama")
    model.model.layers[0].eval()  # a mixed state: restored module by module
    flags = [m.training for m in model.modules()]
    batch = batches()[0]
    state = torch.random.get_rng_state()
    prediction = autocast.probe(model, lambda: loss(model, batch), "cpu")
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
    verdicts = autocast.module_verdicts(prediction)
    # HF's LlamaRMSNorm upcasts itself: the norms compute in fp32; the MLP's act_fn in fp16
    assert verdicts["model.norm"] == verdicts["model.layers.0.input_layernorm"] == "fp32"
    assert verdicts["model.layers.0.mlp.act_fn"] == "fp16"
    assert verdicts["lm_head"] == "mixed"  # fp16 products, fp32 gradients of its casts


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """A 1-step fp32 scan (with its prediction) and a live --amp fp16 scan of the Llama."""
    pytest.importorskip("transformers")
    from fpaudit.cli.commands import run

    before = os.environ.get("FPAUDIT_ARCH")
    os.environ["FPAUDIT_ARCH"] = "llama"
    try:
        out = []
        for amp in ([], ["--amp", "fp16"]):
            target = tmp_path_factory.mktemp("llama") / "report"
            assert run(["scan", str(HF), "--steps", "1", "--out", str(target), *amp]) == 0
            out.append(target)
        yield out[0], out[1]
    finally:
        if before is None:
            os.environ.pop("FPAUDIT_ARCH", None)
        else:
            os.environ["FPAUDIT_ARCH"] = before


def test_prediction_agrees_with_a_live_amp_scan(llama_pair: tuple[Path, Path]) -> None:
    predicted, live = (Report.read(p) for p in llama_pair)
    assert live.info.autocast is None  # a live scan needs no prediction
    prediction = predicted.info.autocast
    assert prediction is not None and prediction.device == "cpu"
    verdicts = autocast.module_verdicts(prediction)
    records = live.records[live.records["kind"] == "backward"]
    names = {"float16": "fp16", "float32": "fp32"}
    live_dtypes = records.groupby("module")["dtype"].agg(lambda s: {names[d] for d in s})
    # per module: all fp16, all fp32 or both, as the live scan recorded them (the
    # pseudo-module <loss> holds only the fp32 loss seed, which no forward op makes)
    expected = {
        module: dtypes.pop() if len(dtypes) == 1 else "mixed"
        for module, dtypes in live_dtypes.items()
        if module != "<loss>"
    }
    assert verdicts == expected
    assert sum(v == "fp32" for v in verdicts.values()) == 6  # embedding, 5 RMSNorms
    # per record: every prediction the seam makes is the live dtype; few are unknown
    said = autocast.predict(records, prediction)
    known = said != "unknown"
    assert (said[known] == records.loc[known, "dtype"].map(names)).all()
    assert known.sum() >= 0.9 * len(records), (known.sum(), len(records))
    # the fp32 scan's own records: the RMSNorms' rsqrt**3 values would be fp32
    own = predicted.records[predicted.records["kind"] == "backward"]
    rsqrt = own[own["node"] == "RsqrtBackward0"]
    assert len(rsqrt) and (autocast.predict(rsqrt, prediction) == "fp32").all()


def test_scan_and_show_say_what_autocast_would_hold(cli, llama_pair: tuple[Path, Path]) -> None:
    shown = cli("show", llama_pair[0], "--top", "2")
    assert shown.code == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert (
        "Under fp16 autocast (cpu, predicted by a forward probe): backward values fp32 in 6" in text
    )
    assert "model.norm" in text.split("fp16 in")[0]
    assert "Under fp16 autocast" not in cli("show", llama_pair[1], "--top", "2").stdout


def test_counts_as_fp16_drops_only_what_autocast_holds_in_fp32(
    llama_pair: tuple[Path, Path],
) -> None:
    predicted, live = (Report.read(p) for p in llama_pair)
    counted = autocast.counts_as_fp16(predicted)
    records = predicted.records
    dropped = records[~counted]
    # every dropped record is in a module the probe saw compute in fp32 (or a node of
    # one), never a Linear's fp16 product
    assert len(dropped) and set(dropped["node"]) >= {"RsqrtBackward0", "PowBackward0"}
    assert "MmBackward0" not in set(dropped["node"])
    assert counted.index.equals(records.index)
    # no prediction (the live scan): everything counts
    assert autocast.counts_as_fp16(live).all()
