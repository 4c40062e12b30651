"""User functions for custom workflow nodes (``role: custom``, ``function: module:function``)."""

import torch

from distflow.data.batch import PackedBatch


def zero_scores(batch: PackedBatch) -> PackedBatch:
    """Every response scores 0: downstream nodes must see no reward signal at all."""
    return batch.with_fields(token={"token_level_scores": torch.zeros_like(batch.token_fields["token_level_scores"])},
                             sample={"scores": torch.zeros_like(batch.sample_fields["scores"])})
