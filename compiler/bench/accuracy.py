"""The accuracy columns of a bench run: each backend's first outputs against the reference's.

Max abs and rel error, cosine similarity, and top-1 agreement for classifiers only (``is_classifier``:
the accuracy gate used labels, or every output is 2-D and comes from a linear layer or a softmax).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compiler.bench.target import VerifiedOnnx
from compiler.core.errors import InputError
from compiler.core.manifest import Manifest
from compiler.frontend.verify import compare_outputs

__all__ = ["Accuracy", "accuracy_of", "is_classifier"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accuracy:
    """Worst case over the outputs, against the reference; ``top1_agreement`` only for 2-D float outputs."""

    max_abs: float
    max_rel: float
    cosine: float
    top1_agreement: float | None
    data: str = ""  # where the inputs came from


def accuracy_of(got: dict[str, np.ndarray], reference: dict[str, np.ndarray], bucket: int, top1: bool = True,
                data: str = "") -> Accuracy:
    """Max abs/rel error and cosine (``compare_outputs``), plus top-1 agreement over 2-D float outputs when ``top1``
    (the model is a classifier). ``data`` says where the inputs came from.

    Outputs are matched in order (names differ between PyTorch and ONNX).
    """
    matched = {r: got[g] for r, g in zip(reference, got)}
    cmp = compare_outputs(matched, reference, bucket)
    agreements = [float(np.mean(np.argmax(matched[n], axis=1) == np.argmax(r, axis=1)))
                  for n, r in reference.items()
                  if top1 and r.ndim == 2 and r.shape[1] > 1 and np.issubdtype(r.dtype, np.floating)]
    return Accuracy(cmp.max_abs, cmp.max_rel, cmp.cosine, min(agreements) if agreements else None, data)


_CLASSIFIER_HEADS = ("Gemm", "MatMul", "Softmax", "LogSoftmax")


def is_classifier(directory: Path, manifest: Manifest, onnx_paths: VerifiedOnnx | None = None) -> bool:
    """Whether top-1 agreement means anything for this model: the accuracy gate ran on labels, or every output is
    2-D (batch x classes) and made by a linear layer or a softmax. A sentence embedding (pooling, normalization,
    LayerNorm) or a per-token output is not a classifier. A projection head on an embedding model looks like one.
    ``onnx_paths`` shares the verified graphs with the rest of a bench run (default: checked here)."""
    if "top1" in manifest.accuracy_metrics.values():
        return True
    if "fp32" not in manifest.onnx:
        return False
    import onnx

    paths = onnx_paths if onnx_paths is not None else VerifiedOnnx(directory, manifest)
    try:
        graph = onnx.load(str(paths.path("fp32")), load_external_data=False).graph
    except (OSError, ValueError, InputError) as err:
        log.debug("no graph to tell a classifier by: %s", err)
        return False
    producers = {out: node for node in graph.node for out in node.output}
    for output in graph.output:
        if len(output.type.tensor_type.shape.dim) != 2:
            return False
        node = producers.get(output.name)
        if node is not None and node.op_type == "Add":  # MatMul + bias
            node = next((producers[i] for i in node.input if i in producers and producers[i].op_type == "MatMul"),
                        node)
        if node is None or node.op_type not in _CLASSIFIER_HEADS:
            return False
    return bool(graph.output)
