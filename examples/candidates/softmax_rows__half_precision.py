# A tempting but dishonest shortcut: compute in float16 and cast back. It halves the memory
# traffic and stays within loose tolerances, but it changes the numerics of an fp32 task;
# the evaluator is expected to reject it.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x.half(), dim=-1).float()
