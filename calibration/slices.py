"""Running a model on a batch in slices of samples whose outputs stay within a memory budget: what the accuracy
gate and the layer ranking do with every evaluation batch, so that their memory does not grow with it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from compiler.backends.base import Runner
from compiler.core.worker import mark_step

__all__ = ["sliced_runs", "SampleBytes", "takes_any_batch", "leading_samples", "as_list", "CHUNK_VALUES"]

# float64 temporaries of a comparison stay under 2 MiB each (a GPT-2 sample's logits are 6.4 M values)
CHUNK_VALUES = 1 << 18


def leading_samples(batch: dict[str, np.ndarray]) -> int:
    """The leading dimension all of the batch's inputs share (its sample count), 0 when they share none."""
    sizes = {np.shape(v)[0] if np.ndim(v) else -1 for v in batch.values()}
    return sizes.pop() if len(sizes) == 1 and -1 not in sizes else 0


class SampleBytes:
    """Output bytes per sample, by the shapes of a sample's inputs, as the first slice of a batch measured them:
    a later batch of those shapes runs in slices of the budget from its first sample. One per model and its
    candidates (an FP16 candidate's outputs take no more bytes than FP32's)."""

    def __init__(self) -> None:
        self._known: dict[tuple[Any, ...], int] = {}

    @staticmethod
    def _key(batch: dict[str, np.ndarray]) -> tuple[Any, ...]:
        return tuple(sorted((name, np.shape(v)[1:], np.asarray(v).dtype.str) for name, v in batch.items()))

    def get(self, batch: dict[str, np.ndarray]) -> int | None:
        return self._known.get(self._key(batch))

    def set(self, batch: dict[str, np.ndarray], per_sample: int) -> None:
        self._known[self._key(batch)] = per_sample


def sliced_runs(run: Callable[[dict[str, np.ndarray]], Any], batch: dict[str, np.ndarray], budget_bytes: int,
                step_name: str, sliceable: bool = True, known: SampleBytes | None = None,
                ) -> Iterator[tuple[int, int | None, list[np.ndarray]]]:
    """``run`` on ``batch`` in slices of samples whose outputs stay under ``budget_bytes``: (start, stop, outputs).

    The first slice is one sample, which measures the output bytes per sample, unless ``known`` has them for
    samples of this batch's shapes (the gate's batches after the first then run whole, not as one sample and the
    rest: half the calls, and no second shape for ONNX Runtime). A batch whose inputs share no leading dimension, or
    whose outputs do not follow the inputs' (a model that reduces over the batch), or a model with a fixed batch
    size (``sliceable`` False) runs whole once: (0, None, outputs).
    """
    size = leading_samples(batch) if sliceable else 0
    measured = known.get(batch) if known is not None and size else None
    start, step = 0, 1 if measured is None else max(1, budget_bytes // max(1, measured))
    while start < size:
        stop = min(size, start + step)
        mark_step(step_name + (f", samples {start}-{stop - 1}" if size > 1 else ""))
        part = batch if (start, stop) == (0, size) else {k: v[start:stop] for k, v in batch.items()}
        outs = as_list(run(part))
        if start == 0 and any(np.ndim(o) == 0 or len(o) != stop for o in outs):
            break  # outputs not per sample: run the batch whole
        yield start, stop, outs
        if start == 0 and measured is None:
            per_sample = max(1, sum(o.nbytes for o in outs) // stop)
            step = max(1, budget_bytes // per_sample)
            if known is not None:
                known.set(batch, per_sample)
        del outs
        start = stop
    if size and start >= size:
        return
    mark_step(step_name)
    yield 0, None, as_list(run(batch))


def takes_any_batch(runner: Runner) -> bool:
    """Whether every input of the runner takes any number of samples (a symbolic first axis)."""
    return all(shape and not isinstance(shape[0], int) for _, shape in runner.input_metadata().values())


def as_list(outputs: Any) -> list[np.ndarray]:
    return list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
