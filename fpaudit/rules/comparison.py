"""Two reports compared: the same format at the same scale, module by module.

``fpaudit diff BASE NEW`` prints :func:`compare`'s result and ``fpaudit gate NEW
--baseline BASE`` judges it, so a change is measured once. Both reports are read in one
format at one scale (default: BASE's recommended scale, the static scale a team
calibrated on it: a change that moves the values moves NEW's own recommendation with
them, and judging NEW there would hide what a fixed scale now loses; the move of the
recommended scale is said beside it), and every number compared is a
*fraction* of each report's own nonzero values, never a raw count: two reports of
different sizes (steps, batch) compare as well as two of the same. The fractions are the
ones the gate judges (:mod:`fpaudit.rules.analysis`'s ``judged_*``: values that do not
scale with the loss are counted apart), over each report's default scope (backward
values inside the model; in a live report those held in its low-precision dtype).

A row is a module (or, ``by="op"``, a module, autograd node and aten op); a row present
in one report only is listed as such (a renamed module is two rows). What makes two
reports incomparable is refused (:class:`~fpaudit.errors.UsageError`, one line): no
common format, one compiled and one eager report (a compiled backward stores other
values than an eager one). What differs without blocking (steps, torch release,
device, autocast dtype) is said in :attr:`Comparison.notes`, one line each.

No torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from fpaudit.errors import Named, UsageError
from fpaudit.numerics.formats import Format, get_format
from fpaudit.report.data import ReportData
from fpaudit.report.records import LOSS_MODULE
from fpaudit.rules import analysis
from fpaudit.rules.recommendation import recommend

# What a row's ``present`` says; the overall row's module.
BOTH, BASE_ONLY, NEW_ONLY = "both", "base", "new"
OVERALL = "(all modules)"
# --sort: the increase of underflow (default), of overflow, the largest move of amax, or
# the model's own order.
SORTS = ("underflow", "overflow", "amax", "order")
GROUPINGS = ("module", "op")


@dataclass(frozen=True)
class Change:
    """One row: a module (or module, node and op) in both reports, or in one only (the
    other's numbers are ``None``). Fractions are of each report's own nonzero values;
    ``amax_change_binades`` is the move of the unscaled amax's binade (``floor(log2)``)."""

    module: str
    node: str | None
    op: str | None
    present: str  # BOTH, BASE_ONLY or NEW_ONLY
    base_underflow: float | None
    new_underflow: float | None
    underflow_change: float | None
    base_overflow: float | None
    new_overflow: float | None
    overflow_change: float | None
    base_underflowed: int | None  # counts, each in its own report (not to be compared)
    new_underflowed: int | None
    base_overflowed: int | None
    new_overflowed: int | None
    base_nonzero: int | None
    new_nonzero: int | None
    base_amax: float | None
    new_amax: float | None
    amax_change_binades: int | None

    def to_dict(self, by: str = "module") -> dict[str, Any]:
        data = asdict(self)
        if by == "module":
            del data["node"], data["op"]
        return data


@dataclass(frozen=True)
class RunChange:
    """Two ``fpaudit run`` reports' loss scalers: the skip rate after calibration (the
    leading skips of a fresh dynamic scaler backing off are expected; see
    :func:`fpaudit.rules.findings.skip_statistics`) and the range of the loss scale."""

    base_skipped: int  # skipped steps after calibration
    new_skipped: int
    base_steps: int  # steps after calibration
    new_steps: int
    base_skip_rate: float
    new_skip_rate: float
    skip_rate_change: float
    base_loss_scale: tuple[float, float]  # (smallest, largest) scale in force
    new_loss_scale: tuple[float, float]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["base_loss_scale"], data["new_loss_scale"] = (
            list(self.base_loss_scale), list(self.new_loss_scale))  # fmt: skip
        return data


def run_change(base: ReportData, new: ReportData) -> RunChange | None:
    """The scalers' change between two ``fpaudit run`` reports; None unless both are."""
    from fpaudit.rules.findings import skip_statistics

    if base.info.command != "run" or new.info.command != "run":
        return None
    stats, scales = [], []
    for report in (base, new):
        steps = report.steps[report.steps["rank"] == report.steps["rank"].min()]
        stats.append(skip_statistics(steps["skipped"].to_numpy(dtype=bool)))
        scale = steps["loss_scale"]
        scales.append((float(scale.min()), float(scale.max())) if len(scale) else (1.0, 1.0))
    rates = [each.skip_rate_after_calibration for each in stats]
    return RunChange(
        base_skipped=stats[0].skipped_after_calibration,
        new_skipped=stats[1].skipped_after_calibration,
        base_steps=stats[0].steps_after_calibration,
        new_steps=stats[1].steps_after_calibration,
        base_skip_rate=rates[0],
        new_skip_rate=rates[1],
        skip_rate_change=rates[1] - rates[0],
        base_loss_scale=scales[0],
        new_loss_scale=scales[1],
    )


@dataclass(frozen=True)
class Comparison:
    """:func:`compare`'s answer: the summary (the whole model's change, each report's
    recommended scale and steps), the notes on what differs, and the rows in ``sort``'s
    order."""

    format: str
    log2_scale: int
    scale_source: str  # "BASE's recommended", "NEW's recommended" or "given"
    by: str
    sort: str
    base_report: str
    new_report: str
    base_steps: int
    new_steps: int
    base_recommended: int | None  # log2 of each report's recommended scale
    new_recommended: int | None
    overall: Change
    rows: tuple[Change, ...]
    notes: tuple[str, ...]
    run: RunChange | None = None  # two fpaudit run reports: their scalers

    @property
    def scale(self) -> float:
        return math.ldexp(1.0, self.log2_scale)

    @property
    def recommended_change(self) -> int | None:
        """NEW's recommended scale over BASE's, in binades."""
        if self.base_recommended is None or self.new_recommended is None:
            return None
        return self.new_recommended - self.base_recommended

    def row(self, module: str) -> Change:
        """The row of ``module`` (``by="module"``); KeyError when neither report has it."""
        for change in self.rows:
            if change.module == module:
                return change
        raise KeyError(module)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "log2_scale": self.log2_scale,
            "scale": self.scale,
            "scale_source": self.scale_source,
            "by": self.by,
            "sort": self.sort,
            "base": {
                "report": self.base_report,
                "steps": self.base_steps,
                "recommended_log2_scale": self.base_recommended,
            },
            "new": {
                "report": self.new_report,
                "steps": self.new_steps,
                "recommended_log2_scale": self.new_recommended,
            },
            "recommended_change_binades": self.recommended_change,
            "notes": list(self.notes),
            "overall": self.overall.to_dict(),
            "run": self.run.to_dict() if self.run is not None else None,
            "modules": [change.to_dict(self.by) for change in self.rows],
        }


# The recommended scales diff reads both reports at by name ("recommended": BASE's).
RECOMMENDED, BASE, NEW = "recommended", "base", "new"
SCALE_NAMES = (RECOMMENDED, BASE, NEW)


def common_format(base: ReportData, new: ReportData, name: str | None = None) -> Format:
    """The format both reports are read in: ``name``, else NEW's first summarised format
    that BASE summarised too (fp16 when neither names one); none in common is refused."""
    if name is not None:
        return get_format(name)
    base_formats, new_formats = base.info.formats, new.info.formats
    if not base_formats or not new_formats:
        return get_format((new_formats or base_formats or ("fp16",))[0])
    shared = [each for each in new_formats if each in base_formats]
    if not shared:
        raise UsageError(
            f"no common format: BASE was summarised in {', '.join(base_formats)}, NEW in "
            f"{', '.join(new_formats)}; pass ",
            Named("format"),
            " F to read both in F",
        )
    return get_format(shared[0])


def refusal(base: ReportData, new: ReportData) -> str | None:
    """Why the two reports cannot be compared at all, else None."""
    if _same_report(base, new):
        return f"BASE and NEW are the same report ({new.path}); compare two different reports"
    compiled = [r.info.compiled is not None for r in (base, new)]
    if compiled[0] != compiled[1]:
        which = "BASE" if compiled[0] else "NEW"
        return (
            f"{which} is a compiled report (scan --compile) and the other an eager one: a "
            "compiled backward stores other values than an eager one, so their fractions "
            "do not compare; scan both the same way"
        )
    return None


def _same_report(base: ReportData, new: ReportData) -> bool:
    if base.path is None or new.path is None:
        return base is new
    return base.path.resolve() == new.path.resolve()


def notes(base: ReportData, new: ReportData) -> tuple[str, ...]:
    """What differs between the reports without blocking a comparison, one line each."""
    said = []
    steps = (_steps(base), _steps(new))
    if steps[0] != steps[1]:
        said.append(
            f"steps differ: BASE ran {steps[0]}, NEW {steps[1]} (fractions compare; counts do not)"
        )
    for key, what in (("torch_version", "torch releases"), ("device", "devices")):
        values = (_environment(base, key), _environment(new, key))
        if values[0] != values[1]:
            said.append(f"{what} differ: BASE {values[0]}, NEW {values[1]}")
    dtypes = (base.info.amp_dtype or "none", new.info.amp_dtype or "none")
    if dtypes[0] != dtypes[1]:
        said.append(f"autocast dtypes differ: BASE {dtypes[0]}, NEW {dtypes[1]}")
    return tuple(said)


def _environment(report: ReportData, key: str) -> str | None:
    """The run's environment entry ``key`` (None for a report that has none)."""
    environment = report.info.environment
    return None if environment is None else str(getattr(environment, key))


def _steps(report: ReportData) -> int:
    done = report.info.steps_run
    if done is not None:
        return done
    return int(report.steps["step"].nunique()) if len(report.steps) else 0


def compare(
    base: ReportData,
    new: ReportData,
    fmt: Format | str | None = None,
    *,
    log2_scale: int | str | None = None,
    by: str = "module",
    sort: str = "underflow",
    headroom_bits: int | None = None,
    include_loss: bool = False,
) -> Comparison:
    """BASE and NEW in ``fmt`` (default: :func:`common_format`) at ``2**log2_scale``, or
    at a recommended scale named in :data:`SCALE_NAMES` (default: BASE's), per module or
    (``by="op"``) per module, node and op.

    ``headroom_bits`` (default: each report's own) sets each recommended scale.
    Raises :class:`~fpaudit.errors.UsageError` when the reports cannot be compared.
    """
    if by not in GROUPINGS or sort not in SORTS:
        raise ValueError(f"by must be one of {GROUPINGS}, sort one of {SORTS}")
    why = refusal(base, new)
    if why is not None:
        raise UsageError(why)
    fmt = fmt if isinstance(fmt, Format) else common_format(base, new, fmt)
    recommended = [
        recommend(
            report, fmt, _headroom(report, headroom_bits), include_loss=include_loss
        ).log2_scale
        for report in (base, new)
    ]
    scale_source = "given"
    if not isinstance(log2_scale, int):
        name = BASE if log2_scale in (None, RECOMMENDED) else log2_scale
        if name not in (BASE, NEW):
            raise UsageError(
                Named("log2_scale"), f" {name!r}: a power of two or one of {', '.join(SCALE_NAMES)}"
            )
        chosen = recommended[0] if name == BASE else recommended[1]
        if chosen is None:  # that report recommends nothing: the other's, else S = 1
            chosen = recommended[1] if name == BASE else recommended[0]
        log2_scale, scale_source = chosen or 0, f"{name.upper()}'s recommended"
    scopes = [analysis.default_scope(report, include_loss) for report in (base, new)]
    totals = [
        analysis.totals(report, fmt, log2_scale, scope=scope).to_dict()
        for report, scope in zip((base, new), scopes, strict=True)
    ]
    group = ("module",) if by == "module" else ("module", "node", "op")
    tables = [
        analysis.range_loss(report, fmt, log2_scale, scope=scope, by=group)
        for report, scope in zip((base, new), scopes, strict=True)
    ]
    rows = _rows(tables[0].to_dict(orient="records"), tables[1].to_dict(orient="records"), group)
    return Comparison(
        format=fmt.name,
        log2_scale=log2_scale,
        scale_source=scale_source,
        by=by,
        sort=sort,
        base_report=str(base.path or ""),
        new_report=str(new.path or ""),
        base_steps=_steps(base),
        new_steps=_steps(new),
        base_recommended=recommended[0],
        new_recommended=recommended[1],
        overall=replace(_change(totals[0], totals[1]), module=OVERALL),
        rows=tuple(_sorted(rows, sort)),
        notes=notes(base, new),
        run=run_change(base, new),
    )


def _headroom(report: ReportData, given: int | None) -> int:
    from fpaudit.rules.summary import report_headroom

    return report_headroom(report) if given is None else given


def _rows(
    base: list[dict[str, Any]], new: list[dict[str, Any]], group: tuple[str, ...]
) -> list[Change]:
    """Every row of either table, NEW's in its order, then those only BASE has."""

    def key(row: dict[str, Any]) -> tuple[str, ...]:
        return tuple(str(row[column]) for column in group)

    in_base = {key(row): row for row in base}
    in_new = {key(row): row for row in new}
    changes = [_change(in_base.get(key(row)), row) for row in new]
    changes += [_change(row, None) for row in base if key(row) not in in_new]
    return changes


def _numbers(row: dict[str, Any] | None) -> dict[str, Any]:
    if row is None:
        return dict.fromkeys(("underflow", "overflow", "underflowed", "overflowed", "nonzero",
                              "amax"))  # fmt: skip
    nonzero = int(row["nonzero"])
    overflowed = int(row["judged_overflow"])
    return {
        "underflow": float(row["judged_underflow_fraction"]),
        "overflow": overflowed / nonzero if nonzero else 0.0,
        "underflowed": int(row["judged_underflow"]),
        "overflowed": overflowed,
        "nonzero": nonzero,
        "amax": float(row["amax"]),
    }


def _binade(amax: float | None) -> int | None:
    if amax is None or not (amax > 0 and math.isfinite(amax)):
        return None
    return math.frexp(amax)[1] - 1  # floor(log2(amax))


def _change(base_row: dict[str, Any] | None, new_row: dict[str, Any] | None) -> Change:
    named = new_row if new_row is not None else base_row
    assert named is not None
    base, new = _numbers(base_row), _numbers(new_row)
    both = base_row is not None and new_row is not None
    binades = (_binade(base["amax"]), _binade(new["amax"]))
    return Change(
        module=str(named.get("module", OVERALL)),
        node=str(named["node"]) if "node" in named else None,
        op=str(named["op"]) if "op" in named else None,
        present=BOTH if both else BASE_ONLY if new_row is None else NEW_ONLY,
        base_underflow=base["underflow"],
        new_underflow=new["underflow"],
        underflow_change=new["underflow"] - base["underflow"] if both else None,
        base_overflow=base["overflow"],
        new_overflow=new["overflow"],
        overflow_change=new["overflow"] - base["overflow"] if both else None,
        base_underflowed=base["underflowed"],
        new_underflowed=new["underflowed"],
        base_overflowed=base["overflowed"],
        new_overflowed=new["overflowed"],
        base_nonzero=base["nonzero"],
        new_nonzero=new["nonzero"],
        base_amax=base["amax"],
        new_amax=new["amax"],
        amax_change_binades=(
            binades[1] - binades[0] if None not in binades else None  # type: ignore[operator]
        ),
    )


def _sorted(rows: list[Change], sort: str) -> list[Change]:
    """Rows in both reports by ``sort`` (largest first; stable: ties keep the model's
    order), then those in one report only, in the model's order."""
    if sort == "order":
        return rows
    compared = [row for row in rows if row.present == BOTH]
    alone = [row for row in rows if row.present != BOTH]

    def size(row: Change) -> float:
        if sort == "underflow":
            return row.underflow_change or 0.0
        if sort == "overflow":
            return row.overflow_change or 0.0
        return abs(row.amax_change_binades or 0)

    return sorted(compared, key=size, reverse=True) + alone


# -- block-scaled recipes (diff --recipe) ----------------------------------------------
@dataclass(frozen=True)
class BlockChange:
    """One module's flushed and saturated fractions of a recipe in both reports (or one:
    the other's are ``None``), of each report's own nonzero values."""

    module: str
    present: str  # BOTH, BASE_ONLY or NEW_ONLY
    base_flush: float | None
    new_flush: float | None
    flush_change: float | None
    base_saturate: float | None
    new_saturate: float | None
    saturate_change: float | None
    base_nonzero: int | None
    new_nonzero: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BlockComparison:
    """``diff --recipe``: each module's change of ``recipe``'s flushed fraction, the
    largest rise first, then the modules of one report only."""

    recipe: str
    base_report: str
    new_report: str
    base_steps: int
    new_steps: int
    overall: BlockChange
    rows: tuple[BlockChange, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "base": {"report": self.base_report, "steps": self.base_steps},
            "new": {"report": self.new_report, "steps": self.new_steps},
            "notes": list(self.notes),
            "overall": self.overall.to_dict(),
            "modules": [change.to_dict() for change in self.rows],
        }


def compare_blocks(base: ReportData, new: ReportData, recipe: str) -> BlockComparison:
    """BASE's and NEW's block statistics of ``recipe`` per module (backward values,
    ``<loss>`` left out, as ``gate --recipe`` judges them); both reports must hold it."""
    from fpaudit.rules.blockplan import block_table

    why = refusal(base, new)
    if why is not None:
        raise UsageError(why)
    lacking = [name for name, report in (("BASE", base), ("NEW", new))
               if recipe not in report.recipes]  # fmt: skip
    if lacking:
        held = "; ".join(f"{name}: {', '.join(r.recipes) or 'none'}"
                         for name, r in (("BASE", base), ("NEW", new)))  # fmt: skip
        raise UsageError(
            f"{' and '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} no block "
            f"statistics of {recipe} (recipes {held}); scan both with ",
            Named("recipe", recipe),
        )
    tables = []
    for report in (base, new):
        table = block_table(report, recipe)
        tables.append(table[table["module"] != LOSS_MODULE].to_dict(orient="records"))
    in_base = {str(row["module"]): row for row in tables[0]}
    in_new = {str(row["module"]): row for row in tables[1]}
    rows = [_block_change(in_base.get(str(row["module"])), row) for row in tables[1]]
    rows += [_block_change(row, None) for row in tables[0] if str(row["module"]) not in in_new]
    compared = sorted((r for r in rows if r.present == BOTH),
                      key=lambda r: r.flush_change or 0.0, reverse=True)  # fmt: skip
    totals = [_block_total(table) for table in tables]
    return BlockComparison(
        recipe=recipe,
        base_report=str(base.path or ""),
        new_report=str(new.path or ""),
        base_steps=_steps(base),
        new_steps=_steps(new),
        overall=replace(_block_change(*totals), module=OVERALL),
        rows=tuple(compared + [r for r in rows if r.present != BOTH]),
        notes=notes(base, new),
    )


def _block_total(rows: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"module": OVERALL}
    for column in ("flushed", "saturated", "nonzero"):
        total[column] = sum(row[column] for row in rows)
    nonzero = total["nonzero"]
    total["flush_fraction"] = total["flushed"] / nonzero if nonzero else 0.0
    total["saturate_fraction"] = total["saturated"] / nonzero if nonzero else 0.0
    return total


def _block_change(base_row: dict[str, Any] | None, new_row: dict[str, Any] | None) -> BlockChange:
    named = new_row if new_row is not None else base_row
    assert named is not None
    both = base_row is not None and new_row is not None

    def value(row: dict[str, Any] | None, column: str) -> Any:
        return None if row is None else row[column]

    flush = (value(base_row, "flush_fraction"), value(new_row, "flush_fraction"))
    saturate = (value(base_row, "saturate_fraction"), value(new_row, "saturate_fraction"))
    nonzero = (value(base_row, "nonzero"), value(new_row, "nonzero"))
    return BlockChange(
        module=str(named["module"]),
        present=BOTH if both else BASE_ONLY if new_row is None else NEW_ONLY,
        base_flush=None if flush[0] is None else float(flush[0]),
        new_flush=None if flush[1] is None else float(flush[1]),
        flush_change=float(flush[1] - flush[0]) if both else None,
        base_saturate=None if saturate[0] is None else float(saturate[0]),
        new_saturate=None if saturate[1] is None else float(saturate[1]),
        saturate_change=float(saturate[1] - saturate[0]) if both else None,
        base_nonzero=None if nonzero[0] is None else int(nonzero[0]),
        new_nonzero=None if nonzero[1] is None else int(nonzero[1]),
    )
