"""What the engine inspector says about an engine's layers, and a summary of it for the manifest.

``layer_information`` needs TensorRT (and a GPU: it makes an execution context per profile; ``inspect_profiles``
is how, given the engine); ``layer_io_types``, ``layers_reading`` and ``layer_summary`` only read the JSON, from
TensorRT 10 or 11.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from compiler.backends.tensorrt.profiles import Shapes
from compiler.core.errors import BuildError

if TYPE_CHECKING:
    import tensorrt as trt

__all__ = ["layer_information", "inspect_profiles", "layer_io_types", "layers_reading", "layer_summary"]


def layer_information(engine: trt.ICudaEngine, profiles: Sequence[Shapes]) -> list[str]:
    """The engine inspector's information on every layer, as JSON, for each profile (DETAILED: trtc's configs are).

    An engine with a dynamic dimension shows "N/A due to dynamic shapes" for every layer's format and type
    unless the inspector has an execution context whose input shapes are all set (``NvInferRuntime.h``,
    ``IEngineInspector::setExecutionContext``), and every trtc engine has a dynamic batch. So profile k gets a
    context with k selected and its opt shapes set, as trtexec does (``inspect_profiles``). Needs TensorRT and a GPU.
    """
    import tensorrt as trt
    from polygraphy import cuda

    stream = cuda.Stream()
    try:
        return inspect_profiles(engine, profiles, trt.LayerInformationFormat.JSON, stream.ptr, stream.synchronize)
    finally:
        stream.free()


def inspect_profiles(engine: trt.ICudaEngine, profiles: Sequence[Shapes], layer_format: trt.LayerInformationFormat,
                     stream_handle: int, synchronize: Callable[[], None]) -> list[str]:
    """``engine``'s layer information in ``layer_format`` for each profile, inspected through a context of its own.

    For profile k: an execution context with profile k selected (on ``stream_handle``, then ``synchronize()``)
    and every input at its opt shape, an inspector given that context, the information, then the inspector
    deleted and only then the context. TensorRT's ``execution_context`` setter keeps a raw pointer and no
    reference, so an inspector must never outlive its context; and one context at a time, so that a profile's
    activation memory is freed before the next profile's context takes its own. ``BuildError`` where TensorRT
    cannot make a context or an opt shape is refused.
    """
    infos = []
    for index, shapes in enumerate(profiles):
        context = engine.create_execution_context()
        if context is None:
            raise BuildError("TensorRT could not create an execution context to inspect the engine (out of GPU "
                             "memory?); run with --debug and see TensorRT's log")
        if engine.num_optimization_profiles > 1:  # profile 0 is the one selected at creation
            context.set_optimization_profile_async(index, stream_handle)
            synchronize()
        for name, (_, opt, _) in shapes.items():
            if not context.set_input_shape(name, opt):
                raise BuildError(f"profile {index} of the engine does not take {name} shaped {opt}, the shape it "
                                 "was built for; run with --debug and see TensorRT's log")
        inspector = engine.create_engine_inspector()
        try:
            inspector.execution_context = context
            infos.append(inspector.get_engine_information(layer_format))
        finally:
            del inspector  # before its context, whose address it holds
        del context
    return infos


_TYPE_NAMES = {"float": "FP32", "fp32": "FP32", "half": "FP16", "fp16": "FP16", "bf16": "BF16", "bfloat16": "BF16",
               "int8": "INT8", "fp8": "FP8", "int4": "INT4", "fp4": "FP4", "int32": "INT32", "int64": "INT64",
               "bool": "BOOL", "uint8": "UINT8"}
_TYPE_TOKEN = re.compile(r"\b(" + "|".join(_TYPE_NAMES) + r")\b", re.IGNORECASE)


def _tensor_type(tensor: Any) -> str:
    """The data type of one tensor of a layer as the inspector's JSON gives it, "FP32"; "unknown" without one."""
    if not isinstance(tensor, dict):
        return "unknown"
    # TensorRT 11 has a "DataType" field; TensorRT 10 folds it into "Format/Datatype" ("Row major linear FP16 ...")
    text = str(tensor.get("DataType") or tensor.get("Format/Datatype") or "")
    match = _TYPE_TOKEN.search(text)
    return _TYPE_NAMES[match.group(1).lower()] if match else "unknown"


def layer_io_types(layer: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The data types of a layer's inputs and of its outputs, in order, from one entry of the inspector's "Layers".

    A layer's precision shows in its inputs: an INT8 convolution reads INT8 and may write FP32 (a dequantize fused
    into it), a quantize layer reads FP32 and writes INT8. Weights are not inputs here.
    """
    inputs, outputs = layer.get("Inputs") or [], layer.get("Outputs") or []
    return ([_tensor_type(t) for t in inputs] if isinstance(inputs, list) else [],
            [_tensor_type(t) for t in outputs] if isinstance(outputs, list) else [])


def layers_reading(layers_json: str, data_type: str) -> list[str]:
    """The names of the layers with at least one input of ``data_type`` ("INT8", "FP16", ...), in engine order.

    TensorRT names a layer after the ONNX nodes it runs (fused ones joined by " + "); an unreadable JSON has none.
    """
    try:
        info = json.loads(layers_json)
    except ValueError:
        return []
    layers = info.get("Layers", []) if isinstance(info, dict) else []
    return [str(layer.get("Name", "")) for layer in layers
            if isinstance(layer, dict) and data_type in layer_io_types(layer)[0]]


def layer_summary(layers_json: str) -> dict[str, Any]:
    """Layer count and the count of layers by the data type of their first output, from the inspector's JSON.

    ``output_types`` is what the manifest records per engine; it is not a layer's precision (an INT8 convolution
    with a fused dequantize writes FP32): ``layers_reading`` tells that. Reads TensorRT 10's and 11's layouts;
    layers given only by name (an engine built without DETAILED profiling verbosity) are counted under "unknown".
    """
    try:
        info = json.loads(layers_json)
    except ValueError:
        return {"count": None, "output_types": {}}
    layers = info.get("Layers", []) if isinstance(info, dict) else []
    types: dict[str, int] = {}
    for layer in layers:
        outputs = layer_io_types(layer)[1] if isinstance(layer, dict) else []
        name = outputs[0] if outputs else "unknown"
        types[name] = types.get(name, 0) + 1
    return {"count": len(layers), "output_types": dict(sorted(types.items()))}
