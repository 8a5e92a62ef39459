"""Batches of every legitimate kind reach the device; scripted models get one clear line."""

from __future__ import annotations

import collections
import dataclasses
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import fpaudit
from fpaudit.run.modelfile import move_to

from ..conftest import one_error_line

META = torch.device("meta")  # every moved tensor shows it was moved


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    labels: list[torch.Tensor]
    name: str = "b"
    derived: int = dataclasses.field(default=0, init=False)


def test_mappings_keep_their_type_and_factory() -> None:
    batch = collections.defaultdict(list, {"x": torch.ones(2), "ids": [torch.zeros(1)]})
    moved = move_to(batch, META)
    assert type(moved) is collections.defaultdict and moved.default_factory is list
    assert moved["x"].device == META and moved["ids"][0].device == META
    assert batch["x"].device.type == "cpu"  # the user's batch is left alone
    ordered = move_to(collections.OrderedDict(b=torch.ones(1), a=torch.ones(1)), META)
    assert type(ordered) is collections.OrderedDict and list(ordered) == ["b", "a"]
    chained = move_to(collections.ChainMap({"x": torch.ones(1)}), META)  # a Mapping, copied
    assert chained["x"].device == META


def test_hugging_face_batch_encoding() -> None:
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding({"input_ids": torch.ones(1, 3, dtype=torch.long)})
    moved = move_to(encoding, META)
    assert isinstance(moved, transformers.BatchEncoding)
    assert moved["input_ids"].device == META


def test_named_tuples_and_dataclasses() -> None:
    pair = move_to(Pair(torch.ones(1), torch.ones(1)), META)
    assert type(pair) is Pair and pair.x.device == META and pair.y.device == META
    batch = move_to(Batch(torch.ones(1), [torch.ones(1)]), META)
    assert type(batch) is Batch and batch.name == "b"
    assert batch.x.device == META and batch.labels[0].device == META


DEFAULTDICT_FILE = """
import collections
import torch
model = torch.nn.Linear(2, 1)
batches = [collections.defaultdict(lambda: None, x=torch.ones(4, 2))]
def loss(model, batch):
    return model(batch["x"]).sum()
"""


def test_a_defaultdict_batch_scans(cli, tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(DEFAULTDICT_FILE))
    result = cli("scan", path, "--steps", "1", "--out", tmp_path / "r")
    assert result.code == 0, result.stderr
    assert (tmp_path / "r").exists()


def test_a_scripted_model_gets_one_line_and_exit_2(cli, tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(
        DEFAULTDICT_FILE.replace(
            "model = torch.nn.Linear(2, 1)", "model = torch.jit.script(torch.nn.Linear(2, 1))"
        )
    )
    line = one_error_line(cli("scan", path, "--steps", "1", "--out", tmp_path / "r"))
    assert "ScriptModule" in line and "audit the eager module" in line
    with pytest.raises(TypeError, match="audit the eager module"):
        fpaudit.audit(torch.jit.script(torch.nn.Linear(2, 1)))
