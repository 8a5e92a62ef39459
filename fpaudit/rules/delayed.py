"""Replay FP8 delayed scaling over a report: ``fpaudit simulate --policy te-delayed``.

FP8 training with *delayed scaling* keeps, per tensor (each GEMM input or
gradient), a history of the last ``H`` per-step amax values and casts step
``t``'s tensor with a scale computed from the history of steps before ``t``:
a spike is seen one step late, and it keeps the scale low for ``H`` steps.
This module re-implements two such rules exactly, in float32 as they run, and
replays them over a report's per-step, per-op amax series; the report's
histograms then say, per step and op, what fraction of the values the scale
would have pushed past the format's largest value (overflow) or below its
smallest normal (flushed, underflow included).

``te-delayed``
    Transformer Engine's ``DelayedScaling`` recipe, ``_default_sf_compute``
    in ``transformer_engine/pytorch/fp8.py`` (NVIDIA/TransformerEngine, read at
    commits 0004dbd and 62a84b3)::

        sf = (fp8_max / amax) / (2 ** margin)
        sf = torch.where(amax > 0.0, sf, scale)
        sf = torch.where(torch.isfinite(amax), sf, scale)
        sf = torch.where(torch.isinf(sf), torch.full_like(sf, _fp32_max), sf)

    with ``amax = max(amax_history)`` (``amax_compute_algo="max"``) or the
    latest entry (``"most_recent"``) from ``_default_get_amax_and_update_history``.
    The history row 0 receives the current step's amax while the step runs; the
    update after the step reads the history (so it holds steps ``t-H+1..t``),
    rolls it and zeroes row 0. The scale starts at 1 (``torch.ones``). All
    tensors are float32, so ``fp8_max / amax`` is one float32 division.
``msamp-delayed``
    The power-of-two rule of MS-AMP's ``ScalingMeta.compute_scaling_factor``
    (``msamp/common/tensor/meta.py``; early Transformer Engine releases used
    the same code)::

        exp = torch.floor(torch.log2(fp_max / amax)) - margin
        sf = torch.round(torch.pow(2, torch.abs(exp)))
        sf = torch.where(amax > 0.0, sf, scale)
        sf = torch.where(torch.isfinite(amax), sf, scale)
        sf = torch.where(exp < 0, 1 / sf, sf)

    replayed with the same history as ``te-delayed``. Faithfully, an infinite
    amax gives ``exp = -inf`` and so ``1 / scale``.

Formats: Transformer Engine's default ``HYBRID`` format casts forward tensors
to E4M3 (max 448) and backward ones to E5M2 (max 57344); ``--format`` picks
one format for all. Values are taken in unscaled units (loss scale 1).

Exactness: a value ``x`` cast with scale ``s`` lands where the fp32 product
``x * s`` rounds in the format. A histogram bin holds all values between its
``lower`` and ``upper`` bounds; the fate is monotone in ``|x|``, so the bin's
count is certainly lost when its lower bound is, and possibly when its upper
bound is. At a power-of-two scale every bin lands in one fate (the mantissa
classes are built for that), so the two bounds coincide and the counts are
exact; ``te-delayed`` scales are rarely powers of two, and then the truth
lies between the two counts reported (``*_lower`` and ``*_upper``). No value
exceeds its record's amax, so the top bin is cut there; and the amax is a
value the op held, so *whether* an op overflows in a step is exact at any
scale: the overflow steps are exact even where the counts are bounds.

Known limitations:

* The replay sees the ops fpaudit records (backward op outputs, and forward op
  outputs with ``scan --forward``), one scaling history per (kind, module,
  node, op, output). Transformer Engine keeps histories for GEMM inputs only.
* An op not recorded in a step (``--every``, or an uncaptured step of
  ``fpaudit run``) enters the history as amax 0, as a tensor not cast that
  step would in Transformer Engine: the scale is kept.
* A recorded step with inf or NaN gives amax inf (whether the real amax
  kernel would ignore a NaN is not modelled).
* MS-AMP computes ``log2`` in float32; here numpy's float32 ``log2`` stands in
  for torch's, which could differ for a quotient within one rounding of a
  power of two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pandas as pd

from fpaudit import defaults
from fpaudit.errors import OptionError, ReportError
from fpaudit.numerics import layout
from fpaudit.numerics.formats import Format, get_format
from fpaudit.report.data import ReportData
from fpaudit.report.records import KIND_BACKWARD, KIND_FORWARD, LOSS_MODULE, OP_KEY_COLUMNS
from fpaudit.rules import fp8_policies

POLICIES: tuple[str, ...] = fp8_policies.POLICIES  # declared in their own registry
AMAX_ALGORITHMS: tuple[str, ...] = ("max", "most_recent")
SWEEP_HISTORY_LENGTHS: tuple[int, ...] = (1, 16, 64, 256, 1024)
SWEEP_MARGINS: tuple[int, ...] = (0, 1, 2)
# DelayedScaling's amax_history_len (1024) and margin (0), declared once in fpaudit.defaults
DEFAULT_HISTORY_LENGTH = defaults.DELAYED_HISTORY_LENGTH
DEFAULT_MARGIN = defaults.DELAYED_MARGIN
DEFAULT_AMAX_COMPUTE_ALGO = defaults.DELAYED_AMAX_COMPUTE_ALGO
HYBRID = {KIND_FORWARD: "fp8_e4m3fn", KIND_BACKWARD: "fp8_e5m2"}
_FP32_MAX = np.float32(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Settings:
    policy: str = "te-delayed"
    amax_history_len: int = DEFAULT_HISTORY_LENGTH
    margin: int = DEFAULT_MARGIN
    amax_compute_algo: str = DEFAULT_AMAX_COMPUTE_ALGO

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise OptionError(
                "policy", f"must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )
        if self.amax_history_len < 1:
            raise OptionError(
                "amax_history_len", f"must be at least 1, got {self.amax_history_len}"
            )
        if self.margin < 0:
            raise OptionError("margin", f"must be 0 or more, got {self.margin}")
        if self.amax_compute_algo not in AMAX_ALGORITHMS:
            raise OptionError(
                "amax_compute_algo",
                f"must be one of {', '.join(AMAX_ALGORITHMS)}, got {self.amax_compute_algo!r}",
            )

    def to_dict(self) -> dict[str, Any]:
        return {item.name: getattr(self, item.name) for item in fields(self)}


def scale_update(
    policy: str, amax: np.ndarray, scale: np.ndarray, fp8_max: float, margin: int
) -> np.ndarray:
    """The new float32 scales from float32 ``amax`` and the current ``scale`` (see the
    module docstring for the code each policy re-implements)."""
    amax = np.asarray(amax, dtype=np.float32)
    scale = np.asarray(scale, dtype=np.float32)
    fmax = np.float32(fp8_max)
    usable = (amax > 0) & np.isfinite(amax)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        quotient = fmax / amax  # float32 / float32: one rounding, as torch does
        if not fp8_policies.REGISTRY[policy].power_of_two:  # te-delayed
            sf = quotient / np.float32(2.0**margin)
            sf = np.where(usable, sf, scale)
            return np.where(np.isinf(sf), _FP32_MAX, sf).astype(np.float32)
        exp = np.floor(np.log2(quotient)) - np.float32(margin)
        sf = np.round(np.power(np.float32(2.0), np.abs(exp))).astype(np.float32)
        sf = np.where(usable, sf, scale)
        return np.where(exp < 0, np.float32(1.0) / sf, sf).astype(np.float32)


def scale_trajectory(
    amax: np.ndarray, settings: Settings, fp8_max: float | np.ndarray
) -> np.ndarray:
    """``scale[i, t]``: the scale tensor ``i`` is cast with in step ``t``, given its
    per-step amax ``amax[i, t]`` (0: not cast that step; inf: held inf/NaN)."""
    amax = np.asarray(amax, dtype=np.float32)
    tensors, steps = amax.shape
    limits = np.broadcast_to(np.asarray(fp8_max, dtype=np.float32), (tensors,))
    scales = np.empty((tensors, steps), dtype=np.float32)
    scale = np.ones(tensors, dtype=np.float32)
    history = settings.amax_history_len
    for t in range(steps):
        scales[:, t] = scale
        if settings.amax_compute_algo == "max":
            # rows 0..H-1 of the history: steps t-H+1..t (np.max propagates NaN as torch.max)
            chosen = np.max(amax[:, max(0, t - history + 1) : t + 1], axis=1)
        else:
            chosen = amax[:, t]
        scale = _update_by_format(settings, chosen, scale, limits)
    return scales


def _update_by_format(
    settings: Settings, chosen: np.ndarray, scale: np.ndarray, limits: np.ndarray
) -> np.ndarray:
    updated = np.empty_like(scale)
    for limit in np.unique(limits):
        rows = limits == limit
        updated[rows] = scale_update(
            settings.policy, chosen[rows], scale[rows], float(limit), settings.margin
        )
    return updated


def classify(fmt: Format, values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For fp32 magnitudes ``values`` cast with fp32 ``scales``: (overflow, flushed) masks.

    The product is exact in float64 (two 24-bit significands) and rounded once to
    float32, as ``x * s`` is on float32 tensors; then compared with the format's
    edges: overflow when it rounds past the largest finite value, flushed when it
    is below the smallest normal (round-to-zero included).
    """
    with np.errstate(over="ignore"):
        product = np.asarray(values, dtype=np.float64) * np.asarray(scales, dtype=np.float64)
        rounded = product.astype(np.float32)
    edge = np.float32(fmt.overflow_edge)
    overflow = (rounded > edge) | ((rounded == edge) if fmt.overflow_edge_inclusive else False)
    flushed = rounded < np.float32(fmt.smallest_normal)
    return np.asarray(overflow, dtype=bool), np.asarray(flushed, dtype=bool)


COUNT_COLUMNS = ("nonzero", "overflow_lower", "overflow_upper", "flushed_lower", "flushed_upper")


@dataclass(frozen=True)
class ReplaySummary:
    """What one delayed-scaling replay comes to, over every op and step: the steps in
    which some op overflows and the fractions of nonzero values that overflow or flush,
    each as a lower (certainly) and upper (possibly) bound. The JSON keys are the
    settings' then these fields' names, in field order."""

    settings: Settings
    exact: bool  # the bounds agree: every scale a power of two
    steps: int
    ops: int
    overflow_steps_lower: int
    overflow_steps_upper: int
    overflow_fraction_lower: float
    overflow_fraction_upper: float
    flushed_fraction_lower: float
    flushed_fraction_upper: float

    def to_dict(self) -> dict[str, Any]:
        own = {item.name: getattr(self, item.name) for item in fields(self)[1:]}
        return {**self.settings.to_dict(), **own}


@dataclass
class Replay:
    """One delayed-scaling replay: per (op, step) scale and counts, and summaries."""

    settings: Settings
    steps: np.ndarray  # the report's step numbers, in order
    ops: pd.DataFrame  # one row per op: OP_KEY_COLUMNS and its format
    scale: np.ndarray  # float32 [op, step]
    amax: np.ndarray  # float32 [op, step], unscaled (0: not recorded)
    counts: dict[str, np.ndarray]  # COUNT_COLUMNS -> int64 [op, step]
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        c = self.counts
        return bool(
            (c["overflow_lower"] == c["overflow_upper"]).all()
            and (c["flushed_lower"] == c["flushed_upper"]).all()
        )

    def overflow_steps(self, bound: str = "upper") -> list[int]:
        """Steps in which some op overflows (``lower``: certainly; ``upper``: possibly)."""
        hit = (self.counts[f"overflow_{bound}"] > 0).any(axis=0)
        return [int(s) for s in self.steps[hit]]

    def fraction(self, name: str) -> float:
        """``name`` (e.g. ``flushed_upper``) over all nonzero values of all steps."""
        nonzero = int(self.counts["nonzero"].sum())
        return int(self.counts[name].sum()) / nonzero if nonzero else 0.0

    def per_step(self) -> pd.DataFrame:
        frame = pd.DataFrame({"step": self.steps})
        for name in COUNT_COLUMNS:
            frame[name] = self.counts[name].sum(axis=0)
        nonzero = np.maximum(frame["nonzero"].to_numpy(), 1)
        for name in COUNT_COLUMNS[1:]:
            frame[f"{name}_fraction"] = frame[name] / nonzero
        frame["ops_overflowing"] = (self.counts["overflow_upper"] > 0).sum(axis=0)
        return frame

    def per_op(self) -> pd.DataFrame:
        frame = self.ops.copy()
        recorded = self.counts["nonzero"] > 0
        for name in COUNT_COLUMNS:
            frame[name] = self.counts[name].sum(axis=1)
        nonzero = np.maximum(frame["nonzero"].to_numpy(), 1)
        for name in COUNT_COLUMNS[1:]:
            frame[f"{name}_fraction"] = frame[name] / nonzero
        frame["overflow_steps_lower"] = (self.counts["overflow_lower"] > 0).sum(axis=1)
        frame["overflow_steps_upper"] = (self.counts["overflow_upper"] > 0).sum(axis=1)
        scale = self.scale.astype(np.float64)
        seen = recorded.any(axis=1)
        frame["min_scale"] = np.where(seen, np.where(recorded, scale, np.inf).min(axis=1), np.nan)
        frame["max_scale"] = np.where(seen, np.where(recorded, scale, -np.inf).max(axis=1), np.nan)
        frame["amax"] = self.amax.max(axis=1, initial=0.0)
        return frame

    def per_op_step(self) -> pd.DataFrame:
        """One row per (op, step) the op was recorded in: scale, amax and counts."""
        op, position = np.nonzero(self.counts["nonzero"] > 0)
        frame = self.ops.iloc[op].reset_index(drop=True)
        frame.insert(0, "step", self.steps[position])
        frame["scale"] = self.scale[op, position].astype(np.float64)
        frame["amax"] = self.amax[op, position].astype(np.float64)
        for name in COUNT_COLUMNS:
            frame[name] = self.counts[name][op, position]
        nonzero = np.maximum(frame["nonzero"].to_numpy(), 1)
        for name in COUNT_COLUMNS[1:]:
            frame[f"{name}_fraction"] = frame[name] / nonzero
        return frame.sort_values(["step"], kind="stable").reset_index(drop=True)

    def summary(self) -> ReplaySummary:
        return ReplaySummary(
            settings=self.settings,
            exact=self.exact,
            steps=len(self.steps),
            ops=len(self.ops),
            overflow_steps_lower=len(self.overflow_steps("lower")),
            overflow_steps_upper=len(self.overflow_steps("upper")),
            overflow_fraction_lower=self.fraction("overflow_lower"),
            overflow_fraction_upper=self.fraction("overflow_upper"),
            flushed_fraction_lower=self.fraction("flushed_lower"),
            flushed_fraction_upper=self.fraction("flushed_upper"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.summary().to_dict(),
            "overflow_step_numbers": self.overflow_steps("upper"),
            "notes": self.notes,
            "per_step": _records(self.per_step()),
            "per_op": _records(self.per_op()),
            "per_op_step": _records(self.per_op_step()),
        }


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    rows = []
    for row in frame.to_dict(orient="records"):
        rows.append(
            {
                k: (None if isinstance(v, float) and not math.isfinite(v) else
                    v.item() if isinstance(v, np.generic) else v)
                for k, v in row.items()
            }
        )  # fmt: skip
    return rows


@dataclass(frozen=True)
class _Series:
    """What every replay of one report shares: ops, amax series, bins joined to both."""

    steps: np.ndarray
    ops: pd.DataFrame
    formats: list[Format]
    amax: np.ndarray  # float32 [op, step]
    finite_amax: np.ndarray  # float64 [op, step]: the largest finite magnitude recorded
    bin_op: np.ndarray
    bin_position: np.ndarray
    lower: np.ndarray  # unscaled bounds of each bin
    upper: np.ndarray
    count: np.ndarray
    notes: tuple[str, ...]


def _records_to_replay(
    report: ReportData,
) -> tuple[np.ndarray, np.ndarray, pd.DataFrame, list[str]]:
    """The steps replayed (the first rank's), which records take part (forward and
    backward ops of that rank, not the loss), those records, and notes on what the
    replay cannot see."""
    if report.steps.empty:
        raise ReportError("the report has no steps to replay")
    notes: list[str] = []
    first_rank = int(report.steps["rank"].min())
    steps_table = report.steps[report.steps["rank"] == first_rank].sort_values(
        "step", kind="stable"
    )
    steps = steps_table["step"].to_numpy(dtype=np.int64)
    if len(report.ranks) > 1:
        notes.append(f"rank {first_rank}'s records only (each rank has its own histories)")
    records = report.records
    keep = (
        records["kind"].isin((KIND_FORWARD, KIND_BACKWARD))
        & (records["module"] != LOSS_MODULE)
        & (records["rank"] == first_rank)
    ).to_numpy()
    selected = records[keep]
    if selected.empty:
        raise ReportError("the report has no forward or backward op records to replay")
    if (selected["steps"] > 1).any():
        notes.append("records cover several steps (--window): each window is one step here")
    if "captured" in steps_table and not steps_table["captured"].all():
        notes.append(
            "some steps were not captured: their ops enter the histories as amax 0 (scale kept)"
        )
    return steps, keep, selected, notes


def _series(report: ReportData, fmt: Format | None) -> _Series:
    steps, keep, selected, notes = _records_to_replay(report)
    records = report.records
    grouped = selected.groupby(list(OP_KEY_COLUMNS), sort=False, dropna=False)
    op_of_record = grouped.ngroup().to_numpy()
    ops = grouped.size().reset_index()[list(OP_KEY_COLUMNS)]
    if fmt is None:
        formats = [get_format(HYBRID[str(kind)]) for kind in ops["kind"]]
    else:
        formats = [fmt] * len(ops)
    ops["format"] = [f.name for f in formats]
    position_of = {int(s): i for i, s in enumerate(steps)}
    position = np.array([position_of.get(int(s), -1) for s in selected["step"]], dtype=np.int64)
    unscale = np.where(
        selected["scales_with_loss"].to_numpy(dtype=bool),
        selected["loss_scale"].to_numpy(dtype=np.float64),
        1.0,
    )
    if any(math.frexp(float(s))[0] != 0.5 for s in np.unique(unscale)):
        notes.append("some loss scales are not powers of two: unscaled bounds are rounded")
    finite_values = selected["amax"].to_numpy(dtype=np.float64) / unscale
    amax_values = finite_values.copy()
    nonfinite = (selected["infs"] + selected["nans"]).to_numpy() > 0
    amax_values[nonfinite] = np.inf
    amax = np.zeros((len(ops), len(steps)), dtype=np.float32)
    finite_amax = np.zeros((len(ops), len(steps)), dtype=np.float64)
    known = position >= 0
    cells = (op_of_record[known], position[known])
    np.maximum.at(amax, cells, amax_values[known].astype(np.float32))
    np.maximum.at(finite_amax, cells, finite_values[known])

    record_row = np.full(len(records), -1, dtype=np.int64)
    record_row[np.flatnonzero(keep)] = np.arange(len(selected))
    bins = report.bins
    row = record_row[bins["record_id"].to_numpy()]
    in_scope = row >= 0
    row = row[in_scope]
    in_steps = position[row] >= 0
    row = row[in_steps]
    factor = unscale[row]
    # the in-memory report of a scan has no derived bounds yet: derive them from the bins
    lower, upper = layout.value_bounds(
        bins["binade"].to_numpy()[in_scope][in_steps], bins["cls"].to_numpy()[in_scope][in_steps]
    )
    return _Series(
        steps,
        ops,
        formats,
        amax,
        finite_amax,
        op_of_record[row],
        position[row],
        np.asarray(lower, dtype=np.float64) / factor,
        # no value exceeds its record's amax: the bin holding it is cut there
        np.minimum(np.asarray(upper, dtype=np.float64) / factor, finite_values[row]),
        bins["count"].to_numpy(dtype=np.int64)[in_scope][in_steps],
        tuple(notes),
    )


def _replay(series: _Series, settings: Settings) -> Replay:
    limits = np.array([f.max_finite for f in series.formats], dtype=np.float32)
    scale = scale_trajectory(series.amax, settings, limits)
    n_ops, n_steps = series.amax.shape
    cell = series.bin_op * n_steps + series.bin_position
    bin_scale = scale[series.bin_op, series.bin_position]
    masks = {name: np.zeros(len(cell), dtype=bool) for name in COUNT_COLUMNS[1:]}
    format_of_bin = np.array([id(f) for f in series.formats], dtype=np.int64)[series.bin_op]
    for fmt in {id(f): f for f in series.formats}.values():
        rows = format_of_bin == id(fmt)
        over_low, flush_low = classify(fmt, series.lower[rows], bin_scale[rows])
        over_high, flush_high = classify(fmt, series.upper[rows], bin_scale[rows])
        masks["overflow_lower"][rows] = over_low  # the smallest value overflows: all do
        masks["overflow_upper"][rows] = over_high
        masks["flushed_lower"][rows] = flush_high  # the largest value is flushed: all are
        masks["flushed_upper"][rows] = flush_low

    def total(weights: np.ndarray) -> np.ndarray:
        summed = np.bincount(cell, weights=weights.astype(np.float64), minlength=n_ops * n_steps)
        return summed.astype(np.int64).reshape(n_ops, n_steps)

    counts = {"nonzero": total(series.count)}
    for name, mask in masks.items():
        counts[name] = total(np.where(mask, series.count, 0))
    # The amax is a value the op held: when it overflows, at least one value does. So
    # whether a step overflows is exact at any scale, even where the counts are bounds.
    amax_over = np.zeros((n_ops, n_steps), dtype=bool)
    for i, fmt in enumerate(series.formats):
        amax_over[i] = classify(fmt, series.finite_amax[i], scale[i])[0]
    amax_over &= counts["nonzero"] > 0
    counts["overflow_lower"] = np.maximum(counts["overflow_lower"], amax_over.astype(np.int64))
    return Replay(
        settings, series.steps, series.ops, scale, series.amax, counts, list(series.notes)
    )


def replay(report: ReportData, settings: Settings, fmt: Format | None = None) -> Replay:
    """Replay ``settings`` over ``report`` (``fmt`` None: Transformer Engine's HYBRID)."""
    replayed = _replay(_series(report, fmt), settings)
    if not replayed.exact:
        replayed.notes.append(
            "the scales are not all powers of two: counts are bounded within a binade "
            "(lower: certainly lost, upper: possibly)"
        )
    return replayed


@dataclass
class Sweep:
    """Replays over a grid of (history length, margin), and the recommended pair."""

    policy: str
    amax_compute_algo: str
    max_overflow_steps: int
    replays: list[Replay]
    recommended: Replay | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        chosen = self.recommended
        return {
            "policy": self.policy,
            "amax_compute_algo": self.amax_compute_algo,
            "max_overflow_steps": self.max_overflow_steps,
            "grid": [r.summary().to_dict() for r in self.replays],
            "recommended": None
            if chosen is None
            else {
                "amax_history_len": chosen.settings.amax_history_len,
                "margin": chosen.settings.margin,
            },
            "notes": self.notes,
        }


def sweep(
    report: ReportData,
    policy: str = "te-delayed",
    *,
    amax_compute_algo: str = "max",
    max_overflow_steps: int = 0,
    history_lengths: tuple[int, ...] = SWEEP_HISTORY_LENGTHS,
    margins: tuple[int, ...] = SWEEP_MARGINS,
    fmt: Format | None = None,
) -> Sweep:
    """Replay every (H, margin) and recommend one for a gate on overflow steps.

    A pair passes when the steps in which some op *possibly* overflows (the upper
    bound) are at most ``max_overflow_steps``. Of the passing pairs the one that
    flushes the fewest values (upper bound) is recommended; ties go to the smaller
    margin (a margin costs a binade of resolution at the bottom), then to the
    shorter history (it recovers sooner from a spike).
    """
    if max_overflow_steps < 0:
        raise OptionError("max_overflow_steps", f"must be 0 or more, got {max_overflow_steps}")
    series = _series(report, fmt)
    replays = [
        _replay(series, Settings(policy, h, m, amax_compute_algo))
        for h in history_lengths
        for m in margins
    ]
    passing = [r for r in replays if len(r.overflow_steps("upper")) <= max_overflow_steps]
    chosen = min(
        passing,
        key=lambda r: (r.fraction("flushed_upper"), r.settings.margin, r.settings.amax_history_len),
        default=None,
    )
    notes = list(series.notes)
    if chosen is None:
        notes.append(
            f"no pair keeps the overflow steps at or below {max_overflow_steps}: "
            "delayed scaling cannot hold this report's spikes"
        )
    if not all(r.exact for r in replays):
        notes.append("counts are bounded within a binade (scales that are not powers of two)")
    return Sweep(policy, amax_compute_algo, max_overflow_steps, replays, chosen, notes)
