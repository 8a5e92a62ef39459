"""What the per-parameter inf/NaN flags of `fpaudit run` (issue 54) cost a step.

    python benchmarks/skip_flags.py [--params 6 100 1000] [--reps 2000] [--device cpu]

At ``scaler.unscale_`` fpaudit took the largest ``|grad|`` of the gradients before (one
``torch._foreach_norm`` per device, then their max); now it keeps each gradient's, flags
the non-finite ones and, when the step closes, reduces them on the device to a count and
the first positions in backward order (``fpaudit.run.skips.GradientFlags``). This times
both, per step, on gradients of the given parameter counts (sizes of an MLP's layers),
medians of ``--reps`` steps; nothing is read on the host in either.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fpaudit.capture import torch_patches as patches
from fpaudit.run.skips import GradientFlags
from fpaudit.run.steps import ScalarLog


def _time(step: object, reps: int, device: torch.device) -> float:
    """Median seconds of ``step()`` over ``reps`` calls (synchronised on CUDA)."""
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        step()  # type: ignore[operator]
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _one_size(count: int, reps: int, device: torch.device) -> tuple[float, float]:
    """Median seconds per step of the amax alone (before) and with the flags (now)."""
    params = [torch.nn.Parameter(torch.randn(64, 64, device=device)) for _ in range(count)]
    grads = [torch.randn_like(p) for p in params]
    flags, log = GradientFlags(), ScalarLog()

    def before() -> None:
        patches.amax(grads)

    def now() -> None:
        found = patches.gradient_maxima(grads)
        assert found is not None
        maxima, kept = found
        flags.note([params[i] for i in kept], maxima)
        maxima.max()
        flags.close([], log.add_vector)

    return _time(before, reps, device), _time(now, reps, device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, nargs="+", default=[6, 100, 1000])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"per step, median of {args.reps} ({device}); µs")
    print(f"{'parameters':>10} {'amax before':>12} {'amax + flags':>13} {'added':>8}")
    for count in args.params:
        old, new = _one_size(count, args.reps, device)
        print(f"{count:>10} {old * 1e6:>12.1f} {new * 1e6:>13.1f} {(new - old) * 1e6:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
