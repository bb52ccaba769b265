"""INT8 Q/DQ placement (calibration/qdq.py) on the bundled examples exported with dynamo, and on tiny graphs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from calibration.qdq import PLACEMENT, QdqPolicy, QdqReport, qdq_model_from, quantizable_nodes, tensors_to_calibrate
from compiler.core.onnx_io import MAX_IR_VERSION, load_onnx, ort_session
from tests.onnx_helpers import make_model, tensor

torch = pytest.importorskip("torch")
models = pytest.importorskip("examples.models")


# --- exported examples, once per module --------------------------------------------------------------------------

def _export(module: torch.nn.Module, args: tuple[torch.Tensor, ...], input_names: list[str], output_name: str,
            dynamic_shapes: tuple[dict[int, object], ...], path: Path) -> onnx.ModelProto:
    torch.onnx.export(module, args, str(path), dynamo=True, input_names=input_names, output_names=[output_name],
                      dynamic_shapes=dynamic_shapes, verbose=False)
    return load_onnx(path)


BATCH = torch.export.Dim("B", min=1, max=64)
SEQ = torch.export.Dim("S", min=1, max=512)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    return _export(models.resnet_digits(), (torch.randn(2, 1, 8, 8),), ["images"], "logits", ({0: BATCH},),
                   tmp_path_factory.mktemp("cnn") / "cnn.onnx")


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    return _export(models.mlp(), (torch.randn(2, 64),), ["x"], "y", ({0: BATCH},),
                   tmp_path_factory.mktemp("mlp") / "mlp.onnx")


@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    ids = torch.randint(0, 1000, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    return _export(models.transformer_encoder(), (ids, mask), ["input_ids", "attention_mask"], "embeddings",
                   ({0: BATCH, 1: SEQ}, {0: BATCH, 1: SEQ}), tmp_path_factory.mktemp("tr") / "transformer.onnx")


@pytest.fixture(scope="module")
def two_input(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    return _export(models.two_input(), (torch.randn(2, 3, 32, 32), torch.randn(2, 16)), ["image", "features"],
                   "logits", ({0: BATCH}, {0: BATCH}), tmp_path_factory.mktemp("two") / "two_input.onnx")


# --- helpers -----------------------------------------------------------------------------------------------------

def _feeds(model: onnx.ModelProto, batch: int = 8, seq: int = 12, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for i in model.graph.input:
        dims = [d.dim_value or {"B": batch, "S": seq}[d.dim_param] for d in i.type.tensor_type.shape.dim]
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 1000, dims).astype(np.int64)
        elif i.name == "attention_mask":
            mask = np.ones(dims, dtype=np.int64)
            mask[0, -3:] = 0  # some padding
            feeds[i.name] = mask
        else:
            feeds[i.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _true_amax(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tensors: list[str]) -> dict[str, float]:
    """max |x| of each tensor on ``feeds``, from the FP32 model run with those tensors exposed as outputs."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    exposed = [t for t in tensors if t not in feeds and t not in {o.name for o in model.graph.output}]
    probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in exposed)
    session = ort_session(probe)
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    values.update(feeds)
    return {t: float(np.abs(values[t]).max()) for t in tensors}


# The mechanics below are shown on tiny models, whose layers are under PLACEMENT's 16-channel minimum and
# whose heads feed graph outputs: these tests switch those two rules off; tests further down show them.
EVERY: dict[str, Any] = {"quantize_output_layer": True, "min_channels": False}
WEIGHTED_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul"}


def _quantize(model: onnx.ModelProto, policy: QdqPolicy | None = None,
              feeds: dict[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, QdqReport]:
    policy = policy or QdqPolicy(**EVERY)
    amax = _true_amax(model, feeds or _feeds(model), tensors_to_calibrate(model, policy))
    return qdq_model_from(model, amax, policy)


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: n for n in model.graph.node for out in n.output}


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def _dq_inputs(model: onnx.ModelProto, node: onnx.NodeProto) -> list[int]:
    """Indices of ``node``'s inputs that come from a DequantizeLinear."""
    producers = _producers(model)
    return [i for i, t in enumerate(node.input) if t in producers and producers[t].op_type == "DequantizeLinear"]


def _names(model: onnx.ModelProto, op_type: str) -> list[str]:
    return [n.name for n in model.graph.node if n.op_type == op_type]


def _weight_of(model: onnx.ModelProto, node: onnx.NodeProto) -> str:
    """Name of the FP32 weight initializer a (quantized or not) node reads through input 1."""
    producers = _producers(model)
    source = node.input[1]
    if source in producers:  # DQ(int8 weight): the int8 initializer is named after the FP32 one
        source = producers[source].input[0].removesuffix("_quantized")
    return source


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _no_qdq_on_outputs(model: onnx.ModelProto) -> None:
    producers = _producers(model)
    for out in model.graph.output:
        assert producers[out.name].op_type not in ("QuantizeLinear", "DequantizeLinear"), out.name


# --- the CNN -----------------------------------------------------------------------------------------------------

def test_cnn_convs_gemm_and_residual_shortcuts_get_qdq(cnn: onnx.ModelProto) -> None:
    qdq, report = _quantize(cnn)
    convs, gemms, adds = _names(cnn, "Conv"), _names(cnn, "Gemm"), _names(cnn, "Add")
    assert (len(convs), len(gemms), len(adds)) == (9, 1, 3)
    # 8 distinct Conv/Gemm data inputs (images, 6 ReLU outputs, the flattened pool) + 2 shortcut-conv outputs
    # feeding residual adds; every one of 9 + 1 weights is INT8 behind its own DQ.
    assert _ops(qdq)["QuantizeLinear"] == 10
    assert _ops(qdq)["DequantizeLinear"] == 20
    assert report.qdq_pairs == 10 and report.quantized_weights == 10
    for name in convs + gemms:
        assert _dq_inputs(qdq, _node(qdq, name)) == [0, 1], name  # data and weight, never the bias
    producers = _producers(qdq)
    for name in adds:
        add = _node(qdq, name)
        assert len(_dq_inputs(qdq, add)) == 1, name
        main = add.input[1 - _dq_inputs(qdq, add)[0]]
        # the un-quantized input is the block's conv2, which TensorRT fuses the add into
        assert producers[main].op_type == "Conv" and ".conv2." in _weight_of(qdq, producers[main]), name
    # The identity shortcut shares its Q/DQ pair with the next block's conv1: one scale per tensor.
    first_add = _node(qdq, adds[0])
    conv1 = next(_node(qdq, c) for c in convs if "stages.0.conv1." in _weight_of(qdq, _node(qdq, c)))
    assert first_add.input[_dq_inputs(qdq, first_add)[0]] == conv1.input[0]
    for op in ("Relu", "ReduceMean", "Reshape"):
        for name in _names(qdq, op):
            assert _dq_inputs(qdq, _node(qdq, name)) == [], name
    _no_qdq_on_outputs(qdq)
    assert report.quantized_nodes == quantizable_nodes(cnn, QdqPolicy(**EVERY))
    assert sorted(report.quantized_nodes) == sorted(convs + gemms + adds)
    assert report.skipped_nodes == {}


def test_per_channel_weight_scales_of_a_conv_and_the_gemm(cnn: onnx.ModelProto) -> None:
    qdq, _ = _quantize(cnn)
    original = {t.name: numpy_helper.to_array(t) for t in cnn.graph.initializer}
    inits = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    producers = _producers(qdq)
    stem = _node(qdq, _names(qdq, "Conv")[0])
    head = _node(qdq, _names(qdq, "Gemm")[0])
    assert helper.get_attribute_value(next(a for a in head.attribute if a.name == "transB")) == 1
    for node, reduce_axes, axis in ((stem, (1, 2, 3), 0), (head, (1,), 0)):
        w = original[_weight_of(qdq, node)]
        dq = producers[node.input[1]]
        assert helper.get_attribute_value(next(a for a in dq.attribute if a.name == "axis")) == axis
        q, scale, zero = (inits[t] for t in dq.input)
        assert q.dtype == np.int8 and zero.dtype == np.int8 and not zero.any()
        np.testing.assert_allclose(scale, np.abs(w).max(axis=reduce_axes) / 127, rtol=1e-6)
        per_row = scale.reshape([-1] + [1] * (w.ndim - 1))
        assert np.all(np.abs(q.astype(np.float32) * per_row - w) <= per_row / 2 + 1e-7)
        assert _weight_of(qdq, node) not in inits  # the FP32 copy is gone


def test_cnn_runs_in_ort_close_to_fp32_at_any_batch(cnn: onnx.ModelProto) -> None:
    feeds = _feeds(cnn, batch=8)
    qdq, _ = _quantize(cnn, feeds=feeds)
    reference = ort_session(cnn).run(None, feeds)[0]
    got = ort_session(qdq).run(None, feeds)[0]
    assert got.shape == reference.shape == (8, 10)
    assert _cosine(got, reference) > 0.99
    np.testing.assert_allclose(got, reference, atol=0.05 * np.abs(reference).max())
    assert ort_session(qdq).run(None, _feeds(cnn, batch=3, seed=1))[0].shape == (3, 10)


def test_cnn_tensors_to_calibrate(cnn: onnx.ModelProto) -> None:
    tensors = tensors_to_calibrate(cnn, QdqPolicy(**EVERY))
    constants = {t.name for t in cnn.graph.initializer}
    assert len(tensors) == len(set(tensors)) == 10
    assert tensors[0] == "images" and not constants & set(tensors)
    produced = [i.name for i in cnn.graph.input] + [o for n in cnn.graph.node for o in n.output]
    assert tensors == sorted(tensors, key=produced.index)
    assert len(tensors_to_calibrate(cnn, QdqPolicy(**EVERY, quantize_residual_add=False))) == 8


# --- the transformer ---------------------------------------------------------------------------------------------

def _linear_and_attention_matmuls(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    constants = {t.name for t in model.graph.initializer}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    linear = [n.name for n in matmuls if n.input[1] in constants]
    return linear, [n.name for n in matmuls if n.name not in linear]


def test_transformer_linear_matmuls_only(transformer: onnx.ModelProto) -> None:
    linear, attention = _linear_and_attention_matmuls(transformer)
    assert (len(linear), len(attention)) == (8, 4)  # 2 blocks x (qkv, proj, fc1, fc2); 2 x (Q·K^T, attn·V)
    qdq, report = _quantize(transformer)
    assert _ops(qdq)["QuantizeLinear"] == 8  # each linear layer reads a distinct activation
    assert _ops(qdq)["DequantizeLinear"] == 16
    for name in linear:
        assert _dq_inputs(qdq, _node(qdq, name)) == [0, 1], name
    for name in attention:
        assert _dq_inputs(qdq, _node(qdq, name)) == [], name
        assert report.skipped_nodes[name] == "attention score product kept in FP32 (policy)"
    assert sorted(report.quantized_nodes) == sorted(linear)
    consumers_of_q = {n.input[0] for n in qdq.graph.node if n.op_type == "QuantizeLinear"}
    producers = _producers(qdq)
    assert not any(producers[t].op_type == "Softmax" for t in consumers_of_q if t in producers)
    for op in ("Softmax", "LayerNormalization", "Gelu", "Add", "Mul", "Reshape", "Transpose"):
        for name in _names(qdq, op):
            assert _dq_inputs(qdq, _node(qdq, name)) == [], name
    _no_qdq_on_outputs(qdq)
    assert [d.dim_param for d in qdq.graph.input[0].type.tensor_type.shape.dim] == ["B", "S"]


def test_transformer_attention_matmuls_by_policy(transformer: onnx.ModelProto) -> None:
    linear, attention = _linear_and_attention_matmuls(transformer)
    qdq, report = _quantize(transformer, QdqPolicy(**EVERY, quantize_attention_matmuls=True))
    assert _ops(qdq)["QuantizeLinear"] == 8 + 2 * 4  # plus both operands of each attention product
    assert _ops(qdq)["DequantizeLinear"] == 16 + 8
    for name in attention:
        assert _dq_inputs(qdq, _node(qdq, name)) == [0, 1], name
    assert sorted(report.quantized_nodes) == sorted(linear + attention) and report.skipped_nodes == {}


def test_transformer_runs_in_ort_close_to_fp32(transformer: onnx.ModelProto) -> None:
    feeds = _feeds(transformer, batch=4, seq=12)
    qdq, _ = _quantize(transformer, feeds=feeds)
    reference = ort_session(transformer).run(None, feeds)[0]
    got = ort_session(qdq).run(None, feeds)[0]
    assert got.shape == reference.shape == (4, 12, 64)
    assert _cosine(got, reference) > 0.99


# --- the MLP and the two-input model -----------------------------------------------------------------------------

def test_mlp_every_gemm_quantized_and_close(mlp: onnx.ModelProto) -> None:
    feeds = _feeds(mlp)
    qdq, report = _quantize(mlp, feeds=feeds)
    assert (_ops(qdq)["Gemm"], _ops(qdq)["QuantizeLinear"], _ops(qdq)["DequantizeLinear"]) == (3, 3, 6)
    for name in _names(qdq, "Gemm"):
        assert _dq_inputs(qdq, _node(qdq, name)) == [0, 1]
    assert report.quantized_nodes == _names(mlp, "Gemm")
    _no_qdq_on_outputs(qdq)
    assert _cosine(ort_session(qdq).run(None, feeds)[0], ort_session(mlp).run(None, feeds)[0]) > 0.99


def test_two_input_both_branches_and_head(two_input: onnx.ModelProto) -> None:
    """Both branches quantized, and the concat before the head in INT8 with one scale."""
    feeds = _feeds(two_input)
    qdq, report = _quantize(two_input, feeds=feeds)
    concat = _node(two_input, _names(two_input, "Concat")[0])
    # image, features, both concat inputs and the concat output (dynamo writes the pooling as ReduceMean)
    assert (_ops(qdq)["QuantizeLinear"], _ops(qdq)["DequantizeLinear"]) == (5, 8)
    assert tensors_to_calibrate(two_input, QdqPolicy(**EVERY)) == ["image", "features", *concat.input,
                                                                   concat.output[0]]
    assert sorted(report.quantized_nodes) == sorted(_names(two_input, "Conv") + _names(two_input, "Gemm")
                                                    + [concat.name])
    assert _dq_inputs(qdq, _node(qdq, concat.name)) == [0, 1]
    scales = {_scale_of(qdq, t) for t in [*concat.input, concat.output[0]]}
    assert len(scales) == 1  # one scale shared by the concat's inputs and its output
    _no_qdq_on_outputs(qdq)
    assert _cosine(ort_session(qdq).run(None, feeds)[0], ort_session(two_input).run(None, feeds)[0]) > 0.99


def _scale_of(model: onnx.ModelProto, tensor: str) -> float:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    return float(inits[q.input[1]])


# --- PLACEMENT's rules on small graphs ---------------------------------------------------------------------------

def _weight(shape: list[int], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_head_feeding_a_graph_output_stays_in_higher_precision() -> None:
    body = helper.make_node("MatMul", ["x", "w1"], ["h"], name="body")
    relu = helper.make_node("Relu", ["h"], ["r"], name="relu")
    head = helper.make_node("MatMul", ["r", "w2"], ["hb"], name="head")
    bias = helper.make_node("Add", ["hb", "b"], ["y"], name="bias")
    model = make_model([body, relu, head, bias], [tensor("x", ["N", 32])], [tensor("y", ["N", 32])],
                       initializers={"w1": _weight([32, 32]), "w2": _weight([32, 32], 1), "b": _weight([32], 2)},
                       opset=19)
    assert quantizable_nodes(model) == ["body"]
    _, report = qdq_model_from(model, {"x": 3.0}, QdqPolicy())
    assert "output layer" in report.skipped_nodes["head"]
    assert quantizable_nodes(model, QdqPolicy(quantize_output_layer=True)) == ["body", "head"]


@pytest.mark.parametrize(("op", "shape", "quantized"), [
    ("Conv", [16, 3, 3, 3], False),  # a 3-channel stem
    ("Conv", [8, 32, 1, 1], False),  # 8 output channels
    ("Conv", [16, 16, 3, 3], True),
    ("MatMul", [64, 4], False),  # a GEMV-like projection to 4 values
    ("MatMul", [64, 16], True),
])
def test_layers_under_16_channels_stay_in_higher_precision(op: str, shape: list[int], quantized: bool) -> None:
    if op == "Conv":
        x = tensor("x", ["N", shape[1], 8, 8])
        node = helper.make_node("Conv", ["x", "w"], ["y"], name="layer", pads=[shape[2] // 2] * 4)
        y = tensor("y", ["N", shape[0], 8, 8])
    else:
        x, y = tensor("x", ["N", shape[0]]), tensor("y", ["N", shape[1]])
        node = helper.make_node("MatMul", ["x", "w"], ["y"], name="layer")
    after = helper.make_node("Relu", ["y"], ["z"], name="after")  # not a head: the output is the Relu's
    z = tensor("z", [d.dim_param or d.dim_value for d in y.type.tensor_type.shape.dim])
    model = make_model([node, after], [x], [z], initializers={"w": _weight(shape)}, opset=19)
    assert (quantizable_nodes(model) == ["layer"]) is quantized
    assert quantizable_nodes(model, QdqPolicy(min_channels=False)) == ["layer"]


def test_pooling_after_a_quantized_conv_gets_qdq_and_not_elsewhere() -> None:
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1])
    relu = helper.make_node("Relu", ["c"], ["r"], name="relu")
    pool = helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2])
    raw_pool = helper.make_node("AveragePool", ["x"], ["q"], name="raw_pool", kernel_shape=[2, 2], strides=[2, 2])
    model = make_model([conv, relu, pool, raw_pool], [tensor("x", ["N", 16, 8, 8])],
                       [tensor("p", ["N", 16, 4, 4]), tensor("q", ["N", 16, 4, 4])],
                       initializers={"w": _weight([16, 16, 3, 3])}, opset=19)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 16, 8, 8)).astype(np.float32)}
    qdq, report = _quantize(model, QdqPolicy(), feeds)
    assert report.quantized_nodes == ["conv", "pool"]
    assert _dq_inputs(qdq, _node(qdq, "pool")) == [0]
    assert "does not come from a quantized layer" in report.skipped_nodes["raw_pool"]
    assert _dq_inputs(qdq, _node(qdq, "raw_pool")) == []
    got, want = ort_session(qdq).run(None, feeds), ort_session(model).run(None, feeds)
    assert _cosine(got[0], want[0]) > 0.999 and np.array_equal(got[1], want[1])


def test_concat_inputs_share_the_widest_scale() -> None:
    a = helper.make_node("Relu", ["x"], ["a"], name="a")
    b = helper.make_node("Mul", ["x", "k"], ["b"], name="b")  # 4x the range of a
    cat = helper.make_node("Concat", ["a", "b"], ["c"], name="cat", axis=1)
    mm = helper.make_node("MatMul", ["c", "w"], ["y"], name="mm")
    relu = helper.make_node("Relu", ["y"], ["z"], name="out")
    model = make_model([a, b, cat, mm, relu], [tensor("x", ["N", 16])], [tensor("z", ["N", 16])],
                       initializers={"k": np.array(4.0, np.float32), "w": _weight([32, 16])}, opset=19)
    assert tensors_to_calibrate(model) == ["a", "b", "c"]
    qdq, report = qdq_model_from(model, {"a": 1.0, "b": 4.0, "c": 4.0}, QdqPolicy())
    assert report.quantized_nodes == ["cat", "mm"]
    assert {_scale_of(qdq, t) for t in "abc"} == {np.float32(4.0 / 127)}
    # a constant input would set the shared scale: that concat stays unquantized
    const_cat = helper.make_node("Concat", ["a", "k16"], ["c"], name="cat", axis=1)  # [N, 16] + [1, 16]: axis 0
    model2 = make_model([a, const_cat, mm, relu], [tensor("x", ["N", 16])], [tensor("z", ["N", 16])],
                        initializers={"k16": _weight([1, 16]), "w": _weight([32, 16])}, opset=19)
    _, report2 = qdq_model_from(model2, {"c": 4.0}, QdqPolicy())
    assert report2.quantized_nodes == ["mm"] and "constant input" in report2.skipped_nodes["cat"]


def test_placement_table_holds_every_rule() -> None:
    assert {op for op, rule in PLACEMENT.items() if rule.kind == "weighted"} == WEIGHTED_OPS
    assert {"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "MaxPool", "AveragePool", "GlobalAveragePool",
            "Concat"} == set(PLACEMENT)
    assert all(rule.why for rule in PLACEMENT.values())
    for rule in PLACEMENT.values():  # each kind's rule carries what it needs
        assert (rule.weight is not None and rule.too_small != "") is (rule.kind == "weighted")
        assert bool(rule.fuses_into) is (rule.kind == "residual")
        assert bool(rule.source_through) is (rule.kind == "pool")
    assert {op for op, rule in PLACEMENT.items() if rule.head_through} == {"Gemm", "MatMul"}


# --- validity on every example -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer", "two_input"])
def test_result_is_valid_onnx_and_input_untouched(name: str, request: pytest.FixtureRequest) -> None:
    model: onnx.ModelProto = request.getfixturevalue(name)
    before = model.SerializeToString()
    qdq, _ = _quantize(model)
    assert model.SerializeToString() == before
    onnx.checker.check_model(qdq, full_check=True)
    onnx.shape_inference.infer_shapes(qdq, strict_mode=True)
    assert qdq.ir_version <= MAX_IR_VERSION
    assert qdq.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "B"
    assert [o.name for o in qdq.graph.output] == [o.name for o in model.graph.output]


# --- policy: exclusions and missing amax -------------------------------------------------------------------------

def test_exclude_nodes_removes_qdq_from_exactly_those(cnn: onnx.ModelProto) -> None:
    full, _ = _quantize(cnn)
    convs = _names(cnn, "Conv")
    stem, head = convs[0], _names(cnn, "Gemm")[0]
    excluded = frozenset({stem, head})
    qdq, report = _quantize(cnn, QdqPolicy(**EVERY, exclude_nodes=excluded))
    for name in excluded:
        assert _dq_inputs(qdq, _node(qdq, name)) == []
        assert "exclude_nodes" in report.skipped_nodes[name]
    for node in full.graph.node:
        if node.op_type in {*WEIGHTED_OPS, "Add"} and node.name not in excluded:
            assert _dq_inputs(qdq, _node(qdq, node.name)) == _dq_inputs(full, node), node.name
    # the images and the pooled features lose their only consumers' Q/DQ
    assert _ops(qdq)["QuantizeLinear"] == _ops(full)["QuantizeLinear"] - 2
    assert "images" not in tensors_to_calibrate(cnn, QdqPolicy(**EVERY, exclude_nodes=excluded))


def test_excluding_a_blocks_conv2_drops_its_residual_qdq(cnn: onnx.ModelProto) -> None:
    """Without an INT8 conv to fuse into, Q/DQ on the shortcut would only add a round trip."""
    conv2 = next(n.name for n in cnn.graph.node if n.op_type == "Conv" and ".2.conv2." in n.input[1])
    producers = _producers(cnn)
    add = next(n for n in cnn.graph.node if n.op_type == "Add" and any(producers[t].name == conv2 for t in n.input))
    qdq, report = _quantize(cnn, QdqPolicy(**EVERY, exclude_nodes=frozenset({conv2})))
    assert _dq_inputs(qdq, _node(qdq, add.name)) == []
    assert conv2 in report.skipped_nodes[add.name]


def test_exclude_op_types_and_residual_policy(mlp: onnx.ModelProto, cnn: onnx.ModelProto) -> None:
    qdq, report = _quantize(mlp, QdqPolicy(**EVERY, exclude_op_types=frozenset({"Gemm"})))
    assert _ops(qdq)["QuantizeLinear"] == _ops(qdq)["DequantizeLinear"] == 0
    assert report.quantized_nodes == [] and len(report.skipped_nodes) == 3
    qdq, report = _quantize(cnn, QdqPolicy(**EVERY, quantize_residual_add=False))
    assert all(_dq_inputs(qdq, _node(qdq, a)) == [] for a in _names(qdq, "Add"))
    assert _ops(qdq)["QuantizeLinear"] == 8


def test_missing_amax_is_a_value_error_naming_the_tensor(cnn: onnx.ModelProto) -> None:
    amax = _true_amax(cnn, _feeds(cnn), tensors_to_calibrate(cnn, QdqPolicy(**EVERY)))
    del amax["relu_1"]
    with pytest.raises(ValueError, match="relu_1"):
        qdq_model_from(cnn, amax, QdqPolicy(**EVERY))
    amax["relu_1"] = float("nan")
    with pytest.raises(ValueError, match="relu_1"):
        qdq_model_from(cnn, amax, QdqPolicy(**EVERY))


def test_shortcut_without_amax_leaves_that_add_unquantized(cnn: onnx.ModelProto) -> None:
    amax = _true_amax(cnn, _feeds(cnn), tensors_to_calibrate(cnn, QdqPolicy(**EVERY)))
    add = next(n for n in cnn.graph.node if n.op_type == "Add" and "getitem_15" in n.input)
    del amax["getitem_15"]  # the 1x1 shortcut conv output of the second block: only the add reads it
    qdq, report = qdq_model_from(cnn, amax, QdqPolicy(**EVERY))
    assert _dq_inputs(qdq, _node(qdq, add.name)) == []
    assert "getitem_15" in report.skipped_nodes[add.name] and add.name not in report.quantized_nodes
    assert report.to_dict()["qdq_pairs"] == 9


def test_policy_takes_any_collection_of_names() -> None:
    assert QdqPolicy(**EVERY, exclude_nodes=["a", "b"]).exclude_nodes == frozenset({"a", "b"})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        QdqPolicy(**EVERY, exclude_op_types="Conv")  # type: ignore[arg-type]


# --- weight axes on tiny graphs ----------------------------------------------------------------------------------

def _single_node(op: str, x_shape: list[int | str], w: np.ndarray, y_shape: list[int | str],
                 **attrs: int) -> onnx.ModelProto:
    node = helper.make_node(op, ["x", "w"], ["y"], name="layer", **attrs)
    return make_model([node], [tensor("x", x_shape)], [tensor("y", y_shape)], {"w": w.astype(np.float32)}, opset=19)


WEIGHT_CASES: dict[str, tuple[Callable[[np.ndarray], onnx.ModelProto], tuple[int, ...], int]] = {
    # name: (model from weight, weight shape, expected axis)
    "conv_transpose": (lambda w: _single_node("ConvTranspose", ["N", 4, 5, 5], w, ["N", 6, 7, 7]), (4, 6, 3, 3), 1),
    "gemm_not_transposed": (lambda w: _single_node("Gemm", ["N", 4], w, ["N", 6]), (4, 6), 1),
    "matmul_3d": (lambda w: _single_node("MatMul", ["N", 3, 4], w, ["N", 3, 6]), (4, 6), 1),
}


def _exact_session(model: onnx.ModelProto) -> object:
    """ONNX Runtime with its fused INT8 kernels off: Q/DQ computed as written, in FP32.

    ORT's fused u8s8 GEMM on AVX2 CPUs without VNNI saturates 16-bit partial sums (a known ORT
    limitation that TensorRT does not share), so exact placement checks use plain Q/DQ arithmetic.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("case", sorted(WEIGHT_CASES))
def test_weight_channel_axis(case: str) -> None:
    build, shape, axis = WEIGHT_CASES[case]
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[(slice(None),) * axis + (0,)] = 0.0  # an all-zero channel must not give scale 0
    model = build(w)
    qdq, report = qdq_model_from(model, {"x": 3.0}, QdqPolicy(**EVERY))
    onnx.checker.check_model(qdq, full_check=True)
    assert report.quantized_nodes == ["layer"] and _dq_inputs(qdq, qdq.graph.node[-1]) == [0, 1]
    dq = _producers(qdq)[qdq.graph.node[-1].input[1]]
    assert helper.get_attribute_value(dq.attribute[0]) == axis
    inits = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    q, scale = inits[dq.input[0]], inits[dq.input[1]]
    expected = np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != axis)) / 127
    expected[0] = 1.0
    np.testing.assert_allclose(scale, expected, rtol=1e-6)

    # Same result as the FP32 layer run on fake-quantized input and weights.
    x_shape = [2] + [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:]]
    x = np.random.default_rng(1).uniform(-3, 3, x_shape).astype(np.float32)
    x_scale = np.float32(3.0 / 127)
    fake_x = (np.clip(np.rint(x / x_scale), -128, 127) * x_scale).astype(np.float32)
    per_channel = [1] * w.ndim
    per_channel[axis] = -1
    fake = onnx.ModelProto()
    fake.CopyFrom(model)
    fake.graph.initializer[0].CopyFrom(numpy_helper.from_array(q.astype(np.float32) * scale.reshape(per_channel), "w"))
    reference = ort_session(fake).run(None, {"x": fake_x})[0]
    np.testing.assert_allclose(_exact_session(qdq).run(None, {"x": x})[0], reference, rtol=1e-5, atol=1e-5)
    assert ort_session(qdq).run(None, {"x": x})[0].shape == reference.shape


def test_opset_too_old_for_per_channel() -> None:
    model = _single_node("MatMul", ["N", 4], np.ones((4, 2)), ["N", 2])
    model.opset_import[0].version = 12
    with pytest.raises(ValueError, match="opset"):
        qdq_model_from(model, {"x": 1.0}, QdqPolicy(**EVERY))


def test_matmul_of_two_activations_needs_both_amax() -> None:
    node = helper.make_node("MatMul", ["a", "b"], ["y"], name="scores")
    model = make_model([node], [tensor("a", ["N", 3, 4]), tensor("b", ["N", 4, 3])], [tensor("y", ["N", 3, 3])],
                       opset=19)
    policy = QdqPolicy(**EVERY, quantize_attention_matmuls=True)
    assert tensors_to_calibrate(model, policy) == ["a", "b"]
    assert tensors_to_calibrate(model, QdqPolicy(**EVERY)) == []
    with pytest.raises(ValueError, match="b"):
        qdq_model_from(model, {"a": 1.0}, policy)
    qdq, _ = qdq_model_from(model, {"a": 1.0, "b": 1.0}, policy)
    assert _ops(qdq) == Counter({"QuantizeLinear": 2, "DequantizeLinear": 2, "MatMul": 1})
    assert all(i.type.tensor_type.elem_type == TensorProto.FLOAT for i in qdq.graph.input)
