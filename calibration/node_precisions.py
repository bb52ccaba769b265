"""Which compute nodes of a model run in which precision once reduced: the counts the manifest, the accuracy report
and ``trtc inspect`` show (``node_precisions``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import onnx

from calibration.fp16 import QDQ_NODE_TYPES, Fp16Report

__all__ = ["node_precisions"]


def node_precisions(model: onnx.ModelProto, int8_nodes: Iterable[str], report: Fp16Report | None) -> dict[str, Any]:
    """Which compute nodes of the FP32 ``model`` run in INT8, FP16 and FP32 once reduced.

    ``int8_nodes`` are the nodes given Q/DQ inputs; ``report`` is the FP16 pass's report, or None when the
    remainder stays FP32. Q/DQ, Cast, Shape and Constant nodes are not counted. Returns
    ``{"counts": {"int8": n, "fp16": n, "fp32": n}, "int8": [...], "fp16": [...], "fp32": {name: why}}``.
    """
    skip = QDQ_NODE_TYPES | {"Constant", "Shape", "Size", "Cast"}
    names = [node.name or f"{node.op_type}_{i}" for i, node in enumerate(model.graph.node)
             if node.op_type not in skip]
    known = set(names)
    int8 = [n for n in int8_nodes if n in known]
    quantized = set(int8)
    high = [n for n in names if n not in quantized]
    if report is None:
        fp16, fp32 = [], dict.fromkeys(high, "FP32 remainder (--fp32-rest)")
    else:
        in_fp16 = set(report.fp16_node_names)
        fp16 = [n for n in high if n in in_fp16]
        fp32 = {n: report.fp32_nodes[n] for n in high if n in report.fp32_nodes}
    return {"counts": {"int8": len(int8), "fp16": len(fp16), "fp32": len(fp32)}, "int8": int8, "fp16": fp16,
            "fp32": fp32}
