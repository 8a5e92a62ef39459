"""fpaudit's metrics and histograms as TensorBoard event files.

:func:`write_report` writes, for every captured step of a report, the metrics of
:mod:`fpaudit.rules.metrics` as scalars (tag = metric name, global step = the step) and
each of the ``top`` modules' backward values as a TensorBoard histogram whose buckets
are the binades (upper edges ``2**(b+1)``, in unscaled units): TensorBoard's histogram
view then shows each module's distribution against the format over steps. It uses
``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package
(``pip install 'fpaudit[tensorboard]'``). :class:`LiveWriter` writes the same as a run
goes (``fpaudit scan --tensorboard DIR``, ``fpaudit run --tensorboard DIR``): each
captured step's metrics and histograms right after the step closes, from the step's own
records (:meth:`fpaudit.Audit.last_step_view`), so a dashboard shows them while training
runs and they equal what ``export`` writes from the finished report.

Known limitations: histograms count nonzero finite values only (zeros and inf/NaN are
the scalars' business); a histogram's ``min``, ``max``, ``sum`` and ``sum_squares``
are those of its bucket edges (the report keeps counts per binade, not the values).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fpaudit.errors import UsageError
from fpaudit.report.store import Report
from fpaudit.rules.metrics import (
    DEFAULT_TOP,
    SKIPPED_STEPS,
    StepView,
    bin_series_of,
    each_step,
    module_tag,
    skip_origin_series,
    skipped_series,
    worst_modules,
)

if TYPE_CHECKING:
    from fpaudit.capture.audit import Audit

__all__ = ["LiveWriter", "summary_writer", "write_report"]

INSTALL_HINT = "pip install 'fpaudit[tensorboard]'"


def summary_writer(directory: Path | str) -> Any:
    """A ``SummaryWriter`` on ``directory``; one clear line (UsageError) when the
    ``tensorboard`` package is missing or the directory cannot be written."""
    writer_class = _writer_class()
    return writer_class(log_dir=str(_writable(Path(directory))))


def _writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise UsageError(
            f"writing TensorBoard event files needs the tensorboard package ({error}); "
            f"{INSTALL_HINT}"
        ) from None
    return SummaryWriter


def _writable(target: Path) -> Path:
    try:
        target.mkdir(parents=True, exist_ok=True)
        if not os.access(target, os.W_OK | os.X_OK):
            raise PermissionError(f"{target} is not writable")
    except OSError as error:
        raise UsageError(f"cannot write TensorBoard event files to {target} ({error})") from None
    return target


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


def _write_step(writer: Any, view: StepView, leave_out: Iterable[str] = ()) -> None:
    """One step's scalars (less ``leave_out``) and its modules' binade histograms."""
    left_out = set(leave_out)
    step = view.metrics.step
    for name, value in view.metrics.values.items():
        if name not in left_out:
            writer.add_scalar(name, value, step)
    for module, (edges, counts) in bin_series_of(view.window, view.modules).items():
        if counts.sum() > 0:
            _histogram(writer, f"fpaudit/backward/{module_tag(module)}", edges, counts, step)


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
            _write_step(writer, StepView(metrics, window, tuple(modules)))
            written += 1
        writer.flush()
        return written
    finally:
        if own:
            writer.close()


class LiveWriter:
    """TensorBoard event files in ``directory`` written as a run goes: call
    :meth:`write_step` after each captured step closes (and its optimizer step is
    marked), :meth:`close` when the run ends. ``fmt`` None: the format of the dtype the
    steps hold their backward values in, else fp16; ``top``: modules with a series and a
    histogram of their own (chosen at the first step, kept for the run).

    ``skips_at_end``: the run learns which steps were skipped only when it ends (``fpaudit
    run`` reads its step scalars in one transfer then): ``fpaudit/skipped_steps`` is left
    out of each step and written for every captured step by :meth:`close`, from the
    finished report. Opening the directory fails with one clear line
    (:class:`~fpaudit.errors.UsageError`); a write that fails during the run is warned
    about once (``warn``, default :func:`warnings.warn`), and the run and its report go on
    without the dashboard. The event file is made at the first step written."""

    def __init__(
        self,
        directory: Path | str,
        fmt: str | None = None,
        *,
        top: int = DEFAULT_TOP,
        skips_at_end: bool = False,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self._writer_class = _writer_class()  # a missing package first: nothing made
        self.directory = _writable(Path(directory))
        self.fmt, self.top, self.skips_at_end = fmt, top, skips_at_end
        self._warn = warn if warn is not None else _warn
        self._writer: Any = None
        self.steps_written = 0
        self.failed: str | None = None
        self._unhook: Callable[[], None] = lambda: None

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter`` (made on first use)."""
        if self._writer is None:
            self._hook_writer_thread()  # (its thread starts writing in the constructor)
            self._writer = self._writer_class(log_dir=str(self.directory))
        return self._writer

    def _hook_writer_thread(self) -> None:
        """The writer's own thread writes the event file; a write that fails there (a
        full disk) is this writer's failure, warned about once, not a traceback on
        stderr: the thread's exceptions go to :meth:`_failed` until :meth:`close`."""
        previous = threading.excepthook

        def hook(args: Any) -> None:
            if type(args.thread).__module__.startswith("tensorboard") and isinstance(
                args.exc_value, Exception
            ):
                self._failed(args.exc_value)
            else:
                previous(args)

        threading.excepthook = hook

        def unhook() -> None:
            if threading.excepthook is hook:  # (not another's hook, set after ours)
                threading.excepthook = previous

        self._unhook = unhook

    def write_step(self, audit: Audit) -> None:
        """The last closed step's metrics and histograms (nothing before a step closed)."""
        if self.failed is None:
            self._guarded(lambda: self._write_last(audit))

    def _write_last(self, audit: Audit) -> None:
        view = audit.last_step_view(self.fmt, top=self.top)
        if view is not None:
            _write_step(self.writer, view, (SKIPPED_STEPS,) if self.skips_at_end else ())
            self.writer.flush()  # on disk now: a dashboard shows the step while the run goes
            self.steps_written += 1

    def close(self, report: Report | None = None) -> None:
        """Write the skip counts (``skips_at_end``, from ``report``), flush and close."""
        if self.failed is None and self.skips_at_end and report is not None:
            self._guarded(lambda: self._write_skips(report))
        if self._writer is not None:
            self._guarded(self._writer.close)
        self._unhook()

    def _write_skips(self, report: Report) -> None:
        for step, skipped in skipped_series(report):
            self.writer.add_scalar(SKIPPED_STEPS, skipped, step)
        for step, by_origin in skip_origin_series(report):
            for name, count in by_origin.items():
                self.writer.add_scalar(name, count, step)

    def _guarded(self, write: Any) -> None:
        try:
            write()
        except Exception as error:  # never stop a run (or lose its report) for a dashboard
            self._failed(error)

    def _failed(self, error: Exception) -> None:
        if self.failed is None:
            self.failed = f"{type(error).__name__}: {error}"
            self._warn(
                f"writing TensorBoard event files to {self.directory} failed "
                f"({self.failed}); the audit goes on without them"
            )


def _warn(message: str) -> None:
    warnings.warn(f"fpaudit: {message}", stacklevel=4)
