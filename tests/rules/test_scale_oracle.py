"""Scale prediction against a real backward seeded with 2**k.

fpaudit records one backward at S = 1 and predicts, by shifting the binades
of the values that scale with the loss, what every op's outputs would be at
S = 2**k. The oracle here shares none of that: a plain ``TorchDispatchMode``
watches a *real* backward seeded with ``2**k`` (fp32 throughout), casts every
backward-op output to fp16 with torch and counts the values that the cast
turns to zero (underflow) or to inf (overflow). Per (autograd node, op,
output index), summed over calls, the two must agree exactly.

Backward formulas are linear in the incoming gradient, and multiplying by a
power of two is exact in fp32 (away from fp32's own subnormals, which are far
below fp16's smallest subnormal 2**-24), so a value that scales with the loss
is bit for bit ``2**k`` times its S = 1 value, and one computed from forward
values alone is bit for bit the same: exact agreement is the right bar. Every
record of the zoo agrees exactly, also when captured under S = 2**12. The one
place prediction is conservative by design (a backward intermediate computed
from a forward tensor that does not require grad is taken as scaled) has its
own test at the end, which says which side it errs on.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fpaudit
from fpaudit.numerics.formats import as_format
from fpaudit.report.records import KIND_BACKWARD
from fpaudit.rules import analysis
from fpaudit.rules.recommendation import recommend

ROOT = Path(__file__).resolve().parents[2]
FP16 = as_format("fp16")
LOG2_SCALES = (-12, -4, 0, 3, 8, 14, 20)

Key = tuple[str, str, int]  # (autograd node, aten op, output index)

# Ops the oracle sees that fpaudit does not record: they only copy values an
# earlier record already counted (same dtype), or return uninitialised memory.
COPIES = {
    "aten.clone.default",
    "aten.copy_.default",
    "aten._to_copy.default",
    "aten._unsafe_view.default",
    "aten.cat.default",
    "aten.stack.default",
    "aten.slice_backward.default",
    "aten.select_backward.default",
    "aten.constant_pad_nd.default",
    "aten.new_empty_strided.default",
    "aten.new_empty.default",
    "aten.empty_like.default",
    "aten.empty.memory_format",
    "aten.empty_strided.default",
}


class CastCounter(TorchDispatchMode):
    """Counts, per (node, op, output), the fp16 cast's zeros-from-nonzero and infs."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[Key, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        output = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        if node is None or func.is_view:
            return output
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        for index, tensor in enumerate(tensors):
            if tensor.is_complex():  # a complex half cast keeps each part in fp16
                tensor = torch.view_as_real(tensor.detach().resolve_conj())
            if not tensor.is_floating_point() or tensor.layout != torch.strided:
                continue
            value = tensor.detach().to(torch.float32)
            cast = value.to(torch.float16)
            finite = torch.isfinite(value)
            row = self.counts[(node.name(), str(func), index)]
            row[0] += int((finite & (value != 0) & (cast == 0)).sum())
            row[1] += int((finite & torch.isinf(cast)).sum())
        return output


def real_counts(
    make: Callable[[], nn.Module], loss_fn: Callable[[nn.Module], torch.Tensor], log2_scale: int
) -> dict[Key, list[int]]:
    torch.manual_seed(1)
    model = make()
    torch.manual_seed(2)
    loss = loss_fn(model)
    seed = torch.tensor(2.0**log2_scale, dtype=loss.dtype)
    counter = CastCounter()
    with counter:
        loss.backward(seed)
    return dict(counter.counts)


def predicted(
    make: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module], torch.Tensor],
    capture_log2_scale: int = 0,
) -> tuple[analysis.Condensed, Any]:
    """fpaudit's records of one backward run at S = 2**capture_log2_scale (the seed)."""
    torch.manual_seed(1)
    model = make()
    scale = 2.0**capture_log2_scale
    with fpaudit.audit(model, loss_scale=scale) as audit:
        torch.manual_seed(2)
        loss = loss_fn(model)
        loss.backward(torch.tensor(scale, dtype=loss.dtype))
        audit.step(loss)
    report = audit.report
    scope = analysis.Scope(kinds=(KIND_BACKWARD,), include_loss=True)
    return analysis.condense(report, scope, by=("node", "op", "output")), report


# -- the zoo ---------------------------------------------------------------


class PackedLSTM(nn.Module):
    """Embedding -> packed LSTM -> linear: ``pack_padded_sequence`` fills zero buffers
    through views in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(
            self.proj(self.embed(ids)), lengths, batch_first=True, enforce_sorted=True
        )
        out, _ = self.lstm(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(padded)


def packed_lstm() -> tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]:
    ids = torch.randint(0, 50, (6, 12), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([12, 12, 9, 7, 5, 3])  # sorted: no index_select to mask the bug

    def loss(model: nn.Module) -> torch.Tensor:
        logits = model(ids, lengths)
        return F.cross_entropy(logits.reshape(-1, 50), ids[:, : logits.shape[1]].reshape(-1)) * 300

    return PackedLSTM, loss


class SliceFill(torch.autograd.Function):
    """``y = x * w`` whose backward builds its gradient by filling slices of a zero buffer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        grad_x = torch.zeros_like(x)
        half = x.shape[-1] // 2
        grad_x[..., :half].add_(grad[..., :half] * w[:half])
        grad_x[..., half:].copy_(grad[..., half:] * w[half:])
        return grad_x * 1.5, (grad * x).sum(0)


class SliceFillModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8) * 1e-3)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(SliceFill.apply(self.fc(x), self.w))


def slice_fill() -> tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    return SliceFillModel, lambda model: model(x).square().mean()


class SpectralFilter(nn.Module):
    """A learned complex filter applied in the frequency domain: complex gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.filter = nn.Parameter(torch.randn(9, dtype=torch.complex64) * 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(self.fc(x), dim=-1)
        return torch.fft.irfft(spectrum * self.filter, n=16, dim=-1)


def spectral() -> tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    return SpectralFilter, lambda model: model(x).square().mean()


def test_complex_gradients_are_counted_by_their_parts() -> None:
    make, loss_fn = spectral()
    _, report = predicted(make, loss_fn)
    records = report.records
    mul = records[(records["node"] == "MulBackward0") & (records["kind"] == KIND_BACKWARD)]
    # spectrum * filter: aten.mul gives each complex factor's gradient at 32 x 9 (one
    # record, two calls: 2 * 32 * 9 * 2 parts = 1152), then aten.sum reduces the
    # filter's to 9 elements (9 * 2 parts = 18)
    assert dict(zip(mul["op"], mul["elements"], strict=True)) == {
        "aten.mul.Tensor": 2 * 32 * 9 * 2,
        "aten.sum.dim_IntList": 9 * 2,
    }
    grads = records[(records["kind"] == "grad") & (records["op"] == "filter")]
    assert grads["elements"].tolist() == [9 * 2]


def _sample(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_oracle_{name}", ROOT / "sample_configs" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample(name: str) -> tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]:
    module = _sample(name)
    batch = next(iter(module.batches()))
    make = module.model if callable(module.model) else (lambda: module.model)
    return make, lambda model: module.loss(model, batch)


def hf(kind: str) -> tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=127, eos_token_id=127,
        )  # fmt: skip

        def make() -> nn.Module:
            lm = transformers.GPT2LMHeadModel(config)
            lm.loss_type = "ForCausalLM"
            return lm

        return make, lambda model: model(input_ids=ids, labels=ids).loss
    if kind == "llama":  # its RMSNorm backward holds rsqrt(var + eps) ** 3: does not scale
        llama = transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip

        def make_llama() -> nn.Module:
            lm = transformers.LlamaForCausalLM(llama)
            lm.loss_type = "ForCausalLM"
            return lm

        return make_llama, lambda model: model(input_ids=ids, labels=ids).loss
    config = transformers.BertConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64,
        vocab_size=128, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    labels = torch.tensor([0, 1])

    def make_bert() -> nn.Module:
        return transformers.BertForSequenceClassification(config)

    return make_bert, lambda model: model(input_ids=ids, labels=labels).loss


ZOO: dict[str, Callable[[], Any]] = {
    "packed_lstm": packed_lstm,
    "slice_fill": slice_fill,
    "spectral": spectral,
    "mlp": lambda: sample("mlp.py"),
    "hf_gpt2": lambda: hf("gpt2"),
    "hf_bert": lambda: hf("bert"),
    "hf_llama": lambda: hf("llama"),
}


CASES = [(name, 0) for name in sorted(ZOO)] + [
    # captured under S = 2**12 (`scan --loss-scale 4096`): a value wrongly taken for
    # scaled would be divided by 4096 even when predicting S = 1
    ("slice_fill", 12),
    ("packed_lstm", 12),
]


def test_values_counted_apart_overflow_at_every_real_scale() -> None:
    """Issue 24: Llama's RMSNorm ``RsqrtBackward0`` ``pow`` outputs do not scale with the
    loss. fpaudit counts those that overflow fp16 apart (``unscalable_overflow``); the
    real backward, seeded with 2**k, overflows exactly as many at every k, so no loss
    scale fixes them."""
    make, loss_fn = ZOO["hf_llama"]()
    condensed, _ = predicted(make, loss_fn)
    keys = [
        (str(row.node), str(row.op), int(row.output))
        for row in condensed.groups[["node", "op", "output"]].itertuples()
    ]
    apart = condensed.at(FP16, 0)["unscalable_overflow"].to_numpy()
    counted = {key: int(n) for key, n in zip(keys, apart, strict=True) if n}
    assert counted and {key[0] for key in counted} == {"RsqrtBackward0"}, counted
    for log2_scale in LOG2_SCALES:
        real = real_counts(make, loss_fn, log2_scale)
        for key, overflow in counted.items():
            assert real[key][1] == overflow, (log2_scale, key, real[key], overflow)
        table = condensed.at(FP16, log2_scale)
        assert (table["unscalable_overflow"].to_numpy() == apart).all()


@pytest.mark.parametrize(("name", "capture_log2_scale"), CASES)
def test_predicted_counts_equal_a_real_backward_at_every_scale(
    name: str, capture_log2_scale: int
) -> None:
    make, loss_fn = ZOO[name]()
    condensed, _ = predicted(make, loss_fn, capture_log2_scale)
    keys = [
        (str(row.node), str(row.op), int(row.output))
        for row in condensed.groups[["node", "op", "output"]].itertuples()
    ]
    checked = 0
    for log2_scale in LOG2_SCALES:
        real = real_counts(make, loss_fn, log2_scale)
        table = condensed.at(FP16, log2_scale)
        for key, underflow, overflow in zip(
            keys, table["underflow"], table["overflow"], strict=True
        ):
            assert key in real, f"{name}: fpaudit recorded {key}, the real backward has no such op"
            assert [int(underflow), int(overflow)] == real[key], (
                f"{name} at S=2**{log2_scale}, {key}: predicted (underflow, overflow) "
                f"{(int(underflow), int(overflow))}, real {tuple(real[key])}"
            )
            checked += int(underflow) + int(overflow)
        missing = {k for k in real if k not in set(keys) and k[1] not in COPIES}
        assert not missing, f"{name}: ops of the real backward fpaudit did not record: {missing}"
    assert checked > 0, f"{name}: no scale produced any underflow or overflow to compare"


class PackedLSTMWithLoss(PackedLSTM):
    """The packed LSTM computing its own loss (Hugging Face style), so every backward op
    belongs to a module and counts for ``recommend``. Large embeddings into a small
    ``proj`` make ``proj``'s weight gradient the largest backward value: the one the
    zero buffer of ``pack_padded_sequence``'s backward used to hide."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.embed.weight.mul_(100)
            self.proj.weight.mul_(0.01)
            self.proj.bias.zero_()

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        logits = super().forward(ids, lengths)
        targets = ids[:, : logits.shape[1]].reshape(-1)
        return F.cross_entropy(logits.reshape(-1, 50), targets)


def real_amax(
    make: Callable[[], nn.Module], loss_fn: Callable[[nn.Module], torch.Tensor], log2_scale: int
) -> float:
    """The largest finite |value| any backward op outputs in a real backward seeded 2**k."""
    amax = 0.0

    class Amax(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            nonlocal amax
            output = func(*args, **(kwargs or {}))
            if torch._C._current_autograd_node() is not None and not func.is_view:
                for tensor in tree_leaves(output):
                    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                        finite = tensor.detach().float().abs().nan_to_num(0.0, 0.0, 0.0)
                        if finite.numel() and str(func) not in COPIES:
                            amax = max(amax, float(finite.max()))
            return output

    torch.manual_seed(1)
    model = make()
    loss = loss_fn(model)
    with Amax():
        loss.backward(torch.tensor(2.0**log2_scale))
    return amax


def test_packed_lstm_recommendation_is_the_largest_scale_a_real_backward_allows() -> None:
    ids = torch.randint(0, 50, (6, 12), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([12, 12, 9, 7, 5, 3])

    def loss(model: nn.Module) -> torch.Tensor:
        return model(ids, lengths)

    _, report = predicted(PackedLSTMWithLoss, loss)
    recommendation = recommend(report, "fp16", headroom_bits=4)
    k = recommendation.log2_scale
    assert k is not None
    # The documented headroom: the largest value stays at or below max_finite / 2**4
    # = 65504 / 16 = 4094 at S = 2**k, and the next power of two would pass it.
    limit = FP16.max_finite / 2**4
    assert real_amax(PackedLSTMWithLoss, loss, k) <= limit
    assert real_amax(PackedLSTMWithLoss, loss, k + 1) > limit
    # The layer before the packing gets its gradient out of the zero buffer that
    # pack_padded_sequence's backward fills through views: its values scale, and its
    # weight gradient limits the scale (taken for fixed, it left 2**16, where the real
    # backward reaches 51490 > 4094).
    assert (recommendation.limiting_module, recommendation.limiting_op) == (
        "proj",
        "aten.mm.default",
    )
    records = report.records
    proj = records[(records["module"] == "proj") & (records["kind"] == KIND_BACKWARD)]
    assert len(proj) and proj["scales_with_loss"].all()


class MaskedScale(torch.autograd.Function):
    """``y = x * (mask * 2**20)``: its backward rebuilds the factor from the saved mask,
    a forward tensor that does not require grad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mask)
        return x * (mask * 2.0**20)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mask,) = ctx.saved_tensors
        factor = mask * 2.0**20  # from forward values alone: does not move with S
        return grad * factor, None


def test_a_fixed_value_read_from_a_forward_tensor_without_grad_is_the_conservative_side() -> None:
    """The documented conservative case: a backward intermediate computed only from a
    forward tensor that does not require grad counts as scaling with the loss. Its
    predicted counts are those of a scaled value; every other record stays exact."""
    mask = torch.ones(4, 8)  # requires_grad=False, like a batch or an attention mask
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return MaskedScale.apply(self.fc(x), mask).mean()

    condensed, report = predicted(Model, lambda model: model(x))
    factor = report.records[report.records["node"] == "MaskedScaleBackward"]
    factor = factor[factor["op"] == "aten.mul.Tensor"]
    assert factor["scales_with_loss"].all()  # the conservative classification
    keys = [(str(r.node), str(r.op), int(r.output)) for r in condensed.groups.itertuples()]
    # at S = 2**k the real factor stays 2**20 = 1048576 (already inf in fp16: 32 values
    # overflow at every k), the gradient 2**20 / 32 * 2**k moves; at k = -30 the real
    # factor still overflows 32 times while the prediction (shifted by -30) says none
    real = real_counts(Model, lambda model: model(x), -30)
    table = condensed.at(FP16, -30)
    mismatched = {
        key
        for key, underflow, overflow in zip(
            keys, table["underflow"], table["overflow"], strict=True
        )
        if [int(underflow), int(overflow)] != real[key]
    }
    assert mismatched == {("MaskedScaleBackward", "aten.mul.Tensor", 0)}
    row = keys.index(("MaskedScaleBackward", "aten.mul.Tensor", 0))
    # the record holds the factor (32 values of 2**20) and the gradient (32 values):
    # predicted: nothing overflows at 2**-30; real: the 32 factor values still do
    assert int(table["overflow"].iloc[row]) == 0 and real[keys[row]][1] == 32
