"""What runs models (TensorRT, ONNX Runtime, PyTorch) behind one contract; TensorRT's builder too."""
