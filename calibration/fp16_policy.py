"""What FP16 mode keeps in FP32: the op types kept by default (``FP32_OPS``, each with its reason), the
policy ``fp16_model_from`` follows (``Fp16Policy``), and FP16's limits.

``calibration/fp16.py`` applies them, in the order its docstring gives, and reports why each node stayed FP32.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.core.errors import InputError

__all__ = ["FP16_MAX", "FP16_MIN_NORMAL", "FP16_TINY", "FP32_OPS", "Fp16Policy"]

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # smallest positive FP16 subnormal
FP16_MIN_NORMAL = 2.0**-14  # below it FP16 keeps fewer than 11 significant bits

# Op types kept in FP32 by default, and why. Deliberately absent:
# * Softmax and LayerNormalization: TensorRT takes FP16 in and out but computes internally in FP32 (Softmax
#   subtracts the row max; opset >= 17 LayerNormalization becomes INormalizationLayer, whose statistics follow
#   stash_type=1, i.e. FP32); ModelOpt AutoCast keeps no compute op in FP32 by type, and the data check
#   (``Fp16Policy.overflow_threshold``) catches scores or residuals that are actually too large. Add them with
#   --keep-fp32 Softmax if needed.
# * ReduceMean (global average pooling): the mean is bounded by the largest input, and TensorRT accumulates
#   FP16 reductions, GEMMs and convolutions in FP32.
FP32_OPS: dict[str, str] = {
    # elementwise ops whose output range explodes (PyTorch autocast runs these in FP32 too)
    "Exp": "e^x overflows FP16 above x = 11.1",
    "Pow": "x^p leaves FP16 range quickly (x^2 overflows above |x| = 256)",
    "Log": "log magnifies the coarse FP16 resolution near 0 (subnormals below 6.1e-5)",
    # sums over many elements grow with the reduced length, beyond any range seen in calibration
    "ReduceSum": "a sum grows with the number of elements reduced",
    "ReduceSumSquare": "a sum of squares grows with the number of elements and overflows FP16",
    "ReduceL1": "a sum grows with the number of elements reduced",
    "ReduceL2": "a sum of squares overflows FP16 before its square root is taken",
    "ReduceProd": "a product over many elements overflows or underflows FP16",
    "ReduceLogSumExp": "exp of the inputs overflows FP16",
    "CumSum": "a running sum grows with the sequence length",
    # indices and coordinates: FP16 rounding changes which element is picked (onnxconverter-common's
    # default block list; AutoCast keeps Resize scales, Upsample and NonMaxSuppression in FP32)
    "TopK": "FP16 ties change the selected indices",
    "NonMaxSuppression": "box coordinates and IoU thresholds need FP32 resolution",
    "RoiAlign": "box coordinates need FP32 resolution",
    "Resize": "scales and coordinate transforms need FP32 resolution",
    "Upsample": "scales need FP32 resolution",
    # control flow: subgraphs are not converted, so the node and what feeds them stay FP32
    "If": "subgraphs are left in FP32",
    "Loop": "subgraphs are left in FP32",
    "Scan": "subgraphs are left in FP32",
}


@dataclass(frozen=True)
class Fp16Policy:
    """What ``fp16_model_from`` keeps in FP32.

    ``keep_fp32``: node names or op types (``--keep-fp32``). ``keep_io_types``: float graph inputs and outputs
    stay FP32, with Casts after the inputs and before the outputs. ``overflow_threshold``: a tensor whose
    observed max |x| exceeds it is produced and consumed in FP32; half the FP16 maximum (32752) leaves room
    for inputs up to 2x larger than any seen in calibration (AutoCast's more conservative default is 512).
    ``underflow_threshold``: a tensor whose observed max |x| is not zero but below it is produced and consumed in
    FP32 too; FP16's smallest normal (6.1e-5) by default, below which every value is a subnormal of a few bits,
    and zero under 6e-8; 0 turns the rule off. ``fp32_ops``: op types always kept in FP32 (``FP32_OPS`` by
    default).
    """

    keep_fp32: frozenset[str] = frozenset()
    keep_io_types: bool = True
    overflow_threshold: float = FP16_MAX / 2
    fp32_ops: frozenset[str] = frozenset(FP32_OPS)
    underflow_threshold: float = FP16_MIN_NORMAL

    def __post_init__(self) -> None:
        for name in ("keep_fp32", "fp32_ops"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise InputError(f"Fp16Policy.{name}={value!r}: pass a set of names, not one string")
            object.__setattr__(self, name, frozenset(value))
        if not 0 <= self.underflow_threshold < self.overflow_threshold:
            raise InputError(f"Fp16Policy.underflow_threshold={self.underflow_threshold}: use a value in "
                             f"[0, {self.overflow_threshold:g}) (0 turns the underflow rule off)")
        if not 0 < self.overflow_threshold <= FP16_MAX:
            raise InputError(f"Fp16Policy.overflow_threshold={self.overflow_threshold}: use a value in "
                             f"(0, {FP16_MAX:g}], the FP16 maximum")
