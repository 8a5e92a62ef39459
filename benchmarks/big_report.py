"""Write a synthetic report with many histogram rows, to time reading it (gate, recommend).

    python benchmarks/big_report.py OUT_DIR [--rows 10000000]

Records look like a real scan's: 64 records per step, each with ~80 nonzero bins
around realistic gradient magnitudes, as many steps as the row count needs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from fpaudit.kernels import histogram
from fpaudit.report.records import KIND_BACKWARD, KIND_GRAD, RecordKey, ReportBuilder, StepRecords
from fpaudit.report.store import Report

RECORDS_PER_STEP = 64
BINS_PER_RECORD = 80


def build(rows: int, seed: int = 0) -> ReportBuilder:
    generator = np.random.default_rng(seed)
    modules = [f"blocks.{i // 8}.layer{i % 8}" for i in range(RECORDS_PER_STEP)]
    keys = [
        RecordKey(
            KIND_GRAD if i % 8 == 7 else KIND_BACKWARD,
            modules[i],
            "AddmmBackward0",
            "aten.mm.default",
            0,
            "float32",
            True,
        )
        for i in range(RECORDS_PER_STEP)
    ]
    builder = ReportBuilder(modules=modules)
    steps = max(1, rows // (RECORDS_PER_STEP * BINS_PER_RECORD))
    for step in range(steps):
        counts = np.zeros((RECORDS_PER_STEP, histogram.N_BINS), dtype=np.int64)
        for record in range(RECORDS_PER_STEP):
            centre = int(generator.integers(-30, -5))  # binade of the bulk
            binades = np.arange(centre - BINADES // 2, centre + BINADES // 2)
            for cls in (0, 2, 4, 6):
                bins = [histogram.finite_bin(int(b), cls) for b in binades]
                counts[record, bins] = generator.integers(1, 10_000, len(bins))
        amax = np.ldexp(1.0, np.full(RECORDS_PER_STEP, -3))
        builder.add_step(
            StepRecords(keys, counts, amax, np.ones(RECORDS_PER_STEP, dtype=np.int64)),
            loss=1.0,
            loss_scale=1.0,
            seconds=0.0,
            index=step,
        )
    return builder


BINADES = BINS_PER_RECORD // 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=10_000_000)
    args = parser.parse_args(argv)
    report = Report.from_builder(build(args.rows))
    report.update_info(formats=("fp16",), headroom_bits=4)
    report.write(args.out, force=True)
    print(f"{len(report.bins):,} histogram rows, {len(report.records):,} records -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
