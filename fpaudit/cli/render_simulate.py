"""What ``fpaudit simulate`` prints: a loss scaler's replay against a static scale, and
FP8 delayed scaling's replay (``--policy te-delayed``) and sweep (``--sweep``).
Results go to stdout, messages to stderr."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from fpaudit.cli.render import stdout
from fpaudit.cli.render_run import sparkline, steps_list
from fpaudit.rules import scalers
from fpaudit.text import module_label, percent, power

if TYPE_CHECKING:
    from fpaudit.rules.delayed import Replay as DelayedReplay
    from fpaudit.rules.delayed import Sweep as DelayedSweep
    from fpaudit.rules.simulation import Simulation


REPLAYED_SKIPS_SHOWN = 8


def simulation(result: Simulation) -> None:
    console = stdout()
    policy, static = result.policy, result.static
    trajectory = policy.trajectory
    settings = {
        k: v for k, v in policy.settings.to_dict().items() if v is not None and k != "policy"
    }
    described = ", ".join(
        f"{k} {power(v) if k in scalers.SCALE_PARAMETERS else v}" for k, v in settings.items()
    )
    console.print(
        f"Replayed {policy.name} ({described}) over {len(trajectory.scale)} step(s), "
        f"{result.format}:"
    )
    grid = Table(title_justify="left")
    for name in ("policy", "skipped", "first skipped steps", "scale at the end", "scale range",
                 "underflow (captured steps)"):  # fmt: skip
        grid.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True)
    rows = [(policy, f"{policy.name} (dynamic)"),
            (static, f"static {power(static.settings.init_scale)}")]  # fmt: skip
    if scalers.REGISTRY[policy.name].is_static:  # --policy static: its row is the static one
        rows = rows[1:]
    for run, label in rows:
        summary = run.summary()
        grid.add_row(
            label,
            str(summary.skipped),
            ", ".join(str(s) for s in summary.skipped_steps[:8]) or "-",
            _scale(summary.final_scale),
            f"{_scale(summary.min_scale)}..{_scale(summary.max_scale)}",
            percent(run.underflow_fraction) if run.nonzero else "not measured",
        )
    console.print(grid)
    console.print(f"Scale ({policy.name}): {sparkline(list(trajectory.scale))}")
    real = result.thresholds.real_scale
    if len(real) and (real != trajectory.scale).any():
        console.print(f"Scale (real run):  {sparkline(list(real))}")
    elif len(real):
        console.print("The replayed trajectory equals the real run's, step for step.")
    if trajectory.aborted_at is not None:
        console.print(
            Text(
                f"{policy.name} would have stopped the run at step "
                f"{trajectory.aborted_at}: an overflow at the minimum scale.",
                style="yellow",
            )
        )
    for skip in result.skip_origins[:REPLAYED_SKIPS_SHOWN]:
        if skip.source == "records":
            what = f"{skip.culprit} reaches {skip.value_at_scale:.4g} there (captured values)"
        else:
            what = f"{skip.culprit} (what the run saw make inf/NaN at that step)"
        console.print(f"  replayed skip at step {skip.step} ({power(skip.scale)}): {what}")
    if len(result.skip_origins) > REPLAYED_SKIPS_SHOWN:
        console.print(f"  … {len(result.skip_origins) - REPLAYED_SKIPS_SHOWN} more (--json)")
    for note in result.notes:
        console.print(f"Note: {note}")


def _scale(value: float | None) -> str:
    """A replayed scale; "-" for a replay of no steps (which simulate refuses)."""
    return "-" if value is None else power(value)


def _bounded(lower: float, upper: float) -> str:
    """A fraction, or its bounds when the replay could only bound it."""
    return percent(lower) if lower == upper else f"{percent(lower)}..{percent(upper)}"


def fp8_replay(result: DelayedReplay, top: int = 10) -> None:
    """``simulate --policy te-delayed``: overflow and flush per op, and the overflow steps."""
    console = stdout()
    s = result.settings
    summary = result.summary()
    console.print(
        f"Replayed {s.policy} (amax_history_len {s.amax_history_len}, margin {s.margin}, "
        f"{s.amax_compute_algo}) over {summary.steps} step(s), {summary.ops} op(s):"
    )
    lower, upper = result.overflow_steps("lower"), result.overflow_steps("upper")
    if upper:
        console.print(
            f"Overflow in {steps_list(upper, len(upper))}"
            + ("" if lower == upper else f" ({len(lower)} certain, {len(upper)} possible)")
        )
    else:
        console.print("No step overflows.")
    overflow = _bounded(summary.overflow_fraction_lower, summary.overflow_fraction_upper)
    flushed = _bounded(summary.flushed_fraction_lower, summary.flushed_fraction_upper)
    console.print(
        f"Overflow: {overflow} of nonzero values; flushed below the smallest normal: {flushed}."
    )
    ops = result.per_op()
    ops = ops.sort_values(
        ["overflow_steps_upper", "flushed_upper_fraction"], ascending=False, kind="stable"
    ).head(top)
    grid = Table(title="ops (worst first)", title_justify="left")
    for name in ("module", "op", "format", "overflow steps", "overflow", "flushed",
                 "scale range"):  # fmt: skip
        grid.add_column(name, justify="left" if name in ("module", "op", "format")
                        else "right", no_wrap=True)  # fmt: skip
    for row in ops.itertuples():
        steps = str(row.overflow_steps_upper)
        if row.overflow_steps_lower != row.overflow_steps_upper:
            steps = f"{row.overflow_steps_lower}..{steps}"
        grid.add_row(
            module_label(str(row.module)),
            str(row.op).removeprefix("aten.").removesuffix(".default"),
            str(row.format),
            steps,
            _bounded(row.overflow_lower_fraction, row.overflow_upper_fraction),
            _bounded(row.flushed_lower_fraction, row.flushed_upper_fraction),
            f"{row.min_scale:.4g}..{row.max_scale:.4g}",
        )
    console.print(grid)
    for note in result.notes:
        console.print(f"Note: {note}")


def fp8_sweep(result: DelayedSweep) -> None:
    """``simulate --policy te-delayed --sweep``: the grid and the recommended pair."""
    console = stdout()
    console.print(
        f"Swept {result.policy} ({result.amax_compute_algo}) over amax_history_len x margin; "
        f"gate: at most {result.max_overflow_steps} overflow step(s)."
    )
    grid = Table(title_justify="left")
    for name in ("history", "margin", "overflow steps", "overflow", "flushed", ""):
        grid.add_column(name, justify="right", no_wrap=True)
    for replay in result.replays:
        summary = replay.summary()
        low, high = summary.overflow_steps_lower, summary.overflow_steps_upper
        grid.add_row(
            str(replay.settings.amax_history_len),
            str(replay.settings.margin),
            str(high) if low == high else f"{low}..{high}",
            _bounded(summary.overflow_fraction_lower, summary.overflow_fraction_upper),
            _bounded(summary.flushed_fraction_lower, summary.flushed_fraction_upper),
            "<- recommended" if replay is result.recommended else "",
        )
    console.print(grid)
    chosen = result.recommended
    if chosen is None:
        console.print("No pair passes the gate.")
    else:
        console.print(
            f"Recommended: DelayedScaling(amax_history_len={chosen.settings.amax_history_len}, "
            f"margin={chosen.settings.margin}, "
            f'amax_compute_algo="{chosen.settings.amax_compute_algo}")'
        )
    for note in result.notes:
        console.print(f"Note: {note}")
