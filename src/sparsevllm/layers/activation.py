from torch import nn

from sparsevllm.kernels.silu_mul import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x):
        return silu_and_mul(x)
