"""Every supported torch release gives the same report numbers on a fixed set of models.

``tests/data/release_identity.json`` holds, for each model below, every record's
counts (elements, zeros, infs, NaNs, amax as a hex float) and a digest of its exact
histogram, made on the default release (torch 2.13.0, CPU). ``make test-release
RELEASE=X`` runs this test on release X: a record that is missing, new or different
there is named (model, kind, module, node, op), so a release that computes an op
differently says which op. Regenerate the file on the default release only, after a
change that is meant to move the numbers:

    .venv/bin/python tests/project/test_release_identity.py --write

The models: the sample MLP, convnet and transformer (one step each), a Hugging Face
GPT-2 built from its config, a checkpointed transformer (recomputation in backward),
and a live fp16 autocast scan of the MLP (``--amp fp16``: the autocast casts and the
fp16 values themselves).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fpaudit.report.store import Report
from fpaudit.run.scan import ScanOptions, scan

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "release_identity.json"
KEY = ("kind", "module", "node", "op", "output", "dtype")

# name: (model file, options)
MODELS: dict[str, tuple[str, ScanOptions]] = {
    "mlp": ("sample_configs/mlp.py", ScanOptions(steps=1)),
    "convnet": ("sample_configs/convnet.py", ScanOptions(steps=1)),
    "transformer": ("sample_configs/transformer.py", ScanOptions(steps=1)),
    "hf_gpt2": ("sample_configs/hf_gpt2.py", ScanOptions(steps=1)),
    "checkpointed": ("tests/models/checkpointed.py", ScanOptions(steps=2)),
    "mlp_amp_fp16": ("sample_configs/mlp.py", ScanOptions(steps=1, amp="fp16")),
}

# Where a release computes an op differently from the default one, by release and
# model: the records (kind, module, node, op) whose numbers may differ there. Empty:
# no supported release computes any of these models' backward differently.
KNOWN_DIFFERENCES: dict[str, dict[str, set[tuple[str, str, str, str]]]] = {}


def digest(report: Report) -> dict[str, dict[str, Any]]:
    """Each record's numbers, keyed by what it is (not by its id, which is an order)."""
    records = report.records
    bins = report.bins.sort_values(["record_id", "binade", "cls"])
    by_record = {
        int(rid): hashlib.sha256(
            group[["binade", "cls", "count"]].to_numpy().tobytes()
        ).hexdigest()[:16]
        for rid, group in bins.groupby("record_id")
    }
    out: dict[str, dict[str, Any]] = {}
    for row in records.itertuples(index=False):
        key = " | ".join(str(getattr(row, k)) for k in KEY) + f" | step {row.step}"
        entry = {
            "elements": int(row.elements),
            "zeros": int(row.zeros),
            "infs": int(row.infs),
            "nans": int(row.nans),
            "amax": float(row.amax).hex(),
            "bins": by_record.get(int(row.record_id), ""),
        }
        if key in out:  # one key twice in a step: keep both, in record order
            key += f" #{sum(k.startswith(key) for k in out)}"
        out[key] = entry
    return out


def measure(name: str) -> dict[str, dict[str, Any]]:
    path, options = MODELS[name]
    return digest(scan(ROOT / path, options))


def _release() -> str:
    return torch.__version__.split("+")[0]


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return dict(json.loads(GOLDEN.read_text()))


def test_golden_file_covers_every_model(golden: dict[str, Any]) -> None:
    assert set(golden["models"]) == set(MODELS)
    assert golden["torch"] == "2.13.0"
    assert all(len(records) > 0 for records in golden["models"].values())


@pytest.mark.parametrize("name", list(MODELS))
def test_report_numbers_equal_the_default_release(name: str, golden: dict[str, Any]) -> None:
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
    want: dict[str, Any] = golden["models"][name]
    got = measure(name)
    excused = KNOWN_DIFFERENCES.get(_release(), {}).get(name, set())

    def excusable(key: str) -> bool:
        kind, module, node, op = key.split(" | ")[:4]
        return (kind, module, node, op) in excused

    missing = sorted(k for k in want.keys() - got.keys() if not excusable(k))
    new = sorted(k for k in got.keys() - want.keys() if not excusable(k))
    changed = sorted(
        f"{k}: {want[k]} -> {got[k]}"
        for k in want.keys() & got.keys()
        if want[k] != got[k] and not excusable(k)
    )
    assert (missing, new, changed) == ([], [], []), (
        f"torch {torch.__version__} differs from torch {golden['torch']} on {name}"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/project/test_release_identity.py --write")
    if _release() != "2.13.0":
        sys.exit(f"write the golden file on torch 2.13.0, not {torch.__version__}")
    data = {"torch": _release(), "models": {name: measure(name) for name in MODELS}}
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}: {sum(len(v) for v in data['models'].values())} records")
