"""Each command's options as one typed, frozen object, built from :data:`fpaudit.options.SPECS`.

A class here lists a command's options in the order its ``--help`` shows them; each
field's default is its spec's (:func:`_declared`, never restated), so mypy checks every
read and tests/test_command_options.py checks that fields and specs agree. The CLI
builds each command's flags from these fields and their specs, merges the config file
and the flags, and hands the command one of these (:meth:`CommandOptions.build`).

Adding an option: its ``Spec`` in :mod:`fpaudit.options` and a typed field here, in the
place its help row goes. No typer here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from fpaudit import options as specs

CONFIG_FIELD = "config_file"  # --config: where the command reads the rest from


def _declared(command: str, name: str) -> Any:
    """``command``'s option ``name`` as a field: the value its spec starts it at."""
    value = specs.spec(command, name).value_default
    return tuple(value) if isinstance(value, list) else value


def _field_value(name: str, value: Any) -> Any:
    """A list as a tuple (the objects are frozen), a path flag as the text a config
    file would give (``config_file`` stays the path it is)."""
    if isinstance(value, list):
        return tuple(value)
    return str(value) if isinstance(value, Path) and name != CONFIG_FIELD else value


@dataclass(frozen=True, kw_only=True)
class CommandOptions:
    """What a command was told: its spec defaults, then the config file, then the flags.

    ``given`` names the options the config file or a flag set, ``flagged`` those set on
    the command line; both let a command tell "left at its default" from "asked for"."""

    COMMAND: ClassVar[str]
    given: frozenset[str] = frozenset()
    flagged: frozenset[str] = frozenset()

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The declared options, in help order (``config_file`` is --config's place)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("given", "flagged"))

    @classmethod
    def build(cls, configured: Mapping[str, Any], flags: Mapping[str, Any]) -> Self:
        """From the config file's values and the flags given (``None``: not given)."""
        flags = {name: value for name, value in flags.items() if value is not None}
        values = {**configured, **flags}
        return cls(
            **{name: _field_value(name, value) for name, value in values.items()},
            given=frozenset(values) - {CONFIG_FIELD},
            flagged=frozenset(flags) - {CONFIG_FIELD},
        )

    def to_meta(self) -> dict[str, Any]:
        """The options as a report's metadata keeps them: JSON values, by name."""
        meta: dict[str, Any] = {}
        for name in self.option_names():
            if name == CONFIG_FIELD:
                continue
            value = getattr(self, name)
            meta[name] = list(value) if isinstance(value, tuple) else value
        return meta


@dataclass(frozen=True, kw_only=True)
class ScanArgs(CommandOptions):
    COMMAND: ClassVar[str] = "scan"
    steps: int = _declared("scan", "steps")
    device: str = _declared("scan", "device")
    format: tuple[str, ...] = _declared("scan", "format")
    headroom_bits: int = _declared("scan", "headroom_bits")
    include_loss: bool = _declared("scan", "include_loss")
    out: str = _declared("scan", "out")
    config_file: Path | None = None
    seed: int = _declared("scan", "seed")
    loss_scale: str = _declared("scan", "loss_scale")
    top: int = _declared("scan", "top")
    force: bool = _declared("scan", "force")
    every: int = _declared("scan", "every")
    window: int = _declared("scan", "window")
    module: tuple[str, ...] = _declared("scan", "module")
    exclude_module: tuple[str, ...] = _declared("scan", "exclude_module")
    op: tuple[str, ...] = _declared("scan", "op")
    exclude_op: tuple[str, ...] = _declared("scan", "exclude_op")
    amp: str | None = _declared("scan", "amp")
    shadow: bool = _declared("scan", "shadow")
    forward: bool = _declared("scan", "forward")
    origins: bool = _declared("scan", "origins")
    replace_partial: bool = _declared("scan", "replace_partial")
    recipe: tuple[str, ...] = _declared("scan", "recipe")


@dataclass(frozen=True, kw_only=True)
class RunArgs(CommandOptions):
    COMMAND: ClassVar[str] = "run"
    out: str = _declared("run", "out")
    force: bool = _declared("run", "force")
    max_steps: int | None = _declared("run", "max_steps")
    capture_every: int = _declared("run", "capture_every")
    window: int = _declared("run", "window")
    format: str | None = _declared("run", "format")
    headroom_bits: int = _declared("run", "headroom_bits")
    module: tuple[str, ...] = _declared("run", "module")
    exclude_module: tuple[str, ...] = _declared("run", "exclude_module")
    op: tuple[str, ...] = _declared("run", "op")
    exclude_op: tuple[str, ...] = _declared("run", "exclude_op")
    max_backoffs: int = _declared("run", "max_backoffs")
    max_skip_rate: float = _declared("run", "max_skip_rate")
    drift_window: int | None = _declared("run", "drift_window")
    drift_binades: int = _declared("run", "drift_binades")
    replace_partial: bool = _declared("run", "replace_partial")
    config_file: Path | None = None
    recipe: tuple[str, ...] = _declared("run", "recipe")


@dataclass(frozen=True, kw_only=True)
class ShowArgs(CommandOptions):
    COMMAND: ClassVar[str] = "show"
    format: str | None = _declared("show", "format")
    scale: str = _declared("show", "scale")
    top: int | None = _declared("show", "top")
    kind: str = _declared("show", "kind")
    by: str = _declared("show", "by")
    steps: bool = _declared("show", "steps")
    limit: int = _declared("show", "limit")
    origins: bool = _declared("show", "origins")
    recipe: str | None = _declared("show", "recipe")
    json: bool = _declared("show", "json")
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class RecommendArgs(CommandOptions):
    COMMAND: ClassVar[str] = "recommend"
    format: str | None = _declared("recommend", "format")
    headroom_bits: int = _declared("recommend", "headroom_bits")
    include_loss: bool = _declared("recommend", "include_loss")
    worst_window: bool = _declared("recommend", "worst_window")
    drift_window: int | None = _declared("recommend", "drift_window")
    drift_binades: int = _declared("recommend", "drift_binades")
    json: bool = _declared("recommend", "json")
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class SimulateArgs(CommandOptions):
    COMMAND: ClassVar[str] = "simulate"
    policy: str = _declared("simulate", "policy")
    format: str | None = _declared("simulate", "format")
    init_scale: str | None = _declared("simulate", "init_scale")
    growth_factor: float | None = _declared("simulate", "growth_factor")
    backoff_factor: float | None = _declared("simulate", "backoff_factor")
    growth_interval: int | None = _declared("simulate", "growth_interval")
    hysteresis: int | None = _declared("simulate", "hysteresis")
    min_scale: str | None = _declared("simulate", "min_scale")
    max_scale: str | None = _declared("simulate", "max_scale")
    static_scale: str | None = _declared("simulate", "static_scale")
    headroom_bits: int = _declared("simulate", "headroom_bits")
    amax_history_len: int = _declared("simulate", "amax_history_len")
    margin: int = _declared("simulate", "margin")
    amax_compute_algo: str = _declared("simulate", "amax_compute_algo")
    sweep: bool = _declared("simulate", "sweep")
    max_overflow_steps: int = _declared("simulate", "max_overflow_steps")
    json: bool = _declared("simulate", "json")
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class PlotArgs(CommandOptions):
    COMMAND: ClassVar[str] = "plot"
    output: str | None = _declared("plot", "output")
    format: str | None = _declared("plot", "format")
    scale: str = _declared("plot", "scale")
    headroom_bits: int = _declared("plot", "headroom_bits")
    recipe: tuple[str, ...] = _declared("plot", "recipe")
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class GateArgs(CommandOptions):
    COMMAND: ClassVar[str] = "gate"
    max_underflow: float | None = _declared("gate", "max_underflow")
    format: str | None = _declared("gate", "format")
    scale: str | None = _declared("gate", "scale")
    per_module: bool = _declared("gate", "per_module")
    headroom_bits: int = _declared("gate", "headroom_bits")
    include_loss: bool = _declared("gate", "include_loss")
    allow_incomplete: bool = _declared("gate", "allow_incomplete")
    allow_nonfinite: bool = _declared("gate", "allow_nonfinite")
    junit: str | None = _declared("gate", "junit")
    recipe: str | None = _declared("gate", "recipe")
    max_flush: float | None = _declared("gate", "max_flush")
    max_saturate: float = _declared("gate", "max_saturate")
    json: bool = _declared("gate", "json")
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class PlanArgs(CommandOptions):
    COMMAND: ClassVar[str] = "plan"
    recipe: tuple[str, ...] = _declared("plan", "recipe")
    max_flush: float | None = _declared("plan", "max_flush")
    max_saturate: float = _declared("plan", "max_saturate")
    names: bool = _declared("plan", "names")
    json: bool = _declared("plan", "json")
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class VerifyArgs(CommandOptions):
    COMMAND: ClassVar[str] = "verify"
    scale: str | None = _declared("verify", "scale")
    amp: str = _declared("verify", "amp")
    clip_norm: float | None = _declared("verify", "clip_norm")
    device: str = _declared("verify", "device")
    seed: int = _declared("verify", "seed")
    json: bool = _declared("verify", "json")


@dataclass(frozen=True, kw_only=True)
class Fp16PlanArgs(CommandOptions):
    COMMAND: ClassVar[str] = "fp16-plan"
    steps: int = _declared("fp16-plan", "steps")
    headroom_bits: int = _declared("fp16-plan", "headroom_bits")
    max_underflow: float = _declared("fp16-plan", "max_underflow")
    device: str = _declared("fp16-plan", "device")
    seed: int = _declared("fp16-plan", "seed")
    json: bool = _declared("fp16-plan", "json")


COMMAND_ARGS: tuple[type[CommandOptions], ...] = (
    ScanArgs, RunArgs, ShowArgs, RecommendArgs, SimulateArgs, PlotArgs, GateArgs, PlanArgs,
    VerifyArgs, Fp16PlanArgs,
)  # fmt: skip
