"""How a constant weight is read and quantized: its channels, INT8 and FP8 per output channel, INT4 in blocks.

The Q/DQ pass (``calibration/qdq.py``) and the INT4 weight-only pass (``calibration/int4.py``) store weights
already quantized, behind a DequantizeLinear: TensorRT takes pre-quantized weights there and ONNX Runtime runs
the same graph, so both compute with exactly the same values. Everything here is symmetric (zero point 0):

* INT8: ``scale = amax / 127`` per output channel, values rounded half to even and clipped to +-127;
* FP8 (E4M3, ``float8e4m3fn``): ``scale = amax / 448`` per output channel, values rounded to the nearest FP8
  number (saturating at +-448, as QuantizeLinear's ``saturate=1``);
* INT4: ``scale = amax / 7`` per block of ``block`` weights along the reduction axis and per output channel,
  values rounded half to even and clipped to [-8, 7] (ModelOpt's and TensorRT's INT4 weight-only layout).

``raise_opset`` moves a graph to the opset these need (FP8 Q/DQ: 19, blocked DequantizeLinear: 21).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx

__all__ = ["WeightChannels", "conv_weight", "conv_transpose_weight", "gemm_weight", "matmul_weight", "node_attr",
           "INT8_MAX", "FP8_MAX", "INT4_MAX", "int8_scale", "scale_for", "int8_weight", "fp8_weight", "int4_weight",
           "dequantized_int4", "raise_opset"]

INT8_MAX = 127.0
FP8_MAX = 448.0  # the largest finite float8e4m3fn
INT4_MAX = 7.0  # symmetric: [-7, 7] used, -8 left for the clip
FP8 = ml_dtypes.float8_e4m3fn
INT4 = ml_dtypes.int4


@dataclass(frozen=True)
class WeightChannels:
    """A constant weight read as a linear layer's: its input and output channels, and the axis of its scales.

    ``axis``: the output-channel axis, along which the weight gets one scale per channel; None where one
    scale serves the whole weight. ``reduction``: the input-channel axis a MatMul/Gemm sums over (INT4 blocks
    run along it); None for convolutions.
    """

    inputs: int
    outputs: int
    axis: int | None
    reduction: int | None = None


def node_attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def conv_weight(node: onnx.NodeProto, dims: Sequence[int]) -> WeightChannels:
    """Conv's weight [K, C/g, kh, kw]: C input and K output channels, one scale per output channel (axis 0)."""
    return WeightChannels(dims[1] * node_attr(node, "group", 1), dims[0], 0)


def conv_transpose_weight(node: onnx.NodeProto, dims: Sequence[int]) -> WeightChannels:
    """ConvTranspose's weight [C, K/g, kh, kw]: C input and K output channels, one scale per output channel
    (axis 1); with groups one scale for the whole weight, as axis 1 then indexes channels of every group."""
    group = node_attr(node, "group", 1)
    return WeightChannels(dims[0], dims[1] * group, 1 if group == 1 else None)


def gemm_weight(node: onnx.NodeProto, dims: Sequence[int]) -> WeightChannels:
    """Gemm's B: [K, N], or [N, K] with transB=1; one scale per output channel N."""
    if node_attr(node, "transB", 0):
        return WeightChannels(dims[1], dims[0], 0, reduction=1)
    return WeightChannels(dims[0], dims[1], 1, reduction=0)


def matmul_weight(node: onnx.NodeProto, dims: Sequence[int]) -> WeightChannels:
    """MatMul's constant weight [..., K, N]: one scale per output channel N (the last axis)."""
    return WeightChannels(dims[-2], dims[-1], len(dims) - 1, reduction=len(dims) - 2)


def int8_scale(amax: np.ndarray) -> np.ndarray:
    """``amax / 127`` as float32; an all-zero tensor or channel gets scale 1 (any scale is exact for zeros)."""
    return _scale(amax, INT8_MAX)


def scale_for(amax: np.ndarray, levels: float) -> np.ndarray:
    """``amax / levels`` in float32 (127 for INT8, 448 for FP8, 7 for INT4); scale 1 where amax is 0."""
    return _scale(amax, levels)


def _scale(amax: np.ndarray, levels: float) -> np.ndarray:
    scale = (np.asarray(amax, dtype=np.float32) / np.float32(levels)).astype(np.float32)
    return np.where(scale >= np.finfo(np.float32).tiny, scale, np.float32(1.0)).astype(np.float32)


def _per_channel(w: np.ndarray, axis: int | None, levels: float) -> tuple[np.ndarray, np.ndarray]:
    """(scale, the scale broadcast against ``w``) for one scale per channel along ``axis`` (None: one scale)."""
    if axis is None:
        scale = _scale(np.abs(w).max(initial=0.0), levels)
        return scale, scale
    others = tuple(i for i in range(w.ndim) if i != axis)
    scale = _scale(np.abs(w).max(axis=others, initial=0.0), levels)
    shape = [1] * w.ndim
    shape[axis] = -1
    return scale, scale.reshape(shape)


def int8_weight(weight: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT8 weights and their float32 scales (one per channel along ``axis``, or a scalar)."""
    w = weight.astype(np.float32, copy=False)
    scale, broadcast = _per_channel(w, axis, INT8_MAX)
    # np.rint rounds half to even, as QuantizeLinear does; +-127 keeps the range symmetric.
    q = w / broadcast
    np.rint(q, out=q)  # in place: a large weight's temporaries add up
    np.clip(q, -INT8_MAX, INT8_MAX, out=q)
    return q.astype(np.int8), scale


def fp8_weight(weight: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """FP8 E4M3 weights (``ml_dtypes.float8_e4m3fn``) and their float32 scales, ``amax / 448`` per channel."""
    w = weight.astype(np.float32, copy=False)
    scale, broadcast = _per_channel(w, axis, FP8_MAX)
    q = w / broadcast
    np.clip(q, -FP8_MAX, FP8_MAX, out=q)  # the cast itself turns values past 448 into NaN
    return q.astype(FP8), scale


def int4_weight(weight: np.ndarray, axis: int, block: int, clip: np.ndarray | None = None,
                ) -> tuple[np.ndarray, np.ndarray]:
    """Block-wise symmetric INT4 weights (``ml_dtypes.int4``) and float32 scales, ``amax / 7`` per block.

    Blocks of ``block`` weights run along ``axis`` (the reduction axis); the scales have ``weight``'s shape with
    that axis ``ceil(size / block)`` long, as DequantizeLinear's ``block_size`` reads them. A last, shorter block
    is scaled by its own values. ``clip`` (the scales' shape) multiplies each block's amax: values beyond the
    shrunk range saturate at -8 / 7.
    """
    w = np.moveaxis(weight.astype(np.float32, copy=False), axis, -1)
    size = w.shape[-1]
    blocks = -(-size // block)
    padded = np.zeros((*w.shape[:-1], blocks * block), dtype=np.float32)
    padded[..., :size] = w
    grouped = padded.reshape(*w.shape[:-1], blocks, block)
    amax = np.abs(grouped).max(axis=-1)
    if clip is not None:
        amax = amax * np.moveaxis(np.asarray(clip, dtype=np.float32), axis, -1)
    scale = _scale(amax, INT4_MAX)
    q = grouped / scale[..., None]
    np.rint(q, out=q)
    np.clip(q, -INT4_MAX - 1, INT4_MAX, out=q)
    values = q.reshape(*w.shape[:-1], blocks * block)[..., :size]
    return np.moveaxis(values.astype(np.int8), -1, axis).astype(INT4), np.moveaxis(scale, -1, axis)


def dequantized_int4(q: np.ndarray, scale: np.ndarray, axis: int, block: int) -> np.ndarray:
    """What DequantizeLinear(q, scale, axis, block_size) computes, in float32 (``q * scale`` per block)."""
    repeated = np.repeat(scale.astype(np.float32), block, axis=axis)
    index = [slice(None)] * q.ndim
    index[axis] = slice(0, q.shape[axis])
    return q.astype(np.float32) * repeated[tuple(index)]


def raise_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """``model`` at ONNX opset ``version`` at least, through onnx's version converter where it is lower.

    The converter rewrites what changed between opsets (ReduceMean's axes moving from an attribute to an input,
    and the like); it reads the graph, not the weights, so a model loaded by reference stays so. Returns ``model``
    itself when its opset is already high enough. Raises ValueError naming the converter's complaint.
    """
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if current >= version:
        return model
    try:
        return onnx.version_converter.convert_version(model, version)
    except Exception as err:  # the converter raises RuntimeError, IndexError or its own ConvertError
        raise ValueError(f"the model's ONNX opset {current} could not be raised to {version} ({err}); export it "
                         f"at opset {version} with --opset {version}") from err
