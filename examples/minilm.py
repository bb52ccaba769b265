"""A MiniLM-like sentence encoder built from a config: all-MiniLM-L6-v2's shape, random weights, no downloads.

``minilm_like()`` is ``transformers.BertModel`` with 6 layers, hidden size 384, 12 heads and intermediate
size 1536 (all-MiniLM-L6-v2's config), returning the last hidden state. Real BERT-style weights have a few
residual channels far larger than the rest (the "outlier dimensions" that their FFN outputs write and every
LayerNorm then carries into the next layer's inputs); random weights do not, so ``OUTLIER_CHANNELS`` rows
of each FFN output projection are scaled by ``OUTLIER_SCALE`` to imitate them. Needs ``transformers``
(the dev extra).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["OUTLIER_CHANNELS", "OUTLIER_SCALE", "VOCAB", "MiniLMLike", "minilm_like", "token_batches"]

VOCAB = 30522
OUTLIER_CHANNELS = (65, 223, 308)  # a few fixed dimensions of the 384, as in real checkpoints
OUTLIER_SCALE = 12.0


class MiniLMLike(nn.Module):
    """BertModel(input_ids, attention_mask) -> last hidden state [B, S, 384]."""

    def __init__(self, seed: int = 0, outliers: bool = True) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(seed)
        config = BertConfig(vocab_size=VOCAB, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                            intermediate_size=1536, max_position_embeddings=512, attn_implementation="eager")
        self.bert = BertModel(config, add_pooling_layer=False).eval()
        if outliers:
            with torch.no_grad():
                for layer in self.bert.encoder.layer:
                    dense = layer.output.dense  # FFN output projection: intermediate -> hidden
                    for channel in OUTLIER_CHANNELS:
                        dense.weight[channel] *= OUTLIER_SCALE
                        dense.bias[channel] += OUTLIER_SCALE

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def minilm_like() -> MiniLMLike:
    return MiniLMLike()


def token_batches(seed: int, batches: int, batch: int = 8, min_len: int = 8, max_len: int = 48,
                  ) -> list[dict[str, np.ndarray]]:
    """Padded batches of random token ids (a Zipf-like vocabulary draw) with their attention masks."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        lengths = rng.integers(min_len, max_len + 1, batch)
        width = int(lengths.max())
        ids = np.minimum(rng.zipf(1.3, (batch, width)) + 999, VOCAB - 1).astype(np.int64)
        ids[:, 0] = 101  # [CLS]
        mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int64)
        ids = np.where(mask == 1, ids, 0)
        out.append({"input_ids": ids, "attention_mask": mask})
    return out
