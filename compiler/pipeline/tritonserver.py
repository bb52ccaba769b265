"""Running Triton Inference Server: finding ``tritonserver``, starting it, waiting until it is ready, stopping it.

Used by ``trtc serve`` and by the tests' real server. ``find_tritonserver`` takes ``tritonserver`` from PATH
(a Triton container: its own backends directory) or else from the ``nvidia-pytriton`` wheel (the extra
``trtc[serve]``), which ships the server, its Python backend and a backend stub per Python version. The
wheel's stub runs the machine's ``libpython3.X`` (this interpreter's, where it was built shared); that
interpreter does not see this environment's packages, so trtc's Triton model finds them through the path
its repository entry records (``compiler.pipeline.triton``), never through ``PYTHONPATH``, which the
server is started without.

``TritonServer`` binds its HTTP, gRPC and metrics endpoints to one address (loopback by default), writes
the server's output to a log file, polls ``/v2/health/ready`` until it answers 200 or a time bound passes,
and on ``stop`` sends SIGTERM to the server's process group, then SIGKILL after a bound: no server is
left running, also when the caller fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from compiler.core.errors import TrtcError

__all__ = ["TritonNotFound", "TritonFailed", "TritonInstall", "TritonServer", "find_tritonserver", "free_port",
           "SERVE_EXTRA"]

log = logging.getLogger(__name__)

SERVE_EXTRA = "trtc[serve]"
READY_SECONDS = 120.0  # a model that loads ONNX Runtime or TensorRT engines in each instance takes a while
# Triton's --exit-timeout-secs: on SIGTERM it waits this long for requests in flight and open client connections
# (a client's kept-alive connection holds it the whole time); stop() kills it 5 s later
EXIT_SECONDS = 10


class TritonNotFound(TrtcError):
    """No ``tritonserver`` on PATH and no ``nvidia-pytriton`` wheel to take it from."""


class TritonFailed(TrtcError):
    """The server exited, or did not become ready in time; the message ends with the tail of its log."""


@dataclass(frozen=True)
class TritonInstall:
    """Where a ``tritonserver`` is and what it needs to start."""

    binary: Path
    source: str  # "PATH" or "nvidia-pytriton"
    backend_files: dict[str, Path] = field(default_factory=dict)  # python/NAME -> file, for a backends folder
    library_paths: tuple[Path, ...] = ()  # prepended to LD_LIBRARY_PATH



def find_tritonserver() -> TritonInstall:
    """``tritonserver`` from PATH, else from the ``nvidia-pytriton`` wheel; ``TritonNotFound`` naming the extra."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), "PATH")
    spec = importlib.util.find_spec("pytriton")  # found, not imported: pytriton's own import is slow and not needed
    locations = list(spec.submodule_search_locations or []) if spec else []
    dist = Path(locations[0]) / "tritonserver" if locations else None
    if dist is None or not (dist / "bin" / "tritonserver").is_file():
        raise TritonNotFound(f"tritonserver was not found: install the extra with `pip install '{SERVE_EXTRA}'` "
                             "(nvidia-pytriton ships the server), or put Triton's tritonserver on PATH")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        shipped = ", ".join(sorted(p.name for p in (dist / "python_backend_stubs").iterdir()))
        raise TritonNotFound(f"nvidia-pytriton has no Python backend stub for Python {version} (it ships {shipped}); "
                             "run trtc with one of those, or put Triton's tritonserver on PATH")
    python = dist / "backends" / "python"
    files = {"python/libtriton_python.so": python / "libtriton_python.so",
             "python/triton_python_backend_utils.py": python / "triton_python_backend_utils.py",
             "python/triton_python_backend_stub": stub}
    libraries = [dist.parent.parent / "nvidia_pytriton.libs"]
    libdir = Path(sysconfig.get_config_var("LIBDIR") or "/nonexistent")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and (libdir / f"libpython{version}.so.1.0").exists():
        libraries.insert(0, libdir)  # the stub then runs this interpreter's libpython, not another 3.X's
    return TritonInstall(dist / "bin" / "tritonserver", "nvidia-pytriton", files, tuple(libraries))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on at ``host`` now (the kernel's pick; another process could take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class TritonServer:
    """One ``tritonserver`` process on ``repository``; ``start`` then ``wait_ready``, or use it as a context manager.

    ``host``: the address all endpoints bind to (127.0.0.1 by default). Ports default to free ones.
    ``explicit``: start with no model loaded (``--model-control-mode=explicit``) so that the caller loads each
    model through the repository API and reads its own error; otherwise every model loads at start and a
    model that fails stops the server (``--exit-on-error``). ``log_path``: where the server's output goes
    (default: a file in the server's temporary folder, removed on ``stop`` unless ``keep_log``); with
    ``stream_output`` the output goes to this process's stdout and stderr instead (``trtc serve``).
    ``extra_args``: more ``tritonserver`` options. Nothing here sends traffic beyond ``host``.
    """

    def __init__(self, repository: str | Path, *, host: str = "127.0.0.1", http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None, explicit: bool = False,
                 install: TritonInstall | None = None, log_path: Path | None = None, keep_log: bool = False,
                 stream_output: bool = False, extra_args: tuple[str, ...] = ()) -> None:
        self.repository = Path(repository)
        self.host = host
        self.http_port = http_port or free_port(host)
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.explicit = explicit
        self.install = install or find_tritonserver()
        self.extra_args = extra_args
        self._work = Path(tempfile.mkdtemp(prefix="trtc-tritonserver-"))
        self.log_path = log_path or self._work / "tritonserver.log"
        self._keep_log = keep_log or log_path is not None
        self.stream_output = stream_output
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        args = [str(self.install.binary), f"--model-repository={self.repository}",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                f"--exit-timeout-secs={EXIT_SECONDS}"]
        if self.install.backend_files:
            args.append(f"--backend-directory={self._backends()}")
        if self.explicit:
            args += ["--model-control-mode=explicit", "--exit-on-error=false"]
        return [*args, *self.extra_args]

    def _backends(self) -> Path:
        """A backends folder of links to the wheel's files, with the stub of this Python as the backend's stub."""
        folder = self._work / "backends"
        for name, target in self.install.backend_files.items():
            link = folder / name
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(target)
        return folder

    def environment(self) -> dict[str, str]:
        """The server's environment: this one without PYTHONPATH/PYTHONHOME (the model's path comes from its entry),
        the wheel's libraries first on LD_LIBRARY_PATH."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        paths = [str(p) for p in self.install.library_paths]
        if env.get("LD_LIBRARY_PATH"):
            paths.append(env["LD_LIBRARY_PATH"])
        if paths:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
        return env

    def start(self) -> TritonServer:
        """Start the server in a process group of its own; its output goes to ``log_path``."""
        if self._process is not None:
            raise RuntimeError("this TritonServer was started already")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(os.devnull if self.stream_output else self.log_path, "wb") as out:
            target = None if self.stream_output else out
            self._process = subprocess.Popen(self.command(), stdout=target,
                                             stderr=None if self.stream_output else subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.environment(),
                                             start_new_session=True)
        log.info("started tritonserver (pid %d) on %s: HTTP %d, gRPC %d, metrics %d", self._process.pid, self.host,
                 self.http_port, self.grpc_port, self.metrics_port)
        return self

    @property
    def pid(self) -> int:
        assert self._process is not None, "start the server first"
        return self._process.pid

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log ("" when its output is streamed)."""
        if self.stream_output:
            return "(its output is above)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = READY_SECONDS) -> None:
        """Poll ``/v2/health/ready`` every 0.1 s until it answers 200; ``TritonFailed`` when the server exits first
        or ``timeout`` seconds pass (the server is then stopped)."""
        end = time.monotonic() + timeout
        while True:
            if not self.running():
                code = self._process.returncode if self._process else None
                raise TritonFailed(f"tritonserver exited with code {code} before it was ready; its log ends:\n"
                                   f"{self.log_tail()}")
            if self._ready():
                return
            if time.monotonic() > end:
                tail = self.log_tail()
                self.stop()
                raise TritonFailed(f"tritonserver was not ready after {timeout:g} s (stopped); its log ends:\n{tail}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as answer:
                return int(answer.status) == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait(self) -> int:
        """Wait until the server exits by itself; its exit code."""
        assert self._process is not None, "start the server first"
        return self._process.wait()

    def stop(self, timeout: float = EXIT_SECONDS + 5.0) -> int | None:
        """SIGTERM to the server's process group (it waits for requests in flight, then exits), SIGKILL after
        ``timeout`` seconds; the exit code (None if it was never started). Safe to call twice."""
        process = self._process
        code = None
        if process is not None:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("tritonserver did not stop within %g s of SIGTERM: killing it", timeout)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            code = process.returncode
            with contextlib.suppress(ProcessLookupError):  # stubs of the Python backend that outlived the server
                os.killpg(process.pid, signal.SIGKILL)
        if not self._keep_log:
            shutil.rmtree(self._work, ignore_errors=True)
        else:
            shutil.rmtree(self._work / "backends", ignore_errors=True)
        return code

    def __enter__(self) -> TritonServer:
        if self._process is None:
            self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
