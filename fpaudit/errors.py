"""The errors fpaudit raises on bad input.

Every one of them becomes exactly one line on stderr and exit code 2 in the
CLI (see ``cli.main``). Messages name the culprit and, where there is one, the
fix.

The library words a message in its own terms (``pass force=True``, ``max_steps must
be at least 1``); the command line says the same with flags (``pass --force``,
``--max-steps must be at least 1``). A message that names a parameter is built from
text and :class:`Named` parts (a :class:`Wording`): ``str()`` gives the library's
words, :meth:`Wording.as_flag` the command line's, and nothing is found again by
searching the text, so a path or a module that happens to be called ``out`` stays as
it is. The same wording serves the gate's reasons (:class:`fpaudit.rules.gating.Failure`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Literal

# The options whose library parameter is named otherwise, by option name: a repeatable
# flag is singular where the parameter is plural (``--module`` is Selection's ``modules``).
# Declared once, here: fpaudit.cli.options words these parameters with these flags too.
LIBRARY_NAMES: dict[str, str] = {
    "module": "modules",
    "exclude_module": "exclude_modules",
    "op": "ops",
    "exclude_op": "exclude_ops",
    "recipe": "recipes",
    "scale": "log2_scale",
}
_FLAGS = {library: "--" + option.replace("_", "-") for option, library in LIBRARY_NAMES.items()}


def flag(name: str) -> str:
    """The command-line flag of the library parameter ``name``: ``max_steps`` is
    ``--max-steps``; a parameter whose option is spelled otherwise (``Selection``'s
    ``modules``, whose flag is ``--module``) is in ``LIBRARY_NAMES``. A name that is a
    flag already (``-o``) stays as it is."""
    if name.startswith("-"):
        return name
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


@dataclass(frozen=True)
class Named:
    """A library parameter a message names: ``name`` as the library spells it and, where
    the message shows it, the ``value`` given: one string, the strings of a repeatable
    option, or ``True`` for a switch turned on.

    The library says ``name``, ``name='value'``, ``name=('a', 'b')``, ``name=True``; the
    command line ``--name``, ``--name value`` (quoted as a shell needs),
    ``--name a --name b``, ``--name``."""

    name: str
    value: str | tuple[str, ...] | Literal[True] | None = None

    def __str__(self) -> str:
        return self.name if self.value is None else f"{self.name}={self.value!r}"

    def as_flag(self) -> str:
        spelled = flag(self.name)
        if self.value is None or self.value is True:
            return spelled
        values = (self.value,) if isinstance(self.value, str) else self.value
        return " ".join(f"{spelled} {shlex.quote(value)}" for value in values)


@dataclass(frozen=True, init=False)
class Wording:
    """A one-line message of text and :class:`Named` parameters, in two vocabularies:
    ``str()`` the library's, :meth:`as_flag` the command line's."""

    parts: tuple[str | Named, ...]

    def __init__(self, *parts: str | Named) -> None:
        object.__setattr__(self, "parts", parts)

    def __str__(self) -> str:
        return "".join(str(part) for part in self.parts)

    def as_flag(self) -> str:
        """The message as the command line says it, each parameter as its flag."""
        return "".join(
            part.as_flag() if isinstance(part, Named) else str(part) for part in self.parts
        )


class FpauditError(Exception):
    """Base class: a problem with the user's input, not a bug in fpaudit.

    The message is text and :class:`Named` parameters (``UsageError("pass ",
    Named("force", True), " to overwrite it")``); ``str()`` words it as the library
    does, :meth:`as_flag` as the command line does."""

    exit_code = 2

    def __init__(self, *message: str | Named) -> None:
        self.wording = Wording(*message)
        super().__init__(str(self.wording))

    def as_flag(self) -> str:
        """The message as the command line says it (what ``cli.run`` prints)."""
        return self.wording.as_flag()


class UsageError(FpauditError):
    """A flag, option or config value is invalid."""


class OptionError(UsageError):
    """A bad value for a library parameter, named as the library names it
    (``steps must be at least 1, got 0``); the CLI names the flag instead.

    ``detail`` may name other parameters (``hysteresis does not apply to
    policy='torch'; it takes init_scale``): give them as :class:`Named` parts, and
    :meth:`as_flag` words them as flags too (``--hysteresis does not apply to
    --policy torch; it takes --init-scale``)."""

    def __init__(self, option: str, *detail: str | Named) -> None:
        super().__init__(Named(option), " ", *detail)
        self.option = option
        self.detail = str(Wording(*detail))


class ConfigError(FpauditError):
    """The TOML config file is missing, malformed or has unknown keys."""


class ModelFileError(FpauditError):
    """The model file is missing, broken, or does not follow the contract."""


class MissingTool(FpauditError):
    """The machine lacks a tool the run needs (a C++ compiler for ``torch.compile``):
    the environment is at fault, not the model."""


class ModelExit(ModelFileError):
    """Model code called ``sys.exit`` or ``os._exit``: an error, never a quiet success."""


class ReportError(FpauditError):
    """A report directory is missing, corrupt, or of an unknown schema version."""


class ReportExists(ReportError):
    """The target of a report write already exists and ``force=True`` was not given
    (the CLI says ``--force``)."""

    def __init__(self, target: object) -> None:
        super().__init__(
            f"{target} already exists; pass ", Named("force", True), " to overwrite it"
        )
        self.target = target


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``exit_code`` is 130 or 143 as shells expect."""

    def __init__(self, signal_name: str = "SIGINT", exit_code: int = 130) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.exit_code = exit_code


class MonitorFailure(BaseException):
    """fpaudit's own code failed inside a patched call, a hook or the backward capture
    (not the user's input, and not the script's error); ``__cause__`` is the error.

    A BaseException, so that the script's ``except Exception`` cannot take it for
    one of its own errors and carry on with a half-watched run. ``fpaudit run``
    reports it naming the script's line; the CLI otherwise as an internal error."""

    def __init__(self, where: str, error: BaseException) -> None:
        super().__init__(f"{where}: {type(error).__name__}: {error}")
        self.where = where
        self.error = error


# -- how a command ends when it neither succeeds nor fails on bad input -------------
# Raised by the library (fpaudit.run.jobs) once what was done is safe on disk; the CLI
# maps each to its exit status and its words in one place (fpaudit.cli.commands).


class Ended(Exception):
    """A command ends on purpose with ``exit_code``: not a success, not bad input."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


class ForkedChildEnded(Ended):
    """A child that model code forked (``os.fork``, a DataLoader worker) came back into
    the scan or run and finished: it ends quietly with ``exit_code`` (the parent writes
    and speaks for the audit)."""


class StoppedRun(Ended):
    """SIGINT or SIGTERM stopped a scan or run after ``done`` completed steps (of
    ``planned``, where known). ``kept`` is None when those steps were written to ``out``,
    marked incomplete; else why the report at ``out`` was kept instead. ``while_writing``:
    a second signal came while those steps were written (the write finished first)."""

    def __init__(self, stopped: Interrupted, done: int, planned: int | None, out: str,
                 kept: Wording | None = None, *,
                 while_writing: StoppedWhileWriting | None = None) -> None:  # fmt: skip
        super().__init__(stopped.exit_code)
        self.signal_name = stopped.signal_name
        self.done = done
        self.planned = planned
        self.out = out
        self.kept = kept
        self.while_writing = while_writing


class StoppedWhileWriting(Ended):
    """SIGINT or SIGTERM arrived while a report was written: the write finished first,
    whole, at ``path``; then the command stops."""

    def __init__(self, stopped: Interrupted, path: object) -> None:
        super().__init__(stopped.exit_code)
        self.signal_name = stopped.signal_name
        self.path = path


class ScriptExited(Ended):
    """``fpaudit run``'s script ended with its own ``sys.exit``: the command ends as
    ``python script`` would, with its status and ``message`` (``sys.exit("text")``'s
    text, which Python prints). Before it, ``error`` (why nothing was audited) or
    ``note`` (why an existing report was kept)."""

    def __init__(self, exit_code: int, message: str | None, *, error: Wording | None = None,
                 note: Wording | None = None) -> None:  # fmt: skip
        super().__init__(exit_code)
        self.message = message
        self.error = error
        self.note = note
