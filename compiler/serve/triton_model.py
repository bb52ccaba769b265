"""trtc's model for Triton's Python backend: a build directory served through ``compiler.load`` inside Triton.

``trtc export-triton --platform trtc`` writes a repository entry whose ``1/model.py`` (``MODEL_PY``) puts
the Python path recorded in the entry's ``config.pbtxt`` first on ``sys.path`` and hands Triton's calls to
``TrtcTritonModel``. So Triton's dynamic batcher forms the batches (any size up to the largest bucket) and
trtc's runtime routes each to its bucket, pads it, and runs it on TensorRT engines where TensorRT imports
(CUDA graphs on a GPU), else on ONNX Runtime: per-bucket engines, which Triton's own TensorRT backend cannot
serve because it does not pad.

At load, ``verify_build`` checks every file of the entry's copy of the build directory against its
manifest's sha256 (a changed file fails the load with a message naming it) and, where the engines are to
run, whether they can run here: a stale engine fails the load with the lines ``trtc check`` prints.

Tensors cross between Triton and numpy through DLPack (torch's), not the stub's ``as_numpy``: the stub of
Triton's Python backend in the ``nvidia-pytriton`` wheels is built against numpy 1's ABI and misreads
arrays under numpy 2 (it returned the first element repeated, measured with 0.7.0 and numpy 2.4).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from compiler.core.errors import InputError, TrtcError

if TYPE_CHECKING:
    from compiler.core.manifest import Manifest

__all__ = ["TrtcTritonModel", "verify_build", "verify_files", "MODEL_PY", "PYTHON_PATH", "SERVING_BACKEND",
           "BUILD_FOLDER"]

log = logging.getLogger(__name__)

# config.pbtxt parameters of a trtc entry
PYTHON_PATH = "trtc_python_path"  # os.pathsep-separated folders put first on the stub's sys.path
SERVING_BACKEND = "trtc_backend"  # compiler.load's backend: auto, tensorrt or onnxruntime
BUILD_FOLDER = "build"  # the build directory's copy, beside model.py in the version folder

MODEL_PY = '''"""Triton Python-backend model of a trtc build (written by `trtc export-triton --platform trtc`).

The build directory is ./build; the code that serves it is trtc's compiler.serve.triton_model, found through
the folders that config.pbtxt's trtc_python_path parameter lists (edit it where trtc lives elsewhere).
"""

import json
import os
import sys


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        folders = parameters.get("trtc_python_path", {}).get("string_value", "").split(os.pathsep)
        for folder in reversed([f for f in folders if f and os.path.isdir(f)]):
            if folder in sys.path:
                sys.path.remove(folder)
            sys.path.insert(0, folder)
        import triton_python_backend_utils as pb_utils
        from compiler.serve.triton_model import TrtcTritonModel

        self.model = TrtcTritonModel(args, pb_utils)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
'''


def verify_files(directory: Path, manifest: Manifest) -> None:
    """Every ONNX file, engine and source snapshot of ``directory`` against its manifest's sha256 (layer files,
    which the manifest records without a digest, must exist); an ``InputError`` names the first that does not."""
    from compiler.core.files import inside
    from compiler.core.manifest import verified_file, verified_onnx

    for precision, record in manifest.onnx.items():
        verified_onnx(directory, record, precision)
    for engine in manifest.engines:
        verified_file(directory, engine, "engine")
        for layers in engine.names[1:]:
            if not inside(directory, layers, "layer file").is_file():
                raise InputError(f"{directory / layers} is missing: the directory is incomplete; rebuild it with "
                                 f"`trtc rebuild {directory}`")
    if manifest.source is not None and manifest.source.snapshot is not None:
        verified_file(directory, manifest.source.snapshot, "source model snapshot")


def verify_build(directory: Path, backend: str = "auto", env: dict[str, Any] | None = None) -> None:
    """Check a repository entry's build directory before it is served; a ``TrtcError`` says what is wrong.

    ``verify_files`` first (a mismatch names the file). Where the engines are to run (``backend`` tensorrt,
    or auto with TensorRT importable; or ``env`` given: that machine's environment, for tests), they are
    checked as ``trtc check`` does and a stale one raises with ``trtc check``'s lines.
    """
    from compiler.core.manifest import read_manifest

    manifest = read_manifest(directory)
    try:
        verify_files(directory, manifest)
    except InputError as err:
        raise InputError(f"the build directory of this repository entry does not match its manifest: {err} (export "
                         "the entry again with `trtc export-triton --force`)") from err
    if not manifest.engines:
        return
    if env is None:
        from compiler.core.capabilities import tensorrt_version

        if backend == "onnxruntime" or (backend == "auto" and tensorrt_version() is None):
            return  # the engines will not run: ONNX Runtime serves the ONNX, checked above
    from compiler.pipeline.check import check_directory

    result = check_directory(directory, env)
    if result.stale:
        raise TrtcError("\n".join(result.lines()))


class TrtcTritonModel:
    """What ``model.py``'s ``TritonPythonModel`` does, given Triton's ``args`` and its ``pb_utils`` module.

    One instance serves one Triton model instance: ``compiler.load`` with one context on the instance's
    device (``cuda:N`` for a GPU instance, the CPU otherwise). ``execute`` runs the requests of one call of
    Triton's dynamic batcher as one batch per input shape (``Engines.run_parts``: each request's rows go
    straight into the bucket's buffers); a request whose feed the runtime refuses gets its own error.
    """

    def __init__(self, args: Mapping[str, str], pb_utils: Any) -> None:
        import torch.utils.dlpack  # noqa: F401  (imported at load: its first import takes seconds, not a request's)

        from compiler.serve.load import load

        self._pb = pb_utils
        config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        directory = Path(args["model_repository"]) / str(args["model_version"]) / BUILD_FOLDER
        backend = parameters.get(SERVING_BACKEND) or "auto"
        verify_build(directory, backend)
        gpu = str(args.get("model_instance_kind", "CPU")).upper() == "GPU"
        device = f"cuda:{args.get('model_instance_device_id', 0)}" if gpu else "cpu"
        self.engines = load(directory, backend, device=device, contexts=1)
        self.input_names = list(self.engines.input_names)
        self.output_names = list(self.engines.output_names)
        log.info("%s: serving %s with %s on %s", args.get("model_instance_name"), directory, self.engines.backend,
                 self.engines.device)

    def _feed(self, request: Any) -> dict[str, np.ndarray]:
        from torch.utils.dlpack import from_dlpack

        feed = {}
        for name in self.input_names:
            tensor = self._pb.get_input_tensor_by_name(request, name)
            if tensor is None:  # Triton checks the inputs against config.pbtxt first; this is a second guard
                raise InputError(f"the request has no input {name!r}")
            feed[name] = from_dlpack(tensor.to_dlpack()).numpy()
        return feed

    def _response(self, outputs: Mapping[str, np.ndarray], start: int, stop: int) -> Any:
        import torch
        from torch.utils.dlpack import to_dlpack

        tensors = [self._pb.Tensor.from_dlpack(name, to_dlpack(torch.from_numpy(
            np.ascontiguousarray(outputs[name][start:stop])))) for name in self.output_names]
        return self._pb.InferenceResponse(output_tensors=tensors)

    def _error(self, err: BaseException) -> Any:
        return self._pb.InferenceResponse(output_tensors=[], error=self._pb.TritonError(str(err).splitlines()[0]))

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        """One response per request, in order."""
        responses: list[Any] = [None] * len(requests)
        groups: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
        for index, request in enumerate(requests):
            try:
                feed = self._feed(request)
                call = self.engines.check(feed)
            except (TrtcError, ValueError, TypeError) as err:  # FeedError is a ValueError
                responses[index] = self._error(err)
                continue
            shape = tuple((name, array.shape[1:], array.dtype.str) for name, array in feed.items())
            groups.setdefault(shape, []).append((index, call))
        for members in groups.values():
            try:
                outputs = self.engines.run_parts([call for _, call in members])
            except Exception as err:  # one batch's failure answers its requests and leaves the model serving
                log.exception("a batch of %d request(s) failed", len(members))
                for index, _ in members:
                    responses[index] = self._error(err)
                continue
            start = 0
            for index, call in members:
                responses[index] = self._response(outputs, start, start + call.rows)
                start += call.rows
        return responses

    def close(self) -> None:
        self.engines.close()
