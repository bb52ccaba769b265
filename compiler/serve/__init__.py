"""Serving: ``compiler.load`` and the dynamic batcher."""
