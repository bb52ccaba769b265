"""Example inputs from the user's file (``--example-data FILE.npz``) for the export and pass checks.

The file is what ``--calib-data`` takes: an ``.npz`` of arrays keyed by input name, or an ``.npy`` array for a
model with one input. An input whose spec starts with the batch ``B`` takes a batch of samples (the input's rank)
or one sample (one dimension less), and the feed at batch b is its first b samples, repeated when there are fewer;
any other input takes its value whole, fed as it is at every batch. The arrays are checked against the spec
once, here: names, dtypes, fixed sizes and dynamic ranges. Values are not: NaN or Inf are real inputs too.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from compiler.core.errors import InputError
from compiler.core.specs import BATCH_DIM, ModelSpec
from compiler.frontend.verify import FeedSource

__all__ = ["example_feeds"]


def example_feeds(path: Path, spec: ModelSpec) -> tuple[FeedSource, str]:
    """A feed at each batch size from ``path`` for the inputs of ``spec``, and its description for the manifest.

    InputError naming the file, the input and the fix: no such file, not a numpy file, an input without an array,
    another dtype, rank, fixed size, a dynamic size outside its ``--dim`` range, or batched inputs with different
    numbers of samples. Arrays for names the model does not have are ignored.
    """
    arrays = _read(path, spec)
    missing = [n for n in spec.input_names if n not in arrays]
    if missing:
        raise InputError(f"{path}: no array for input {missing[0]!r} (it has {', '.join(map(repr, arrays)) or 'none'});"
                         " --example-data takes one array per input name, as --calib-data")
    batched: dict[str, np.ndarray] = {}
    whole: dict[str, np.ndarray] = {}
    for inp in spec.inputs:
        value = arrays[inp.name]
        if value.dtype.name != inp.dtype:
            raise InputError(f"{path}: input {inp.name!r} is {value.dtype}, the model takes {inp.dtype}; save it "
                             f"with .astype('{inp.dtype}')")
        has_batch = bool(inp.dims) and inp.dims[0] == BATCH_DIM
        if has_batch and value.ndim == len(inp.dims) - 1:
            value = value[None]
        if value.ndim != len(inp.dims):
            want = f"{len(inp.dims)} (a batch) or {len(inp.dims) - 1} (one sample)" if has_batch else str(len(inp.dims))
            raise InputError(f"{path}: input {inp.name!r} has shape {value.shape}, rank {value.ndim}; the spec "
                             f"{inp} takes rank {want}")
        for axis, (size, dim) in enumerate(zip(value.shape, inp.dims)):
            if isinstance(dim, int) and size != dim:
                raise InputError(f"{path}: input {inp.name!r} has shape {value.shape}; dimension {axis} must be {dim}"
                                 f" ({inp})")
            if dim == BATCH_DIM and size < 1:
                raise InputError(f"{path}: input {inp.name!r} holds no sample; give at least one")
            if isinstance(dim, str) and dim in spec.dims and not spec.dims[dim].min <= size <= spec.dims[dim].max:
                raise InputError(f"{path}: input {inp.name!r} has {dim}={size}, outside its range {spec.dims[dim]}; "
                                 f"fix --dim {dim} or the data")
        (batched if has_batch else whole)[inp.name] = value
    counts = {len(v) for v in batched.values()}
    if len(counts) > 1:
        sizes = ", ".join(f"{n}: {len(v)}" for n, v in batched.items())
        raise InputError(f"{path}: the batched inputs hold different numbers of samples ({sizes}); give each the same")
    samples = counts.pop() if counts else 1

    def feed_at(batch: int) -> dict[str, np.ndarray]:
        rows = np.arange(batch) % samples
        feed = {n: np.ascontiguousarray(v[rows]) for n, v in batched.items()}
        feed.update(whole)
        return {i.name: feed[i.name] for i in spec.inputs}

    what = f"{samples} sample(s) of {path}" if batched else str(path)
    return feed_at, f"--example-data {what}"


def _read(path: Path, spec: ModelSpec) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise InputError(f"{path}: no such file; --example-data takes an .npz file (one array per input name)")
    try:
        if path.suffix == ".npy":
            if len(spec.inputs) != 1:
                raise InputError(f"{path}: an .npy file holds one array, but the model has inputs {spec.input_names}; "
                                 "use an .npz file keyed by input name")
            return {spec.input_names[0]: np.load(path, allow_pickle=False)}
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            raise InputError(f"{path}: holds one array, not arrays by input name; save it with np.savez")
        with loaded as npz:
            return {k: npz[k] for k in npz.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise InputError(f"{path}: not a readable .npz file ({err}); save it with np.savez(path, name=array, ...)"
                         ) from err
