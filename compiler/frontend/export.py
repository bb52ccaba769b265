"""PyTorch -> ONNX with dynamic batch (and other declared dynamic dims).

The dynamo exporter (``torch.onnx.export(..., dynamo=True)``) goes first. If it fails, the
TorchScript exporter is tried, and the manifest records which one produced the file. A
TorchScript module goes straight to the TorchScript exporter, since dynamo cannot trace it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from compiler.backends.pytorch import names_of_outputs
from compiler.core.errors import ExportError, InputError, raised_by_user_code, user_code_failure
from compiler.core.onnx_io import load_onnx
from compiler.core.specs import BATCH_DIM, INTEGER_DTYPES, ModelSpec
from compiler.frontend.loading import LoadedModel, onnx_input_spec
from compiler.frontend.verify import FeedSource

__all__ = ["ExportResult", "onnx_from_torch", "example_inputs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    model: onnx.ModelProto
    exporter: str  # "dynamo" | "torchscript" | "onnx-input"
    opset: int
    seconds: float
    fallback_reason: str | None = None  # why dynamo was not used, when it was not


def example_inputs(spec: ModelSpec, max_batch: int, feeds: FeedSource | None = None) -> tuple[Any, ...]:
    """Tensors to trace with: batch 2 (not 0 or 1, which exporters specialise) and dims at opt.

    With ``feeds`` (the user's example or calibration data), its first samples at batch 2 instead, so that
    integer inputs hold values the model accepts.
    """
    import torch

    batch = min(2, max_batch) if max_batch > 1 else 1
    if feeds is not None:
        feed = feeds(batch)
    else:
        values = spec.opt_values(batch)
        for name, rng in spec.dims.items():
            values[name] = max(2, rng.opt) if rng.max >= 2 else rng.opt
        feed = spec.example_feed(batch=values[BATCH_DIM], values=values)
    return tuple(torch.from_numpy(feed[i.name]) for i in spec.inputs)


def onnx_from_torch(loaded: LoadedModel, spec: ModelSpec, max_batch: int, opset: int | None = None,
                    output_names: list[str] | None = None, workdir: Path | None = None,
                    feeds: FeedSource | None = None) -> ExportResult:
    """Export ``loaded`` to an in-memory ONNX model whose dynamic dims are named as in ``spec``.

    ``workdir`` holds the TorchScript exporter's file (the dynamo exporter's model becomes a proto
    without one); it must exist. ``feeds`` gives example inputs from the user's data (see
    ``example_inputs``).
    """
    start = time.perf_counter()
    if loaded.is_onnx:
        assert loaded.onnx_path is not None
        model = load_onnx(loaded.onnx_path)
        onnx_input_spec(model, spec)  # InputError where the spec contradicts the file
        return ExportResult(model, "onnx-input", _opset(model), time.perf_counter() - start)
    assert workdir is not None
    args = example_inputs(spec, max_batch, feeds)
    eager = _check_model_accepts(loaded, spec, args, from_data=feeds is not None)
    output_names = output_names or names_of_outputs(eager, spec.input_names)
    path = workdir / "exported.onnx"
    if loaded.format == "torchscript":
        model = _torchscript_export(loaded.module, args, spec, max_batch, opset, output_names, path)
        return ExportResult(model, "torchscript", _opset(model), time.perf_counter() - start,
                            "TorchScript modules cannot be traced by the dynamo exporter")
    try:
        model = _dynamo_export(loaded, args, spec, max_batch, opset, output_names)
        return ExportResult(model, "dynamo", _opset(model), time.perf_counter() - start)
    except Exception as dynamo_err:  # the exporter raises many types; all mean "try the other one"
        reason = _summarize(dynamo_err)
        log.warning("dynamo exporter failed (%s); retrying with the TorchScript exporter", reason)
        if loaded.module is None:
            raise ExportError(f"the dynamo exporter failed: {reason}") from dynamo_err
        try:
            model = _torchscript_export(loaded.module, args, spec, max_batch, opset, output_names, path)
        except Exception as ts_err:
            raise ExportError(f"both ONNX exporters failed. dynamo: {reason}. torchscript: {_summarize(ts_err)}. "
                              "Replace or register that operator (torch.onnx custom translation), or export "
                              "ONNX yourself and pass the .onnx file") from ts_err
        return ExportResult(model, "torchscript", _opset(model), time.perf_counter() - start, reason)


_REJECTS = (RuntimeError, TypeError, ValueError, IndexError, AssertionError)


def _check_model_accepts(loaded: LoadedModel, spec: ModelSpec, args: tuple[Any, ...], from_data: bool = False,
                         ) -> Any:
    """Run the eager model once on the example inputs, so that a wrong shape spec or value range, a forward that
    raises or one that returns None fails clearly, early, in one line that shows the user's frame; returns what
    it returned."""
    import torch

    try:
        with torch.inference_mode():
            out = loaded.module(*args)
    except Exception as err:  # the user's forward: whatever it raises is theirs, shown at their frame
        raise InputError(_rejection(loaded, spec, args, from_data, err)) from err
    if out is None or (isinstance(out, (tuple, list)) and out and all(o is None for o in out)):
        raise InputError(f"the model's forward returned None ({_forward_location(loaded.module)}): there is no "
                         "output to export; return the output tensor(s) from forward")
    return out


def _rejection(loaded: LoadedModel, spec: ModelSpec, args: tuple[Any, ...], from_data: bool,
               err: BaseException) -> str:
    """The message for a forward that raised on the example inputs: which inputs, what the user can change."""
    failure = user_code_failure("the model's forward", err)
    culprit = None if from_data else _rejected_values(loaded, spec, args)
    if culprit is not None:
        return (f"the model rejects the example values of input {culprit.name!r} ({culprit.describe_values()}): "
                f"{failure}; give the values it accepts as --input "
                f"'{culprit.name}:{'x'.join(map(str, culprit.dims))}:{culprit.dtype}[LOW,HIGH)' or pass --example-data "
                "with real inputs")
    shapes = ", ".join(f"{i.name}={tuple(a.shape)}" for i, a in zip(spec.inputs, args))
    if from_data and _fails_on_spec_values(loaded, spec, args):
        return (f"the model fails in eager PyTorch on the first samples of the given data ({shapes}) and on "
                f"generated inputs of the same shapes: {failure}; fix the model (the data are not the cause)")
    if from_data:
        return (f"the model rejects the first samples of the given data ({shapes}): {failure}; fix that data "
                "(--example-data, or --calib-data without it)")
    if raised_by_user_code(err):  # the forward's own line raised: the model first, the shapes perhaps
        return (f"{failure} on inputs shaped like {shapes}; fix the model's forward, or the --input shapes if they "
                "are wrong (--debug shows the whole traceback)")
    values = "; ".join(f"{i.name}: {i.describe_values()}" for i in spec.inputs if i.dtype in INTEGER_DTYPES)
    hint = "fix the --input shapes" + (f" or the integer inputs' value ranges ({values})" if values else "")
    return (f"the model rejects inputs shaped like --input {' '.join(str(i) for i in spec.inputs)} ({shapes}): "
            f"{failure}; {hint}, or the model")


def _fails_on_spec_values(loaded: LoadedModel, spec: ModelSpec, args: tuple[Any, ...]) -> bool:
    """Whether the model raises on the spec's generated values at the shapes of ``args`` too (the data are not
    what it fails on)."""
    import torch

    batch = int(args[0].shape[0]) if args and args[0].dim() else 1
    feed = spec.example_feed(batch=batch, values={d: int(a.shape[k]) for i, a in zip(spec.inputs, args)
                                                  for k, d in enumerate(i.dims) if isinstance(d, str)})
    try:
        with torch.inference_mode():
            loaded.module(*(torch.from_numpy(feed[i.name]) for i in spec.inputs))
    except Exception:  # any failure answers the question
        return True
    return False


def _forward_location(module: Any) -> str:
    """``file:line in Class.forward`` of a module's forward, for a message; the class name where it has no file."""
    import inspect

    forward = getattr(type(module), "forward", None)
    name = f"{type(module).__name__}.forward"
    try:
        path = inspect.getsourcefile(forward) if forward is not None else None
        line = inspect.getsourcelines(forward)[1] if forward is not None else 0
    except (OSError, TypeError):
        return name
    if not path:
        return name
    with contextlib.suppress(ValueError):  # a file outside the working directory keeps its full path
        path = str(Path(path).resolve().relative_to(Path.cwd()))
    return f"{name} at {path}:{line}"


def _rejected_values(loaded: LoadedModel, spec: ModelSpec, args: tuple[Any, ...]) -> Any:
    """The integer input whose example values the model rejects: the one that, set to zeros, lets the model run."""
    import torch

    for index, (inp, arg) in enumerate(zip(spec.inputs, args)):
        if inp.dtype not in INTEGER_DTYPES or not bool(torch.any(arg != 0)):
            continue
        trial = list(args)
        trial[index] = torch.zeros_like(arg)
        try:
            with torch.inference_mode():
                loaded.module(*trial)
        except _REJECTS:
            continue
        return inp
    return None


def _dynamo_export(loaded: LoadedModel, args: tuple[Any, ...], spec: ModelSpec, max_batch: int,
                   opset: int | None, output_names: list[str] | None) -> onnx.ModelProto:
    import torch

    dims: dict[str, Any] = {BATCH_DIM: torch.export.Dim(BATCH_DIM, min=1, max=max(max_batch, 2))}
    for name, rng in spec.dims.items():
        dims[name] = torch.export.Dim(name, min=rng.min, max=rng.max)
    dynamic_shapes = tuple({axis: dims[d] for axis, d in enumerate(i.dims) if isinstance(d, str)}
                           for i in spec.inputs)
    target = loaded.exported_program if loaded.exported_program is not None else loaded.module
    kwargs: dict[str, Any] = {}
    if loaded.exported_program is None:
        kwargs["dynamic_shapes"] = _matching_parameters(loaded.module, dynamic_shapes)
    with _without_shadowing_folders(), _quiet():
        # no file: the ONNXProgram's model becomes a proto in memory (weights inline, whatever their size: a proto
        # over 2 GiB is only refused when serialized, and trtc saves and runs such protos through files); writing
        # the weights as external data and reading them back cost seconds on a ViT-B/16 for the same proto
        program = torch.onnx.export(target, args, None, dynamo=True, input_names=spec.input_names,
                                    output_names=output_names, opset_version=opset, verbose=False, optimize=True,
                                    **kwargs)
        assert program is not None  # None only for the TorchScript exporter
        model = program.model_proto
    del program  # its graph holds the module's weights; the proto has its own copy
    return _rename_dims(model, spec)


def _matching_parameters(module: Any, shapes: tuple[Any, ...]) -> tuple[Any, ...]:
    """Dynamic shapes laid out as ``forward``'s parameters: torch.export wants a ``*args`` part as one tuple."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return shapes
    if not any(p.kind is p.VAR_POSITIONAL for p in params):
        return shapes
    named = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    return (*shapes[:named], tuple(shapes[named:]))


def _torchscript_export(module: Any, args: tuple[Any, ...], spec: ModelSpec, max_batch: int, opset: int | None,
                        output_names: list[str] | None, path: Path) -> onnx.ModelProto:
    import torch

    names = output_names or ["output"]
    dynamic_axes: dict[str, dict[int, str]] = {
        i.name: {axis: d for axis, d in enumerate(i.dims) if isinstance(d, str)} for i in spec.inputs}
    with _quiet():
        torch.onnx.export(module, args, str(path), dynamo=False, input_names=spec.input_names, output_names=names,
                          dynamic_axes=dynamic_axes, opset_version=opset or 17, do_constant_folding=True)
    model = load_onnx(path)
    # The TorchScript exporter names output dims itself; give the batch its name when it is dim 0.
    for out in model.graph.output:
        shape = out.type.tensor_type.shape
        if shape.dim and not shape.dim[0].dim_value:
            shape.dim[0].dim_param = BATCH_DIM
    return model


def _rename_dims(model: onnx.ModelProto, spec: ModelSpec) -> onnx.ModelProto:
    """Make sure graph inputs carry the spec's dim names (an ExportedProgram names them s0, s1...)."""
    renames: dict[str, str] = {}
    by_name = {i.name: i for i in spec.inputs}
    for inp in model.graph.input:
        if inp.name not in by_name:
            continue
        for dim, want in zip(inp.type.tensor_type.shape.dim, by_name[inp.name].dims):
            if isinstance(want, str) and dim.dim_param and dim.dim_param != want:
                renames[dim.dim_param] = want
    if renames:
        for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
            for dim in vi.type.tensor_type.shape.dim:
                if dim.dim_param in renames:
                    dim.dim_param = renames[dim.dim_param]
    return model


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


@contextlib.contextmanager
def _quiet() -> Any:
    """The exporters print progress to stdout; keep the CLI's output ours."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


# packages torch's compiler imports when they are found, which a folder of the same name on the import path (the
# working directory's triton/ that `trtc export-triton --repo triton` writes) hides
SHADOWABLE = ("triton",)


def shadowing_entries(names: tuple[str, ...] = SHADOWABLE) -> dict[str, Path]:
    """Import path entries that hold a plain folder (no ``__init__.py``) named like one of ``names``, by entry: such
    a folder imports as an empty namespace package in place of the real one."""
    import sys

    found: dict[str, Path] = {}
    for entry in sys.path:
        for name in names:
            folder = Path(entry or ".") / name
            if folder.is_dir() and not (folder / "__init__.py").is_file():
                found[entry] = folder
    return found


@contextlib.contextmanager
def _without_shadowing_folders() -> Any:
    """Run the dynamo exporter with an import path that does not let a folder (``triton/``) stand in for the package
    torch looks for: the entries holding one leave ``sys.path`` for the block (one log line), an empty namespace
    package already imported under the name leaves ``sys.modules``; both come back after."""
    import sys

    entries = shadowing_entries()
    modules = {n: sys.modules.pop(n) for n in SHADOWABLE if n in sys.modules
               and getattr(sys.modules[n], "__file__", None) is None}
    if not entries and not modules:
        yield
        return
    for folder in entries.values():
        log.info("%s shadows the %s package; the dynamo exporter runs without %s on the import path", folder,
                 folder.name, folder.parent)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in entries]
    try:
        yield
    finally:
        sys.path[:] = saved
        for name, module in modules.items():
            sys.modules.setdefault(name, module)


_OP = re.compile(r"(aten::[A-Za-z0-9_.]+|[A-Za-z0-9_]+::[A-Za-z0-9_.]+)")
_LOC = re.compile(r'File "([^"]+)", line (\d+)')


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _summarize(err: BaseException) -> str:
    """The first unsupported operator and the first source location named in an exporter error; without an
    operator, the innermost cause's own line (the exporter's wrapper says only which step failed)."""
    text = _ANSI.sub("", str(err))
    innermost = err
    cause = err.__cause__
    while cause is not None:
        text += "\n" + _ANSI.sub("", str(cause))
        if str(cause).strip():
            innermost = cause
        cause = cause.__cause__
    op = _OP.search(text)
    loc = _LOC.search(text)
    what = _ANSI.sub("", _first_line(innermost))
    if innermost is not err:
        what = f"{type(innermost).__name__}: {what}" if not what.startswith(type(innermost).__name__) else what
    parts = [f"unsupported operator {op.group(1)}" if op else what]
    if loc:
        parts.append(f"at {loc.group(1)}:{loc.group(2)}")
    return " ".join(parts)


def _first_line(err: BaseException) -> str:
    """The line that says what went wrong: TorchScript errors end with it, others start with it."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[A-Za-z]*Error: ", line)]
    if named:
        return named[-1][:300]
    return lines[0][:300] if lines else err.__class__.__name__
