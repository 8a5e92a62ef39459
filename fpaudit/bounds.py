"""The values a parameter takes, declared once for the library and the command line.

A :class:`Bounds` is checked where the library's option classes and functions take the
value (``ScanOptions.steps``, ``gate(max_underflow=...)``) and, for the command line, where
the CLI's option declaration (``fpaudit.cli.options``) names the same object: one number,
one wording (``steps must be at least 1, got 0``; the CLI words it as ``--steps``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fpaudit.errors import OptionError


def _words(choices: tuple[str, ...]) -> str:
    """Choices as a message lists them: "a, b or c"; a longer list as "one of a, b, ..."."""
    if len(choices) > 3:
        return "one of " + ", ".join(choices)
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


@dataclass(frozen=True)
class Bounds:
    """The values an option takes: at least ``minimum``, at most ``maximum`` (a float
    option bounded by 0 and 1 is a fraction), or one of ``choices`` (a registry's names,
    read when a value is checked, so a registry that loads pandas loads it only then).
    The one place the command line checks a value; the message names the option as the
    library does and the CLI words it as its flag."""

    minimum: int | float | None = None
    maximum: int | float | None = None
    choices: Callable[[], tuple[str, ...]] | None = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of bounds (``must be at least 1, got 0``), else None."""
        if self.choices is not None:
            known = self.choices()
            return None if value in known else f"must be {_words(known)}, got {value!r}"
        low, high = self.minimum, self.maximum
        if (low is None or value >= low) and (high is None or value <= high):
            return None
        if low is not None and high is not None:
            fraction = "a fraction " if isinstance(high, float) and (low, high) == (0, 1) else ""
            return f"must be {fraction}between {low:g} and {high:g}, got {value}"
        if low is not None:
            return f"must be {'0 or more' if low == 0 else f'at least {low}'}, got {value}"
        return f"must be at most {high}, got {value}"

    def check(self, name: str, value: Any) -> None:
        """Raise :class:`OptionError` naming ``name`` when ``value`` is out of bounds."""
        problem = None if value is None else self.problem(value)
        if problem is not None:
            raise OptionError(name, problem)


AT_LEAST_1 = Bounds(minimum=1)
FRACTION = Bounds(minimum=0.0, maximum=1.0)
