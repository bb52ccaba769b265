"""Load a user's model from a file or a factory, safely.

Accepted: TorchScript archives (``torch.jit.save``), ExportedProgram files
(``torch.export.save``, ``.pt2``), ONNX files, and ``--model-factory pkg.module:fn`` with
optional ``--weights`` (a state dict, read with ``weights_only=True``). A pickled
``nn.Module`` (``torch.save(model)``) runs arbitrary code when loaded, so it is refused
unless the user passes ``--trust-pickle``.
"""

from __future__ import annotations

import importlib
import logging
import pickle
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.core.errors import InputError, user_code_failure
from compiler.core.specs import BATCH_DIM, DTYPES, DimRange, InputSpec, ModelSpec

if TYPE_CHECKING:
    from compiler.core.manifest import FileRecord, Manifest

__all__ = ["LoadedModel", "load_model", "detect_format", "specs_from_exported_program", "snapshot_into",
           "load_snapshot", "SNAPSHOT_DIR", "onnx_inputs", "onnx_input_spec"]

log = logging.getLogger(__name__)

SNAPSHOT_DIR = "source"  # DIR/source/: the exact model a build exported (state dict or model file)
SAVE_HINT = ("save the model with torch.export.save (.pt2) or torch.jit.save, export it to ONNX, or pass "
             "--model-factory pkg.module:make_model")


@dataclass
class LoadedModel:
    """A model ready for export: an eager module (or ExportedProgram), or an ONNX file as is."""

    format: str  # "torchscript" | "exported_program" | "onnx" | "factory" | "pickle"
    source: Path | None  # the file the model came from (hashed into the manifest)
    module: Any = None  # torch.nn.Module or torch.jit.ScriptModule, in eval mode
    exported_program: Any = None  # torch.export.ExportedProgram, for .pt2 files
    onnx_path: Path | None = None

    @property
    def is_onnx(self) -> bool:
        return self.format == "onnx"


def detect_format(path: Path) -> str:
    """Tell the file's format from its content, not its name."""
    with open(path, "rb") as f:
        head = f.read(4)
    if zipfile.is_zipfile(path):
        try:
            names = zipfile.ZipFile(path).namelist()
        except (zipfile.BadZipFile, OSError) as err:
            raise InputError(f"{path}: a damaged archive ({err}); save the model again") from err
        if any("/code/" in n for n in names) and any(n.endswith("constants.pkl") or n.endswith("data.pkl")
                                                    for n in names):
            return "torchscript"
        if any(n.endswith("archive_format") or n.endswith("models/model.json") for n in names):
            return "exported_program"
        if any(n.endswith("data.pkl") for n in names):
            return "pickle"
        raise InputError(f"{path}: a zip archive but not a PyTorch model; {SAVE_HINT}")
    if head[:1] == b"\x80":
        return "pickle"
    if path.suffix.lower() == ".onnx" or head[:1] == b"\x08":  # ModelProto starts with ir_version (field 1)
        return "onnx"
    raise InputError(f"{path}: not a model file trtc can read (not TorchScript, ExportedProgram, ONNX or a "
                     f"PyTorch pickle); {SAVE_HINT}")


def load_model(path: str | Path | None = None, *, factory: str | None = None, weights: str | Path | None = None,
               trust_pickle: bool = False) -> LoadedModel:
    """Load a model from ``path`` or from ``factory`` (``pkg.module:fn``), on the CPU, in eval mode."""
    if factory:
        if path:
            raise InputError("give either a model file or --model-factory, not both")
        return _from_factory(factory, Path(weights) if weights else None)
    if path is None:
        raise InputError("no model given: pass a model file or --model-factory pkg.module:make_model")
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file; check the path")
    if weights:
        raise InputError("--weights goes with --model-factory; a model file already holds its weights")
    fmt = detect_format(path)
    loader = {"torchscript": _torchscript, "exported_program": _exported_program, "onnx": _onnx,
              "pickle": _pickle}[fmt]
    model = loader(path, trust_pickle)
    log.info("loaded %s as %s", path, fmt)
    return model


def _torchscript(path: Path, trust_pickle: bool) -> LoadedModel:
    import torch

    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except (RuntimeError, ValueError, zipfile.BadZipFile) as err:
        raise InputError(f"{path}: TorchScript archive could not be loaded ({_first_line(err)}); "
                         "save it again with torch.jit.save") from err
    return LoadedModel("torchscript", path, module=module.eval())


def _exported_program(path: Path, trust_pickle: bool) -> LoadedModel:
    import torch

    try:
        program = torch.export.load(str(path))
    except Exception as err:  # torch.export.load raises many types on damaged archives
        raise InputError(f"{path}: ExportedProgram could not be loaded ({_first_line(err)}); "
                         "save it again with torch.export.save") from err
    return LoadedModel("exported_program", path, module=program.module(), exported_program=program)


def _onnx(path: Path, trust_pickle: bool) -> LoadedModel:
    from compiler.core.onnx_io import load_onnx

    load_onnx(path, load_weights=False)  # validates the protobuf
    return LoadedModel("onnx", path, onnx_path=path)


def _pickle(path: Path, trust_pickle: bool) -> LoadedModel:
    import torch

    if not trust_pickle:
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise InputError(f"{path}: a pickled Python object (torch.save(model)); loading it can run arbitrary "
                             "code, so trtc refuses by default; pass --trust-pickle if you trust its source, or "
                             f"{SAVE_HINT}") from None
        except (RuntimeError, EOFError, zipfile.BadZipFile) as err:
            raise InputError(f"{path}: a damaged PyTorch file ({_first_line(err)}); save it again") from err
        if isinstance(obj, dict):
            raise InputError(f"{path}: holds a state dict, not a model; pass --model-factory pkg.module:make_model "
                             f"--weights {path}")
        raise InputError(f"{path}: holds a {type(obj).__name__}, not a model; {SAVE_HINT}")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # the pickle names classes of the user's project
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, AttributeError, ModuleNotFoundError) as err:
        raise InputError(f"{path}: the pickle could not be loaded ({_first_line(err)}); the classes it names "
                         "must be importable, or " + SAVE_HINT) from err
    if not isinstance(obj, torch.nn.Module):
        raise InputError(f"{path}: holds a {type(obj).__name__}, not an nn.Module; {SAVE_HINT}")
    return LoadedModel("pickle", path, module=obj.eval())


def _from_factory(spec: str, weights: Path | None) -> LoadedModel:
    import torch

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InputError(f"--model-factory {spec!r} does not parse: write pkg.module:function")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # factories usually live in the user's project
    try:
        mod = importlib.import_module(module_name)
    except ImportError as err:
        raise InputError(f"--model-factory {spec}: cannot import {module_name} ({err}); run trtc from the "
                         "directory that holds the package or install it") from err
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise InputError(f"--model-factory {spec}: {module_name} has no callable {attr!r}")
    try:
        module = fn()
    except Exception as err:  # the user's code: any exception is theirs to fix, shown at their frame
        raise InputError(f"{user_code_failure(f'--model-factory {spec}', err)}; fix the factory (--debug shows the "
                         "whole traceback)") from err
    if not isinstance(module, torch.nn.Module):
        raise InputError(f"--model-factory {spec} returned a {type(module).__name__}, not an nn.Module")
    if weights is not None:
        if not weights.is_file():
            raise InputError(f"{weights}: no such weights file; check --weights")
        try:
            state = torch.load(str(weights), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile) as err:
            raise InputError(f"{weights}: not a state dict that loads with weights_only=True "
                             f"({_first_line(err)}); save it with torch.save(model.state_dict(), PATH)") from err
        if not isinstance(state, dict):
            raise InputError(f"{weights}: holds a {type(state).__name__}, not a state dict")
        _load_state_dict(module, state, weights, spec)
    source = weights
    return LoadedModel("factory", source, module=module.eval())


def _load_state_dict(module: Any, state: dict[str, Any], weights: Path, factory: str) -> None:
    """``module.load_state_dict(state)``; InputError naming the first missing and unexpected keys, or the first
    tensor whose shape differs, when the state dict does not fit the factory's model."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own
              if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(own[k].shape)]

    def first(keys: list[str], n: int = 3) -> str:
        return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")

    problems = ([f"{len(missing)} missing key(s): {first(missing)}"] if missing else []) + \
        ([f"{len(unexpected)} unexpected key(s): {first(unexpected)}"] if unexpected else []) + \
        ([f"{len(shapes)} shape mismatch(es): {first(shapes, 2)} (file vs model)"] if shapes else [])
    if problems:
        raise InputError(f"{weights}: does not fit the model of {factory}: {'; '.join(problems)}; save the state dict "
                         "of the same architecture, or fix the factory")
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise InputError(f"{weights}: does not fit {factory} ({_first_line(err)})") from err


def snapshot_into(directory: Path, loaded: LoadedModel) -> FileRecord | None:
    """Keep the model a build exports in ``directory/source/``; returns its manifest record, None for ONNX.

    A factory's module is kept as its state dict (``source/state_dict.pt``, read back with
    ``weights_only=True``), so a factory that initialises randomly still gives bench and the
    ``torch`` serving backend the weights that were exported; a model file is copied as it is.
    """
    import torch

    from compiler.core.manifest import FileRecord

    if loaded.is_onnx or loaded.module is None:
        return None
    folder = directory / SNAPSHOT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    if loaded.format == "factory" or loaded.source is None:
        path = folder / "state_dict.pt"
        torch.save({k: v.detach().cpu().contiguous() for k, v in loaded.module.state_dict().items()}, path)
    else:
        path = folder / ("model" + (loaded.source.suffix or ".pt"))
        shutil.copyfile(loaded.source, path)
    return FileRecord.for_file(directory, path)


def load_snapshot(directory: Path, manifest: Manifest, trust_pickle: bool = False) -> LoadedModel:
    """The source model exactly as the build in ``directory`` exported it, from ``source.snapshot``.

    The snapshot is read only inside ``directory`` and after its sha256 matches the manifest. A
    factory is called for its architecture and gets the snapshot's state dict. InputError for an
    ONNX source (no PyTorch model), a build without a snapshot (made by an older trtc) or a bad one.
    """
    from compiler.core.manifest import verified_file

    source = manifest.source
    if source is not None and source.format == "onnx":
        raise InputError("the directory was exported from an ONNX file: there is no PyTorch model to run; use "
                         "backend='onnxruntime'")
    if source is None or source.snapshot is None:
        raise InputError(f"{directory}: the build keeps no snapshot of its source model (made by an older trtc); "
                         "run `trtc build` again so that bench and the torch backend run the exported weights")
    path = verified_file(directory, source.snapshot, "source model snapshot")
    if source.format == "factory":
        factory = (source.factory or source.path.partition(" + ")[0]).strip()
        return _from_factory(factory, path)
    return load_model(path, trust_pickle=trust_pickle)


def program_ranges(program: Any) -> dict[str, tuple[int, int | None]]:
    """Declared (min, max) of each dynamic dim of an ExportedProgram, named as ``specs_from_exported_program`` names
    them (B for the first); max is None when unbounded."""
    import torch

    ranges: dict[str, tuple[int, int | None]] = {}
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    letters = iter("STUVWXYZHKLMNPQR")
    seen: dict[str, str] = {}
    for name in program.graph_signature.user_inputs:
        val = placeholders[name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for size in val.shape:
            if isinstance(size, int) or str(size) in seen:
                continue
            seen[str(size)] = BATCH_DIM if not seen else next(letters)
            vr = program.range_constraints.get(size.node.expr)
            lo = max(1, int(vr.lower)) if vr is not None else 1
            hi = int(vr.upper) if vr is not None and vr.upper.is_finite else None
            ranges[seen[str(size)]] = (lo, hi)
    return ranges


def specs_from_exported_program(program: Any) -> tuple[list[InputSpec], dict[str, DimRange]]:
    """Input specs read off an ExportedProgram's placeholders and range constraints.

    The first dynamic dimension of the first input is taken as the batch ``B``; the other
    symbols get letters in order of appearance, with their declared ranges (opt = max/2
    clipped into the range, a neutral middle). The batch range comes from --buckets.
    """
    import torch

    user_inputs = list(program.graph_signature.user_inputs)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    symbols: dict[str, str] = {}
    ranges: dict[str, DimRange] = {}
    specs: list[InputSpec] = []
    letters = iter("STUVWXYZHKLMNPQR")
    for name in user_inputs:
        val = placeholders[name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise InputError(f"ExportedProgram input {name!r} is not a tensor; pass --input specs instead")
        dims: list[int | str] = []
        for size in val.shape:
            if isinstance(size, int):
                dims.append(size)
                continue
            sym = str(size)
            if sym not in symbols:
                symbols[sym] = BATCH_DIM if not symbols else next(letters)
                if symbols[sym] != BATCH_DIM:
                    vr = program.range_constraints.get(size.node.expr)
                    lo = max(1, int(vr.lower)) if vr is not None else 1
                    hi = int(vr.upper) if vr is not None and vr.upper.is_finite else max(lo, 512)
                    ranges[symbols[sym]] = DimRange(lo, min(hi, max(lo, hi // 2)), hi)
            dims.append(symbols[sym])
        specs.append(InputSpec(name, tuple(dims), str(val.dtype).removeprefix("torch.")))
    return specs, ranges


# ONNX element types trtc serves (TensorRT takes them as inputs), by their names in compiler.core.specs.DTYPES
_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 3: "int8", 2: "uint8", 9: "bool"}


def onnx_inputs(model: Any) -> list[Any]:
    """The graph inputs of an ONNX model that its caller feeds: those that are not initializers (IR 3 lists every
    initializer among the graph inputs too)."""
    initializers = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


def onnx_input_spec(model: Any, given: ModelSpec | None = None) -> ModelSpec:
    """The input spec of an ONNX model: each input as ``given`` (``--input``) has it, the others as the file declares
    them, after the given ones in the file's order; names as the file has them (any string), rank 0 included, and a
    model without inputs has an empty spec.

    InputError naming the input and why: a type trtc cannot serve (a sequence, map or optional; an element type
    TensorRT does not take, such as float64; a zero-size dimension), a shape the file leaves open that no ``--input``
    gives, or a given spec that contradicts the file (an unknown name, another rank, fixed size or dtype).
    """
    declared = onnx_inputs(model)
    given_inputs = {i.name: i for i in given.inputs} if given is not None else {}
    names = [i.name for i in declared]
    unknown = [n for n in given_inputs if n not in names]
    if unknown:
        raise InputError(f"the ONNX model has no input named {unknown[0]!r}; its inputs are "
                         f"{', '.join(repr(n) for n in names) or 'none'}: fix --input")
    from_file = []
    for info in declared:
        dtype = _served_dtype(info)
        if info.name in given_inputs:
            _check_given(info, given_inputs[info.name], dtype)
        else:
            from_file.append(_declared_spec(info, dtype))
    return ModelSpec((*given_inputs.values(), *from_file), dict(given.dims) if given is not None else {})


def _served_dtype(info: Any) -> str:
    """The DTYPES name of an ONNX input's element type; InputError for a value trtc cannot serve."""
    import onnx

    kind = info.type.WhichOneof("value")
    if kind != "tensor_type":
        raise InputError(f"the ONNX input {info.name!r} is {_type_text(info.type)}: trtc serves tensor inputs only; "
                         "re-export the model with tensor inputs")
    elem = info.type.tensor_type.elem_type
    if elem not in _ONNX_DTYPES:
        name = onnx.TensorProto.DataType.Name(elem) if elem in onnx.TensorProto.DataType.values() else str(elem)
        raise InputError(f"the ONNX input {info.name!r} is {name.lower()}, which TensorRT does not take as an input "
                         f"(it takes {', '.join(DTYPES)}); cast it in the model or re-export it with one of those")
    shape = info.type.tensor_type.shape
    if info.type.tensor_type.HasField("shape") and any(d.HasField("dim_value") and d.dim_value == 0
                                                         for d in shape.dim):
        raise InputError(f"the ONNX input {info.name!r} has a zero-size dimension ({_dims_text(info)}): TensorRT "
                         "takes no empty inputs; re-export the model with sizes of at least 1")
    return _ONNX_DTYPES[elem]


def _type_text(type_proto: Any) -> str:
    """An ONNX value type in words: ``a sequence of float tensors``, ``an optional sequence of ...``, ``a map``."""
    import onnx

    kind = type_proto.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        elem = getattr(type_proto, kind).elem_type
        name = onnx.TensorProto.DataType.Name(elem).lower() if elem in onnx.TensorProto.DataType.values() else "?"
        return f"a {name} {'sparse tensor' if kind == 'sparse_tensor_type' else 'tensor'}"
    if kind == "sequence_type":
        return "a sequence of " + _type_text(type_proto.sequence_type.elem_type).removeprefix("a ") + "s"
    if kind == "optional_type":
        return "an optional " + _type_text(type_proto.optional_type.elem_type).removeprefix("a ").removeprefix("an ")
    if kind == "map_type":
        return "a map"
    return "of no type"


def _dims_text(info: Any) -> str:
    dims = info.type.tensor_type.shape.dim
    return "x".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in dims) or "rank 0"


def _declared_spec(info: Any, dtype: str) -> InputSpec:
    """The spec of an input as the file declares it: its fixed sizes, a dynamic first dimension (any other fixed)
    read as the batch ``B``; InputError naming ``--input`` for other dynamic dimensions, whose ranges it needs."""
    tensor_type = info.type.tensor_type
    if tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in tensor_type.shape.dim):
        return InputSpec(info.name, tuple(int(d.dim_value) for d in tensor_type.shape.dim), dtype)
    dims = tensor_type.shape.dim if tensor_type.HasField("shape") else []
    if dims and not dims[0].HasField("dim_value") and all(d.HasField("dim_value") for d in dims[1:]):
        # a dynamic first dimension and fixed others: the batch, its range from --buckets
        return InputSpec(info.name, (BATCH_DIM, *(int(d.dim_value) for d in dims[1:])), dtype)
    letters = iter("STUVWXYZ")
    if tensor_type.HasField("shape"):
        dims = [str(d.dim_value) if d.HasField("dim_value") else (BATCH_DIM if k == 0 else next(letters, "S"))
                for k, d in enumerate(tensor_type.shape.dim)]
        shape, declared = "x".join(dims), f" ({_dims_text(info)})"
    else:
        shape, declared = "SHAPE", " (not even its rank)"
    raise InputError(f"the ONNX input {info.name!r} has no fixed shape in the file{declared}; pass --input "
                     f"'{info.name}:{shape}:{dtype}' (B is the batch; another letter a dynamic dimension, with --dim)")


def _check_given(info: Any, spec: InputSpec, dtype: str) -> None:
    """``--input`` must agree with the ONNX input: rank, fixed sizes (a dynamic one only where the file's is), dtype."""
    tensor_type = info.type.tensor_type
    if spec.dtype != dtype:
        raise InputError(f"--input {spec}: the ONNX input is {dtype}; write {spec.name}:"
                         f"{'x'.join(map(str, spec.dims))}:{dtype}")
    if not tensor_type.HasField("shape"):
        return
    dims = tensor_type.shape.dim
    if len(dims) != len(spec.dims):
        raise InputError(f"--input {spec}: the ONNX input has rank {len(dims)}, the spec has rank {len(spec.dims)}")
    for axis, (dim, want) in enumerate(zip(dims, spec.dims)):
        if dim.dim_value and isinstance(want, int) and dim.dim_value != want:
            raise InputError(f"--input {spec}: dimension {axis} is {dim.dim_value} in the ONNX model")
        if dim.dim_value and isinstance(want, str):
            raise InputError(f"--input {spec}: dimension {axis} is fixed at {dim.dim_value} in the ONNX "
                             f"model and cannot be the dynamic {want}; re-export with a dynamic axis")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else err.__class__.__name__
