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
    "Environment",
    "Finding",
    "OpDtypes",
    "RunInfo",
    "RunMeta",
    "ScalerInfo",
    "SkipStatistics",
]

# Written by every command that writes a report (whenever ``command`` is set), None
# included (readers have always found them there); the other fields when set.
_ALWAYS = (
    "command",
    "steps_requested",
    "steps_run",
    "complete",
    "stopped_by",
    "selection",
    "amp_dtype",
)  # and "amp", derived from amp_dtype


# Written together whenever ``argv`` is set (the command line's RunMeta), None included.
_COMMAND_LINE = ("argv", "config", "options", "headroom_bits")


# Written whenever the command is ``run`` (its scaler None when it had none).
_RUN = ("scaler", "findings", "training")


# Written with the tables (Report.from_builder), whenever ``steps`` is set.
_BUILDER = ("steps", "modules", "window")


# What a run's end sets (Report.record_run): the fields RunInfo.ended fills, and run's.
_ENDED = (*_ALWAYS, "model_file", "script", *_RUN)


# Entries of meta.json that are the file's, not the run's: the writer stamps them.
FILE_KEYS = ("schema_version", "histogram", "files")


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


@dataclass(frozen=True)
class Environment:
    """Where a run ran (``fpaudit.report.store.run_metadata``; no file paths, no user data):
    the versions, when the report was made, and the device. meta.json keeps each entry at
    its top level."""

    fpaudit_version: str
    torch_version: str
    python_version: str
    created: str
    device: str
    device_name: str

    def to_dict(self) -> dict[str, Any]:
        return {item.name: getattr(self, item.name) for item in dataclasses.fields(self)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Environment | None:
        """The entries of ``meta``; None when one is missing or not a string."""
        values = [meta.get(item.name) for item in dataclasses.fields(cls)]
        if not all(isinstance(value, str) for value in values):
            return None
        return cls(*map(str, values))


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
    out_of_range: int | None = None  # fp64 values outside fp32's range (zero or inf bins)
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
    # Where it ran (run_metadata) and how the records were kept (ReportBuilder's --window)
    environment: Environment | None = None
    window: int | None = None
    # The command line (scan's and run's RunMeta): as typed, its config file, its options;
    # written together (with headroom_bits) whenever ``argv`` is set
    argv: str | None = None
    config: str | None = None
    options: Mapping[str, Any] | None = None
    # Several ranks: how many wrote the report (fpaudit.run.distributed), or, for one
    # rank's part (Report.for_rank), which rank it is
    ranks: int | None = None
    rank: int | None = None
    # The schema version of the file it was read from (None: not read; the writer stamps
    # its own, with the histogram layout and the files' checksums)
    schema_version: int | None = None
    # The writing command's own entries (its options as it ran: scan's seed and device,
    # run's optimizers, an integration's trainer settings), JSON values as meta.json keeps
    # them; no rule decides on them. A typed field's key is never among them.
    settings: Mapping[str, Any] = field(default_factory=dict)

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

    def __post_init__(self) -> None:
        taken = set(self.settings) & _KEYS
        if taken:
            raise ValueError(f"settings {sorted(taken)} are run info fields: set the fields")

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> RunInfo:
        """The typed view of ``meta`` (checked on read by ``fpaudit.report.checks``); a
        field of the wrong type reads as its default, an entry no field holds is one of
        the ``settings``."""

        def of(name: str, *types: type) -> Any:
            value = meta.get(name)
            ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
            return value if ok else None

        def strings(name: str) -> tuple[str, ...]:
            value = meta.get(name)
            return tuple(str(v) for v in value) if isinstance(value, list | tuple) else ()

        selection = meta.get("selection")
        complete = meta.get("complete", True)
        options = meta.get("options")
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
            out_of_range=of("out_of_range", int),
            recipes=strings("recipes"),
            scaler=_record(ScalerInfo, meta.get("scaler")),
            training=_record(SkipStatistics, meta.get("training")),
            formats=strings("formats"),
            headroom_bits=of("headroom_bits", int),
            include_loss=of("include_loss", bool),
            autocast=_record(AutocastPrediction, meta.get("autocast")),
            compiled=_record(CompiledInfo, meta.get("compiled")),
            findings=_findings(meta.get("findings")),
            environment=Environment.from_meta(meta),
            window=of("window", int),
            argv=of("argv", str),
            config=of("config", str),
            options=dict(options) if isinstance(options, dict) else None,
            ranks=of("ranks", int),
            rank=of("rank", int),
            schema_version=of("schema_version", int),
            settings={k: v for k, v in meta.items() if k not in _KEYS and k not in FILE_KEYS},
        )

    def to_meta(self) -> dict[str, Any]:
        """meta.json's object for this run (JSON types; the writer adds the file's entries,
        ``FILE_KEYS``): each field under its key when it is set (``_ALWAYS``, the command
        line's and run's entries, None included, as the commands have always written them),
        then the command's own ``settings``."""
        names = [
            item.name
            for item in dataclasses.fields(self)
            if item.name not in ("environment", "settings") and self._written(item.name)
        ]
        meta = dict(self.settings)
        if self.environment is not None:
            meta.update(self.environment.to_dict())
        meta.update(self.entries(*names))
        if self.command is not None:
            meta["amp"] = self.amp
        return meta

    def _written(self, name: str) -> bool:
        if name in _ALWAYS:
            return self.command is not None
        if name in _COMMAND_LINE:
            return self.argv is not None or getattr(self, name) is not None
        if name in _RUN and self.command == "run":
            return True
        if name in _BUILDER:
            return self.steps is not None
        value = getattr(self, name)
        return value is not None and value != ()

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

    def ended_as(self, run: RunInfo, command_line: RunMeta | None = None) -> RunInfo:
        """This run (its tables' fields, what the capture set) ended as ``run`` says: the
        fields a run's end sets (``RunInfo.ended``'s, and for ``fpaudit run`` its scaler,
        findings and skips) from ``run``, its ``settings`` added to these, and the
        ``command_line``'s entries (its formats when it names them)."""
        ended = _ENDED if run.command == "run" else _ENDED[: -len(_RUN)]
        info = dataclasses.replace(
            self,
            **{name: getattr(run, name) for name in ended},
            settings={**self.settings, **run.settings},
        )
        if command_line is None:
            return info
        return dataclasses.replace(
            info,
            argv=command_line.argv,
            config=command_line.config,
            options=dict(command_line.options),
            headroom_bits=command_line.headroom_bits,
            formats=command_line.formats if command_line.formats is not None else info.formats,
            include_loss=command_line.include_loss,
        )

    @property
    def amp(self) -> str | None:
        """ "fp16" or "bf16" when autocast ran (from ``amp_dtype``), else None."""
        return AMP_NAMES.get(self.amp_dtype or "")

    @property
    def source(self) -> str:
        """The model file or training script the run audited ("" when neither)."""
        return self.model_file or self.script or ""


# Every meta.json key a field of RunInfo (or its Environment) holds, "amp" derived
_KEYS = frozenset(
    [
        item.name
        for item in dataclasses.fields(RunInfo)
        if item.name not in ("environment", "settings")
    ]
    + [item.name for item in dataclasses.fields(Environment)]
    + ["amp"]
)
