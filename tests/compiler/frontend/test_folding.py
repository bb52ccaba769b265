"""Constant folding keeps what a graph computes where onnx-graphsurgeon alone would not (compiler.frontend.folding)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler.core.onnx_io import ort_session
from compiler.frontend.folding import fold_constants
from compiler.frontend.passes import infer_shapes
from tests.onnx_helpers import make_model, tensor

X = np.random.default_rng(0).normal(size=(3, 4, 5)).astype(np.float32)

# Every Shape-15 case of ONNX's node tests (onnx/backend/test/case/node/shape.py), as (name, start, end)
SHAPE_15_CASES = [("shape", None, None), ("shape_start_1", 1, None), ("shape_end_1", None, 1),
                  ("shape_start_negative_1", -1, None), ("shape_end_negative_1", None, -1),
                  ("shape_start_1_end_negative_1", 1, -1), ("shape_start_1_end_2", 1, 2),
                  ("shape_clip_start", -10, None), ("shape_clip_end", None, 10),
                  ("shape_start_greater_than_end", 2, 1)]


def shape_model(start: int | None, end: int | None, dims: list[int | str]) -> onnx.ModelProto:
    attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    return make_model([helper.make_node("Shape", ["x"], ["y"], **attrs)], [tensor("x", dims)],
                      [tensor("y", [None], TensorProto.INT64)], opset=15)


def ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize(("name", "start", "end"), SHAPE_15_CASES, ids=[c[0] for c in SHAPE_15_CASES])
def test_each_shape_15_case_folds_to_the_sliced_dims(name: str, start: int | None, end: int | None) -> None:
    """A Shape(start, end) of a static 3x4x5 input folds to exactly ``x.shape[start:end]`` (onnx-graphsurgeon's own
    shape folding gave the whole [3, 4, 5]): no Shape node is left and ONNX Runtime returns those dims."""
    folded, _ = fold_constants(infer_shapes(shape_model(start, end, [3, 4, 5]))[0])
    assert ops(folded)["Shape"] == 0
    want = np.array(X.shape[slice(start, end)], dtype=np.int64)
    np.testing.assert_array_equal(ort_session(folded).run(None, {"x": X})[0], want)


def test_a_static_slice_of_a_dynamic_shape_folds_and_a_dynamic_one_stays() -> None:
    """Shape(start=1) of a Bx4x5 input folds to [4, 5] (the batch is not in the slice); Shape(end=2) keeps its node
    (the batch is) and still returns [B, 4] at two batch sizes."""
    static, changes = fold_constants(infer_shapes(shape_model(1, None, ["B", 4, 5]))[0])
    assert ops(static)["Shape"] == 0 and changes["sliced_shapes_folded"] == 1
    dynamic, _ = fold_constants(infer_shapes(shape_model(None, 2, ["B", 4, 5]))[0])
    assert ops(dynamic)["Shape"] == 1
    for batch in (2, 7):
        x = np.zeros((batch, 4, 5), np.float32)
        np.testing.assert_array_equal(ort_session(dynamic).run(None, {"x": x})[0], [batch, 4])


@pytest.mark.parametrize("reader", ["Gather", "Slice"])
def test_a_gather_or_slice_of_a_sliced_shape_is_not_read_off_the_whole_shape(reader: str) -> None:
    """Shape(start=1) of a 3xBx4x5 input is [B, 4, 5]; element 2 of it is 5, where onnx-graphsurgeon's folding of
    Shape->Gather / Shape->Slice reads element 2 of the whole shape (4). The folded graph returns 5."""
    if reader == "Gather":
        node = helper.make_node("Gather", ["s", "i"], ["y"])
        inits = {"i": np.array([2], np.int64)}
    else:
        node = helper.make_node("Slice", ["s", "start", "stop"], ["y"])
        inits = {"start": np.array([2], np.int64), "stop": np.array([3], np.int64)}
    model = make_model([helper.make_node("Shape", ["x"], ["s"], start=1), node], [tensor("x", [3, "B", 4, 5])],
                       [tensor("y", [1], TensorProto.INT64)], inits, opset=15)
    x = np.zeros((3, 2, 4, 5), np.float32)
    folded, _ = fold_constants(infer_shapes(model)[0])
    np.testing.assert_array_equal(ort_session(folded).run(None, {"x": x})[0], [5])


def cast_model(op: str, constant: np.ndarray | None) -> onnx.ModelProto:
    """Shape(x) -> Cast(float) -> op(., constant) -> Cast(int64): the pattern of onnx-graphsurgeon's cast elision."""
    inputs = ["f", "c"] if constant is not None else ["f", "f"]
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["f"], to=TensorProto.FLOAT),
             helper.make_node(op, inputs, ["m"]), helper.make_node("Cast", ["m"], ["y"], to=TensorProto.INT64)]
    inits = {"c": constant} if constant is not None else {}
    return make_model(nodes, [tensor("x", ["B", 5])], [tensor("y", [2], TensorProto.INT64)], inits)


INEXACT = [("Mul", np.array([0.5], np.float32)), ("Sub", np.array([0.5], np.float32)), ("Equal", None),
           ("Greater", None)]


@pytest.mark.parametrize(("op", "constant"), INEXACT)
def test_inexact_cast_elision_is_left_alone(op: str, constant: np.ndarray | None) -> None:
    """int(size * 0.5), int(size - 0.5), size == size: onnx-graphsurgeon's cast elision would cast 0.5 to 0 (or hand
    Equal's bool to an int64 tensor); the folded graph returns what the original does at two batch sizes."""
    model = cast_model(op, constant)
    folded, _ = fold_constants(infer_shapes(model)[0])
    for batch in (3, 8):
        x = np.zeros((batch, 5), np.float32)
        want = ort_session(model).run(None, {"x": x})[0]
        np.testing.assert_array_equal(ort_session(folded).run(None, {"x": x})[0], want)


def test_exact_cast_elision_still_happens() -> None:
    """An integral constant (x 2.0) keeps onnx-graphsurgeon's elision, as before: the Casts go, the result stays."""
    model = cast_model("Mul", np.array([2.0], np.float32))
    folded, changes = fold_constants(infer_shapes(model)[0])
    assert ops(folded)["Cast"] == 0 and changes["kept_from_graphsurgeon"] == []
    x = np.zeros((3, 5), np.float32)
    np.testing.assert_array_equal(ort_session(folded).run(None, {"x": x})[0], [6, 10])


def test_float_constant_nodes_stay_float32() -> None:
    """Constant(value_float=1.5) and Constant(value_floats=[...]) fold into float32 initializers (onnx-graphsurgeon
    alone made float64 ones, which the float Add reading them rejects)."""
    nodes = [helper.make_node("Constant", [], ["c"], value_float=1.5),
             helper.make_node("Constant", [], ["d"], value_floats=[1.5, 2.0]),
             helper.make_node("Add", ["c", "d"], ["e"]), helper.make_node("Add", ["x", "e"], ["y"])]
    folded, _ = fold_constants(make_model(nodes, [tensor("x", [2])], [tensor("y", [2])]))
    assert ops(folded) == Counter({"Add": 1})
    assert [i.data_type for i in folded.graph.initializer] == [TensorProto.FLOAT]
    np.testing.assert_array_equal(ort_session(folded).run(None, {"x": np.zeros(2, np.float32)})[0], [3.0, 3.5])


def test_a_model_with_optional_values_is_left_unfolded() -> None:
    """Optional-typed values, which onnx-graphsurgeon's exporter cannot write: the model comes back as it was, with the
    reason in the changes, and still runs."""
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2]))
    nodes = [helper.make_node("Optional", ["x"], ["o"]), helper.make_node("OptionalGetElement", ["o"], ["y"])]
    graph = helper.make_graph(nodes, "t", [tensor("x", [2])], [tensor("y", [2])],
                              value_info=[helper.make_value_info("o", opt)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    folded, changes = fold_constants(model)
    assert "optional" in changes["skipped"] and ops(folded) == ops(model)
    x = np.ones(2, np.float32)
    np.testing.assert_array_equal(ort_session(folded).run(None, {"x": x})[0], x)


def test_an_ir3_model_comes_back_valid() -> None:
    """IR 3 lists initializers among the graph inputs; onnx-graphsurgeon drops them from there, so the folded model
    says IR 4 (where that is valid) and passes onnx.checker."""
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "t",
                              [tensor("x", [2]), tensor("w", [2])], [tensor("y", [2])],
                              [onnx.numpy_helper.from_array(np.ones(2, np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=3)
    folded, _ = fold_constants(model)
    assert folded.ir_version >= 4 and [i.name for i in folded.graph.input] == ["x"]
    onnx.checker.check_model(folded)


def test_castlike_of_a_constant_folds() -> None:
    """CastLike(constant, x) takes only x's type, so it folds with its constant (the dynamo exporter writes a Conv's
    zero bias so, which kept that bias, and the BatchNorm after the Conv, from folding): no CastLike is left and the
    result is the same."""
    value = helper.make_tensor("v", TensorProto.DOUBLE, [2], [0.5, 1.5])
    nodes = [helper.make_node("Constant", [], ["c"], value=value), helper.make_node("CastLike", ["c", "x"], ["d"]),
             helper.make_node("Add", ["x", "d"], ["y"])]
    model = make_model(nodes, [tensor("x", ["B", 2])], [tensor("y", ["B", 2])])
    folded, _ = fold_constants(infer_shapes(model)[0])
    assert ops(folded) == Counter({"Add": 1})
    x = np.ones((3, 2), np.float32)
    np.testing.assert_array_equal(ort_session(folded).run(None, {"x": x})[0], x + np.array([0.5, 1.5]))
