"""Capture overhead: a full training step (forward + backward) with and without fpaudit.

    python benchmarks/overhead.py            # or: make bench
    python benchmarks/overhead.py --reps 9 --json results.json

Plain and audited steps run in one process, interleaved (plain, audited,
plain, ...), on the same weights and batch, so machine noise hits both alike.
It prints medians and the ratio of medians; absolute times on a shared
machine mean little, the ratio is the number to quote.
"""

from __future__ import annotations

import argparse
import json
import platform
import runpy
import statistics
import sys
import time
from pathlib import Path

import torch

import fpaudit

ROOT = Path(__file__).resolve().parent.parent


def _sample(name: str) -> dict:
    return runpy.run_path(str(ROOT / "sample_configs" / f"{name}.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="transformer", choices=["transformer", "mlp", "convnet"])
    parser.add_argument("--reps", type=int, default=7, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    sample = _sample(args.model)
    model = sample["model"]()
    batch = next(iter(sample["batches"]()))
    loss_fn = sample["loss"]

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()

    audit = fpaudit.audit(model)

    def audited() -> None:
        with audit:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            loss.backward()
            audit.step(loss=loss)

    for _ in range(args.warmup):
        plain()
        audited()
    times: dict[str, list[float]] = {"plain": [], "fpaudit": []}
    for _ in range(args.reps):
        for name, step in (("plain", plain), ("fpaudit", audited)):
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)

    records = audit.report.records
    last = records[records["step"] == records["step"].max()]
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "model": args.model,
        "reps": args.reps,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "backward_values_per_step": int(last.loc[last["kind"] == "backward", "elements"].sum()),
        "backward_outputs_per_step": int(last.loc[last["kind"] == "backward", "calls"].sum()),
        "median_seconds": medians,
        "ratio": medians["fpaudit"] / medians["plain"],
    }
    values = result["backward_values_per_step"] / 1e6
    outputs = result["backward_outputs_per_step"]
    print(
        f"model {args.model}: {values:.1f} M backward values in {outputs} op outputs per step; "
        f"torch {torch.__version__}, {result['threads']} threads, {args.reps} interleaved reps"
    )
    print(f"{'':10}{'median step':>14}{'ratio':>8}")
    for name in ("plain", "fpaudit"):
        print(f"{name:10}{medians[name] * 1e3:>11.1f} ms{medians[name] / medians['plain']:>7.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
