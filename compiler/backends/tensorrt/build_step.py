"""The real build step: TensorRT builds an engine from a Polygraphy loader, and says what it rejected.

``tensorrt_build_step`` is what ``build_engine_files`` calls when no other step is given; tests of everything
around a build inject a double of this step alone. Every function here needs TensorRT, imported when called.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.backends.tensorrt.layers import layer_information
from compiler.backends.tensorrt.logger import tensorrt_logger
from compiler.backends.tensorrt.profiles import Shapes
from compiler.backends.tensorrt.versions import strongly_typed_flag
from compiler.core.errors import BuildError

if TYPE_CHECKING:
    import tensorrt as trt

__all__ = ["tensorrt_build_step", "describe_parser_errors", "deserialize_engine"]

log = logging.getLogger(__name__)


def describe_parser_errors(parser: trt.OnnxParser) -> str:
    """The ONNX parser's errors as one line each naming the node and operator TensorRT rejected."""
    lines = []
    for index in range(parser.num_errors):
        error: trt.ParserError = parser.get_error(index)
        if error.node() >= 0:
            where = f"node {error.node_name() or '#' + str(error.node())} ({error.node_operator() or '?'})"
        else:
            where = "the graph"
        stack = error.local_function_stack()
        if stack:
            where += f" in local function {' > '.join(stack)}"
        lines.append(f"{where}: {error.desc()} [{error.code().name}]")
    return "; ".join(lines) or "the parser reported no error, yet parsing failed"


def _parser_errors(onnx_path: Path) -> str | None:
    """Parse ``onnx_path`` once more with a fresh TensorRT parser and describe what it rejects, or None.

    Polygraphy logs the parser's errors and raises "Could not parse ONNX correctly", dropping the
    error objects; a second parse is cheap next to a build, and only happens on failure. The second
    parse logs nothing: its errors are in the ``BuildError`` the caller raises.
    """
    import tensorrt as trt
    from polygraphy.logger import G_LOGGER

    logger = tensorrt_logger()
    builder = trt.Builder(logger)
    flags = 0
    if strongly_typed_flag():
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        parsed = parser.parse_from_file(str(onnx_path))
    if parsed and parser.num_errors == 0:
        return None
    return describe_parser_errors(parser)


def deserialize_engine(engine_bytes: bytes) -> trt.ICudaEngine:
    """The engine trtc just built, loaded back (host code allowed: trtc built it); ``BuildError`` if TensorRT
    cannot."""
    import tensorrt as trt

    runtime = trt.Runtime(tensorrt_logger())
    runtime.engine_host_code_allowed = True  # version-compatible engines carry the lean runtime; trtc built it
    engine = runtime.deserialize_cuda_engine(engine_bytes)
    if engine is None:
        raise BuildError("TensorRT built an engine it cannot load back; run with --debug and see TensorRT's log")
    return engine


def tensorrt_build_step(loader: Any, profiles: list[Shapes]) -> tuple[bytes, list[str]]:
    """Build with TensorRT through Polygraphy: the serialized engine and its layer information JSON per profile.

    Parser failures become a ``BuildError`` that names each ONNX node and operator TensorRT rejected;
    other failures a ``BuildError`` pointing at TensorRT's log.
    """
    from polygraphy.exception import PolygraphyException
    from polygraphy.logger import G_LOGGER

    severity = G_LOGGER.INFO if log.isEnabledFor(logging.DEBUG) else G_LOGGER.WARNING
    try:
        with G_LOGGER.verbosity(severity):
            engine_bytes = loader()
    except (PolygraphyException, RuntimeError) as err:  # RuntimeError: what TensorRT's bindings raise
        onnx_path = Path(loader._network.path)  # polygraphy keeps the path public on NetworkFromOnnxPath
        rejected = _parser_errors(onnx_path)
        if rejected:
            raise BuildError(f"TensorRT cannot parse {onnx_path.name}: {rejected}; change or replace these "
                             "operators in the model (or export with another --opset)") from err
        raise BuildError(f"TensorRT failed to build the engine ({err}); run with --debug to see TensorRT's "
                         "log, or lower --opt-level / raise --workspace") from err
    data = bytes(engine_bytes)
    return data, layer_information(deserialize_engine(data), profiles)
