"""Numeric limits shared by the library and the command line.

One home for the bounds that recommendation, drift, plot, the report reader,
the TOML config and the CLI all check against, so none of them restates a number.
"""

from __future__ import annotations

DEFAULT_HEADROOM_BITS = 4  # binades kept free below a format's max, as PopART's 1/16 bin edge
MAX_HEADROOM_BITS = 64  # more than any format's range (fp32 spans 277 binades, fp16 40)

# A loss scale is an fp32 number: keep it a normal one.
LOG2_SCALE_MIN = -126
LOG2_SCALE_MAX = 127
