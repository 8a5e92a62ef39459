"""The errors fpaudit raises on bad input.

Every one of them becomes exactly one line on stderr and exit code 2 in the
CLI (see ``cli.main``). Messages name the culprit and, where there is one, the
fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


class FpauditError(Exception):
    """Base class: a problem with the user's input, not a bug in fpaudit."""

    exit_code = 2


class UsageError(FpauditError):
    """A flag, option or config value is invalid."""


class OptionError(UsageError):
    """A bad value for a library parameter, named as the library names it
    (``steps must be at least 1, got 0``); the CLI names the flag instead.

    ``mentions`` are the other parameters ``detail`` names, as ``name`` or
    ``name='value'`` (``hysteresis does not apply to policy='torch'; it takes
    init_scale``); :meth:`as_flag` words them as flags too."""

    def __init__(self, option: str, detail: str, *, mentions: Sequence[str] = ()) -> None:
        super().__init__(f"{option} {detail}")
        self.option = option
        self.detail = detail
        self.mentions = tuple(mentions)

    def as_flag(self) -> str:
        """The message as the command line says it: ``--steps must be at least 1, got 0``,
        ``--hysteresis does not apply to --policy torch; it takes --init-scale``."""
        detail = self.detail
        for name in self.mentions:
            flag = _flag(name)
            detail = re.sub(rf"(?<![-\w]){name}='([^']*)'", rf"{flag} \1", detail)
            detail = re.sub(rf"(?<![-\w]){name}\b", flag, detail)
        return f"{_flag(self.option)} {detail}"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class ConfigError(FpauditError):
    """The TOML config file is missing, malformed or has unknown keys."""


class ModelFileError(FpauditError):
    """The model file is missing, broken, or does not follow the contract."""


class ModelExit(ModelFileError):
    """Model code called ``sys.exit`` or ``os._exit``: an error, never a quiet success."""


class ReportError(FpauditError):
    """A report directory is missing, corrupt, or of an unknown schema version."""


class ReportExists(ReportError):
    """The target of a report write already exists and ``force=True`` was not given
    (the CLI says ``--force``)."""

    def __init__(self, target: object) -> None:
        super().__init__(f"{target} already exists; pass force=True to overwrite it")
        self.target = target


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``exit_code`` is 130 or 143 as shells expect."""

    def __init__(self, signal_name: str = "SIGINT", exit_code: int = 130) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.exit_code = exit_code
