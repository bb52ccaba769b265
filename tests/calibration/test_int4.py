"""INT4 weight-only graphs: block-wise INT4 weights behind DequantizeLinear(block_size), which layers get them, AWQ
against round-to-nearest on real rows, and ``trtc calibrate --int4-weights`` end to end. Models run in ONNX Runtime
and are compared with FP32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from calibration.int4 import Int4Policy, awq_scales, int4_layers, int4_model_from
from calibration.observe import ChannelSamples
from calibration.weights import int4_weight
from compiler.cli import cli
from compiler.core.onnx_io import graph_holds, ort_session, session_rules
from tests.onnx_helpers import make_model, tensor

RNG = np.random.default_rng(0)


def test_int4_blocks_are_symmetric_and_onnxruntime_dequantizes_them_as_written() -> None:
    """Each block of 64 weights along the reduction axis gets scale amax/7 and values in [-8, 7]; ONNX Runtime's
    DequantizeLinear(axis=0, block_size=64) of the stored INT4 tensor gives q * scale exactly, and the round trip
    stays within half a step of every weight."""
    w = RNG.standard_normal((256, 48)).astype(np.float32)
    q, scale = int4_weight(w, 0, 64)
    assert q.shape == w.shape and scale.shape == (4, 48)
    values = q.astype(np.int8)
    assert values.min() >= -8 and values.max() <= 7
    np.testing.assert_allclose(scale, np.abs(w.reshape(4, 64, 48)).max(1) / 7, rtol=1e-6)
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=0, block_size=64)
    model = make_model([node], [], [tensor("w", [256, 48])], {"q": q, "s": scale}, opset=21)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    want = values.astype(np.float32) * np.repeat(scale, 64, axis=0)
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - w).max() <= np.repeat(scale, 64, axis=0).max() / 2 + 1e-6


def _linear_model() -> onnx.ModelProto:
    """x [B,64] -> MatMul(64x128) -> Relu -> Gemm(transB, 128->64) -> Relu -> MatMul(64x10) head -> y."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"),
             helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
             helper.make_node("Gemm", ["r1", "w2", "b2"], ["h2"], name="fc2", transB=1),
             helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
             helper.make_node("MatMul", ["r2", "w3"], ["y"], name="head")]
    init = {"w1": RNG.standard_normal((64, 128)).astype(np.float32) * 0.1,
            "w2": RNG.standard_normal((64, 128)).astype(np.float32) * 0.1,
            "b2": RNG.standard_normal(64).astype(np.float32) * 0.1,
            "w3": RNG.standard_normal((64, 10)).astype(np.float32) * 0.1}
    return make_model(nodes, [tensor("x", ["B", 64])], [tensor("y", ["B", 10])], init, opset=20)


def test_int4_model_puts_the_linear_layers_in_int4_and_runs_as_its_weights_say() -> None:
    """MatMul and Gemm(transB) get INT4 weights blocked along their reduction axis (opset raised to 21), the head
    keeps its weight; ONNX Runtime runs the graph exactly as the FP32 graph with the dequantized weights, the
    session policy keeps MatMulNBits (which changes results) out, and the report counts 8x fewer weight bytes."""
    model = _linear_model()
    quantized, report = int4_model_from(model, Int4Policy(block=32))
    assert report.quantized_nodes == ["fc1", "fc2"] and "output layer" in report.skipped_nodes["head"]
    assert next(o.version for o in quantized.opset_import if o.domain == "") == 21
    dqs = {n.output[0]: n for n in quantized.graph.node if n.op_type == "DequantizeLinear"}
    attrs = {name: {a.name: a.i for a in n.attribute} for name, n in dqs.items()}
    assert sorted((a["axis"], a["block_size"]) for a in attrs.values()) == [(0, 32), (1, 32)]
    inits = {t.name: t for t in quantized.graph.initializer}
    assert {inits[n.input[0]].data_type for n in dqs.values()} == {TensorProto.INT4}
    assert "w1" not in inits and "w3" in inits
    assert graph_holds(quantized) == {"qdq", "int4"} and session_rules(quantized)
    x = RNG.standard_normal((8, 64)).astype(np.float32)
    got = ort_session(quantized).run(None, {"x": x})[0]
    q1, s1 = int4_weight(onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w1")), 0, 32)
    w1 = q1.astype(np.float32) * np.repeat(s1, 32, axis=0)
    q2, s2 = int4_weight(onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w2")), 1, 32)
    w2 = q2.astype(np.float32) * np.repeat(s2, 32, axis=1)
    init = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    want = np.maximum(np.maximum(x @ w1, 0) @ w2.T + init["b2"], 0) @ init["w3"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert report.fp32_weight_bytes == 2 * 64 * 128 * 4 and report.int4_weight_bytes < report.fp32_weight_bytes / 7


def test_awq_scales_lower_the_layer_error_on_outlier_channels_against_round_to_nearest() -> None:
    """On a layer whose input has a few channels 30x larger than the rest (as real transformer activations do),
    AWQ's searched scales and clips give a smaller output error than round-to-nearest on held-out rows, and the
    graph it writes (one Mul of 1/s before the layer) computes exactly x / s @ Q(s W)."""
    k, n = 128, 64
    big = np.ones(k, np.float32)
    big[[3, 40, 77]] = 30.0
    calib = RNG.standard_normal((512, k)).astype(np.float32) * big
    held = RNG.standard_normal((512, k)).astype(np.float32) * big
    w = RNG.standard_normal((k, n)).astype(np.float32) * 0.1
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
                        helper.make_node("Relu", ["h"], ["y"], name="relu")],
                       [tensor("x", ["B", k])], [tensor("y", ["B", n])], {"w": w}, opset=21)
    layers, _ = int4_layers(model, Int4Policy(block=128))
    samples = {"x": ChannelSamples(np.abs(calib).mean(0), calib, len(calib))}
    found = awq_scales(model, layers, samples, 128)
    assert found.alpha["fc"] > 0

    def error(quantized: onnx.ModelProto) -> float:
        graph = make_model(list(quantized.graph.node), [tensor("x", ["B", k])], [tensor("h", ["B", n])],
                           {t.name: onnx.numpy_helper.to_array(t) for t in quantized.graph.initializer}, opset=21)
        return float(np.square(ort_session(graph).run(None, {"x": held})[0] - held @ w).sum())

    rtn, _ = int4_model_from(model, Int4Policy(block=128, method="rtn"))
    awq, report = int4_model_from(model, Int4Policy(block=128), found)
    assert [n.op_type for n in awq.graph.node].count("Mul") == 1 and report.awq_alpha["fc"] == found.alpha["fc"]
    assert error(awq) < 0.8 * error(rtn)


@pytest.fixture(scope="module")
def transformer_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from compiler.core.settings import ExportSettings, ModelSource
    from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
    from compiler.pipeline.export import export_directory

    tmp = tmp_path_factory.mktemp("int4")
    for name, seed in (("calib", 1), ("eval", 2)):
        rng = np.random.default_rng(seed)
        mask = np.ones((32, 16), np.int64)
        mask[::3, 10:] = 0
        np.savez(tmp / f"{name}.npz", input_ids=rng.integers(0, 1000, (32, 16)), attention_mask=mask)
    spec = ModelSpec((parse_input_spec("input_ids:BxS:int64[0,1000)"), parse_input_spec("attention_mask:BxS:int64")),
                     dict([parse_dim_range("S=1:16:64")]))
    export_directory(ExportSettings(ModelSource(factory="examples.models:transformer_encoder"), tmp / "fp32",
                                    spec=spec, buckets=(1, 8)))
    return tmp


def test_calibrate_int4_writes_a_smaller_gated_graph_that_runs_as_unoptimized(transformer_export: Path,
                                                                             tmp_path: Path) -> None:
    """``trtc calibrate --int4-weights`` at its defaults on a transformer: exit 0, model.int4.onnx holding INT4
    weights with an FP16 rest, smaller than the FP32 graph (sizes in the manifest); the graph in ``ort_session``
    gives the outputs of the same graph with every optimization off, within cosine 0.99 of FP32 on held-out data."""
    directory = tmp_path / "m"
    shutil.copytree(transformer_export / "fp32", directory)
    result = CliRunner().invoke(cli, ["calibrate", str(directory), "--int4-weights", "--calib-data",
                                      str(transformer_export / "calib.npz"), "--eval-data",
                                      str(transformer_export / "eval.npz")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((directory / "manifest.json").read_text())
    entry = manifest["int4"]
    assert manifest["precision"] == "int4" and entry["method"] == "awq" and entry["layers"] > 0
    assert entry["bytes"] == manifest["onnx"]["int4"]["bytes"] < entry["fp32_bytes"]
    path = directory / "model.int4.onnx"
    assert graph_holds(onnx.load(str(path), load_external_data=False)) == {"qdq", "int4", "fp16"}  # FP16 rest
    feed = dict(np.load(transformer_export / "eval.npz"))
    got = ort_session(path).run(None, feed)[0]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, plain, atol=1e-3 * np.abs(plain).max())
    fp32 = ort_session(directory / "model.onnx").run(None, feed)[0].reshape(len(got), -1).astype(np.float64)
    flat = got.reshape(len(got), -1).astype(np.float64)
    cosine = (flat * fp32).sum(1) / (np.linalg.norm(flat, axis=1) * np.linalg.norm(fp32, axis=1))
    assert cosine.mean() >= 0.99


def test_int4_options_refuse_bad_values_in_one_line(transformer_export: Path, tmp_path: Path) -> None:
    """A block size that is no power of two, and AWQ without calibration data, each end in one line naming the fix
    (exit 2, no traceback), and the directory gains no INT4 graph."""
    directory = tmp_path / "m"
    shutil.copytree(transformer_export / "fp32", directory)
    runner = CliRunner()
    bad_block = runner.invoke(cli, ["calibrate", str(directory), "--int4-weights", "--int4-block", "100"])
    assert bad_block.exit_code == 2 and "--int4-block 100: use a power of two" in bad_block.output
    no_data = runner.invoke(cli, ["calibrate", str(directory), "--int4-weights"])
    assert no_data.exit_code == 2 and "--int4-method awq needs calibration data" in no_data.output
    assert "Traceback" not in bad_block.output + no_data.output and not (directory / "model.int4.onnx").exists()
