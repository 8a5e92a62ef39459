"""What a report says about its run: one frozen dataclass, one schema.

A report's ``meta.json`` is a JSON object (its format is unchanged, so reports of
every readable schema version still read). :class:`RunInfo` is the typed view of
the fields that several modules write or read: commands that write a report
(``scan``, ``run``, the training integrations) build one and merge
:meth:`RunInfo.to_meta` into the metadata (``Report.record_run``); a field set on
its own later (the capture's ``out_of_range``, ``run``'s ``formats``) goes through
``Report.update_info`` (:meth:`RunInfo.entries`); readers use ``Report.info``
(:meth:`RunInfo.from_meta`), never string keys. Fields a report lacks (an older
report, or one built by the ``Audit`` API without a command) read as their
defaults. ``fpaudit run``'s findings are :class:`Finding` objects, and what the
command line adds (its argv, config and options) is a :class:`RunMeta`. Plain Python:
no pandas, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from fpaudit.numerics.formats import AMP_NAMES

__all__ = [
    "AMP_NAMES",
    "AutocastPrediction",
    "CompiledInfo",
    "Finding",
    "OpDtypes",
    "RunInfo",
    "RunMeta",
    "ScalerInfo",
    "SkipStatistics",
]

# Written by every command that writes a report, None included (readers have always
# found them there); the other fields are written only when set.
_ALWAYS = (
    "command",
    "steps_requested",
    "steps_run",
    "complete",
    "stopped_by",
    "selection",
    "amp_dtype",
)  # and "amp", derived from amp_dtype


# Not stamped by to_meta (a run's end must not overwrite them with defaults): written
# with the tables (Report.from_builder, the capture through Report.update_info) or by
# the command beside the run's fields.
_READ_ONLY = (
    "steps", "modules", "out_of_range", "recipes", "formats", "headroom_bits", "include_loss",
    "findings", "autocast", "compiled",
)  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """One misuse finding of ``fpaudit run`` (made by ``fpaudit.rules.findings``), as a
    report keeps it in meta.json's ``findings``: the rule's ``code`` and ``severity``, the
    script's ``file`` and ``line``, the first ``steps`` it happened at and in how many
    steps (``count``)."""

    code: str
    severity: str  # "error" or "warning"
    file: str
    line: int
    message: str
    steps: tuple[int, ...] = ()
    count: int = 0

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def to_dict(self) -> dict[str, Any]:
        """JSON values, in the order meta.json keeps them (sorted), so every JSON output
        of a read report prints them as it always has."""
        return {
            "code": self.code,
            "count": self.count,
            "file": self.file,
            "line": self.line,
            "message": self.message,
            "severity": self.severity,
            "steps": list(self.steps),
        }

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> Finding:
        """The finding ``item`` (meta.json's form, checked on read); a KeyError when a key
        is missing."""
        return cls(
            code=str(item["code"]),
            severity=str(item["severity"]),
            file=str(item["file"]),
            line=int(item["line"]),
            message=str(item["message"]),
            steps=tuple(int(step) for step in item["steps"]),
            count=int(item["count"]),
        )


def _meta_key(item: dataclasses.Field[Any]) -> str:
    """The key a field is kept under in meta.json: its name, or its ``metadata["key"]``."""
    return str(item.metadata.get("key", item.name))


class _MetaRecord:
    """A frozen record meta.json keeps as an object: each field under its key (its name,
    or its ``metadata["key"]``), checked on read by ``fpaudit.report.checks``."""

    def to_dict(self) -> dict[str, Any]:
        """The entries in the order meta.json keeps them (sorted), so every JSON output of a
        read report prints them as it always has."""
        fields = dataclasses.fields(self)  # type: ignore[arg-type]  # a dataclass's base
        return dict(sorted((_meta_key(item), getattr(self, item.name)) for item in fields))

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> Self:
        """The record in ``item``; a KeyError when an entry is missing. Numbers keep the
        type they were stored with."""
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        return cls(**{field_.name: item[_meta_key(field_)] for field_ in fields})


@dataclass(frozen=True)
class SkipStatistics(_MetaRecord):
    """A run's skipped optimizer steps, split at the end of calibration: the leading run
    of skips while a fresh dynamic scaler backs off from its initial scale (expected, not
    a problem), until its first step that is not skipped
    (``fpaudit.rules.findings.skip_statistics``; meta.json's ``training``)."""

    steps: int
    skipped: int
    calibration_steps: int
    steps_after_calibration: int
    skipped_after_calibration: int
    skip_rate_after_calibration: float


@dataclass(frozen=True)
class ScalerInfo(_MetaRecord):
    """The loss scaler ``fpaudit run`` saw (meta.json's ``scaler``): its class, as
    ``module.qualname``, and its settings."""

    scaler_class: str = field(metadata={"key": "class"})
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int


@dataclass(frozen=True)
class OpDtypes:
    """Under the probed autocast, one forward op of a module: the dtypes its backward
    computes in (the op's output dtype; for an add or a cast, whose gradient passes
    through, the dtypes it is cast to) and casts the gradient to (a differentiable input's
    dtype that is not the output's), by format name, sorted."""

    compute: tuple[str, ...]
    cast: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {item.name: list(getattr(self, item.name)) for item in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> Self:
        """The entry ``item``; a KeyError when a field is missing."""
        return cls(**{f.name: tuple(map(str, item[f.name])) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class AutocastPrediction:
    """What fp16 autocast would do to an fp32 scan's model (``fpaudit.capture.autocast.probe``;
    meta.json's ``autocast``): the ``device`` and ``dtype`` probed, how long the probe took,
    and per module, per forward op, its :class:`OpDtypes`; or the ``error`` the model
    failed with under autocast (no prediction: ``seconds`` and ``modules`` are not kept)."""

    device: str
    dtype: str
    seconds: float = 0.0
    modules: Mapping[str, Mapping[str, OpDtypes]] = field(default_factory=dict)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """meta.json's ``autocast`` as the probe has always written it."""
        kept = ("device", "dtype", "error") if self.error is not None else (
            "device", "dtype", "seconds", "modules")  # fmt: skip
        data = {item.name: getattr(self, item.name) for item in dataclasses.fields(self)}
        data["modules"] = {
            module: {op: dtypes.to_dict() for op, dtypes in ops.items()}
            for module, ops in self.modules.items()
        }
        return {key: data[key] for key in kept}

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> Self:
        """The prediction in ``item``; a KeyError, TypeError or ValueError when it is none."""
        modules = item.get("modules") or {}
        error = item.get("error")
        return cls(
            device=str(item.get("device", "?")),
            dtype=str(item.get("dtype", "float16")),
            seconds=float(item.get("seconds", 0.0)),
            modules={
                str(module): {str(op): OpDtypes.from_dict(entry) for op, entry in ops.items()}
                for module, ops in modules.items()
            },
            error=str(error) if error else None,
        )


@dataclass(frozen=True)
class CompiledInfo:
    """What a ``torch.compile``d model hid from the audit (meta.json's ``compiled``;
    ``fpaudit.capture.compiled_receiver``): whether Inductor compiled part of it
    (``inductor``), how many compiled backward runs the audit observed, per module the ops
    a fused kernel kept in registers (``fused_away``: never stored, not counted), and what
    the audit could not observe, a line each (``not_covered``)."""

    inductor: bool
    observed_backward_runs: int = 0
    fused_away: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    not_covered: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """meta.json's ``compiled``, in the receiver's order."""
        return {
            "inductor": self.inductor,
            "observed_backward_runs": self.observed_backward_runs,
            "fused_away": {module: list(ops) for module, ops in self.fused_away.items()},
            "not_covered": list(self.not_covered),
        }

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> Self:
        """The entry ``item``; an entry it lacks reads as its default (a report from before
        ``inductor`` was kept: Inductor's, as the gate has always read it)."""
        fused = item.get("fused_away") or {}
        return cls(
            inductor=bool(item.get("inductor", True)),
            observed_backward_runs=int(item.get("observed_backward_runs") or 0),
            fused_away={str(m): tuple(str(op) for op in ops) for m, ops in fused.items()},
            not_covered=tuple(str(line) for line in item.get("not_covered") or ()),
        )


def _record(cls: Any, value: Any) -> Any:
    """meta.json's entry ``value`` as the record ``cls``; None when it is none."""
    if not isinstance(value, dict):
        return None
    try:
        return cls.from_dict(value)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _findings(value: Any) -> tuple[Finding, ...]:
    """meta.json's ``findings``; an entry that is not a finding is dropped."""
    found = []
    for item in value if isinstance(value, list) else ():
        try:
            found.append(Finding.from_dict(item))
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(found)


@dataclass(frozen=True)
class RunMeta:
    """What the command line adds to a report's metadata (``scan(meta=...)``,
    ``run_script(meta=...)``): the command as typed, its config file and options, and
    the settings the readers of the report use. ``formats`` and ``include_loss`` are
    written only when given (``run`` sets its formats after the run)."""

    argv: str
    config: str | None
    options: Mapping[str, Any]
    headroom_bits: int | None
    formats: tuple[str, ...] | None = None
    include_loss: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """The metadata entries, as the commands have always written them."""
        data: dict[str, Any] = {}
        if self.formats is not None:
            data["formats"] = list(self.formats)
        data["headroom_bits"] = self.headroom_bits
        if self.include_loss is not None:
            data["include_loss"] = self.include_loss
        data.update(argv=self.argv, config=self.config, options=dict(self.options))
        return data

    @classmethod
    def from_dict(cls, meta: Mapping[str, Any]) -> RunMeta:
        """The entries of ``meta`` (a report's metadata) that :meth:`to_dict` writes."""
        formats = meta.get("formats")
        return cls(
            argv=meta["argv"],
            config=meta.get("config"),
            options=dict(meta["options"]),
            headroom_bits=meta.get("headroom_bits"),
            formats=tuple(formats) if formats is not None else None,
            include_loss=meta.get("include_loss"),
        )


@dataclass(frozen=True)
class RunInfo:
    command: str | None = None  # "scan", "run", or an integration's name
    steps_requested: int | None = None  # None: run until the script ends
    steps_run: int | None = None  # completed steps (None: no command recorded any)
    complete: bool = True  # False: the run was interrupted
    stopped_by: str | None = None  # what interrupted it, in words
    selection: Mapping[str, Sequence[str]] = field(default_factory=dict)  # option -> globs
    amp_dtype: str | None = None  # the dtype autocast held values in ("float16", ...)
    model_file: str | None = None  # scan: the model file
    script: str | None = None  # run: the training script
    # Recorded with the tables (Report.from_builder, capture); not stamped by to_meta.
    steps: int | None = None  # captured steps
    modules: tuple[str, ...] = ()  # module names in network order
    out_of_range: int = 0  # fp64 values outside fp32's range (binned as zero or inf)
    recipes: tuple[str, ...] = ()  # block-scaled recipes audited (--recipe)
    # run: the loss scaler's settings and skip statistics (fpaudit.run.training)
    scaler: ScalerInfo | None = None
    training: SkipStatistics | None = None
    # Written beside these by the command (its settings, run's formats) and by
    # fpaudit.run.training (the findings); not stamped by to_meta.
    formats: tuple[str, ...] = ()  # the formats the command summarised, first: the default
    headroom_bits: int | None = None  # scan's and run's --headroom-bits
    include_loss: bool | None = None  # scan's --include-loss
    findings: tuple[Finding, ...] = ()  # run: the misuse findings
    # scan without --amp: what fp16 autocast would do, per module (fpaudit.capture.autocast.probe)
    autocast: AutocastPrediction | None = None
    # torch.compile (fpaudit.capture.compiled); None when nothing compiled ran
    compiled: CompiledInfo | None = None

    @classmethod
    def ended(
        cls,
        command: str | None,
        stopped_by: str | None,
        steps: tuple[int | None, int],
        selection: Mapping[str, Sequence[str]],
        amp_dtype: str | None,
        *,
        complete: bool | None = None,
        **where: str,
    ) -> RunInfo:
        """A run as the command that wrote it ends it: ``steps`` requested and run, and
        complete when nothing ``stopped_by`` it (an interruption, an exit or an error, in
        words) unless ``complete`` says otherwise (``run``'s --max-steps stops a run that
        is complete); ``where``: the ``model_file`` or ``script`` it ran."""
        requested, run = steps
        return cls(
            command=command,
            steps_requested=requested,
            steps_run=run,
            complete=stopped_by is None if complete is None else complete,
            stopped_by=stopped_by,
            selection=selection,
            amp_dtype=amp_dtype,
            **where,  # type: ignore[arg-type]  # model_file or script: str fields
        )

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> RunInfo:
        """The typed view of ``meta`` (checked on read by ``fpaudit.report.store``); a field
        of the wrong type reads as its default."""

        def of(name: str, *types: type) -> Any:
            value = meta.get(name)
            ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
            return value if ok else None

        def strings(name: str) -> tuple[str, ...]:
            value = meta.get(name)
            return tuple(str(v) for v in value) if isinstance(value, list | tuple) else ()

        selection = meta.get("selection")
        complete = meta.get("complete", True)
        return cls(
            command=of("command", str),
            steps_requested=of("steps_requested", int),
            steps_run=of("steps_run", int),
            complete=complete is not False,
            stopped_by=of("stopped_by", str),
            selection={
                str(k): tuple(str(p) for p in v)
                for k, v in (selection.items() if isinstance(selection, dict) else ())
                if isinstance(v, list | tuple)
            },
            amp_dtype=of("amp_dtype", str),
            model_file=of("model_file", str),
            script=of("script", str),
            steps=of("steps", int),
            modules=strings("modules"),
            out_of_range=of("out_of_range", int) or 0,
            recipes=strings("recipes"),
            scaler=_record(ScalerInfo, meta.get("scaler")),
            training=_record(SkipStatistics, meta.get("training")),
            formats=strings("formats"),
            headroom_bits=of("headroom_bits", int),
            include_loss=of("include_loss", bool),
            autocast=_record(AutocastPrediction, meta.get("autocast")),
            compiled=_record(CompiledInfo, meta.get("compiled")),
            findings=_findings(meta.get("findings")),
        )

    def to_meta(self) -> dict[str, Any]:
        """The metadata entries of this run (JSON types), to merge into ``Report.meta``."""
        names = [
            item.name
            for item in dataclasses.fields(self)
            if item.name not in _READ_ONLY  # written with the tables, or beside these
            and (item.name in _ALWAYS or getattr(self, item.name) is not None)
        ]
        return {**self.entries(*names), "amp": self.amp}

    def entries(self, *names: str) -> dict[str, Any]:
        """The metadata entries of the fields ``names`` (JSON types: a tuple as a list),
        whatever their values, under the keys ``from_meta`` reads them from."""
        meta: dict[str, Any] = {}
        for name in names:
            value = getattr(self, name)
            if name == "selection":
                value = {k: list(v) for k, v in value.items()}
            elif isinstance(value, _MetaRecord | AutocastPrediction | CompiledInfo):
                value = value.to_dict()
            elif isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = [v.to_dict() if isinstance(v, Finding) else v for v in value]
            meta[name] = value
        return meta

    @property
    def amp(self) -> str | None:
        """ "fp16" or "bf16" when autocast ran (from ``amp_dtype``), else None."""
        return AMP_NAMES.get(self.amp_dtype or "")

    @property
    def source(self) -> str:
        """The model file or training script the run audited ("" when neither)."""
        return self.model_file or self.script or ""
