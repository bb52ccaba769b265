"""Which layers lose the most in a reduced precision, each measured alone: every candidate layer runs beside an
FP32 twin reading the same inputs, so one ONNX Runtime run per slice of a batch ranks them all (what the gate's
fallback keeps out of the reduced precision first)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import onnx

from calibration.slices import CHUNK_VALUES, sliced_runs, takes_any_batch
from compiler.backends.registry import check_runner
from compiler.core import defaults
from compiler.core.onnx_io import FreshNames, TemporaryOnnxFile

__all__ = ["layer_errors"]


def layer_errors(candidate: onnx.ModelProto, reference: onnx.ModelProto, layers: list[str],
                 batches: Iterable[dict[str, np.ndarray]], budget_bytes: int = defaults.CALIB_MEMORY_BUDGET,
                 ) -> dict[str, float]:
    """Each layer's own error in ``candidate``, all layers measured in one ONNX Runtime run per slice of a batch.

    Beside each layer of ``candidate`` (INT8 or FP16) runs an FP32 twin: the layer as ``reference`` has it
    (FP32 weights) reading the very inputs the candidate layer reads before their Q/DQ or Cast. The error is
    sum |y - y_fp32|^2 / sum |y_fp32|^2 over ``batches``: what the layer itself loses, not what it inherits
    from the layers before it. ``layers`` names nodes present in both models (the passes keep node names).
    Batches run in slices whose outputs (two per layer) stay under ``budget_bytes``, one sample at least.
    """
    shadow, pairs = _with_fp32_twins(candidate, reference, layers)
    wanted = [name for pair in pairs.values() for name in pair]
    with TemporaryOnnxFile(shadow, prefix="trtc-ranking-") as path:
        del shadow  # ONNX Runtime reads the file
        runner = check_runner("onnxruntime", str(path), ["CPUExecutionProvider"], memory_arena=False,
                              outputs=wanted)
        runner.activate()
    num = dict.fromkeys(pairs, 0.0)
    den = dict.fromkeys(pairs, 0.0)
    sliceable = takes_any_batch(runner)
    for index, batch in enumerate(batches):
        for _, _, outs in sliced_runs(runner.infer, batch, budget_bytes, f"layer ranking, batch {index}", sliceable):
            outputs = dict(zip(wanted, outs))
            for layer, (got, want) in pairs.items():
                n, d = _squared_error(outputs[got], outputs[want])
                num[layer] += n
                den[layer] += d
            del outs, outputs
    runner.release()
    return {layer: (num[layer] / den[layer] if den[layer] > 0 else (0.0 if num[layer] == 0 else math.inf))
            for layer in pairs}


def _squared_error(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(sum (got - ref)^2, sum ref^2) in float64, converted a chunk at a time."""
    a, b = got.reshape(-1), ref.reshape(-1)
    num = den = 0.0
    for c in range(0, a.size, CHUNK_VALUES):
        x, y = a[c:c + CHUNK_VALUES].astype(np.float64), b[c:c + CHUNK_VALUES].astype(np.float64)
        num += float(np.square(x - y).sum())
        den += float(np.square(y).sum())
    return num, den


def _with_fp32_twins(candidate: onnx.ModelProto, reference: onnx.ModelProto, layers: list[str],
                     ) -> tuple[onnx.ModelProto, dict[str, tuple[str, str]]]:
    """``candidate`` plus, per layer, an FP32 copy of the reference node and both outputs as graph outputs.

    Returns the model and ``{layer: (candidate output, twin output)}``, both FLOAT.
    """
    ref_nodes = {n.name: n for n in reference.graph.node if n.name}
    ref_inits = {t.name: t for t in reference.graph.initializer}
    cand_nodes = {n.name: n for n in candidate.graph.node if n.name}
    out = onnx.ModelProto()
    out.CopyFrom(candidate)
    graph = out.graph
    fresh = FreshNames(graph)
    available = {i.name for i in graph.input} | {o for node in graph.node for o in node.output}

    def as_float(tensor: str) -> str:
        cast = fresh(f"{tensor}_twin_fp32")
        graph.node.append(onnx.helper.make_node("Cast", [tensor], [cast], name=fresh(f"{cast}_cast"),
                                                to=onnx.TensorProto.FLOAT))
        return cast

    pairs: dict[str, tuple[str, str]] = {}
    copied: dict[str, str] = {}
    for layer in layers:
        original, node = ref_nodes.get(layer), cand_nodes.get(layer)
        if original is None or node is None or not node.output:
            continue
        inputs = []
        for tensor in original.input:
            if not tensor:
                inputs.append("")
            elif tensor in ref_inits:
                if tensor not in copied:
                    copied[tensor] = fresh(f"{tensor}_twin")
                    init = onnx.TensorProto()
                    init.CopyFrom(ref_inits[tensor])
                    init.name = copied[tensor]
                    graph.initializer.append(init)
                inputs.append(copied[tensor])
            elif tensor in available:
                inputs.append(as_float(tensor))
            else:
                break
        else:
            twin = onnx.NodeProto()
            twin.CopyFrom(original)
            twin.name = fresh(f"{layer}_twin")
            del twin.input[:]
            twin.input.extend(inputs)
            del twin.output[:]
            twin.output.extend([fresh(f"{o}_twin") if o else "" for o in original.output])
            graph.node.append(twin)
            pairs[layer] = (as_float(node.output[0]), twin.output[0])
    for got, want in pairs.values():
        graph.output.extend([onnx.helper.make_tensor_value_info(got, onnx.TensorProto.FLOAT, None),
                             onnx.helper.make_tensor_value_info(want, onnx.TensorProto.FLOAT, None)])
    return out, pairs
