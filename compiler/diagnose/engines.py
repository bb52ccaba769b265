"""``trtc diff --engines``: the TensorRT engines' outputs against the FP32 ONNX graph on the diff's data, through the
serving runtime (``compiler.load(backend="tensorrt")``, which checks them as ``trtc check`` does). Needs TensorRT;
without it, one InputError saying so."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from compiler.backends.registry import check_runner, unavailable
from compiler.core.capabilities import checking_providers
from compiler.core.errors import InputError
from compiler.core.manifest import Manifest
from compiler.diagnose.diff import Errors

__all__ = ["engine_errors", "engines_unavailable"]


def engines_unavailable(manifest: Manifest) -> str | None:
    """Why ``--engines`` cannot run for this build here, in one line; None when it can."""
    reason = unavailable("tensorrt")
    if reason is not None:
        return f"--engines compares TensorRT engines, and TensorRT cannot run here ({reason})"
    if not manifest.engines:
        return f"--engines: the build has no engines ({manifest.engines_note or 'never built'}); run `trtc rebuild`"
    return None


def engine_errors(directory: Path, manifest: Manifest, batches: Iterable[dict[str, np.ndarray]],
                  ) -> list[dict[str, Any]]:
    """Every output of the engines (batches split to the largest bucket) against the FP32 ONNX graph on ONNX
    Runtime: ``[{"bucket": "all", "outputs": {name: Errors as JSON}}]``."""
    reason = engines_unavailable(manifest)
    if reason is not None:
        raise InputError(reason)
    from compiler.serve.load import load

    engines = load(directory, backend="tensorrt", precision=manifest.build.precision if manifest.build else None)
    runner = check_runner("onnxruntime", str(manifest.onnx_for(directory, "fp32")), checking_providers(),
                          memory_arena=False)
    runner.activate()
    largest = max(e.bucket for e in manifest.engines)
    sums: dict[str, dict[str, float]] = {}
    for batch in batches:
        size = len(next(iter(batch.values())))
        for start in range(0, size, largest):
            part = {k: v[start:start + largest] for k, v in batch.items()}
            want = runner.infer(part)
            got = engines(part)
            got = got if isinstance(got, dict) else dict(zip(want, got if isinstance(got, (list, tuple)) else [got]))
            for name, ref in want.items():
                a, b = np.asarray(got[name], np.float64).ravel(), np.asarray(ref, np.float64).ravel()
                total = sums.setdefault(name, {"diff_sq": 0.0, "ref_sq": 0.0, "got_sq": 0.0, "dot": 0.0,
                                               "max_abs": 0.0})
                d = a - b
                total["diff_sq"] += float(d @ d)
                total["ref_sq"] += float(b @ b)
                total["got_sq"] += float(a @ a)
                total["dot"] += float(a @ b)
                total["max_abs"] = max(total["max_abs"], float(np.abs(d).max(initial=0.0)))
    runner.release()
    close = getattr(engines, "close", None)
    if callable(close):
        close()
    return [{"bucket": "all", "outputs": {name: Errors.of(s).to_json() for name, s in sums.items()
                                          if math.isfinite(s["ref_sq"])}}]
