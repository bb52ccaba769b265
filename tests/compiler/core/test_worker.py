"""Crash isolation: a native crash in a stage's worker process is a one-line error naming the stage."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core.errors import CalibrationError, WorkerCrashed
from compiler.core.settings import ExportSettings, ModelSource
from compiler.core.specs import ModelSpec, parse_input_spec
from compiler.core.worker import Worker, _Crumb, in_worker
from compiler.pipeline.export import export_directory
from tests import crash_helpers


def test_result_logs_and_errors_come_back(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="calibration"):
        assert in_worker("test", crash_helpers.square_and_log, 7) == 49
    assert "squaring 7 in the worker" in caplog.text
    with pytest.raises(CalibrationError, match="bad data: fix it"):
        in_worker("test", crash_helpers.raise_user_error)
    with pytest.raises(KeyError) as bug:
        in_worker("test", crash_helpers.raise_bug)
    assert any("worker process" in note and "raise_bug" in note for note in bug.value.__notes__)


def test_a_segfault_names_the_stage_and_step() -> None:
    with pytest.raises(WorkerCrashed) as crash:
        in_worker("FP16 calibration", crash_helpers.segfault_at, "FP16 accuracy gate: the FP16 model", "batch 3")
    message = str(crash.value)
    assert "SIGSEGV" in message and "FP16 accuracy gate: the FP16 model, batch 3" in message
    assert "\n" not in message and crash.value.exit_code == 2


def test_the_stage_crumb_keeps_the_last_text_written_whole(tmp_path: Path) -> None:
    """The crumb file a crashed worker leaves reads back the last text written whole: a later write cut short in
    its slot (the other slot than the one named) leaves it, a text longer than a slot is cut to fit, and a
    missing file reads as nothing."""
    path = tmp_path / "stage"
    _Crumb.create(path)
    assert _Crumb.read(path) == ""
    crumb = _Crumb(path)
    crumb.write("gate, batch 1")
    crumb.write("gate, batch 2 (meanwhile reading batch 3)")
    assert _Crumb.read(path) == "gate, batch 2 (meanwhile reading batch 3)"
    raw = bytearray(path.read_bytes())
    torn = 1 + (1 - raw[0]) * _Crumb.SLOT  # the slot the next write takes, half written
    raw[torn:torn + 6] = (40).to_bytes(2, "little") + b"gate"
    path.write_bytes(bytes(raw))
    assert _Crumb.read(path) == "gate, batch 2 (meanwhile reading batch 3)"
    _Crumb(path).write("é" * _Crumb.SLOT)
    assert _Crumb.read(path) == "é" * ((_Crumb.SLOT - 2) // 2)
    assert _Crumb.read(tmp_path / "none") == ""


def test_a_started_worker_warms_then_runs_its_call_in_the_same_process(caplog: pytest.LogCaptureFixture) -> None:
    """A Worker runs its warm function in the child before the call, in the same process as the call (the call
    sees the process id the warm recorded there, which is not this one), and the warm's log records come back."""
    with caplog.at_level(logging.WARNING, logger="calibration"), Worker(warm=crash_helpers.warm_and_log) as worker:
        warmed, child = worker.run("test", crash_helpers.warmed_pids)
    assert warmed == [child] and child != os.getpid()
    assert "warming the worker" in caplog.text


def test_a_warm_that_raises_leaves_the_call_to_run_and_one_that_crashes_is_named() -> None:
    """Warming is an optimisation: a warm function that raises does not stop the call (its result comes back);
    a warm that dies of SIGSEGV makes the call raise WorkerCrashed, one line, naming the stage the worker was in."""
    with Worker(warm=crash_helpers.warm_raises) as worker:
        assert worker.run("test", crash_helpers.square_and_log, 3) == 9
    with Worker(warm=crash_helpers.warm_segfaults) as worker, pytest.raises(WorkerCrashed) as crash:
        worker.run("INT8 calibration", crash_helpers.square_and_log, 3)
    message = str(crash.value)
    assert "SIGSEGV" in message and "during warming" in message and "\n" not in message


def test_an_unused_worker_ends_at_once_even_while_warming() -> None:
    """A Worker closed without a call (an error before calibration) ends within seconds although its warm function
    would run ten minutes, and leaves no child process behind."""
    start = time.perf_counter()
    with Worker(warm=crash_helpers.warm_forever):
        time.sleep(0.5)  # the child is running its warm function by now
    assert time.perf_counter() - start < 10
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_trtc_calibrate_survives_a_native_crash_with_one_line(tmp_path: Path) -> None:
    """A loader that dies of SIGSEGV making the calibration pass's second batch: `trtc calibrate` exits 2 with one
    line naming the signal, the stage and the batch being read ahead, and writes nothing into the directory."""
    out = tmp_path / "m"
    export_directory(ExportSettings(ModelSource(factory="examples.models:mlp"), out,
                                    spec=ModelSpec((parse_input_spec("x:Bx64"),)), buckets=(1, 4)))
    before = sorted(p.name for p in out.iterdir())
    result = CliRunner().invoke(cli, ["calibrate", str(out), "--int8", "-q",
                                      "--calib-loader", "tests.crash_helpers:segfault_on_second_pass"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "SIGSEGV" in lines[0] and "INT8 calibration: histograms of" in lines[0]
    assert "meanwhile reading batch 1" in lines[0], lines[0]
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written
