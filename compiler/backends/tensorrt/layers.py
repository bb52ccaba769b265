"""What the engine inspector says about an engine's layers, and a summary of it for the manifest.

``layer_information`` needs TensorRT (and a GPU: it makes an execution context per profile);
``layer_summary`` only reads the JSON, from TensorRT 10 or 11.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from compiler.backends.tensorrt.profiles import Shapes
from compiler.core.errors import BuildError

if TYPE_CHECKING:
    import tensorrt as trt

__all__ = ["layer_information", "layer_summary"]


def layer_information(engine: trt.ICudaEngine, profiles: Sequence[Shapes]) -> list[str]:
    """The engine inspector's information on every layer, as JSON, for each profile (DETAILED: trtc's configs are).

    An engine with a dynamic dimension shows "N/A due to dynamic shapes" for every layer's format and type
    unless the inspector has an execution context whose input shapes are all set (``NvInferRuntime.h``,
    ``IEngineInspector::setExecutionContext``), and every trtc engine has a dynamic batch. So profile k gets a
    context with k selected and its opt shapes set, as trtexec does; one context at a time, released after.
    """
    import tensorrt as trt
    from polygraphy import cuda

    inspector = engine.create_engine_inspector()
    stream = cuda.Stream()
    infos = []
    try:
        for index, shapes in enumerate(profiles):
            context = engine.create_execution_context()
            if context is None:
                raise BuildError("TensorRT could not create an execution context to inspect the engine (out of GPU "
                                 "memory?); run with --debug and see TensorRT's log")
            if engine.num_optimization_profiles > 1:  # profile 0 is the one selected at creation
                context.set_optimization_profile_async(index, stream.ptr)
                stream.synchronize()
            for name, (_, opt, _) in shapes.items():
                if not context.set_input_shape(name, opt):
                    raise BuildError(f"profile {index} of the engine does not take {name} shaped {opt}, the shape it "
                                     "was built for; run with --debug and see TensorRT's log")
            inspector.execution_context = context
            infos.append(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
            del context  # its activation memory goes before the next profile's context takes its own
    finally:
        stream.free()
    return infos



_TYPE_NAMES = {"float": "FP32", "fp32": "FP32", "half": "FP16", "fp16": "FP16", "bf16": "BF16", "bfloat16": "BF16",
               "int8": "INT8", "fp8": "FP8", "int4": "INT4", "fp4": "FP4", "int32": "INT32", "int64": "INT64",
               "bool": "BOOL", "uint8": "UINT8"}
_TYPE_TOKEN = re.compile(r"\b(" + "|".join(_TYPE_NAMES) + r")\b", re.IGNORECASE)


def _output_type(layer: dict[str, Any]) -> str:
    outputs = layer.get("Outputs") or []
    first = outputs[0] if outputs and isinstance(outputs[0], dict) else {}
    # TensorRT 11 has a "DataType" field; TensorRT 10 folds it into "Format/Datatype" ("Row major linear FP16 ...")
    text = str(first.get("DataType") or first.get("Format/Datatype") or "")
    match = _TYPE_TOKEN.search(text)
    return _TYPE_NAMES[match.group(1).lower()] if match else "unknown"


def layer_summary(layers_json: str) -> dict[str, Any]:
    """Layer count and the count of layers per output data type, from the inspector's JSON.

    Reads TensorRT 10's and 11's layouts; layers given only by name (an engine built without
    DETAILED profiling verbosity) are counted under "unknown".
    """
    try:
        info = json.loads(layers_json)
    except ValueError:
        return {"count": None, "output_types": {}}
    layers = info.get("Layers", []) if isinstance(info, dict) else []
    types: dict[str, int] = {}
    for layer in layers:
        name = _output_type(layer) if isinstance(layer, dict) else "unknown"
        types[name] = types.get(name, 0) + 1
    return {"count": len(layers), "output_types": dict(sorted(types.items()))}
