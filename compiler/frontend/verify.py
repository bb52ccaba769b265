"""Compare ONNX Runtime against eager PyTorch (or any two runners) on identical inputs.

The rule is elementwise, like ``numpy.allclose``: an element passes when
``|got - ref| <= atol * max(1, scale) + rtol * |ref|``, where ``scale`` is the output's max
|value|. The absolute part keeps near-zero elements from failing on FP32 kernel noise (a
detection head's 3.8e-5 on values around 0.1); it grows with outputs larger than 1 so that
elements that cancel in a large output (box coordinates in pixels) are judged against the
output's magnitude. On top of that, each whole output (per run) must keep a cosine
similarity of at least ``min_cosine`` to the reference: a wrong operator moves errors to the
scale of the values themselves, far past both.

Where the checks run (``checking_devices``): eager PyTorch on CUDA and ONNX Runtime on its CUDA
provider when a CUDA device, torch's CUDA and onnxruntime-gpu are all present, else both on the
CPU. TF32 is off on both sides (torch's matmul and cuDNN flags, the provider's ``use_tf32``), so
the FP32 check compares FP32 kernels with FP32 kernels and the CPU's tolerance holds unchanged;
with TF32 a ViT-B/16's outputs move by about 1e-3 of their scale, past the default ``atol``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np

from compiler.backends.base import Runner
from compiler.backends.onnxrt_runner import OnnxRuntimeRunner
from compiler.backends.registry import check_runner
from compiler.core.capabilities import checking_providers
from compiler.core.errors import InputError, VerificationError, first_line, user_code_failure
from compiler.core.settings import Tolerance
from compiler.core.specs import ModelSpec

__all__ = ["Comparison", "Tolerance", "compare_outputs", "checked", "verify_runners", "onnxruntime_errors",
           "ort_message",
           "FeedSource", "CheckingDevices", "checking_devices", "EagerReference", "fp32_math",
           "ExportChecks"]

FORWARD = "the model's forward"  # the user's code, as messages name it
log = logging.getLogger(__name__)

FeedSource = Callable[[int], dict[str, np.ndarray]]  # batch size -> one feed at that batch


@dataclass(frozen=True)
class Comparison:
    """Worst case over all outputs of one run.

    ``max_rel`` is the max absolute error divided by the reference's max |value| (relative to the
    output's scale). ``cosine`` is the lowest cosine similarity of a whole output. ``mismatched``
    counts the elements outside the tolerance, of ``elements``; ``worst_output`` names the output
    with the largest error relative to what the tolerance allows (``excess``, > 1 fails).
    """

    batch: int
    max_abs: float
    max_rel: float
    cosine: float
    mismatched: int = 0
    elements: int = 0
    worst_output: str = ""
    excess: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def passes(self, tol: Tolerance) -> bool:
        return self.mismatched == 0 and self.cosine >= tol.min_cosine


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a64, b64) / (na * nb))


def compare_outputs(got: Mapping[str, Any], ref: Mapping[str, Any], batch: int,
                    tol: Tolerance | None = None) -> Comparison:
    """Compare every output of ``got`` against ``ref`` (same names); ``tol`` defaults to ``Tolerance()``.

    Integer, boolean and string outputs must be equal; reduced floats (bfloat16, float8) are compared as float32. A
    sequence output (a list of arrays) is compared element by element, an empty optional (None) must be empty in
    both.
    """
    tol = tol or Tolerance()
    got, ref = _flattened(got, ref)
    max_abs, max_rel, cos = 0.0, 0.0, 1.0
    mismatched, elements, worst, worst_excess = 0, 0, "", -1.0
    for name, r in ref.items():
        g = got[name]
        if r.dtype.kind == "V" or r.dtype.name.startswith(("bfloat16", "float8", "float4")):  # ml_dtypes' floats
            g, r = g.astype(np.float32), r.astype(np.float32)
        if g.shape != r.shape:
            raise VerificationError(f"output {name}: shape {g.shape} differs from the reference's {r.shape}")
        elements += r.size
        if not r.size:
            continue
        if g.dtype == bool or r.dtype == bool or r.dtype.kind != "f":
            differ = int(np.count_nonzero(g != r))
            if differ:
                mismatched += differ
                numeric = r.dtype.kind in "iub" and g.dtype.kind in "iub"
                max_abs = max(max_abs, float(np.max(np.abs(g.astype(np.float64) - r.astype(np.float64))))
                              if numeric else float("inf"))
                worst, worst_excess = name, float("inf")
            continue
        if not np.all(np.isfinite(g)) and not np.array_equal(np.isfinite(g), np.isfinite(r)):
            return Comparison(batch, float("inf"), float("inf"), 0.0, mismatched + int(np.sum(~np.isfinite(g))),
                              elements, name, float("inf"))
        g64, r64 = g.astype(np.float64), r.astype(np.float64)
        finite = np.isfinite(r64)
        g64, r64 = np.where(finite, g64, 0.0), np.where(finite, r64, 0.0)
        err = np.abs(g64 - r64)
        scale = float(np.max(np.abs(r64)))
        allowed = tol.atol * max(1.0, scale) + tol.rtol * np.abs(r64)
        excess = float(np.max(err / np.maximum(allowed, np.finfo(np.float64).tiny)))
        mismatched += int(np.count_nonzero(err > allowed))
        max_abs = max(max_abs, float(err.max()))
        max_rel = max(max_rel, float(err.max()) / scale if scale > 0 else float(err.max()))
        if scale > 0:  # an all-zero reference has no direction; the elementwise rule alone judges it
            cos = min(cos, cosine_similarity(g64, r64))
        if excess > worst_excess:
            worst, worst_excess = name, excess
        if scale == 0:
            log.warning("output %s is all zeros in the reference at batch %d: the check compares little there",
                        name, batch)
    return Comparison(batch, max_abs, max_rel, cos, mismatched, elements, worst, max(worst_excess, 0.0))


def _flattened(got: Mapping[str, Any], ref: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Both sides with each sequence output as one entry per element (``name[i]``) and empty optionals left out;
    VerificationError when a sequence's length or an optional's presence differs."""
    flat_got: dict[str, np.ndarray] = {}
    flat_ref: dict[str, np.ndarray] = {}
    for name, r in ref.items():
        g = got[name]
        if (g is None) != (r is None):
            raise VerificationError(f"output {name}: {'empty' if g is None else 'a value'} where the reference has "
                                    f"{'none' if r is None else 'one'}")
        if r is None:
            continue
        if isinstance(r, (list, tuple)) or isinstance(g, (list, tuple)):
            lengths = [len(v) if isinstance(v, (list, tuple)) else "no sequence" for v in (r, g)]
            if isinstance(lengths[0], str) or lengths[0] != lengths[1]:
                raise VerificationError(f"output {name}: a sequence of {lengths[0]} elements in the reference, of "
                                        f"{lengths[1]} here")
            inner_got, inner_ref = _flattened({f"{name}[{i}]": v for i, v in enumerate(g)},
                                              {f"{name}[{i}]": v for i, v in enumerate(r)})
            flat_got.update(inner_got)
            flat_ref.update(inner_ref)
            continue
        flat_got[name], flat_ref[name] = np.asarray(g), np.asarray(r)
    return flat_got, flat_ref


def ort_message(err: BaseException) -> str:
    """ONNX Runtime's message without its prefix (``[ONNXRuntimeError] : 1 : FAIL : ``), on one line."""
    text = " ".join(str(err).split())
    return text.split(" : ", 3)[-1][:300] if text.startswith("[ONNXRuntimeError]") else text[:300]


def onnxruntime_errors() -> tuple[type[BaseException], ...]:
    """The exceptions ONNX Runtime raises for a model it cannot load or a run it cannot do (its own types, which
    derive from Exception only)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidArgument", "RuntimeException", "InvalidGraph", "NotImplemented", "InvalidProtobuf",
             "NoSuchFile", "EPFail", "ModelLoadCanceled", "ModelRequiresCompilation", "NotFound")
    return tuple(getattr(state, n) for n in names if isinstance(getattr(state, n, None), type))


def checked(got: Mapping[str, Any], ref: Mapping[str, Any], batch: int, tol: Tolerance, what: str,
            candidate: str, reference: str) -> Comparison:
    """``compare_outputs`` of one run; VerificationError (naming ``what``, both sides and the worst output) past
    ``tol``. Outputs are matched in order: the names may differ."""
    got = {r: got[c] for r, c in zip(ref, got)}  # outputs in graph order; names may differ
    cmp = compare_outputs(got, ref, batch, tol)
    log.debug("%s at batch %d: max abs %.3g, max rel %.3g, cosine %.6f, %d of %d elements outside", what, batch,
              cmp.max_abs, cmp.max_rel, cmp.cosine, cmp.mismatched, cmp.elements)
    if not cmp.passes(tol):
        raise VerificationError(
            f"{what}: {candidate} differs from {reference} at batch {batch}, output "
            f"{cmp.worst_output!r}: {cmp.mismatched} of {cmp.elements} elements outside {tol} (max abs error "
            f"{cmp.max_abs:.3g}, {cmp.max_rel:.3g} of the output's scale, cosine {cmp.cosine:.6f}); raise --atol "
            "or --rtol if that is expected, or report the model")
    return cmp


def verify_runners(candidate: Runner, reference: Runner, spec: ModelSpec, batches: list[int],
                   tol: Tolerance | None, what: str, seed: int = 0, feeds: FeedSource | None = None,
                   ) -> list[Comparison]:
    """Run both (active runners) on the same inputs at each batch size; raise VerificationError past ``tol``.

    ``feeds`` gives the input at a batch size (the user's calibration data, say); by default
    ``spec.example_feed`` with a seed per batch.
    """
    tol = tol or Tolerance()
    results = []
    for batch in batches:
        feed = feeds(batch) if feeds is not None else spec.example_feed(batch, seed=seed + batch)
        ref = reference.infer(feed)
        got = candidate.infer(feed)
        results.append(checked(got, ref, batch, tol, what, candidate.name, reference.name))
    return results


# ONNX Runtime's CUDA provider for the FP32 checks: no TF32 (on by default in the provider; off, its Conv sets cuDNN's
# FMA math before searching algorithms, and its MatMul/Gemm use FP32 cuBLAS math)
_CHECK_CUDA_OPTIONS = {"use_tf32": "0"}


@dataclass(frozen=True)
class CheckingDevices:
    """Where the export checks run: eager PyTorch's device and ONNX Runtime's providers (TF32 off on both)."""

    torch_device: str  # "cuda" or "cpu"
    ort_providers: tuple[Any, ...]  # for the ONNX Runtime runner: names, or (name, options) pairs

    @property
    def ort_provider(self) -> str:
        first = self.ort_providers[0]
        return str(first[0] if isinstance(first, tuple) else first)

    def ort_runner(self, model: Any) -> OnnxRuntimeRunner:
        """An ONNX Runtime check runner on ``model`` (a path or proto) with these providers, not yet active."""
        return cast(OnnxRuntimeRunner, check_runner("onnxruntime", model, list(self.ort_providers)))


def checking_devices(providers: list[str] | None = None) -> CheckingDevices:
    """The GPU when ONNX Runtime's CUDA provider and torch's CUDA are both usable (``checking_providers``, or
    ``providers`` if given), else the CPU for both sides."""
    providers = providers if providers is not None else checking_providers()
    if providers[0] == "CUDAExecutionProvider":
        return CheckingDevices("cuda", (("CUDAExecutionProvider", dict(_CHECK_CUDA_OPTIONS)), "CPUExecutionProvider"))
    return CheckingDevices("cpu", ("CPUExecutionProvider",))


@contextlib.contextmanager
def fp32_math() -> Iterator[None]:
    """TF32 off for torch's CUDA matmuls and convolutions inside the block (cuDNN allows it by default)."""
    import torch

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.allow_tf32, matmul.allow_tf32)
    cudnn.allow_tf32 = matmul.allow_tf32 = False
    try:
        yield
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = saved


class EagerReference(Runner):
    """Eager PyTorch as the export checks' reference, on ``device`` with TF32 off.

    A module that cannot run on CUDA (a graph with a CPU device baked in, too little memory) falls back
    to the CPU with a warning; ``device`` says where it ran last. ``close`` moves the module back to the
    CPU (``.to`` moves it in place, and later steps save its weights) and frees torch's cached GPU memory.
    """

    name = "torch"

    def __init__(self, module: Any, input_names: list[str], output_names: list[str], device: str = "cpu") -> None:
        super().__init__()
        self.module = module
        self.input_names = input_names
        self.output_names = output_names
        self.device = device
        self._runner: Runner | None = None

    def move_to(self, device: str) -> None:
        self.device = device
        self._runner = self._on(device)

    def _on(self, device: str) -> Runner:
        if device != "cpu":
            try:
                return self._active(device)
            except RuntimeError as err:
                self._fall_back(err)
        return self._active("cpu")

    def _active(self, device: str) -> Runner:
        runner = check_runner("torch", self.module, self.input_names, self.output_names, device=device)
        runner.activate()
        return runner

    def _fall_back(self, err: Exception) -> None:
        log.warning("eager PyTorch cannot run the model on %s (%s); the export checks run it on the CPU",
                    self.device, first_line(err))
        self.device = "cpu"

    def _activate(self) -> None:
        self._runner = self._on(self.device)

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The eager outputs; a CUDA run that fails (a device mismatch inside the graph, out of memory) runs again
        on the CPU, where the checks then stay."""
        with fp32_math():
            if self.device == "cpu":
                return super().infer(feed)
            try:
                return super().infer(feed)
            except RuntimeError as err:
                self._fall_back(err)
                self._runner = self._on("cpu")
                return super().infer(feed)

    def _upload(self, feed: Mapping[str, np.ndarray]) -> None:
        assert self._runner is not None
        self._runner.upload(feed)

    def _execute(self) -> None:
        assert self._runner is not None
        self._runner.execute()

    def _download(self) -> dict[str, np.ndarray]:
        assert self._runner is not None
        return self._runner.download()

    def _release(self) -> None:
        self._runner = None

    def close(self) -> None:
        self.release()
        if hasattr(self.module, "to"):
            self.module.to("cpu")
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


class ExportChecks:
    """The export and pass checks of one export: on the GPU where there is one (``checking_devices``), and
    judged on the CPU when a GPU check fails.

    The tolerance was set on FP32 CPU kernels; a GPU library that still takes a reduced-precision path
    (TF32 somewhere despite the flags) must not fail a correct export, so a failed GPU check runs again on
    the CPU, whose verdict stands (with a warning naming the GPU's error), and the remaining checks stay
    there. ``module`` is the eager model (None for an ONNX input, whose reference is then the original ONNX).
    """

    def __init__(self, module: Any, input_names: list[str], output_names: list[str],
                 devices: CheckingDevices | None = None) -> None:
        self.devices = devices or checking_devices()
        self.eager = EagerReference(module, input_names, output_names, self.devices.torch_device) \
            if module is not None else None
        if self.eager is not None:
            self.eager.activate()
        self.provider = self.devices.ort_provider  # the provider of the last check's candidate session

    @property
    def reference_name(self) -> str:
        return self.eager.name if self.eager is not None else "onnxruntime[original ONNX]"

    def run(self, candidate: Any, original: Any, spec: ModelSpec, batches: list[int], tol: Tolerance | None,
            what: str, feeds: FeedSource | None = None, feeds_from: str = "") -> list[Comparison]:
        """``verify_runners`` of ``candidate`` (an ONNX path or proto) against the eager model, or against
        ``original`` (ONNX) where there is none; ``feeds_from`` says where ``feeds`` come from, for messages.

        InputError when ONNX Runtime cannot load ``original`` or run it on the inputs (``--example-data`` gives real
        ones); VerificationError when it cannot load or run ``candidate`` while the reference runs."""
        try:
            return self._run(candidate, original, spec, batches, tol, what, feeds, feeds_from)
        except VerificationError as err:
            if self.devices.torch_device == "cpu" and self.devices.ort_provider == "CPUExecutionProvider":
                raise
            log.warning("%s failed on the GPU (%s); checking again on the CPU, whose verdict stands", what,
                        str(err).split(": ", 1)[-1])
            self.devices = checking_devices(["CPUExecutionProvider"])
            if self.eager is not None:
                self.eager.move_to("cpu")
            return self._run(candidate, original, spec, batches, tol, what, feeds, feeds_from)

    def _run(self, candidate: Any, original: Any, spec: ModelSpec, batches: list[int], tol: Tolerance | None,
             what: str, feeds: FeedSource | None, feeds_from: str) -> list[Comparison]:
        errors = onnxruntime_errors()
        inputs = f"the example inputs ({feeds_from})" if feeds is not None else \
            "the values trtc generated for its inputs (" + ", ".join(
                f"{i.name}: {i.describe_values()}" for i in spec.inputs) + ")"
        hint = "check those inputs" if feeds is not None else \
            "pass --example-data FILE.npz with real inputs (one array per input name)"
        with contextlib.ExitStack() as stack:
            reference: Runner
            if self.eager is not None:
                reference = self.eager
            else:
                try:
                    reference = stack.enter_context(self.devices.ort_runner(original))
                except errors as err:
                    raise InputError(f"ONNX Runtime cannot load the ONNX model ({ort_message(err)}); fix or re-export "
                                     "the model") from err
                reference.name = self.reference_name
            runner = self.devices.ort_runner(candidate)
            try:
                stack.enter_context(runner)
            except errors as err:
                raise VerificationError(f"{what}: ONNX Runtime cannot load the model to check ({ort_message(err)}); "
                                        "report the model") from err
            self.provider = runner.provider
            tol = tol or Tolerance()
            results = []
            for batch in batches:
                feed = feeds(batch) if feeds is not None else spec.example_feed(batch, seed=batch)
                try:
                    ref = reference.infer(feed)
                except errors as err:
                    raise InputError(f"ONNX Runtime cannot run the original model on {inputs}: {ort_message(err)}; "
                                     f"{hint}") from err
                except Exception as err:  # the user's forward, in eager PyTorch: theirs to fix, at their frame
                    if self.eager is None:
                        raise
                    raise InputError(f"{user_code_failure(FORWARD, err)} at batch {batch} "
                                     f"in eager PyTorch (the checks run batches {', '.join(map(str, batches))}); "
                                     "fix the model, or lower --buckets to the batches it takes") from err
                try:
                    got = runner.infer(feed)
                except errors as err:
                    raise VerificationError(f"{what}: ONNX Runtime cannot run the model to check at batch {batch}, "
                                            f"while it runs {reference.name} ({ort_message(err)}); report the model"
                                            ) from err
                results.append(checked(got, ref, batch, tol, what, runner.name, reference.name))
            return results

    def record(self) -> dict[str, Any]:
        """Where the checks ran, for the manifest's ``verification.devices``."""
        return {"onnxruntime": self.provider, "torch": self.eager.device if self.eager is not None else None,
                "tf32": False}

    def close(self) -> None:
        if self.eager is not None:
            self.eager.close()
