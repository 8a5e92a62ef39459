"""What an audit costs the host per backward op and per parameter: one thread, side by side.

    PYTHONPATH=. python benchmarks/host_overhead.py [--rounds 7] [--steps 20] [--quick]
        [--clock cpu|wall] [--warmup 2] [--skip-transformer]

On a GPU the backward runs asynchronously, so what an audited step adds is mostly the
host's work per backward op (the dispatch mode's Python, its decisions, the kernel
launches) and per parameter when the step is closed. This measures that work on the CPU,
with one thread (``torch.set_num_threads(1)``), on two models: a deep narrow MLP (200 x
(``Linear(16,16)``, ``Tanh``), batch 4: thousands of tiny backward ops, 400 parameters)
and the reference transformer of ``benchmarks/bench.py``. Four variants of a full step
(forward + backward), interleaved in rotating order, each round timing ``--steps`` steps
of one variant (the transformer: ``--steps // 10``, at least 1), medians over
``--rounds`` rounds:

* plain;
* a bare ``TorchDispatchMode`` (only ``return func(*args, **kwargs)``) around backward;
* fpaudit capturing every backward op, the step not closed (the audit stays open);
* fpaudit with ``audit.step(loss=loss)`` every step.

Each audited round opens a fresh audit and runs ``--warmup`` steps (default 2) before its
timed steps: an audit's first step also makes a row for every record key it meets (the
table, the selection's verdicts, the keys), once per run, which is not the per-step cost
this measures. That first step is timed on its own and printed apart. (Before this
option, each round's 20 timed steps included its audit's first step, so the audited
ratios carried 1/20 of that setup and depended on the round length.)

Printed per model: each variant's time per step and ratio to plain; the cost per backward
aten call of the bare mode and of fpaudit's capture ((variant - plain) / aten calls, the
calls counted by a counting mode); the cost per parameter of closing a step ((closed -
not closed) / parameters), and of ``audit.step()`` alone (timed around each call, median
over rounds), which the difference of two whole-step medians measures only roughly; the
first step of an audit that closes its steps, and its ratio to a timed audited step.
Before each round the garbage collector collects (untimed), so that a round does not pay
for what the one before it left; during the rounds it runs as it would in training (a
dispatch mode's tensors are tracked objects, so the bare mode pays for collections too).
The machine is shared and noisy: compare medians and ratios.
``--clock cpu`` (the default) times each round by this thread's CPU time
(``time.thread_time``: the engine runs a CPU backward on the calling thread, and
``torch.set_num_threads(1)`` keeps the kernels on it), which is the host's work and leaves
out the time other processes took the core; ``--clock wall`` times by the wall clock
(``time.perf_counter``), as the first version of this benchmark did.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # benchmarks/bench.py: the reference transformer

import fpaudit


class BareMode(TorchDispatchMode):
    """The least a Python dispatch mode costs: it only runs the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class CountingMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def deep_mlp(quick: bool) -> tuple[nn.Module, torch.Tensor, Callable[..., Any]]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(20 if quick else 200):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers), torch.randn(4, 16), lambda m, x: m(x).square().mean()


def measure(
    name: str,
    built: tuple[nn.Module, torch.Tensor, Callable[..., Any]],
    rounds: int,
    steps: int,
    clock: Callable[[], float] = time.thread_time,
    warmup: int = 2,
) -> dict[str, Any]:
    model, batch, loss_fn = built

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        with BareMode():
            loss.backward()

    step_seconds: list[float] = []  # audit.step() alone, per round
    first_seconds: list[float] = []  # the first step of each audit that closes its steps

    def closed(audit: fpaudit.Audit) -> float:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        start = clock()
        audit.step(loss=loss)
        return clock() - start

    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    with CountingMode() as counter:
        loss.backward()
    parameters = sum(1 for _ in model.parameters())

    def run(variant: str) -> float:
        """Seconds per step of ``steps`` steps of ``variant``, after a full garbage
        collection (untimed): a round does not pay for what the one before it left."""
        gc.collect()
        if variant in ("plain", "bare mode"):
            step = plain if variant == "plain" else bare
            start = clock()
            for _ in range(steps):
                step()
            return (clock() - start) / steps
        audit = fpaudit.audit(model)

        def audited() -> float:
            if variant == "capture, not closed":
                plain()
                return 0.0
            return closed(audit)

        closing = 0.0
        with audit:
            for done in range(warmup):  # the audit's setup: not what a step costs
                start = clock()
                audited()
                if done == 0 and variant != "capture, not closed":
                    first_seconds.append(clock() - start)
            start = clock()
            for _ in range(steps):
                closing += audited()
            elapsed = clock() - start
            audit.close(discard=True)
        if variant != "capture, not closed":
            step_seconds.append(closing / steps)
        return elapsed / steps

    variants = ["plain", "bare mode", "capture, not closed", "audit.step() each step"]
    for variant in variants:  # warm-up: kernels loaded, caches filled
        run(variant)
    step_seconds.clear()
    first_seconds.clear()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(rounds):
        for variant in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            times[variant].append(run(variant))
    med = {v: statistics.median(t) for v, t in times.items()}
    plain_s = med["plain"]
    return {
        "model": name,
        "aten_calls": counter.calls,
        "parameters": parameters,
        "median_step_seconds": med,
        "ratio": {v: med[v] / plain_s for v in variants},
        "us_per_aten_call_bare": 1e6 * (med["bare mode"] - plain_s) / counter.calls,
        "us_per_aten_call_capture": 1e6 * (med["capture, not closed"] - plain_s) / counter.calls,
        "us_per_parameter_close": 1e6
        * (med["audit.step() each step"] - med["capture, not closed"])
        / parameters,
        "us_per_parameter_step_alone": 1e6 * statistics.median(step_seconds) / parameters,
        "warmup": warmup,
        "first_step_seconds": statistics.median(first_seconds) if first_seconds else None,
    }


def report(result: dict[str, Any]) -> None:
    print(
        f"{result['model']}: {result['aten_calls']} backward aten calls, "
        f"{result['parameters']} parameters"
    )
    for variant, seconds in result["median_step_seconds"].items():
        print(f"  {variant:24s} {1000 * seconds:9.2f} ms/step  {result['ratio'][variant]:6.2f}x")
    bare, capture = result["us_per_aten_call_bare"], result["us_per_aten_call_capture"]
    print(f"  per backward aten call: bare mode {bare:.2f} us, capture {capture:.2f} us "
          f"({capture / bare:.2f}x the bare mode)")  # fmt: skip
    print(f"  closing a step: {result['us_per_parameter_close']:.2f} us per parameter "
          f"(audit.step() alone: {result['us_per_parameter_step_alone']:.2f})")  # fmt: skip
    first = result["first_step_seconds"]
    if first is not None:
        steady = result["median_step_seconds"]["audit.step() each step"]
        print(f"  an audit's first step (its rows made; not timed above, which follows "
              f"{result['warmup']} warm-up steps): {1000 * first:.2f} ms, "
              f"{first / steady:.2f}x a timed audited step")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small models, for a smoke run")
    parser.add_argument("--skip-transformer", action="store_true")
    parser.add_argument(
        "--warmup", type=int, default=2, help="steps each audit runs before its timed steps"
    )
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="this thread's CPU time, or wall"
    )
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, 1 thread, medians of {args.rounds} rounds, "
          f"{args.clock} clock")  # fmt: skip
    mlp = deep_mlp(args.quick)
    report(measure("deep narrow MLP", mlp, args.rounds, args.steps, clock, args.warmup))
    if not args.skip_transformer:
        built = bench.build("transformer", args.quick)
        steps = max(1, args.steps // 10)
        report(measure("reference transformer", built, args.rounds, steps, clock, args.warmup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
