"""Run a model file for some steps under the audit: what ``fpaudit scan`` does.

Each step: zero the gradients, take the next batch, compute ``loss(model,
batch)``, run backward seeded with the loss scale ``S`` (so every gradient
is multiplied by ``S``, exactly as backward on ``S * loss``), close the audit
step (the one host sync), then take an optimizer step if the model file
defines an optimizer and the step's loss and gradients are finite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from fpaudit import defaults, torch_internals_compile
from fpaudit._process import Owner
from fpaudit.bounds import AT_LEAST_1
from fpaudit.capture import compiled
from fpaudit.capture.audit import Audit, Selection, StepSummary
from fpaudit.errors import (
    FpauditError,
    Interrupted,
    ModelExit,
    ModelFileError,
    Named,
    OptionError,
    UsageError,
)
from fpaudit.numerics.recipes import get_recipe
from fpaudit.report.records import KIND_BACKWARD, LOSS_MODULE
from fpaudit.report.runinfo import AMP_NAMES, AutocastPrediction, RunInfo, RunMeta
from fpaudit.run import distributed, modelfile

if TYPE_CHECKING:
    from fpaudit.report.store import Report


@dataclass(frozen=True)
class ScanOptions:
    # defaults: declared once in fpaudit.defaults, which the CLI options read too
    steps: int = defaults.SCAN_STEPS
    device: str = defaults.DEVICE
    loss_scale: float = 1.0
    seed: int | None = defaults.SEED
    every: int = defaults.SCAN_EVERY  # capture steps 0, K, 2K, ...
    window: int = defaults.WINDOW  # merge W consecutive captured steps
    selection: Selection = field(default_factory=Selection)
    amp: str | None = None  # live mode: "fp16" or "bf16", forward under torch.autocast
    shadow: bool = False  # re-run low-precision backward ops in fp32 to count lost values
    forward: bool = False  # also record forward op outputs
    origins: bool = False  # per op call, did it make inf/NaN (implies forward)
    recipes: tuple[str, ...] = ()  # block-scaled recipes to audit (--recipe)
    compile: bool = False  # torch.compile the model with Inductor (fpaudit.capture.compiled)

    def __post_init__(self) -> None:
        for name in self.recipes:
            get_recipe(name)  # an unknown name is a one-line UsageError
        for name in ("steps", "every", "window"):
            AT_LEAST_1.check(name, getattr(self, name))
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise OptionError("amp", f"must be one of {', '.join(AMP_DTYPES)}, got {self.amp!r}")
        if self.shadow and self.amp is None:
            raise OptionError(
                "shadow", "compares low-precision ops with fp32: it needs ", Named("amp")
            )
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise OptionError("loss_scale", f"must be a positive number, got {self.loss_scale}")
        if math.frexp(self.loss_scale)[0] != 0.5:
            raise OptionError("loss_scale", f"must be a power of two, got {self.loss_scale:g}")


# --amp's names and their torch dtypes: the names autocast's dtypes have in a report
AMP_DTYPES = {name: getattr(torch, dtype) for dtype, name in AMP_NAMES.items()}


def resolve_device(spec: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked against what this machine has."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        index_text = spec.partition(":")[2]
        if index_text and not index_text.isdigit():
            raise UsageError(f"invalid device {spec!r}; use auto, cpu, cuda or cuda:N")
        if not torch.cuda.is_available():
            raise OptionError("device", f"{spec}: CUDA is not available on this machine")
        if index_text and int(index_text) >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise OptionError("device", f"{spec}: this machine has {count} CUDA device(s)")
        return torch.device(spec)
    raise UsageError(f"invalid device {spec!r}; use auto, cpu, cuda or cuda:N")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class ScanInterrupted(Interrupted):
    """The scan was interrupted; ``report`` holds the completed steps, marked incomplete."""

    def __init__(self, report: Report, cause: Interrupted) -> None:
        super().__init__(cause.signal_name, cause.exit_code)
        self.report = report


class ScanFailed(Exception):
    """Under torchrun, a rank failed after some steps (this one, or another: ``error``
    says which, in its words); ``report`` holds this rank's completed steps, marked
    incomplete, for the caller to write apart (the ranks cannot meet to write one)."""

    def __init__(self, report: Report, error: FpauditError) -> None:
        super().__init__(str(error))
        self.report = report
        self.error = error


class ScanExited(ModelExit):
    """Model code called ``sys.exit``/``os._exit`` after some steps: ``report`` holds them,
    marked incomplete; the error stands (exit 2)."""

    def __init__(self, report: Report, cause: ModelExit) -> None:
        super().__init__(str(cause))
        self.report = report


@dataclass(frozen=True)
class StepProgress:
    step: int  # 1-based count of steps done
    steps: int
    summary: StepSummary | None  # None for a step that was not captured
    optimizer_step: bool
    loss: float | None


def _probe_autocast(
    path: Path, model: torch.nn.Module, spec: Any, batch: Any, device: torch.device
) -> AutocastPrediction:
    """fpaudit.capture.autocast.probe on the first batch, after the steps. A model that fails
    under autocast (or exits) gets a prediction with its ``error`` (no prediction), never
    a failed scan: the steps are done."""
    from fpaudit.capture import autocast

    try:
        with modelfile.user_code(path, "loss(model, batch)"):
            return autocast.probe(model, lambda: spec.loss(model, batch), device.type)
    except Exception as error:  # the model's own failure under autocast: no prediction
        failure = str(error) if isinstance(error, ModelFileError) else repr(error)
        return AutocastPrediction(device.type, "float16", error=failure)


def scan(
    model_path: str | Path,
    options: ScanOptions = ScanOptions(),
    *,
    on_step: Callable[[StepProgress], None] | None = None,
    on_captured: Callable[[Audit], None] | None = None,
    meta: RunMeta | None = None,
) -> Report:
    """Scan ``model_path`` for ``options.steps`` steps and return the report (not written).

    ``on_step`` gets each step's progress; ``on_captured`` gets the audit after each
    captured step closed and its optimizer step was marked (a dashboard reads
    :meth:`Audit.last_step_view` there).

    Raises :class:`ScanInterrupted` on SIGINT/SIGTERM and :class:`ScanExited` when model
    code calls ``sys.exit`` or ``os._exit`` after a completed step; both carry the
    completed steps as a report marked incomplete. Under torchrun the ranks agree before
    each step (``distributed.Peers``): they stop together when a rank's batches end or a
    signal arrives; a rank that fails raises :class:`ScanFailed` there, and so do the
    others, with its words (or :class:`~fpaudit.run.distributed.RankFailed` before a
    step completed).
    """
    with modelfile.exits_caught():
        return _scan(Path(model_path), options, _Listeners(on_step, on_captured), meta)


@dataclass(frozen=True)
class _Setup:
    """What a scan's steps run on, set up by :func:`_set_up`."""

    path: Path
    options: ScanOptions
    device: torch.device
    rank: int
    world: int
    spec: modelfile.ModelFile
    model: torch.nn.Module  # the audited model (compiled through fpaudit's backend, if it is)
    trained: torch.nn.Module  # what forward runs through (DDP under torchrun)
    optimizer: torch.optim.Optimizer | None
    audit: Audit
    peers: distributed.Peers | None  # under torchrun: what the ranks tell each other

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's autocast (``--amp``), or nothing."""
        if self.options.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AMP_DTYPES[self.options.amp])


class _Listeners(NamedTuple):
    """Who hears of each step: its progress, and (captured steps) the audit."""

    on_step: Callable[[StepProgress], None] | None
    on_captured: Callable[[Audit], None] | None


class _Ran(NamedTuple):
    """How the steps ended: how many completed, and what stopped them early."""

    steps_run: int
    interrupted: Interrupted | None
    exited: ModelExit | None
    failed: FpauditError | None = None  # under torchrun: this rank's error or a peer's
    ended_on: tuple[int, ...] = ()  # under torchrun: the ranks whose batches ended first


def _scan(path: Path, options: ScanOptions, listeners: _Listeners, meta: RunMeta | None) -> Report:
    setup = _set_up(path, options)
    # Under torchrun each rank takes every world-th batch: its own shard of the data.
    world = setup.world
    batches = itertools.islice(setup.spec.batches(options.steps * world), setup.rank, None, world)
    # the first batch, for the autocast probe after the steps: kept only when a probe
    # can run (an fp32 scan)
    first: list[Any] | None = [] if options.amp is None else None
    owner = Owner()  # a child the model code forks runs on, but never probes
    ran = _run_steps(setup, batches, listeners, first)
    report = setup.audit.report
    if first and (ran.interrupted, ran.exited, ran.failed) == (None, None, None) and owner.here():
        # an fp32 scan: what would fp16 autocast hold? One forward after the steps, so
        # that the steps run as they would without it
        probed = _probe_autocast(path, setup.model, setup.spec, first[0], setup.device)
        report.update_info(autocast=probed)
    _record(setup, report, ran, meta)
    if ran.failed is not None:
        raise ScanFailed(report, ran.failed)
    if ran.interrupted is not None:
        raise ScanInterrupted(report, ran.interrupted)
    if ran.exited is not None:
        raise ScanExited(report, ran.exited)
    return report


def _set_up(path: Path, options: ScanOptions) -> _Setup:
    """The device (and under torchrun the process group), the seed, the model file's
    model on the device (compiled or observed), its optimizer and the audit, in order."""
    rank, world = 0, 1
    if distributed.launched():  # torchrun: this rank's device, the process group
        device = resolve_device(distributed.local_device(options.device))
        rank, world = distributed.init_from_environment(device)
    else:
        device = resolve_device(options.device)
    if world == 1:
        return _set_up_on(path, options, device, rank, world, None)
    peers = distributed.Peers(rank, world, device)
    try:
        return _set_up_on(path, options, device, rank, world, peers)
    except Exception as error:  # this rank's error, left for the others; or a peer's
        raise peers.failure(error) from error


def _set_up_on(
    path: Path,
    options: ScanOptions,
    device: torch.device,
    rank: int,
    world: int,
    peers: distributed.Peers | None,
) -> _Setup:
    if options.seed is not None:
        seed_everything(options.seed)
    spec = modelfile.load(path)
    with modelfile.user_code(path, f"moving the model to {device}"):
        model = spec.model.to(device)
    model.train()
    # torch.compile: a compiled model file (or --compile) runs through fpaudit's Inductor
    # backend, which hands out what its backward stores (fpaudit.capture.compiled)
    not_covered: str | None = None
    if options.compile or compiled.inductor_options(model) is not None:
        _check_compile_cache()  # (another backend writes no Inductor cache)
    if options.compile and compiled.eager_module(model) is None:
        model = compiled.compile(model)
    else:
        model, not_covered = _observed(model)
    trained: torch.nn.Module = model
    if world > 1 and any(p.requires_grad for p in model.parameters()):
        ids = [device.index] if device.type == "cuda" else None
        try:  # DDP checks that every rank's parameters have the same shapes
            trained = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        except RuntimeError as error:
            if distributed.looks_like_peer_gone(error):
                raise
            raise ModelFileError(
                f"{path}: rank {rank}'s model differs from the other ranks' "
                f"({distributed.first_line(error)}); every rank must build the same model"
            ) from error
    optimizer = spec.optimizer(model.parameters())

    audit = Audit(
        model,
        loss_scale=options.loss_scale,
        selection=options.selection,
        window=options.window,
        shadow=options.shadow,
        origins=options.origins,
        recipes=options.recipes,
    )
    if not_covered is not None:
        audit.note_not_covered(not_covered)
    options.selection.check_modules(audit.module_names)  # a typo fails before any step
    return _Setup(path, options, device, rank, world, spec, model, trained, optimizer, audit, peers)


def _observed(model: torch.nn.Module) -> tuple[torch.nn.Module, str | None]:
    """``compiled.observed``, keeping what the model file gave ``torch.compile``
    (``fullgraph=True``: a graph break fails as it fails without fpaudit; ``dynamic``)."""
    fullgraph, dynamic = torch_internals_compile.compile_arguments(model)
    options = compiled.inductor_options(model)
    eager = compiled.eager_module(model)
    given = (fullgraph, dynamic) != (False, None)
    if not given or options is None or eager is None or options.get("triton.cudagraphs"):
        return compiled.observed(model)
    return compiled.compile(eager, options=options, fullgraph=fullgraph, dynamic=dynamic), None


def _check_compile_cache() -> None:
    """torch.compile writes compiled code to Inductor's cache folder: one that cannot be
    written is the machine's problem, said before any step (not the model's error)."""
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        if named:  # made here first: Inductor makes it while it is imported, and an
            os.makedirs(named, exist_ok=True)  # import that failed half-way stays broken
        folder = torch_internals_compile.inductor_cache_dir()
        problem = None if os.access(folder, os.W_OK | os.X_OK) else "it is not writable"
    except OSError as error:
        folder, problem = str(error.filename or named), error.strerror or str(error)
    if problem is not None:
        given = "TORCHINDUCTOR_CACHE_DIR" if named else "Inductor's default"
        raise UsageError(
            f"torch.compile cannot write Inductor's cache folder {folder} ({given}): "
            f"{problem}; set TORCHINDUCTOR_CACHE_DIR to a writable folder"
        )


def _run_steps(
    setup: _Setup, batches: Iterator[Any], listeners: _Listeners, first: list[Any] | None
) -> _Ran:
    """Run a step per batch until the batches end, an interruption or an exit in model
    code (once a step completed: before that, the exit stands)."""
    if setup.peers is not None:
        return _run_agreed_steps(setup, setup.peers, batches, listeners, first)
    steps_run = 0
    try:
        for step, batch in enumerate(batches):
            _told_step(setup, step, batch, first, listeners)
            steps_run = step + 1
    except KeyboardInterrupt as error:  # SIGINT, or SIGTERM as the CLI raises it
        return _Ran(steps_run, error if isinstance(error, Interrupted) else Interrupted(), None)
    except ModelExit as error:  # sys.exit/os._exit in model code: keep what was done
        if steps_run == 0:
            raise
        return _Ran(steps_run, None, error)
    return _Ran(steps_run, None, None)


def _told_step(
    setup: _Setup, step: int, batch: Any, first: list[Any] | None, listeners: _Listeners
) -> None:
    """One step, then its listeners told (a captured step's audit, the progress)."""
    progress = _step(setup, step, batch, first)
    if listeners.on_captured is not None and progress.summary is not None:
        listeners.on_captured(setup.audit)
    if listeners.on_step is not None:
        listeners.on_step(progress)


_NO_BATCH = object()


def _run_agreed_steps(
    setup: _Setup,
    peers: distributed.Peers,
    batches: Iterator[Any],
    listeners: _Listeners,
    first: list[Any] | None,
) -> _Ran:
    """The steps under torchrun: before each, every rank says whether it has a batch and
    whether a signal arrived, and all stop together; an error (this rank's, or a peer's
    that failed a collective) ends this rank's steps with the words every rank says."""
    steps_run = 0
    with peers.signals_held():
        try:
            for step in itertools.count():
                batch = next(batches, _NO_BATCH)
                stop = peers.agree(batch is not _NO_BATCH)
                if stop is not None:
                    if stop.signal_name is not None:
                        return _Ran(steps_run, Interrupted(stop.signal_name, stop.exit_code), None)
                    shorter = stop.ended if len(stop.ended) < setup.world else ()
                    return _Ran(steps_run, None, None, ended_on=shorter)
                _told_step(setup, step, batch, first, listeners)
                steps_run = step + 1
        except Exception as error:  # ModelExit included: the others cannot go on alone
            failed = peers.failure(error)
            if steps_run == 0:
                raise failed from error
            return _Ran(steps_run, None, None, failed=failed)
    raise AssertionError("unreachable")  # pragma: no cover


def _step(setup: _Setup, step: int, batch: Any, first: list[Any] | None) -> StepProgress:
    """One step (see the module docstring), audited every ``options.every``-th step;
    step 0 keeps its batch in ``first`` when that is given."""
    options, path, audit, optimizer = setup.options, setup.path, setup.audit, setup.optimizer
    captured = step % options.every == 0
    with audit if captured else contextlib.nullcontext():
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            setup.model.zero_grad(set_to_none=True)
        batch = modelfile.move_to(batch, setup.device)
        if step == 0 and first is not None:
            first.append(batch)
        forward = (
            audit.forward_pass()
            if captured and (options.forward or options.origins)
            else contextlib.nullcontext()
        )
        with forward, setup.autocast(), modelfile.user_code(path, "loss(model, batch)"):
            loss = setup.spec.loss(setup.trained, batch)
        loss = modelfile.check_loss(loss, path)
        seed = torch.full_like(loss, options.loss_scale)
        if captured:
            audit.record(KIND_BACKWARD, LOSS_MODULE, "seed", "seed", 0, True, seed)
        with modelfile.user_code(path, "backward"):
            torch.autograd.backward(loss, grad_tensors=seed)
        summary = audit.step(loss=loss, index=step) if captured else None
        if captured and step == 0:  # the ops are known once a backward ran
            options.selection.check_ops(audit.seen_ops())
    if summary is not None:
        loss_value, healthy = summary.loss, summary.loss_finite and not summary.nonfinite_grads
    else:  # an unaudited step: its one sync reads the loss
        loss_value = float(loss.detach())
        healthy = math.isfinite(loss_value)
    stepped = False
    if optimizer is not None and healthy:
        with modelfile.user_code(path, "optimizer.step()"):
            optimizer.step()
        stepped = True
    if captured:
        audit.mark_optimizer_step(stepped, skipped=optimizer is not None and not stepped)
    return StepProgress(step + 1, options.steps, summary, stepped, loss_value)


def _record(setup: _Setup, report: Report, ran: _Ran, meta: RunMeta | None) -> None:
    """Stamp the run on ``report``: how it ended, the scan's settings, the caller's meta."""
    options, device, optimizer = setup.options, setup.device, setup.optimizer
    held = str(AMP_DTYPES[options.amp]).removeprefix("torch.") if options.amp else None
    stopped_by = (
        ran.interrupted.signal_name
        if ran.interrupted is not None
        else ("an exit in model code" if ran.exited is not None else None)
    )
    if isinstance(ran.failed, distributed.RankFailed):  # its words name the rank
        stopped_by = f"an error on another rank ({ran.failed})"
    elif ran.failed is not None:
        stopped_by = f"an error on rank {setup.rank} ({ran.failed})"
    steps = (options.steps, ran.steps_run)
    run = RunInfo.ended("scan", stopped_by, steps, options.selection.describe(), held,
                        model_file=str(setup.path))  # fmt: skip
    environment = report.info.environment
    if environment is not None:  # the device the scan ran on, named by torch on CUDA
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        environment = dataclasses.replace(
            environment, device=str(device), device_name=name or environment.device_name
        )
        report.update_info(environment=environment)
    report.record_run(
        run,
        {
            "loss_scale": options.loss_scale,
            "seed": options.seed,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "every": options.every,
            "shadow": options.shadow,
            "forward": options.forward or options.origins,
            "origins": options.origins,
            "capture_dtype": str(next(setup.model.parameters()).dtype).removeprefix("torch."),
            "world_size": setup.world,
            **({"batches_ended_on": list(ran.ended_on)} if ran.ended_on else {}),
        },
        meta,
    )
