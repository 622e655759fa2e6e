# diag(a) @ b scales row i of b by a[i]: an O(N*M) broadcast instead of an O(N^2*M) product.
# The off-diagonal terms the product adds are exact zeros, so the result is bit-identical.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.unsqueeze(1) * b
