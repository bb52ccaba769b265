"""`trtc export` of ONNX files takes the file's own inputs, refuses what it cannot serve in one line, and checks on
the user's example data; ``run_passes`` returns only graphs it has checked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from compiler.cli import cli
from compiler.core.errors import InputError, VerificationError
from compiler.core.manifest import read_manifest
from compiler.core.onnx_io import ort_session
from compiler.frontend.passes import DEFAULT_PASSES, run_passes, run_passes_unchecked
from tests.onnx_helpers import make_model, tensor


def export(tmp_path: Path, model: onnx.ModelProto, *args: str, command: str = "export") -> tuple[int, str, Path]:
    """``trtc COMMAND -q tmp/model.onnx ARGS --out tmp/out``: exit code, output, output directory."""
    onnx.save(model, str(tmp_path / "model.onnx"))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, [command, "-q", str(tmp_path / "model.onnx"), *args, "--out", str(out)])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output, out


def error_line(output: str) -> str:
    """The one error line of a refusal (warnings may come before it): no traceback, nothing after it."""
    lines = output.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in output, output
    assert sum(line.startswith("error: ") for line in lines) == 1, output
    return lines[-1]


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_numeric_names_rank_0_and_declared_shapes_need_no_input_option(tmp_path: Path) -> None:
    """An input named '0' (as PyTorch exports name them) and a rank-0 one, both fully declared: exported without any
    --input, the manifest lists them as the file has them, and the ONNX written computes x * s."""
    model = make_model([helper.make_node("Mul", ["0", "s"], ["y"])], [tensor("0", [2, 3]), tensor("s", [])],
                       [tensor("y", [2, 3])])
    code, output, out = export(tmp_path, model, "--buckets", "1")
    assert code == 0, output
    assert manifest(out)["inputs"] == ["0:2x3:float32", "s::float32"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = ort_session(out / "model.onnx").run(None, {"0": x, "s": np.array(2.0, np.float32)})[0]
    np.testing.assert_array_equal(got, 2 * x)


def test_a_dynamic_batch_with_fixed_other_dims_needs_no_input_option(tmp_path: Path) -> None:
    """An input declared Nx3 (a named first dimension, the others fixed): built with --buckets 1,8 and no --input,
    exit 0, the manifest reads it as x:Bx3, and the ONNX written runs a batch of 8 as Relu."""
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", ["N", 3])], [tensor("y", ["N", 3])])
    code, output, out = export(tmp_path, model, "--buckets", "1,8")
    assert code == 0, output
    assert manifest(out)["inputs"] == ["x:Bx3:float32"]
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
    np.testing.assert_array_equal(ort_session(out / "model.onnx").run(None, {"x": x})[0], np.maximum(x, 0))


def test_a_model_without_inputs_exports(tmp_path: Path) -> None:
    """A graph of constants only: nothing to feed, exit 0, a manifest that reads back with no inputs, and the ONNX
    written computes the constants."""
    value = helper.make_tensor("v", TensorProto.FLOAT, [2], [1.0, 2.0])
    model = make_model([helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Neg", ["c"], ["y"])],
                       [], [tensor("y", [2])])
    code, output, out = export(tmp_path, model, "--buckets", "1")
    assert code == 0, output
    assert read_manifest(out).inputs == ()
    np.testing.assert_array_equal(ort_session(out / "model.onnx").run(None, {})[0], [-1.0, -2.0])


def test_given_inputs_and_declared_ones_combine(tmp_path: Path) -> None:
    """--input for the input with a dynamic batch, the file's declaration for the fixed one: both are in the spec."""
    model = make_model([helper.make_node("Add", ["x", "b"], ["y"])], [tensor("x", ["N", 4]), tensor("b", [4])],
                       [tensor("y", ["N", 4])])
    code, output, out = export(tmp_path, model, "--input", "x:Bx4", "--buckets", "1,4")
    assert code == 0, output
    assert manifest(out)["inputs"] == ["x:Bx4:float32", "b:4:float32"]


def sequence_type() -> onnx.TypeProto:
    return helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2]))


def optional_type() -> onnx.TypeProto:
    return helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2]))


REFUSED = {
    "sequence": (helper.make_value_info("x", sequence_type()), "is a sequence of float tensors"),
    "optional": (helper.make_value_info("x", optional_type()), "is an optional float tensor"),
    "float64": (tensor("x", [2], TensorProto.DOUBLE), "is double, which TensorRT does not take"),
    "uint16": (tensor("x", [2], TensorProto.UINT16), "is uint16, which TensorRT does not take"),
    "zero-size": (tensor("x", [0, 2]), "has a zero-size dimension (0x2)"),
    "open shape": (tensor("x", ["N", "M"]), "has no fixed shape in the file (NxM); pass --input 'x:BxS:float32'"),
}


@pytest.mark.parametrize("kind", REFUSED)
def test_inputs_trtc_cannot_serve_are_refused_in_one_line(kind: str, tmp_path: Path) -> None:
    """Each value type trtc cannot serve (and a shape the file leaves open) is one line, exit 2, naming the input and
    why; no output directory is written."""
    info, why = REFUSED[kind]
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "t", [info],
                              [helper.make_value_info("y", info.type)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    code, output, out = export(tmp_path, model)
    assert code == 2
    assert f"error: the ONNX input 'x' {why}" in error_line(output)
    assert not (out / "model.onnx").exists()


def test_an_input_option_that_contradicts_the_file_is_refused(tmp_path: Path) -> None:
    """--input with another dtype than the file's: one line saying which dtype to write."""
    model = make_model([helper.make_node("Identity", ["x"], ["y"])], [tensor("x", [2], TensorProto.INT64)],
                       [tensor("y", [2], TensorProto.INT64)])
    code, output, _ = export(tmp_path, model, "--input", "x:2:float32")
    assert code == 2 and "the ONNX input is int64; write x:2:int64" in error_line(output)


def range_model() -> onnx.ModelProto:
    """Range(start, limit, delta) of rank-0 int64 inputs: generated values (zeros) make delta 0, which Range refuses."""
    names = ["start", "limit", "delta"]
    return make_model([helper.make_node("Range", names, ["y"])], [tensor(n, [], TensorProto.INT64) for n in names],
                      [tensor("y", ["N"], TensorProto.INT64)])


def range_data(tmp_path: Path, **arrays: np.ndarray) -> str:
    values = {"start": np.array(2, np.int64), "limit": np.array(9, np.int64), "delta": np.array(3, np.int64)}
    np.savez(tmp_path / "inputs.npz", **{**values, **arrays})
    return str(tmp_path / "inputs.npz")


def test_an_onnx_model_that_fails_on_generated_values_names_example_data(tmp_path: Path) -> None:
    """Without --example-data, ONNX Runtime cannot run the original on generated values (a delta of 0): one line,
    exit 2, naming the values and --example-data. With real inputs as --example-data the export passes, the
    manifest says whence the checks' inputs came, and the ONNX written computes the range."""
    code, output, _ = export(tmp_path, range_model())
    line = error_line(output)
    assert code == 2 and "cannot run the original model on the values trtc generated" in line
    assert "delta: zeros" in line and "--example-data FILE.npz" in line
    code, output, out = export(tmp_path, range_model(), "--example-data", range_data(tmp_path))
    assert code == 0, output
    assert manifest(out)["verification"]["inputs"] == f"--example-data {tmp_path / 'inputs.npz'}"
    feed = {"start": np.array(2, np.int64), "limit": np.array(9, np.int64), "delta": np.array(3, np.int64)}
    np.testing.assert_array_equal(ort_session(out / "model.onnx").run(None, feed)[0], [2, 5, 8])


def test_trtc_build_takes_example_data_too(tmp_path: Path) -> None:
    """`trtc build --engine none --example-data`: exit 0, the export checks ran on the file's inputs."""
    code, output, out = export(tmp_path, range_model(), "--example-data", range_data(tmp_path), "--engine", "none",
                               command="build")
    assert code == 0, output
    assert manifest(out)["verification"]["inputs"].startswith("--example-data")


@pytest.mark.parametrize(("arrays", "problem"), [
    ({"delta": None}, "no array for input 'delta'"),
    ({"delta": np.array(3.0)}, "input 'delta' is float64, the model takes int64"),
    ({"delta": np.array([3], np.int64)}, "input 'delta' has shape (1,), rank 1; the spec delta::int64 takes rank 0"),
])
def test_example_data_that_does_not_fit_is_refused_in_one_line(arrays: dict, problem: str, tmp_path: Path) -> None:
    """A missing array, another dtype or another rank in --example-data: one line, exit 2, naming the input and what
    the model takes."""
    path = range_data(tmp_path, **{k: v for k, v in arrays.items() if v is not None})
    if any(v is None for v in arrays.values()):
        with np.load(path) as npz:
            np.savez(path, **{k: npz[k] for k in npz.files if arrays.get(k, 0) is not None})
    code, output, _ = export(tmp_path, range_model(), "--example-data", path)
    assert code == 2 and problem in error_line(output)


def test_batched_example_data_feeds_each_verified_batch(tmp_path: Path) -> None:
    """For an input with the batch B, --example-data holds samples: the checks at batch 1 and 4 run on its first
    rows (repeated past the three given), as the manifest's verified batches show."""
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", ["N", 4])], [tensor("y", ["N", 4])])
    np.savez(tmp_path / "inputs.npz", x=np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32))
    code, output, out = export(tmp_path, model, "--input", "x:Bx4", "--buckets", "1,4", "--example-data",
                               str(tmp_path / "inputs.npz"))
    assert code == 0, output
    verification = manifest(out)["verification"]
    assert [c["batch"] for c in verification["passes"]] == [1, 4]
    assert verification["inputs"] == f"--example-data 3 sample(s) of {tmp_path / 'inputs.npz'}"


def test_sequence_outputs_are_checked_element_by_element(tmp_path: Path) -> None:
    """A model whose output is a sequence (SplitToSequence): the pass check compares each element, exit 0."""
    seq = helper.make_value_info("s", sequence_type())
    graph = helper.make_graph([helper.make_node("SplitToSequence", ["x"], ["s"], axis=0)], "t", [tensor("x", [2, 2])],
                              [seq])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    code, output, out = export(tmp_path, model, "--buckets", "1")
    assert code == 0, output
    assert len(manifest(out)["verification"]["passes"]) == 1


def test_run_passes_checks_its_result_and_says_so() -> None:
    """run_passes returns a graph that ONNX Runtime found to compute what the original did on the feeds; a pass that
    changes the result raises VerificationError instead of returning it; run_passes_unchecked returns that wrong
    graph, as its name says."""
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", [2, 3])], [tensor("y", [2, 3])])

    def negate(m: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
        m.graph.node[0].op_type = "Neg"
        return m, {}

    feeds = {"x": np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)}
    _, results = run_passes(onnx.ModelProto.FromString(model.SerializeToString()), feeds)
    assert [r.name for r in results] == [name for name, _ in DEFAULT_PASSES]
    with pytest.raises(VerificationError, match="pass check"):
        run_passes(onnx.ModelProto.FromString(model.SerializeToString()), feeds, passes=[("negate", negate)])
    wrong, _ = run_passes_unchecked(onnx.ModelProto.FromString(model.SerializeToString()), [("negate", negate)])
    assert wrong.graph.node[0].op_type == "Neg"


def test_run_passes_wants_feeds_where_the_model_leaves_shapes_open() -> None:
    """Without feeds, run_passes generates values for declared shapes; with an open one it asks for --input (the spec)
    or feeds, and where ONNX Runtime fails on the generated values it says to give feeds."""
    open_shape = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", ["N", "M"])],
                            [tensor("y", ["N", "M"])])
    with pytest.raises(InputError, match="no fixed shape"):
        run_passes(open_shape)
    with pytest.raises(InputError, match="give feeds that it accepts"):
        run_passes(range_model())
