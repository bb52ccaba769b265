"""``trtc serve DIR``: a build directory on Triton Inference Server, in the foreground, until Ctrl-C.

The directory is exported as a ``trtc`` entry (``compiler.pipeline.triton``: Triton's dynamic batcher in
front of trtc's runtime) into a temporary model repository, and ``tritonserver`` (``compiler.pipeline
.tritonserver``: from PATH or the ``trtc[serve]`` extra) runs on it with its output on the terminal. Once it
is ready the caller is handed the endpoints and a ``curl`` request that runs the model on zeros. Ctrl-C
(or SIGTERM) stops the server: it finishes the requests in flight, then the repository is removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiler.core import defaults

__all__ = ["ServeEndpoints", "serve_directory", "curl_example"]

log = logging.getLogger(__name__)

# numpy dtype names -> the datatype names of Triton's HTTP/gRPC protocol (KServe v2)
PROTOCOL_TYPES = {"float32": "FP32", "float16": "FP16", "float64": "FP64", "int64": "INT64", "int32": "INT32",
                  "int16": "INT16", "int8": "INT8", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
                  "uint64": "UINT64", "bool": "BOOL"}


@dataclass(frozen=True)
class ServeEndpoints:
    """Where a running ``trtc serve`` answers."""

    model: str
    http: str  # http://HOST:PORT
    grpc: str  # HOST:PORT
    metrics: str  # http://HOST:PORT/metrics
    curl: str  # a shell command that sends one request of zeros
    pid: int  # the tritonserver process (the leader of its own process group)


def curl_example(directory: Path, model: str, http_url: str) -> str:
    """A shell line that sends one request of batch 1, all zeros, to ``model``: Python writes the JSON body (any
    size), curl sends it. Dynamic dimensions take their optimum value."""
    from compiler.core.manifest import read_manifest

    spec = read_manifest(directory).spec
    feed = spec.example_feed(1, values=spec.opt_values(1))
    parts = [f'{{"name": {json.dumps(name)}, "shape": {list(array.shape)}, '
             f'"datatype": "{PROTOCOL_TYPES.get(array.dtype.name, "FP32")}", '
             f'"data": [{"False" if array.dtype == bool else "0"}] * {array.size}}}' for name, array in feed.items()]
    script = f'import json; print(json.dumps({{"inputs": [{", ".join(parts)}]}}))'
    return (f"python3 -c {shlex.quote(script)} | curl -s -X POST {http_url}/v2/models/{model}/infer "
            "-H 'Content-Type: application/json' -d @-")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt here, so that a service manager's stop stops the server as Ctrl-C does."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve_directory(directory: str | Path, *, on_ready: Callable[[ServeEndpoints], None],
                    host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                    instances: int = 1, max_wait_ms: float = defaults.MAX_WAIT_MS, name: str | None = None,
                    preferred_batch_sizes: tuple[int, ...] | None = None, ready_timeout: float = 300.0) -> int:
    """Serve ``directory`` on Triton until Ctrl-C or SIGTERM (then 0), or until the server exits by itself
    (``TritonFailed``). ``on_ready`` gets the endpoints once ``/v2/health/ready`` answers. The other
    arguments as for ``triton_repository`` and ``TritonServer``. A missing
    ``tritonserver`` is ``TritonNotFound`` before anything is written."""
    from compiler.pipeline.triton import triton_repository
    from compiler.pipeline.tritonserver import TritonFailed, TritonServer, find_tritonserver

    directory = Path(directory)
    install = find_tritonserver()
    with tempfile.TemporaryDirectory(prefix="trtc-serve-") as repo:
        folder = triton_repository(directory, Path(repo), name=name, platform="trtc", instances=instances,
                                   max_wait_ms=max_wait_ms, preferred_batch_sizes=preferred_batch_sizes)
        server = TritonServer(repo, host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                              install=install, stream_output=True)
        with _sigterm_as_interrupt():
            try:
                server.start()
                server.wait_ready(ready_timeout)
                on_ready(ServeEndpoints(folder.name, server.http_url, server.grpc_url, server.metrics_url,
                                        curl_example(directory, folder.name, server.http_url), server.pid))
                code = server.wait()
                raise TritonFailed(f"tritonserver exited by itself with code {code} (its output is above)")
            except KeyboardInterrupt:
                log.info("stopping Triton: it finishes the requests in flight first")
                return 0
            finally:
                server.stop()
