"""Loading and saving ONNX models, external data included, and ONNX Runtime sessions.

trtc always saves a graph ``X.onnx`` with its weights in ``X.onnx.data`` beside it (the
layout the dynamo exporter writes), so graphs stay small and models over 2 GiB work.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from compiler.core.errors import InputError

__all__ = ["load_onnx", "load_onnx_by_reference", "save_onnx", "tensor_array", "onnx_files", "ort_session",
           "warm_checking_providers", "warm_checking_providers_beside", "SESSION_POLICY", "SessionRule",
           "graph_holds", "session_rules", "ort_log_severity", "apply_ort_log_severity", "TemporaryOnnxFile",
           "outer_scope_names",
           "copy_fields", "weightless_copy", "FreshNames",
           "MAX_IR_VERSION"]

log = logging.getLogger(__name__)

# onnx 1.23 writes IR version 14 by default; ONNX Runtime 1.31 reads at most 13.
MAX_IR_VERSION = 10


def load_onnx(path: str | os.PathLike[str], load_weights: bool = True) -> onnx.ModelProto:
    """Load an ONNX model and, by default, its external data from beside it."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such ONNX file; check the path")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as err:
        raise InputError(f"{path}: not a valid ONNX file ({err.__class__.__name__}); pass an .onnx model") from err
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{path}: not a valid ONNX file (no graph); pass an .onnx model")
    if load_weights:
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError) as err:
            raise InputError(f"{path}: external weights could not be read ({err}); keep the .data file "
                             "beside the .onnx file") from err
    return model


def load_onnx_by_reference(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """``path``'s graph, its external weights left in their file: each refers to it by absolute path.

    Costs no memory for the weights, whatever the model's size. Passes read a weight when they need it
    (:func:`tensor_array`) and :func:`save_onnx` copies the bytes of those still referenced into the file it
    writes, so a model built from this one (Q/DQ, FP16) holds only its new weights. The absolute locations
    are for this process only: ``save_onnx`` never writes them, and ONNX Runtime never sees such a proto.
    """
    path = Path(path)
    model = load_onnx(path, load_weights=False)
    files = {f.name: f.resolve() for f in onnx_files(path)[1:]}  # checked to stay beside the graph
    for t in _external_tensors(model.graph):
        entry = next(e for e in t.external_data if e.key == "location")
        entry.value = str(files[entry.value])
    return model


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """The values of ``tensor``, read from its file when :func:`load_onnx_by_reference` left it there.

    Raises ValueError for external data that was not loaded (a relative location with no folder to read it
    from): load the model with :func:`load_onnx` or :func:`load_onnx_by_reference`.
    """
    ref = _reference(tensor)
    if ref is None:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            raise ValueError(f"tensor {tensor.name!r} is external data that was not loaded; load the model with "
                             "compiler.core.onnx_io.load_onnx (or load_onnx_by_reference) first")
        return numpy_helper.to_array(tensor)
    file, offset, length = ref
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    with open(file, "rb") as f:
        f.seek(offset)
        data = np.fromfile(f, dtype=np.uint8, count=length)
    if data.size != length:
        raise ValueError(f"tensor {tensor.name!r}: {file} ends before its {length} bytes at offset {offset}")
    shaped = data.view(dtype.newbyteorder("<")).reshape(tuple(tensor.dims))
    return shaped.astype(dtype, copy=False)


def _external_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers of ``graph`` whose data lives in a file (subgraphs keep theirs inline)."""
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            yield t


def _reference(tensor: onnx.TensorProto) -> tuple[Path, int, int] | None:
    """(file, offset, length) of a tensor left in its file by :func:`load_onnx_by_reference`, else None."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    if not os.path.isabs(location):
        return None
    length = int(info["length"]) if "length" in info else Path(location).stat().st_size - int(info.get("offset", 0))
    return Path(location), int(info.get("offset", 0)), length


_COPY_CHUNK = 64 << 20  # bytes copied at a time from a referenced weight file


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike[str]) -> list[Path]:
    """Save ``model`` as ``path`` plus ``path.data`` (weights of 1 KiB or more); returns the files written.

    The one way trtc writes a model, for its outputs and for ONNX Runtime sessions: the weights are
    written one at a time and the graph file holds references, so nothing here holds a second copy of the
    weights, ``model`` is left as it was (no IR version change either), and models over 2 GiB work.
    Weights that :func:`load_onnx_by_reference` left in their file are copied across in chunks; external
    data that was never loaded (a relative location) stays a reference, as written. Own code rather than
    ``onnx.save_model(save_as_external_data=True)``: that moves the weights out of the proto, and loading
    them back grows protobuf's arena by their size each time (it keeps the cleared bytes).
    Initializers of subgraphs stay inline. Does not write atomically by itself: callers save into a
    staging directory and commit it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_path = path.parent / (path.name + ".data")
    partial = path.parent / (data_path.name + ".partial")  # the old data file may be what references point at
    skeleton = copy_fields(model, onnx.ModelProto(), skip={"graph"})
    skeleton.ir_version = min(skeleton.ir_version, MAX_IR_VERSION)
    graph = copy_fields(model.graph, skeleton.graph, skip={"initializer"})
    offset = 0
    kept: set[str] = set()  # files that references never loaded still point at
    try:
        with partial.open("wb") as out:
            for t in model.graph.initializer:
                ref = _reference(t)
                if ref is None and (t.data_location == onnx.TensorProto.EXTERNAL or t.ByteSize() < 1024):
                    graph.initializer.append(t)
                    kept.update(e.value for e in t.external_data if e.key == "location")
                    continue
                if ref is not None:
                    length = _copy_bytes(ref, out)
                else:
                    payload = t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes()
                    out.write(payload)
                    length = len(payload)
                    del payload
                stored = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims,
                                          data_location=onnx.TensorProto.EXTERNAL)
                if t.HasField("doc_string"):
                    stored.doc_string = t.doc_string
                for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(length))):
                    stored.external_data.add(key=key, value=value)
                graph.initializer.append(stored)
                offset += length
        if data_path.name in kept and offset:
            raise ValueError(f"{path}: the model's unloaded weights live in {data_path.name}, which saving it there "
                             "would overwrite; load it with load_onnx_by_reference, or save it elsewhere")
        if offset:
            os.replace(partial, data_path)
        elif data_path.name not in kept and data_path.exists():
            data_path.unlink()
        path.write_bytes(skeleton.SerializeToString())
    finally:
        if partial.exists():
            partial.unlink()
    return [p for p in (path, data_path) if p.exists()]


def _copy_bytes(ref: tuple[Path, int, int], out: Any) -> int:
    """Append ``ref``'s bytes (file, offset, length) to ``out`` a chunk at a time; returns the length."""
    file, offset, length = ref
    with open(file, "rb") as source:
        source.seek(offset)
        left = length
        while left:
            chunk = source.read(min(left, _COPY_CHUNK))
            if not chunk:
                raise ValueError(f"{file} ends before the {length} bytes at offset {offset} it should hold")
            out.write(chunk)
            left -= len(chunk)
    return length


def onnx_files(path: str | os.PathLike[str]) -> list[Path]:
    """The graph file and every external data file it references."""
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as err:
        raise InputError(f"{path}: not a valid ONNX file ({err.__class__.__name__}); pass an .onnx model") from err
    locations: set[str] = set()
    tensors: list[Any] = list(model.graph.initializer)
    for node in model.graph.node:
        tensors += [a.t for a in node.attribute if a.HasField("t")]
    for t in tensors:
        for entry in t.external_data:
            if entry.key == "location":
                locations.add(entry.value)
    for loc in locations:  # external data stays beside the graph (onnx refuses anything else when loading too)
        if not loc or loc.startswith(("/", "\\")) or ".." in loc.replace("\\", "/").split("/") or ":" in loc:
            raise InputError(f"{path}: external data location {loc!r} leaves the model's folder; keep the data "
                             "files beside the .onnx file")
    return [path] + [path.parent / loc for loc in sorted(locations)]


@dataclass(frozen=True)
class SessionRule:
    """What a session of a graph that holds ``what`` runs without, and why (measured, ONNX Runtime 1.31 on the CPU;
    the graph run with every optimization off is the reference): graph transformers turned off by name
    (``disabled_optimizers``) and session config entries (``config``, (key, value) pairs). ``changes_results``:
    whether the graph run with those transformers on gives other outputs or no session (False: they only crash the
    session on some hosts' CPU provider, and a GPU instance, Triton's, never runs them)."""

    what: str
    disabled_optimizers: tuple[str, ...]
    why: str
    config: tuple[tuple[str, str], ...] = ()
    changes_results: bool = True


# The session options trtc runs a graph with, by what the graph holds: the one policy for every run of a build's
# graphs (export checks, calibration, the accuracy gate, bench, serving, the load check before a precision file is
# written): every session trtc makes comes from ``ort_session``. A graph that holds none of these runs with every
# optimization on. QDQSelectorActionTransformer is the pass that rewrites DequantizeLinear -> op -> QuantizeLinear
# groups into ONNX Runtime's own quantized kernels (QLinearConv, QLinearConcat, MatMulIntegerToFloat, MatMulNBits);
# ``session.disable_quant_qdq`` turns it off with ONNX Runtime's other Q/DQ rewrites (propagation, bias
# quantization, pair removal): the Q/DQ then run as written, every other optimization (constant folding, layout,
# fusions of the float graph) stays on. Those rewrites apply to nodes on the CPU provider only.
SESSION_POLICY: dict[str, SessionRule] = {
    "qdq": SessionRule("Q/DQ", (),
                       "ONNX Runtime's Q/DQ fusions change or break valid Q/DQ graphs: the Q/DQ of FP16 tensors have "
                       "FP16 scales, and QLinearConcat, what the Q/DQ around a Concat become, takes FP32 scales only "
                       "(the session fails to load: SegFormer's decoder, an upsampled branch concatenated with "
                       "another); the fused u8s8 kernels saturate intermediate sums on x86 CPUs without VNNI, "
                       "which TensorRT does not",
                       config=(("session.disable_quant_qdq", "1"),)),
    "fp8": SessionRule("FP8 Q/DQ", ("QDQSelectorActionTransformer", "WeightBiasQuantization"),
                       "QDQSelectorActionTransformer rewrites an FP8 DequantizeLinear -> MatMul into "
                       "MatMulIntegerToFloat, which takes no FP8 input: the session fails to load (level extended or "
                       "all); WeightBiasQuantization stores a Conv's bias as INT32 at the FP8 input and weight "
                       "scales, which changes its outputs (the digits CNN lost 11 points of top-1; level basic up)"),
    "int4": SessionRule("INT4 block-quantized weights", ("QDQSelectorActionTransformer",),
                        "it rewrites an INT4 DequantizeLinear(block_size) -> MatMul into MatMulNBits, which at its "
                        "accuracy level 4 quantizes the activations to INT8 on the fly: the results change"),
    "fp16": SessionRule("FP16 tensors", ("NchwcTransformer",),
                        "ONNX Runtime 1.31's NchwcTransformer (level all, the CPU provider's blocked layout for FP32 "
                        "convolutions and pooling) crashed the process (SIGSEGV) creating the CPU session of "
                        "torchvision's ViT-B/16 in FP16 on an Intel Xeon host; the graph loads and runs at level "
                        "extended and with that transformer alone off. It changes layouts only, never results",
                        changes_results=False),
}
_FP8_TYPES = frozenset({onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E4M3FNUZ, onnx.TensorProto.FLOAT8E5M2,
                        onnx.TensorProto.FLOAT8E5M2FNUZ})
_INT4_TYPES = frozenset({onnx.TensorProto.INT4, onnx.TensorProto.UINT4})
_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


def graph_holds(model: onnx.ModelProto) -> frozenset[str]:
    """Which of ``SESSION_POLICY``'s kinds the main graph holds: ``qdq`` (a QuantizeLinear or DequantizeLinear),
    ``fp8`` (an FP8 initializer, zero point or Q/DQ output type), ``int4`` (an INT4/UINT4 initializer, or a
    DequantizeLinear with ``block_size``), ``fp16`` (an FP16 initializer, constant, cast or graph tensor)."""
    graph = model.graph
    types = {t.data_type for t in graph.initializer}
    types |= {vi.type.tensor_type.elem_type for vi in [*graph.input, *graph.output, *graph.value_info]}
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                types.add(attr.t.data_type)
            elif ((attr.name == "output_dtype" and attr.type == onnx.AttributeProto.INT)
                  or (attr.name == "to" and node.op_type == "Cast")):
                types.add(attr.i)
    held = set()
    if any(n.op_type in _QDQ_OPS for n in graph.node):
        held.add("qdq")
    if types & _FP8_TYPES:
        held.add("fp8")
    if onnx.TensorProto.FLOAT16 in types:
        held.add("fp16")
    if types & _INT4_TYPES or any(n.op_type == "DequantizeLinear" and any(a.name == "block_size" for a in n.attribute)
                                  for n in graph.node):
        held.add("int4")
    return frozenset(held)


def session_rules(model: str | os.PathLike[str] | onnx.ModelProto) -> list[SessionRule]:
    """The ``SESSION_POLICY`` rules that apply to ``model`` (a path: its graph is read, not its weights)."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    held = graph_holds(proto)
    return [rule for kind, rule in SESSION_POLICY.items() if kind in held]


# ONNX Runtime's log severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal
_ORT_WARNING, _ORT_ERROR = 2, 3


def ort_log_severity() -> int:
    """The severity from which ONNX Runtime's own log lines are shown: its warnings (optimizer notes such as "could
    not constant fold", hundreds for a large model) when this module's logger is enabled for DEBUG, else errors
    only."""
    return _ORT_WARNING if log.isEnabledFor(logging.DEBUG) else _ORT_ERROR


def apply_ort_log_severity() -> int:
    """Set ONNX Runtime's default logger to ``ort_log_severity()`` and return it: what sessions made elsewhere
    with default options log (onnx-graphsurgeon's constant folding makes its own), and what ONNX Runtime's
    optimizers log through, whatever their session's own level."""
    import onnxruntime as ort

    severity = ort_log_severity()
    ort.set_default_logger_severity(severity)
    return severity


def ort_session(model: str | os.PathLike[str] | onnx.ModelProto, providers: list[Any] | None = None,
                threads: int = 0, weights_dir: str | os.PathLike[str] | None = None,
                memory_arena: bool = True, in_node_order: bool = False, spinning: bool = True) -> Any:
    """An ONNX Runtime session on the given model (path or in-memory proto): every ONNX Runtime run trtc makes.
    All graph optimizations are on except those ``SESSION_POLICY`` turns off for what the graph holds (Q/DQ,
    FP8 Q/DQ, INT4 weights: ``session_rules``), so the accuracy gate, bench and serving run a graph alike; ONNX
    Runtime logs at ``ort_log_severity()``.

    The options are about execution only, never about what the graph computes: ``weights_dir``: where the
    external data of an in-memory proto lives (its graph alone then costs no copy of the weights).
    ``memory_arena=False`` returns each run's CPU buffers instead of keeping an arena sized by the largest
    run (rounded up to a power of two): slower by a few percent, but memory follows what is live.
    ``in_node_order`` runs nodes in the graph's order where ONNX Runtime may choose (priority-based order).
    ``spinning=False``: ONNX Runtime's idle threads sleep instead of spinning for work (serving sessions, which
    share the cores with the server's own threads). ``providers``: names or (name, options) pairs, default the CPU.
    """
    import onnxruntime as ort

    severity = apply_ort_log_severity()
    opts = ort.SessionOptions()
    opts.log_severity_level = severity
    rules = session_rules(model)
    for rule in rules:
        for key, value in rule.config:
            opts.add_session_config_entry(key, value)
    if weights_dir is not None:
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights_dir))
    if threads:
        opts.intra_op_num_threads = threads
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if not memory_arena:
        opts.enable_cpu_mem_arena = False
    if in_node_order:
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if providers and any(p != "CPUExecutionProvider" for p in providers) and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    providers = providers or ["CPUExecutionProvider"]
    disabled = sorted({name for rule in rules for name in rule.disabled_optimizers})
    extra: dict[str, Any] = {"disabled_optimizers": disabled} if disabled else {}
    if rules:
        log.debug("ONNX Runtime session without %s (what the graph holds: SESSION_POLICY)",
                  ", ".join([*disabled, *(f"{k}={v}" for r in rules for k, v in r.config)]))
    held = _weight_bytes(model) if isinstance(model, onnx.ModelProto) else 0
    if held > _PROTO_LIMIT or (held > _SERIALIZE_LIMIT and weights_dir is None):
        # ONNX Runtime reads it from files, removed once it has loaded them: protobuf cannot serialize 2 GiB, and
        # writing the weights as they are is faster than one serialized copy (a ViT-B/16 on the dev CPU: 0.9 s
        # against 3.2-4.0 s with the session's own parse of it)
        assert isinstance(model, onnx.ModelProto)
        with TemporaryOnnxFile(model) as path:
            return ort.InferenceSession(str(path), sess_options=opts, providers=providers, **extra)
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, sess_options=opts, providers=providers, **extra)


def warm_checking_providers() -> list[str]:
    """Load what trtc's own ONNX Runtime runs (``capabilities.checking_providers``) need before the first of them,
    and return those providers: ONNX Runtime, torch, and where ONNX Runtime's CUDA provider is among them, CUDA
    and the provider's libraries, by running a one-node graph once on it. A worker started ahead of its work
    (``worker.Worker``) calls it so that these seconds pass while the export runs."""
    import onnxruntime  # noqa: F401  (the import is the point)

    from compiler.core.capabilities import checking_providers

    providers = checking_providers()
    if providers[0] != "CPUExecutionProvider":
        x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
        y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
        graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "warm", [x], [y])
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
        ort_session(model, providers).run(None, {"x": np.ones(1, np.float32)})
    return providers


def warm_checking_providers_beside() -> threading.Thread:
    """``warm_checking_providers`` in a daemon thread started now, beside the export: the export checks' first
    session then finds CUDA and the provider's libraries loaded (their loading is native code, which need not hold
    the GIL). A failure there is logged (debug) and left to the checks to meet."""

    def warm() -> None:
        try:
            warm_checking_providers()
        except Exception as err:  # warming is an optimisation: the checks report whatever failed here
            log.debug("warming ONNX Runtime's providers failed: %s", err)

    thread = threading.Thread(target=warm, name="trtc-warm-providers", daemon=True)
    thread.start()
    return thread


class TemporaryOnnxFile:
    """``model`` saved (:func:`save_onnx`) into a temporary folder, removed on exit: ``with
    TemporaryOnnxFile(model) as path: session = ...(path)``, for ONNX Runtime to read a proto from a file.

    Reading the file costs no serialized copy of the weights beside the proto (and works over 2 GiB).
    Keeps no reference to ``model``: a caller that drops its own inside the block frees the weights before
    ONNX Runtime loads its copy. Once a session has loaded the model it no longer needs the files.
    """

    def __init__(self, model: onnx.ModelProto, prefix: str = "trtc-ort-") -> None:
        self._scratch = tempfile.TemporaryDirectory(prefix=prefix)
        self.path = Path(self._scratch.name) / "model.onnx"
        try:
            save_onnx(model, self.path)
        except BaseException:
            self._scratch.cleanup()
            raise

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self._scratch.cleanup()


_PROTO_LIMIT = 2**31 - 2**24  # bytes of weights above which a proto is not serialized in one piece
_SERIALIZE_LIMIT = 2**26  # bytes of weights above which a session reads a proto from files


def _weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the weights held in the proto (raw data and typed fields, roughly), without serializing it."""
    total = 0
    for t in model.graph.initializer:
        total += len(t.raw_data) + 4 * (len(t.float_data) + len(t.int32_data)) + 8 * (len(t.int64_data)
                                                                                      + len(t.double_data))
    return total


def outer_scope_names(node: onnx.NodeProto) -> set[str]:
    """Names that the control-flow subgraphs of ``node`` (If, Loop, Scan; nested ones too) read from the scopes
    around it; empty for a node without subgraphs. Names a subgraph defines itself are not among them."""
    names: set[str] = set()
    for sub in subgraphs(node):
        names |= _free_names(sub)
    return names


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The control-flow subgraphs of ``node`` (If's branches, Loop's and Scan's bodies), not nested ones."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _free_names(graph: onnx.GraphProto) -> set[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {o for node in graph.node for o in node.output}
    used = {i for node in graph.node for i in node.input if i} | {o.name for o in graph.output}
    for node in graph.node:
        used |= outer_scope_names(node)
    return used - defined


SMALL_INITIALIZER = 1024  # elements: smaller initializers stay in a weightless copy (they may hold shapes)


def copy_fields(source: Any, target: Any, skip: set[str]) -> Any:
    """Copy every set field of a protobuf message except ``skip`` (so that large graphs are not copied twice)."""
    for fd, value in source.ListFields():
        if fd.name in skip:
            continue
        if fd.is_repeated:
            getattr(target, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(target, fd.name).CopyFrom(value)
        else:
            setattr(target, fd.name, value)
    return target


def weightless_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with initializers over ``SMALL_INITIALIZER`` elements (or in external data) turned into typed
    graph inputs: cheap to copy and to run shape inference on, whatever the model's size (no 2 GiB limit)."""
    import math

    from onnx.external_data_helper import uses_external_data

    skeleton = copy_fields(model, onnx.ModelProto(), skip={"graph"})
    graph = model.graph
    g = copy_fields(graph, skeleton.graph, skip={"initializer", "input"})
    g.input.extend(graph.input)
    inputs = {i.name for i in graph.input}
    for t in graph.initializer:
        if math.prod(t.dims) <= SMALL_INITIALIZER and not uses_external_data(t):
            g.initializer.append(t)
        elif t.name not in inputs:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return skeleton


class FreshNames:
    """Tensor and node names that collide with nothing in ``graph`` (its initializers, inputs, and every node's
    inputs, outputs and name), nor with any name this handed out before."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.used: set[str] = {t.name for t in graph.initializer} | {i.name for i in graph.input}
        self.used |= {name for node in graph.node for name in [*node.input, *node.output, node.name]}

    def __call__(self, base: str) -> str:
        """``base``, or ``base_1``, ``base_2``, ... : the first one not used yet, from then on used."""
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name

