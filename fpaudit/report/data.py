"""A report's data: the run it describes and its tables, and what is derived from them.

:class:`ReportData` is what the rules read (``fpaudit.rules`` never imports the I/O of
``fpaudit.report.store``, which reads and writes it: ``Report``); the run is a
:class:`~fpaudit.report.runinfo.RunInfo`, the stored truth, and meta.json's object is
derived from it (``meta``) only where JSON is written or compared. Each table's columns
are named once, in ``fpaudit.report.tables``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Self, TypeVar

import numpy as np
import pandas as pd

from fpaudit.numerics import layout
from fpaudit.report.records import BIN_COLUMNS, ReportBuilder
from fpaudit.report.runinfo import Environment, RunInfo, RunMeta
from fpaudit.report.schema import (
    BINS_SCHEMA,
    OPTIONAL_TABLES,
    RECORDS_SCHEMA,
    STEPS_SCHEMA,
    frame,
)

__all__ = ["ReportData"]

T = TypeVar("T")


@dataclass
class ReportData:
    """An in-memory report: the run it describes (``info``, a :class:`RunInfo`: the stored
    truth, meta.json only its JSON form), the three tables every report has
    (``records``, ``bins``, ``steps``) and the optional ones (``origins``, ``blocks``,
    ``skips``):
    pandas DataFrames."""

    info: RunInfo
    records: pd.DataFrame
    bins: pd.DataFrame
    steps: pd.DataFrame
    path: Path | None = field(default=None, compare=False)
    origins: pd.DataFrame | None = field(default=None, compare=False)  # scan --origins

    @property
    def meta(self) -> Mapping[str, Any]:
        """meta.json's object for this report, as the writer writes it without the file's
        own entries (the JSON edge, read-only: change the report through ``info``)."""
        return MappingProxyType(self.info.to_meta())

    def record_run(
        self, run: RunInfo, settings: Mapping[str, Any], command_line: RunMeta | None = None
    ) -> None:
        """How every writer ends a run: ``run``'s ending (``RunInfo.ended``, and run's
        scaler, findings and skips) on this report's info, with the command's own
        ``settings`` (its options as it ran; no field's name) and the ``command_line``'s
        entries (``RunInfo.ended_as``)."""
        run = dataclasses.replace(run, settings=dict(settings))
        self.info = self.info.ended_as(run, command_line)

    def update_info(self, **fields: Any) -> None:
        """Set the :class:`RunInfo` ``fields`` named (``report.update_info(formats=("fp16",))``),
        leaving the others as they are; an unknown name is a TypeError."""
        self.info = dataclasses.replace(self.info, **fields)

    @property
    def complete(self) -> bool:
        """False when the run was interrupted (the report then holds the completed steps)."""
        return self.info.complete

    def inexact_scales(self) -> list[float]:
        """The loss scales of captured values that are not powers of two (a training
        script's own choice, seen by ``fpaudit run``). Counts at another scale shift such
        values by whole binades as if the scale were 2**floor(log2 S), so they may be off
        by one binade; amax, and so the recommendation, divide by S exactly."""
        scales = np.unique(self.records["loss_scale"].to_numpy(dtype=np.float64))
        return [float(s) for s in scales if math.frexp(float(s))[0] != 0.5]

    def incompleteness(self) -> str | None:
        """Why the report is incomplete, in words, or None."""
        info = self.info
        if info.complete:
            return None
        by = info.stopped_by or "an interruption"
        done, asked = info.steps_run, info.steps_requested
        steps = (
            f" after {done} of {asked} step(s)" if done is not None and asked is not None else ""
        )
        return f"the run was stopped by {by}{steps}"

    @property
    def ranks(self) -> list[int]:
        """The torch.distributed ranks that recorded this report ([0] for one process)."""
        return sorted({int(r) for r in self.steps["rank"]} | {int(r) for r in self.records["rank"]})

    def for_rank(self, rank: int) -> Self:
        """What one rank recorded, as a report of its own (record ids renumbered; the
        optional tables keep that rank's rows)."""
        keep = (self.records["rank"] == rank).to_numpy()
        new_id = np.full(len(keep), -1, dtype=np.int64)
        new_id[keep] = np.arange(int(keep.sum()))
        bins = self.bins[keep[self.bins["record_id"].to_numpy()]]
        bins = bins.assign(record_id=new_id[bins["record_id"].to_numpy()].astype(np.int32))
        records = self.records[keep]
        records = records.assign(record_id=np.arange(len(records), dtype=np.int32))
        steps = self.steps[self.steps["rank"] == rank]
        part = type(self)(
            dataclasses.replace(self.info, ranks=1, rank=rank),
            records.reset_index(drop=True),
            bins.reset_index(drop=True),
            steps.reset_index(drop=True),
        )
        for name in OPTIONAL_TABLES:
            table: pd.DataFrame | None = getattr(self, name)
            if table is not None:
                mine = self._rank_of_rows(name, table) == rank
                setattr(part, name, table[mine].reset_index(drop=True))
        return part

    def _rank_of_rows(self, name: str, table: pd.DataFrame) -> np.ndarray:
        """The rank that recorded each row of optional table ``name``: its ``rank`` column
        where it has one, else what the merge of ranks noted, else this report's one rank
        (-1 where a report of several ranks does not know)."""
        if "rank" in table.columns:
            column: np.ndarray = table["rank"].to_numpy(dtype=np.int64)
            return column
        noted = self._table_ranks.get(name)
        if noted is not None:
            return noted
        ranks = self.ranks
        return np.full(len(table), ranks[0] if len(ranks) == 1 else -1, dtype=np.int64)

    # Values derived from the tables (fpaudit.rules.analysis's condensed histograms), by key;
    # valid while the tables are unchanged. Filled only through ``cached``.
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    blocks: pd.DataFrame | None = field(default=None, compare=False)
    """Block-scaled statistics (``--recipe``), or None when no recipe was audited."""
    skips: pd.DataFrame | None = field(default=None, compare=False)
    """``fpaudit run``'s skipped steps and their origins (version 6), or None."""
    # Per optional table without a rank column (origins), the rank of each row, noted
    # when the ranks' parts of a report are merged (``for_rank`` splits them again).
    _table_ranks: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, computed once per ``key`` for this report (a derived value
        such as a condensed histogram: several scales and formats cost one pass)."""
        if key not in self._cache:
            self._cache[key] = compute()
        result: T = self._cache[key]
        return result

    @classmethod
    def from_builder(
        cls,
        builder: ReportBuilder,
        environment: Environment | None = None,
        steps: dict[str, Any] | None = None,
    ) -> Self:
        """The report ``builder`` has collected so far (see ``ReportBuilder.columns``),
        made in ``environment``; ``steps`` replaces its steps table (``fpaudit run`` knows
        more steps than it captured)."""
        records, bins, own_steps = builder.columns()
        offsets_to_bins = np.arange(layout.FIRST_FINITE_BIN, layout.INF_BIN)
        binade, cls_of = layout.bin_binade_and_class(offsets_to_bins)
        offsets = bins.pop("offset")
        bins["binade"] = binade[offsets].astype(np.int16)
        bins["cls"] = cls_of[offsets].astype(np.int8)
        # Through Arrow, so in-memory frames have exactly the dtypes a read gives.
        info = RunInfo(
            environment=environment,
            steps=builder.steps,
            window=builder.window,
            modules=tuple(builder.modules),
        )
        return cls(
            info,
            frame(records, RECORDS_SCHEMA),
            frame(bins, BINS_SCHEMA, BIN_COLUMNS),
            frame(own_steps if steps is None else steps, STEPS_SCHEMA),
        )

    @property
    def recipes(self) -> list[str]:
        """The recipes whose block statistics this report holds (meta ``recipes``)."""
        return list(self.info.recipes)
