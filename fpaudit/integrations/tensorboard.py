"""fpaudit's metrics and histograms as TensorBoard event files.

:func:`write_report` writes, for every captured step of a report, the metrics of
:mod:`fpaudit.rules.metrics` as scalars (tag = metric name, global step = the step) and
each of the ``top`` modules' backward values as a TensorBoard histogram whose buckets
are the binades (upper edges ``2**(b+1)``, in unscaled units): TensorBoard's histogram
view then shows each module's distribution against the format over steps. It uses
``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package
(``pip install 'fpaudit[tensorboard]'``).

Known limitations: histograms count nonzero finite values only (zeros and inf/NaN are
the scalars' business); a histogram's ``min``, ``max``, ``sum`` and ``sum_squares``
are those of its bucket edges (the report keeps counts per binade, not the values).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from fpaudit.errors import UsageError
from fpaudit.report.store import Report
from fpaudit.rules.metrics import DEFAULT_TOP, bin_series, each_step, module_tag, worst_modules

__all__ = ["summary_writer", "write_report"]

INSTALL_HINT = "pip install 'fpaudit[tensorboard]'"


def summary_writer(directory: Path | str) -> Any:
    """A ``SummaryWriter`` on ``directory``; one clear line (UsageError) when the
    ``tensorboard`` package is missing or the directory cannot be written."""
    target = Path(directory)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise UsageError(
            f"writing TensorBoard event files needs the tensorboard package ({error}); "
            f"{INSTALL_HINT}"
        ) from None
    try:
        target.mkdir(parents=True, exist_ok=True)
        if not os.access(target, os.W_OK | os.X_OK):
            raise PermissionError(f"{target} is not writable")
    except OSError as error:
        raise UsageError(f"cannot write TensorBoard event files to {target} ({error})") from None
    return SummaryWriter(log_dir=str(target))


def _histogram(writer: Any, tag: str, edges: np.ndarray, counts: np.ndarray, step: int) -> None:
    # TensorBoard's bucket i holds values in (limit[i-1], limit[i]]: a binade's upper edge
    lower = edges / 2.0
    writer.add_histogram_raw(
        tag,
        min=float(lower[0]),
        max=float(edges[-1]),
        num=int(counts.sum()),
        sum=float(np.dot(counts, lower)),
        sum_squares=float(np.dot(counts, lower * lower)),
        bucket_limits=[float(e) for e in edges],
        bucket_counts=[int(c) for c in counts],
        global_step=step,
    )


def write_report(
    report: Report,
    directory: Path | str,
    fmt: str = "fp16",
    *,
    top: int = DEFAULT_TOP,
    writer: Any | None = None,
) -> int:
    """Write ``report``'s metrics and histograms to TensorBoard event files in
    ``directory`` (or through ``writer``); returns the number of steps written."""
    own = writer is None
    writer = summary_writer(directory) if writer is None else writer
    try:
        modules = worst_modules(report, fmt, top)
        written = 0
        for metrics, window in each_step(report, fmt, modules=modules):
            for name, value in metrics.values.items():
                writer.add_scalar(name, value, metrics.step)
            for module in modules:
                edges, counts = bin_series(window, module)
                if counts.sum() > 0:
                    tag = f"fpaudit/backward/{module_tag(module)}"
                    _histogram(writer, tag, edges, counts, metrics.step)
            written += 1
        writer.flush()
        return written
    finally:
        if own:
            writer.close()
