# relu(s * y) = s * relu(y) for s > 0, so the scale folds into the convolution's weights and
# bias, and ReLU and the bias add run in place on the convolution's output: two passes over
# the output fewer. With s a power of two the folding is exact.
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, scale: float):
        super().__init__()
        # Same parameters, created in the same order as the reference's.
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.bias = nn.Parameter(torch.randn(out_channels, 1, 1) * 0.1)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(x, self.conv.weight * self.scale, self.conv.bias * self.scale, padding=1)
        return y.relu_().add_(self.bias)
