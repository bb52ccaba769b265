"""PyTorch in, folded and verified ONNX out: loading, export, verification, graph passes."""
