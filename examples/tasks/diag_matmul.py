"""diag(a) @ B: a dense matrix product with a diagonal matrix.

Materialising the N x N diagonal matrix and multiplying costs O(N^2 M) work; scaling the rows
of B by a costs O(N M). The classic algebraic shortcut an optimiser should find.
"""

import torch
import torch.nn as nn

N = 512
M = 256


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.diag(a) @ b


def get_inputs():
    return [torch.randn(N), torch.randn(N, M)]


def get_init_inputs():
    return []
