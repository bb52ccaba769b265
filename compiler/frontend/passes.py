"""Graph passes over ONNX models: the whole optimizer is the ``DEFAULT_PASSES`` list (constant folding lives in
``compiler.frontend.folding``).

Each pass takes a model and returns ``(model, changes)`` where ``changes`` says what it did.
``run_passes`` times each one, records node and initializer counts before and after, and checks in ONNX Runtime
that the result computes what the model did; ``run_passes_unchecked`` leaves the check to its caller.
The passes work on any ONNX input (dynamo or TorchScript exporter, other tools, onnx.helper).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from compiler.core.errors import InputError, VerificationError
from compiler.core.onnx_io import weightless_copy
from compiler.core.settings import Tolerance
from compiler.core.specs import ModelSpec
from compiler.frontend.folding import fold_constants

__all__ = ["PassResult", "run_passes", "run_passes_unchecked", "DEFAULT_PASSES", "infer_shapes", "fold_batchnorm",
           "cleanup"]

log = logging.getLogger(__name__)

Pass = Callable[[onnx.ModelProto], "tuple[onnx.ModelProto, dict[str, Any]]"]


@dataclass
class PassResult:
    name: str
    nodes_before: int
    nodes_after: int
    initializers_before: int
    initializers_after: int
    seconds: float
    changes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PassError(RuntimeError):
    """A pass failed; the message names it and the passes that ran before it."""


def infer_shapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """ONNX shape inference with data propagation; symbolic dims (B, S) stay symbolic.

    Runs on a copy without the large weights (protobuf cannot serialize a model over 2 GiB, and the
    weights need no copy) and sets the value_info it finds on ``model``, which it returns.
    """
    before = len(model.graph.value_info)
    _typed_in_place(model, data_prop=True)
    return model, {"value_infos": len(model.graph.value_info) - before}


def _typed_in_place(model: onnx.ModelProto, data_prop: bool = False) -> onnx.ModelProto:
    """Set ``model``'s value_info from shape inference on a copy whose large initializers are typed inputs."""
    skeleton = weightless_copy(model)
    graph = model.graph
    kept = {t.name for t in skeleton.graph.initializer} | {i.name for i in graph.input}
    large = {t.name for t in graph.initializer if t.name not in kept}
    inferred = onnx.shape_inference.infer_shapes(skeleton, data_prop=data_prop)
    del model.graph.value_info[:]
    model.graph.value_info.extend(vi for vi in inferred.graph.value_info if vi.name not in large)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def fold_batchnorm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Fold inference BatchNormalization into the preceding Conv/ConvTranspose/Gemm or MatMul+Add.

    A BatchNorm with no foldable producer (its input is shared, or not from such a node) becomes
    a per-channel Mul and Add, so no BatchNormalization node is left either way.
    """
    graph = model.graph
    typed = _typed_in_place(model)  # ranks, for BatchNorms that become Mul + Add
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    graph_outputs = {o.name for o in graph.output}
    folded, converted = [], []
    remove: list[onnx.NodeProto] = []
    for bn in [n for n in graph.node if n.op_type == "BatchNormalization"]:
        if (len(bn.output) > 1 and any(bn.output[1:])) or not all(i in inits for i in bn.input[1:5]):
            continue  # training-mode BN or statistics computed at run time: leave it
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        gamma, beta, mean, var = (numpy_helper.to_array(inits[i]).astype(np.float64) for i in bn.input[1:5])
        scale = gamma / np.sqrt(var + eps)
        shift = beta - mean * scale
        producer = producers.get(bn.input[0])
        ok = (producer is not None and consumers.get(bn.input[0], 0) == 1 and bn.input[0] not in graph_outputs)
        if ok and producer is not None and _fold_into(producer, scale, shift, inits, producers, graph):
            producer_out = bn.input[0]
            for n in graph.node:  # rewire consumers of the BN output to the producer output
                for k, name in enumerate(n.input):
                    if name == bn.output[0]:
                        n.input[k] = producer_out
            for out in graph.output:
                if out.name == bn.output[0]:
                    _rename_tensor(graph, producer_out, bn.output[0])
            remove.append(bn)
            folded.append(bn.name)
            continue
        rank = _rank(typed, bn.input[0])
        if rank is None:
            log.warning("BatchNormalization %s left as is: the rank of its input is unknown", bn.name)
            continue
        bshape = [-1] + [1] * (rank - 2)
        s_name, b_name = f"{bn.name or bn.output[0]}_scale", f"{bn.name or bn.output[0]}_shift"
        graph.initializer.extend([numpy_helper.from_array(scale.astype(np.float32).reshape(bshape), s_name),
                                  numpy_helper.from_array(shift.astype(np.float32).reshape(bshape), b_name)])
        mid = f"{bn.output[0]}_scaled"
        idx = list(graph.node).index(bn)
        graph.node.insert(idx, onnx.helper.make_node("Add", [mid, b_name], [bn.output[0]], name=f"{bn.name}_add"))
        graph.node.insert(idx, onnx.helper.make_node("Mul", [bn.input[0], s_name], [mid], name=f"{bn.name}_mul"))
        remove.append(bn)
        converted.append(bn.name)
    for n in remove:
        graph.node.remove(n)
    model, _ = cleanup(model)
    return model, {"folded": folded, "converted_to_mul_add": converted}


def _fold_into(producer: onnx.NodeProto, scale: np.ndarray, shift: np.ndarray, inits: dict[str, onnx.TensorProto],
               producers: dict[str, onnx.NodeProto], graph: onnx.GraphProto) -> bool:
    """Scale the producer's weights and bias in place; False when the producer cannot absorb the BN."""
    op = producer.op_type
    if op in ("Conv", "ConvTranspose"):
        if len(producer.input) < 2 or producer.input[1] not in inits:
            return False
        w = numpy_helper.to_array(inits[producer.input[1]]).astype(np.float64)
        group = next((a.i for a in producer.attribute if a.name == "group"), 1)
        if op == "Conv":
            w = w * scale.reshape([-1] + [1] * (w.ndim - 1))
        else:  # ConvTranspose weight is [C_in, C_out/group, k...]; output channel o = g*(C_out/g) + j
            c_in, c_out_g = w.shape[0], w.shape[1]
            w = w.reshape(group, c_in // group, c_out_g, *w.shape[2:])
            w = w * scale.reshape(group, 1, c_out_g, *([1] * (w.ndim - 3)))
            w = w.reshape(c_in, c_out_g, *w.shape[3:])
        bias = _bias(producer, 2, inits, len(scale))
        if bias is None:
            return False
        _set_init(graph, inits, producer, 1, w)
        _set_bias(graph, inits, producer, 2, bias * scale + shift)
        return True
    if op == "Gemm":
        attrs = {a.name: a for a in producer.attribute}
        if ("alpha" in attrs and attrs["alpha"].f != 1.0) or ("beta" in attrs and attrs["beta"].f != 1.0):
            return False
        if producer.input[1] not in inits:
            return False
        trans_b = attrs["transB"].i if "transB" in attrs else 0
        w = numpy_helper.to_array(inits[producer.input[1]]).astype(np.float64)
        w = w * (scale[:, None] if trans_b else scale[None, :])
        bias = _bias(producer, 2, inits, len(scale))
        if bias is None or bias.ndim != 1:
            return False
        _set_init(graph, inits, producer, 1, w)
        _set_bias(graph, inits, producer, 2, bias * scale + shift)
        return True
    if op == "Add":  # MatMul(x, W) + b, with a 2-D result so that BN's channel axis is W's last axis
        matmul = next((producers[i] for i in producer.input if i in producers and producers[i].op_type == "MatMul"),
                      None)
        b_name = next((i for i in producer.input if i in inits), None)
        if matmul is None or b_name is None or matmul.input[1] not in inits:
            return False
        w = numpy_helper.to_array(inits[matmul.input[1]]).astype(np.float64)
        b = numpy_helper.to_array(inits[b_name]).astype(np.float64)
        if w.ndim != 2 or w.shape[1] != len(scale) or b.shape not in ((len(scale),), (1, len(scale))):
            return False
        _set_init(graph, inits, matmul, 1, w * scale[None, :])
        _set_init(graph, inits, producer, list(producer.input).index(b_name), b * scale + shift)
        return True
    return False


def _bias(node: onnx.NodeProto, index: int, inits: dict[str, onnx.TensorProto], channels: int) -> np.ndarray | None:
    if len(node.input) > index and node.input[index]:
        if node.input[index] not in inits:
            return None
        return numpy_helper.to_array(inits[node.input[index]]).astype(np.float64)
    return np.zeros(channels)


def _set_init(graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto], node: onnx.NodeProto, index: int,
              value: np.ndarray) -> None:
    """Write a new initializer for ``node.input[index]`` (a fresh name: the old one may be shared)."""
    old = node.input[index]
    dtype = numpy_helper.to_array(inits[old]).dtype if old in inits else np.float32
    new = f"{old}_bnfolded" if not old.endswith("_bnfolded") else old
    tensor = numpy_helper.from_array(value.astype(dtype), new)
    if new in inits:
        graph.initializer.remove(inits[new])
    graph.initializer.append(tensor)
    inits[new] = tensor
    node.input[index] = new


def _set_bias(graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto], node: onnx.NodeProto, index: int,
              value: np.ndarray) -> None:
    if len(node.input) <= index:
        node.input.extend([""] * (index + 1 - len(node.input)))
    if not node.input[index]:
        name = f"{node.name or node.output[0]}_bias_bnfolded"
        tensor = numpy_helper.from_array(value.astype(np.float32), name)
        graph.initializer.append(tensor)
        inits[name] = tensor
        node.input[index] = name
        return
    _set_init(graph, inits, node, index, value)


def _rank(model: onnx.ModelProto, name: str) -> int | None:
    for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return len(vi.type.tensor_type.shape.dim)
    return None


def _rename_tensor(graph: onnx.GraphProto, old: str, new: str) -> None:
    for n in graph.node:
        for k, name in enumerate(n.input):
            if name == old:
                n.input[k] = new
        for k, name in enumerate(n.output):
            if name == old:
                n.output[k] = new


def cleanup(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Remove Identity nodes, nodes whose outputs nobody uses, and unused initializers."""
    graph = model.graph
    graph_outputs = {o.name for o in graph.output}
    graph_inputs = {i.name for i in graph.input}
    identities = 0
    for node in [n for n in graph.node if n.op_type == "Identity"]:
        src, dst = node.input[0], node.output[0]
        if dst in graph_outputs:
            if src in graph_inputs or src in graph_outputs or any(i.name == src for i in graph.initializer):
                continue  # the Identity is what makes this output a distinct tensor
            graph.node.remove(node)
            _rename_tensor(graph, src, dst)
        else:
            graph.node.remove(node)
            for n in graph.node:
                for k, name in enumerate(n.input):
                    if name == dst:
                        n.input[k] = src
        identities += 1
    # dead nodes: walk back from the outputs
    needed = set(graph_outputs)
    keep: list[onnx.NodeProto] = []
    for node in reversed(list(graph.node)):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
            for attr in node.attribute:  # subgraphs (If/Loop) read outer tensors by name
                if attr.HasField("g"):
                    needed.update(_outer_names(attr.g))
    dead = len(graph.node) - len(keep)
    if dead:
        del graph.node[:]
        graph.node.extend(reversed(keep))
    unused = [i for i in graph.initializer if i.name not in needed]
    for init in unused:
        graph.initializer.remove(init)
    return model, {"identities_removed": identities, "dead_nodes_removed": dead,
                   "initializers_removed": len(unused)}


def _outer_names(g: onnx.GraphProto) -> set[str]:
    names = {i for n in g.node for i in n.input}
    for n in g.node:
        for attr in n.attribute:
            if attr.HasField("g"):
                names |= _outer_names(attr.g)
    return names


DEFAULT_PASSES: list[tuple[str, Pass]] = [
    ("shape_inference", infer_shapes),
    ("constant_folding", fold_constants),
    ("batchnorm_folding", fold_batchnorm),
    ("cleanup", cleanup),
    ("final_shape_inference", infer_shapes),  # value_info for the rewritten graph
]


def run_passes(model: onnx.ModelProto, feeds: Mapping[str, Any] | None = None, *, spec: ModelSpec | None = None,
               passes: list[tuple[str, Pass]] | None = None, tolerance: Tolerance | None = None,
               ) -> tuple[onnx.ModelProto, list[PassResult]]:
    """Run the passes (``DEFAULT_PASSES``) and check their result, as ``trtc export``'s pass check does: ONNX Runtime
    (CPU) runs ``model`` as it came and as the passes left it on the same inputs, and a result past ``tolerance``
    (default ``Tolerance()``) raises VerificationError. So the graph returned computes what ``model`` did on them.

    ``feeds``: the inputs by name (arrays; a list for a sequence input); without them ``spec.example_feed(1)`` when
    ``spec`` is given, else the values ``trtc export`` generates for the shapes the model declares. InputError when
    the model leaves a shape open and neither is given, or when ONNX Runtime cannot load ``model`` or run it on the
    inputs (give real ones). ONNX Runtime holds one copy of ``model`` while the passes run. ``model`` is changed in
    place (value_info, folded weights): pass a copy to keep it. ``run_passes_unchecked`` is the same without the
    check.
    """
    from compiler.backends.registry import check_runner
    from compiler.frontend.loading import onnx_input_spec
    from compiler.frontend.verify import checked, onnxruntime_errors, ort_message

    errors = onnxruntime_errors()
    if feeds is None:
        spec = spec or onnx_input_spec(model)
        feeds, inputs = spec.example_feed(1), "generated values"
    else:
        inputs = "the given feeds"
    tol = tolerance or Tolerance()
    reference = check_runner("onnxruntime", model, ["CPUExecutionProvider"])
    try:
        with reference:
            want = reference.infer(feeds)
    except errors as err:
        raise InputError(f"ONNX Runtime cannot run the model on {inputs}: {ort_message(err)}; give feeds that it "
                         "accepts") from err
    folded, results = run_passes_unchecked(model, passes)
    candidate = check_runner("onnxruntime", folded, ["CPUExecutionProvider"])
    try:
        with candidate:
            got = candidate.infer(feeds)
    except errors as err:
        raise VerificationError(f"pass check: ONNX Runtime cannot run the model the passes made, while it runs the "
                                f"original ({ort_message(err)}); report the model") from err
    checked(got, want, 1, tol, "pass check (folded ONNX vs the original)", "the passes' result", "the original")
    return folded, results


def run_passes_unchecked(model: onnx.ModelProto, passes: list[tuple[str, Pass]] | None = None,
                         ) -> tuple[onnx.ModelProto, list[PassResult]]:
    """Run the passes in order, unchecked: nothing here runs the result (``run_passes`` does). For callers that
    check it themselves, as ``trtc export`` does against eager PyTorch or the original ONNX, on the GPU where there is
    one. A failing pass is reported with the passes that ran before it."""
    results: list[PassResult] = []
    for name, fn in passes or DEFAULT_PASSES:
        nodes, inits = len(model.graph.node), len(model.graph.initializer)
        start = time.perf_counter()
        try:
            model, changes = fn(model)
        except Exception as err:
            ran = ", ".join(r.name for r in results) or "none"
            raise PassError(f"pass {name} failed after [{ran}]: {err}") from err
        results.append(PassResult(name, nodes, len(model.graph.node), inits, len(model.graph.initializer),
                                  time.perf_counter() - start, changes))
        log.debug("pass %s: nodes %d -> %d, initializers %d -> %d", name, nodes, len(model.graph.node), inits,
                 len(model.graph.initializer))
    return model, results
