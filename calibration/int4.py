"""INT4 weight-only graphs: block-wise INT4 weights for the linear layers, FP16 activations.

``int4_model_from`` stores the constant weight of every MatMul and Gemm that ``PLACEMENT`` marks ``int4`` as INT4
behind a ``DequantizeLinear`` with ``block_size`` (opset 21): one FP32 (later FP16) scale per ``block`` weights
along the reduction axis and per output channel, symmetric, zero point 0 (``calibration/weights.py``). TensorRT
runs such a MatMul as an INT4 weight-only GEMM (weights dequantized in the kernel, FP16 math); ONNX Runtime runs
the same graph as written. Convolutions, the model's head, layers with fewer than 16 channels and products of two
activations stay as they are (FP16 after the FP16 pass that follows).

AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization", 2023), ``method="awq"``: the input channels that carry
large activations matter more, so before rounding each weight row k is multiplied by ``s_k = a_k ** alpha``
(``a_k``: the mean |x| of input channel k on the calibration data, normalised so that max and min of ``s`` are
reciprocal) and the layer's input is divided by the same ``s`` (one ``Mul`` before the layers reading that input,
which share one ``s``). ``alpha`` is searched per input on a grid of ``defaults.AWQ_GRID`` values in [0, 1),
minimising the squared error of the layers' outputs on calibration rows; ``alpha = 0`` is plain round-to-nearest
(and adds no ``Mul``). ``method="rtn"`` rounds every weight to nearest, no data needed.

What this module will not do: quantize activations, convolutions or weights that are not FP32 initializers;
choose which layers the gate keeps in FP16 (``calibration/accuracy.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from calibration.qdq import PLACEMENT, QdqPolicy, node_names, placement
from calibration.weights import INT4_MAX, WeightChannels, int4_weight, raise_opset
from compiler.core import defaults
from compiler.core.onnx_io import MAX_IR_VERSION, FreshNames, copy_fields, tensor_array

__all__ = ["INT4_OPSET", "Int4Policy", "Int4Report", "Int4Layer", "AwqSearch", "int4_layers", "awq_inputs",
           "awq_scales",
           "int4_model_from"]

log = logging.getLogger(__name__)

INT4_OPSET = 21  # DequantizeLinear's block_size and the INT4 type


@dataclass(frozen=True)
class Int4Policy:
    """Which layers get INT4 weights and how: ``block`` weights per scale, ``method`` awq or rtn;
    ``exclude_nodes`` stay in higher precision (the gate's fallback)."""

    block: int = defaults.INT4_BLOCK
    method: str = defaults.INT4_METHOD
    exclude_nodes: frozenset[str] = frozenset()
    exclude_op_types: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Int4Layer:
    """A layer to quantize: its node, its activation input, its constant weight and how to read that weight."""

    node: str
    activation: str
    weight: str
    channels: WeightChannels


@dataclass
class Int4Report:
    """What :func:`int4_model_from` did: the layers in INT4, those kept and why, the AWQ exponent per input, the
    bytes of the weights before (FP32) and after (INT4 values and scales)."""

    quantized_nodes: list[str] = field(default_factory=list)
    skipped_nodes: dict[str, str] = field(default_factory=dict)
    awq_alpha: dict[str, float] = field(default_factory=dict)
    fp32_weight_bytes: int = 0
    int4_weight_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def int4_layers(model: onnx.ModelProto, policy: Int4Policy | None = None,
                ) -> tuple[list[Int4Layer], dict[str, str]]:
    """The layers ``policy`` puts in INT4, in graph order, and the skipped weighted nodes with the reason."""
    policy = policy or Int4Policy()
    graph = model.graph
    graph_inputs = {i.name for i in graph.input}
    constants = {t.name: t for t in graph.initializer if t.name not in graph_inputs}
    # the weighted rules of INT8 (a head, too few channels, two activations, exclusions) hold for INT4 too
    placed, reasons = placement(model, QdqPolicy(exclude_nodes=policy.exclude_nodes & set(node_names(graph)),
                                                 exclude_op_types=policy.exclude_op_types))
    chosen = set(placed)
    layers, skipped = [], {}
    for node, name in zip(graph.node, node_names(graph)):
        rule = PLACEMENT.get(node.op_type)
        if rule is None or rule.kind != "weighted":
            continue
        reason = reasons.get(name, "") if name not in chosen else ""
        if not reason and not rule.int4:
            reason = f"not in INT4: {rule.not_int4}"
        weight = node.input[1] if len(node.input) > 1 else ""
        if not reason and (weight not in constants or len(constants[weight].dims) != 2):
            reason = "weight is not a 2-D constant"
        if not reason and node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
            reason = "Gemm with transA: its input channels are not the last axis"
        if reason:
            skipped[name] = reason
            continue
        assert rule.weight is not None
        layers.append(Int4Layer(name, node.input[0], weight, rule.weight(node, constants[weight].dims)))
    return layers, skipped


def awq_inputs(layers: list[Int4Layer]) -> dict[str, int]:
    """The activation tensors AWQ needs statistics of, with their channel count (the layers' input channels)."""
    return {layer.activation: layer.channels.inputs for layer in layers}


def _as_kn(weight: np.ndarray, channels: WeightChannels) -> np.ndarray:
    """A 2-D weight as [input channels, output channels]."""
    return weight if channels.reduction == 0 else weight.T


def _fake_int4(w: np.ndarray, block: int, clip: np.ndarray | None = None) -> np.ndarray:
    """``w`` [K, N] rounded to INT4 blocks along K and back to float32 (``int4_weight`` then ``dequantized_int4``,
    without the INT4 storage type); ``clip`` [blocks, N] scales each block's range (AWQ's clip search)."""
    k, n = w.shape
    blocks = -(-k // block)
    padded = w if k == blocks * block else np.concatenate([w, np.zeros((blocks * block - k, n), np.float32)])
    grouped = padded.reshape(blocks, block, n)
    amax = np.abs(grouped).max(axis=1)
    if clip is not None:
        amax = amax * clip
    scale = np.where(amax > 0, amax / INT4_MAX, 1.0).astype(np.float32)[:, None, :]
    q = np.clip(np.rint(grouped / scale), -INT4_MAX - 1, INT4_MAX) * scale
    return q.reshape(blocks * block, n)[:k]


def _awq_error(rows: np.ndarray, weights: list[np.ndarray], s: np.ndarray, block: int) -> float:
    """The summed squared error of the layers' outputs on ``rows`` with input scales ``s``, against FP32."""
    total = 0.0
    for w in weights:
        approx = _fake_int4(w * s[:, None], block) / s[:, None]
        approx -= w
        total += float(np.square(rows @ approx).sum())
    return total


def _clip_ratios(rows: np.ndarray, w: np.ndarray, block: int, steps: int = 10, shrink: float = 0.5) -> np.ndarray:
    """AWQ's clip search: per block and output channel, the fraction of the block's max |w| that rounds with the
    least output error on ``rows`` (1.0, 0.95, ..., 0.5), each block scored on its own input channels."""
    k, n = w.shape
    blocks = -(-k // block)
    best = np.ones((blocks, n), dtype=np.float32)
    for g in range(blocks):
        part, x = w[g * block:(g + 1) * block], rows[:, g * block:(g + 1) * block]
        errors = []
        for i in range(steps + 1):
            ratio = np.full((1, n), 1.0 - shrink * i / steps, dtype=np.float32)
            errors.append(np.square(x @ (_fake_int4(part, block, ratio) - part)).sum(axis=0))
        best[g] = 1.0 - shrink * np.argmin(np.stack(errors), axis=0) / steps
    return best


@dataclass
class AwqSearch:
    """What AWQ chose: per activation tensor the exponent and input-channel scales ``s`` of the layers reading it,
    and per layer the clip ratio of each block and output channel ([blocks, output channels])."""

    alpha: dict[str, float] = field(default_factory=dict)
    scales: dict[str, np.ndarray] = field(default_factory=dict)
    clips: dict[str, np.ndarray] = field(default_factory=dict)


def awq_scales(model: onnx.ModelProto, layers: list[Int4Layer], samples: Mapping[str, Any], block: int,
               grid: int = defaults.AWQ_GRID) -> AwqSearch:
    """AWQ's two searches on calibration rows: the scale exponent per input tensor, then the clip per block.

    ``samples`` maps each tensor of :func:`awq_inputs` to its ``ChannelSamples`` (``calibration.observe``): the
    mean |x| per channel and a sample of rows. A scale candidate's error is the summed squared error of every
    layer reading the tensor, on those rows, against the FP32 layer; ``s = 1`` (alpha 0) is among the candidates,
    so the scales never score worse than round-to-nearest there. The clip search then shrinks each block's
    range where that lowers the error of its share of the output, as the paper's ``auto_clip``.
    """
    constants = {t.name: t for t in model.graph.initializer}
    groups: dict[str, list[Int4Layer]] = {}
    for layer in layers:
        groups.setdefault(layer.node, []).append(layer)
    found = AwqSearch()
    for tensor, members in groups.items():
        stats = samples.get(members[0].activation)
        if stats is None or not len(stats.rows):
            continue
        rows = stats.rows.astype(np.float32)
        weights = [_as_kn(tensor_array(constants[m.weight]).astype(np.float32), m.channels) for m in members]
        magnitude = np.maximum(stats.mean_abs.astype(np.float64), 1e-8)
        ones = np.ones(len(magnitude), dtype=np.float32)
        best = (0.0, ones, _awq_error(rows, weights, ones, block))
        for step in range(1, grid):
            alpha = step / grid
            s = magnitude ** alpha
            s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
            error = _awq_error(rows, weights, s, block)
            if error < best[2]:
                best = (alpha, s, error)
        alpha, s = best[0], best[1]
        if alpha > 0:
            found.alpha[tensor], found.scales[tensor] = alpha, s
        for member, w in zip(members, weights):
            found.clips[member.node] = _clip_ratios(rows / s[None, :], w * s[:, None], block)
        log.debug("AWQ %s (%d layer(s)): alpha %.2f", tensor, len(members), alpha)
    return found


def int4_model_from(model: onnx.ModelProto, policy: Int4Policy | None = None, awq: AwqSearch | None = None,
                    ) -> tuple[onnx.ModelProto, Int4Report]:
    """A new FP32 model whose INT4 layers read block-quantized INT4 weights, and a report.

    ``awq`` is :func:`awq_scales`' search (None, or layers it lacks: round-to-nearest). The model moves to opset 21
    where it is lower (``raise_opset``). Weights must be loaded or referenced (``load_onnx_by_reference``);
    ``model`` is not modified. The FP16 rest is the caller's next step (``int8_fp16_model_from``, which gives
    the scales FP16 as it does INT8's).
    """
    policy = policy or Int4Policy()
    awq = awq or AwqSearch()
    model = raise_opset(model, INT4_OPSET)
    layers, skipped = int4_layers(model, policy)
    report = Int4Report(skipped_nodes=skipped)
    out = copy_fields(model, onnx.ModelProto(), skip={"graph"})
    out.ir_version = min(max(out.ir_version, 10), MAX_IR_VERSION)
    source = model.graph
    graph = copy_fields(source, out.graph, skip={"node", "initializer"})
    fresh = FreshNames(source)

    constants = {t.name: t for t in source.initializer}
    by_node = {layer.node: layer for layer in layers}
    new_inits: list[onnx.TensorProto] = []
    scaled_inputs: dict[str, tuple[str, onnx.NodeProto]] = {}  # activation -> (its Mul's output, the Mul)
    replaced: set[str] = set()
    weight_outputs: dict[tuple[str, str], tuple[str, onnx.NodeProto]] = {}
    nodes: list[onnx.NodeProto] = []
    for original, name in zip(source.node, node_names(source)):
        layer = by_node.get(name)
        node = onnx.NodeProto()
        node.CopyFrom(original)
        if layer is not None:
            use_scale = layer.node in awq.scales
            alpha = awq.alpha.get(layer.node, 0.0)
            s = awq.scales.get(layer.node, np.ones(layer.channels.inputs, dtype=np.float32))
            if use_scale and layer.node not in scaled_inputs:
                inverse = fresh(f"{layer.activation}_awq_inverse_scale")
                new_inits.append(numpy_helper.from_array(np.float32(1.0) / np.asarray(s, dtype=np.float32), inverse))
                scaled = fresh(f"{layer.activation}_awq_scaled")
                scaled_inputs[layer.node] = (scaled, helper.make_node(
                    "Mul", [layer.activation, inverse], [scaled], name=fresh(f"{layer.activation}_awq_Mul")))
                nodes.append(scaled_inputs[layer.node][1])
                report.awq_alpha[layer.node] = alpha
            key = (layer.weight, layer.node if layer.node in awq.clips else "")
            if key not in weight_outputs:
                weight = tensor_array(constants[layer.weight]).astype(np.float32)
                axis = layer.channels.reduction
                assert axis is not None
                if use_scale:
                    shape = [1, 1]
                    shape[axis] = -1
                    weight = weight * np.asarray(s, dtype=np.float32).reshape(shape)
                clip = awq.clips.get(layer.node)
                q, scale = int4_weight(weight, axis, policy.block, clip if axis == 0 or clip is None else clip.T)
                q_name, scale_name = fresh(f"{layer.weight}_int4"), fresh(f"{layer.weight}_int4_scale")
                new_inits += [numpy_helper.from_array(q, q_name), numpy_helper.from_array(scale, scale_name)]
                dq_out = fresh(f"{layer.weight}_dequantized")
                dq = helper.make_node("DequantizeLinear", [q_name, scale_name], [dq_out],
                                      name=fresh(f"{layer.weight}_Dequantize"), axis=axis, block_size=policy.block)
                weight_outputs[key] = (dq_out, dq)
                nodes.append(dq)
                report.fp32_weight_bytes += weight.size * 4
                report.int4_weight_bytes += (q.size + 1) // 2 + scale.size * 2  # scales end up FP16
            node.input[1] = weight_outputs[key][0]
            if use_scale:
                node.input[0] = scaled_inputs[layer.node][0]
            replaced.add(layer.weight)
            report.quantized_nodes.append(name)
        nodes.append(node)
    graph.node.extend(nodes)
    read = {i for n in nodes for i in n.input} | {o.name for o in source.output}
    graph.initializer.extend(t for t in source.initializer if t.name not in replaced or t.name in read)
    graph.initializer.extend(new_inits)
    log.debug("INT4: %d layers quantized (%d with AWQ scales), %d kept", len(report.quantized_nodes),
              len(report.awq_alpha), len(report.skipped_nodes))
    return out, report


def int4_stage(model: onnx.ModelProto, fp32_path: Any, data: Any, evaluator: Any, settings: Any,
               ) -> tuple[Any, dict[str, Any]]:
    """``trtc calibrate --int4-weights``: the INT4 weight-only model with its FP16 rest, gated, with the fallback.

    ``data`` (a ``CalibrationData`` or None) gives AWQ its activations and the FP16 rest its ranges; AWQ without
    data is refused (``--int4-method rtn`` needs none). ``evaluator`` is the gate's (None: no gate). Returns the
    gate's outcome (or None) and the details calibrate.py records: ``int4`` (block, method, layers, the AWQ
    exponents, weight bytes), ``node_precisions``, ``_model``.
    """
    from calibration.accuracy import gate_with_fallback
    from calibration.fp16 import float_tensors, int8_fp16_model_from
    from calibration.fp16_policy import Fp16Policy
    from calibration.node_precisions import node_precisions
    from calibration.observe import collect_channel_samples, collect_max_abs
    from compiler.core.capabilities import checking_providers
    from compiler.core.errors import CalibrationError
    from compiler.core.progress import progress, stage_timer
    from compiler.core.worker import mark

    model = raise_opset(model, INT4_OPSET)
    names = set(node_names(model.graph))
    keep = frozenset(settings.keep_fp32)
    policy = Int4Policy(block=settings.int4_block, method=settings.int4_method, exclude_nodes=keep & names,
                        exclude_op_types=keep - names)
    layers, _ = int4_layers(model, policy)
    awq: AwqSearch | None = None
    max_abs: dict[str, float] | None = None
    if policy.method == "awq":
        if data is None:
            raise CalibrationError("--int4-method awq needs calibration data (--calib-data or --calib-loader) for its "
                                   "activation-aware scales; pass some, or use --int4-method rtn")
        inputs = awq_inputs(layers)
        mark(f"INT4 calibration: channel statistics of {len(inputs)} layer inputs of the FP32 model")
        with progress(f"AWQ statistics of {len(inputs)} tensors", data.samples) as advance:
            samples = collect_channel_samples(fp32_path, inputs, data.batches(), providers=checking_providers(),
                                              budget_bytes=settings.memory_budget, progress=advance)
        with stage_timer("AWQ scale search"):
            awq = awq_scales(model, layers, samples, policy.block)
        del samples
    if data is not None:
        floats = float_tensors(model)
        mark(f"INT4 calibration: max |x| of {len(floats)} tensors for the FP16 rest")
        max_abs = collect_max_abs(fp32_path, floats, data.batches(), providers=checking_providers(),
                                  budget_bytes=settings.memory_budget)
    fp16_policy = Fp16Policy(keep_fp32=keep)
    reports: dict[frozenset[str], tuple[Int4Report, Any]] = {}

    def build(excluded: frozenset[str]) -> onnx.ModelProto:
        kept = "" if not excluded else f" with {len(excluded)} layer(s) kept in FP16"
        mark(f"INT4 accuracy gate: the INT4 model{kept}")
        p = Int4Policy(block=policy.block, method=policy.method, exclude_nodes=policy.exclude_nodes | excluded,
                       exclude_op_types=policy.exclude_op_types)
        quantized, report = int4_model_from(model, p, awq)
        combined, fp16_report = int8_fp16_model_from(quantized, fp16_policy, max_abs)
        reports[excluded] = (report, fp16_report)
        return combined

    first = build(frozenset())
    report, fp16_report = reports[frozenset()]
    details: dict[str, Any] = {"_model": first, "int4": _summary(report, policy)}
    outcome = None
    if evaluator is not None:
        with stage_timer("INT4 accuracy gate"):
            outcome = gate_with_fallback(build, [layer.node for layer in layers], evaluator, "INT4", initial=first,
                                         reference=model, kept_as="FP16")
        report, fp16_report = reports[frozenset(outcome.kept)]
        details["int4"] = _summary(report, policy)
    counts = node_precisions(model, report.quantized_nodes, fp16_report)
    counts["counts"] = {"int4" if k == "int8" else k: v for k, v in counts["counts"].items()}
    counts["int4"] = counts.pop("int8")
    details["node_precisions"] = counts
    log.info("INT4 model: %d layers with INT4 weights (%d with AWQ scales), %d nodes in FP16, %d in FP32; weights "
             "%.1f MB -> %.1f MB", len(report.quantized_nodes), len(report.awq_alpha), counts["counts"]["fp16"],
             counts["counts"]["fp32"], report.fp32_weight_bytes / 1e6, report.int4_weight_bytes / 1e6)
    return outcome, details


def _summary(report: Int4Report, policy: Int4Policy) -> dict[str, Any]:
    return {"block_size": policy.block, "method": policy.method, "layers": len(report.quantized_nodes),
            "awq_scaled_inputs": len(report.awq_alpha), "awq_alpha": report.awq_alpha,
            "fp32_weight_bytes": report.fp32_weight_bytes, "int4_weight_bytes": report.int4_weight_bytes}
