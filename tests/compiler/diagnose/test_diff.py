"""`trtc diff` on the digits CNN's INT8 build: the layer a test breaks (one activation scale coarsened) ranks
first, the numbers are those of separate ONNX Runtime runs, and slicing changes none of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from calibration.fp16_rounding import fp16_rounding_emulation
from calibration.sensitivity import layer_errors
from compiler.cli import cli
from compiler.core.manifest import read_manifest
from compiler.core.onnx_io import load_onnx, ort_session
from compiler.diagnose.diff import compare_graphs
from tests.compiler.diagnose.conftest import DigitsBuild
from tests.compiler.diagnose.helpers import coarsen_activation_scale, single_consumer_layers

CONVS = ("Conv",)


def diff(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, ["diff", "-q", *map(str, args)])


def broken(directory: Path) -> str:
    """Break the second quantized Conv whose activation Q/DQ feeds it alone; its node name."""
    layer = single_consumer_layers(directory / "model.int8.onnx", CONVS)[1]
    coarsen_activation_scale(directory, layer)
    return layer


def test_the_broken_layer_is_first_and_worst_and_the_jump(digits_copy: Path) -> None:
    """After one activation scale is coarsened 24x, diff.json lists that Conv first by isolated error, above every
    other layer, marks it as the jump of the accumulated error, and the printed table's first row names it; in the
    intact build the same layer's isolated error is several times smaller."""
    intact = diff(digits_copy, "--no-plot")
    assert intact.exit_code == 0, intact.output
    before = json.loads((digits_copy / "report" / "diff.json").read_text())
    layer = broken(digits_copy)
    result = diff(digits_copy, "--no-plot")
    assert result.exit_code == 0, result.output
    report = json.loads((digits_copy / "report" / "diff.json").read_text())
    rows = report["layers"]
    assert rows[0]["layer"] == layer and rows[0]["op_type"] == "Conv" and rows[0]["precision"] == "int8"
    assert all(r["isolated"]["relative"] < rows[0]["isolated"]["relative"] for r in rows[1:])
    assert report["jump"] == layer
    old = next(r for r in before["layers"] if r["layer"] == layer)
    assert rows[0]["isolated"]["relative"] > 4 * old["isolated"]["relative"]
    table = result.output.splitlines()
    first = next(i for i, line in enumerate(table) if line.split()[:1] == ["#"])
    assert table[first + 1].split()[:2] == ["1", layer]
    assert report["data"].startswith("the build's evaluation data") and report["samples"] == 256


def test_the_gates_own_ranking_agrees(digits_copy: Path, digits_int8: DigitsBuild) -> None:
    """calibration.sensitivity.layer_errors (the gate's ranking, candidate-side twins) puts the same broken layer
    first as diff's isolated error (reference-side copies) does."""
    layer = broken(digits_copy)
    assert diff(digits_copy, "--no-plot").exit_code == 0
    report = json.loads((digits_copy / "report" / "diff.json").read_text())
    manifest = read_manifest(digits_copy)
    candidate = load_onnx(manifest.onnx_for(digits_copy, "int8"))
    reference = load_onnx(manifest.onnx_for(digits_copy, "fp32"))
    with np.load(digits_int8.eval) as data:
        batch = {"images": data["images"][:64]}
    errors = layer_errors(fp16_rounding_emulation(candidate), reference, [r["layer"] for r in report["layers"]],
                          [batch])
    assert max(errors, key=errors.__getitem__) == layer == report["layers"][0]["layer"]


def test_output_errors_match_separate_onnx_runtime_runs(digits_copy: Path, digits_int8: DigitsBuild) -> None:
    """The output row of diff.json (cosine, relative error, max abs over 256 samples) equals what the FP32 graph
    and the INT8 graph give in two separate ONNX Runtime sessions (Q/DQ exact, FP16 rest emulated as the gate does)."""
    broken(digits_copy)
    assert diff(digits_copy, "--no-plot").exit_code == 0
    report = json.loads((digits_copy / "report" / "diff.json").read_text())
    manifest = read_manifest(digits_copy)
    with np.load(digits_int8.eval) as data:
        images = data["images"][:256]
    want = ort_session(manifest.onnx_for(digits_copy, "fp32")).run(None, {"images": images})[0].astype(np.float64)
    emulated = fp16_rounding_emulation(load_onnx(manifest.onnx_for(digits_copy, "int8")))
    got = ort_session(emulated).run(None, {"images": images})[0].astype(np.float64)
    out = report["outputs"][manifest.output_names[0]]
    assert out["relative"] == pytest.approx(np.linalg.norm(got - want) / np.linalg.norm(want), rel=1e-3)
    assert out["max_abs"] == pytest.approx(np.abs(got - want).max(), rel=1e-3)
    cosine = (got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want)
    assert out["cosine"] == pytest.approx(cosine, abs=1e-5)


def test_slices_of_one_sample_give_the_same_numbers(digits_copy: Path, digits_int8: DigitsBuild) -> None:
    """With a budget of one byte every batch runs one sample at a time; every layer's sums match the run of whole
    batches (float32 sums inside the graph, so to 1e-4)."""
    manifest = read_manifest(digits_copy)
    with np.load(digits_int8.eval) as data:
        batches = [{"images": data["images"][:16]}, {"images": data["images"][16:40]}]
    paths = manifest.onnx_for(digits_copy, "fp32"), manifest.onnx_for(digits_copy, "int8")
    _, whole, samples, _ = compare_graphs(*paths, batches, ["CPUExecutionProvider"])
    _, sliced, sliced_samples, _ = compare_graphs(*paths, batches, ["CPUExecutionProvider"], budget_bytes=1)
    assert samples == sliced_samples == 40
    for key, sums in whole.items():
        for stat, value in sums.items():
            assert sliced[key][stat] == pytest.approx(value, rel=1e-4, abs=1e-6), (key, stat)


def test_two_builds_a_build_against_itself_is_exact_and_against_a_broken_copy_ranks_the_break(
        digits_copy: Path, tmp_path: Path) -> None:
    """`trtc diff A A` gives relative error 0 and cosine 1 at every layer and output; `trtc diff A B` with B the
    broken copy ranks B's broken layer first and writes A's report/diff.json."""
    same = diff(digits_copy, digits_copy, "--no-plot")
    assert same.exit_code == 0, same.output
    report = json.loads((digits_copy / "report" / "diff.json").read_text())
    assert report["layers"] and all(r["accumulated"]["relative"] == 0 and r["isolated"]["relative"] == 0
                                    for r in report["layers"])
    assert all(o["relative"] == 0 and o["cosine"] == pytest.approx(1) for o in report["outputs"].values())
    other = tmp_path / "b"
    shutil.copytree(digits_copy, other)
    layer = broken(other)
    result = diff(digits_copy, other, "--no-plot")
    assert result.exit_code == 0, result.output
    report = json.loads((digits_copy / "report" / "diff.json").read_text())
    assert report["layers"][0]["layer"] == layer
    assert report["reference"]["precision"] == report["candidate"]["precision"] == "int8"


def test_sort_accumulated_and_top(digits_copy: Path) -> None:
    """--sort accumulated orders diff.json by accumulated relative error, worst first; --top 3 prints three rows."""
    result = diff(digits_copy, "--sort", "accumulated", "--top", "3", "--no-plot")
    assert result.exit_code == 0, result.output
    rows = json.loads((digits_copy / "report" / "diff.json").read_text())["layers"]
    errors = [r["accumulated"]["relative"] for r in rows]
    assert errors == sorted(errors, reverse=True)
    lines = result.output.splitlines()
    first = next(i for i, line in enumerate(lines) if line.split()[:1] == ["#"])
    assert [line.split()[0] for line in lines[first + 1:first + 4]] == ["1", "2", "3"]
    assert not lines[first + 4].split()[0].isdigit()


def test_plot_is_a_png_and_without_matplotlib_a_note(digits_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With matplotlib diff.png is a PNG file; without it (its import fails) there is none, the output says why in
    one line, and diff.json records the note."""
    assert diff(digits_copy).exit_code == 0
    assert (digits_copy / "report" / "diff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (digits_copy / "report" / "diff.png").unlink()
    modules = __import__("sys").modules
    for name in [m for m in modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(modules, name, None)  # every import of matplotlib fails
    result = diff(digits_copy)
    assert result.exit_code == 0, result.output
    assert not (digits_copy / "report" / "diff.png").exists()
    assert "matplotlib is not installed: no diff.png (pip install 'trtc[plot]')" in result.output
    report = json.loads((digits_copy / "report" / "diff.json").read_text())
    assert report["plot"]["file"] is None and "matplotlib" in report["plot"]["note"]


def test_fp16_graph_layers_are_fp16_and_its_output_matches_onnx_runtime(digits_copy: Path,
                                                                         digits_int8: DigitsBuild) -> None:
    """After `trtc calibrate --fp16`, `trtc diff --precision fp16` lists the Convs as fp16 layers whose isolated
    relative error is at FP16's rounding level (under 1e-2), and its output row equals a separate ONNX Runtime run
    of the FP16 graph under the gate's FP16 emulation."""
    calibrated = CliRunner().invoke(cli, ["calibrate", str(digits_copy), "-q", "--fp16", "--calib-data",
                                          str(digits_int8.calib), "--eval-data", str(digits_int8.eval)])
    assert calibrated.exit_code == 0, calibrated.output
    result = diff(digits_copy, "--precision", "fp16", "--no-plot")
    assert result.exit_code == 0, result.output
    report = json.loads((digits_copy / "report" / "diff.json").read_text())
    convs = [r for r in report["layers"] if r["op_type"] == "Conv"]
    assert convs and all(r["precision"] == "fp16" and r["isolated"]["relative"] < 1e-2 for r in convs)
    manifest = read_manifest(digits_copy)
    with np.load(digits_int8.eval) as data:
        images = data["images"][:256]
    want = ort_session(manifest.onnx_for(digits_copy, "fp32")).run(None, {"images": images})[0].astype(np.float64)
    emulated = fp16_rounding_emulation(load_onnx(manifest.onnx_for(digits_copy, "fp16")))
    got = ort_session(emulated).run(None, {"images": images})[0].astype(np.float64)
    relative = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert report["outputs"][manifest.output_names[0]]["relative"] == pytest.approx(relative, rel=1e-3)
