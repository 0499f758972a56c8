import torch
from torch import nn

from sparsevllm.kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual), fused on GPU."""
        return rms_norm(x, self.weight, self.eps, residual)
