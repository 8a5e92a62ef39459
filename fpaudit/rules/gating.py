"""The CI gate: pass when the report measured something, and the underflow at a scale
stays under a threshold.

The verdict is decided here, once: :attr:`GateResult.failures` lists every
reason the gate failed, and every rendering (terminal, JSON, JUnit, GitHub
annotations) reads it instead of deciding again. A reason speaks the library's
terms (``max_underflow``, ``allow_incomplete=True``) and holds the parameters it
names (a :class:`~fpaudit.errors.Wording`), so the command line's renderings say
the flags instead (``--max-underflow``, ``--allow-incomplete``). The gate fails

* on **evidence**: when no nonzero finite value in scope was measured (a
  selection that matched nothing, a run that captured nothing, values that
  were all zero, inf or NaN), when backward values in scope, the loss or the
  parameter gradients of a step hold inf or NaN (unless ``allow_nonfinite``;
  the reason names the first such step; the values of a step whose optimizer
  step a loss scaler skipped are excused: skipping them is the scaler's job),
  and when the report holds no completed step (even with ``allow_incomplete``);
* on **range**: when the underflow fraction (overall, or of any module with
  ``per_module``) exceeds ``max_underflow``, when a live ``--shadow`` report's
  lost fraction (values the device really zeroed) exceeds it, or when any value
  overflows at the scale (a dynamic scaler would skip the step, a static one
  train on inf);
* on an interrupted run, unless ``allow_incomplete``;
* on the run's **error findings** (``fpaudit run``'s misuse rules of severity
  ``error``, such as clipping gradients still multiplied by the loss scale), one
  failure per finding, unless ``allow_errors``;
* against a **baseline** (``baseline`` and ``max_increase``): when the underflow
  fraction rose by more than ``max_increase`` (absolute) over the baseline's at the
  same scale, overall and with ``per_module`` in every module both reports hold, or
  when values overflow where the baseline had none (:mod:`fpaudit.rules.comparison`
  measures the change). The evidence rules above judge the baseline too: a baseline
  that measured nothing cannot pass anything. ``max_underflow`` may then be left out.

Values that do not scale with the loss and underflow or overflow at every scale
(:mod:`fpaudit.rules.analysis`'s ``unscalable_*`` counts) are not a loss-scale problem:
the range rules judge the values the scale answers for, and the result counts the
others apart (:attr:`GateResult.unscalable_overflow`); with ``fail_unscalable``
any such value fails the gate too.

The scale defaults to the recommended one; against a baseline, to the baseline's
recommended scale (the static scale a team calibrated on it: a change that moves the
values moves NEW's own recommendation with them, and would hide the loss); for a
``fpaudit run`` report, to the scales the run trained at, each value at its step's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from fpaudit.bounds import FRACTION
from fpaudit.errors import Named, UsageError, Wording
from fpaudit.numerics.formats import Format, as_format
from fpaudit.numerics.limits import DEFAULT_HEADROOM_BITS
from fpaudit.report.data import ReportData
from fpaudit.report.runinfo import Finding
from fpaudit.report.tables import Records, Steps
from fpaudit.rules import analysis, comparison
from fpaudit.rules.comparison import Change
from fpaudit.rules.recommendation import recommend
from fpaudit.rules.skips import report_skip_verdict
from fpaudit.text import count, module_label, percent, scale_text

# Failure kinds, in the order a rendering lists them.
UNDERFLOW = "underflow"
OVERFLOW = "overflow"
LOST = "lost"
NOTHING_MEASURED = "nothing-measured"
NONFINITE = "nonfinite"
PERSISTENT_SKIPS = "persistent-skips"  # a loss scaler's skips say the run is broken
NO_STEPS = "no-steps"
INCOMPLETE = "incomplete"
UNSCALABLE = "unscalable"
ERROR_FINDING = "error-finding"
UNDERFLOW_INCREASE = "underflow-increase"  # against a baseline
NEW_OVERFLOW = "new-overflow"

# The scale a gate judges at, by where it came from.
RECOMMENDED = "recommended"  # the report's own recommended scale
GIVEN = "given"  # log2_scale given
BASELINE_RECOMMENDED = "the baseline's recommended"  # with a baseline: what BASE calibrated
TRAINED = "trained"  # a run report: each value at the loss scale its step trained at
NONE_RECOMMENDED = "nothing recommended: no nonzero value to size a scale on"


# The scales a gate takes by name: the report's own recommended one, the baseline's, the run's.
BY_RECOMMENDATION, BY_BASELINE, BY_TRAINING = "recommended", "baseline", "trained"
SCALE_NAMES = (BY_RECOMMENDATION, BY_BASELINE, BY_TRAINING)


def _scale_name(
    given: int | str | None, baseline: ReportData | None, trained: tuple[int, int] | None
) -> str | None:
    """The named scale to judge at (None: a number was given), checked against what the
    report and the baseline hold."""
    if isinstance(given, int):
        return None
    if given is None:
        if baseline is not None:
            return BY_BASELINE
        return BY_TRAINING if trained else BY_RECOMMENDATION
    if given not in SCALE_NAMES:
        raise UsageError(
            Named("log2_scale"), f" {given!r}: a power of two or one of {', '.join(SCALE_NAMES)}"
        )
    if given == BY_BASELINE and baseline is None:
        raise UsageError(Named("log2_scale"), " 'baseline' needs ", Named("baseline"))
    if given == BY_TRAINING and trained is None:
        raise UsageError(
            Named("log2_scale"), " 'trained' needs a report of `fpaudit run` that captured "
            "values scaling with the loss",
        )  # fmt: skip
    return given


def scale_words(log2_scale: int, source: str, trained: tuple[int, int] | None = None) -> str:
    """``S = 2^15 = 32768 (recommended)``; a run judged as trained: ``the scales the run
    trained at (S = 2^16)`` or ``(S = 2^10 to 2^16, step by step)``."""
    if source != TRAINED or trained is None:
        return f"S = {scale_text(log2_scale)} ({source})"
    low, high = trained
    if low == high:
        return f"the scale the run trained at (S = {scale_text(low)})"
    return f"the scales the run trained at (S = 2^{low} to 2^{high}, step by step)"


# Subjects that are not modules.
OVERALL = "(all modules)"
EVIDENCE = "(evidence)"
COMPLETE = "(complete)"
FINDINGS = "(findings)"
BASELINE = "(baseline)"  # the baseline report is no evidence


@dataclass(frozen=True)
class Failure:
    """One reason the gate failed: what (a module, ``OVERALL``, ``EVIDENCE`` or
    ``COMPLETE``), which rule (``kinds``) and a one-line reason in plain words
    (``wording``): :attr:`reason` in the library's terms, :meth:`as_flag` as the
    command line says it."""

    subject: str
    kinds: tuple[str, ...]
    wording: Wording

    @property
    def reason(self) -> str:
        """The reason in the library's terms (``vs max_underflow 0.001``)."""
        return str(self.wording)

    def as_flag(self) -> str:
        """The reason as the command line says it (``vs --max-underflow 0.001``)."""
        return self.wording.as_flag()

    def to_dict(self, *, flags: bool = False) -> dict[str, Any]:
        """``subject``, ``kinds`` and ``reason`` (``flags``: as the command line says it)."""
        reason = self.as_flag() if flags else self.reason
        return {"subject": self.subject, "kinds": self.kinds, "reason": reason}


@dataclass(frozen=True)
class Offender:
    """A module (or ``OVERALL``) that broke a range rule, with its numbers at the scale:
    the values the scale answers for (``underflow*``, ``overflow``), the others apart
    (``unscalable_*``), and what a live ``--shadow`` run lost."""

    module: str
    underflow_fraction: float
    underflow: int
    nonzero: int
    overflow: int
    unscalable_underflow: int
    unscalable_overflow: int
    lost: int
    lost_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _shown(default: Any, key: str, after: str) -> Any:
    """A :class:`GatePolicy` field that :meth:`GateResult.to_dict` shows: under ``key``,
    after the result's field ``after`` (where ``gate --json`` has always printed it)."""
    return field(default=default, metadata={"key": key, "after": after})


@dataclass(frozen=True)
class GatePolicy:
    """What a gate judges against (the parameters of :func:`gate`, in its terms): the
    limits, the rules waived, the headroom of the recommended scale and the scope."""

    max_underflow: float | None = _shown(None, "max_underflow", "scale_source")
    per_module: bool = _shown(False, "per_module", "overflow")
    headroom_bits: int = DEFAULT_HEADROOM_BITS
    include_loss: bool = False
    allow_incomplete: bool = _shown(False, "incomplete_allowed", "complete")
    allow_nonfinite: bool = _shown(False, "nonfinite_allowed", "nonfinite_loss_steps")
    fail_unscalable: bool = _shown(False, "fail_unscalable", "unscalable_overflow")
    allow_errors: bool = _shown(False, "errors_allowed", "error_findings")
    max_increase: float | None = _shown(None, "max_increase", "baseline")

    def check(self, baseline: ReportData | None) -> None:
        """A gate needs a limit: ``max_underflow``, or a ``baseline`` with ``max_increase``."""
        max_underflow, max_increase = self.max_underflow, self.max_increase
        FRACTION.check("max_underflow", max_underflow)
        FRACTION.check("max_increase", max_increase)
        if (baseline is None) != (max_increase is None):
            given, missing = ("baseline", "max_increase") if max_increase is None else (
                "max_increase", "baseline")  # fmt: skip
            raise UsageError(Named(given), " needs ", Named(missing), " too")
        if max_underflow is None and baseline is None:
            raise UsageError(
                "a gate needs a limit: ", Named("max_underflow"), ", or ", Named("baseline"),
                " with ", Named("max_increase"),
            )  # fmt: skip


@dataclass(frozen=True)
class GateResult:
    """The verdict (``passed``, and every reason it failed in ``failures``), the numbers at
    the scale it judged, and the ``policy`` it judged by."""

    policy: GatePolicy
    passed: bool
    format: str
    log2_scale: int
    scale: float
    scale_source: str  # RECOMMENDED, GIVEN, BASELINE_RECOMMENDED, TRAINED or NONE_RECOMMENDED
    underflow_fraction: float
    underflow: int
    nonzero: int
    overflow: int
    offenders: list[Offender] = field(default_factory=list)
    complete: bool = True  # False: the report's run was interrupted
    steps_run: int = 0  # completed steps
    nonfinite: int = 0  # inf/NaN backward values in scope (scaler-skipped steps excused)
    nonfinite_loss_steps: int = 0  # steps whose loss was inf or NaN (skipped steps excused)
    # steps whose loss or gradients were inf or NaN that no scaler skipped, the first one
    nonfinite_steps: int = 0
    first_nonfinite_step: int | None = None
    shadow_nonzero: int = 0  # live --shadow: nonzero values of the fp32 re-runs
    lost: int = 0  # live --shadow: of those, zero on the device
    lost_fraction: float = 0.0
    # values that do not scale with the loss and underflow/overflow at every scale
    unscalable_underflow: int = 0
    unscalable_overflow: int = 0
    error_findings: list[Finding] = field(default_factory=list)  # the run's errors
    # against a baseline: its path, the whole model's change, what regressed
    baseline: str | None = None
    baseline_overall: Change | None = None
    regressions: list[Change] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)  # empty exactly when passed
    # TRAINED: the smallest and largest log2 scale the run trained at (log2_scale: the first)
    trained_log2_scales: tuple[int, int] | None = None
    # against a baseline: log2 of each report's recommended scale
    base_recommended: int | None = None
    new_recommended: int | None = None

    @property
    def scale_words(self) -> str:
        """The scale judged at, in words: ``S = 2^15 = 32768 (the baseline's recommended)``."""
        return scale_words(self.log2_scale, self.scale_source, self.trained_log2_scales)

    def to_dict(self, *, flags: bool = False) -> dict[str, Any]:
        """Every field as JSON values, the policy's shown among them (see ``_shown``);
        ``flags``: the reasons as the command line says them (what ``gate --json`` prints)."""
        shown: dict[str, list[tuple[str, Any]]] = {}
        for item in fields(self.policy):
            if "key" in item.metadata:
                entry = (item.metadata["key"], getattr(self.policy, item.name))
                shown.setdefault(item.metadata["after"], []).append(entry)
        data: dict[str, Any] = {}
        for item in fields(self):
            if item.name != "policy":
                data[item.name] = _json_value(getattr(self, item.name), flags)
                data.update(shown.get(item.name, ()))
        return data

    @property
    def reasons(self) -> list[str]:
        """Every failure's one-line reason in the library's terms, in order."""
        return [failure.reason for failure in self.failures]


def _json_value(value: Any, flags: bool) -> Any:
    """A result field as JSON: records by their ``to_dict``, a failure's reason as the
    command line says it with ``flags``."""
    if isinstance(value, list):
        return [_json_value(item, flags) for item in value]
    if isinstance(value, Failure):
        return value.to_dict(flags=flags)
    if isinstance(value, Offender | Finding | Change):
        return value.to_dict()
    return value


def gate(
    report: ReportData,
    fmt: Format | str,
    max_underflow: float | None,
    *,
    log2_scale: int | str | None = None,
    per_module: bool = False,
    headroom_bits: int = DEFAULT_HEADROOM_BITS,
    include_loss: bool = False,
    allow_incomplete: bool = False,
    allow_nonfinite: bool = False,
    fail_unscalable: bool = False,
    allow_errors: bool = False,
    baseline: ReportData | None = None,
    max_increase: float | None = None,
) -> GateResult:
    """Judge ``report`` at ``2**log2_scale`` or at a scale named in :data:`SCALE_NAMES`
    (default: the baseline's recommended scale with a ``baseline``, the scales a ``fpaudit
    run`` report trained at, else the report's recommended scale), against
    ``max_underflow``, against ``baseline`` with ``max_increase``, or both (the
    parameters of :class:`GatePolicy`)."""
    policy = GatePolicy(
        max_underflow=max_underflow, per_module=per_module, headroom_bits=headroom_bits,
        include_loss=include_loss, allow_incomplete=allow_incomplete,
        allow_nonfinite=allow_nonfinite, fail_unscalable=fail_unscalable,
        allow_errors=allow_errors, max_increase=max_increase,
    )  # fmt: skip
    return judge(report, fmt, policy, log2_scale=log2_scale, baseline=baseline)


def judge(
    report: ReportData,
    fmt: Format | str,
    policy: GatePolicy,
    *,
    log2_scale: int | str | None = None,
    baseline: ReportData | None = None,
) -> GateResult:
    """:func:`gate` with its parameters as one :class:`GatePolicy`."""
    fmt = as_format(fmt)
    policy.check(baseline)
    include_loss = policy.include_loss
    scope = analysis.default_scope(report, include_loss)
    trained = analysis.trained_log2_scales(report, scope)
    name = _scale_name(log2_scale, baseline, trained)
    judged = report
    if isinstance(log2_scale, int):
        judged_scale, scale_source = log2_scale, GIVEN
    elif name == BY_BASELINE:  # the static scale a team calibrated on the baseline
        assert baseline is not None
        base_k = recommend(baseline, fmt, policy.headroom_bits, include_loss=include_loss)
        judged_scale = base_k.log2_scale or 0
        scale_source = BASELINE_RECOMMENDED if base_k.log2_scale is not None else NONE_RECOMMENDED
    elif name == BY_TRAINING:
        assert trained is not None
        judged, judged_scale = analysis.as_trained(report), 0  # each value at its own scale
        scale_source = TRAINED
    else:
        recommended = recommend(report, fmt, policy.headroom_bits, include_loss=include_loss)
        judged_scale = recommended.log2_scale or 0
        scale_source = RECOMMENDED if recommended.log2_scale is not None else NONE_RECOMMENDED
    log2_scale = trained[0] if scale_source == TRAINED and trained else judged_scale
    overall = analysis.totals(judged, fmt, judged_scale, scope=scope)
    where = f"{fmt.name} at {scale_words(log2_scale, scale_source, trained)}"

    failures, offenders = _range_failures(judged, fmt, judged_scale, scope, overall, policy, where)
    compared = None if baseline is None else comparison.compare(
        baseline, report, fmt, log2_scale=log2_scale, headroom_bits=policy.headroom_bits,
        include_loss=include_loss,
    )  # fmt: skip
    regressions = _regressions(compared, policy.per_module, policy.max_increase)
    failures += [
        _regression_failure(change, policy.max_increase or 0.0, where) for change in regressions
    ]
    evidence = _all_evidence(report, scope, overall, policy.allow_nonfinite, include_loss)
    failures += evidence.failures + _run_failures(
        report, policy.allow_incomplete, policy.allow_errors
    )
    failures += _skip_failures(report, fmt, policy.allow_nonfinite)
    if baseline is not None:
        failures += _baseline_failures(baseline, fmt, log2_scale, policy)
    return GateResult(
        policy=policy,
        passed=not failures,
        format=fmt.name,
        log2_scale=log2_scale,
        scale=math.ldexp(1.0, log2_scale),
        scale_source=scale_source,
        trained_log2_scales=trained,
        base_recommended=None if compared is None else compared.base_recommended,
        new_recommended=None if compared is None else compared.new_recommended,
        offenders=offenders,
        complete=report.complete,
        steps_run=evidence.steps_run,
        nonfinite=evidence.nonfinite,
        nonfinite_loss_steps=evidence.loss_steps,
        nonfinite_steps=len(evidence.broken_steps),
        first_nonfinite_step=evidence.broken_steps[0] if evidence.broken_steps else None,
        error_findings=_errors(report),
        baseline=None if baseline is None else str(baseline.path or ""),
        baseline_overall=None if compared is None else compared.overall,
        regressions=regressions,
        failures=failures,
        **_numbers(overall, GateResult),
    )


# The numbers of a Totals that a gate's result and its offenders show, by the name they
# show them under: the judged counts (the values the scale answers for) as the plain
# names, the values no scale fixes apart, and what a live --shadow run lost.
_FROM_TOTALS = {
    "underflow_fraction": "judged_underflow_fraction",
    "underflow": "judged_underflow",
    "nonzero": "nonzero",
    "overflow": "judged_overflow",
    "shadow_nonzero": "shadow_nonzero",
    "lost": "lost",
    "lost_fraction": "lost_fraction",
    "unscalable_underflow": "unscalable_underflow",
    "unscalable_overflow": "unscalable_overflow",
}


def _numbers(row: analysis.Totals, record: type[GateResult | Offender]) -> dict[str, Any]:
    """The fields of ``record`` that :data:`_FROM_TOTALS` maps, read from ``row``."""
    names = {item.name for item in fields(record)}
    return {name: getattr(row, total) for name, total in _FROM_TOTALS.items() if name in names}


@dataclass(frozen=True)
class _Evidence:
    """What the evidence rules found in one report, and their failures."""

    steps_run: int
    nonfinite: int
    loss_steps: int
    broken_steps: list[int]  # loss or gradients inf/NaN, no scaler skipped them
    failures: list[Failure]


def _all_evidence(
    report: ReportData,
    scope: analysis.Scope,
    overall: analysis.Totals,
    allow_nonfinite: bool,
    include_loss: bool,
) -> _Evidence:
    steps_run = _steps_run(report)
    nonfinite, loss_steps = _nonfinite(report, scope)
    broken = analysis.nonfinite_steps(report)
    failures = _evidence(
        report, overall, steps_run, nonfinite, broken, allow_nonfinite, include_loss
    )
    return _Evidence(steps_run, nonfinite, loss_steps, broken, failures)


def _baseline_failures(
    baseline: ReportData, fmt: Format, log2_scale: int, policy: GatePolicy
) -> list[Failure]:
    """The evidence rules, the complete rule and the error findings, on the baseline:
    each failure said as the baseline's (``BASELINE``)."""
    scope = analysis.default_scope(baseline, policy.include_loss)
    overall = analysis.totals(baseline, fmt, log2_scale, scope=scope)
    found = _all_evidence(
        baseline, scope, overall, policy.allow_nonfinite, policy.include_loss
    ).failures
    found += _run_failures(baseline, policy.allow_incomplete, policy.allow_errors)
    return [
        Failure(BASELINE, failure.kinds, Wording("the baseline: ", *failure.wording.parts))
        for failure in found
    ]


def _errors(report: ReportData) -> list[Finding]:
    """The run's error findings (``fpaudit run``'s misuse rules of severity ``error``)."""
    return [finding for finding in report.info.findings if finding.severity == "error"]


def _run_failures(report: ReportData, allow_incomplete: bool, allow_errors: bool) -> list[Failure]:
    """An interrupted run (unless allowed), then one failure per error finding (unless
    allowed)."""
    failures = [] if report.complete or allow_incomplete else [_INCOMPLETE_FAILURE]
    if not allow_errors:
        failures += [_finding_failure(item) for item in _errors(report)]
    return failures


def _regressions(
    compared: comparison.Comparison | None, per_module: bool, limit: float | None
) -> list[Change]:
    """The modules (with ``per_module``; those in both reports) and the whole model whose
    underflow rose by more than ``limit`` or that overflow where the baseline did not
    (none without a baseline)."""
    if compared is None or limit is None:
        return []
    rows = [row for row in compared.rows if row.present == comparison.BOTH] if per_module else []
    return [change for change in [*rows, compared.overall] if _regressed(change, limit)]


def _regressed(change: Change, limit: float) -> tuple[str, ...]:
    kinds = []
    if (change.underflow_change or 0.0) > limit:
        kinds.append(UNDERFLOW_INCREASE)
    if change.base_overflowed == 0 and (change.new_overflowed or 0) > 0:
        kinds.append(NEW_OVERFLOW)
    return tuple(kinds)


def _regression_failure(change: Change, limit: float, where: str) -> Failure:
    kinds = _regressed(change, limit)
    overall = change.module == comparison.OVERALL
    subject = "overall" if overall else f"module {module_label(change.module)}"
    base, new = change.base_underflow or 0.0, change.new_underflow or 0.0
    parts: list[str | Named] = [
        f"{subject}: underflow {percent(new)} vs the baseline's {percent(base)} "
        f"(+{percent(new - base)}, over the limit {percent(limit)} of "
    ]
    parts += [Named("max_increase"), ")"]
    if NEW_OVERFLOW in kinds:
        parts.append(
            f"; {count(change.new_overflowed or 0)} value(s) overflow where the baseline had none"
        )
    parts.append(f"; {where}")
    return Failure(OVERALL if overall else change.module, kinds, Wording(*parts))


def _range_failures(
    report: ReportData,
    fmt: Format,
    log2_scale: int,
    scope: analysis.Scope,
    overall: analysis.Totals,
    policy: GatePolicy,
    where: str,
) -> tuple[list[Failure], list[Offender]]:
    """The underflow/overflow failures (each module's, then the overall one) and offenders;
    none without ``max_underflow`` (a gate against a baseline alone)."""
    failures: list[Failure] = []
    offenders: list[Offender] = []
    max_underflow, fail_unscalable, per_module = (
        policy.max_underflow, policy.fail_unscalable, policy.per_module)  # fmt: skip
    if max_underflow is None:
        return failures, offenders
    if per_module:
        for row in analysis.module_table(report, fmt, log2_scale, scope=scope).itertuples():
            numbers = analysis.Totals.from_row(row._asdict())
            kinds = _range_kinds(numbers, max_underflow, fail_unscalable)
            if kinds:
                module = str(row.module)
                offenders.append(_offender(module, numbers))
                subject = f"module {module_label(module)}"
                reason = _range_reason(subject, numbers, kinds, max_underflow, where)
                failures.append(Failure(module, kinds, reason))
    overall_kinds = _range_kinds(overall, max_underflow, fail_unscalable)
    if overall_kinds:
        if not per_module:
            offenders.append(_offender(OVERALL, overall))
        reason = _range_reason("overall", overall, overall_kinds, max_underflow, where)
        failures.append(Failure(OVERALL, overall_kinds, reason))
    return failures, offenders


_INCOMPLETE_FAILURE = Failure(
    COMPLETE,
    (INCOMPLETE,),
    Wording(
        "the report is incomplete (its run was interrupted), which fails the gate; pass ",
        Named("allow_incomplete", True),
        " to judge it anyway",
    ),
)


def _range_kinds(
    numbers: analysis.Totals, max_underflow: float, fail_unscalable: bool
) -> tuple[str, ...]:
    """Which range rules a module's (or the whole model's) numbers break: the values the
    scale answers for (``judged_*``), and with ``fail_unscalable`` the others."""
    kinds = []
    if numbers.judged_underflow_fraction > max_underflow:
        kinds.append(UNDERFLOW)
    if numbers.lost_fraction > max_underflow:
        kinds.append(LOST)
    if numbers.judged_overflow > 0:
        kinds.append(OVERFLOW)
    unscalable = numbers.unscalable_underflow + numbers.unscalable_overflow
    if fail_unscalable and unscalable > 0:
        kinds.append(UNSCALABLE)
    return tuple(kinds)


def _range_reason(
    subject: str, numbers: analysis.Totals, kinds: tuple[str, ...], limit: float, where: str
) -> Wording:
    parts: list[str | Named] = []
    if UNDERFLOW in kinds:
        parts += [
            f"underflow {percent(numbers.judged_underflow_fraction)} exceeds the "
            f"limit {percent(limit)} (",
            Named("max_underflow"),
            ")",
        ]
    if LOST in kinds:
        parts.append(
            f"the device lost {percent(numbers.lost_fraction)} of its values at the "
            f"run's loss scale "
            f"({count(numbers.lost)} of {count(numbers.shadow_nonzero)} nonzero in the "
            f"fp32 re-run), over the limit {percent(limit)}"
        )
    if OVERFLOW in kinds:
        parts.append(f"{count(numbers.judged_overflow)} value(s) overflow")
    if UNSCALABLE in kinds:
        parts.append(
            f"{_unscalable_text(numbers)} at every scale (they do not scale with the loss), "
            "which fails the gate with "
        )
        parts.append(Named("fail_unscalable", True))
    joined: list[str | Named] = []
    for part in parts:  # " and " between the rules; a Named ends the part before it
        if joined and isinstance(joined[-1], str) and isinstance(part, str):
            joined.append(" and ")
        joined.append(part)
    return Wording(
        f"{subject}: ",
        *joined,
        f"; {count(numbers.judged_underflow)} of {count(numbers.nonzero)} nonzero backward "
        f"values underflow, {count(numbers.judged_overflow)} overflow; {where}",
    )


def _unscalable_text(numbers: analysis.Totals) -> str:
    """``"480 value(s) overflow"``, ``"3 value(s) underflow"`` or both."""
    parts = []
    if numbers.unscalable_overflow:
        parts.append(f"{count(numbers.unscalable_overflow)} value(s) overflow")
    if numbers.unscalable_underflow:
        parts.append(f"{count(numbers.unscalable_underflow)} value(s) underflow")
    return " and ".join(parts)


def _finding_failure(finding: Finding) -> Failure:
    """One error finding of ``fpaudit run``: the gate fails on it unless told otherwise."""
    return Failure(
        FINDINGS,
        (ERROR_FINDING,),
        Wording(
            f"the run found an error: {finding.code} at {finding.where} ({finding.message}); pass ",
            Named("allow_errors", True),
            " to gate on the values alone",
        ),
    )


def _steps_run(report: ReportData) -> int:
    done = report.info.steps_run
    if done is not None:
        return done
    return int(report.steps[Steps.step].nunique()) if len(report.steps) else 0


def _nonfinite(report: ReportData, scope: analysis.Scope) -> tuple[int, int]:
    """Inf/NaN backward values in scope and steps with an inf/NaN loss, leaving out
    the steps whose optimizer step a loss scaler skipped (what a scaler is for). Only a
    report with a loss scaler (``fpaudit run`` with a GradScaler) excuses skipped steps:
    a scan skips the optimizer on inf/NaN because the run is broken."""
    steps = report.steps
    excused = steps[Steps.skipped].to_numpy(dtype=bool)
    if report.info.scaler is None:
        excused = np.zeros(len(steps), dtype=bool)
    skipped = set(steps.loc[excused, Steps.step].astype(int))
    records = scope.select(report.records)
    counted = np.ones(len(records), dtype=bool)
    if skipped:
        single = records[Records.steps].to_numpy() == 1
        in_skipped = records[Records.step].astype(int).isin(skipped).to_numpy()
        counted &= ~(single & in_skipped)
    values = (
        records[Records.infs].to_numpy()[counted].sum()
        + records[Records.nans].to_numpy()[counted].sum()
    )
    bad_loss = ~steps[Steps.loss_finite].to_numpy(dtype=bool) & ~excused
    return int(values), int(bad_loss.sum())


def _evidence(
    report: ReportData,
    overall: analysis.Totals,
    steps_run: int,
    nonfinite: int,
    broken_steps: list[int],
    allow_nonfinite: bool,
    include_loss: bool,
) -> list[Failure]:
    """The failures that say the report is not evidence of anything."""
    failures = []
    if steps_run == 0:
        failures.append(
            Failure(
                EVIDENCE,
                (NO_STEPS,),
                Wording(
                    "the report holds no completed step: there is nothing to judge (",
                    Named("allow_incomplete", True),
                    " does not accept an empty report)",
                ),
            )
        )
    if overall.nonzero == 0 and overall.shadow_nonzero == 0:
        failures.append(Failure(EVIDENCE, (NOTHING_MEASURED,), _nothing_reason(report, overall)))
    elif (
        (compiled := report.info.compiled) is not None
        and compiled.inductor
        and not compiled.observed_backward_runs
    ):
        # A compiled model's backward values are its compiled graph's: the ops it hands
        # back to aten and the parameter gradients alone are a subset, not evidence.
        not_covered = list(compiled.not_covered)
        failures.append(
            Failure(
                EVIDENCE,
                (NOTHING_MEASURED,),
                Wording(
                    "measured nothing of the compiled backward: no value it stored was "
                    "observed (" + ("; ".join(not_covered) or "no compiled backward ran") + ")"
                ),
            )
        )
    if (nonfinite or broken_steps) and not allow_nonfinite:
        parts = []
        if nonfinite:
            parts.append(f"{nonfinite:,} backward value(s) in scope are inf or NaN")
        if broken_steps:
            parts.append(
                f"the loss or gradients are inf or NaN in {len(broken_steps):,} step(s) that "
                f"no loss scaler skipped (first: step {broken_steps[0]})"
            )
        failures.append(
            Failure(
                EVIDENCE,
                (NONFINITE,),
                Wording(
                    f"{' and '.join(parts)}: counts of the finite values alone do not show the "
                    "run is healthy; pass ",
                    Named("allow_nonfinite", True),
                    " to judge them anyway",
                ),
            )
        )
    return failures


def _skip_failures(report: ReportData, fmt: Format, allow_nonfinite: bool) -> list[Failure]:
    """A run whose loss scaler's skips are persistent (``rules.skips``): its numbers are
    of a broken run, whatever they say (the skipped steps' inf/NaN are excused above)."""
    verdict = report_skip_verdict(report, fmt)
    if verdict is None or not verdict.persistent or allow_nonfinite:
        return []
    said = f"the loss scaler's skips are persistent: {verdict.reason}; pass "
    wording = Wording(said, Named("allow_nonfinite", True), " to judge the run anyway")
    return [Failure(EVIDENCE, (PERSISTENT_SKIPS,), wording)]


def _nothing_reason(report: ReportData, overall: analysis.Totals) -> Wording:
    """Why the scope holds no nonzero finite value, as far as the report tells."""
    globs: list[str | Named] = []  # Selection's fields: "modules a b" (--module a b)
    for key, value in (report.info.selection or {}).items():
        globs += ["; "] * bool(globs) + [Named(key), f" {' '.join(map(str, value))}"]
    hints = []
    if report.records.empty:
        hints.append("the report holds no records: nothing was captured, or no backward ran")
    else:
        elements, zeros = overall.elements, overall.zeros
        special = overall.nonfinite
        hints.append(f"{elements:,} value(s) in scope: {zeros:,} zero, {special:,} inf or NaN")
    out_of_range = report.info.out_of_range
    if out_of_range:
        hints.append(f"{out_of_range:,} value(s) lay outside fp32's range and were not binned")
    said: list[str | Named] = ["the scan's selection was ", *globs, "; "] if globs else []
    return Wording(
        "measured nothing: no nonzero finite backward value in scope, so underflow 0% proves "
        "nothing (",
        *said,
        "; ".join(hints),
        ")",
    )


def judged_module_table(
    report: ReportData, result: GateResult, *, include_loss: bool = False
) -> Any:
    """Per module, the numbers at the scale ``result`` judged ``report`` at (a run judged at
    the scales it trained at: each value at its step's), in ``result``'s format and scope."""
    scope = analysis.default_scope(report, include_loss)
    if result.scale_source == TRAINED:
        return analysis.module_table(analysis.as_trained(report), result.format, 0, scope=scope)
    return analysis.module_table(report, result.format, result.log2_scale, scope=scope)


def _offender(module: str, row: analysis.Totals) -> Offender:
    return Offender(module=module, **_numbers(row, Offender))
