"""A small convolution block: 3x3 convolution, ReLU, a positive scale, a per-channel bias.

Everything after the convolution is elementwise and can be fused into one pass, and the
positive scale can be folded into the convolution's weights because relu(s * y) = s * relu(y)
for s > 0.
"""

import torch
import torch.nn as nn

BATCH = 4
IN_CHANNELS = 16
OUT_CHANNELS = 32
SIZE = 32
SCALE = 0.5


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, scale: float):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.bias = nn.Parameter(torch.randn(out_channels, 1, 1) * 0.1)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = torch.relu(y)
        y = y * self.scale
        return y + self.bias


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CHANNELS, OUT_CHANNELS, SCALE]
