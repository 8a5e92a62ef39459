"""What autocast would hold in fp16: a prediction for an fp32 scan, per module and value.

Under ``torch.autocast(device, dtype=torch.float16)`` an op runs in fp16, in fp32 or in
the widest dtype of its inputs, by torch's op lists (``aten/src/ATen/autocast_mode.cpp``,
documented in "Automatic Mixed Precision package - torch.amp", sections "CUDA Ops that
can autocast to float32" and "CPU Ops that can autocast to float32"), and a module may
upcast on its own (Hugging Face's ``LlamaRMSNorm`` computes in
``hidden_states.to(torch.float32)``). A backward op's output is the gradient of a forward
op's input and has that input's dtype, so a module's backward values are fp16 under
autocast exactly where its forward ops' differentiable inputs are fp16.

:func:`probe` observes that directly, with torch as the oracle: one forward pass of the
model under autocast (eval mode, so no activation checkpointing reruns it and no
running statistics move; the RNG state restored afterwards), a dispatch mode recording,
for each op that makes new values, the dtypes of its floating inputs that require grad,
attributed to the innermost module by fpaudit's module clock. :func:`predict` turns a
report's records into one verdict each (the seam every "what counts" rule calls):
``fp16``, ``fp32`` or ``unknown``. Nothing is cast or run for real: the prediction is a
:class:`~fpaudit.report.runinfo.AutocastPrediction` in the report's metadata
(``autocast``), and ``--amp`` live scans stay the ground
truth.

Known limitations: the probe sees the ops of one forward pass on the first batch; a
model whose dtypes depend on the data, or that runs forward differently in eval mode,
can differ from the training pass. A backward node is matched to its forward op by name
(``RsqrtBackward0`` to ``aten.rsqrt``); a node with no forward op of that name in its
module (a custom ``autograd.Function``) takes the module's verdict, ``unknown`` when the
module computes in both dtypes.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch import nn

from fpaudit.numerics.formats import AMP_NAMES
from fpaudit.report.runinfo import AutocastPrediction, OpDtypes
from fpaudit.torch_internals import OpOverload, TorchDispatchMode

if TYPE_CHECKING:
    from fpaudit.report.store import Report

FP16, FP32, MIXED, UNKNOWN = "fp16", "fp32", "mixed", "unknown"

# Ops that autocast runs in fp32 whatever their inputs (a public name each, as torch's
# "torch.amp" documentation lists them; aten/src/ATen/autocast_mode.cpp registers them
# with CastPolicy fp32, fp32_set_opt_dtype or fp32_append_dtype). Data, for explaining a
# prediction; tests/capture/test_autocast.py runs each under autocast and checks its output is
# fp32 on this torch. The probe does not need them: it sees what autocast did.
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "group_norm",
    "norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "prod", "softmax", "log_softmax", "cumprod",
    "cumsum", "sum",
)  # fmt: skip
_CPU_FP32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "prod", "quantile", "nanquantile",
    "cdist", "trace", "inverse", "max_pool3d", "adaptive_avg_pool3d", "reflection_pad1d",
    "replication_pad1d", "mse_loss", "cosine_embedding_loss", "nll_loss",
    "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "huber_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "ctc_loss", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits",
    "fft_fft",
)  # fmt: skip
FP32_OPS: dict[str, frozenset[str]] = {"cuda": frozenset(_CUDA_FP32), "cpu": frozenset(_CPU_FP32)}
# Ops whose gradient is their output's gradient, passed on to each input (cast to that
# input's dtype): backward makes new values only for an input whose dtype is not the
# output's (a residual add of an fp16 branch to an fp32 stream gives the branch an fp16
# cast of the fp32 gradient, and passes the stream's on untouched; a cast's backward is
# the cast back).
_PASSTHROUGH = frozenset({"add", "sub", "to_copy"})
_CAST = "aten._to_copy.default"  # a backward value made by casting a gradient
# the formats' names of the dtypes autocast computes in (numerics.formats.AMP_NAMES) and fp32
_DTYPE_NAMES = {
    getattr(torch, dtype): name for dtype, name in {**AMP_NAMES, "float32": FP32}.items()
}


def forward_name(op: str) -> str:
    """An aten op's base name as a backward node names it: ``aten._to_copy.default`` ->
    ``to_copy``, ``aten.nll_loss_forward.default`` -> ``nll_loss``."""
    base = op.split(".")[1] if op.startswith("aten.") else op
    return base.strip("_").removesuffix("_forward")


def node_forward_name(node: str) -> str:
    """The forward op a backward node differentiates: ``RsqrtBackward0`` -> ``rsqrt``,
    ``ToCopyBackward0`` -> ``to_copy``; "" for a node that is not an op's backward."""
    match = re.fullmatch(r"(\w+?)Backward\d*", node)
    if match is None:
        return ""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).lower()


class _Probe(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves the mode untyped
    def __init__(self, clock: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self._clock = clock
        self.seen: dict[str, dict[str, dict[str, set[str]]]] = {}

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        from fpaudit.capture.oprules import creates_new_values

        output = func(*args, **(kwargs or {}))
        if creates_new_values(func, args, output):
            name = forward_name(str(func))
            inputs = {
                t.dtype
                for t in _flat_tensors((args, kwargs))
                if t.is_floating_point() and t.requires_grad
            }
            outputs = {t.dtype for t in _flat_tensors(output) if t.is_floating_point()}
            if inputs:
                # backward computes in the op's dtype (its output's), then casts the
                # gradient to each input's dtype where that differs
                cast = inputs - outputs
                compute = cast if name in _PASSTHROUGH else outputs
                ops = self.seen.setdefault(self._clock.current_module(), {})
                entry = ops.setdefault(name, {"compute": set(), "cast": set()})
                entry["compute"].update(_DTYPE_NAMES.get(d, str(d)) for d in compute)
                entry["cast"].update(_DTYPE_NAMES.get(d, str(d)) for d in cast)
        return output


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _flat_tensors(item)]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _flat_tensors(item)]
    return []


def probe(
    model: nn.Module, forward: Callable[[], Any], device_type: str, dtype: str = "float16"
) -> AutocastPrediction:
    """Run ``forward`` (one forward pass of ``model``, e.g. the model file's loss on a
    batch) under ``torch.autocast(device_type, dtype)`` and return what autocast did: per
    module, per forward op, the dtypes its backward computes in and casts the gradient to
    (:class:`~fpaudit.report.runinfo.OpDtypes`). The model's train/eval flags, its
    gradients and the RNG state are as they were; nothing is kept of the pass."""
    from fpaudit.capture.clock import ModuleClock

    clock = ModuleClock(model)
    modes = {m: m.training for m in model.modules()}
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[], enabled=True))
        if device_type == "cuda":
            stack.enter_context(torch.random.fork_rng(enabled=True))
        clock.install(model, stack)
        model.eval()
        try:
            mode = _Probe(clock)
            with torch.autocast(device_type, dtype=getattr(torch, dtype)), mode:
                forward()
        finally:
            for module, training in modes.items():
                module.training = training
    seconds = time.perf_counter() - started
    modules = {
        m: {
            op: OpDtypes(compute=tuple(sorted(entry["compute"])), cast=tuple(sorted(entry["cast"])))
            for op, entry in ops.items()
        }
        for m, ops in mode.seen.items()
    }
    return AutocastPrediction(device_type, dtype, seconds, modules)


def module_verdicts(prediction: AutocastPrediction) -> dict[str, str]:
    """Per module seen by the probe: ``fp16`` when every differentiable input of its
    ops is fp16 (its backward values would all be fp16), ``fp32`` when every one is fp32,
    else ``mixed`` (both: a Linear casts its fp32 input to fp16, so its backward has
    fp16 products and the fp32 gradient of the cast)."""
    verdicts = {}
    for module, ops in prediction.modules.items():
        dtypes = {d for entry in ops.values() for d in (*entry.compute, *entry.cast)}
        verdicts[module] = dtypes.pop() if len(dtypes) == 1 else MIXED
    return verdicts


def predict(records: pd.DataFrame, prediction: AutocastPrediction | None) -> pd.Series:
    """The seam: per record (row of ``records``: ``module``, ``node``, ``op``), what its
    values would be under the probed autocast (a cast's output: the dtype the node's
    forward op casts gradients to; any other: the dtype that op computes in): ``fp16``,
    ``fp32`` or ``unknown`` (no prediction, or the module computes in both dtypes and the
    node names no single one). A rule
    that judges the fp16 what-if counts a record unless this says ``fp32``."""
    if prediction is None or not len(records):
        return pd.Series(UNKNOWN, index=records.index, dtype=object)
    modules = prediction.modules
    verdicts = module_verdicts(prediction)
    cache: dict[tuple[str, str, bool], str] = {}

    def one(module: str, node: str, op: str) -> str:
        key = (module, node, op == _CAST)
        if key not in cache:
            entry = modules.get(module, {}).get(node_forward_name(node))
            dtypes = None if entry is None else entry.cast if op == _CAST else entry.compute
            if dtypes is not None and len(dtypes) == 1:
                cache[key] = dtypes[0] if dtypes[0] in (FP16, FP32) else UNKNOWN
            else:
                verdict = verdicts.get(module, UNKNOWN)
                cache[key] = UNKNOWN if verdict == MIXED else verdict
        return cache[key]

    rows = zip(records["module"], records["node"], records["op"], strict=True)
    values = [one(m, n, o) for m, n, o in rows]
    return pd.Series(values, index=records.index, dtype=object)


@dataclass(frozen=True)
class Summary:
    """A report's autocast prediction in words' terms: modules (report order) whose
    backward values would be all fp16, all fp32, or both, under fp16 autocast."""

    device: str
    fp16: list[str]
    fp32: list[str]
    mixed: list[str]
    seconds: float
    error: str | None = None  # the model failed under autocast: no prediction

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summary(report: Report) -> Summary | None:
    """The prediction an fp32 scan stored (None: a live ``--amp`` scan, a run, or a
    report from before the probe)."""
    prediction = report.info.autocast
    if prediction is None:
        return None
    device = prediction.device
    if prediction.error is not None:
        return Summary(device, [], [], [], 0.0, prediction.error)
    verdicts = module_verdicts(prediction)
    order = [m for m in report.info.modules if m in verdicts]
    order += sorted(set(verdicts) - set(order))
    return Summary(
        device,
        [m for m in order if verdicts[m] == FP16],
        [m for m in order if verdicts[m] == FP32],
        [m for m in order if verdicts[m] == MIXED],
        prediction.seconds,
    )


def counts_as_fp16(report: Report) -> pd.Series:
    """Per row of ``report.records`` (same index): whether the fp16 what-if should count
    the record's values as fp16 (False exactly where the stored prediction says autocast
    would hold them in fp32; True without a prediction, the conservative side). A live
    ``--amp`` scan's records carry their real dtype instead."""
    records = report.records
    return predict(records, report.info.autocast) != FP32
