"""Every report table's columns, each named once, as an attribute of the table's class.

A table is a small wrapper class (:class:`Records`, :class:`Bins`, :class:`Steps`,
:class:`Origins`, :class:`Blocks`) whose :class:`Column` attributes are its columns, in
the files' order: ``Records.module`` is the string ``"module"``, so a rule writes
``records[Records.module]`` and a renamed column is a type error (mypy: no attribute),
not a run-time ``KeyError``. On a wrapped DataFrame the same attribute is that column
(``Records(frame).module``). The column dicts of ``records.py`` (``RECORD_COLUMNS``,
``STEP_COLUMNS``, ...) and the Arrow schemas of ``schema.py`` are read from these
classes. The key that names a record (:class:`Key`) is declared once and spliced into
the records and blocks tables where their files have always had it.

Plain Python: pandas is only named for the type checker (a capturing process never
imports it until it builds a report).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, overload

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Bins", "Blocks", "Column", "Key", "Origins", "Records", "Steps", "Table"]


class Column:
    """One column of a table: its Arrow type's name (``"int32"``, ``"string"``, ...) and
    what it holds; its name is the attribute's."""

    def __init__(self, dtype: str, doc: str = "") -> None:
        self.dtype = dtype
        self.doc = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, table: None, owner: type) -> str: ...

    @overload
    def __get__(self, table: Table, owner: type) -> pd.Series: ...

    def __get__(self, table: Table | None, owner: type) -> Any:
        """On the class: the column's name. On a wrapped table: the column."""
        return self.name if table is None else table.frame[self.name]


class Table:
    """A report table: a DataFrame behind its class's :class:`Column` attributes."""

    _columns: ClassVar[dict[str, Column]] = {}

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame

    def __init_subclass__(cls, *, key_after: str | None = None, **kwargs: Any) -> None:
        """The columns in order: the class's own, with :class:`Key`'s after ``key_after``
        for a table keyed by record (records, blocks)."""
        super().__init_subclass__(**kwargs)
        own = {name: c for name, c in vars(cls).items() if isinstance(c, Column)}
        if key_after is None:
            cls._columns = own
            return
        names = list(own)
        at = names.index(key_after) + 1
        key = {name: c for name, c in vars(Key).items() if isinstance(c, Column)}
        cls._columns = {**{n: own[n] for n in names[:at]}, **key}
        cls._columns.update({n: own[n] for n in names[at:]})

    @classmethod
    def columns(cls) -> dict[str, str]:
        """Every column's name and Arrow type's name, in the files' order."""
        return {name: column.dtype for name, column in cls._columns.items()}


class Key(Table):
    """What names a record: the op output a value is (kind, module, autograd node, op,
    output index) and the dtype it was stored in."""

    kind = Column("string")
    module = Column("string")
    node = Column("string")
    op = Column("string")
    output = Column("int16")
    dtype = Column("string")


class Records(Key, key_after="steps"):
    """One row per (step, kind, module, node, op, output, dtype): the statistics of every
    tensor recorded under that key in that step."""

    record_id = Column("int32", "numbers the records of one rank: 0, 1, 2, ...")
    rank = Column("int16", "the torch.distributed rank that recorded it (0 in one process)")
    step = Column("int32", "the (first) step the record covers")
    steps = Column("int32", "how many captured steps it covers (--window)")
    scales_with_loss = Column("bool")
    calls = Column("int64")
    elements = Column("int64")
    zeros = Column("int64")
    infs = Column("int64")
    nans = Column("int64")
    amax = Column("float64")
    loss_scale = Column("float64")
    # --shadow: the op re-run in fp32 on the same inputs, upcast
    shadow_calls = Column("int64", "outputs compared with their fp32 re-run (0: not shadowed)")
    shadow_nonzero = Column("int64", "nonzero elements of the fp32 re-runs")
    lost = Column("int64", "nonzero in the fp32 re-run, zero in the real output")
    overflowed = Column("int64", "finite in the fp32 re-run, inf or NaN in the real output")


class Bins(Table):
    """The nonzero finite histogram bins of each record (``lower`` and ``upper`` are
    derived from ``binade`` and ``cls`` when a report is written)."""

    record_id = Column("int32")
    binade = Column("int16", "floor(log2|x|)")
    cls = Column("int8", "the mantissa class (fpaudit.numerics.layout)")
    lower = Column("float64", "the smallest magnitude the bin holds (inclusive)")
    upper = Column("float64", "the largest magnitude the bin holds (inclusive)")
    count = Column("int64")


class Steps(Table):
    """One row per step of the run."""

    step = Column("int32")
    rank = Column("int16")
    loss = Column("float64", "fpaudit run: the sum of the losses backpropagated in the step")
    loss_finite = Column("bool")
    loss_scale = Column("float64", "the scale in force during the step")
    scale_after = Column("float64", "the scale after the scaler's update (static: the same)")
    skipped = Column("bool", "the optimizer step was skipped: inf/NaN gradients")
    optimizer_step = Column("bool", "an optimizer step was taken")
    grad_norm = Column("float64", "clip_grad_norm_'s total norm, unscaled (NaN: not clipped)")
    clip_max_norm = Column("float64", "its max_norm (NaN: none)")
    clipped = Column("bool", "clip_grad_norm_ scaled the gradients, clip_grad_value_ clamped")
    clip_value = Column("float64", "clip_grad_value_'s clip_value (NaN: no clipping by value)")
    clipped_fraction = Column("float64", "the fraction of gradient elements it clamped")
    grad_amax = Column("float64", "largest |parameter gradient|, unscaled (inf/NaN: overflowed)")
    backward_calls = Column("int32")
    captured = Column("bool", "backward ops were recorded in this step (records exist)")
    records = Column("int32")
    nonfinite_grads = Column("int64")
    first_nonfinite = Column("string", "--forward: the module and op that first made inf/NaN")
    seconds = Column("float64")


class Origins(Table):
    """``scan --origins``: one row per op call that may make inf/NaN."""

    step = Column("int32")
    sequence = Column("int32", "execution order within the step (1, 2, ...)")
    phase = Column("string", "forward or backward")
    module = Column("string")
    node = Column("string", "the autograd node (backward)")
    op = Column("string")
    output = Column("int16")
    dtype = Column("string")
    scales_with_loss = Column("bool")
    loss_scale = Column("float64", "the scale the step ran under")
    elements = Column("int64")
    nonfinite = Column("int64", "inf or NaN elements of the output")
    amax = Column("float64", "largest finite output magnitude")
    inputs_nonfinite = Column("bool", "some floating input held inf or NaN")
    input_amax_scaled = Column("float64", "largest finite |input| scaled with the loss")
    input_amax_fixed = Column("float64", "... of inputs that require grad (not scaled)")


class Skips(Table):
    """``fpaudit run`` with a loss scaler (from version 6): one row per step the scaler
    skipped, with where its inf/NaN came from (``fpaudit.run.skips``,
    ``fpaudit.rules.skips``)."""

    step = Column("int32")
    rank = Column("int16")
    loss_scale = Column("float64", "the scale in force")
    loss_finite = Column("bool", "False: the forward already made inf/NaN")
    nonfinite_params = Column("int64", "parameters whose gradient held inf/NaN (-1: not checked)")
    params_checked = Column("int64", "parameters the scaler checked")
    params = Column("string", "the first of them, in backward order, comma-separated")
    op_step = Column("int32", "the captured step the op was seen in (this or the next; -1: none)")
    op_phase = Column("string", "forward or backward (empty: none named)")
    op_module = Column("string")
    op = Column("string")
    op_amax = Column("float64", "its largest finite |output| at op_scale (NaN: none named)")
    op_scale = Column("float64", "the scale op_step ran under")


class Blocks(Key, key_after="step"):
    """``--recipe``: one row per (step, record key, recipe); its key columns here, then
    the counts (``records.BLOCK_COUNT_COLUMNS``) and the histograms
    (``records.BLOCK_HISTOGRAM_COLUMNS``)."""

    rank = Column("int16")
    step = Column("int32")
    recipe = Column("string")
