"""Progress in CI logs: one line per stage with its time, and a line every INTERVAL_S in loops."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core import progress as progress_module
from compiler.core.progress import progress, stage_timer


@pytest.fixture
def log_lines(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(progress_module, "is_terminal", lambda: False)
    monkeypatch.setattr(progress_module, "INTERVAL_S", 0.0)
    caplog.set_level(logging.INFO, logger="compiler.core.progress")
    return caplog


def test_loops_and_stages_log_lines_off_a_terminal(log_lines: pytest.LogCaptureFixture) -> None:
    with stage_timer("calibration"), progress("calibrating 3 tensors", 4) as advance:
        for _ in range(4):
            advance(1)
    lines = [r.getMessage() for r in log_lines.records]
    assert lines[:3] == [f"calibrating 3 tensors: {n}/4 samples ({25 * n}%), 0 s" for n in (1, 2, 3)]
    assert lines[3].startswith("calibrating 3 tensors: 4/4 samples in ") and lines[3].endswith(" s")
    assert lines[4].startswith("calibration: ") and lines[4].endswith(" s") and len(lines) == 5


def test_a_failed_stage_says_so(log_lines: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError), stage_timer("export"):
        raise ValueError("boom")
    assert log_lines.records[-1].getMessage().startswith("export: failed after ")


def test_quiet_loops_log_nothing(log_lines: pytest.LogCaptureFixture) -> None:
    logging.getLogger("compiler.core.progress").setLevel(logging.WARNING)
    try:
        with progress("ranking layers", 3, unit="layers") as advance:
            advance(3)
    finally:
        logging.getLogger("compiler.core.progress").setLevel(logging.NOTSET)
    assert not log_lines.records


@pytest.mark.slow
def test_a_build_logs_every_stage_with_its_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(progress_module, "is_terminal", lambda: False)
    monkeypatch.setattr(progress_module, "INTERVAL_S", 0.0)
    monkeypatch.setenv("TRTC_IN_PROCESS", "1")  # the patched interval lives in this process, not in a worker
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32))
    result = CliRunner().invoke(cli, ["build", "--model-factory", "examples.models:mlp", "--input", "x:Bx64", "--int8",
                                      "--calib-data", str(tmp_path / "calib.npz"), "--calib-batch", "16",
                                      "--buckets", "1,4", "--engine", "none", "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps long lines in a log
    for stage in ("export:", "export check:", "graph passes:", "pass check:", "INT8 calibration:"):
        assert stage in text, (stage, result.output)
    assert "16/48 samples (33%)" in text and "48/48 samples in" in text, result.output


def test_a_record_holds_each_outermost_stage_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside recording_stages, outermost stages are recorded in order (a repeated one adds up), an inner stage counts
    in its outer one only, the 'before' stage holds the process's seconds until the record began, and the record's
    stages plus what no stage holds make its process seconds."""
    import time

    monkeypatch.setattr(progress_module, "process_seconds", lambda: 5.0)
    with progress_module.recording_stages(before="start") as times:
        with stage_timer("a"), stage_timer("inner"):
            time.sleep(0.02)
        with stage_timer("b"):
            pass
        with stage_timer("a"):
            time.sleep(0.02)
        with progress_module.recording_stages() as same:  # a library call inside a command: the same record
            assert same is times
    record = times.to_dict()
    assert list(record["stages"]) == ["start", "a", "b"]
    assert record["stages"]["start"] == 5.0 and record["stages"]["a"] >= 0.04
    assert abs(sum(record["stages"].values()) + record["unaccounted_seconds"] - record["process_seconds"]) < 0.02
    with stage_timer("outside"):  # no record open: nothing is kept
        pass
    assert "outside" not in times.stages


def test_process_seconds_counts_from_the_process_start() -> None:
    """process_seconds is positive and at least the time since this test began."""
    import time

    start = time.perf_counter()
    seconds = progress_module.process_seconds()
    assert seconds >= time.perf_counter() - start and seconds > 0
