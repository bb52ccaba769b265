"""`trtc inspect` on the digits CNN's INT8 build, and the one-line refusals of `trtc inspect` and `trtc diff`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner, Result

from compiler.cli import cli
from compiler.core.capabilities import tensorrt_version
from tests.compiler.diagnose.conftest import DigitsBuild


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [*map(str, args)])


def test_inspect_shows_the_builds_facts(digits_int8: DigitsBuild) -> None:
    """The screen names the source and exporter, the input with its dims and batch range, both graphs with their
    layer counts by precision equal to the calibration's own records (report/accuracy.json), the layers placement
    left out of INT8 with why, the gate's result and data, and that no engines were built."""
    directory = digits_int8.directory
    result = run("inspect", directory)
    assert result.exit_code == 0, result.output
    report = json.loads((directory / "report" / "accuracy.json").read_text())["int8"]
    counts = report["node_precisions"]["counts"]
    out = result.output
    assert "examples.models:resnet_digits" in out and "exported with" in out
    assert any(line.split()[:4] == ["in", "images", "Bx1x8x8", "float32"] and "B 1..16" in line
               for line in out.splitlines())
    assert f"{counts['int8']} INT8, {counts['fp16']} FP16" in out
    for layer, why in report["qdq"]["skipped_nodes"].items():
        assert f"int8: {layer}: not quantized: {why}" in out
    assert "accuracy gate, int8: PASS" in out and str(digits_int8.eval) in out
    assert "engines: none" in out


def test_inspect_json_and_layers(digits_int8: DigitsBuild) -> None:
    """--json --layers is one JSON document whose node counts match the records and whose layer list gives every
    Q/DQ-fed node of the INT8 graph as int8 and every compute node of the FP32 graph as fp32."""
    directory = digits_int8.directory
    result = run("inspect", directory, "--json", "--layers")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    report = json.loads((directory / "report" / "accuracy.json").read_text())["int8"]
    graph = next(g for g in facts["graphs"] if g["precision"] == "int8")
    assert graph["nodes"] == {k: v for k, v in report["node_precisions"]["counts"].items() if v}
    layers = {row["layer"]: row["precisions"] for row in facts["layers"]}
    assert {n for n, p in layers.items() if p["int8"] == "int8"} == set(report["qdq"]["quantized_nodes"])
    fp32 = onnx.load(str(directory / "model.onnx"), load_external_data=False)
    assert {n.name for n in fp32.graph.node if n.op_type == "Conv"} <= {n for n, p in layers.items()
                                                                        if p["fp32"] == "fp32"}
    assert facts["gate"]["int8"]["passed"] is True and facts["engines"] == []
    table = run("inspect", directory, "--layers")
    assert table.exit_code == 0
    assert any(line.split()[:3] == [report["qdq"]["quantized_nodes"][0], "fp32", "int8"]
               for line in table.output.splitlines())


def test_refusals_are_one_line_with_exit_2(digits_int8: DigitsBuild, tmp_path: Path) -> None:
    """A missing directory, an FP32-only export, a graph changed after the manifest, two different models, and data
    that is gone each give exit 2 and one `error:` line naming the fix; nothing is written."""
    missing = run("diff", tmp_path / "nope")
    assert missing.exit_code == 2 and missing.output.strip().startswith("error: ") and \
        len(missing.output.strip().splitlines()) == 1
    fp32 = tmp_path / "fp32"
    shutil.copytree(digits_int8.directory, fp32)
    manifest = json.loads((fp32 / "manifest.json").read_text())
    for key in ("calibration", "data", "accuracy", "fp16"):
        manifest.pop(key, None)
    manifest["onnx"] = {"fp32": manifest["onnx"]["fp32"]}
    manifest["precision"] = "fp32"
    (fp32 / "manifest.json").write_text(json.dumps(manifest))
    only = run("diff", fp32)
    assert only.exit_code == 2 and "holds only the FP32 graph" in only.output and "trtc calibrate" in only.output
    changed = tmp_path / "changed"
    shutil.copytree(digits_int8.directory, changed)
    with (changed / "model.int8.onnx").open("ab") as f:
        f.write(b"\0")
    bad = run("diff", changed)
    assert bad.exit_code == 2 and "does not match the sha256" in bad.output
    assert not (changed / "report" / "diff.json").exists()
    other = tmp_path / "other"
    shutil.copytree(digits_int8.directory, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["source"]["sha256"] = "0" * 64
    manifest["onnx"]["fp32"]["sha256"] = "1" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    two = run("diff", digits_int8.directory, other)
    assert two.exit_code == 2 and "different models" in two.output
    gone = tmp_path / "gone"
    shutil.copytree(digits_int8.directory, gone)
    report = json.loads((gone / "report" / "accuracy.json").read_text())
    for entry in report.values():
        entry["eval_data"]["source"] = entry["calibration_data"]["source"] = str(tmp_path / "moved.npz")
    (gone / "report" / "accuracy.json").write_text(json.dumps(report))
    nodata = run("diff", gone)
    assert nodata.exit_code == 2 and "pass --data" in nodata.output
    ok = run("diff", gone, "--data", digits_int8.eval, "--samples", "16", "--no-plot", "-q")
    assert ok.exit_code == 0, ok.output
    assert json.loads((gone / "report" / "diff.json").read_text())["samples"] == 16
    assert run("inspect", tmp_path / "nope").exit_code == 2


@pytest.mark.skipif(tensorrt_version() is not None, reason="TensorRT is installed: --engines runs")
def test_engines_without_tensorrt_is_one_line_exit_2(digits_int8: DigitsBuild) -> None:
    """Without TensorRT `trtc diff --engines` says so in one line and exits 2 before comparing anything."""
    result = run("diff", digits_int8.directory, "--engines")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert "TensorRT cannot run here" in result.output


def test_help_shows_examples() -> None:
    """Both commands' --help show their example blocks."""
    for command, example in (("inspect", "trtc inspect build/m --layers"), ("diff", "trtc diff build/m")):
        result = run(command, "--help")
        assert result.exit_code == 0 and example in result.output


def test_inspect_reads_engine_records_and_their_layer_reports(digits_int8: DigitsBuild, tmp_path: Path) -> None:
    """An engine recorded by a build elsewhere (TensorRT 10.12 on an H200, with a layer report in TensorRT 10's
    layout) shows its TensorRT version, GPU, size, build time and compatibility; whether it runs here is
    `trtc check`'s answer (here: no, with check's reason); its layers are counted by the type they read."""
    from compiler.core.manifest import EngineRecord, read_manifest, write_manifest
    from compiler.core.settings import BuildSettings
    from compiler.pipeline.check import check_directory

    directory = tmp_path / "m"
    shutil.copytree(digits_int8.directory, directory)
    (directory / "engines").mkdir()
    (directory / "engines" / "b1.engine").write_bytes(b"\0" * 2048)
    layer = {"Inputs": [{"Name": "x", "Format/Datatype": "Row major linear Int8"}],
             "Outputs": [{"Name": "y", "Format/Datatype": "Row major linear FP32"}]}
    half = {"Inputs": [{"Name": "y", "Format/Datatype": "Row major linear FP16 format"}], "Outputs": []}
    (directory / "engines" / "b1.layers.json").write_text(json.dumps({"Layers": [layer, layer, half]}))
    from compiler.core.files import sha256_file

    manifest = read_manifest(directory)
    engine = EngineRecord(1, "engines/b1.engine", sha256_file(directory / "engines" / "b1.engine"), bytes=2048,
                          build_seconds=3.5, layers={"file": "engines/b1.layers.json", "count": 3},
                          onnx="model.int8.onnx", onnx_sha256=manifest.onnx["int8"].sha256)
    environment = {"tensorrt": "10.12.0", "gpu": "NVIDIA H200", "compute_capability": "9.0", "platform": "linux"}
    write_manifest(directory / "manifest.json", manifest.with_engines(
        BuildSettings(buckets=(1,), precision="int8"), environment, [engine]))
    result = run("inspect", directory, "--json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)["engines"][0]
    assert (row["tensorrt"], row["gpu"], row["compute_capability"]) == ("10.12.0", "NVIDIA H200", "9.0")
    assert (row["bytes"], row["build_seconds"], row["precision"], row["hardware_compat"]) == (2048, 3.5, "int8",
                                                                                            "none")
    check = check_directory(directory)
    assert row["runs_here"] is (not check.stale)
    if check.stale:
        assert row["why_not"] == check.stale[0].reason
    assert row["layers"] == {"file": "engines/b1.layers.json", "count": 3, "by_precision": {"INT8": 2, "FP16": 1}}
    table = run("inspect", directory)
    assert table.exit_code == 0 and "2 INT8, 1 FP16" in table.output and "NVIDIA H200 (9.0)" in table.output
