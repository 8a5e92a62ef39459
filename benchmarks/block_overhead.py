"""Block statistics' cost: interleaved full training steps of the reference transformer
(the one benchmarks/bench.py builds), plain, fpaudit, fpaudit with one MX recipe, with
nvfp4 alone and with every recipe; medians and ratios to plain. bench.py times the same
variants in its table.

    PYTHONPATH=. python benchmarks/block_overhead.py 3 [--quick]
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench
import torch

import fpaudit
from fpaudit.numerics.recipes import RECIPES

quick = "--quick" in sys.argv
reps = int(sys.argv[1])
model, ids, loss_fn = bench.build("transformer", quick)
audits = {
    "fpaudit": fpaudit.audit(model),
    "fpaudit --recipe mxfp8-e4m3": fpaudit.audit(model, recipes=["mxfp8-e4m3"]),
    "fpaudit --recipe nvfp4": fpaudit.audit(model, recipes=["nvfp4"]),
    f"fpaudit --recipe (all {len(RECIPES)})": fpaudit.audit(model, recipes=list(RECIPES)),
}


def plain():
    model.zero_grad(set_to_none=True)
    loss_fn(model, ids).backward()


def audited(a):
    def step():
        with a:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, ids)
            loss.backward()
            a.step(loss=loss)

    return step


variants = {"plain": plain, **{k: audited(a) for k, a in audits.items()}}
for f in variants.values():
    f()
times = {k: [] for k in variants}
order = list(variants.items())
for rep in range(reps):
    for name, f in order[rep % len(order) :] + order[: rep % len(order)]:
        t = time.perf_counter()
        f()
        times[name].append(time.perf_counter() - t)
    print(rep, {k: round(v[-1], 3) for k, v in times.items()}, flush=True)
med = {k: statistics.median(v) for k, v in times.items()}
out = {
    "quick": quick,
    "reps": reps,
    "threads": torch.get_num_threads(),
    "median_step_seconds": med,
    "ratio": {k: med[k] / med["plain"] for k in med},
}
print(json.dumps(out, indent=1))
