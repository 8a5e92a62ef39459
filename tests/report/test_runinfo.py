"""RunInfo: the run metadata's one schema, written by commands and read by everyone."""

from __future__ import annotations

from pathlib import Path

from fpaudit.report.runinfo import (
    AutocastPrediction,
    CompiledInfo,
    Finding,
    OpDtypes,
    RunInfo,
    RunMeta,
)
from fpaudit.report.store import Report

from ..conftest import SAMPLES
from ..reports import report_from


def test_written_fields_read_back_the_same() -> None:
    info = RunInfo(
        command="scan",
        model_file="m.py",
        steps_requested=4,
        steps_run=3,
        complete=False,
        stopped_by="SIGINT",
        selection={"modules": ["a.*"]},
        amp_dtype="float16",
    )
    meta = info.to_meta()
    # the always-written fields, None included; the optional ones only when set
    assert meta == {
        "command": "scan",
        "model_file": "m.py",
        "steps_requested": 4,
        "steps_run": 3,
        "complete": False,
        "stopped_by": "SIGINT",
        "selection": {"modules": ["a.*"]},
        "amp": "fp16",
        "amp_dtype": "float16",
    }
    assert RunInfo.from_meta(meta) == RunInfo(
        **{**info.__dict__, "selection": {"modules": ("a.*",)}}
    )


def test_a_report_without_a_command_reads_the_defaults() -> None:
    import torch

    report = report_from({"a": torch.tensor([1.0, 2.0**-30])})  # Audit-API-like: no command
    info = report.info
    assert info.command is None and info.steps_run is None and info.complete
    assert info.steps == 1 and info.modules == ("a",) and info.selection == {}
    assert info.source == "" and info.scaler is None and info.training is None


def test_info_follows_the_metadata_and_wrong_types_read_as_defaults() -> None:
    import torch

    report = report_from({"a": torch.tensor([1.0])})
    # as read from a meta.json (the JSON edge: RunInfo.from_meta)
    meta = {**report.meta, "steps_run": True, "amp_dtype": 3, "script": "train.py"}
    info = RunInfo.from_meta(meta)
    assert info.steps_run is None and info.amp_dtype is None  # a bool is no step count
    assert info.source == "train.py"


def test_a_scanned_report_on_disk_reads_through_info(cli, tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = cli("scan", SAMPLES / "quadratic.py", "--steps", "2", "--out", out)
    assert result.code == 0, result.stderr
    info = Report.read(out).info
    assert info.command == "scan" and info.steps_run == 2 and info.steps_requested == 2
    assert info.complete and info.stopped_by is None
    assert info.model_file == str(SAMPLES / "quadratic.py") and info.amp is None


def test_the_commands_settings_and_findings_read_typed_and_are_not_rewritten() -> None:
    finding = {"code": "scheduler-on-skipped-step", "count": 1, "file": "t.py", "line": 9,
               "message": "m", "severity": "warning", "steps": [3]}  # fmt: skip
    meta = {"formats": ["bf16", "fp16"], "headroom_bits": 4, "include_loss": True,
            "findings": [finding, "not a dict", {"rule": "scheduler-on-skip"}]}  # fmt: skip
    info = RunInfo.from_meta(meta)
    assert (info.formats, info.headroom_bits, info.include_loss) == (("bf16", "fp16"), 4, True)
    # typed; what is not a finding (not a dict, or a dict without a finding's keys) is dropped
    assert info.findings == (
        Finding("scheduler-on-skipped-step", "warning", "t.py", 9, "m", steps=(3,), count=1),
    )
    # a run's end (Report.record_run) leaves them as they are
    ended = info.ended_as(RunInfo(command="scan", steps_run=1))
    assert (ended.formats, ended.headroom_bits, ended.include_loss, ended.findings) == (
        info.formats, info.headroom_bits, info.include_loss, info.findings,
    )  # fmt: skip
    # a bool is no headroom, a number no include_loss: each reads as unset
    wrong = RunInfo.from_meta({"headroom_bits": True, "include_loss": 1, "findings": {}})
    assert (wrong.headroom_bits, wrong.include_loss, wrong.findings) == (None, None, ())


def test_record_run_stamps_the_run_the_settings_and_the_command_line() -> None:
    import pytest
    import torch

    report = report_from({"a": torch.tensor([1.0])})
    run = RunInfo(command="scan", steps_requested=4, steps_run=2, complete=False)
    line = RunMeta(argv="fpaudit scan m.py", config=None, options={"every": 3}, headroom_bits=4)
    report.record_run(run, {"seed": 0, "every": 2}, line)
    assert report.info.steps_run == 2 and report.info.complete is False
    assert report.meta["seed"] == 0 and report.meta["every"] == 2
    assert report.meta["argv"] == "fpaudit scan m.py" and report.info.argv == line.argv
    assert report.info.headroom_bits == 4 and report.meta["options"] == {"every": 3}
    # a setting cannot override a typed field: no raw key wins over the record
    with pytest.raises(ValueError, match="formats"):
        report.record_run(run, {"formats": ["bf16"]})


def test_a_run_ends_complete_unless_something_stopped_it() -> None:
    stopped = RunInfo.ended("scan", "SIGINT", (4, 3), {"modules": ["a.*"]}, None, model_file="m.py")
    assert (stopped.complete, stopped.stopped_by, stopped.steps_requested, stopped.steps_run) == (
        False, "SIGINT", 4, 3,
    )  # fmt: skip
    assert stopped.model_file == "m.py" and stopped.selection == {"modules": ["a.*"]}
    done = RunInfo.ended("lightning", None, (None, 7), {}, "bfloat16")
    assert done.complete and done.stopped_by is None and done.amp_dtype == "bfloat16"
    # run's --max-steps stops a script whose run is complete, and says what stopped it
    capped = RunInfo.ended("run", "max-steps", (5, 5), {}, None, complete=True, script="t.py")
    assert capped.complete and capped.stopped_by == "max-steps" and capped.script == "t.py"


def test_update_info_writes_only_the_named_fields_under_their_old_keys() -> None:
    import pytest
    import torch

    report = report_from({"a": torch.tensor([1.0])})
    before = dict(report.meta)
    report.update_info(formats=("bf16",), model_file="m.py", out_of_range=3, recipes=("mxfp4",))
    # JSON types, under the keys meta.json has always had
    assert report.meta == {**before, "formats": ["bf16"], "model_file": "m.py",
                           "out_of_range": 3, "recipes": ["mxfp4"]}  # fmt: skip
    info = report.info
    assert (info.formats, info.model_file, info.out_of_range) == (("bf16",), "m.py", 3)
    assert report.recipes == ["mxfp4"]
    with pytest.raises(TypeError):
        report.update_info(no_such_field=1)


def test_a_finding_round_trips_in_meta_jsons_form_and_key_order() -> None:
    finding = Finding("clip-before-unscale", "error", "train.py", 12, "m", (0, 1), 2)
    data = finding.to_dict()
    # sorted, as meta.json (written with sort_keys) has always held them and read them back
    assert list(data) == sorted(data)
    assert data == {"code": "clip-before-unscale", "count": 2, "file": "train.py", "line": 12,
                    "message": "m", "severity": "error", "steps": [0, 1]}  # fmt: skip
    assert Finding.from_dict(data) == finding and finding.where == "train.py:12"


def test_update_info_writes_findings_as_dicts() -> None:
    import torch

    report = report_from({"a": torch.tensor([1.0])})
    finding = Finding("scale-falling", "warning", "t.py", 3, "m", (4,), 1)
    report.update_info(findings=(finding,))
    assert report.meta["findings"] == [finding.to_dict()]
    assert report.info.findings == (finding,)


def _scan_meta_by_hand() -> dict[str, object]:
    """The dict cli/commands.py built for scan before RunMeta, key for key."""
    return {"formats": ["fp16", "bf16"], "headroom_bits": 4, "include_loss": False,
            "argv": "fpaudit scan m.py", "config": None, "options": {"steps": 2, "module": ["a"]}}  # fmt: skip


def test_run_meta_writes_the_dicts_the_commands_built_by_hand() -> None:
    scan = RunMeta(argv="fpaudit scan m.py", config=None, options={"steps": 2, "module": ["a"]},
                   headroom_bits=4, formats=("fp16", "bf16"), include_loss=False)  # fmt: skip
    assert scan.to_dict() == _scan_meta_by_hand()
    assert list(scan.to_dict()) == list(_scan_meta_by_hand())  # the same order too
    run = RunMeta(argv="fpaudit run t.py", config="c.toml", options={}, headroom_bits=None)
    # run's formats and include_loss are not written by it (run sets formats later)
    assert run.to_dict() == {"headroom_bits": None, "argv": "fpaudit run t.py",
                             "config": "c.toml", "options": {}}  # fmt: skip
    assert list(run.to_dict()) == ["headroom_bits", "argv", "config", "options"]
    for meta in (scan, run):
        assert RunMeta.from_dict(meta.to_dict()) == meta


def test_a_scanned_reports_meta_json_holds_run_meta_as_the_dict_form(cli, tmp_path: Path) -> None:
    import json

    out = tmp_path / "r"
    result = cli("scan", SAMPLES / "quadratic.py", "--steps", "2", "--out", out)
    assert result.code == 0, result.stderr
    meta = json.loads((out / "meta.json").read_text())
    written = RunMeta.from_dict(meta)
    assert written.formats == ("fp16",) and written.headroom_bits == 4
    assert written.include_loss is False and written.config is None
    assert written.argv.startswith("fpaudit scan ") and written.options["steps"] == 2
    assert {k: meta[k] for k in written.to_dict()} == written.to_dict()


# meta.json's autocast and compiled entries as the probe and the compiled receiver wrote
# them before they were records, key for key
AUTOCAST_BY_HAND = {"device": "cpu", "dtype": "float16", "seconds": 0.25, "modules": {
    "fc": {"addmm": {"compute": ["fp16"], "cast": ["fp32"]}},
    "norm": {"rsqrt": {"compute": ["fp32"], "cast": []}, "add": {"compute": [], "cast": []}}}}  # fmt: skip
AUTOCAST_FAILED = {"device": "cuda", "dtype": "float16", "error": "RuntimeError('no')"}
COMPILED_BY_HAND = {"inductor": True, "observed_backward_runs": 2,
                    "fused_away": {"blocks.0.act": ["aten.erf.default", "aten.exp.default"]},
                    "not_covered": ["'' is compiled with backend 'aot_eager': ..."]}  # fmt: skip


def test_the_autocast_prediction_and_compiled_info_write_meta_jsons_form_back() -> None:
    import json

    import torch

    for key, written in (("autocast", AUTOCAST_BY_HAND), ("autocast", AUTOCAST_FAILED),
                         ("compiled", COMPILED_BY_HAND)):  # fmt: skip
        report = report_from({"a": torch.tensor([1.0])})
        read = RunInfo.from_meta({key: json.loads(json.dumps(written))})  # as from meta.json
        record = getattr(read, key)
        assert record is not None and record.to_dict() == written
        assert list(record.to_dict()) == list(written)  # in the order they were written
        report.update_info(**{key: record})
        assert report.meta[key] == written
    prediction = AutocastPrediction.from_dict(AUTOCAST_BY_HAND)
    assert prediction.modules["fc"]["addmm"] == OpDtypes(compute=("fp16",), cast=("fp32",))
    assert AutocastPrediction.from_dict(AUTOCAST_FAILED).error == "RuntimeError('no')"
    compiled = CompiledInfo.from_dict(COMPILED_BY_HAND)
    assert compiled.fused_away == {"blocks.0.act": ("aten.erf.default", "aten.exp.default")}


def test_a_compiled_entry_from_before_inductor_was_kept_reads_as_inductors() -> None:
    # reports written before the receiver kept "inductor": the gate has always read them
    # as Inductor-compiled (the only backend then)
    old = CompiledInfo.from_dict({"observed_backward_runs": 0, "fused_away": {}})
    assert old == CompiledInfo(inductor=True)


def test_a_malformed_autocast_or_compiled_entry_reads_as_none() -> None:
    import torch

    report = report_from({"a": torch.tensor([1.0])})
    info = RunInfo.from_meta({**report.meta,  # as read from meta.json
                              "autocast": {"modules": {"fc": {"addmm": {"compute": ["fp16"]}}}},
                              "compiled": ["not", "a", "dict"]})  # fmt: skip
    assert info.autocast is None and info.compiled is None
