"""Graph passes on ONNX built with onnx.helper and on TorchScript-exporter output."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import helper

from compiler.core.onnx_io import ort_session
from compiler.frontend.folding import fold_constants
from compiler.frontend.passes import cleanup, fold_batchnorm, run_passes
from tests.onnx_helpers import make_model, tensor

rng = np.random.default_rng(0)


def bn_params(prefix: str, c: int) -> dict[str, np.ndarray]:
    return {f"{prefix}_g": rng.uniform(0.5, 1.5, c).astype(np.float32),
            f"{prefix}_b": rng.normal(0, 0.1, c).astype(np.float32),
            f"{prefix}_m": rng.normal(0, 0.1, c).astype(np.float32),
            f"{prefix}_v": rng.uniform(0.5, 1.5, c).astype(np.float32)}


def bn_node(prefix: str, x: str, y: str) -> onnx.NodeProto:
    return helper.make_node("BatchNormalization", [x, f"{prefix}_g", f"{prefix}_b", f"{prefix}_m", f"{prefix}_v"],
                            [y], name=prefix, epsilon=1e-3)


def run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort_session(model).run(None, feed)


def ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def conv_bn_model() -> onnx.ModelProto:
    inits = {"w": rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "wt": rng.normal(size=(8, 4, 2, 2)).astype(
        np.float32), **bn_params("bn1", 8), **bn_params("bn2", 4), **bn_params("bn3", 4)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             bn_node("bn1", "c", "c_bn"),
             helper.make_node("ConvTranspose", ["c_bn", "wt"], ["t"], name="convT", strides=[2, 2]),
             bn_node("bn2", "t", "t_bn"),
             helper.make_node("Relu", ["t_bn"], ["r"], name="relu"),
             bn_node("bn3", "r", "y")]  # after a Relu: not foldable, becomes Mul + Add
    return make_model(nodes, [tensor("x", ["B", 3, 8, 8])], [tensor("y", ["B", 4, 16, 16])], inits)


def test_batchnorm_folds_into_conv_and_conv_transpose_and_the_rest_becomes_mul_add() -> None:
    model = conv_bn_model()
    x = rng.normal(size=(2, 3, 8, 8)).astype(np.float32)
    before = run(model, {"x": x})[0]
    folded, changes = fold_batchnorm(model)
    assert changes == {"folded": ["bn1", "bn2"], "converted_to_mul_add": ["bn3"]}
    assert ops(folded)["BatchNormalization"] == 0
    assert ops(folded)["Mul"] == 1 and ops(folded)["Add"] == 1
    onnx.checker.check_model(folded, full_check=True)
    np.testing.assert_allclose(run(folded, {"x": x})[0], before, rtol=1e-4, atol=1e-5)


def test_batchnorm_folds_into_gemm_and_matmul_add() -> None:
    inits = {"w1": rng.normal(size=(6, 16)).astype(np.float32), "b1": rng.normal(size=6).astype(np.float32),
             "w2": rng.normal(size=(6, 5)).astype(np.float32), "b2": rng.normal(size=5).astype(np.float32),
             **bn_params("bnA", 6), **bn_params("bnB", 5)}
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["g"], name="gemm", transB=1),
             bn_node("bnA", "g", "g_bn"),
             helper.make_node("MatMul", ["g_bn", "w2"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "b2"], ["a"], name="add"),
             bn_node("bnB", "a", "y")]
    model = make_model(nodes, [tensor("x", ["B", 16])], [tensor("y", ["B", 5])], inits)
    x = rng.normal(size=(4, 16)).astype(np.float32)
    before = run(model, {"x": x})[0]
    folded, changes = fold_batchnorm(model)
    assert changes["folded"] == ["bnA", "bnB"]
    assert ops(folded) == Counter({"Gemm": 1, "MatMul": 1, "Add": 1})
    assert folded.graph.output[0].name == "y"
    np.testing.assert_allclose(run(folded, {"x": x})[0], before, rtol=1e-4, atol=1e-5)


def test_constant_folding_and_cleanup() -> None:
    inits = {"a": np.ones((4,), np.float32), "b": np.full((4,), 2.0, np.float32),
             "unused": np.zeros((3,), np.float32)}
    nodes = [helper.make_node("Add", ["a", "b"], ["ab"], name="const_add"),  # constant subgraph
             helper.make_node("Mul", ["x", "ab"], ["m"], name="mul"),
             helper.make_node("Identity", ["m"], ["i"], name="identity"),
             helper.make_node("Relu", ["i"], ["y"], name="relu"),
             helper.make_node("Neg", ["x"], ["dead"], name="dead_neg")]
    model = make_model(nodes, [tensor("x", ["B", 4])], [tensor("y", ["B", 4])], inits)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    before = run(model, {"x": x})[0]
    folded, changes = fold_constants(model)
    assert changes["nodes_folded"] >= 1 and ops(folded)["Add"] == 0
    cleaned, changes = cleanup(folded)
    assert ops(cleaned) == Counter({"Mul": 1, "Relu": 1})
    assert changes["identities_removed"] == 1
    assert {i.name for i in cleaned.graph.initializer} == {n.input[1] for n in cleaned.graph.node if n.op_type == "Mul"}
    np.testing.assert_allclose(run(cleaned, {"x": x})[0], before, rtol=1e-6)


def test_identity_feeding_a_graph_output_keeps_the_output_name() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Identity", ["r"], ["y"])]
    model = make_model(nodes, [tensor("x", ["B", 4])], [tensor("y", ["B", 4])])
    cleaned, _ = cleanup(model)
    assert ops(cleaned) == Counter({"Relu": 1}) and cleaned.graph.node[0].output[0] == "y"


@pytest.mark.slow
def test_torchscript_exporter_output_keeps_batchnorm_until_our_pass() -> None:
    import io

    import torch

    from examples.models import resnet_digits

    model = resnet_digits()
    buf = io.BytesIO()
    torch.onnx.export(model, (torch.randn(2, 1, 8, 8),), buf, dynamo=False, do_constant_folding=False,
                      training=torch.onnx.TrainingMode.PRESERVE, input_names=["images"],
                      dynamic_axes={"images": {0: "B"}})
    exported = onnx.load_from_string(buf.getvalue())
    assert ops(exported)["BatchNormalization"] == 9
    x = np.random.default_rng(1).normal(size=(5, 1, 8, 8)).astype(np.float32)
    folded, results = run_passes(exported, {"images": x})
    assert ops(folded)["BatchNormalization"] == 0
    assert [r.name for r in results] == ["shape_inference", "constant_folding", "batchnorm_folding", "cleanup",
                                         "final_shape_inference"]
    assert folded.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "B"
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(run(folded, {"images": x})[0], want, rtol=1e-4, atol=1e-5)


def test_constant_folding_leaves_no_cycle_holding_the_weights() -> None:
    # onnx-graphsurgeon's graph is a reference cycle whose constants hold the input model's weights; left to
    # the collector it kept a 2.25 GiB model alive in a process that then only waited on its calibration worker
    import gc

    model = make_model([helper.make_node("Add", ["a", "b"], ["ab"], name="const_add"),
                        helper.make_node("MatMul", ["x", "ab"], ["y"], name="mm")],
                       [tensor("x", ["B", 4])], [tensor("y", ["B", 4])],
                       {"a": np.ones((4, 4), np.float32), "b": np.eye(4, dtype=np.float32)})
    gc.collect()
    gc.disable()
    try:
        fold_constants(model)
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert unreachable == 0
