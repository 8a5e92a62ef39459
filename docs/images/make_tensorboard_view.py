"""Regenerate ``docs/images/tensorboard-histograms.png``: what TensorBoard's histogram view
shows of ``fpaudit export`` (docs/commands/export.md), drawn from the event file itself.

    .venv/bin/python docs/images/make_tensorboard_view.py

It scans the sample transformer for 4 steps (CPU, seed 0), exports the report with
``fpaudit export --tensorboard``, reads the event file back with tensorboard's own
reader, and draws the histogram of one module per step, offset as TensorBoard's
"offset" view does, with fp16's edges marked: 2**-25 (at or below: zero), 2**-14 (the
smallest normal; below it subnormal) and 65504 (the largest finite).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TARGET = HERE / "tensorboard-histograms.png"
MODULE = "blocks.3.attn"


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fpaudit.integrations.tensorboard import write_report
    from fpaudit.run.scan import ScanOptions, scan

    report = scan(ROOT / "sample_configs" / "transformer.py", ScanOptions(steps=4, device="cpu"))
    with tempfile.TemporaryDirectory() as scratch:
        write_report(report, scratch, "fp16", top=8)
        events = EventAccumulator(scratch, size_guidance={"histograms": 0, "scalars": 0})
        events.Reload()
        histograms = events.Histograms(f"fpaudit/backward/{MODULE}")
        underflow = events.Scalars(f"fpaudit/fp16/underflow/{MODULE}")
    figure, axes = plt.subplots(figsize=(9, 4.5))
    for offset, event in enumerate(reversed(histograms)):
        value = event.histogram_value
        limits = np.log2(np.asarray(value.bucket_limit))  # upper edges 2**(b+1)
        counts = np.asarray(value.bucket) / max(value.num, 1)
        base = offset * 0.05
        axes.fill_between(limits - 0.5, base, base + counts, step="mid", alpha=0.6,
                          label=f"step {event.step}")  # fmt: skip
    for edge, name in ((-25, "2^-25: zero"), (-14, "2^-14: smallest normal"),
                       (np.log2(65504), "65504: largest finite")):  # fmt: skip
        axes.axvline(edge, color="black", linestyle="--", linewidth=0.8)
        axes.text(edge + 0.3, axes.get_ylim()[1] * 0.92, name, fontsize=8)
    title = ", ".join(f"step {s.step}: {100 * s.value:.3g}%" for s in underflow)
    axes.set_title(f"fpaudit/backward/{MODULE} (TensorBoard histograms, offset by step)\n"
                   f"fpaudit/fp16/underflow/{MODULE}: {title}", fontsize=9)  # fmt: skip
    axes.set_xlabel("log2 |backward value| (unscaled, S = 1)")
    axes.set_ylabel("fraction of nonzero values (offset per step)")
    axes.legend(fontsize=8, loc="center left")
    figure.tight_layout()
    partial = TARGET.with_name(f".{TARGET.name}.tmp")
    figure.savefig(partial, format="png", dpi=110)
    os.replace(partial, TARGET)
    print(f"wrote {TARGET.relative_to(ROOT)} ({TARGET.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
