"""Low-precision number formats, and exactly where a scaled value lands in each.

A :class:`Format` is a small frozen dataclass: three numbers (fraction bits,
log2 of the smallest normal, largest finite value) from which every threshold
is derived. ``Format.from_dtype`` builds one from ``torch.finfo``; the
registered formats are written out as literals so that reading a report
never imports torch (1.6 s of start-up), and the tests check each against
``torch.finfo`` and against hand-written constants.

:func:`fate` answers the one question the whole tool is built on: a value
``x`` of an fp32 tensor, multiplied by a power-of-two scale ``S`` in fp32 and
cast to the format (``(x * S).to(dtype)``), does it become zero, a subnormal,
a normal number, or overflow? It is computed with integers, modelling
round-to-nearest-even in two stages: the fp32 product (exact unless it falls
into fp32's subnormal range or overflows fp32) and then the cast.

Known limitations:

* ``float8_e4m3fn`` has no infinity. torch 2.13 saturates out-of-range casts to
  +-448 (earlier releases produced NaN). Either way information is lost, so a
  value whose rounding exceeds 448 (anything above 464) counts as overflow.
* Only round-to-nearest-even is modelled; stochastic rounding is not.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fpaudit.errors import UsageError

if TYPE_CHECKING:
    import torch


class OverflowResult(enum.StrEnum):
    """What torch's cast gives past a format's overflow edge."""

    INF = "inf"
    SATURATE = "saturate"  # the largest finite value (a format without inf)


class Fate(enum.IntEnum):
    """Where a nonzero finite value lands after scaling and casting."""

    UNDERFLOW = 0  # rounds to zero
    SUBNORMAL = 1  # nonzero, but the scaled value is below the smallest normal
    NORMAL = 2
    OVERFLOW = 3  # rounds beyond the largest finite value (inf, NaN or saturated)


@dataclass(frozen=True)
class FormatLimits:
    """Where a scaled value of one format rounds to zero, goes subnormal and overflows
    (``fpaudit formats``' row): :attr:`Format.limits`."""

    format: str
    dtype: str
    smallest_subnormal: float
    round_to_zero_edge: float
    smallest_normal: float
    max_finite: float
    overflow_edge: float
    overflow_edge_inclusive: bool
    overflow_result: OverflowResult

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Format:
    """A binary floating-point format with IEEE-style subnormals.

    ``mantissa_bits`` counts the stored fraction bits; ``min_normal_exp`` is
    log2 of the smallest normal; ``max_finite`` is the largest finite value.
    """

    name: str
    dtype_name: str  # the torch dtype, as in torch.float16
    mantissa_bits: int
    min_normal_exp: int
    max_finite: float
    overflow_result: OverflowResult = OverflowResult.INF  # what torch's cast gives past the edge

    @classmethod
    def from_dtype(
        cls, name: str, dtype: torch.dtype, overflow_result: OverflowResult = OverflowResult.INF
    ) -> Format:
        import torch

        info = torch.finfo(dtype)
        mantissa_bits = -math.frexp(info.eps)[1] + 1  # eps = 2**-mantissa_bits
        min_normal_exp = math.frexp(info.smallest_normal)[1] - 1
        dtype_name = str(dtype).removeprefix("torch.")
        return cls(
            name, dtype_name, mantissa_bits, min_normal_exp, float(info.max), overflow_result
        )

    @property
    def dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    @property
    def smallest_normal(self) -> float:
        return math.ldexp(1.0, self.min_normal_exp)

    @property
    def smallest_subnormal(self) -> float:
        return math.ldexp(1.0, self.min_normal_exp - self.mantissa_bits)

    @property
    def round_to_zero_edge(self) -> float:
        """Magnitudes at or below this round to zero (the tie goes to even, i.e. to 0)."""
        return self.smallest_subnormal / 2

    @property
    def max_exp(self) -> int:
        """log2 of the binade that holds ``max_finite``."""
        return math.frexp(self.max_finite)[1] - 1

    @property
    def overflow_edge(self) -> float:
        """Halfway between ``max_finite`` and the next value the format would have."""
        return self.max_finite + math.ldexp(1.0, self.max_exp - self.mantissa_bits - 1)

    @property
    def overflow_edge_inclusive(self) -> bool:
        """Does the tie at ``overflow_edge`` overflow? Only if max_finite's last bit is odd."""
        last_bit = int(math.ldexp(self.max_finite, self.mantissa_bits - self.max_exp)) & 1
        return bool(last_bit)

    @property
    def limits(self) -> FormatLimits:
        """This format's thresholds, as ``fpaudit formats`` lists them: each field of
        :class:`FormatLimits` is this format's attribute of the same name."""
        named: dict[str, Any] = {"format": self.name, "dtype": self.dtype_name}
        return FormatLimits(
            **{
                item.name: named[item.name] if item.name in named else getattr(self, item.name)
                for item in dataclasses.fields(FormatLimits)
            }
        )

    @property
    def overflow_note(self) -> str | None:
        """What a reader of the thresholds must know of this format's overflow: that it
        has no inf and torch's cast saturates, and from which torch release where earlier
        ones gave NaN (None when overflow gives inf). True on every supported release."""
        if self.overflow_result is not OverflowResult.SATURATE:
            return None
        since = SATURATING_CAST_SINCE.get(self.name)
        releases = f" (torch {since} on; NaN before)" if since else ""
        return f"{self.name} has no inf: torch's cast saturates at {self.max_finite:g}{releases}."

    @property
    def fp32_range(self) -> bool:
        """Whether the format has fp32's exponent range (bf16): its values rarely need a
        loss scale, which only moves them toward the top of a range they already fit in."""
        return self.min_normal_exp <= FP32.min_normal_exp and self.max_exp >= FP32.max_exp

    def round(self, mantissa: int, exponent: int) -> tuple[int, int] | None:
        """Round ``mantissa * 2**exponent`` (mantissa > 0) to nearest-even in this format.

        Returns the result as ``(mantissa, exponent)``, ``(0, 0)`` when it
        rounds to zero, or ``None`` when it overflows.
        """
        top = mantissa.bit_length() - 1 + exponent  # floor(log2(value))
        quantum = max(top, self.min_normal_exp) - self.mantissa_bits
        if quantum > exponent:
            shift = quantum - exponent
            kept = mantissa >> shift
            rest = mantissa & ((1 << shift) - 1)
            half = 1 << (shift - 1)
            if rest > half or (rest == half and kept & 1):
                kept += 1
            mantissa, exponent = kept, quantum
        if mantissa == 0:
            return (0, 0)
        if math.ldexp(mantissa, exponent) > self.max_finite:
            return None
        return (mantissa, exponent)


# Written out so that no torch import is needed; tests/numerics/test_formats.py checks
# every one against Format.from_dtype (torch.finfo).
FP32 = Format("fp32", "float32", 23, -126, math.ldexp(2 - 2**-23, 127))

# The torch release from which the eager cast past a saturating format's overflow edge
# gives its largest finite value; the releases before it give NaN
# (fpaudit/torch_internals.py, "Semantics that moved"; tests/numerics/test_formats.py
# checks each release it runs on). fpaudit counts both as overflow.
SATURATING_CAST_SINCE = {"fp8_e4m3fn": "2.13"}

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp16", "float16", 10, -14, 65504.0),
        Format("bf16", "bfloat16", 7, -126, math.ldexp(2 - 2**-7, 127)),
        Format("fp8_e4m3fn", "float8_e4m3fn", 3, -6, 448.0, OverflowResult.SATURATE),
        Format("fp8_e5m2", "float8_e5m2", 2, -14, 57344.0),
    )
}


AMP_NAMES = {FORMATS[name].dtype_name: name for name in ("fp16", "bf16")}
"""The formats autocast holds values in (``--amp fp16`` / ``bf16``), by their dtype's name:
the one map from a dtype to a format's name (``fpaudit.run.scan.AMP_DTYPES`` and the
autocast probe's dtype names are built from it)."""


def get_format(name: str) -> Format:
    """Look a format up by its CLI spelling, with a helpful error."""
    try:
        return FORMATS[name]
    except KeyError:
        known = ", ".join(FORMATS)
        raise UsageError(f"unknown format {name!r}; known: {known}") from None


def as_format(fmt: Format | str) -> Format:
    """A Format, given one or its name."""
    return fmt if isinstance(fmt, Format) else get_format(fmt)


def fate(fmt: Format, binade: int, fraction: int) -> Fate:
    """Where ``(x * S).to(fmt.dtype)`` lands, for ``|x * S| = (1 + fraction/2**23) * 2**binade``.

    ``binade`` is floor(log2) of the exact product ``|x| * S``; ``fraction`` is
    the 23-bit normalised fraction of ``|x|`` (a power-of-two scale keeps it).
    The product is first rounded to fp32, as ``x * S`` is on an fp32 tensor.
    """
    product = FP32.round((1 << 23) | fraction, binade - 23)
    if product is None:
        return Fate.OVERFLOW
    mantissa, exponent = product
    if mantissa == 0:
        return Fate.UNDERFLOW
    cast = fmt.round(mantissa, exponent)
    if cast is None:
        return Fate.OVERFLOW
    if cast[0] == 0:
        return Fate.UNDERFLOW
    if mantissa.bit_length() - 1 + exponent < fmt.min_normal_exp:
        return Fate.SUBNORMAL
    return Fate.NORMAL
