"""What ``fpaudit fp16-plan`` prints: the modules to keep out of fp16, the loss scale,
the verifying step and the snippet to paste. Results go to stdout, messages to stderr."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text

from fpaudit.cli.render import short_op, stdout, unscalable_counts
from fpaudit.text import module_label, percent, scale_text

if TYPE_CHECKING:
    from fpaudit.run.fp16plan import Fp16Plan


def fp16plan_target() -> float:
    from fpaudit.run.fp16plan import TARGET_SKIP_RATE

    return TARGET_SKIP_RATE


def fp16_plan(plan: Fp16Plan) -> None:
    """``fpaudit fp16-plan``: the modules to keep out, the scale, the verification, a snippet."""
    console = stdout()
    console.print(
        f"fp16 plan for {plan.model_file} ({plan.steps} step(s) scanned in fp32, headroom "
        f"{plan.headroom_bits} bit(s), underflow limit {percent(plan.max_underflow)}):"
    )
    if plan.log2_scale is None:
        console.print(Text("No scale keeps the underflow within the limit.", style="red"))
    if plan.keep_out:
        console.print("Keep out of fp16 (autocast disabled, fp32 inputs):")
        for r in plan.ranges:
            console.print(
                f"  {module_label(r.module)}: forward amax {r.forward_amax:.4g}, "
                f"backward amax {r.backward_amax:.4g} (unscaled)"
            )
    else:
        console.print("No module needs to leave fp16.")
    if plan.log2_scale is not None:
        console.print(
            f"Loss scale S = {scale_text(plan.log2_scale)}: "
            f"{percent(plan.underflow_fraction)} of the backward values left in fp16 underflow."
        )
    why = plan.scales_differ_because()
    if plan.recommended_log2_scale is not None and plan.log2_scale is not None:
        same = "the same scale" if why is None else f"S = {scale_text(plan.recommended_log2_scale)}"
        console.print(
            f"scan/recommend give {same} (headroom {plan.recommended_headroom_bits} bits, every "
            f"module in fp16){'' if why is None else ': ' + why}."
        )
    unscalable = unscalable_counts(plan.unscalable_overflow, plan.unscalable_underflow)
    if unscalable:
        ops = "; ".join(
            f"{g.node} ({short_op(g.op)}) in {len(g.modules)} module(s)"
            for g in plan.unscalable[:3]
        )
        console.print(
            f"{unscalable} fp16 at every scale in the fp32 scan ({ops}): no loss scale fixes "
            "them; the verifying step below shows whether autocast keeps them in fp32."
        )
    console.print(
        f"growth_interval = {plan.growth_interval}: growth attempts skip at most 1/(N + 1) "
        f"of the steps, kept below {percent(fp16plan_target())}; "
        f"{round(plan.overflow_rate_at_2s * plan.steps)} of {plan.steps} scanned step(s) "
        f"overflow at 2S, so growth would skip about {percent(plan.predicted_skip_rate)} of "
        "steps."
    )
    for note in plan.notes:
        console.print(f"Note: {note}")
    result = plan.verification
    if result is not None:
        updated = sum(1 for p in result.parameters if p.changed_mixed)
        if result.passed:
            console.print(
                f"Verified: an fp16 step at S with these modules kept out is finite, loses "
                f"{percent(result.lost_fraction)} of nonzero gradient elements, and updates "
                f"{updated} of {len(result.parameters)} parameter(s) (every one fp32 updates)."
            )
        else:
            problem = "its gradients held inf or NaN" if result.skipped else (
                f"{len(result.stalled)} parameter(s) did not update"
            )  # fmt: skip
            console.print(
                Text(f"FAIL: the verifying fp16 step did not pass: {problem}.", style="red")
            )
    if plan.log2_scale is not None:
        console.print("Paste:")
        console.print(plan.snippet(), markup=False, highlight=False)
