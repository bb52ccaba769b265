"""trtc: PyTorch to TensorRT engines, checked."""

__version__ = "0.1.0"
