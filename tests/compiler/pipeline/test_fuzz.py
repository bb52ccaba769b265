"""Fuzzed build directories: truncated or garbage artifacts give one line and a user-error exit
from every command and an InputError/ValueError from ``compiler.load``, never a traceback or a hang.

Each artifact of a real build directory (test_safety's, built once) is cut in half, has a few bytes flipped
and is replaced by random bytes of its length (seeded), and every command runs on the result. An
artifact a command reads (the ONNX and engines after their sha256, the manifest always) must make it fail
with its documented exit code; the others may succeed, but never with a traceback.
"""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

import compiler
from compiler.core.errors import InputError
from tests.compiler.pipeline.test_safety import built, other_job, trtc  # noqa: F401  (built is the module's fixture)

pytestmark = pytest.mark.slow  # every command on every damaged artifact: minutes on two cores

ARTIFACTS = ("manifest.json", "calibration.json", "model.onnx", "model.onnx.data", "model.int8.onnx",
             "engines/b1.engine", "engines/b1.layers.json", "source/state_dict.pt", "report/accuracy.json",
             "timing.cache")
MUTATIONS = ("half", "flip", "garbage")  # truncated, a few bytes changed, not the file at all
BENCH = ("--backends", "onnxruntime", "-n", "1", "--min-seconds", "0", "--warmup", "0", "--warmup-seconds",
         "0", "--no-plot")

# the exit code a command must give when this artifact is damaged (flipped bytes of a JSON file may leave it valid
# JSON, so those are held only to "no traceback"); every other pair just must not crash
MUST_FAIL = {
    "manifest.json": {"check": 2, "rebuild": 2, "merge": 2, "bench": 2, "export-triton": 2, "calibrate": 2},
    "calibration.json": {"calibrate": 2},
    "model.onnx": {"bench": 2, "calibrate": 2},
    "model.onnx.data": {"bench": 2, "calibrate": 2},
    "model.int8.onnx": {"rebuild": 2, "bench": 2, "export-triton": 2},
    "engines/b1.engine": {"check": 1, "merge": 2},
}
LOAD_MUST_FAIL = {"manifest.json": {"onnxruntime", "torch"}, "model.int8.onnx": {"onnxruntime"},
                  "source/state_dict.pt": {"torch"}}


def mutate(path: Path, how: str, seed: int) -> None:
    data = path.read_bytes()
    rng = np.random.default_rng(seed)
    if how == "empty":
        data = b""
    elif how == "half":
        data = data[: len(data) // 2]
    elif how == "flip":
        buf = bytearray(data)
        for i in rng.integers(0, len(buf), size=3):
            buf[i] ^= int(rng.integers(1, 256))
        data = bytes(buf)
    else:
        data = rng.integers(0, 256, size=max(len(data), 16), dtype=np.uint8).tobytes()
    path.write_bytes(data)


def commands(directory: Path, job: Path, work: Path) -> dict[str, list[str]]:
    return {"check": ["check", str(directory)],
            "rebuild": ["rebuild", str(directory)],
            "merge": ["merge", str(directory), str(job)],
            "bench": ["bench", str(directory), *BENCH],
            "export-triton": ["export-triton", str(directory), "--repo", str(work / "repo"), "--force"],
            "calibrate": ["calibrate", str(directory), "--int8", "--calib-data", "random", "--calib-samples", "16"]}


@pytest.mark.parametrize("artifact", ARTIFACTS)
def test_every_command_survives_a_damaged_artifact(built: Path, tmp_path: Path, artifact: str) -> None:  # noqa: F811
    job = other_job(built, tmp_path)
    for how in MUTATIONS:
        seed = zlib.crc32(f"{artifact}:{how}".encode())
        for name in (*commands(built, job, tmp_path), "load-onnxruntime", "load-torch"):
            directory = tmp_path / f"{how}-{name}"
            shutil.copytree(built, directory)
            mutate(directory / artifact, how, seed)
            where = f"{artifact} {how} {name}"
            if name.startswith("load-"):
                backend = name.removeprefix("load-")
                try:
                    with compiler.load(directory, backend=backend, device="cpu") as engines:
                        engines(np.zeros((1, 16), np.float32))
                except (InputError, ValueError):
                    continue
                tolerated = how == "flip" and artifact == "manifest.json"
                assert tolerated or backend not in LOAD_MUST_FAIL.get(artifact, set()), f"{where}: loaded"
                continue
            result = trtc(*commands(directory, job, tmp_path)[name])
            assert isinstance(result.exception, (SystemExit, type(None))), f"{where}: {result.exception!r}"
            assert "Traceback" not in result.output, where
            if result.exit_code not in (0, 1):
                errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
                assert len(errors) == 1, f"{where}: {result.stderr}"
            expected = MUST_FAIL.get(artifact, {}).get(name)
            if expected is not None and not (how == "flip" and artifact.endswith(".json")):
                assert result.exit_code == expected, f"{where}: exit {result.exit_code}: {result.output}"


@pytest.mark.parametrize("how", ("empty", *MUTATIONS))
def test_damaged_data_and_profiles_are_one_line_errors(built: Path, tmp_path: Path, how: str) -> None:  # noqa: F811
    data = tmp_path / "x.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32))
    mutate(data, how, zlib.crc32(how.encode()))
    directory = tmp_path / "m"
    shutil.copytree(built, directory)
    profile = tmp_path / "p.toml"
    profile.write_text(f'[model]\nfactory = "tests.compiler.pipeline.test_safety:random_mlp"\ninputs = ["x:Bx16"]\n'
                       f'[build]\nout = "{tmp_path / "p"}"\nbuckets = [1]\nengine = "none"\n')
    mutate(profile, how, zlib.crc32(how.encode()))
    for args in (["bench", str(directory), "--data", str(data), *BENCH],
                 ["calibrate", str(directory), "--int8", "--calib-data", str(data)],
                 ["rebuild", "--profile", str(profile)]):
        result = trtc(*args)
        assert isinstance(result.exception, (SystemExit, type(None))), f"{args[0]} {how}: {result.exception!r}"
        assert "Traceback" not in result.output
        if args[0] != "rebuild" or how != "flip":  # three flipped bytes may leave a valid profile
            assert result.exit_code == 2, f"{args[0]} {how}: {result.output}"
            errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1, result.stderr


# keys commands read, each set to values of the wrong type: a hand-edited or damaged manifest that is still JSON
KEY_PATHS = (("inputs",), ("inputs", 0), ("dims",), ("output_names",), ("output_names", 0), ("buckets",),
             ("precision",), ("source",), ("source", "snapshot"), ("source", "snapshot", "file"), ("onnx",),
             ("onnx", "int8"), ("onnx", "int8", "files"), ("build",), ("build", "buckets"), ("engines",),
             ("engines", 0), ("engines", 0, "file"), ("engines", 0, "profile"), ("engines", 0, "shapes"),
             ("engines", 0, "layers"), ("environment",))
WRONG = (None, 7, "x", [])


@pytest.mark.parametrize("key", KEY_PATHS, ids=lambda k: ".".join(map(str, k)))
def test_a_manifest_with_a_wrong_type_is_one_line(built: Path, tmp_path: Path, key: tuple[str | int, ...],  # noqa: F811
                                                   ) -> None:
    import json

    base = json.loads((built / "manifest.json").read_text())
    for value in WRONG:
        manifest = json.loads(json.dumps(base))
        parent = manifest
        for part in key[:-1]:
            parent = parent[part]
        parent[key[-1]] = value
        directory = tmp_path / f"v{WRONG.index(value)}"
        shutil.copytree(built, directory)
        (directory / "manifest.json").write_text(json.dumps(manifest))
        for args in (["check", str(directory)], ["export-triton", str(directory), "--repo", str(tmp_path / "repo"),
                                                 "--force"]):
            result = trtc(*args)
            where = f"{'.'.join(map(str, key))}={value!r} {args[0]}"
            assert isinstance(result.exception, (SystemExit, type(None))), f"{where}: {result.exception!r}"
            if result.exit_code not in (0, 1):
                errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
                assert len(errors) == 1, f"{where}: {result.stderr}"
        for backend in ("onnxruntime", "torch"):
            try:
                with compiler.load(directory, backend=backend, device="cpu") as engines:
                    engines(np.zeros((1, 16), np.float32))
            except (InputError, ValueError):
                pass
