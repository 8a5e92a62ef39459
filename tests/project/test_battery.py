"""The bad-input battery: every command against broken files, model code, flags and reports.

One case per row. Each runs the real CLI entry point and checks the exit code,
that a failure is exactly one ``fpaudit: error:`` line with no traceback, the
words the user sees, and that a failed scan leaves no report behind.
``test_reliability_doc_is_current`` renders the outcomes ``test_bad_input``
observed as the table in docs/reliability.md (``FPAUDIT_UPDATE_DOCS=1`` rewrites
it); each case runs once per session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from fpaudit.cli.commands import run
from fpaudit.report.files import output_lock

from ..conftest import ROOT, SAMPLES
from ..reports import report_from

DOC = ROOT / "docs" / "reliability.md"

GOOD = """import torch
model = torch.nn.Linear(2, 1)
batches = [torch.ones(3, 2)]
def loss(model, batch):
    return model(batch).sum()
"""


def model(source: str, name: str = "model.py") -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).write_text(source)

    return setup


def raw_model(data: bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "model.py").write_bytes(data)

    return setup


# what fpaudit run writes for clip_grad_norm_ before unscale_ (an error-level finding)
CLIP_ERROR = {"code": "clip-before-unscale", "severity": "error", "file": "train.py", "line": 12,
              "message": "clipped gradients still multiplied by the loss scale", "steps": [0],
              "count": 1}  # fmt: skip


def report(damage: Callable[[Path], None] | None = None, **meta: object) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        built = report_from({"a": torch.tensor([2.0**-30, 1.0]), "b": torch.tensor([1e-3, 0.0])})
        built.write(tmp / "report")
        _set_meta(tmp / "report", meta)
        if damage is not None:
            damage(tmp / "report")

    return setup


def ranked_report(damage: Callable[[Path], None]) -> Callable[[Path], None]:
    """A report of two ranks (parts written as torch.distributed ranks would), then damaged."""

    def setup(tmp: Path) -> None:
        root = tmp / "report"
        root.mkdir()
        built = report_from({"a": torch.tensor([2.0**-30, 1.0])})
        files = {}
        for rank in (0, 1):
            files.update(built.write_tables(root, f"rank-{rank:05d}/"))
        built.write_meta(root, files, dataclasses.replace(built.info, ranks=2))
        damage(root)

    return setup


def _set_meta(root: Path, entries: dict[str, object]) -> None:
    """meta.json's ``entries`` set as given, well-formed or not (the typed report cannot
    hold a malformed one: the reader's checks are what these cases test)."""
    if entries:
        edit_meta(lambda meta: meta.update(entries))(root)


def edit_meta(change: Callable[[dict[str, object]], None]) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        meta = json.loads((root / "meta.json").read_text())
        change(meta)
        (root / "meta.json").write_text(json.dumps(meta))

    return damage


def truncate(name: str) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        data = (root / name).read_bytes()
        (root / name).write_bytes(data[: len(data) // 2])

    return damage


def edit_records(column: str, change: Callable[[list], None]) -> Callable[[Path], None]:
    """Change one column of records.parquet in place, with a checksum to match."""

    def damage(root: Path) -> None:
        import hashlib

        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(root / "records.parquet")
        values = table.column(column).to_pylist()
        change(values)
        index = table.schema.get_field_index(column)
        field = table.schema.field(index)
        pq.write_table(
            table.set_column(index, field, pa.array(values, field.type)),
            root / "records.parquet",
        )
        meta = json.loads((root / "meta.json").read_text())
        meta["files"]["records.parquet"]["sha256"] = hashlib.sha256(
            (root / "records.parquet").read_bytes()
        ).hexdigest()
        (root / "meta.json").write_text(json.dumps(meta))

    return damage


def _first(value: object) -> Callable[[list], None]:
    def change(values: list) -> None:
        values[0] = value(values[0]) if callable(value) else value

    return change


def values_report(tensors: dict[str, list[float]], **meta: object) -> Callable[[Path], None]:
    """A report whose backward records hold exactly these values (one record per module)."""

    def setup(tmp: Path) -> None:
        built = report_from({name: torch.tensor(values) for name, values in tensors.items()})
        built.write(tmp / "report")
        _set_meta(tmp / "report", meta)

    return setup


def both(*damages: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        for one in damages:
            one(root)

    return damage


def nest_in_meta(levels: int) -> Callable[[Path], None]:
    """Add a key nested ``levels`` lists deep to meta.json, as text (no recursion here)."""

    def damage(root: Path) -> None:
        text = (root / "meta.json").read_text()
        (root / "meta.json").write_text(
            '{"deep": ' + "[" * levels + "]" * levels + ", " + text.lstrip()[1:]
        )

    return damage


def grow_meta(size: int) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        os.truncate(root / "meta.json", size)  # sparse: no disk used

    return damage


def pandas_metadata(root: Path) -> None:
    """Put a hostile ``pandas`` entry in records.parquet's schema metadata (checksum kept valid)."""
    import hashlib

    import pyarrow.parquet as pq

    table = pq.read_table(root / "records.parquet")
    hostile = b'{"index_columns": ["no_such_column"], "columns": [{"name": "kind", "pandas_type": "categorical", "numpy_type": "int99", "metadata": null}], "pandas_version": "99"}'
    pq.write_table(table.replace_schema_metadata({b"pandas": hostile}), root / "records.parquet")
    meta = json.loads((root / "meta.json").read_text())
    meta["files"]["records.parquet"]["sha256"] = hashlib.sha256(
        (root / "records.parquet").read_bytes()
    ).hexdigest()
    (root / "meta.json").write_text(json.dumps(meta))


def symlinked(name: str) -> Callable[[Path], None]:
    """Move ``name`` out of the report and leave a symbolic link to it in its place."""

    def damage(root: Path) -> None:
        outside = root.parent / f"outside-{name}"
        (root / name).rename(outside)
        (root / name).symlink_to(outside)

    return damage


TRAIN = """import torch
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    optimizer.zero_grad()
    model(torch.ones(3, 2)).sum().backward()
    optimizer.step()
"""

SCALER = {"class": "torch.amp.GradScaler", "init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
          "growth_interval": 2000}  # fmt: skip


def locked(tmp: Path) -> None:
    (tmp / "model.py").write_text(GOOD)


@dataclass
class Case:
    name: str
    args: list[str]
    code: int
    says: str  # words the user sees (on stderr for failures, else stdout)
    setup: Callable[[Path], None] = field(default=lambda tmp: None)
    hold_lock: bool = False
    env: dict[str, str] = field(default_factory=dict)  # set while it runs ({tmp} filled)


AWKWARD_OUTPUTS = """import torch
from torch import nn

class Awkward(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4, sparse=True)  # sparse gradient
        self.empty = nn.Parameter(torch.zeros(0))  # zero-size gradient
        self.rotate = nn.Parameter(torch.tensor(0.5))

    def forward(self, ids):
        h = self.embed(ids) + self.empty.sum()
        z = torch.polar(torch.ones_like(h), h * self.rotate)  # complex values in backward
        return z.real.sum() + h.argmax().float() * 0  # an integer op too

model = Awkward
batches = [torch.randint(0, 10, (3, 5))]
def loss(model, ids):
    return model(ids)
"""

CASES: list[Case] = [
    # -- the model file -------------------------------------------------------------
    Case("model file missing", ["scan", "{tmp}/nope.py"], 2, "does not exist"),
    Case("model file is a directory", ["scan", "{tmp}"], 2, "is not a file"),
    Case("model file is not text", ["scan", "{tmp}/model.py"], 2, "model.py", raw_model(b"\x00\xff\xfe binary")),
    Case("syntax error", ["scan", "{tmp}/model.py"], 2, "model.py:2: syntax error", model("import torch\ndef f(:\n")),
    Case("raises at import", ["scan", "{tmp}/model.py"], 2, "model.py:2: importing the model file raised ValueError: no data",
         model("import torch\nraise ValueError('no data')\n")),
    Case("sys.exit at import", ["scan", "{tmp}/model.py"], 2, "called sys.exit(3)", model("import sys\nsys.exit(3)\n")),
    Case("no `model`", ["scan", "{tmp}/model.py"], 2, "does not define `model`", model("batches = []\ndef loss(m, b): return b\n")),
    Case("no `batches`", ["scan", "{tmp}/model.py"], 2, "does not define `batches`",
         model("import torch\nmodel = torch.nn.Linear(2, 1)\ndef loss(m, b): return b\n")),
    Case("no `loss`", ["scan", "{tmp}/model.py"], 2, "does not define `loss`",
         model("import torch\nmodel = torch.nn.Linear(2, 1)\nbatches = [1]\n")),
    Case("`model` is not a module", ["scan", "{tmp}/model.py"], 2, "`model` is an int", model(GOOD.replace("torch.nn.Linear(2, 1)", "3"))),
    Case("`model()` raises", ["scan", "{tmp}/model.py"], 2, "model() raised RuntimeError: no GPU",
         model(GOOD.replace("model = torch.nn.Linear(2, 1)", "def model():\n    raise RuntimeError('no GPU')"))),
    Case("no trainable parameters", ["scan", "{tmp}/model.py"], 2, "no parameters that require grad",
         model(GOOD.replace("torch.nn.Linear(2, 1)", "torch.nn.Linear(2, 1).requires_grad_(False)"))),
    Case("empty batch iterable", ["scan", "{tmp}/model.py"], 2, "`batches` yielded no batches",
         model(GOOD.replace("[torch.ones(3, 2)]", "[]"))),
    Case("`batches` not iterable", ["scan", "{tmp}/model.py"], 2, "`batches` is an int", model(GOOD.replace("[torch.ones(3, 2)]", "7"))),
    Case("iterating `batches` raises", ["scan", "{tmp}/model.py"], 2, "iterating `batches` raised OSError: disk gone",
         model(GOOD.replace("batches = [torch.ones(3, 2)]", "def batches():\n    raise OSError('disk gone')\n    yield"))),
    Case("loss is not a scalar", ["scan", "{tmp}/model.py"], 2, "shape [3, 1]; expected a scalar",
         model(GOOD.replace("model(batch).sum()", "model(batch)"))),
    Case("loss is not a tensor", ["scan", "{tmp}/model.py"], 2, "returned a float", model(GOOD.replace("model(batch).sum()", "1.5"))),
    Case("loss is an integer tensor", ["scan", "{tmp}/model.py"], 2, "expected a floating-point one",
         model(GOOD.replace("model(batch).sum()", "torch.tensor(3)"))),
    Case("loss does not require grad", ["scan", "{tmp}/model.py"], 2, "the loss does not require grad",
         model(GOOD.replace("model(batch).sum()", "model(batch).sum().detach()"))),
    Case("loss raises", ["scan", "{tmp}/model.py"], 2, "model.py:5: loss(model, batch) raised KeyError: 'label'",
         model(GOOD.replace("return model(batch).sum()", "raise KeyError('label')"))),
    Case("backward raises", ["scan", "{tmp}/model.py"], 2, "backward raised ArithmeticError: bad grad",
         model(GOOD.replace("def loss(model, batch):", "class Bad(torch.autograd.Function):\n    @staticmethod\n"
               "    def forward(ctx, x): return x * 1\n    @staticmethod\n    def backward(ctx, g): raise ArithmeticError('bad grad')\n"
               "def loss(model, batch):").replace("model(batch).sum()", "Bad.apply(model(batch)).sum()"))),
    Case("`optimizer` not callable", ["scan", "{tmp}/model.py"], 2, "`optimizer` is an int", model(GOOD + "optimizer = 3\n")),
    Case("`optimizer()` returns no optimizer", ["scan", "{tmp}/model.py"], 2, "optimizer(params) returned a list",
         model(GOOD + "def optimizer(params):\n    return list(params)\n")),
    Case("loss turns NaN at step 1", ["scan", "{tmp}/model.py", "--steps", "3", "--out", "{tmp}/r"], 0,
         "1 step(s) had a non-finite loss",
         model(GOOD.replace("batches = [torch.ones(3, 2)]", "batches = [torch.ones(3, 2), torch.full((3, 2), float('nan')), torch.ones(3, 2)]"))),
    Case("complex, integer, sparse and zero-size values in backward", ["scan", "{tmp}/model.py", "--steps", "1", "--out", "{tmp}/r"],
         0, "Recommended static loss scale", model(AWKWARD_OUTPUTS)),
    # -- flags ----------------------------------------------------------------------
    Case("--steps 0", ["scan", "{tmp}/model.py", "--steps", "0"], 2, "--steps must be at least 1, got 0", model(GOOD)),
    Case("--steps not a number", ["scan", "{tmp}/model.py", "--steps", "many"], 2, "Invalid value", model(GOOD)),
    Case("negative --headroom-bits", ["scan", "{tmp}/model.py", "--headroom-bits", "-1"], 2, "--headroom-bits must be between 0 and 64, got -1", model(GOOD)),
    Case("--loss-scale nan", ["scan", "{tmp}/model.py", "--loss-scale", "nan"], 2, "--loss-scale must be a positive number, got nan", model(GOOD)),
    Case("--loss-scale not a power of two", ["scan", "{tmp}/model.py", "--loss-scale", "1000"], 2,
         "nearest are 512 (2^9) and 1024 (2^10)", model(GOOD)),
    Case("unknown --format", ["scan", "{tmp}/model.py", "--format", "fp9"], 2,
         "unknown format 'fp9'; known: fp16, bf16, fp8_e4m3fn, fp8_e5m2", model(GOOD)),
    Case("unknown --device", ["scan", "{tmp}/model.py", "--device", "tpu"], 2, "invalid device 'tpu'", model(GOOD)),
    Case("--every 0", ["scan", "{tmp}/model.py", "--every", "0"], 2, "--every must be at least 1", model(GOOD)),
    Case("--window 0", ["scan", "{tmp}/model.py", "--window", "0"], 2, "--window must be at least 1", model(GOOD)),
    Case("report exists, no --force", ["scan", "{tmp}/model.py", "--out", "{tmp}/report"], 2,
         "already exists; pass --force to overwrite it", lambda tmp: (model(GOOD)(tmp), report()(tmp))),
    Case("--force onto a directory that is not a report", ["scan", "{tmp}/model.py", "--out", "{tmp}", "--force"], 2,
         "is not an fpaudit report; refusing to replace it", model(GOOD)),
    Case("another run is writing the report", ["scan", "{tmp}/model.py", "--out", "{tmp}/r"], 2,
         "another fpaudit run (pid", locked, hold_lock=True),
    # -- config files ---------------------------------------------------------------
    Case("config file missing", ["scan", "{tmp}/model.py", "--config", "{tmp}/none.toml"], 2, "config file", model(GOOD)),
    Case("invalid TOML", ["scan", "{tmp}/model.py", "--config", "{tmp}/model.py"], 2, "invalid TOML", model(GOOD)),
    Case("unknown config key", ["gate", "{tmp}/report", "--config", "{tmp}/c.toml"], 2, "unknown key 'max_underflw'",
         lambda tmp: (report()(tmp), (tmp / "c.toml").write_text("max_underflw = 0.1\n"))),
    Case("config value of the wrong type", ["gate", "{tmp}/report", "--config", "{tmp}/c.toml"], 2,
         "[gate] max_underflow must be a number", lambda tmp: (report()(tmp), (tmp / "c.toml").write_text("[gate]\nmax_underflow = 'low'\n"))),
    # -- reports --------------------------------------------------------------------
    Case("report missing", ["show", "{tmp}/nope"], 2, "does not exist"),
    Case("report is a file", ["recommend", "{tmp}/c.toml"], 2, "is not a directory", lambda tmp: (tmp / "c.toml").write_text("")),
    Case("report directory is empty", ["gate", "{tmp}", "--max-underflow", "0.1"], 2, "is not an fpaudit report (no meta.json)"),
    Case("report truncated", ["show", "{tmp}/report"], 2, "bins.parquet is corrupt (checksum mismatch)", report(truncate("bins.parquet"))),
    Case("report from a newer fpaudit", ["recommend", "{tmp}/report"], 2, "schema version 7 is newer than this fpaudit reads",
         report(edit_meta(lambda m: m.update(schema_version=7)))),
    Case("metadata is not JSON", ["show", "{tmp}/report"], 2, "corrupt metadata",
         report(lambda root: (root / "meta.json").write_text("{oops"))),
    Case("metadata lost its file list", ["show", "{tmp}/report"], 2, "no file list", report(edit_meta(lambda m: m.pop("files")))),
    Case("metadata field of the wrong type", ["show", "{tmp}/report"], 2, "modules has the wrong type",
         report(edit_meta(lambda m: m.update(modules="a,b")))),
    Case("tables tampered consistently", ["gate", "{tmp}/report", "--max-underflow", "0.1"], 2,
         "records and bins disagree on element counts",
         report(edit_records("elements", _first(lambda n: n + 5)))),
    Case("gate without a threshold", ["gate", "{tmp}/report"], 2, "gate needs --max-underflow", report()),
    Case("--max-underflow above 1", ["gate", "{tmp}/report", "--max-underflow", "2"], 2, "between 0 and 1, got 2.0", report()),
    Case("--max-underflow nan", ["gate", "{tmp}/report", "--max-underflow", "nan"], 2, "between 0 and 1, got nan", report()),
    Case("--scale 0", ["show", "{tmp}/report", "--scale", "0"], 2, "--scale must be a positive number, got 0", report()),
    Case("--scale beyond fp32", ["show", "{tmp}/report", "--scale", "2^200"], 2, "outside the range of an fp32 scale", report()),
    Case("--scale not a number", ["gate", "{tmp}/report", "--max-underflow", "0.1", "--scale", "lots"], 2,
         "--scale 'lots' is not a number", report()),
    Case("unknown --kind", ["show", "{tmp}/report", "--kind", "weights"], 2, "--kind must be backward, grad or forward", report()),
    Case("incomplete report at the gate", ["gate", "{tmp}/report", "--max-underflow", "1"], 1,
         "the report is incomplete", report(complete=False, stopped_by="SIGINT", steps_run=2, steps_requested=9)),
    Case("unknown command", ["audit"], 2, "No such command 'audit'"),
    # -- training scripts (fpaudit run) ---------------------------------------------------
    Case("training script missing", ["run", "--out", "{tmp}/r", "--", "{tmp}/train.py"], 2, "training script <tmp>/train.py does not exist"),
    Case("training script is a directory", ["run", "--out", "{tmp}/r", "--", "{tmp}"], 2, "is a directory"),
    Case("training script with a syntax error", ["run", "--out", "{tmp}/r", "--", "{tmp}/train.py"], 2,
         "the script raised SyntaxError", model("for step in range(3)\n    pass\n", "train.py")),
    Case("training script raises", ["run", "--out", "{tmp}/r", "--", "{tmp}/train.py"], 2,
         "<tmp>/train.py:2: the script raised KeyError: 'lr'", model("config = {}\nlr = config['lr']\n", "train.py")),
    Case("training script exits 4", ["run", "--out", "{tmp}/r", "--", "{tmp}/train.py"], 4, "exited before an optimizer step",
         model("import sys\nsys.exit(4)\n", "train.py")),
    Case("training script without a loop", ["run", "--out", "{tmp}/r", "--", "{tmp}/train.py"], 2,
         "finished without an optimizer step: nothing to audit", model("print('nothing to train')\n", "train.py")),
    Case("--max-steps 0", ["run", "--max-steps", "0", "--", "{tmp}/train.py"], 2, "--max-steps must be at least 1", model(GOOD, "train.py")),
    Case("--capture-every -1", ["run", "--capture-every", "-1", "--", "{tmp}/train.py"], 2, "--capture-every must be 0 (never) or more",
         model(GOOD, "train.py")),
    Case("--max-skip-rate 2", ["run", "--max-skip-rate", "2", "--", "{tmp}/train.py"], 2, "--max-skip-rate must be between 0 and 1",
         model(GOOD, "train.py")),
    Case("run onto an existing report", ["run", "--out", "{tmp}/report", "--", "{tmp}/train.py"], 2, "already exists; pass --force",
         lambda tmp: (model(GOOD, "train.py")(tmp), report()(tmp))),
    # -- simulate and steps -------------------------------------------------------------
    Case("unknown --policy", ["simulate", "{tmp}/report", "--policy", "fairseq"], 2, "--policy must be one of", report()),
    Case("option the policy lacks", ["simulate", "{tmp}/report", "--policy", "apex", "--hysteresis", "2"], 2,
         "--hysteresis does not apply to --policy apex", report()),
    Case("--backoff-factor above 1", ["simulate", "{tmp}/report", "--backoff-factor", "2"], 2, "--backoff-factor must be between 0 and 1",
         report()),
    Case("--growth-interval 0", ["simulate", "{tmp}/report", "--growth-interval", "0"], 2, "--growth-interval must be a whole number >= 1",
         report()),
    Case("--init-scale inf", ["simulate", "{tmp}/report", "--init-scale", "inf"], 2, "--init-scale must be a positive number", report()),
    Case("--limit 1 for --steps", ["show", "{tmp}/report", "--steps", "--limit", "1"], 2, "--limit must be at least 2", report()),
    Case("--drift-binades -1", ["recommend", "{tmp}/report", "--drift-binades", "-1"], 2, "--drift-binades must be 0 or more", report()),
    Case("findings of the wrong type", ["show", "{tmp}/report", "--steps"], 2, "findings has the wrong type",
         report(edit_meta(lambda m: m.update(findings="none")))),
    Case("--junit under a file", ["gate", "{tmp}/report", "--max-underflow", "1", "--junit", "{tmp}/notes.txt/j.xml"], 2,
         "--junit: cannot create folder <tmp>/notes.txt", report(lambda root: (root.parent / "notes.txt").write_text(""))),
    Case("report of 2 ranks missing a part", ["show", "{tmp}/report"], 2, "rank-00001/records.parquet is missing",
         ranked_report(lambda root: shutil.rmtree(root / "rank-00001"))),
    Case("report of 0 ranks", ["show", "{tmp}/report"], 2, "ranks 0 out of range 1..32768",
         ranked_report(edit_meta(lambda m: m.update(ranks=0)))),
    Case("report with a negative loss scale", ["show", "{tmp}/report"], 2,
         "loss_scale must be a positive number in fp32 range", report(edit_records("loss_scale", _first(-1.0)))),
    # -- evidence: the gate passes only what was measured ------------------------------
    Case("--module with a typo", ["scan", "{tmp}/model.py", "--module", "linaer", "--out", "{tmp}/r"], 2,
         "--module 'linaer' matches no module of the model", model(GOOD)),
    Case("--exclude-module '*'", ["scan", "{tmp}/model.py", "--exclude-module", "*", "--out", "{tmp}/r"], 2,
         "the selection --exclude-module '*' leaves no module of the model to measure", model(GOOD)),
    Case("--op with a typo", ["scan", "{tmp}/model.py", "--op", "aten.mmm.*", "--out", "{tmp}/r"], 2,
         "--op 'aten.mmm.*' matches no backward op of the model (closest: aten.mm.default", model(GOOD)),
    Case("run --module with a typo", ["run", "--module", "lineer", "--capture-every", "1", "--out", "{tmp}/r", "--", "{tmp}/train.py"],
         2, "--module 'lineer' matches no module of the model", model(TRAIN, "train.py")),
    Case("gate on a report of zeros", ["gate", "{tmp}/report", "--max-underflow", "0.01"], 1,
         "measured nothing", values_report({"a": [0.0, 0.0, -0.0]})),
    Case("gate on inf/NaN values only", ["gate", "{tmp}/report", "--max-underflow", "0.01"], 1,
         "measured nothing", values_report({"a": [float("inf"), float("nan")]})),
    Case("gate on some inf/NaN values", ["gate", "{tmp}/report", "--max-underflow", "0.01"], 1,
         "2 backward value(s) in scope are inf or NaN", values_report({"a": [1.0, float("inf"), float("nan")]})),
    Case("gate on some inf/NaN values, --allow-nonfinite", ["gate", "{tmp}/report", "--max-underflow", "0.01", "--allow-nonfinite"], 0,
         "PASS", values_report({"a": [1.0, float("inf"), float("nan")]})),
    Case("gate on a run report with an error finding", ["gate", "{tmp}/report", "--max-underflow", "0.01"], 1,
         "the run found an error: clip-before-unscale at train.py:12", report(findings=[CLIP_ERROR])),
    Case("gate on a run report with an error finding, --allow-errors",
         ["gate", "{tmp}/report", "--max-underflow", "0.01", "--allow-errors"], 0, "PASS", report(findings=[CLIP_ERROR])),
    Case("gate on values the device lost (live --shadow)", ["gate", "{tmp}/report", "--max-underflow", "0.01"], 1,
         "the device lost 100% of its values at the run's loss scale (4 of 4",
         report(both(edit_records("shadow_nonzero", _first(4)), edit_records("lost", _first(4))))),
    Case("gate on no completed step, --allow-incomplete", ["gate", "{tmp}/report", "--max-underflow", "1", "--allow-incomplete"], 1,
         "the report holds no completed step", report(complete=False, stopped_by="SIGINT", steps_run=0, steps_requested=9)),
    Case("--junit inside the report", ["gate", "{tmp}/report", "--max-underflow", "1", "--junit", "{tmp}/report/j.xml"], 2,
         "--junit <tmp>/report/j.xml is inside the report <tmp>/report", report()),
    # -- reports are validated before they are trusted -----------------------------------
    Case("absurd headroom_bits in meta.json", ["recommend", "{tmp}/report"], 2, "meta.json: headroom_bits 1e+30 out of range 0..64",
         report(edit_meta(lambda m: m.update(headroom_bits=10**30)))),
    Case("absurd steps_run in meta.json", ["gate", "{tmp}/report", "--max-underflow", "1"], 2,
         "meta.json: steps_run -1 out of range 0..2147483647", report(edit_meta(lambda m: m.update(steps_run=-1)))),
    # 10**400 is past float's range: the message must not convert it to a float
    *(Case(f"steps_run of 10**400 in meta.json ({command})", [command, "{tmp}/report", *extra], 2,
           "meta.json: steps_run 1e+400 out of range 0..2147483647", report(edit_meta(lambda m: m.update(steps_run=10**400))))
      for command, extra in (("show", []), ("recommend", []), ("gate", ["--max-underflow", "1"]))),
    Case("loss_scale of 10**400 in meta.json", ["show", "{tmp}/report"], 2,
         "meta.json: loss_scale 1e+400 out of range 1.4013e-45..3.40282e+38", report(edit_meta(lambda m: m.update(loss_scale=10**400)))),
    Case("meta.json nested 100,000 deep", ["show", "{tmp}/report"], 2, "corrupt metadata (nested too deeply)", report(nest_in_meta(100_000))),
    Case("meta.json nested 100 deep", ["show", "{tmp}/report"], 2, "corrupt metadata (nested deeper than 32 levels)",
         report(nest_in_meta(100))),
    Case("meta.json of 65 MiB", ["show", "{tmp}/report"], 2, "meta.json: larger than 64 MiB", report(grow_meta(65 << 20))),
    Case("pandas entry in the Parquet schema metadata", ["show", "{tmp}/report"], 0, "backward values per module",
         report(pandas_metadata)),
    Case("symbolic link inside the report", ["show", "{tmp}/report"], 2, "records.parquet is a symbolic link",
         report(symlinked("records.parquet"))),
    Case("meta.json is a symbolic link", ["show", "{tmp}/report"], 2, "meta.json is a symbolic link", report(symlinked("meta.json"))),
    Case("malformed findings", ["show", "{tmp}/report", "--steps"], 2, "meta.json: findings[0].line must be a whole number, got \"ten\"",
         report(findings=[{"code": "x", "file": "t.py", "line": "ten", "message": "m", "severity": "error", "steps": [], "count": 1}])),
    Case("malformed training block", ["show", "{tmp}/report", "--steps"], 2, "meta.json: training.skipped must be a whole number, got null",
         report(training={"steps": 1})),
    Case("malformed scaler block", ["simulate", "{tmp}/report"], 2, "meta.json: scaler.init_scale -1 out of range",
         report(scaler={**SCALER, "init_scale": -1.0})),
    Case("plot without --output", ["plot", "{tmp}/report"], 2, "plot needs --output FILE.png or FILE.svg (-o for short)", report()),
    Case("plot into a .bmp", ["plot", "{tmp}/report", "-o", "{tmp}/r.bmp"], 2, "--output must end in .png or .svg", report()),
    Case("plot onto a directory", ["plot", "{tmp}/report", "-o", "{tmp}/d.png"], 2, "d.png is a directory",
         report(lambda root: (root.parent / "d.png").mkdir())),
    # -- where the report goes, and model code that exits --------------------------------
    Case("--out .", ["scan", "{tmp}/model.py", "--out", "."], 2, "--out '.' names no new directory", model(GOOD)),
    Case("--out empty", ["scan", "{tmp}/model.py", "--out", ""], 2, "names no new directory", model(GOOD)),
    Case("--out /", ["scan", "{tmp}/model.py", "--out", "/"], 2, "--out '/' names no new directory", model(GOOD)),
    Case("--out inside a file", ["scan", "{tmp}/model.py", "--out", "{tmp}/model.py/r"], 2,
         "--out: cannot create folder <tmp>/model.py: a file is in the way (<tmp>/model.py)", model(GOOD)),
    Case("--out name of 256 bytes", ["scan", "{tmp}/model.py", "--out", "{tmp}/" + "n" * 256], 2,
         "is 256 bytes long; this filesystem allows 255", model(GOOD)),
    Case("sys.exit in loss()", ["scan", "{tmp}/model.py"], 2, "model.py:5: loss(model, batch) called sys.exit(0)",
         model(GOOD.replace("    return model(batch).sum()", "    raise SystemExit(0)"))),
    Case("os._exit in loss()", ["scan", "{tmp}/model.py"], 2, "loss(model, batch) called os._exit(0)",
         model("import os\n" + GOOD.replace("    return model(batch).sum()", "    os._exit(0)"))),
    Case("sys.exit in model()", ["scan", "{tmp}/model.py"], 2, "model() called sys.exit(1)",
         model(GOOD.replace("model = torch.nn.Linear(2, 1)", "import sys\ndef model():\n    sys.exit(1)"))),
    Case("sys.exit while iterating `batches`", ["scan", "{tmp}/model.py"], 2, "iterating `batches` called sys.exit(None)",
         model(GOOD.replace("batches = [torch.ones(3, 2)]", "def batches():\n    raise SystemExit\n    yield"))),
    # -- the environment at fault, and what fpaudit changes of the request ----------------
    Case("report path is a symlink loop", ["show", "{tmp}/loop"], 2,
         "report <tmp>/loop: <tmp>/loop is a symbolic link that leads back to itself (a symlink loop)",
         lambda tmp: (tmp / "loop").symlink_to("loop")),
    Case("--junit is a symlink loop", ["gate", "{tmp}/report", "--max-underflow", "1", "--junit", "{tmp}/loop"], 2,
         "--junit <tmp>/loop: <tmp>/loop is a symbolic link that leads back to itself",
         report(lambda root: (root.parent / "loop").symlink_to("loop"))),
    Case("--out under a symlink loop", ["scan", "{tmp}/model.py", "--out", "{tmp}/loop/sub"], 2,
         "--out <tmp>/loop/sub: <tmp>/loop is a symbolic link that leads back to itself",
         lambda tmp: (model(GOOD)(tmp), (tmp / "loop").symlink_to("loop"))),
    Case("Inductor's cache folder under a file", ["scan", "{tmp}/model.py", "--compile", "--out", "{tmp}/r"], 2,
         "torch.compile cannot write Inductor's cache folder <tmp>/model.py/inductor (TORCHINDUCTOR_CACHE_DIR): Not a directory",
         model(GOOD), env={"TORCHINDUCTOR_CACHE_DIR": "{tmp}/model.py/inductor"}),
    Case("fullgraph=True model with a graph break", ["scan", "{tmp}/model.py", "--out", "{tmp}/r"], 2,
         "model.py:9: loss(model, batch) raised Unsupported: Failed to trace builtin operator",
         model(GOOD.replace("model = torch.nn.Linear(2, 1)", "class Breaks(torch.nn.Linear):\n"
               "    def forward(self, x):\n        print(end='')  # a graph break\n"
               "        return super().forward(x)\nmodel = torch.compile(Breaks(2, 1), fullgraph=True)"))),
]  # fmt: skip


@dataclass
class Outcome:
    code: int
    line: str  # the first line the user sees
    traceback: bool
    report_left: bool


def _fill(arg: str, tmp: Path) -> str:
    return arg.replace("{tmp}", str(tmp))


def _normalise(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp), "<tmp>").replace(str(ROOT), "<repo>")
    return re.sub(r"pid \d+", "pid N", text)


def run_case(case: Case, tmp: Path) -> Outcome:
    case.setup(tmp)
    before = set(tmp.iterdir())
    out, err = io.StringIO(), io.StringIO()
    lock = output_lock(tmp / "r") if case.hold_lock else contextlib.nullcontext()
    env = {name: _fill(value, tmp) for name, value in case.env.items()}
    with lock, _environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run([_fill(a, tmp) for a in case.args])
    errors = [line for line in err.getvalue().splitlines() if line.strip()]
    shown = (
        errors
        if code == 2
        else [line for line in out.getvalue().splitlines() if case.says in line] or errors
    )
    created = {p for p in set(tmp.iterdir()) - before if not p.name.endswith(".lock")}
    return Outcome(
        code=code,
        line=_normalise(shown[0] if shown else "", tmp),
        traceback="Traceback" in err.getvalue(),
        report_left=any((p / "meta.json").exists() or p.name.startswith(".") for p in created),
    )


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Each case's outcome as test_bad_input observed it, by case name: the reliability doc is
# rendered from these, so the battery runs once (a case that did not run, as under -k,
# runs in test_reliability_doc_is_current).
OBSERVED: dict[str, Outcome] = {}


def test_case_names_are_unique() -> None:
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, tmp_path: Path) -> None:
    outcome = run_case(case, tmp_path)
    OBSERVED[case.name] = outcome  # before the checks: the doc shows what was seen
    assert outcome.code == case.code, outcome
    assert not outcome.traceback
    assert case.says in outcome.line or case.says in _normalise(outcome.line, tmp_path), outcome
    if case.code == 2:
        assert outcome.line.startswith("fpaudit: error: ")
        assert not outcome.report_left, "a failed command left a report or a staging directory"


def render(outcomes: list[tuple[Case, Outcome]]) -> str:
    lines = [
        "# Reliability: what fpaudit does with bad input",
        "",
        "Generated by `tests/project/test_battery.py` (`FPAUDIT_UPDATE_DOCS=1 make test` rewrites it;",
        "the suite fails when it is out of date). Every row is a test: the command ran through",
        "the real CLI entry point, and the exit code and the first line the user saw are",
        "recorded as observed. Exit codes: 0 success, 1 gate failed, 2 bad input. No case",
        "printed a traceback, and no failed command left a report or a half-written one.",
        "`<tmp>` is the test's scratch directory.",
        "",
        "| # | bad input | command | exit | what the user sees |",
        "| --- | --- | --- | --- | --- |",
    ]
    for number, (case, outcome) in enumerate(outcomes, 1):
        command = " ".join(["fpaudit", *(a.replace("{tmp}", "<tmp>") for a in case.args)])
        message = outcome.line.replace("|", "\\|")
        lines.append(f"| {number} | {case.name} | `{command}` | {outcome.code} | {message} |")
    lines += [
        "",
        "Interrupted runs (tested with real signals in `tests/report/test_reliability.py`): SIGINT or",
        "SIGTERM during `scan` writes the completed steps as a report marked incomplete and",
        "exits 130 or 143; `gate` then fails unless `--allow-incomplete`.",
        "",
        "Faults outside this table, each tested with a real subprocess in",
        "`tests/project/test_faults.py`:",
        "",
        "- SIGINT or SIGTERM (twice) while a report is written: the write finishes, the",
        "  report is whole, exit 130 or 143. SIGTERM anywhere in a command exits 143.",
        "- Ctrl-C in step 0 of `scan --force`: the existing report, with more completed",
        "  steps, is kept (`--replace-partial` replaces it).",
        "- `--force` swaps the new report in atomically (`renameat2(RENAME_EXCHANGE)`);",
        '  a reader racing it reads the old or the new report, never a false "corrupt".',
        "  Without it, a crash between the two renames is undone by the next write.",
        "- A training script or model file that forks (`os.fork`, DataLoader workers):",
        "  only the process that started the audit writes the report and releases the lock.",
        "  Locks are `flock`s: they die with their process, whatever its pid.",
        "- A kernel build lock left by a killed build or load: removed, the kernel loads.",
        "- A cached CPU kernel cut to half its size (a full disk during the link, a partial",
        "  cache restore; loading it died of SIGBUS): one line (`the cached CPU kernel ... does",
        "  not match its build (N bytes, built M); rebuilding it`), rebuilt, never loaded; the",
        "  counts equal the pure-torch path's (`tests/kernels/test_kernel_build.py`).",
        "- No C++ compiler (`CXX` names none, `c++` not on `PATH`): one note (`no C++ compiler",
        "  found (...)`), the pure-torch path, no build attempted; `scan --compile` stops with",
        "  one line naming the compiler (`no C++ compiler found: torch.compile (Inductor)",
        "  needs one ...`), exit 2.",
        "- Disk full (tmpfs), file-size limit (`RLIMIT_FSIZE`), read-only filesystem: one",
        "  line, exit 2, the old report intact. Names of 250 and 253 bytes work.",
        "- `sys.exit`/`os._exit` in `loss()` after some steps: exit 2 naming the model file,",
        "  the completed steps kept as an incomplete report. Model prints go to stderr under",
        "  `verify --json`; `--out` is resolved before model code can `chdir`.",
        "- An `--out` path past PATH_MAX (4096 bytes on Linux, less the room the report's",
        "  files need inside it): one line naming `--out` and the path's length, exit 2,",
        "  nothing created; a path at the limit writes its report.",
        "- A model file that starts a thread without `daemon=True` (a prefetcher that never",
        "  ends): the report is written and the summary printed, then one note names the",
        "  thread and fpaudit exits with the command's code instead of waiting forever.",
        "  `fpaudit run` waits for a script's threads, as `python script` does.",
        "  Threads torch starts (Inductor's compile workers) are torch's, not the model's:",
        "  no note for them.",
        "- A `meta.json` number past float's range (`steps_run` of 10**400): one line naming",
        "  the field, exit 2, from `show`, `recommend` and `gate`.",
        "- A report directory gets the mode `mkdir` gives under the umask (0755 under 022,",
        "  0750 under 027), and its files the mode `open` gives (0644, 0640).",
        "",
        "The environment at fault, each tested with a real subprocess in",
        "`tests/project/test_faults_environment.py` (the tmpfs cases where the tests run as root):",
        "",
        "- Standard output full (`fpaudit gate r ... > /dev/full`): `fpaudit: error: cannot",
        "  write the result to standard output: No space left on device`, exit 2.",
        "- Standard output closed (`fpaudit show r | head -0`): `fpaudit: error: standard",
        "  output was closed before fpaudit wrote its result (Broken pipe)`, exit 2 (not 1,",
        "  a failed gate's status).",
        "- `run --tensorboard DIR` with DIR on a full disk: one `fpaudit: warning: writing",
        "  TensorBoard event files to DIR failed (OSError: [Errno 28] No space left on",
        "  device); the audit goes on without them`, no thread traceback; the run and its",
        "  report complete, exit 0.",
        "- `scan --compile` with `TORCHINDUCTOR_CACHE_DIR` on a read-only mount:",
        "  `fpaudit: error: torch.compile cannot write Inductor's cache folder DIR",
        "  (TORCHINDUCTOR_CACHE_DIR): Read-only file system; set TORCHINDUCTOR_CACHE_DIR to",
        "  a writable folder`, exit 2, nothing written.",
        "",
        "Faults under `torchrun` (2 ranks, gloo on the CPU), each tested in",
        "`tests/run/test_distributed_faults.py`; every rank ends within 60 s of the fault, no",
        "process of the launch is left and no lock is held:",
        "",
        "- One-shot `batches` shorter on rank 1: every rank stops at the shortest; exit 0 and",
        "  `fpaudit: note: the batches of rank 1 ended after 2 step(s); every rank stopped",
        "  there`; the report holds those steps of both ranks.",
        "- SIGTERM to torchrun, or Ctrl-C (SIGINT to the job): every rank stops at the same",
        "  step; `fpaudit: interrupted by SIGTERM after N of M step(s); the completed steps",
        "  are in OUT, marked incomplete`; one report of both ranks, incomplete.",
        "- `loss` raises on rank 1: rank 1 says its error, rank 0 `fpaudit: error: rank 1",
        "  failed: model.py:38: loss(model, batch) raised ValueError: ...; this rank's 2",
        "  completed step(s) are in OUT.rank0, marked incomplete`; each rank's steps in",
        "  `OUT.rankN`, incomplete; no torch file named as the culprit. Exit 2.",
        "- Rank 1 builds a different model: `fpaudit: error: rank 1 failed: model.py: rank",
        "  1's model differs from the other ranks' ([1]: params[0] in this process with sizes",
        "  [12, 4] appears not to match ...); every rank must build the same model`, exit 2.",
        "- Rank 1 killed (SIGKILL): rank 0 says `fpaudit: error: another rank's process ended",
        "  without a word (killed, or it crashed); rank 0 stopped: Connection closed by peer",
        "  ...; this rank's N completed step(s) are in OUT.rank0, marked incomplete`.",
        "",
        "Damaged and tampered",
        "reports are also fuzzed (`tests/report/test_fuzz.py`): random metadata, random bytes in the",
        "Parquet files and well-formed tables with impossible values end in a result or one",
        "clean error line, never an internal error.",
        "",
    ]
    return "\n".join(lines)


def test_reliability_doc_is_current(tmp_path_factory: pytest.TempPathFactory) -> None:
    """docs/reliability.md is the table of every case's observed outcome: the outcomes
    test_bad_input recorded, and a fresh run of any case it did not run this session."""
    assert len(CASES) >= 30
    for case in CASES:
        if case.name not in OBSERVED:
            OBSERVED[case.name] = run_case(case, tmp_path_factory.mktemp("case"))
    text = render([(case, OBSERVED[case.name]) for case in CASES])
    if os.environ.get("FPAUDIT_UPDATE_DOCS") == "1":
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text(text)
    assert DOC.exists() and DOC.read_text() == text, (
        "docs/reliability.md is stale: run FPAUDIT_UPDATE_DOCS=1 make test"
    )


def _sample_digests() -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(SAMPLES)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(SAMPLES.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip


SAMPLES_BEFORE = _sample_digests()  # at collection: before any test of the session ran


def test_samples_are_not_touched() -> None:
    """No test run so far (this module's cases and every module collected before it, which
    scan, verify and run the samples) changed, added or removed a sample file."""
    assert "mlp.py" in SAMPLES_BEFORE
    assert _sample_digests() == SAMPLES_BEFORE
