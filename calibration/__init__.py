"""trtc's precision stage: INT8 (explicit Q/DQ) and FP16 ONNX graphs from calibration data, proven by an
accuracy gate in ONNX Runtime.

Modules, in pipeline order: ``data`` (read and check samples), ``observe`` (run them through ONNX Runtime
and observe the activations), ``masks`` (which values stay out: padding, mask biases), ``statistics``
(streaming |x| histograms and amax methods), ``qdq`` (TensorRT-placeable Q/DQ), ``fp16_policy`` (what FP16
mode keeps in FP32), ``fp16`` (FP16 graphs with FP32 where needed), ``fp16_rounding`` (FP16 arithmetic
emulated for the gate on CPUs), ``accuracy`` (the gate and its layer fallback), ``calibrate`` (the stage as
a whole).
"""

__all__ = ["accuracy", "calibrate", "data", "fp16", "fp16_policy", "fp16_rounding", "masks", "observe", "qdq",
           "statistics"]
