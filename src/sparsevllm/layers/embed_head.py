import torch
from torch import nn
import torch.nn.functional as F


class VocabEmbedding(nn.Embedding):
    pass


class LMHead(nn.Module):
    """Final projection to logits; shares the embedding matrix when the model ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: nn.Embedding | None = None):
        super().__init__()
        self.weight = tied_to.weight if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
