"""FP8 (E4M3) Q/DQ graphs: placement from PLACEMENT's FP8 rules, FP8 values, the ONNX Runtime session policy that
runs them faithfully, and ``trtc calibrate --fp8`` / ``trtc build --fp8 --engine none`` end to end, with the
compute-capability requirement recorded and enforced. Models run in ONNX Runtime and are compared with FP32."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from calibration.qdq import QdqPolicy, qdq_model_from, tensors_to_calibrate
from calibration.weights import fp8_weight
from compiler.cli import cli
from compiler.core.onnx_io import graph_holds, ort_session, session_rules
from compiler.core.settings import CalibrationSettings
from tests.onnx_helpers import make_model, tensor

RNG = np.random.default_rng(0)


def _mlp_with_pool() -> onnx.ModelProto:
    """x [B,16,8,8] -> Conv(32) -> Relu -> MaxPool -> Flatten -> MatMul(512x64) -> Relu -> MatMul(64x10) -> y."""
    nodes = [helper.make_node("Conv", ["x", "cw", "cb"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["hr"], name="relu2"),
             helper.make_node("MatMul", ["hr", "w2"], ["y"], name="head")]
    init = {"cw": RNG.standard_normal((32, 16, 3, 3)).astype(np.float32) * 0.1,
            "cb": RNG.standard_normal(32).astype(np.float32) * 0.1,
            "w1": RNG.standard_normal((512, 64)).astype(np.float32) * 0.05,
            "w2": RNG.standard_normal((64, 10)).astype(np.float32) * 0.1}
    return make_model(nodes, [tensor("x", ["B", 16, 8, 8])], [tensor("y", ["B", 10])], init, opset=19)


def test_fp8_places_qdq_on_convolutions_and_gemms_only_with_fp8_values() -> None:
    """FP8 Q/DQ goes on the Conv and the inner MatMul (activation per tensor, float8e4m3fn zero points, scale amax/448)
    and not on the pool (INT8 would quantize it) or the head; the stored weights are the FP8 rounding of the FP32
    weights per output channel; and the graph runs in ONNX Runtime within FP8's error of the FP32 model."""
    model = _mlp_with_pool()
    fp8 = QdqPolicy(precision="fp8")
    tensors = tensors_to_calibrate(model, fp8)
    assert tensors == ["x", "f"]  # conv's and fc1's inputs; INT8 would add the pool's input "r"
    assert "r" in tensors_to_calibrate(model, QdqPolicy())
    x = RNG.standard_normal((16, 16, 8, 8)).astype(np.float32)
    reference = ort_session(model)
    y = reference.run(None, {"x": x})[0]
    probe = make_model(list(model.graph.node)[:4], [tensor("x", ["B", 16, 8, 8])], [tensor("f", ["B", 512])],
                       {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name[0] == "c"},
                       opset=19)
    f = ort_session(probe).run(None, {"x": x})[0]
    amax = {"x": float(np.abs(x).max()), "f": float(np.abs(f).max())}  # max calibration on the data itself
    quantized, report = qdq_model_from(model, amax, fp8)
    assert report.quantized_nodes == ["conv", "fc1"]
    assert "not in FP8" in report.skipped_nodes["pool"] and "output layer" in report.skipped_nodes["head"]
    counts = Counter(n.op_type for n in quantized.graph.node)
    assert counts["QuantizeLinear"] == 2 and counts["DequantizeLinear"] == 4
    inits = {t.name: t for t in quantized.graph.initializer}
    zero_types = {inits[n.input[2]].data_type for n in quantized.graph.node if n.op_type == "QuantizeLinear"}
    assert zero_types == {TensorProto.FLOAT8E4M3FN}
    x_scale = next(onnx.numpy_helper.to_array(inits[n.input[1]]) for n in quantized.graph.node
                   if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    assert np.isclose(float(x_scale), amax["x"] / 448, rtol=1e-6)
    w1_q, _ = fp8_weight(onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w1")),
                                1)
    stored = next(t for t in quantized.graph.initializer if t.name.startswith("w1_quantized"))
    assert stored.data_type == TensorProto.FLOAT8E4M3FN
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(stored).astype(np.float32), w1_q.astype(np.float32))
    got = ort_session(quantized).run(None, {"x": x})[0]
    cosine = (got * y).sum() / (np.linalg.norm(got) * np.linalg.norm(y))
    assert cosine > 0.995


def _fp8_matmul() -> onnx.ModelProto:
    """y = DQ(Q(x)) @ DQ(fp8 weight): one FP8 GEMM in an FP32 graph, as the gate's FP16 emulation runs it."""
    w = RNG.standard_normal((64, 32)).astype(np.float32)
    q, scale = fp8_weight(w, 1)
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    init = {"xs": np.array(0.01, np.float32), "xz": np.zeros((), ml_dtypes.float8_e4m3fn), "wq": q, "ws": scale,
            "wz": np.zeros(32, ml_dtypes.float8_e4m3fn)}
    return make_model(nodes, [tensor("x", ["B", 64])], [tensor("y", ["B", 32])], init, opset=19)


def _unoptimized(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_fp8_sessions_run_without_the_fusion_that_rejects_fp8_and_match_unoptimized_runs() -> None:
    """In this ONNX Runtime the default optimizations turn an FP8 DQ -> MatMul into MatMulIntegerToFloat and the
    session fails; ``ort_session`` (SESSION_POLICY, by what the graph holds) loads it, names the transformers it
    disables, and gives exactly the outputs of the same graph with every optimization off."""
    model = _fp8_matmul()
    assert graph_holds(model) == {"qdq", "fp8"}
    assert sorted(r.disabled_optimizers for r in session_rules(model)) == [(), ("QDQSelectorActionTransformer",
                                                                            "WeightBiasQuantization")]
    with pytest.raises(Exception, match="MatMulIntegerToFloat"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_array_equal(ort_session(model).run(None, {"x": x})[0], _unoptimized(model, x))
    plain = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor("x", ["B", 64])],
                       [tensor("y", ["B", 32])], {"w": np.ones((64, 32), np.float32)})
    assert graph_holds(plain) == frozenset() and session_rules(plain) == []  # an FP32 graph: every optimization on


def test_fp8_calibration_defaults_to_max_and_refuses_the_fp32_rest() -> None:
    """FP8's default range is the max |x| (INT8 keeps percentile), and --fp32-rest, an INT8 option, is refused."""
    assert CalibrationSettings(precision="fp8").method == "max"
    assert CalibrationSettings(precision="int8").method == "percentile"
    assert CalibrationSettings(precision="fp8", method="percentile").method == "percentile"
    with pytest.raises(Exception, match="--fp32-rest applies to --int8 only"):
        CalibrationSettings(precision="fp8", fp32_rest=True)


@pytest.fixture(scope="module")
def digits_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from compiler.core.settings import ExportSettings, ModelSource
    from compiler.core.specs import ModelSpec, parse_input_spec
    from compiler.pipeline.export import export_directory
    from examples.digits import train_digits

    tmp = tmp_path_factory.mktemp("digits_fp8")
    torch.set_num_threads(1)
    model, splits = train_digits(epochs=3)
    torch.save(model.state_dict(), tmp / "weights.pt")
    np.savez(tmp / "calib.npz", images=splits.calib_x[:128])
    np.savez(tmp / "eval.npz", images=splits.test_x, labels=splits.test_y)
    export_directory(ExportSettings(ModelSource(factory="examples.models:resnet_digits", weights=tmp / "weights.pt"),
                                    tmp / "fp32", spec=ModelSpec((parse_input_spec("images:Bx1x8x8"),)),
                                    buckets=(1, 16)))
    return tmp


def test_calibrate_fp8_writes_a_gated_fp8_graph_that_records_its_gpu_requirement(digits_export: Path,
                                                                                  tmp_path: Path) -> None:
    """``trtc calibrate --fp8`` on the trained digits CNN: exit 0, model.fp8.onnx whose convolutions read FP8 Q/DQ
    and whose rest is FP16; the manifest records the precision, compute capability 8.9 on its onnx entry and the
    node counts; the graph in ``ort_session`` (what bench and serving run) matches the same graph with every
    optimization off (ONNX Runtime's WeightBiasQuantization alone cost 11 points here) and keeps top-1 within 1
    point of FP32."""
    import shutil

    directory = tmp_path / "m"
    shutil.copytree(digits_export / "fp32", directory)
    result = CliRunner().invoke(cli, ["calibrate", str(directory), "--fp8", "--calib-data",
                                      str(digits_export / "calib.npz"), "--eval-data", str(digits_export / "eval.npz")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["precision"] == "fp8"
    assert manifest["onnx"]["fp8"]["requires_compute_capability"] == "8.9"
    assert manifest["fp8"]["method"] == "max" and manifest["fp8"]["node_precisions"]["fp8"] > 0
    graph = onnx.load(str(directory / "model.fp8.onnx"), load_external_data=False)
    assert graph_holds(graph) == {"qdq", "fp8", "fp16"}
    assert any(a.i == TensorProto.FLOAT16 for n in graph.graph.node if n.op_type == "Cast" for a in n.attribute
               if a.name == "to")  # Casts to FP16: the rest runs in FP16
    held = dict(np.load(digits_export / "eval.npz"))
    fp32 = ort_session(directory / "model.onnx").run(None, {"images": held["images"]})[0]
    got = ort_session(directory / "model.fp8.onnx").run(None, {"images": held["images"]})[0]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(str(directory / "model.fp8.onnx"), opts, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, plain.run(None, {"images": held["images"]})[0], atol=1e-3 * np.abs(fp32).max())
    drop = 100 * ((fp32.argmax(1) == held["labels"]).mean() - (got.argmax(1) == held["labels"]).mean())
    assert drop <= 1.0
