"""A dynamic batcher for requests from other processes, through shared memory: ``ProcessBatcher``.

One Python process answers 11-14 k requests a second from 64 threads and 35-60 k from asyncio
coroutines on an H200 host (its GIL; docs/benchmarks.md), while one GPU runs a small transformer at
60-101 k rows a second. A server with several worker processes (one per core, as web servers run)
sends their requests to the one process that owns the GPU:

    # the process that owns the GPU
    batcher = ProcessBatcher(compiler.load("build/m"), max_wait_ms=5)
    handles = [batcher.client_handle(slots=8) for _ in range(16)]
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=serve, args=(handle,)) for handle in handles]

    # in each worker process (it imports numpy and this module, never torch or ONNX Runtime)
    def serve(handle):
        client = handle.connect()
        y = client.submit(x, timeout=0.5)       # from up to `slots` threads at once

How a request travels: every request has a slot in one shared-memory file (room for ``slot_rows``
rows of every input at the model's largest sizes, for the outputs, and a few numbers). The client
checks its arrays, copies them into its slot and writes the slot's number (4 bytes) into a pipe.
The batcher reads many numbers per read, copies the slots' rows into the pinned input buffers of a
context (``Engines.start_parts``; a small batch of single rows is first gathered with one numpy call
per input, a large one is copied straight from the slots), runs the bucket, and wakes each client process with
one write of its slots' numbers into the process's own pipe (a thread there wakes the callers). On
a GPU the batch's outputs are copied by the GPU into a page-locked results area of the shared
memory, and each client copies its rows from there (an area serves the next batches once all its
answers are read, or their time is over); on the CPU the batcher writes all answers of the batch
into their slots with one numpy assignment per output. So the batcher spends a few microseconds of
Python per request, and the clients' own work runs in their processes under their own GILs. (A
semaphore per slot cost the batcher a wake-up system call per request: 5-20 microseconds of its GIL
each, the largest part of its time.)

Why not ``multiprocessing.Queue``: it pickles every array and wakes a feeder thread per message,
tens of microseconds per request on the GPU process's one GIL.

Handles are passed to processes started by ``multiprocessing`` (``spawn`` or ``fork``) after the
batcher exists, one handle per process. The shared memory is a file in ``/dev/shm`` removed as soon
as it is made (the handles carry its descriptor), so nothing is left behind, even after a crash.
When the batcher closes or its process ends, spawned clients' waiting callers fail at once with
``BatcherClosed`` (forked clients hold the pipes' other ends too, so they only see their timeouts).
Inputs must all have the batch dimension first and a numpy dtype (no bfloat16); models whose output
sizes depend on the data can outgrow their slots (such a batch fails with a message).

The files: ``layout`` (the shared memory: its fields, the slots' model, the file), ``client`` (``ClientHandle``,
``BatcherClient``), ``server`` (``ProcessBatcher``), ``page_lock`` (``cudaHostRegister`` of the results areas). The
errors a caller waits into are ``compiler.serve.waits``' ``RequestTimeout`` and ``BatcherClosed``, as for
``DynamicBatcher``, and ``RequestFailed`` (its batch failed).
"""

from compiler.serve.processes.client import BatcherClient, ClientHandle, RequestFailed
from compiler.serve.processes.server import ProcessBatcher

__all__ = ["BatcherClient", "ClientHandle", "ProcessBatcher", "RequestFailed"]
