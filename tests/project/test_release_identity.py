"""Every supported torch release gives the same report numbers on a fixed set of models.

The reference is measured on the machine that runs the test, by the default release
(torch 2.13.0): float reductions (matmul, sum) are ordered by the CPU's vector width,
so a file of numbers made on one machine does not hold on another (an AVX-512 machine
and an AVX2 one differ in the last bits of amax and move values across binade edges),
while two releases on one machine must agree exactly. ``make test-release RELEASE=X``
first writes the reference with the default venv:

    .venv/bin/python tests/project/test_release_identity.py --write REFERENCE.json

and then runs this test on release X with ``FPAUDIT_IDENTITY_REFERENCE=REFERENCE.json``:
a record that is missing, new or different there is named (model, kind, module, node,
op), so a release that computes an op differently says which op. On the default release
without a reference, the test checks the precondition instead: two measurements in one
process are identical, record for record.

The models: the sample MLP, convnet and transformer (one step each), a Hugging Face
GPT-2 built from its config, a checkpointed transformer (recomputation in backward),
and a live fp16 autocast scan of the MLP (``--amp fp16``: the autocast casts and the
fp16 values themselves).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fpaudit.report.store import Report
from fpaudit.run.scan import ScanOptions, scan

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RELEASE = "2.13.0"
REFERENCE_ENV = "FPAUDIT_IDENTITY_REFERENCE"
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


def _reference_path() -> Path | None:
    value = os.environ.get(REFERENCE_ENV)
    return Path(value) if value else None


@pytest.fixture(scope="module")
def reference() -> dict[str, Any] | None:
    path = _reference_path()
    if path is None:
        if _release() != DEFAULT_RELEASE:
            pytest.fail(
                f"torch {torch.__version__} is compared with the default release measured "
                f"on this machine: set {REFERENCE_ENV} to the file that "
                f"'python {Path(__file__).relative_to(ROOT)} --write FILE' wrote on torch "
                f"{DEFAULT_RELEASE} (make test-release does both)"
            )
        return None
    data = dict(json.loads(path.read_text()))
    assert data["torch"] == DEFAULT_RELEASE, f"{path} was written on torch {data['torch']}"
    assert set(data["models"]) == set(MODELS), f"{path} covers other models than MODELS"
    assert all(len(records) > 0 for records in data["models"].values())
    return data


@pytest.mark.parametrize("name", list(MODELS))
def test_report_numbers_equal_the_default_release(
    name: str, reference: dict[str, Any] | None
) -> None:
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
    got = measure(name)
    assert got, f"{name}: the scan recorded nothing, so it proves nothing"
    if reference is None:  # the default release: the precondition, determinism
        want, against = measure(name), f"a second measurement on torch {torch.__version__}"
    else:
        want, against = reference["models"][name], f"torch {reference['torch']}"
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
        f"torch {torch.__version__} differs from {against} on {name}"
    )


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit("usage: python tests/project/test_release_identity.py --write FILE")
    if _release() != DEFAULT_RELEASE:
        sys.exit(f"write the reference on torch {DEFAULT_RELEASE}, not {torch.__version__}")
    out = Path(sys.argv[2])
    data = {"torch": _release(), "models": {name: measure(name) for name in MODELS}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {sum(len(v) for v in data['models'].values())} records")
