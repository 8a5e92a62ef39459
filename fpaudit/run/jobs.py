"""A scan or a run, to a report on disk: one call each.

:func:`report_target` checks where a report goes before any work (the rules of
:mod:`fpaudit.report.outputs`); :func:`scan_to_report` and :func:`run_to_report` then do
everything between the parsed options and the summary: the output lock, the write
(whole, or the completed steps of a stopped or failed run, never over a report that
completed more steps unless ``replace_partial``), torchrun's parts and barriers, the
dashboard's closing, and what a child that model code forked does (nothing: it never
writes, unlocks, closes or speaks for the audit).

How a command ends other than with its summary is a typed exception, raised once what
was done is safe on disk: :class:`~fpaudit.errors.StoppedRun`,
:class:`~fpaudit.errors.StoppedWhileWriting`, :class:`~fpaudit.errors.ScriptExited`,
:class:`~fpaudit.errors.ForkedChildEnded` or an :class:`~fpaudit.errors.FpauditError`;
the CLI maps each to its exit status and words (``fpaudit.cli.commands``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol

from fpaudit._process import Owner
from fpaudit.errors import (
    ForkedChildEnded,
    FpauditError,
    Interrupted,
    ModelFileError,
    Named,
    ReportExists,
    ScriptExited,
    StoppedRun,
    StoppedWhileWriting,
    UsageError,
    Wording,
)
from fpaudit.report.outputs import check_creatable

if TYPE_CHECKING:
    from fpaudit.capture.audit import Audit
    from fpaudit.numerics.formats import Format
    from fpaudit.report.runinfo import RunMeta
    from fpaudit.report.store import Report
    from fpaudit.run.scan import ScanFailed, ScanOptions, StepProgress
    from fpaudit.run.training import RunOptions, RunOutcome

# The exit status of a scan whose model code failed or exited (bad input: 2).
_FAILED = ModelFileError.exit_code
# bytes a report adds below its path: its staging sibling's longer name
# (fpaudit.report.outputs.hidden_sibling) and the longest file inside it (rank
# prefixes, origins.parquet, a lock)
REPORT_INSIDE_BYTES = 96


@dataclass(frozen=True)
class ReportTarget:
    """Where a report goes: ``path`` absolute (model code may chdir), ``shown`` as the
    user gave it (what messages say); ``force`` replaces a report there, and
    ``replace_partial`` lets the completed steps of a stopped run replace a report that
    completed more."""

    path: Path
    shown: str
    force: bool = False
    replace_partial: bool = False


def report_target(
    given: str | os.PathLike[str], *, force: bool = False, replace_partial: bool = False
) -> ReportTarget:
    """Check ``given`` (the ``out`` option) before any work: a name for a new directory
    that :func:`fpaudit.report.outputs.make_parent` can create, with room for the
    report's files, and no report there unless ``force``."""
    text = str(given)
    if not text.strip() or Path(text).name in ("", ".", ".."):
        raise UsageError(
            Named("out"), f" {text!r} names no new directory; give the report a name, for "
            "example ", Named("out", "fpaudit-report"),
        )  # fmt: skip
    path = Path(os.path.abspath(text))
    check_creatable(path, "out", given=text, inside=REPORT_INSIDE_BYTES)
    if path.exists() and not force:
        raise ReportExists(text)
    return ReportTarget(path, text, force, replace_partial)


class Dashboard(Protocol):
    """What scan and run feed as they go (a TensorBoard ``LiveWriter``): each captured
    step's audit, then ``close`` with the run's report (None when it failed)."""

    def write_step(self, audit: Audit) -> None: ...

    def close(self, report: Report | None = None) -> None: ...


# A progress display over N steps: a context that gives the callback each step calls.
Progress = Callable[[int], AbstractContextManager[Callable[["StepProgress"], None] | None]]


@dataclass(frozen=True)
class ScanDone:
    """A scan written to disk: its ``report`` (under torchrun every rank's, merged) and
    the ranks whose batches ended first (every rank stopped there)."""

    report: Report
    batches_ended_on: tuple[int, ...] = ()


def scan_to_report(
    model_file: Path,
    options: ScanOptions,
    target: ReportTarget,
    *,
    meta: RunMeta | None = None,
    progress: Progress | None = None,
    dashboard: Callable[[], Dashboard] | None = None,
) -> ScanDone | None:
    """Scan ``model_file`` and write the report to ``target``; None on a torchrun rank
    other than rank 0, which wrote its part (rank 0 locks, shows ``progress``, feeds the
    ``dashboard`` it makes, and reads the merged report back).

    A stopped scan keeps its completed steps and raises :class:`StoppedRun`; one whose
    model code exited keeps them and raises a :class:`ModelFileError`; under torchrun a
    rank that failed writes its own steps apart (``OUT.rankN``) and raises the failing
    rank's error."""
    from fpaudit.run import distributed

    owner = Owner()  # a child model code forks never writes, unlocks or closes
    lead = distributed.leads()
    live = dashboard() if dashboard is not None and lead else None
    try:
        report = _scan_and_write(model_file, options, target, meta, live, progress, owner)
    finally:
        if live is not None and owner.here():
            live.close()
    if not distributed.active():
        return ScanDone(report)
    distributed.shutdown()  # every rank wrote its part: meet at a barrier, then leave
    if not lead:
        return None
    from fpaudit.report.store import Report

    merged = Report.read(target.path)  # every rank's part
    ended = merged.info.settings.get("batches_ended_on")
    return ScanDone(merged, tuple(ended or ()))


def _scan_and_write(
    model_file: Path,
    options: ScanOptions,
    target: ReportTarget,
    meta: RunMeta | None,
    live: Dashboard | None,
    progress: Progress | None,
    owner: Owner,
) -> Report:
    from fpaudit.report.files import output_lock
    from fpaudit.run import distributed
    from fpaudit.run.scan import ScanExited, ScanFailed, ScanInterrupted, scan

    lead = distributed.leads()
    lock = output_lock(target.path) if lead else contextlib.nullcontext()
    on_captured = live.write_step if live is not None else None
    shown = progress(options.steps) if progress is not None and lead else None
    with lock:
        try:
            with shown if shown is not None else contextlib.nullcontext() as advance:
                report = scan(
                    model_file, options, on_step=advance, on_captured=on_captured, meta=meta
                )
        except ScanInterrupted as stopped:  # keep the completed steps
            if not owner.here():
                raise ForkedChildEnded(stopped.exit_code) from None
            kept, while_writing = _write_partial(stopped.report, target, stopping=True)
            done = stopped.report.info.steps_run or 0
            raise StoppedRun(
                stopped, done, options.steps, target.shown, kept, while_writing=while_writing
            ) from None
        except ScanFailed as failed:  # torchrun: a rank failed; each keeps its steps apart
            if not owner.here():
                raise ForkedChildEnded(_FAILED) from None
            _write_alone(failed, target)
        except ScanExited as exited:  # model code called sys.exit/os._exit
            if not owner.here():
                raise ForkedChildEnded(_FAILED) from None
            kept, _ = _write_partial(exited.report, target)
            done = exited.report.info.steps_run or 0
            where = f"the {done} completed step(s) are in {target.shown}, marked incomplete"
            raise ModelFileError(f"{exited}; ", *(kept.parts if kept else (where,))) from None
        if not owner.here():
            raise ForkedChildEnded(0)
        _write(lambda: distributed.write_report(report, target.path, force=target.force), report)
    return report


def _write_alone(failed: ScanFailed, target: ReportTarget) -> NoReturn:
    """Under torchrun, after a rank failed: write this rank's completed steps alone to
    ``OUT.rankN`` (the ranks cannot meet to write one report: the failed one is gone)
    and fail with the failing rank's words. SIGINT and SIGTERM (torchrun stops every
    rank once one exits) no longer interrupt: this rank is ending, within seconds."""
    for number in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread: nothing to hold
            signal.signal(number, signal.SIG_IGN)
    report, done = failed.report, failed.report.info.steps_run or 0
    rank = int(os.environ.get("RANK", "0"))
    own = target.path.with_name(f"{target.path.name}.rank{rank}")
    shown = f"{target.shown}.rank{rank}"
    try:
        report.write(own, force=target.force)
        kept = f"this rank's {done} completed step(s) are in {shown}, marked incomplete"
    except Exception as problem:  # the failure is the news; the write a note in its line
        kept = f"this rank's {done} completed step(s) could not be written to {shown} ({problem})"
    error = failed.error
    raise type(error)(*error.wording.parts, f"; {kept}")


def _write_partial(
    report: Report, target: ReportTarget, *, stopping: bool = False
) -> tuple[Wording | None, StoppedWhileWriting | None]:
    """Write a report of a stopped or failed run, unless it would replace a report that
    completed more steps (``replace_partial`` allows it). Returns why the existing report
    was kept (None when written) and, for a run already ``stopping``, the signal that
    arrived during the write (the write finished first)."""
    from fpaudit.report.files import steps_in
    from fpaudit.run import distributed

    done = report.info.steps_run or 0
    existing = steps_in(target.path) if target.path.exists() else None
    if existing is not None and done < existing and not target.replace_partial:
        kept = Wording(
            f"kept the existing report {target.shown} ({existing} completed step(s)): this "
            f"run completed {done}; pass ", Named("replace_partial", True),
            " to replace it anyway",
        )  # fmt: skip
        return kept, None
    try:
        _write(lambda: distributed.write_report(report, target.path, force=target.force), report)
    except StoppedWhileWriting as second:
        if not stopping:  # a signal during the write of a stopped run: already stopping
            raise
        return None, second
    return None, None


def _write(write: Callable[[], object], report: Report) -> None:
    """Run ``write``; a Ctrl-C or SIGTERM during it waits for the end (the write defers
    them) and is then raised as :class:`StoppedWhileWriting`, the report written whole."""
    try:
        write()
    except KeyboardInterrupt as error:
        if report.path is None:
            raise
        stopped = error if isinstance(error, Interrupted) else Interrupted()
        raise StoppedWhileWriting(stopped, report.path) from None


@dataclass(frozen=True)
class RunDone:
    """A run written to disk: its ``report``, the ``format`` it is read in, the run's
    ``outcome`` (findings, how the script ended), ``while_writing`` (a signal that came
    during the write of a stopped run; the write finished first) and ``ending``: what
    ends the command once its summary is shown (None: a plain success)."""

    report: Report
    format: Format
    outcome: RunOutcome
    ending: FpauditError | StoppedRun | ScriptExited | None = None
    while_writing: StoppedWhileWriting | None = None


def run_to_report(
    script: Path,
    args: Sequence[str],
    options: RunOptions,
    target: ReportTarget,
    *,
    fmt: Format | None = None,
    meta: RunMeta | None = None,
    dashboard: Callable[[], Dashboard] | None = None,
) -> RunDone:
    """Run ``script`` with ``args`` under the audit and write the report to ``target``
    (``fmt`` None: the format of the dtype its steps held, ``rules.summary.run_format``).

    The completed steps of a stopped, failed or exited script are written too, unless a
    report there completed more. A script that made no optimizer step writes nothing
    and raises (its error, :class:`ScriptExited` with its status, or a
    :class:`ModelFileError`); one whose report was kept instead raises at once; else the
    :class:`RunDone`'s ``ending`` says how the command ends after its summary."""
    from fpaudit.report.files import output_lock
    from fpaudit.rules.summary import run_format
    from fpaudit.run.training import run_script

    owner = Owner()  # the script's os.fork() children never write, unlock or close
    live = dashboard() if dashboard is not None else None
    with output_lock(target.path):
        on_captured = live.write_step if live is not None else None
        try:
            outcome = run_script(script, list(args), options, meta=meta, on_captured=on_captured)
        except BaseException:
            if live is not None and owner.here():
                live.close()  # what was written stays readable
            raise
        if live is not None and owner.here():
            live.close(outcome.report)
        if not owner.here():  # the script's os.fork() child ended its script: exit as it would
            raise ForkedChildEnded(outcome.exit_status)
        report = outcome.report
        fmt = fmt or run_format(report)
        report.update_info(formats=(fmt.name,))
        if not report.info.steps_run and outcome.interrupted is None:
            _nothing_run(script, outcome)
        kept, while_writing = None, None
        if outcome.interrupted is not None or outcome.failure is not None or outcome.exited:
            stopping = outcome.interrupted is not None
            kept, while_writing = _write_partial(report, target, stopping=stopping)
        else:
            _write(lambda: report.write(target.path, force=target.force), report)
    done = report.info.steps_run or 0
    if kept is not None:
        _kept_instead(outcome, done, target, kept)
    ending: FpauditError | StoppedRun | ScriptExited | None = None
    if outcome.interrupted is not None:
        ending = StoppedRun(outcome.interrupted, done, options.max_steps, target.shown)
    elif outcome.failure is not None:
        ending = outcome.failure
    elif outcome.exited:
        ending = ScriptExited(outcome.exit_status, outcome.exit_message)
    return RunDone(report, fmt, outcome, ending, while_writing)


def _nothing_run(script: Path, outcome: RunOutcome) -> NoReturn:
    """End a run that made no optimizer step: its error, the script's own status, or
    "nothing to audit"."""
    if outcome.failure is not None:
        raise outcome.failure  # nothing done, nothing to keep
    if outcome.exited:  # nothing to audit, and the script's own status
        raise ScriptExited(
            outcome.exit_status, outcome.exit_message,
            error=Wording(f"{script} exited before an optimizer step: nothing to audit"),
        )  # fmt: skip
    raise ModelFileError(
        f"{script} finished without an optimizer step: nothing to audit (fpaudit run "
        "watches torch.optim optimizers and torch.amp.GradScaler)"
    )


def _kept_instead(outcome: RunOutcome, done: int, target: ReportTarget, kept: Wording) -> NoReturn:
    """End a stopped or failed run whose report was not written over a fuller one."""
    if outcome.interrupted is not None:
        raise StoppedRun(outcome.interrupted, done, None, target.shown, kept)
    if outcome.exited:
        raise ScriptExited(outcome.exit_status, outcome.exit_message, note=kept)
    raise ModelFileError(f"{outcome.failure}; ", *kept.parts)
