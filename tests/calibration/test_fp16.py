"""FP16 graphs for strongly typed TensorRT: accuracy on the bundled examples, the data-driven overflow check,
--keep-fp32, untouched shape computations, and valid, strictly typed results."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from calibration.fp16 import Fp16Report, fp16_model_from
from calibration.fp16_policy import FP32_OPS, Fp16Policy
from compiler.core.errors import InputError
from compiler.core.onnx_io import MAX_IR_VERSION, ort_session
from tests.onnx_helpers import make_model, tensor

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
# FP16 keeps 11 significant bits (unit roundoff 2^-11 = 4.9e-4). Observed worst max |error| over the four
# examples, relative to max |FP32 output|: 5.1e-4 in ORT CPU (which computes ops without FP16 kernels in FP32)
# and 1.1e-3 with every node evaluated in its declared type (onnx.reference). 5e-3 is ~10 roundoffs: room for
# error compounding over the layers, while a wrong weight or a dropped Cast shows up far above it.
REL_MAX_ERROR = 5e-3


def _feeds(rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    mask = np.concatenate([np.ones((3, 15)), np.zeros((3, 5))], axis=1).astype(np.int64)
    return {
        "transformer": {"input_ids": rng.integers(0, 1000, (3, 20)).astype(np.int64), "attention_mask": mask},
        "resnet_digits": {"images": rng.standard_normal((4, 1, 8, 8)).astype(np.float32)},
        "mlp": {"x": rng.standard_normal((4, 64)).astype(np.float32)},
        "two_input": {"image": rng.standard_normal((4, 3, 32, 32)).astype(np.float32),
                      "features": rng.standard_normal((4, 16)).astype(np.float32)},
    }


FEEDS = _feeds(np.random.default_rng(0))


def _export(name: str, path: Path) -> onnx.ModelProto:
    import torch

    from examples import models

    b = torch.export.Dim("B", min=1, max=64)
    if name == "transformer":
        s = torch.export.Dim("S", min=1, max=512)
        args: tuple[Any, ...] = (torch.randint(0, 100, (2, 16)), torch.ones(2, 16, dtype=torch.int64))
        module: torch.nn.Module = models.transformer_encoder()
        dims: tuple[dict[int, Any], ...] = ({0: b, 1: s}, {0: b, 1: s})
    elif name == "resnet_digits":
        module, args, dims = models.resnet_digits(), (torch.randn(2, 1, 8, 8),), ({0: b},)
    elif name == "mlp":
        module, args, dims = models.mlp(), (torch.randn(2, 64),), ({0: b},)
    else:
        module, args, dims = models.two_input(), (torch.randn(2, 3, 32, 32), torch.randn(2, 16)), ({0: b}, {0: b})
    torch.onnx.export(module, args, str(path), dynamo=True, input_names=list(FEEDS[name]), output_names=["out"],
                      dynamic_shapes=dims)
    return onnx.load(str(path))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], onnx.ModelProto]:
    """Exports an example on first use, once per module (about 5 s each)."""
    folder = tmp_path_factory.mktemp("fp16")
    return functools.cache(lambda name: _export(name, folder / f"{name}.onnx"))


@pytest.fixture(params=list(FEEDS))
def example(request: pytest.FixtureRequest,
            exported: Callable[[str], onnx.ModelProto]) -> tuple[str, onnx.ModelProto]:
    return request.param, exported(request.param)


@pytest.fixture
def transformer(exported: Callable[[str], onnx.ModelProto]) -> onnx.ModelProto:
    return exported("transformer")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _elem_type(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type


def _dims(vi: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def _observed_max_abs(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, float]:
    """Max |x| of every float tensor on one batch (what calibration.observe.collect_max_abs measures)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    names = [vi.name for vi in inferred.graph.value_info if _elem_type(vi) == FLOAT]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n, FLOAT, None) for n in names)
    outputs = ort_session(probe).run(None, feed)
    return {o.name: float(np.abs(v).max()) for o, v in zip(probe.graph.output, outputs)}


def _typed_run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    """The first output with every node evaluated in its declared type (onnx.reference), as TensorRT runs it."""
    outputs: Any = ReferenceEvaluator(model).run(None, feed)
    return np.asarray(outputs[0])


def _assert_valid(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert model.ir_version <= MAX_IR_VERSION


# -- the bundled examples ------------------------------------------------------------------------------------------


def test_examples_match_fp32_and_keep_fp32_io(example: tuple[str, onnx.ModelProto]) -> None:
    name, model = example
    feed = FEEDS[name]
    before = model.SerializeToString()
    fp16, report = fp16_model_from(model, Fp16Policy())

    assert model.SerializeToString() == before, "the input model was modified"
    _assert_valid(fp16)
    assert report.fp32_nodes == {} and report.clipped_initializers == []
    assert report.fp16_nodes > 0 and report.casts_inserted >= 1
    for old, new in zip([*model.graph.input, *model.graph.output], [*fp16.graph.input, *fp16.graph.output]):
        assert (new.name, _elem_type(new), _dims(new)) == (old.name, _elem_type(old), _dims(old))
    assert "B" in _dims(fp16.graph.input[0])

    initializers = {t.name: t for t in fp16.graph.initializer}
    weights = [initializers[i] for n in fp16.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")
               for i in n.input if i in initializers]
    assert weights and all(w.data_type == FLOAT16 for w in weights)

    reference = ort_session(model).run(None, feed)[0]
    scale = float(np.abs(reference).max())
    # ORT CPU, as the task's harness runs it, and every node in its declared type, as TensorRT runs it
    for result in (ort_session(fp16).run(None, feed)[0], _typed_run(fp16, feed)):
        assert result.dtype == np.float32
        assert _cosine(result, reference) > 0.999
        np.testing.assert_allclose(result, reference, rtol=0, atol=REL_MAX_ERROR * scale)


def test_examples_observed_ranges_keep_nothing_in_fp32(example: tuple[str, onnx.ModelProto]) -> None:
    # the transformer's -1e4 padding bias is the largest activation (1.0e4) and fits FP16
    name, model = example
    max_abs = _observed_max_abs(model, FEEDS[name])
    _, report = fp16_model_from(model, Fp16Policy(), max_abs)
    assert report.fp32_nodes == {}


def test_keep_io_types_false_makes_fp16_io(example: tuple[str, onnx.ModelProto]) -> None:
    name, model = example
    fp16, _ = fp16_model_from(model, Fp16Policy(keep_io_types=False))
    _assert_valid(fp16)
    assert all(_elem_type(vi) in (FLOAT16, TensorProto.INT64) for vi in [*fp16.graph.input, *fp16.graph.output])
    feed = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in FEEDS[name].items()}
    result = ort_session(fp16).run(None, feed)[0]
    assert result.dtype == np.float16
    assert _cosine(result, ort_session(model).run(None, FEEDS[name])[0]) > 0.999


# -- the transformer: shape computations, the padding mask, --keep-fp32 --------------------------------------------


def test_integer_and_shape_subgraph_untouched(transformer: onnx.ModelProto) -> None:
    inferred = onnx.shape_inference.infer_shapes(transformer)
    types = {vi.name: _elem_type(vi) for vi in [*inferred.graph.value_info, *inferred.graph.input]}
    types |= {t.name: t.data_type for t in transformer.graph.initializer}
    int_nodes = [n for n in transformer.graph.node if all(types[t] != FLOAT for t in [*n.input, *n.output] if t)]
    assert Counter(n.op_type for n in int_nodes) >= Counter({"Shape": 2, "Range": 1, "Concat": 2, "Squeeze": 1})

    fp16, _ = fp16_model_from(transformer, Fp16Policy())
    written = {n.SerializeToString() for n in fp16.graph.node}
    assert all(n.SerializeToString() in written for n in int_nodes)
    new_types = {t.name: t.data_type for t in fp16.graph.initializer}
    assert all(new_types[name] == dtype for name, dtype in types.items()
               if name in new_types and dtype != FLOAT)
    # the mask's Cast(to=FLOAT) now produces FP16 for the FP16 Sub after it; the embedding tables are FP16
    cast = next(n for n in fp16.graph.node if n.name == "node__to_copy")
    assert helper.get_attribute_value(cast.attribute[0]) == FLOAT16
    assert new_types["tok.weight"] == FLOAT16


def test_keep_fp32_by_node_name_and_op_type(transformer: onnx.ModelProto,
                                            caplog: pytest.LogCaptureFixture) -> None:
    softmaxes = [n.name for n in transformer.graph.node if n.op_type == "Softmax"]
    with caplog.at_level(logging.DEBUG, logger="calibration.fp16"):  # per node: debug; the report lists them
        fp16, report = fp16_model_from(transformer, Fp16Policy(keep_fp32=frozenset({"Softmax", "node_gelu"})))
    _assert_valid(fp16)
    assert report.fp32_nodes == dict.fromkeys([*softmaxes, "node_gelu"], "--keep-fp32")
    assert f"kept Softmax {softmaxes[0]} in FP32: --keep-fp32" in caplog.text
    types = {vi.name: _elem_type(vi) for vi in fp16.graph.value_info}
    for node in fp16.graph.node:
        if node.name in report.fp32_nodes:
            assert all(types[t] == FLOAT for t in [*node.input, *node.output])
        if node.name == "node_gelu_1":
            assert types[node.output[0]] == FLOAT16
    # one Cast per tensor and direction around each kept node, plus the output Cast
    assert report.casts_inserted == 1 + 3 * 2
    result = ort_session(fp16).run(None, FEEDS["transformer"])[0]
    reference = ort_session(transformer).run(None, FEEDS["transformer"])[0]
    assert _cosine(result, reference) > 0.999


# -- the data-driven overflow check ---------------------------------------------------------------------------------


def _overflowing_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Mul", ["x", "k_up"], ["big"], name="scale_up"),
             helper.make_node("Add", ["big", "b"], ["big_shifted"], name="shift"),
             helper.make_node("Mul", ["big_shifted", "k_down"], ["small"], name="scale_down"),
             helper.make_node("Relu", ["small"], ["y"], name="relu")]
    return make_model(nodes, [tensor("x", ["B", 4])], [tensor("y", ["B", 4])],
                      {name: np.array(v, np.float32) for name, v in [("k_up", 1000.0), ("b", 1.0), ("k_down", 0.001)]})


def test_overflowing_tensor_keeps_producer_and_consumers_in_fp32(caplog: pytest.LogCaptureFixture) -> None:
    model = _overflowing_model()
    x = np.array([[100.0, -50.0, 80.0, 3.0]], np.float32)  # x * 1000 reaches 1e5 > 65504
    reference = ort_session(model).run(None, {"x": x})[0]
    max_abs = _observed_max_abs(model, {"x": x})
    assert max_abs["big"] == pytest.approx(1e5)

    with caplog.at_level(logging.DEBUG, logger="calibration.fp16"):  # per node: debug; the report lists them
        fp16, report = fp16_model_from(model, Fp16Policy(), max_abs)
    _assert_valid(fp16)
    assert report.fp32_nodes == {"scale_up": "produces big with max |x| 1e+05 > 32752",
                                 "shift": "produces big_shifted with max |x| 1e+05 > 32752",
                                 "scale_down": "consumes big_shifted with max |x| 1e+05 > 32752"}
    assert "kept Mul scale_up in FP32: produces big with max |x| 1e+05 > 32752" in caplog.text
    assert report.fp16_nodes == 1  # relu
    for result in (ort_session(fp16).run(None, {"x": x})[0], _typed_run(fp16, {"x": x})):
        assert np.isfinite(result).all()
        np.testing.assert_allclose(result, reference, rtol=1e-3)

    # Without the observed ranges every node is FP16 and x * 1000 overflows. The ONNX reference evaluator runs
    # each node in its declared type, as TensorRT does; ORT CPU would hide the overflow, since it has no FP16
    # Mul/Add kernels and computes the whole chain in FP32.
    blind, report = fp16_model_from(model, Fp16Policy())
    assert report.fp32_nodes == {}
    with np.errstate(over="ignore"):
        result = _typed_run(blind, {"x": x})
    assert np.isinf(result[0, [0, 2]]).all()


# -- small graphs: tables, constants, attributes, errors -----------------------------------------------------------


def test_fp32_ops_shared_initializer_and_constants() -> None:
    # Exp is in FP32_OPS and shares `w` with an FP16 Mul; Range has no float16 schema; the Constant and the
    # ConstantOfShape feed FP16 nodes and become FP16 themselves
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"], name="mul"),
             helper.make_node("Exp", ["w"], ["ew"], name="exp"),
             helper.make_node("Add", ["xw", "ew"], ["s"], name="add"),
             helper.make_node("Constant", [], ["c"], name="const", value_float=2.0),
             helper.make_node("Mul", ["s", "c"], ["s2"], name="mul_c"),
             helper.make_node("Shape", ["x"], ["shape"], name="shape"),
             helper.make_node("ConstantOfShape", ["shape"], ["ones"], name="ones",
                              value=helper.make_tensor("v", FLOAT, [1], [1.0])),
             helper.make_node("Add", ["s2", "ones"], ["s3"], name="add_ones"),
             helper.make_node("Range", ["r0", "r1", "r2"], ["r"], name="range"),
             helper.make_node("Add", ["s3", "r"], ["y"], name="add_r")]
    model = make_model(nodes, [tensor("x", ["B", 4])], [tensor("y", ["B", 4])],
                       {"w": np.arange(4, dtype=np.float32) / 4, "r0": np.array(0, np.float32),
                        "r1": np.array(4, np.float32), "r2": np.array(1, np.float32)})
    fp16, report = fp16_model_from(model, Fp16Policy())
    _assert_valid(fp16)
    assert report.fp32_nodes == {"exp": f"op type Exp in FP32_OPS ({FP32_OPS['Exp']})",
                                 "range": "opset 17 Range does not accept float16 for T"}
    initializers = {t.name: t.data_type for t in fp16.graph.initializer}
    assert initializers == {"w": FLOAT, "w_fp16": FLOAT16, "r0": FLOAT, "r1": FLOAT, "r2": FLOAT}
    by_name = {n.name: n for n in fp16.graph.node}
    assert by_name["const"].attribute[0].t.data_type == FLOAT16
    assert by_name["ones"].attribute[0].t.data_type == FLOAT16
    assert [n.op_type for n in fp16.graph.node].count("Cast") == report.casts_inserted == 4  # x, ew, r, y

    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    reference = ort_session(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(ort_session(fp16).run(None, {"x": x})[0], reference, rtol=2e-3, atol=2e-3)


def test_huge_mask_fill_is_clipped_to_fp16_range(caplog: pytest.LogCaptureFixture) -> None:
    fill = np.float32(np.finfo(np.float32).min)  # masked_fill(..., finfo.min), as Hugging Face models do
    nodes = [helper.make_node("Add", ["x", "bias"], ["scores"], name="add_mask"),
             helper.make_node("Softmax", ["scores"], ["y"], name="softmax", axis=-1)]
    model = make_model(nodes, [tensor("x", ["B", 4])], [tensor("y", ["B", 4])],
                       {"bias": np.array([0, 0, fill, fill], np.float32)})
    with caplog.at_level(logging.WARNING, logger="calibration.fp16"):
        fp16, report = fp16_model_from(model, Fp16Policy())
    _assert_valid(fp16)
    assert report.clipped_initializers == ["bias"]
    assert "clipped 1 FP16 constants" in caplog.text
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    result = _typed_run(fp16, {"x": x})
    np.testing.assert_allclose(result, ort_session(model).run(None, {"x": x})[0], atol=1e-3)


def test_subgraph_reads_stay_fp32() -> None:
    then_branch = helper.make_graph([helper.make_node("Mul", ["h", "h"], ["t_out"])], "then", [],
                                    [tensor("t_out", ["B", 4])])
    else_branch = helper.make_graph([helper.make_node("Neg", ["h"], ["e_out"])], "else", [],
                                    [tensor("e_out", ["B", 4])])
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="relu"),
             helper.make_node("Sigmoid", ["x"], ["g"], name="sigmoid"),
             helper.make_node("If", ["cond"], ["branch"], name="if", then_branch=then_branch,
                              else_branch=else_branch),
             helper.make_node("Add", ["branch", "g"], ["y"], name="add")]
    model = make_model(nodes, [tensor("x", ["B", 4]), tensor("cond", [], TensorProto.BOOL)],
                       [tensor("y", ["B", 4])])
    fp16, report = fp16_model_from(model, Fp16Policy())
    _assert_valid(fp16)
    assert set(report.fp32_nodes) == {"relu", "if"}
    assert report.fp32_nodes["relu"] == "produces h, which a control-flow subgraph reads"
    feed = {"x": np.array([[-1.0, 0.5, 2.0, 3.0]], np.float32), "cond": np.array(True)}
    np.testing.assert_allclose(ort_session(fp16).run(None, feed)[0], ort_session(model).run(None, feed)[0],
                               rtol=1e-3)


def test_the_emulation_keeps_a_weight_a_subgraph_reads() -> None:
    """An INT8 weight whose DequantizeLinear the emulation computes stays while a control-flow subgraph reads it."""
    from calibration.fp16_rounding import fp16_rounding_emulation

    w = np.arange(-8, 8, dtype=np.int8).reshape(4, 4)
    then_branch = helper.make_graph([helper.make_node("Identity", ["w"], ["t_out"])], "then", [],
                                    [tensor("t_out", [4, 4], TensorProto.INT8)])
    else_branch = helper.make_graph([helper.make_node("Neg", ["w"], ["e_out"])], "else", [],
                                    [tensor("e_out", [4, 4], TensorProto.INT8)])
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], name="dq"),
             helper.make_node("MatMul", ["x", "wf"], ["y"], name="mm"),
             helper.make_node("If", ["cond"], ["branch"], name="if", then_branch=then_branch,
                              else_branch=else_branch)]
    model = make_model(nodes, [tensor("x", ["B", 4], TensorProto.FLOAT16), tensor("cond", [], TensorProto.BOOL)],
                       [tensor("y", ["B", 4], TensorProto.FLOAT16), tensor("branch", [4, 4], TensorProto.INT8)],
                       {"w": w, "s": np.float16(0.5)})
    emulated = fp16_rounding_emulation(model)
    assert "w" in {t.name for t in emulated.graph.initializer}
    assert "DequantizeLinear" not in {n.op_type for n in emulated.graph.node}  # computed by the emulation
    x = np.eye(4, dtype=np.float32)
    for cond, expected in ((True, w), (False, -w)):
        y, got = ort_session(emulated).run(None, {"x": x, "cond": np.array(cond)})
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(y, w.astype(np.float32) * 0.5)


def test_unconvertible_attribute_type_fails_naming_the_node() -> None:
    nodes = [helper.make_node("HannWindow", ["n"], ["window"], name="hann", output_datatype=FLOAT),
             helper.make_node("Mul", ["window", "x"], ["y"], name="mul")]
    model = make_model(nodes, [tensor("x", [8])], [tensor("y", [8])], {"n": np.array(8, np.int64)})
    with pytest.raises(ValueError, match=r"node 'hann' \(HannWindow\).*--keep-fp32 HannWindow"):
        fp16_model_from(model, Fp16Policy())
    fp16, report = fp16_model_from(model, Fp16Policy(keep_fp32=frozenset({"HannWindow"})))
    _assert_valid(fp16)
    assert report.fp32_nodes == {"hann": "--keep-fp32"}


def test_policy_validation_and_report() -> None:
    with pytest.raises(InputError, match="overflow_threshold"):
        Fp16Policy(overflow_threshold=1e6)
    with pytest.raises(InputError, match="keep_fp32"):
        Fp16Policy(keep_fp32="Softmax")  # type: ignore[arg-type]
    assert Fp16Policy(keep_fp32={"a"}).keep_fp32 == frozenset({"a"})  # type: ignore[arg-type]
    report = Fp16Report(fp32_nodes={"n": "--keep-fp32"}, fp16_nodes=3, casts_inserted=2)
    assert report.to_dict() == {"fp32_nodes": {"n": "--keep-fp32"}, "fp16_nodes": 3, "fp16_node_names": [],
                                "casts_inserted": 2, "clipped_initializers": []}
