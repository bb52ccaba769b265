"""What a feed must be for a model: one check per input, shared by ``Engines`` (``compiler.serve.engines``) and
the process batcher's clients (``compiler.serve.processes``), which import numpy and this only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.backends.contexts import _NUMPY_DTYPES
from compiler.core.errors import FeedError, InputError
from compiler.core.specs import BATCH_DIM, DimRange, ModelSpec


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
        np_dtype = _NUMPY_DTYPES[i.dtype]
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
