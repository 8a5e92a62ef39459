"""fpaudit's benchmark: capture cost against peers, memory, report size, read speed.

    make bench                       # = python benchmarks/bench.py
    python benchmarks/bench.py --quick --json /tmp/bench.json   # small and fast (the tests run it)

Everything is measured on this machine in one run, as ratios to plain training
steps; times are medians of interleaved repetitions (plain, fpaudit, peers,
plain, ...), so machine noise hits every variant alike. Sections:

* step overhead: a full training step (forward + backward) of the reference
  transformer (sample_configs/transformer.py: 4 blocks, d=256, 8 heads, batch
  16 x 128) and of a GPT-2-small-shaped model (12 layers, d=768, 12 heads,
  vocab 50257, batch 4 x 128, built in code), for: plain; fpaudit capturing
  every backward op; fpaudit with ``--every 4``; fpaudit limited to one block
  (``--module 'blocks.0*'``); W&B ``watch(log="gradients", log_freq=1)``
  offline and TensorBoard ``add_histogram`` of every parameter gradient each
  step (both only when installed: ``pip install wandb tensorboard``); and, on
  the transformer, fpaudit with its dashboard metrics read each step (what the
  Lightning and Hugging Face callbacks log) and with ``--tensorboard``'s live
  writer (metrics and 8 modules' binade histograms, flushed each step);
  ``--skip recipes`` leaves out the ``--recipe`` variants (the slowest);
* peak memory: peak RSS of N plain steps vs N audited steps, in fresh processes;
* report size: bytes per captured op output per step, from a real scan;
* ``fpaudit scan`` end to end vs the same steps in a plain script (processes);
* ``fpaudit gate`` and ``recommend`` on a report of 10 million histogram rows;
* compiled steps: the reference transformer ``torch.compile``d (Inductor) against the same
  model compiled by ``fpaudit.compile`` with an audit open every step, side by side
  (compilation in the warm-up, not timed).

Prints a table and writes the results as JSON (default benchmarks/results/latest.json).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import fpaudit

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_configs" / "transformer.py"
FPAUDIT = [sys.executable, "-m", "fpaudit"]


def _sample() -> dict[str, Any]:
    return runpy.run_path(str(SAMPLE))


def build(model_name: str, quick: bool) -> tuple[torch.nn.Module, torch.Tensor, Callable[..., Any]]:
    sample = _sample()
    torch.manual_seed(0)
    if model_name == "transformer":
        sizes = dict(vocab=sample["VOCAB"], d_model=256, heads=8, layers=4, seq=128)
        batch = 16
    else:  # GPT-2 small: 12 layers, d=768, 12 heads, vocab 50257
        sizes = dict(vocab=50257, d_model=768, heads=12, layers=12, seq=128)
        batch = 4
    if quick:
        sizes.update(d_model=64, heads=4, layers=2, seq=32)
        batch = 4
    model = sample["TransformerLM"](**sizes)
    ids = next(sample["token_batches"](1, batch=batch, seq=sizes["seq"], vocab=sizes["vocab"]))
    return model, ids, sample["loss"]


# -- step overhead ----------------------------------------------------------
def step_variants(
    model: torch.nn.Module,
    ids: torch.Tensor,
    loss_fn: Callable[..., Any],
    tmp: Path,
    knobs: bool,
    all_recipes: bool = False,
    recipes: bool = True,
) -> tuple[dict[str, Callable[[], None]], fpaudit.Audit]:
    """The step functions to time, and the audit capturing every backward op."""
    import fpaudit

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model, ids).backward()

    full = fpaudit.audit(model)

    def audited(audit: fpaudit.Audit = full) -> None:
        with audit:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, ids)
            loss.backward()
            audit.step(loss=loss)

    one_block = fpaudit.audit(model, selection=fpaudit.Selection(modules=("blocks.0*",)))
    counter = {"step": 0}

    def every_4() -> None:
        counter["step"] += 1
        if counter["step"] % 4 == 0:
            audited()
        else:
            plain()

    variants: dict[str, Callable[[], None]] = {"plain": plain, "fpaudit": audited}
    # Block-scaled statistics (--recipe): one MX recipe, and every registered recipe.
    one_recipe = fpaudit.audit(model, recipes=["mxfp8-e4m3"])
    if recipes:
        variants["fpaudit --recipe mxfp8-e4m3"] = lambda: audited(one_recipe)
    if knobs and all_recipes and recipes:  # every recipe: about 50x a plain step, not in --quick
        from fpaudit.numerics.recipes import RECIPES

        all_recipes = fpaudit.audit(model, recipes=list(RECIPES))
        variants[f"fpaudit --recipe (all {len(RECIPES)})"] = lambda: audited(all_recipes)
    if knobs:
        variants["fpaudit --every 4"] = every_4
        variants["fpaudit --module 'blocks.0*'"] = lambda: audited(one_block)
        variants.update(_dashboard_variants(model, audited, tmp))
    with contextlib.suppress(ImportError):
        import wandb

        watched = copy.deepcopy(model)
        os.environ.setdefault("WANDB_SILENT", "true")
        wandb.init(project="fpaudit-bench", dir=str(tmp), mode="offline",
                   settings=wandb.Settings(silent=True, console="off"))  # fmt: skip
        wandb.watch(watched, log="gradients", log_freq=1)

        def with_wandb() -> None:
            watched.zero_grad(set_to_none=True)
            loss = loss_fn(watched, ids)
            loss.backward()
            wandb.log({"loss": float(loss.detach())})

        variants["W&B watch(gradients)"] = with_wandb
    with contextlib.suppress(ImportError):
        from torch.utils.tensorboard import SummaryWriter

        logged = copy.deepcopy(model)
        writer = SummaryWriter(log_dir=str(tmp / "tensorboard"))
        tb_step = {"n": 0}

        def with_tensorboard() -> None:
            logged.zero_grad(set_to_none=True)
            loss_fn(logged, ids).backward()
            for name, param in logged.named_parameters():
                writer.add_histogram(name, param.grad, tb_step["n"])
            tb_step["n"] += 1

        variants["TensorBoard add_histogram"] = with_tensorboard
    return variants, full


def _dashboard_variants(
    model: torch.nn.Module, audited: Callable[[fpaudit.Audit], None], tmp: Path
) -> dict[str, Callable[[], None]]:
    """The audit with its metrics read each step (what the Lightning and HF callbacks log),
    and with ``--tensorboard``'s live writer (metrics and 8 modules' histograms, flushed)."""
    import fpaudit

    variants: dict[str, Callable[[], None]] = {}
    metered = fpaudit.audit(model)

    def with_metrics() -> None:
        audited(metered)
        metered.metrics()

    variants["fpaudit + metrics() each step"] = with_metrics
    with contextlib.suppress(ImportError):
        from fpaudit.integrations.tensorboard import LiveWriter

        live, watched = LiveWriter(tmp / "fpaudit-live", "fp16"), fpaudit.audit(model)

        def with_live() -> None:
            audited(watched)
            live.write_step(watched)

        variants["fpaudit --tensorboard (live)"] = with_live
    return variants


def measure_steps(
    model_name: str,
    reps: int,
    warmup: int,
    quick: bool,
    tmp: Path,
    knobs: bool,
    recipes: bool = True,
) -> dict[str, Any]:
    model, ids, loss_fn = build(model_name, quick)
    variants, audit = step_variants(
        model, ids, loss_fn, tmp, knobs, all_recipes=not quick, recipes=recipes
    )
    for _ in range(warmup):
        for step in variants.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    blocks = 4 if knobs else 1  # --every 4 needs whole cycles: time blocks of 4 steps
    order = list(variants.items())
    for rep in range(reps):
        # Rotate the order every repetition: no variant always follows the same one.
        for name, step in order[rep % len(order) :] + order[: rep % len(order)]:
            start = time.perf_counter()
            for _ in range(blocks):
                step()
            times[name].append((time.perf_counter() - start) / blocks)
    records = audit.report.records
    last = records[(records["step"] == records["step"].max()) & (records["kind"] == "backward")]
    grads = sum(p.numel() for p in model.parameters())
    medians = {name: statistics.median(values) for name, values in times.items()}
    with contextlib.suppress(ImportError):
        import wandb

        if wandb.run is not None:
            wandb.finish()
    return {
        "model": model_name,
        "reps": reps,
        "parameters": grads,
        "backward_values_per_step": int(last["elements"].sum()),
        "backward_outputs_per_step": int(last["calls"].sum()),
        "median_step_seconds": medians,
        "ratio": {name: medians[name] / medians["plain"] for name in medians},
    }


# -- compiled steps ----------------------------------------------------------
def measure_compiled(reps: int, quick: bool) -> dict[str, Any]:
    """A plain compiled step against an audited compiled step, interleaved."""
    import fpaudit
    from fpaudit.capture import compiled

    model, ids, loss_fn = build("transformer", quick)
    twin = copy.deepcopy(model)
    plain_model = torch.compile(model)
    audited_model = compiled.compile(twin)
    audit = fpaudit.audit(audited_model)

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(plain_model, ids).backward()

    def audited() -> None:
        with audit:
            twin.zero_grad(set_to_none=True)
            loss = loss_fn(audited_model, ids)
            loss.backward()
            audit.step(loss=loss)

    variants = {"compiled": plain, "compiled + fpaudit": audited}
    start = time.perf_counter()
    plain()
    compile_plain = time.perf_counter() - start
    start = time.perf_counter()
    audited()
    compile_audited = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for rep in range(reps):
        for name, step in order[rep % 2 :] + order[: rep % 2]:
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    records = audit.report.records
    last = records[(records["step"] == records["step"].max()) & (records["kind"] == "backward")]
    stored = last[last["node"] == compiled.COMPILED_NODE]
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "model": "transformer",
        "reps": reps,
        "first_step_seconds": {"compiled": compile_plain, "compiled + fpaudit": compile_audited},
        "stored_values_per_step": int(stored["elements"].sum()),
        "stored_buffers_per_step": int(stored["calls"].sum()),
        "median_step_seconds": medians,
        "ratio": medians["compiled + fpaudit"] / medians["compiled"],
    }


# -- peak memory (fresh processes) ------------------------------------------
def _peak_rss_kb() -> int:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork/exec from the parent.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory_child(variant: str, steps: int, quick: bool) -> None:
    """Train ``steps`` steps; the plain child never imports fpaudit (or pandas)."""
    model, ids, loss_fn = build("transformer", quick)
    baseline = _peak_rss_kb()
    audit = None
    if variant == "fpaudit":
        import fpaudit

        audit = fpaudit.audit(model)
    for _ in range(steps):
        with audit if audit is not None else contextlib.nullcontext():
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, ids)
            loss.backward()
            if audit is not None:
                audit.step(loss=loss)
    print(json.dumps({"baseline_kb": baseline, "peak_kb": _peak_rss_kb()}))


def measure_memory(steps: int, quick: bool, runs: int) -> dict[str, Any]:
    """Peak RSS of fresh processes, alternating plain and fpaudit; medians of ``runs``."""
    peaks: dict[str, list[int]] = {"plain": [], "fpaudit": []}
    added: dict[str, list[int]] = {"plain": [], "fpaudit": []}
    for _ in range(runs):
        for variant in ("plain", "fpaudit"):
            args = [sys.executable, __file__, "--memory-child", variant, "--steps", str(steps)]
            output = subprocess.run(
                args + (["--quick"] if quick else []), capture_output=True, text=True, check=True
            )
            child = json.loads(output.stdout.strip().splitlines()[-1])
            peaks[variant].append(child["peak_kb"])
            added[variant].append(child["peak_kb"] - child["baseline_kb"])
    peak = {k: statistics.median(v) for k, v in peaks.items()}
    grown = {k: statistics.median(v) for k, v in added.items()}
    return {
        "runs": runs,
        "steps": steps,
        "peak_rss_mb": {k: v / 1024 for k, v in peak.items()},
        "peak_ratio": peak["fpaudit"] / peak["plain"],
        "training_memory_ratio": grown["fpaudit"] / max(1, grown["plain"]),
    }


# -- scan end to end and report size ----------------------------------------
PLAIN_SCRIPT = """
import runpy, sys, torch
sample = runpy.run_path(sys.argv[1]); torch.manual_seed(0)
model = sample["model"](); optimizer = sample["optimizer"](model.parameters())
for step, ids in zip(range(int(sys.argv[2])), sample["batches"]()):
    optimizer.zero_grad(set_to_none=True)
    loss = sample["loss"](model, ids); loss.backward(); float(loss); optimizer.step()
"""


def _timed(args: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(args, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_scan(steps: int, runs: int, tmp: Path) -> dict[str, Any]:
    import fpaudit

    out = tmp / "scan-report"
    scan = [*FPAUDIT, "scan", str(SAMPLE), "--steps", str(steps), "--out", str(out), "--force"]
    plain = [sys.executable, "-c", PLAIN_SCRIPT, str(SAMPLE), str(steps)]
    scan_times, plain_times = [], []
    for _ in range(runs):  # interleaved
        plain_times.append(_timed(plain, 1))
        scan_times.append(_timed(scan, 1))
    plain_seconds, scan_seconds = statistics.median(plain_times), statistics.median(scan_times)
    report = fpaudit.Report.read(out)
    outputs = int(report.records["calls"].sum())
    size = sum(f.stat().st_size for f in out.iterdir())
    return {
        "steps": steps,
        "plain_script_seconds": plain_seconds,
        "scan_seconds": scan_seconds,
        "ratio": scan_seconds / plain_seconds,
        "report_bytes": size,
        "captured_outputs": outputs,
        "report_bytes_per_output_per_step": size / max(1, outputs),
    }


# -- reading a big report -----------------------------------------------------
def measure_read(rows: int, runs: int, tmp: Path) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from big_report import build as build_big

    from fpaudit.report.store import Report

    out = tmp / "big-report"
    report = Report.from_builder(build_big(rows))
    report.update_info(formats=("fp16",), headroom_bits=4)
    report.write(out, force=True)
    gate = [*FPAUDIT, "gate", str(out), "--max-underflow", "0.01"]
    recommend = [*FPAUDIT, "recommend", str(out)]
    gate_times, recommend_times = [], []
    for _ in range(runs):
        gate_times.append(_timed_allowing(gate, {0, 1}))
        recommend_times.append(_timed_allowing(recommend, {0}))
    return {
        "histogram_rows": len(report.bins),
        "gate_seconds": statistics.median(gate_times),
        "recommend_seconds": statistics.median(recommend_times),
    }


def _timed_allowing(args: list[str], codes: set[int]) -> float:
    start = time.perf_counter()
    result = subprocess.run(args, capture_output=True)
    if result.returncode not in codes:
        raise RuntimeError(result.stderr.decode())
    return time.perf_counter() - start


# -- output -------------------------------------------------------------------
def print_table(results: dict[str, Any]) -> None:
    machine = f"torch {results['torch']}, {results['threads']} threads, {results['machine']}"
    print(f"fpaudit benchmark: {machine}")
    for section in results["steps"]:
        values = section["backward_values_per_step"] / 1e6
        outputs = section["backward_outputs_per_step"]
        print(
            f"\nstep overhead, {section['model']}: {values:.1f} M backward values in {outputs} "
            f"op outputs per step, {section['parameters'] / 1e6:.1f} M parameters; "
            f"median of {section['reps']} interleaved reps"
        )
        print(f"  {'variant':32}{'median step':>14}{'ratio':>8}")
        for name, seconds in section["median_step_seconds"].items():
            print(f"  {name:32}{seconds * 1e3:>11.1f} ms{section['ratio'][name]:>7.2f}x")
    memory = results.get("memory")
    if memory:
        rss = memory["peak_rss_mb"]
        print(
            f"\npeak memory (RSS, median of {memory['runs']} fresh processes each, "
            f"{memory['steps']} steps): plain {rss['plain']:.0f} MB, "
            f"fpaudit {rss['fpaudit']:.0f} MB: {memory['peak_ratio']:.3f}x"
        )
    scan = results.get("scan")
    if scan:
        print(
            f"scan end to end, {scan['steps']} steps: plain script "
            f"{scan['plain_script_seconds']:.1f} s, fpaudit scan {scan['scan_seconds']:.1f} s: "
            f"{scan['ratio']:.2f}x; report {scan['report_bytes'] / 1024:.0f} KB, "
            f"{scan['report_bytes_per_output_per_step']:.0f} bytes per captured op output per step"
        )
    compiled_steps = results.get("compiled")
    if compiled_steps:
        medians = compiled_steps["median_step_seconds"]
        first = compiled_steps["first_step_seconds"]
        print(
            f"compiled step (Inductor), transformer, median of {compiled_steps['reps']} "
            f"interleaved reps: compiled {medians['compiled'] * 1e3:.1f} ms, compiled + "
            f"fpaudit {medians['compiled + fpaudit'] * 1e3:.1f} ms: "
            f"{compiled_steps['ratio']:.2f}x; {compiled_steps['stored_buffers_per_step']} "
            f"stored buffers ({compiled_steps['stored_values_per_step'] / 1e6:.1f} M values) "
            f"per step; first step (compiling) {first['compiled']:.0f} s vs "
            f"{first['compiled + fpaudit']:.0f} s"
        )
    read = results.get("read")
    if read:
        print(
            f"report of {read['histogram_rows'] / 1e6:.1f} M histogram rows: fpaudit gate "
            f"{read['gate_seconds']:.2f} s, recommend {read['recommend_seconds']:.2f} s "
            "(whole command)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, few reps (smoke test)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["steps", "gpt2", "memory", "scan", "read", "compile", "recipes"],
        help="skip a section",
    )
    parser.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "latest.json"
    )
    parser.add_argument("--memory-child", choices=["plain", "fpaudit"], help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child, args.steps, args.quick)
        return 0

    reps = 1 if args.quick else args.reps
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "reps": reps,
        "date": time.strftime("%Y-%m-%d"),
        "steps": [],
    }
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        models = ["transformer"] + ([] if "gpt2" in args.skip or args.quick else ["gpt2-small"])
        if "steps" in args.skip:
            models = []
        for model_name in models:
            model_reps = reps if model_name == "transformer" else max(1, min(reps, 5))
            knobs = model_name == "transformer"
            results["steps"].append(
                measure_steps(
                    model_name, model_reps, 1, args.quick, tmp, knobs, "recipes" not in args.skip
                )
            )
        if "memory" not in args.skip:
            results["memory"] = measure_memory(args.steps, args.quick, 1 if args.quick else 5)
        if "scan" not in args.skip:
            results["scan"] = measure_scan(2 if args.quick else 8, 1 if args.quick else 3, tmp)
        if "read" not in args.skip:
            results["read"] = measure_read(
                100_000 if args.quick else 10_000_000, 1 if args.quick else 3, tmp
            )
        if "compile" not in args.skip:
            results["compiled"] = measure_compiled(reps, args.quick)
    print_table(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
