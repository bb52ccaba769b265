"""Compare ONNX Runtime against eager PyTorch (or any two runners) on identical seeded inputs."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from compiler.errors import VerificationError
from compiler.runners import Runner
from compiler.specs import ModelSpec

__all__ = ["Comparison", "compare_outputs", "verify_runners"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Comparison:
    """Worst case over all outputs of one run.

    ``max_rel`` is the max absolute error divided by the reference's max |value| (relative to
    the output's scale, which stays meaningful where single elements are near zero).
    """

    batch: int
    max_abs: float
    max_rel: float
    cosine: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a64, b64) / (na * nb))


def compare_outputs(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], batch: int) -> Comparison:
    max_abs, max_rel, cos = 0.0, 0.0, 1.0
    for name, r in ref.items():
        g = got[name]
        if g.shape != r.shape:
            raise VerificationError(f"output {name}: shape {g.shape} differs from the reference's {r.shape}")
        if not np.all(np.isfinite(g)):
            return Comparison(batch, float("inf"), float("inf"), 0.0)
        err = float(np.max(np.abs(g.astype(np.float64) - r.astype(np.float64)))) if r.size else 0.0
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / scale if scale > 0 else err)
        cos = min(cos, cosine_similarity(g, r))
    return Comparison(batch, max_abs, max_rel, cos)


def verify_runners(candidate: Runner, reference: Runner, spec: ModelSpec, batches: list[int], rtol: float,
                   what: str, seed: int = 0) -> list[Comparison]:
    """Run both on the same seeded inputs at each batch size; raise past ``rtol`` (relative to output scale)."""
    results = []
    for batch in batches:
        feed = spec.example_feed(batch, seed=seed + batch)
        ref = reference.infer(feed)
        got = candidate.infer(feed)
        got = {r: got[c] for r, c in zip(ref, got)}  # outputs in graph order; names may differ
        cmp = compare_outputs(got, ref, batch)
        log.debug("%s at batch %d: max abs %.3g, max rel %.3g, cosine %.6f", what, batch, cmp.max_abs, cmp.max_rel,
                 cmp.cosine)
        results.append(cmp)
        if not cmp.max_rel <= rtol:
            raise VerificationError(f"{what}: {candidate.name} differs from {reference.name} at batch {batch} by "
                                    f"{cmp.max_rel:.3g} relative (max abs {cmp.max_abs:.3g}) > tolerance {rtol:g}; "
                                    "raise --rtol if that is expected, or report the model")
    return results
