"""Check fpaudit on a real GPU: exactness on the device, no host sync per op, overhead.

    python benchmarks/gpu_check.py                 # on a CUDA machine, a few minutes at most
    python benchmarks/gpu_check.py --device cpu    # smoke test (the test suite runs it)

What it checks, on the sample transformer:

1. exactness: the device histogram paths (the Triton kernel, when Triton is installed,
   and the pure-torch path) equal the CPU reference on a tensor of edge values and
   random bit patterns (ties, subnormals, signed zeros, inf, NaN), in fp32 and fp16;
   and their cost per value on 64 M values against one read (``sum``);
2. no host sync while capturing: forward and backward run under
   ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising
   call; only the step close (one transfer) runs outside it;
3. attribution works on the autograd device threads (records per module);
4. overhead: plain and audited steps interleaved, medians, ratio (also with
   ``FPAUDIT_KERNEL=torch``, the pure-torch histogram path);
5. live mode on the device: a step under ``torch.autocast`` in fp16 with the fp32
   shadow, also free of host syncs, and the values the shadow found lost;
6. ``fpaudit verify`` on the device at scale 1 and at the recommended scale;
7. block statistics (``--recipe``): every recipe's statistics vector on the device (on
   CUDA the Triton block kernel for the MX and pow2-floor recipes, the pure-torch path
   for nvfp4 and per-tensor ones) equals the CPU path's (the C++ kernel where built) on
   edge values, random bit patterns, fp16/bf16, a transposed view and partial blocks,
   under ``set_sync_debug_mode("error")``; and each covered recipe's cost per value
   (kernel and pure-torch path) against the histogram kernel's;
8. ``fpaudit run`` on ``sample_configs/train_loop.py --bugs`` on the device: the three
   findings, and no host sync beyond the script's own (GradScaler's ``.item()``, its
   ``get_scale()``, its prints) and fpaudit's one read at the end, counted with
   ``torch.cuda.set_sync_debug_mode("warn")`` against the plain script.
9. closing a step of the deep narrow MLP of ``benchmarks/host_overhead.py`` (200 x
   (``Linear(16,16)``, ``Tanh``), 400 parameters): the host time of ``audit.step()``
   (median, µs per parameter) and the Triton histogram launches it makes, with the
   parameters' gradients in one multi-tensor launch per dtype (``add_many``) and, for
   comparison, one launch each (the path before it), interleaved; and that the
   launches do not grow with the parameters (at most one per dtype).
10. bound launches: the Triton histogram kernel launched through the compiled kernel the
    JIT returned for the arguments' class (``_triton_kernel.BoundKernel``) counts what
    the JIT's own launch counts, and the CPU reference, for each dtype, aligned and
    unaligned tensors of sizes from 1 to a million and more, without a host sync; and
    the host time per launch of ``benchmarks/launch_overhead.py`` on the device (the
    JIT's launch, bound, binding off, ``HistogramTable.add``).

Prints a summary; ``--json FILE`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fpaudit
from fpaudit.kernels import build as kernels
from fpaudit.kernels import histogram

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def no_host_sync(device: torch.device):
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def kernel_mode(value: str):
    previous = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[kernels.ENV]
        else:
            os.environ[kernels.ENV] = previous


def check_exactness(device: torch.device) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randint(
        -(2**31), 2**31 - 1, (1_000_000,), generator=generator, dtype=torch.int64
    )
    x = patterns.to(torch.int32).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.0**-149,
                          2.0**-25, 65520.0, 464.0, 2.0**-134, 1.0])  # fmt: skip
    x = torch.cat([x, edges, torch.randn(1_000_000, generator=generator) * 1e-4])
    reference = torch.bincount(histogram.bin_indices(x), minlength=histogram.N_BINS).numpy()
    half = torch.bincount(histogram.bin_indices(x.half().float()), minlength=histogram.N_BINS)
    expected = reference + half.numpy()
    finite = x[torch.isfinite(x)].abs()
    result: dict[str, Any] = {
        "kernel": "triton" if device.type == "cuda" and kernels.device_kernel() else "torch"
    }
    for path in ("auto", "torch"):
        with kernel_mode(path):
            on_device = histogram.Histogram(device)
            with no_host_sync(device):
                on_device.add(x.to(device))
                on_device.add(x.to(device).half())
            host = on_device.host()
        suffix = "" if path == "auto" else "_torch_path"
        result["exact" + suffix] = bool(np.array_equal(host.counts, expected))
        result["amax_exact" + suffix] = host.amax == float(finite.max())
    result["kernel_failure"] = kernels.device_failure()
    return result


def _median_seconds(device: torch.device, run: Any, reps: int) -> float:
    """Median wall time of ``run()`` over ``reps`` runs after one warm-up (compiles)."""
    times = []
    for rep in range(reps + 1):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_edge_values() -> torch.Tensor:
    """Signed zeros, inf, NaN, fp32 subnormals, and each element format's thresholds
    (scaled by a few powers of two, so they land in blocks of every scale) with their
    fp32 neighbours."""
    from fpaudit.numerics.recipes import E2M1, E4M3, E5M2

    values = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.0**-149, 2.0**-127]
    for element in (E2M1, E4M3, E5M2):
        edges = (element.round_to_zero_edge, element.smallest_subnormal,
                 element.smallest_normal, element.max_finite, element.overflow_edge)  # fmt: skip
        for edge in edges:
            for shift in (-100, -3, 0, 5, 60):
                values.append(float(edge) * 2.0**shift)
    x = torch.tensor(values, dtype=torch.float32)
    finite = x[torch.isfinite(x) & (x != 0)]
    x = torch.cat([x, torch.nextafter(finite, torch.zeros_like(finite)),
                   torch.nextafter(finite, torch.full_like(finite, float("inf")))])  # fmt: skip
    return torch.cat([x, -x])


def check_block_stats(device: torch.device, n: int, reps: int) -> dict[str, Any]:
    """Block statistics on ``device`` against the CPU path, every recipe; ns per value.

    On CUDA the recipes the Triton block kernel covers take it (the rest the torch
    general path); each is compared exactly with the CPU path (the C++ kernel where it
    builds) on edge values, random bit patterns, wide binades, fp16/bf16 inputs, a
    transposed view and partial blocks, under ``set_sync_debug_mode("error")``. Then each
    covered recipe is timed (median of ``reps``) through the kernel and through the
    pure-torch path, against the histogram kernel on the same values."""
    from fpaudit.kernels import _triton_blocks, blockstats
    from fpaudit.numerics.recipes import RECIPES, get_recipe

    generator = torch.Generator().manual_seed(1)
    patterns = torch.randint(-(2**31), 2**31 - 1, (64, 512), generator=generator)
    x = torch.cat([patterns.to(torch.int32).view(torch.float32),
                   torch.randn(64, 512, generator=generator) * 1e-4,
                   torch.exp2(torch.randn(64, 512, generator=generator) * 30)])  # fmt: skip
    edges = block_edge_values()
    edges = torch.cat([edges, torch.zeros(-edges.numel() % 48)]).reshape(-1, 48)
    tensors = {
        "mixed": x,
        "edges (partial blocks)": edges,
        "float16": (torch.randn(96, 256, generator=generator) * 1e-3).half(),
        "bfloat16": (torch.randn(96, 256, generator=generator) * 1e-30).bfloat16(),
        "transposed, partial": x[:, :300].t(),
    }
    names = [*RECIPES, *(f"{name}:col" for name, r in RECIPES.items() if not r.per_tensor)]
    block_kernel = device.type == "cuda" and kernels.device_block_kernel() is not None
    mismatched = []
    for name in names:
        recipe = get_recipe(name)
        for label, tensor in tensors.items():
            # on CUDA against the CPU path (the compiled kernel); on the CPU (the smoke
            # test) the kernel is the device path, so against the pure-torch path
            expected = blockstats.block_stats(tensor, recipe, compiled=device.type != "cpu")
            with no_host_sync(device):
                got = blockstats.block_stats(tensor.to(device), recipe)
            if not torch.equal(got.cpu(), expected):
                mismatched.append(f"{name} on {label}")
    values = torch.randn(n, device=device) * 1e-3
    table = histogram.HistogramTable(device)
    row = table.new_row()
    histogram_ns = _median_seconds(device, lambda: table._add_device(row, values), reps) / n * 1e9
    timings: dict[str, dict[str, float]] = {}
    for name, recipe in RECIPES.items():
        if not _triton_blocks.covers(recipe):
            continue
        kernel_ns = _median_seconds(
            device, lambda r=recipe: blockstats.block_stats(values, r), reps
        ) / n * 1e9  # fmt: skip
        with kernel_mode("torch"):
            torch_ns = _median_seconds(
                device, lambda r=recipe: blockstats.block_stats(values, r), reps
            ) / n * 1e9  # fmt: skip
        timings[name] = {
            "ns_per_value": kernel_ns,
            "torch_path_ns_per_value": torch_ns,
            "ratio_to_histogram_kernel": kernel_ns / histogram_ns,
        }
    return {
        "block_kernel": "triton" if block_kernel else ("cpp" if device.type == "cpu" else "torch"),
        "block_kernel_failure": kernels.device_block_failure(),
        "block_stats_exact": not mismatched,
        "block_stats_mismatched": mismatched,
        "block_stats_histogram_ns_per_value": histogram_ns,
        "block_stats_timings": timings,
    }


def print_block_summary(summary: dict[str, Any]) -> None:
    """One PASS/FAIL line for the block statistics, then a line per timed recipe."""
    verdict = "PASS" if summary["block_stats_exact"] else "FAIL"
    print(
        f"block stats: {verdict} ({summary['block_kernel']} path on {summary['device']} "
        f"equals the CPU path on every recipe)"
        + "".join(f"\n  mismatch: {m}" for m in summary["block_stats_mismatched"])
    )
    print(
        f"  histogram (device path): {summary['block_stats_histogram_ns_per_value']:.3f} ns/value"
    )
    for name, t in summary["block_stats_timings"].items():
        print(
            f"  {name:<20} {t['ns_per_value']:.3f} ns/value "
            f"({t['ratio_to_histogram_kernel']:.2f}x the histogram; "
            f"torch path {t['torch_path_ns_per_value']:.3f})"
        )


def print_step_close_summary(summary: dict[str, Any]) -> None:
    """Closing a step of the deep narrow MLP: µs per parameter and launches, each path."""
    per = summary["step_close_us_per_parameter"]
    launches = summary["step_close_launches"]
    print(
        f"step close ({summary['step_close_parameters']} parameters, audit.step() host time): "
        f"add_many {per['add_many']:.2f} us/parameter, {launches['add_many']} launches; "
        f"one add each {per['one add each']:.2f} us/parameter, {launches['one add each']} "
        f"launches ({summary['step_close_speedup']:.2f}x)"
    )


def time_kernels(device: torch.device, n: int, reps: int) -> dict[str, float]:
    """Nanoseconds per value: the histogram paths and one read, medians, interleaved."""
    x = torch.randn(n, device=device) * 1e-3
    table = histogram.HistogramTable(device)
    row = table.new_row()
    variants: dict[str, Any] = {"read (sum)": lambda: x.sum()}
    if device.type == "cuda" and kernels.device_kernel() is not None:
        variants["triton"] = lambda: table._add_device(row, x)
    variants["torch path"] = lambda: table._add_device_torch(row, x)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps + 1):
        for name, run in variants.items():
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            if rep:  # the first round compiles and warms up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) / n * 1e9 for name, t in times.items()}


def count_syncs(device: torch.device, run: Any) -> int:
    """Synchronising CUDA calls made by ``run()`` (0 off CUDA)."""
    if device.type != "cuda":
        run()
        return 0
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return sum("synchroniz" in str(w.message) for w in caught)


@contextmanager
def counted_launches():
    """Count the Triton histogram kernels' launches (both kernels, bound or not) inside
    the block: yields a dict whose "launches" is set to their number at its end (0 where
    there is no kernel)."""
    counter = {"launches": 0}
    module = kernels.device_kernel()
    if module is None:
        yield counter
        return
    before = module.ONE.launches + module.MANY.launches
    try:
        yield counter
    finally:
        counter["launches"] = module.ONE.launches + module.MANY.launches - before


def check_bound_launches(device: torch.device, quick: bool) -> dict[str, Any]:
    """Bound launches (``_triton_kernel.BoundKernel``) against the JIT's own: each dtype,
    aligned and unaligned tensors of sizes 1 to a million and more, added three times by
    ``add_flat`` (the first the JIT's, the next two bound) and three times by the JIT,
    to rows of two tables that must come out equal, and equal to three times the CPU
    reference; without a host sync. Then the host time per launch of
    ``benchmarks/launch_overhead.py`` (JIT, bound, binding off, ``HistogramTable.add``)."""
    if device.type != "cuda":  # nothing launched off CUDA: nothing to check
        return {"bound_launches_exact": True, "bound_launches_ok": True, "launch_us": {}}
    module = kernels.device_kernel()
    if module is None or not module.BINDS:  # on CUDA a check that launched nothing fails
        why = kernels.device_failure() if module is None else f"Triton {module.triton.__version__}"
        return {"bound_launches_exact": False, "bound_launches_ok": False, "launch_us": {},
                "bound_launches_not_run": why}  # fmt: skip
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from launch_overhead import jit_launch, measure

    generator = torch.Generator().manual_seed(1)
    base = torch.randn(1 << 20 | 77, generator=generator) * 1e-3
    base[::97] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 2.0**-149, 65520.0])[
        torch.arange(base[::97].numel()) % 6
    ]
    slices = [(0, 1), (0, 1000), (3, 1000), (0, 5000), (1, 4097), (0, base.numel())]
    cases = [base[a : a + n].to(dtype) for dtype in module.NATIVE for a, n in slices]
    bound_table = torch.zeros((len(cases), histogram.WIDTH), dtype=torch.int64, device=device)
    jit_table = torch.zeros_like(bound_table)
    bound_before = module.ONE.bound
    on_device = [x.to(device) for x in cases]
    with no_host_sync(device):
        for row, x in enumerate(on_device):
            for _ in range(3):
                module.add_flat(x, bound_table, row)
                jit_launch(module, x, jit_table, row)
    bound_rows = bound_table.cpu().numpy()
    exact = bool(np.array_equal(bound_rows, jit_table.cpu().numpy()))
    for row, x in enumerate(cases):
        wide = x.float()
        counts = torch.bincount(histogram.bin_indices(wide), minlength=histogram.N_BINS)
        counted = bound_rows[row, : histogram.N_BINS]
        exact = exact and bool(np.array_equal(counted, 3 * counts.numpy()))
        amax = int(histogram.finite_amax_bits(histogram._abs_bits(wide)))
        exact = exact and int(bound_rows[row, histogram.AMAX_COLUMN]) == amax
    return {
        "bound_launches_exact": exact,
        "bound_launches": module.ONE.bound - bound_before,
        "bound_launches_ok": module.ONE.bound - bound_before >= 2 * len(cases),  # 2 a case
        "launch_us": measure(module, device, 3 if quick else 7, 50 if quick else 500),
    }


def check_step_close(device: torch.device, reps: int, quick: bool) -> dict[str, Any]:
    """Host time of ``audit.step()`` on the deep narrow MLP, and its histogram launches:
    the gradients through ``add_many`` (one launch per dtype) and one ``add`` each."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from host_overhead import deep_mlp

    model, batch, loss_fn = deep_mlp(quick)
    model, batch = model.to(device), batch.to(device)
    parameters = sum(1 for _ in model.parameters())
    one_each = histogram.HistogramTable.add_many

    def add_each(table: Any, rows: list[int], tensors: list[torch.Tensor]) -> None:
        for row, x in zip(rows, tensors, strict=True):
            table.add(row, x)

    def close(audit: fpaudit.Audit, batched: bool) -> tuple[float, int]:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        synchronize(device)
        if not batched:
            histogram.HistogramTable.add_many = add_each  # type: ignore[method-assign]
        try:
            with counted_launches() as counter:
                start = time.perf_counter()
                audit.step(loss=loss)  # its one transfer waits for its own kernels
                seconds = time.perf_counter() - start
        finally:
            histogram.HistogramTable.add_many = one_each  # type: ignore[method-assign]
        return seconds, counter["launches"]

    variants = {"add_many": True, "one add each": False}
    times: dict[str, list[float]] = {name: [] for name in variants}
    launches: dict[str, int] = {}
    audit = fpaudit.audit(model)
    with audit:
        for rep in range(reps + 1):
            for name, batched in variants.items():
                seconds, launches[name] = close(audit, batched)
                if rep:  # the first round compiles and warms up
                    times[name].append(seconds)
        audit.close(discard=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "step_close_parameters": parameters,
        "step_close_us_per_parameter": {n: 1e6 * t / parameters for n, t in medians.items()},
        "step_close_launches": launches,
        "step_close_speedup": medians["one add each"] / medians["add_many"],
        # at most one per dtype the kernel reads (fp32, fp16, bf16), whatever the parameters
        "step_close_fixed_launches": launches["add_many"] <= 3,
    }


def check_run(device: torch.device, steps: int) -> dict[str, Any]:
    from fpaudit.run.training import RunOptions, run_script

    script = ROOT / "sample_configs" / "train_loop.py"
    args = ["--steps", str(steps), "--device", str(device), "--bugs"]

    def plain() -> None:
        saved = sys.argv
        sys.argv = [str(script), *args]
        try:
            runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.argv = saved

    outcome: list[Any] = []
    plain_syncs = count_syncs(device, plain)
    fpaudit_syncs = count_syncs(
        device, lambda: outcome.append(run_script(script, args, RunOptions(capture_every=0)))
    )
    captured = run_script(script, args, RunOptions(capture_every=5)).report
    steps_table = outcome[0].report.steps
    return {
        "run_findings": sorted(f.code for f in outcome[0].findings),
        "run_skipped_steps": [int(s) for s in steps_table.loc[steps_table["skipped"], "step"]],
        "run_syncs_plain_script": plain_syncs,
        "run_syncs_under_fpaudit": fpaudit_syncs,  # + 1: the one read at the end
        "run_no_extra_sync": fpaudit_syncs <= plain_syncs + 1,
        "run_captured_live_dtype": captured.meta.get("amp_dtype"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 rep (smoke test)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2

    summary: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        summary["device_name"] = torch.cuda.get_device_name(device)
    summary.update(check_exactness(device))
    summary.update(check_block_stats(device, 1 << 16 if args.quick else 1 << 25,
                                     1 if args.quick else 5))  # fmt: skip

    sample = runpy.run_path(str(ROOT / "sample_configs" / "transformer.py"))
    torch.manual_seed(0)
    sizes = {"d_model": 64, "heads": 4, "layers": 2, "vocab": 256, "seq": 32} if args.quick else {}
    model = sample["TransformerLM"](**sizes).to(device)
    batch_size = 4 if args.quick else sample["BATCH"]
    ids = next(sample["token_batches"](1, batch=batch_size, seq=sizes.get("seq", sample["SEQ"]),
                                       vocab=sizes.get("vocab", sample["VOCAB"])))  # fmt: skip
    ids = ids.to(device)
    loss_fn = sample["loss"]

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model, ids).backward()
        synchronize(device)

    audit = fpaudit.audit(model)
    sync_error = None

    def audited() -> None:
        nonlocal sync_error
        with audit:
            model.zero_grad(set_to_none=True)
            try:
                with no_host_sync(device):
                    loss = loss_fn(model, ids)
                    loss.backward()
            except RuntimeError as error:  # a synchronising call inside capture
                sync_error = str(error).splitlines()[0]
                raise
            audit.step(loss=loss)  # the one sync per step
        synchronize(device)

    reps = 1 if args.quick else args.reps
    for _ in range(1 if args.quick else 3):
        plain()
        audited()

    def audited_torch_path() -> None:
        with kernel_mode("torch"):
            audited()

    times: dict[str, list[float]] = {"plain": [], "fpaudit": [], "fpaudit_torch_path": []}
    variants = (("plain", plain), ("fpaudit", audited), ("fpaudit_torch_path", audited_torch_path))
    for _ in range(reps):
        for name, step in variants:
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)

    report = audit.report
    records = report.records
    medians = {k: statistics.median(v) for k, v in times.items()}
    recommended = fpaudit.recommend(report, "fp16").log2_scale or 0

    # live fp16 with the shadow, at scale 1 and at the recommended scale
    amp = "cuda" if device.type == "cuda" else "cpu"
    live: dict[str, Any] = {}
    for log2_scale in (0, recommended):
        shadowed = fpaudit.audit(model, shadow=True, loss_scale=2.0**log2_scale)
        with shadowed:
            model.zero_grad(set_to_none=True)
            try:
                with no_host_sync(device), torch.autocast(amp, dtype=torch.float16):
                    loss = loss_fn(model, ids)
                with no_host_sync(device):
                    torch.autograd.backward(
                        loss, grad_tensors=torch.full_like(loss, 2.0**log2_scale)
                    )
            except RuntimeError as error:
                sync_error = str(error).splitlines()[0]
                raise
            shadowed.step(loss=loss)
        rows = shadowed.report.records
        low = rows[rows["dtype"] == "float16"]
        live[f"2^{log2_scale}"] = {
            "float16_records": len(low),
            "lost": int(low["lost"].sum()),
            "lost_fraction": float(low["lost"].sum() / max(1, low["shadow_nonzero"].sum())),
        }
    synchronize(device)

    from fpaudit.run.verify import verify

    sample_file = ROOT / "sample_configs" / "transformer.py"
    verified = {}
    if not args.quick:
        for log2_scale in (0, recommended):
            result = verify(sample_file, log2_scale=log2_scale, amp="fp16", device=str(device))
            verified[f"2^{log2_scale}"] = {
                "passed": result.passed,
                "skipped": result.skipped,
                "stalled": len(result.stalled),
                "max_zeroed_fraction": max(p.zeroed_fraction for p in result.parameters),
            }
    summary.update(check_run(device, 20 if args.quick else 200))
    summary.update(check_step_close(device, 1 if args.quick else args.reps, args.quick))
    summary.update(check_bound_launches(device, args.quick))
    summary.update(
        {
            "no_host_sync_during_capture": sync_error is None,
            "modules_attributed": sorted(set(records["module"]) - {fpaudit.LOSS_MODULE})[:6],
            "backward_records_per_step": int(
                (records[records["step"] == 0]["kind"] == "backward").sum()
            ),
            "median_step_seconds": medians,
            "ratio": medians["fpaudit"] / medians["plain"],
            "ratio_torch_path": medians["fpaudit_torch_path"] / medians["plain"],
            "kernel_ns_per_value": time_kernels(
                device, 1 << 16 if args.quick else 1 << 26, 1 if args.quick else 10
            ),
            "recommended_fp16_log2_scale": recommended,
            "live_fp16_shadow": live,
            "verify_fp16": verified,
        }
    )
    summary["no_host_sync_during_capture"] = sync_error is None
    ok = summary["exact"] and summary["amax_exact"] and summary["no_host_sync_during_capture"]
    ok = ok and summary["exact_torch_path"] and summary["amax_exact_torch_path"]
    ok = ok and summary["block_stats_exact"]
    ok = ok and summary["backward_records_per_step"] > 0
    ok = ok and all(v["float16_records"] > 0 for v in live.values())
    ok = ok and summary["run_no_extra_sync"] and len(summary["run_findings"]) == 3
    ok = ok and summary["step_close_fixed_launches"]
    ok = ok and summary["bound_launches_exact"]
    ok = ok and summary["bound_launches_ok"]
    summary["ok"] = bool(ok)
    print(json.dumps(summary, indent=2))
    print_block_summary(summary)
    print_step_close_summary(summary)
    for name, us in summary["launch_us"].items():
        print(f"launch host time: {name} {us:.2f} us")
    print(f"gpu_check: {'PASS' if ok else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
