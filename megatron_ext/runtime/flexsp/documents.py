"""Variable-length sequences from fixed-length samples: cut each sample after every EOD token.

Legend: n = samples, s = their length, c = per-token columns (input id, label, loss mask).
This is the document view Megatron's reset_position_ids / reset_attention_mask give the same
sample; FlexSP schedules each document as one sequence (positions restart at 0 in each).
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["split_documents"]


def split_documents(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                    eod: int) -> list[torch.Tensor]:
    """[n, s] samples -> documents as [len, c] rows, each ending at (and keeping) an EOD."""
    rows = torch.stack([tokens, labels, (loss_mask > 0).long()], dim=-1)  # [n, s, c]
    docs: list[torch.Tensor] = []
    for sample, sample_rows in zip(tokens, rows):
        ends = ((sample == eod).nonzero().flatten() + 1).tolist()
        bounds = [0, *[e for e in ends if e < sample.numel()], sample.numel()]
        docs += [sample_rows[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    return docs
