"""How numbers and names are written in words: plain functions, no rich, no I/O.

Shared by the renderings (``render``, ``ci``, ``plot``) and by the library's
one-line verdicts (``gating``), so that a number reads the same everywhere.
"""

from __future__ import annotations

import math

ROOT_LABEL = "(root)"


def module_label(name: str) -> str:
    return ROOT_LABEL if name == "" else name


def module_in_prose(name: str) -> str:
    """A module's name inside a sentence: a path that starts with a number (a child of a
    top-level ``nn.Sequential``) reads "module 4", not a bare "4"."""
    label = module_label(name)
    return f"module {label}" if label.split(".")[0].isdigit() else label


def percent(fraction: float) -> str:
    if fraction == 0:
        return "0%"
    return f"{100 * fraction:.3g}%"


def scale_text(log2_scale: int | None) -> str:
    if log2_scale is None:
        return "none"
    value = math.ldexp(1.0, log2_scale)
    plain = f"{int(value)}" if log2_scale >= 0 and log2_scale < 53 else f"{value:.4g}"
    return f"2^{log2_scale} = {plain}"


def count(value: int) -> str:
    return f"{int(value):,}"


def expected_count(value: float) -> str:
    """A count that may be an expected value (stochastic rounding): 2 decimals when it
    is not whole (``1,234.57``), else as :func:`count`."""
    if float(value).is_integer():
        return count(int(value))
    return f"{float(value):,.2f}"


def power(value: float, *, large_digits: int = 6) -> str:
    """2^k for a power of two, else the number to 6 significant digits, or to
    ``large_digits`` from 1e6 up (the formats table writes bf16's maximum as 3.39e+38)."""
    mantissa, exponent = math.frexp(value)
    if value > 0 and math.isfinite(value) and mantissa == 0.5:
        return f"2^{exponent - 1}"
    return f"{value:.{6 if value < 1e6 else large_digits}g}"
