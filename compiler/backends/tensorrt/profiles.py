"""The optimization-profile shapes of an engine: min/opt/max of every input, per batch bucket.

The builder and the manifest both take them from ``engine_profile_shapes``, so the shapes a manifest records are
the ones the engine was built for. Pure Python: nothing here needs TensorRT.
"""

from __future__ import annotations

from collections.abc import Sequence

from compiler.core.errors import InputError
from compiler.core.specs import BATCH_DIM, ModelSpec

__all__ = ["Shape", "Shapes", "profile_shapes", "multi_profile_shapes", "engine_profile_shapes"]

Shape = tuple[int, ...]
Shapes = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)


def profile_shapes(spec: ModelSpec, bucket: int, batch_min: int | None = None) -> Shapes:
    """Min/opt/max shape of every input for the engine of one batch bucket.

    The batch ``B`` is fixed at the bucket (min = opt = max) unless ``batch_min`` lowers its min;
    every other dynamic dimension spans its declared range (``--dim S=1:128:512``). Inputs without
    dynamic dimensions get their one shape thrice.
    """
    if bucket < 1:
        raise InputError(f"bucket {bucket} is not a positive integer: write --buckets like 1,4,8,16")
    low = {name: r.min for name, r in spec.dims.items()}
    opt = {name: r.opt for name, r in spec.dims.items()}
    high = {name: r.max for name, r in spec.dims.items()}
    for values in (opt, high):
        values[BATCH_DIM] = bucket
    low[BATCH_DIM] = bucket if batch_min is None else batch_min
    return {i.name: (i.shape(low), i.shape(opt), i.shape(high)) for i in spec.inputs}


def multi_profile_shapes(spec: ModelSpec, buckets: Sequence[int]) -> list[Shapes]:
    """The profiles of a multi-profile engine, in bucket order: profile k takes batches from bucket k-1 + 1 up
    to bucket k (opt = bucket k), so together they cover every batch from 1 to the largest bucket and a
    server that does not pad (Triton's dynamic batcher) can pick a profile for any batch."""
    ordered = sorted(buckets)
    return [profile_shapes(spec, b, batch_min=(ordered[k - 1] + 1) if k else 1) for k, b in enumerate(ordered)]


def engine_profile_shapes(spec: ModelSpec, buckets: Sequence[int], multi_profile: bool) -> list[Shapes]:
    """The profiles one engine is built with, one per bucket in bucket order: the builder and the manifest
    both take them from here, so the shapes the manifest records are the ones the engine was built for."""
    if multi_profile:
        return multi_profile_shapes(spec, buckets)
    return [profile_shapes(spec, b) for b in sorted(buckets)]
