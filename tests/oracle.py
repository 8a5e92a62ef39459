"""The cast oracle: what torch itself does to ``x * S`` cast to a format.

Everything fpaudit predicts from histograms is compared against this.
"""

from __future__ import annotations

import torch

from fpaudit.numerics.formats import Format

# float8_e4m3fn has no inf and torch saturates out-of-range casts to 448, so
# the cast cannot show an overflow. By hand: 448 = 1.75 * 2**8 (mantissa 110,
# last bit even), the next step would be 480, the tie is 448 + 32/2 = 464 and
# rounds to even, i.e. down to 448. So overflow is |x * S| > 464.
E4M3FN_OVERFLOW_ABOVE = 464.0


def oracle_counts(x: torch.Tensor, fmt: Format, log2_scale: int) -> dict[str, int]:
    """Counts of underflow/flushed/subnormal/overflow for float32 ``x`` at S = 2**log2_scale."""
    assert x.dtype == torch.float32
    assert -149 <= log2_scale <= 127, "S must be an fp32 number"
    scale = torch.tensor(2.0**log2_scale, dtype=torch.float32)
    finite = torch.isfinite(x)
    nonzero = finite & (x != 0)
    product = x * scale  # fp32 multiply, exactly what a user's code does
    cast = product.to(fmt.dtype).to(torch.float32)
    underflow = nonzero & (cast == 0)
    flushed = nonzero & (product.abs() < fmt.smallest_normal)
    if fmt.overflow_result == "saturate":
        overflow = finite & ~(product.abs() <= E4M3FN_OVERFLOW_ABOVE)
        # and torch's cast really does saturate (or NaN) those values
        assert bool(
            (cast[overflow].abs() == fmt.max_finite).logical_or(cast[overflow].isnan()).all()
        )
    else:
        overflow = finite & ~torch.isfinite(cast)
    return {
        "elements": x.numel(),
        "zeros": int((x == 0).sum()),
        "nonfinite": int((~finite).sum()),
        "nonzero": int(nonzero.sum()),
        "underflow": int(underflow.sum()),
        "flushed": int(flushed.sum()),
        "subnormal": int((flushed & ~underflow).sum()),
        "overflow": int(overflow.sum()),
    }


def edge_values() -> torch.Tensor:
    """Ties, neighbours of every threshold of every format, fp32 subnormals, signed zeros, inf, NaN."""
    values = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0]
    values += [2.0**-149, 3 * 2.0**-149, 2.0**-127, 2.0**-126, (2 - 2.0**-23) * 2.0**-127]
    for edge in (2.0**-25, 2.0**-24, 2.0**-14, 65504.0, 65520.0, 2.0**-134, 2.0**-126, 448.0, 464.0,
                 480.0, 2.0**-10, 2.0**-9, 2.0**-6, 57344.0, 61440.0, 2.0**-17, 2.0**-16,
                 (2 - 2.0**-8) * 2.0**127, (2 - 2.0**-7) * 2.0**127):  # fmt: skip
        edge32 = torch.tensor(edge, dtype=torch.float32)
        values += [edge, torch.nextafter(edge32, torch.tensor(0.0)).item(),
                   torch.nextafter(edge32, torch.tensor(float("inf"))).item()]  # fmt: skip
    for fraction in (0x80, 0x81, 0x680000, 0x680001, 0x6FFFFF, 0x700000, 0x7F7FFF, 0x7F8000,
                     0x7FEFFF, 0x7FF000, 0x7FFFFE, 0x7FFFFF):  # fmt: skip
        for binade in (-20, 0, 3):
            values.append((1 + fraction / 2**23) * 2.0**binade)
    x = torch.tensor(values, dtype=torch.float32)
    return torch.cat([x, -x])
