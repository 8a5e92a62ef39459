"""Command options from a TOML file, merged under the command line.

A config file sets the same options as the flags, with ``_`` or ``-`` in
names. Top-level keys apply to every command that has that option; a table
named after a command (``[scan]``, ``[run]``, ``[show]``, ``[recommend]``,
``[simulate]``, ``[plot]``, ``[gate]``, ``[plan]``) applies to that command only
and wins over the top level. Unknown keys and tables are errors.
Precedence: command line > config file > built-in default.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

from fpaudit.cli.options import toml_schema
from fpaudit.errors import ConfigError, OptionError
from fpaudit.numerics.limits import LOG2_SCALE_MAX, LOG2_SCALE_MIN

_POWER = re.compile(r"^\s*2\s*(\^|\*\*)\s*([+-]?\d+)\s*$")


def parse_number(text: str, what: str) -> float:
    """A positive finite number written as ``65536``, ``1e4``, ``2^16`` or ``2**-3``;
    ``what`` names the option it is for (an :class:`~fpaudit.errors.OptionError` names it)."""
    match = _POWER.match(text)
    if match:
        exponent = int(match.group(2))
        if abs(exponent) > 1074:
            raise OptionError(what, f"{text} is out of range")
        return math.ldexp(1.0, exponent)
    try:
        value = float(text)
    except ValueError:
        raise OptionError(what, f"{text!r} is not a number; use e.g. 65536 or 2^16") from None
    if not (math.isfinite(value) and value > 0):
        raise OptionError(what, f"must be a positive number, got {text}")
    return value


def parse_scale(text: str, what: str = "scale") -> int:
    """log2 of a power-of-two scale written as ``1024``, ``0.5``, ``2^10`` or ``2**-3``;
    ``what`` names the option it is for (``scale``, ``loss_scale``), as in
    :func:`parse_number`."""
    match = _POWER.match(text)
    if match:
        log2 = int(match.group(2))
    else:
        try:
            value = float(text)
        except ValueError:
            raise OptionError(what, f"{text!r} is not a number; use e.g. 1024 or 2^10") from None
        if not (math.isfinite(value) and value > 0):
            raise OptionError(what, f"must be a positive number, got {text}")
        mantissa, exponent = math.frexp(value)
        if mantissa != 0.5:
            lower = exponent - 1
            raise OptionError(
                what,
                f"{text} is not a power of two; the nearest are "
                f"{math.ldexp(1, lower):g} (2^{lower}) and "
                f"{math.ldexp(1, lower + 1):g} (2^{lower + 1})",
            )
        log2 = exponent - 1
    if not LOG2_SCALE_MIN <= log2 <= LOG2_SCALE_MAX:
        raise OptionError(
            what,
            f"2^{log2} is outside the range of an fp32 scale "
            f"(2^{LOG2_SCALE_MIN} to 2^{LOG2_SCALE_MAX})",
        )
    return log2


# Command -> option name -> expected TOML type, from the one declaration of each option
# (fpaudit.cli.options). "formats" is a string or a list of strings; "scale" is a number or
# a string such as "2^12" or "recommended".
COMMAND_OPTIONS: dict[str, dict[str, str]] = toml_schema()


def _normalise(key: str) -> str:
    return key.replace("-", "_")


def _check_type(file: Path, where: str, key: str, kind: str, value: Any) -> Any:
    def fail(expected: str) -> ConfigError:
        return ConfigError(f"{file}: {where}{key} must be {expected}, got {value!r}")

    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise fail("an integer")
    elif kind == "float":
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise fail("a number")
        value = float(value)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise fail("true or false")
    elif kind == "str":
        if not isinstance(value, str):
            raise fail("a string")
    elif kind == "scale":
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise fail('a number or a string such as "2^12"')
        value = str(value)
    elif kind == "recipes":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail("a recipe name or a list of them")
    elif kind == "patterns":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail("a glob pattern or a list of them")
    elif kind in ("format", "formats"):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise fail("a format name or a list of them")
    return value


def load(file: str | Path) -> dict[str, Any]:
    """Parse and check the whole file (every table), so typos anywhere are caught."""
    path = Path(file)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None

    # A top-level key may mean different things to different commands (`steps`: scan's
    # count, show's flag): it must suit at least one of them.
    every_option: dict[str, list[tuple[str, str]]] = {}
    for command, options in COMMAND_OPTIONS.items():
        for option, option_kind in options.items():
            every_option.setdefault(option, []).append((command, option_kind))
    checked: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = _normalise(raw_key)
        if key in COMMAND_OPTIONS and isinstance(value, dict):
            section: dict[str, Any] = {}
            for raw_name, option_value in value.items():
                name = _normalise(raw_name)
                kind = COMMAND_OPTIONS[key].get(name)
                if kind is None:
                    known = ", ".join(sorted(COMMAND_OPTIONS[key]))
                    raise ConfigError(
                        f"{path}: unknown key {raw_name!r} in [{key}]; known: {known}"
                    )
                section[name] = _check_type(path, f"[{key}] ", name, kind, option_value)
            checked[key] = section
        elif key in every_option:
            checked[key] = _top_level(path, key, every_option[key], value)
        else:
            known = ", ".join(sorted(every_option))
            tables = ", ".join(f"[{c}]" for c in COMMAND_OPTIONS)
            raise ConfigError(
                f"{path}: unknown key {raw_key!r}; known: {known}, and the tables {tables}"
            )
    return checked


def _top_level(file: Path, key: str, uses: list[tuple[str, str]], value: Any) -> Any:
    """A top-level ``key``'s raw value, once it suits some command that takes it."""
    kinds: dict[str, list[str]] = {}
    for command, kind in uses:
        kinds.setdefault(kind, []).append(command)
    for kind in kinds:
        try:
            _check_type(file, "", key, kind, value)
            return value
        except ConfigError:
            continue
    if len(kinds) == 1:
        return _check_type(file, "", key, uses[0][1], value)  # raises its own message
    expected = "; or ".join(
        f"{_EXPECTED[kind]} (for {', '.join(commands)})" for kind, commands in kinds.items()
    )
    raise ConfigError(f"{file}: {key} must be {expected}, got {value!r}")


_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "scale": 'a number or a string such as "2^12"',
    "patterns": "a glob pattern or a list of them",
    "format": "a format name or a list of them",
    "formats": "a format name or a list of them",
}


def options_for(command: str, file: str | Path | None) -> dict[str, Any]:
    """The options ``file`` sets for ``command`` (top level, then its own table).

    A top-level key of a kind this command does not take (``steps = 2`` for ``show``,
    whose ``--steps`` is a flag) is another command's and left out."""
    if file is None:
        return {}
    data = load(file)
    known = COMMAND_OPTIONS[command]
    path = Path(file)
    options: dict[str, Any] = {}
    for key, value in data.items():
        if key in known and key not in COMMAND_OPTIONS:
            try:
                options[key] = _check_type(path, "", key, known[key], value)
            except ConfigError:
                continue  # suits another command (load checked that one does)
    options.update(data.get(command, {}))
    if "format" in options and known["format"] == "format":
        options["format"] = options["format"][0]  # single-format commands take the first
    return options
