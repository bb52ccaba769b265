"""The one check of a feed against a model's input spec, and the checked feed the backends run.

``FeedChecker.check`` holds every input to its contract (names, dtypes, rank, fixed sizes, the batch, the
ranges of dynamic sizes) and returns a ``CheckedFeed``. ``Engines`` checks every call with it, the batchers
every request, and the process batcher's clients every request in their own processes: this module imports
numpy only (torch is used where the caller already imported it), so a client process never imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.core.errors import FeedError, InputError
from compiler.core.specs import BATCH_DIM, DimRange, ModelSpec

__all__ = ["NUMPY_DTYPES", "CheckedFeed", "FeedChecker", "InputCheck", "as_kind", "array_of", "check_shape",
           "checks_for", "mismatch", "dims_text"]

# numpy's dtype for each spec dtype; None where numpy has none (bfloat16: torch tensors only)
NUMPY_DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
                                "int8": np.int8, "uint8": np.uint8, "bool": np.bool_, "bfloat16": None}


@dataclass
class CheckedFeed:
    """A feed checked against the spec (``Engines.check``): what one ``engines(...)`` runs."""

    kind: str  # what the outputs become: "numpy", "torch" (CPU tensors) or "cuda" (CUDA tensors)
    arrays: dict[str, Any]  # numpy arrays, or CUDA tensors when ``on_device``
    rows: int
    dims: dict[str, int]  # sizes of the non-batch dynamic dimensions
    key: tuple[int, ...]  # the same sizes, in spec order: a cache key
    on_device: bool = False
    device: Any = None  # the torch device of a CUDA feed


def as_kind(outputs: dict[str, np.ndarray], call: CheckedFeed) -> dict[str, Any]:
    """Host numpy outputs as the feed's kind: numpy, CPU tensors (shared memory) or CUDA tensors on its device."""
    if call.kind == "numpy":
        return outputs
    import torch

    if call.kind == "torch":
        return {name: torch.from_numpy(a) for name, a in outputs.items()}
    return {name: torch.from_numpy(a).to(call.device) for name, a in outputs.items()}




@dataclass(frozen=True)
class InputCheck:
    """One input's contract, laid out for a fast check: fixed sizes and dynamic dims by axis."""

    name: str
    dims: tuple[int | str, ...]
    dtype: str
    np_dtype: Any  # numpy dtype, None for bfloat16 (torch tensors only)
    batched: bool
    fixed: tuple[tuple[int, int], ...]  # (axis, size)
    dynamic: tuple[tuple[int, str], ...]  # (axis, dimension name), the batch excluded


def checks_for(spec: ModelSpec) -> list[InputCheck]:
    checks = []
    for i in spec.inputs:
        if BATCH_DIM in i.dims[1:]:
            raise InputError(f"input {i}: the runtime batches along the first dimension, and B is not first; "
                             "re-export with the batch first")
        fixed = tuple((axis, d) for axis, d in enumerate(i.dims) if isinstance(d, int))
        dynamic = tuple((axis, d) for axis, d in enumerate(i.dims) if isinstance(d, str) and d != BATCH_DIM)
        np_dtype = NUMPY_DTYPES[i.dtype]
        checks.append(InputCheck(i.name, i.dims, i.dtype, np.dtype(np_dtype) if np_dtype is not None else None,
                                 bool(i.dims) and i.dims[0] == BATCH_DIM, fixed, dynamic))
    if not any(c.batched for c in checks):
        raise InputError(f"no input has the batch dimension B first ({', '.join(map(str, spec.inputs))}); the "
                         "runtime serves batched models: re-export with --input NAME:Bx...")
    return checks


def check_shape(check: InputCheck, shape: tuple[int, ...], rows: int, dims: dict[str, int],
                ranges: Mapping[str, DimRange]) -> int:
    """Hold one input's shape to ``check``: its rank, fixed sizes, the batch ``rows`` of the inputs before it (-1:
    none yet) and the dynamic sizes in ``dims`` (filled in, each within its range). Returns the batch rows."""
    if len(shape) != len(check.dims):
        raise FeedError(f"input {check.name!r} has shape {tuple(shape)}, the model takes "
                        f"{dims_text(check.dims)} (rank {len(check.dims)})")
    for axis, size in check.fixed:
        if shape[axis] != size:
            raise FeedError(f"input {check.name!r} has shape {tuple(shape)}, the model takes "
                            f"{dims_text(check.dims)}: dimension {axis} must be {size}")
    if check.batched:
        if rows < 0:
            rows = shape[0]
        elif shape[0] != rows:
            raise FeedError(f"input {check.name!r} has batch {shape[0]}, another input batch {rows}: every input "
                            "needs the same batch size")
    for axis, dim in check.dynamic:
        size = shape[axis]
        have = dims.get(dim)
        if have is None:
            rng = ranges[dim]
            if not rng.min <= size <= rng.max:
                raise FeedError(f"input {check.name!r}: {dim} = {size} is outside the range {rng.min}..{rng.max} "
                                "the model was built for")
            dims[dim] = size
        elif size != have:
            raise FeedError(f"input {check.name!r} has {dim} = {size}, another input {dim} = {have}")
    return rows


def mismatch(names: list[str], x: Mapping[str, Any]) -> FeedError:
    """The error for a feed whose names are not the model's inputs."""
    missing = [n for n in names if x.get(n) is None]
    unknown = [n for n in x if n not in names]
    return FeedError(f"the feed does not match the model's inputs {names}: missing {missing}, unknown {unknown}")


def dims_text(dims: tuple[int | str, ...]) -> str:
    return "x".join(str(d) for d in dims)


def array_of(value: Any, check: InputCheck) -> tuple[str, Any]:
    """("numpy" | "torch" | "cuda", the array to run): numpy arrays and CPU tensors as numpy, CUDA tensors as is."""
    if isinstance(value, np.ndarray):
        if value.dtype != check.np_dtype:
            how = f"x.astype(np.{check.dtype})" if check.np_dtype is not None else "a torch.bfloat16 tensor"
            raise FeedError(f"input {check.name!r} has dtype {value.dtype}, the model takes {check.dtype}: pass {how}")
        return "numpy", value
    torch = sys.modules.get("torch")
    if torch is not None and type(value) is torch.Tensor:
        # The common case with a single call into torch: after a model run every call into torch starts cold and
        # costs microseconds, so the dtype is checked on the numpy view, and numpy() itself refuses the tensors that
        # need more (grad, a GPU, no numpy dtype such as bfloat16); those and a wrong dtype take the checks below.
        try:
            array = value.numpy()
        except (RuntimeError, TypeError):
            array = None
        if array is not None and array.dtype == check.np_dtype:
            return "torch", array
    if torch is not None and isinstance(value, torch.Tensor):
        want = getattr(torch, check.dtype)
        if value.dtype != want:
            raise FeedError(f"input {check.name!r} has dtype {value.dtype}, the model takes {want}: pass x.to({want})")
        if value.requires_grad:
            value = value.detach()
        if value.is_cuda:
            return "cuda", value
        return "torch", value.numpy()
    raise FeedError(f"input {check.name!r} is a {type(value).__name__}; pass a numpy array or a torch tensor")


class FeedChecker:
    """Checks feeds against one model's spec: ``check(x, single)`` (see the module docstring)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.input_names = spec.input_names
        self.checks = checks_for(spec)
        self._dim_names = tuple(spec.dims)

    def check(self, x: Any, single: bool) -> CheckedFeed:
        """``x`` (one array when ``single``, else a mapping by input name) checked: raises ``FeedError`` naming the
        input and what is wrong. CUDA tensors stay where they are (``kind`` "cuda"): the caller places them."""
        if single:
            if len(self.input_names) != 1:
                raise FeedError(f"the model takes inputs {self.input_names}: pass a dict {{name: array}}")
            x = {self.input_names[0]: x}
        kind = ""
        rows = -1
        dims: dict[str, int] = {}
        arrays: dict[str, Any] = {}
        for check in self.checks:
            value = x.get(check.name)
            if value is None:
                raise mismatch(self.input_names, x)
            if type(value) is np.ndarray:
                if value.dtype != check.np_dtype:
                    array_of(value, check)  # raises with the message
                this, array = "numpy", value
            else:
                this, array = array_of(value, check)
            if this != kind:
                if kind:
                    raise FeedError(f"input {check.name!r} is a {this} array and another input a {kind} array: pass "
                                    "all inputs as numpy arrays, or all as torch tensors on one device")
                kind = this
            rows = check_shape(check, array.shape, rows, dims, self.spec.dims)
            arrays[check.name] = array
        if len(x) != len(self.input_names):
            raise mismatch(self.input_names, x)
        if rows == 0:
            raise FeedError("the batch is empty (0 rows): pass at least one row")
        return CheckedFeed(kind, arrays, rows, dims, tuple(dims[d] for d in self._dim_names) if dims else ())

