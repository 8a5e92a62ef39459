"""What `fpaudit run` costs a training loop: the sample loop plain, monitored, and capturing.

    python benchmarks/run_overhead.py [--steps 200] [--reps 5]

All variants run in this process, interleaved in rotating order; medians and ratios to
the plain script are printed (the machine is shared and noisy: compare ratios, not
times). The sample loop (sample_configs/train_loop.py, fp16 autocast, GradScaler, a
small MLP) is a worst case for per-step overhead: its steps take a few milliseconds, so
fpaudit's per-call Python work shows up as much as it ever will.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import runpy
import statistics
import sys
import time
from pathlib import Path

from fpaudit.run.training import RunOptions, run_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "sample_configs" / "train_loop.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    script_args = ["--steps", str(args.steps), "--device", "cpu"]

    def plain() -> None:
        saved = sys.argv
        sys.argv = [str(SCRIPT), *script_args]
        try:
            runpy.run_path(str(SCRIPT), run_name="__main__")
        finally:
            sys.argv = saved

    variants = {
        "plain script": plain,
        "fpaudit run --capture-every 0": lambda: run_script(
            SCRIPT, script_args, RunOptions(capture_every=0)
        ),
        "fpaudit run (--capture-every 10)": lambda: run_script(
            SCRIPT, script_args, RunOptions(capture_every=10)
        ),
        "fpaudit run --capture-every 1": lambda: run_script(
            SCRIPT, script_args, RunOptions(capture_every=1)
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(args.reps + 1):  # the first round warms up and is dropped
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            with contextlib.redirect_stdout(io.StringIO()):
                start = time.perf_counter()
                variants[name]()
                elapsed = time.perf_counter() - start
            if rep:
                times[name].append(elapsed)
    base = statistics.median(times["plain script"])
    print(f"{args.steps} steps of {SCRIPT.name}, median of {args.reps}:")
    for name in names:
        median = statistics.median(times[name])
        print(f"  {name:34s} {1000 * median / args.steps:7.2f} ms/step  {median / base:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
