"""compiler.load and the backends behind it on the CPU: choosing a backend, the fallback without TensorRT, what a
directory must hold, the TF32 policy."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import compiler
from compiler.backends.tensorrt.runtime import EnginesNotRunnable
from compiler.core.capabilities import tensorrt_version
from compiler.core.errors import InputError, TensorRTNotInstalled
from compiler.serve.load import load
from tests.builds import build_directory
from tests.manifests import write_manifest_json
from tests.project import ROOT

# --- backends and loading -----------------------------------------------------------------------------------------

def test_auto_backend_falls_back_to_onnx_runtime_and_says_so_once(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    if tensorrt_version() is not None:
        pytest.skip("TensorRT is installed here: auto picks it")
    directory = build_directory(tmp_path / "m", "mlp")
    with caplog.at_level(logging.INFO, logger="compiler.serve.engines"):
        for _ in range(2):
            with load(directory) as engines:
                assert engines.backend == "onnxruntime"
                engines(np.zeros((1, 64), np.float32))
    notes = [r for r in caplog.records if "TensorRT is not installed" in r.getMessage()]
    assert len(notes) == 1 and "ONNX Runtime" in notes[0].getMessage()


def _with_engines(tmp_path: Path) -> Path:
    directory = build_directory(tmp_path / "m", "mlp", buckets=[1, 4])
    (directory / "engines").mkdir()
    (directory / "engines" / "b1.engine").write_bytes(b"not an engine")
    engines = [{"bucket": b, "file": f"engines/b{b}.engine", "sha256": "0" * 64,
                "shapes": {"x": {"min": [b, 64], "opt": [b, 64], "max": [b, 64]}}} for b in (1, 4)]
    data = json.loads((directory / "manifest.json").read_text())
    data.update(engines=engines, environment={"tensorrt": "10.13.0.35", "compute_capability": "9.0"})
    write_manifest_json(directory / "manifest.json", data)
    return directory


def test_tensorrt_backend_without_tensorrt_names_the_fix(tmp_path: Path) -> None:
    if tensorrt_version() is not None:
        pytest.skip("TensorRT is installed here")
    directory = _with_engines(tmp_path)
    with pytest.raises(TensorRTNotInstalled, match="TensorRT is not installed") as err:
        load(directory, backend="tensorrt")
    assert f"trtc rebuild {directory}" in str(err.value)


def test_stale_or_missing_engines_name_trtc_rebuild(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the installation check passed, the `trtc check` rules decide: here the files do not match."""
    import compiler.backends.tensorrt.runtime

    directory = _with_engines(tmp_path)
    monkeypatch.setattr(compiler.backends.tensorrt.runtime, "require_tensorrt", lambda directory=None: "10.13.0.35")
    with pytest.raises(EnginesNotRunnable) as err:
        load(directory, backend="tensorrt")
    message = str(err.value)
    assert f"trtc rebuild {directory}" in message
    assert "bucket 4 (engines/b4.engine): engine file missing" in message
    assert "bucket 1 (engines/b1.engine): engine file differs" in message
    bare = build_directory(tmp_path / "bare", "mlp", engines=[], engines_note="not built: TensorRT is not installed")
    with pytest.raises(EnginesNotRunnable, match=r"no TensorRT engines .*`trtc rebuild"):
        load(bare, backend="tensorrt")


def test_bad_arguments(dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InputError, match="backend='tensorflow'"):
        load(dirs["mlp"], backend="tensorflow")
    with pytest.raises(InputError, match=r"no manifest\.json"):
        load(tmp_path)
    with pytest.raises(InputError, match="contexts=0"):
        load(dirs["mlp"], backend="onnxruntime", contexts=0)


class _Held:
    """An object the collector tracks, to find in (or miss from) ``gc.get_objects()``."""


def _tracked(thing: object) -> bool:
    return any(o is thing for o in gc.get_objects())


def test_load_freezes_what_is_alive_before_it_unless_told_not_to(dirs: dict[str, Path]) -> None:
    """``load`` moves an object alive before it out of the collector's generations (frozen: ``gc.get_objects``,
    which lists the generations a full collection walks, no longer holds it) while the engines it made stay in
    them and still answer; with ``freeze_gc=False`` an object alive before the load stays tracked."""
    gc.unfreeze()
    before = _Held()
    try:
        with load(dirs["mlp"], backend="onnxruntime", device="cpu") as engines:
            assert not _tracked(before) and gc.get_freeze_count() > 0
            assert _tracked(engines)
            assert engines(np.zeros((2, 64), np.float32)).shape[0] == 2
        gc.unfreeze()
        after = _Held()
        with load(dirs["mlp"], backend="onnxruntime", device="cpu", freeze_gc=False):
            assert _tracked(after) and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_compiler_load_is_reexported_lazily() -> None:
    assert compiler.load is load
    code = ("import sys, compiler; assert 'compiler.serve.engines' not in sys.modules; "
            "assert 'torch' not in sys.modules and 'onnxruntime' not in sys.modules; print(compiler.__all__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "load" in done.stdout


def test_onnxruntime_launcher_handoffs_run_in_order_and_hand_each_set_its_own_error() -> None:
    """The launcher thread of an ONNX Runtime CUDA context without graphs (``_Handoff``, one per buffer set, one
    thread shared): jobs run in the order handed; a set's error reaches its own ``wait`` only and the set serves
    again; ``settle`` waits for a job whose caller is gone and drops its error; once the thread takes no new work
    (the interpreter shutting down) a job runs on the caller's thread."""
    from concurrent.futures import ThreadPoolExecutor

    from compiler.backends.onnxrt import _Handoff

    launcher = ThreadPoolExecutor(1)
    first, second = _Handoff(launcher), _Handoff(launcher)
    gate = threading.Event()
    ran: list[tuple[str, str]] = []

    def job(name: str, fail: bool = False) -> Callable[[], None]:
        def run() -> None:
            if name == "a":
                assert gate.wait(10)
            ran.append((name, threading.current_thread().name))
            if fail:
                raise RuntimeError(f"{name} failed")
        return run

    first.give(job("a"))
    second.give(job("b", fail=True))
    assert not first.done() and not second.done()
    gate.set()
    with pytest.raises(RuntimeError, match="b failed"):
        second.wait()
    first.wait()
    assert [name for name, _ in ran] == ["a", "b"] and first.done() and second.done()
    second.give(job("c"))
    second.wait()  # the error was b's, given once
    first.give(job("d", fail=True))
    first.settle()  # nobody waits for d: its error is dropped
    first.wait()
    assert first.done() and [name for name, _ in ran][-2:] == ["c", "d"]
    first.give(job("x", fail=True))  # failed, and never waited for
    launcher.shutdown(wait=True)
    first.give(job("e"))
    assert ran[-1] == ("e", threading.current_thread().name) and first.done()
    first.wait()  # e ran on this thread: x's error is not e's
