"""The shared memory of a process batcher: where every array lies, and what the slots hold.

A ``ProcessBatcher`` (``server``) and its clients (``client``) share one file of memory. ``regions`` lists its
fields: per slot a request's inputs and its answer's outputs (room for ``slot_rows`` rows at the model's largest
sizes), the request's rows, dynamic sizes, numbers and times, the status of its answer (``STATUS_*``) and room for
an error message; on a GPU, results areas the GPU copies whole batches' outputs into. ``Layout`` places them;
``SlotModel`` is the model as the slots hold it, with the feed checker its clients hold requests to. Both are
plain data, so they pickle with a ``ClientHandle``. Numpy, the standard library and ``compiler.backends.feeds``
only: a client process imports this.
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.backends.feeds import NUMPY_DTYPES, FeedChecker
from compiler.core.errors import InputError
from compiler.core.specs import BATCH_DIM, ModelSpec

STATUS_OK, STATUS_FAILED, STATUS_EXPIRED, STATUS_CLOSED = 1, 2, 3, 4  # a slot's status after its answer
ERROR_BYTES = 480  # room for the message of a failed request
_ALIGN = 64
PAGE = mmap.PAGESIZE  # the results areas start on a page: the GPU copies into them (cudaHostRegister)
GRACE = 1.0  # seconds a caller waits past its timeout for a batch that started just before it
OVERLOADED = "the server is overloaded; raise the timeout, or add contexts (in_flight) or GPUs"


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Layout:
    """Where every array of the shared-memory file lies: plain numbers, so it pickles with a handle."""

    fields: tuple[Field, ...]
    size: int

    @staticmethod
    def of(arrays: Sequence[tuple[str, str, tuple[int, ...]] | tuple[str, str, tuple[int, ...], int]]) -> Layout:
        """Fields one after the other, each at a multiple of ``_ALIGN`` bytes (or of its own alignment, a fourth
        element: a page for memory the GPU writes into)."""
        fields = []
        offset = 0
        for name, dtype, shape, *align in arrays:
            step = align[0] if align else _ALIGN
            offset = -(-offset // step) * step
            fields.append(Field(name, dtype, shape, offset))
            offset += -(-fields[-1].nbytes // _ALIGN) * _ALIGN
        return Layout(tuple(fields), max(offset, _ALIGN))

    def views(self, buffer: Any) -> dict[str, np.ndarray]:
        return {f.name: np.frombuffer(buffer, dtype=f.dtype, count=math.prod(f.shape), offset=f.offset)
                .reshape(f.shape) for f in self.fields}


@dataclass(frozen=True)
class SlotIo:
    """One input or output as the slots hold it: dims as the spec writes them (names for dynamic sizes)."""

    name: str
    dtype: str
    dims: tuple[int | str, ...]  # without the batch dimension
    largest: tuple[int, ...]  # the slot's room: the dims at their largest


@dataclass(frozen=True)
class SlotModel:
    inputs: tuple[SlotIo, ...]
    outputs: tuple[SlotIo, ...]
    dim_names: tuple[str, ...]  # the dynamic non-batch dims, in the order a slot stores their values
    checker: FeedChecker  # the inputs' contracts: a client checks every request with it, as ``Engines`` does
    slot_rows: int


def regions(model: SlotModel, slots: int, results: int, max_batch: int) -> list[Any]:
    """The shared memory's fields: per slot its request and answer; ``results`` areas of ``max_batch`` rows of every
    output, where the GPU copies a batch's outputs and the clients read them (``where``: area, first row and the
    area's generation per answered slot; ``taken``: the answer number a client has read)."""
    fields: list[Any] = [(f"in:{io.name}", io.dtype, (slots, model.slot_rows, *io.largest)) for io in model.inputs]
    fields += [(f"out:{io.name}", io.dtype, (slots, model.slot_rows, *io.largest)) for io in model.outputs]
    ranks = max([len(io.largest) for io in model.outputs] + [1])
    fields += [("rows", "int64", (slots,)), ("dims", "int64", (slots, max(1, len(model.dim_names)))),
                ("asked", "int64", (slots,)), ("answered", "int64", (slots,)), ("status", "int64", (slots,)),
                ("out_shapes", "int64", (slots, len(model.outputs), ranks)),
                ("submitted", "float64", (slots,)), ("deadline", "float64", (slots,)),
                ("error", "uint8", (slots, ERROR_BYTES)), ("closed", "int64", (1,)),
                ("where", "int64", (slots, 3)), ("taken", "int64", (slots,)),
                ("generation", "int64", (max(1, results),))]
    if results:
        fields += [(f"res:{io.name}", io.dtype, (results, max_batch * math.prod(io.largest)), PAGE)
                    for io in model.outputs]
    return fields


def slot_index(slot: int | slice, rows: int, shape: Sequence[int]) -> tuple[Any, ...]:
    """The index of one request's rows at ``shape`` (its non-batch sizes) in a slot area (``in:``/``out:`` fields)."""
    return (slot, slice(0, rows), *(slice(0, n) for n in shape))


def slot_model(engines: Any, slot_rows: int) -> SlotModel:
    """The slots' layout from the engines' spec, the outputs' sizes from one run at the largest input sizes."""
    spec: ModelSpec = engines.spec
    inputs = []
    largest_values = {name: r.max for name, r in spec.dims.items()}
    for i in spec.inputs:
        if not i.dims or i.dims[0] != BATCH_DIM:
            raise InputError(f"input {i} has no batch dimension first; the process batcher serves models whose "
                             "inputs are all batched (use DynamicBatcher in one process for this one)")
        if NUMPY_DTYPES.get(i.dtype) is None:
            raise InputError(f"input {i} is {i.dtype}, which numpy cannot hold in shared memory; export the model "
                             "with float32 or float16 inputs")
        dims = tuple(i.dims[1:])
        largest = tuple(d if isinstance(d, int) else largest_values[d] for d in dims)
        inputs.append(SlotIo(i.name, i.dtype, dims, largest))
    probe = engines(spec.example_feed(1, values={**spec.opt_values(1), **largest_values}))
    if not isinstance(probe, dict):
        probe = {engines.output_names[0]: probe}
    outputs = tuple(SlotIo(name, str(np.asarray(probe[name]).dtype), tuple(np.asarray(probe[name]).shape[1:]),
                           tuple(np.asarray(probe[name]).shape[1:])) for name in engines.output_names)
    return SlotModel(tuple(inputs), outputs, tuple(spec.dims), FeedChecker(spec), slot_rows)


def shared_memory(size: int, directory: str | None) -> tuple[Any, mmap.mmap]:
    """``size`` bytes of shared memory: a file in ``/dev/shm`` removed at once (its descriptor, as a multiprocessing
    Connection, travels to the clients, so nothing is left behind even after a crash), its pages reserved now:
    writing into a tmpfs beyond its limit is a SIGBUS, not an error."""
    from multiprocessing.connection import Connection

    directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    fd, path = tempfile.mkstemp(prefix=f"trtc-batcher-{os.getpid()}-", dir=directory)
    os.unlink(path)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            free = os.statvfs(directory)
            raise InputError(f"{directory} has {free.f_bavail * free.f_frsize / 2**20:.0f} MiB free and the batcher's "
                             f"slots need {size / 2**20:.0f} MiB ({err.strerror}): lower capacity or slot_rows, or "
                             "give the container more shared memory (docker run --shm-size)") from None
        return Connection(fd), mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
