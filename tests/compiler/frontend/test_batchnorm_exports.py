"""BatchNorm folding on real PyTorch exports, at several opsets and both exporters, against eager PyTorch.

ONNX's own BatchNormalization cases feed the statistics as graph inputs, so none of them exercises folding: these
export small eval-mode models whose BatchNorms have non-trivial statistics (running mean and variance away from 0
and 1, affine or not) and check what ``run_passes`` makes of them.
"""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from compiler.core.onnx_io import ort_session
from compiler.frontend.passes import run_passes


def with_statistics(module: nn.Module, seed: int = 0) -> nn.Module:
    """``module`` in eval mode with every BatchNorm's running statistics (and affine parameters) randomised."""
    generator = torch.Generator().manual_seed(seed)
    for bn in module.modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            c = bn.num_features
            bn.running_mean.copy_(torch.randn(c, generator=generator) * 0.5)
            bn.running_var.copy_(torch.rand(c, generator=generator) + 0.5)
            if bn.affine:
                bn.weight.data.copy_(torch.rand(c, generator=generator) + 0.5)
                bn.bias.data.copy_(torch.randn(c, generator=generator) * 0.2)
    return module.eval()


class MatMulAdd(nn.Module):
    """x @ W + b written out (exported as MatMul + Add, not Gemm), then a BatchNorm1d over its features."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 6))
        self.b = nn.Parameter(torch.randn(6))
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x @ self.w + self.b)


MODELS = {
    # name: (factory, input shape, BatchNorms the pass must fold into their producer)
    "conv_bn": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)), (2, 3, 8, 8), 1),
    "conv_bias_bn_relu": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()), (2, 3, 8, 8), 1),
    "grouped_conv_transpose_bn": (lambda: nn.Sequential(nn.ConvTranspose2d(8, 4, 2, stride=2, groups=2),
                                                        nn.BatchNorm2d(4)), (2, 8, 5, 5), 1),
    "conv1d_bn": (lambda: nn.Sequential(nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6)), (2, 4, 10), 1),
    "linear_bn": (lambda: nn.Sequential(nn.Linear(16, 6), nn.BatchNorm1d(6)), (4, 16), 1),
    "matmul_add_bn": (MatMulAdd, (4, 16), 1),
    # affine=False: no weight and bias in PyTorch; after a ReLU the BatchNorm has no producer to fold into
    "relu_bn_without_affine": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8, affine=False)),
                               (2, 3, 8, 8), 0),
    "conv_bn_without_affine": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, affine=False)),
                               (2, 3, 8, 8), 1),
}

EXPORTS = [pytest.param("torchscript", 13, id="torchscript-13"), pytest.param("torchscript", 17, id="torchscript-17"),
           pytest.param("dynamo", 18, id="dynamo-18", marks=pytest.mark.slow),
           pytest.param("dynamo", 21, id="dynamo-21", marks=pytest.mark.slow)]


def exported(module: nn.Module, x: torch.Tensor, exporter: str, opset: int) -> onnx.ModelProto:
    """``module`` exported with its BatchNorms kept (the TorchScript exporter's own folding off)."""
    buf = io.BytesIO()
    if exporter == "torchscript":
        torch.onnx.export(module, (x,), buf, dynamo=False, opset_version=opset, do_constant_folding=False,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "B"}, "y": {0: "B"}})
        return onnx.load_from_string(buf.getvalue())
    program = torch.onnx.export(module, (x,), dynamo=True, opset_version=opset, optimize=False, input_names=["x"],
                                output_names=["y"], dynamic_shapes=({0: torch.export.Dim("B", min=1, max=64)},))
    assert program is not None
    return program.model_proto


@pytest.mark.parametrize(("exporter", "opset"), EXPORTS)
@pytest.mark.parametrize("name", MODELS)
def test_batchnorm_folding_of_a_pytorch_export_matches_eager(name: str, exporter: str, opset: int) -> None:
    """The export holds BatchNormalization nodes; after run_passes (which checks its result in ONNX Runtime) none is
    left, as many as expected were folded into their Conv/ConvTranspose/Gemm/MatMul+Add producer (the rest became
    Mul + Add), and ONNX Runtime on the folded graph matches eager PyTorch at a batch the export never saw within
    rtol 1e-4, atol 1e-5."""
    factory, shape, foldable = MODELS[name]
    torch.manual_seed(0)
    module = with_statistics(factory())
    x = torch.randn(*shape)
    model = exported(module, x, exporter, opset)
    assert Counter(n.op_type for n in model.graph.node)["BatchNormalization"] == 1
    feeds = {"x": x.numpy()}
    folded, results = run_passes(model, feeds)
    assert Counter(n.op_type for n in folded.graph.node)["BatchNormalization"] == 0
    changes = next(r.changes for r in results if r.name == "batchnorm_folding")
    assert len(changes["folded"]) == foldable and len(changes["converted_to_mul_add"]) == 1 - foldable
    other = torch.randn(3, *shape[1:], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = module(other).numpy()
    got = ort_session(folded).run(None, {"x": other.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
