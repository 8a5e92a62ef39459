"""Block-scaled recipes: an element format, a block shape and a scale rule.

Under block scaling every block of values shares one scale, chosen from the
block's own maximum, so whether a value survives depends on its block, not on
the tensor. A :class:`Recipe` is data: :mod:`fpaudit.kernels.blockstats` turns a tensor
into exact per-class counts for one. The rules follow the reference
implementations named beside each:

``mx-floor`` (OCP MX v1.0 section 6.3; torchao ``to_mx`` FLOOR)
    ``X = 2**(floor(log2(block_amax)) - emax_elem)``, an E8M0 power of two
    clamped to ``[2**-127, 2**127]``. The block maximum can land above the
    element format's largest value; it is clamped (saturated).
``mx-rceil`` (cuBLAS / Transformer Engine ``cvt.rp.satfinite.ue8m0``; torchao RCEIL)
    ``X = 2**ceil(log2(block_amax / elem_max))``, the fp32 quotient's exponent
    rounded up exactly: no saturation.
``nvfp4`` (torchao ``nvfp4_quantize`` with ``per_tensor_amax_to_scale``)
    A per-tensor fp32 scale ``amax / (448 * 6)``; each 16-element block's scale
    ``(block_amax / 6) / tensor_scale`` is clamped to E4M3's ``[2**-6, 448]`` and
    rounded to E4M3; elements are multiplied by
    ``(1 / tensor_scale) / block_scale`` in fp32, clamped to +-6, rounded to E2M1.
``pow2-floor`` (DeepSeek-V3 / Transformer Engine ``Float8BlockScaling``)
    The multiplier ``elem_max / block_amax`` (fp32) rounded down to a power of
    two (its fp32 exponent), so the block maximum lands in ``(elem_max/2, elem_max]``.
``amax`` (Transformer Engine ``Float8CurrentScaling``)
    The multiplier ``elem_max / amax`` in fp32, one block per tensor.

A multiplier that overflows fp32 (a tiny amax) is clamped to fp32's largest
value (pow2: ``2**127``), as Transformer Engine does.

Elements round to nearest, ties to even, except under ``rounding="stochastic"``
(``nvfp4-sr``, as NVFP4 training recipes quantize gradients): the scale is the same
(scales still round to nearest), but a scaled value between adjacent representable
magnitudes ``lo < |v| < hi`` rounds to ``hi`` with probability
``(|v| - lo) / (hi - lo)``, else to ``lo``. Its class counts are *expected* counts
(floats; see :func:`fpaudit.kernels.blockstats.expected_block_stats`).

Known limitations: the stochastic rounding is the ideal one (a probability exactly
proportional to the distance); hardware draws a few random bits per element, which
moves each probability by at most ``2**-bits``. The 2-D orientation ``columnwise``
quantizes along the first dimension of the tensor viewed as ``(-1, last)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from fpaudit.errors import UsageError
from fpaudit.numerics.formats import FORMATS, Format, OverflowResult

E2M1 = Format("fp4_e2m1", "float4_e2m1fn_x2", 1, 0, 6.0, OverflowResult.SATURATE)
"""OCP FP4 E2M1: 1 fraction bit, smallest normal 1.0, largest 6.0, subnormal 0.5."""
E4M3 = FORMATS["fp8_e4m3fn"]
E5M2 = FORMATS["fp8_e5m2"]

SCALE_RULES = ("mx-floor", "mx-rceil", "nvfp4", "pow2-floor", "amax", "amax-pow2")
ORIENTATIONS = ("rowwise", "columnwise")
ROUNDINGS = ("nearest", "stochastic")
E8M0_BIAS = 127


@dataclass(frozen=True)
class RecipeSummary:
    """One recipe as ``fpaudit recipes`` lists it (:attr:`Recipe.summary`): its block
    (``"tensor"`` or ``"rows x columns"``), scale rule and format, and the element
    thresholds after the block scale. Round to nearest: every magnitude up to
    ``element_flush_at`` becomes 0; stochastic rounding flushes none for certain, and any
    below ``element_may_flush_below`` may flush (the other is None)."""

    recipe: str
    element: str
    block: str
    orientation: str
    scale_rule: str
    scale_format: str
    element_flush_at: float | None
    element_may_flush_below: float | None
    element_smallest_normal: float
    element_max: float
    rounding: str
    cost: int
    description: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Recipe:
    """One block-scaled quantization recipe.

    ``block`` is ``(rows, columns)`` of one block of the tensor viewed as
    ``(-1, last dimension)``; ``(0, 0)`` means the whole tensor is one block.
    ``cost`` orders recipes for ``fpaudit plan`` (cheaper first: fewer bits
    moved and multiplied per element). ``rounding`` is how elements round (see the
    module); ``stochastic`` makes the class counts expected values.
    """

    name: str
    element: Format
    block: tuple[int, int]
    scale_rule: str
    cost: int
    orientation: str = "rowwise"
    description: str = ""
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"unknown scale rule {self.scale_rule!r}")
        if self.orientation not in ORIENTATIONS:
            raise ValueError(f"unknown orientation {self.orientation!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {self.rounding!r}")

    @property
    def expected(self) -> bool:
        """Whether the class counts are expected values (stochastic rounding), not exact."""
        return self.rounding == "stochastic"

    @property
    def per_tensor(self) -> bool:
        return self.block == (0, 0)

    @property
    def block_elements(self) -> int:
        return self.block[0] * self.block[1]

    @property
    def scale_format(self) -> str:
        """The format the block scale is stored in."""
        if self.scale_rule.startswith("mx-"):
            return "e8m0"
        if self.scale_rule == "nvfp4":
            return "e4m3+fp32"
        return "fp32" if self.scale_rule == "amax" else "fp32 pow2"

    @property
    def scale_code_bias(self) -> int:
        """What is subtracted from a block's scale code to show it: E8M0's bias, so that the
        code reads as log2 of the scale; nvfp4's codes are E4M3 bits, shown as they are."""
        return 0 if self.scale_rule == "nvfp4" else E8M0_BIAS

    @property
    def summary(self) -> RecipeSummary:
        """This recipe as ``fpaudit recipes`` lists it: a field of :class:`RecipeSummary`
        not computed here is this recipe's attribute of the same name."""
        element = self.element
        computed: dict[str, Any] = {
            "recipe": self.name,
            "element": element.name,
            "block": "tensor" if self.per_tensor else f"{self.block[0]}x{self.block[1]}",
            "element_flush_at": None if self.expected else element.round_to_zero_edge,
            "element_may_flush_below": element.smallest_subnormal if self.expected else None,
            "element_smallest_normal": element.smallest_normal,
            "element_max": element.max_finite,
        }
        return RecipeSummary(
            **{
                item.name: computed[item.name]
                if item.name in computed
                else getattr(self, item.name)
                for item in dataclasses.fields(RecipeSummary)
            }
        )

    @property
    def element_max_pow2(self) -> int:
        """floor(log2) of the element format's largest value (8 for E4M3)."""
        return math.frexp(self.element.max_finite)[1] - 1


# Cost order (cheapest first), documented in docs/commands/recipes.md: 4-bit elements before
# 8-bit, MX (one E8M0 per 32) before finer or wider scales, per-tensor last.
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("mxfp4", E2M1, (1, 32), "mx-floor", 10, description="OCP MXFP4, E8M0 floor"),
        Recipe("mxfp4-rceil", E2M1, (1, 32), "mx-rceil", 11, description="MXFP4, E8M0 round-up"),
        Recipe("nvfp4", E2M1, (1, 16), "nvfp4", 12, description="E4M3 per 16 x fp32 per tensor"),
        Recipe(
            "nvfp4-sr",
            E2M1,
            (1, 16),
            "nvfp4",
            13,
            description="nvfp4, stochastic rounding: expected counts",
            rounding="stochastic",
        ),
        Recipe("mxfp8-e4m3", E4M3, (1, 32), "mx-floor", 20, description="OCP MXFP8, E8M0 floor"),
        Recipe("mxfp8-e4m3-rceil", E4M3, (1, 32), "mx-rceil", 21, description="E8M0 round-up"),
        Recipe("mxfp8-e5m2", E5M2, (1, 32), "mx-floor", 22, description="OCP MXFP8, E8M0 floor"),
        Recipe("mxfp8-e5m2-rceil", E5M2, (1, 32), "mx-rceil", 23, description="E8M0 round-up"),
        Recipe("fp8-block-1x128", E4M3, (1, 128), "pow2-floor", 30, description="DeepSeek-V3"),
        Recipe("fp8-block-128x128", E4M3, (128, 128), "pow2-floor", 31, description="weights"),
        Recipe("fp8-tensor-e4m3", E4M3, (0, 0), "amax", 40, description="current scaling"),
        Recipe("fp8-tensor-e4m3-pow2", E4M3, (0, 0), "amax-pow2", 41, description="pow2 scale"),
        Recipe("fp8-tensor-e5m2", E5M2, (0, 0), "amax", 42, description="current scaling"),
        Recipe("fp8-tensor-e5m2-pow2", E5M2, (0, 0), "amax-pow2", 43, description="pow2 scale"),
    )
}
COLUMNWISE_SUFFIX = ":col"
"""``mxfp8-e4m3:col`` is the recipe quantized along the first dimension (2-D operands)."""


def get_recipe(name: str) -> Recipe:
    """A recipe by its CLI spelling (``:col`` for the columnwise orientation)."""
    base, col, rest = name.partition(COLUMNWISE_SUFFIX)
    recipe = RECIPES.get(base)
    if recipe is None or rest:
        known = ", ".join(RECIPES)
        raise UsageError(
            f"unknown recipe {name!r}; known: {known} (add {COLUMNWISE_SUFFIX!r} for columnwise)"
        )
    if not col:
        return recipe
    if recipe.per_tensor:
        raise UsageError(f"recipe {base!r} has one scale per tensor: no columnwise variant")
    return Recipe(
        name,
        recipe.element,
        recipe.block,
        recipe.scale_rule,
        recipe.cost,
        "columnwise",
        recipe.description + ", columnwise",
        recipe.rounding,
    )


def as_recipe(recipe: Recipe | str) -> Recipe:
    return recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
