"""What a bench run measures: one ``Plan`` per backend and precision, each opening a runner over one buffer set of
a serving backend (``Engines.runner``).

Every row is a serving backend of ``compiler.load``, made by name (``compiler.backends.registry``), one context
of it, timed through the runner's upload / execute / download split: the harness measures exactly what is
served.

  torch            the source model in eager mode (the torch backend, graphs off): FP32, and under
                   autocast FP16 when the build is FP16/INT8
  torch-cudagraph  the torch backend with its CUDA graph per bucket (CUDA only)
  onnxruntime      every ONNX of the build (fp32, fp16, int8, fp8, int4) on the onnxruntime backend: CUDA when
                   present (``ort_providers`` CPUExecutionProvider first keeps it on the CPU); int8, fp8 and int4
                   rows, and fp16 rows on the CPU, are accuracy rows (ONNX Runtime emulates those precisions:
                   ``measure.emulated``)
  tensorrt         the build's engines on the tensorrt backend

A backend that cannot run here is returned as ``Skipped``, with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from compiler.backends.base import Runner
from compiler.bench.report import Skipped
from compiler.bench.target import Target
from compiler.core.capabilities import capabilities, cuda_available
from compiler.core.settings import BENCH_BACKENDS, BenchSettings, ServeSettings

__all__ = ["Plan", "plans_for"]

log = logging.getLogger(__name__)

ONNX_PRECISION_ORDER = ("fp32", "fp16", "int8", "fp8", "int4")


@dataclass
class Plan:
    """A backend and precision to measure, and how to open its runner (one for every bucket)."""

    backend: str
    precision: str
    open: Callable[[], Runner]  # not yet active; releasing it closes its serving backend
    torch_memory: bool = False  # peak memory from torch's allocator (else the device-wide free-memory delta)
    weight_bytes: int = 0  # the eager model's parameters and buffers, resident before the measurement starts


def plans_for(target: Target, settings: BenchSettings, device: str, buckets: tuple[int, ...], tf32: bool,
              ) -> tuple[list[Plan], list[Skipped]]:
    """A plan for each backend of ``settings.backends`` (in ``BENCH_BACKENDS`` order) and precision that can run here,
    and the ones that cannot, each with the reason."""
    from compiler.backends.registry import ServingSource, serving_backend
    from compiler.serve.engines import Engines
    from compiler.serve.load import load

    manifest, spec, model = target.manifest, target.spec, target.model
    onnx = manifest.onnx
    reduced = any(p in onnx for p in ONNX_PRECISION_ORDER[1:]) or manifest.precision in ONNX_PRECISION_ORDER[1:]
    torch_precisions = ("fp32", "fp16") if reduced else ("fp32",)
    cuda = cuda_available()
    plans: list[Plan] = []
    skipped: list[Skipped] = []
    model_mode_note = ("`trtc bench MODEL` runs eager PyTorch and ONNX Runtime only; build a directory with "
                       "`trtc build` and bench it for the others")

    def skip(backend: str, precision: str | None, reason: str) -> None:
        skipped.append(Skipped(backend, precision, None, reason))

    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) \
        if model is not None and hasattr(model, "parameters") else 0

    def served(name: str, source: ServingSource, serve: ServeSettings, label: str | None = None,
               ) -> Callable[[], Runner]:
        def open_runner() -> Runner:
            engines = Engines(serving_backend(name, source, serve), contexts=1)
            provider = "CUDAExecutionProvider" if engines.device.startswith("cuda") else "CPUExecutionProvider"
            return engines.runner(label or f"{name}[{provider}]", closing=True)

        return open_runner

    def torch_runner(precision: str, graphs: bool) -> Callable[[], Runner]:
        source = ServingSource(target.directory, manifest, spec, buckets, module=model)
        label = ("torch-cudagraph" if graphs else "torch") + ("[autocast-fp16]" if precision == "fp16" else "")
        return served("torch", source, ServeSettings(backend="torch", device=device, contexts=1, cuda_graphs=graphs,
                                                     autocast_fp16=precision == "fp16"), label)

    def ort_runner(precision: str, ort_device: str | None) -> Callable[[], Runner]:
        source = ServingSource(target.directory, manifest, spec, buckets, onnx=target.onnx.path(precision))
        return served("onnxruntime", source, ServeSettings(backend="onnxruntime", device=ort_device, contexts=1,
                                                           threads=settings.threads, tf32=tf32))

    def trt_runner() -> Runner:
        return load(target.directory, backend="tensorrt", contexts=1).runner("tensorrt", closing=True)

    for backend in BENCH_BACKENDS:
        if backend not in settings.backends:
            continue
        if backend == "torch":
            for precision in torch_precisions:
                if model is None:
                    skip(backend, precision, target.model_note)
                elif precision == "fp16" and device != "cuda":
                    skip(backend, precision, "autocast FP16 runs on CUDA only, and this run is on the CPU")
                else:
                    plans.append(Plan(backend, precision, torch_runner(precision, False), torch_memory=True,
                                      weight_bytes=weights))
        elif backend == "torch-cudagraph":
            for precision in torch_precisions:
                if target.model_mode:
                    skip(backend, precision, model_mode_note)
                elif not cuda:
                    skip(backend, precision, "no CUDA device: torch.cuda.is_available() is False")
                elif device != "cuda":
                    skip(backend, precision, "--device cpu: CUDA graphs run on CUDA only")
                elif model is None:
                    skip(backend, precision, target.model_note)
                else:
                    plans.append(Plan(backend, precision, torch_runner(precision, True), torch_memory=True,
                                      weight_bytes=weights))
        elif backend == "onnxruntime":
            ort_device = _ort_device(settings.ort_providers)
            for precision in sorted(onnx, key=lambda p: ONNX_PRECISION_ORDER.index(p)
                                    if p in ONNX_PRECISION_ORDER else 99):
                plans.append(Plan(backend, precision, ort_runner(precision, ort_device)))
        elif backend == "tensorrt":
            engines = manifest.engines
            reason = model_mode_note if target.model_mode else capabilities().tensorrt_unavailable()
            if reason is None and not engines:
                note = manifest.engines_note or "not built"
                reason = f"the build has no TensorRT engines ({note.removeprefix('not built: ')}); " \
                         f"build them with `trtc build` where TensorRT is installed"
            if reason is not None:
                skip(backend, None, reason)
                continue
            plans.append(Plan(backend, manifest.engine_precision(engines[0]), trt_runner))
    return plans, skipped


def _ort_device(providers: tuple[str, ...]) -> str | None:
    """The onnxruntime backend's device for ``--ort-providers``: the CPU when it comes first, else CUDA when usable.

    The serving backend runs the CUDA provider or the CPU; a TensorRT EP asked for is run as CUDA, with a warning.
    """
    if not providers:
        return None
    if providers[0] == "CPUExecutionProvider":
        return "cpu"
    if providers[0] != "CUDAExecutionProvider":
        log.warning("--ort-providers %s: the onnxruntime backend serves with the CUDA provider or the CPU; running "
                    "with CUDA where usable", providers[0])
    return None
