"""Where a run breaks in fp16: the ops that *make* inf/NaN, live or predicted.

Pure functions over the origins table that ``scan --origins`` stores in a report
(``origins.parquet``, one row per floating output of every op call that creates
values, in execution order; see ``fpaudit.capture.origin_probe``). No torch.

* **Live origin**: an op call whose output holds inf or NaN while every floating
  input is finite. It is blamed with its module, aten op, phase, step, number of
  non-finite elements and largest finite input magnitude. An op whose inputs
  already hold inf/NaN only carries them (propagation): counted, never blamed.
  ``inf - inf = NaN`` downstream of an overflow is propagation.
* **Deliberate infinity**: an op that writes inf/NaN by design, not by arithmetic,
  is never an origin (:func:`deliberate`). Two kinds: an op that only writes
  constants or copies of its inputs (``scalar_tensor``, ``full``, ``fill_``,
  ``masked_fill``, ``where``, ... in :data:`CONSTANT_OPS`), whose inf can only be
  one of its constant arguments (Hugging Face's ``-inf`` attention masks); and an
  op whose largest finite input, or output, is exactly float32's largest value (a
  ``torch.finfo(float32).min`` mask cast to fp16 becomes ``-inf``). Live, they are
  listed apart; predicted, they are left out. ``scan``'s first non-finite forward
  op (``fpaudit.capture.mode``), ``show --origins`` and ``fp16-plan`` apply this rule.
* **Predicted origin at S** (from an fp32 reference run): an op call whose
  values, at scale S, reach the format's overflow edge (65520 for fp16: under
  round-to-nearest-even 65520 rounds to inf) while its inputs stay below it.
  In backward, outputs and gradient inputs scale with S (in unscaled units: the
  recorded value over the run's loss scale) and forward values and parameters
  (inputs that require grad) do not; forward values never scale. Backward outputs
  that do not scale with the loss (from saved forward values alone) are not
  predicted: they do not move with S, and autocast usually keeps them in fp32.

Known limitations: a predicted origin reads each op in isolation (amax of inputs
and output), not what the op would compute from already-rounded fp16 inputs; an op
that autocast runs in fp32 (a norm's backward) is named where its values reach the
edge, while a live run makes the inf where such a value is first cast to fp16.
A constant op that writes a huge *finite* value is not an origin either way; its
value reaches the overflow edge only where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fpaudit.numerics.formats import FP32, Format
from fpaudit.report.records import ORIGIN_COLUMNS as COLUMNS
from fpaudit.report.tables import Origins as OriginCalls

if TYPE_CHECKING:  # pandas only where a table is built or read, not in capture
    import pandas as pd


# Ops whose every output element is a constant argument or a copy of an input element:
# from finite tensor inputs they make inf/NaN only when told to (an infinite fill value,
# or a fill value past the output dtype's range: masked_fill(-1e9) on fp16 scores).
# Casts (_to_copy, copy_ across dtypes) round, so they are not among them.
CONSTANT_OPS = frozenset(
    {
        "scalar_tensor", "full", "full_like", "new_full", "fill", "fill_", "masked_fill",
        "masked_fill_", "where", "index_fill", "index_fill_", "masked_scatter",
        "masked_scatter_", "scatter", "scatter_", "index_put", "index_put_", "lift_fresh",
        "lift_fresh_copy", "cat", "stack", "expand_copy",
        "repeat", "tril", "triu", "constant_pad_nd", "fill_diagonal_",
    }
)  # fmt: skip


def is_constant_op(op: str) -> bool:
    """Is ``op`` (``aten.masked_fill.Scalar`` or a ``torch._ops`` overload) a constant op?"""
    parts = str(op).split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1] in CONSTANT_OPS


def is_sentinel(values: Any) -> np.ndarray:
    """Is a magnitude exactly float32's largest value, a ``torch.finfo`` mask sentinel?"""
    same: np.ndarray = np.asarray(values, dtype=np.float64) == FP32.max_finite
    return same


def deliberate(table: pd.DataFrame) -> np.ndarray:
    """Per op call of an origins table: are its inf/NaN (or huge values) deliberate,
    written by a constant op or carried from a finfo sentinel, rather than computed?"""
    constant = np.fromiter((is_constant_op(op) for op in table[OriginCalls.op]), bool, len(table))
    sentinel = (
        is_sentinel(table[OriginCalls.amax])
        | is_sentinel(table[OriginCalls.input_amax_scaled])
        | is_sentinel(table[OriginCalls.input_amax_fixed])
    )
    either: np.ndarray = constant | sentinel
    return either


_PANDAS = {
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "float64": "float64",
    "bool": "bool",
    "string": "object",
}


def table_from_columns(columns: dict[str, list[Any]]) -> pd.DataFrame:
    import pandas as pd

    frame = pd.DataFrame({name: columns.get(name, []) for name in COLUMNS})
    return frame.astype({name: _PANDAS[t] for name, t in COLUMNS.items()})


@dataclass(frozen=True)
class Origins:
    """Live origins and per-step propagation counts of one report."""

    origins: pd.DataFrame  # the blamed op calls, in (step, sequence) order
    propagation: pd.DataFrame  # per step: op calls that only carried inf/NaN
    deliberate: pd.DataFrame  # op calls that wrote inf/NaN by design (masks), not blamed

    def to_dict(self) -> dict[str, Any]:
        return {
            "origins": _rows(self.origins),
            "propagation": _rows(self.propagation),
            "deliberate": _rows(self.deliberate),
        }


_SHOWN = [
    OriginCalls.step,
    OriginCalls.sequence,
    OriginCalls.phase,
    OriginCalls.module,
    OriginCalls.op,
    OriginCalls.node,
    OriginCalls.output,
    OriginCalls.dtype,
    OriginCalls.nonfinite,
    OriginCalls.elements,
    "largest_finite_input",
]


def _with_input(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.copy()
    frame["largest_finite_input"] = np.maximum(
        frame[OriginCalls.input_amax_scaled].to_numpy(),
        frame[OriginCalls.input_amax_fixed].to_numpy(),
    )
    return frame


def live(table: pd.DataFrame) -> Origins:
    """The op calls that made inf/NaN from finite inputs by arithmetic, the ones that
    wrote them by design, and how many carried them on."""
    import pandas as pd

    bad = table[table[OriginCalls.nonfinite] > 0]
    made = bad[~bad[OriginCalls.inputs_nonfinite]]
    by_design = deliberate(made)
    blamed = _with_input(made[~by_design])
    carried = bad[bad[OriginCalls.inputs_nonfinite]]
    propagation = (
        carried.groupby(OriginCalls.step, sort=True).size().rename("op_calls").reset_index()
        if not carried.empty
        else pd.DataFrame(
            {OriginCalls.step: pd.Series(dtype="int32"), "op_calls": pd.Series(dtype="int64")}
        )
    )
    return Origins(_ordered(blamed), propagation, _ordered(_with_input(made[by_design])))


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values([OriginCalls.step, OriginCalls.sequence], kind="stable").reset_index(
        drop=True
    )[_SHOWN]


def reaches_overflow(fmt: Format, values: np.ndarray) -> np.ndarray:
    """Does a magnitude round past the format's largest finite value (65520 for fp16)?"""
    edge = fmt.overflow_edge
    values = np.asarray(values, dtype=np.float64)
    return (values > edge) | ((values == edge) if fmt.overflow_edge_inclusive else False)


def predicted(table: pd.DataFrame, fmt: Format, scale: float) -> pd.DataFrame:
    """Op calls whose values reach ``fmt``'s overflow edge at ``scale`` while their
    inputs do not, in execution order; ``first`` marks each step's first one."""
    backward = (table[OriginCalls.phase] == "backward").to_numpy()
    unscale = table[OriginCalls.loss_scale].to_numpy(dtype=np.float64)
    factor = np.where(backward, scale / unscale, 1.0)
    scales = table[OriginCalls.scales_with_loss].to_numpy(dtype=bool) & backward
    output = table[OriginCalls.amax].to_numpy(dtype=np.float64) * np.where(scales, factor, 1.0)
    inputs = np.maximum(
        table[OriginCalls.input_amax_scaled].to_numpy(dtype=np.float64) * factor,
        table[OriginCalls.input_amax_fixed].to_numpy(dtype=np.float64),
    )
    hit = reaches_overflow(fmt, output) & ~reaches_overflow(fmt, inputs)
    # backward values that do not scale with the loss (computed from saved forward values
    # alone, such as a norm's pow(var, -1.5)) do not move with S: left to the live run
    hit &= scales | ~backward
    # constants and torch.finfo(float32) sentinels (attention masks) are not computed
    # values: an fp16 run uses fp16's own finfo there
    hit &= ~deliberate(table)
    hit &= ~table[OriginCalls.inputs_nonfinite].to_numpy(dtype=bool)
    frame = _with_input(table[hit]).assign(
        value_at_scale=output[hit], largest_input_at_scale=inputs[hit]
    )
    frame = frame.sort_values([OriginCalls.step, OriginCalls.sequence], kind="stable").reset_index(
        drop=True
    )
    frame["first"] = ~frame[OriginCalls.step].duplicated()
    shown = [c for c in _SHOWN if c != OriginCalls.nonfinite]
    return frame[[*shown, OriginCalls.amax, "value_at_scale", "largest_input_at_scale", "first"]]


def _rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for row in frame.to_dict(orient="records"):
        out.append({k: v.item() if isinstance(v, np.generic) else v for k, v in row.items()})
    return out
