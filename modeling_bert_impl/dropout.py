"""Dropout with its mask drawn from random bits on CPU.

`F.dropout` draws one random number per element (`bernoulli_`); on CPU that took a fifth of a fine-tuning step (both
models', transformers' too). Here each element reads 15 bits of a 64-bit draw instead, so p is rounded to a multiple of
2^-15 (0.1 becomes 0.100006) and the kept values are scaled by the exact inverse of the keep rate: the expectation is
kept, as `F.dropout` keeps it. On other devices and when traced, `F.dropout` itself runs.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

BITS = 15  # read from each 16-bit part of a draw: random_ on int64 draws 63 bits, so every part has 15 below its top


def keep_mask(shape, p: float, device) -> torch.Tensor:
    """A bool mask of `shape`, each element True with probability 1 - round(p * 2^15) / 2^15, independently."""
    n = math.prod(shape)
    parts = torch.empty(-(-n // 4), dtype=torch.int64, device=device).random_().view(torch.int16)[:n]  # 4 a draw
    return ((parts & (2**BITS - 1)) >= round(p * 2**BITS)).view(shape)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """`F.dropout(x, p, training)`, its mask from `keep_mask` in eager CPU training where p, rounded, drops some
    elements and keeps some (else F.dropout: p below 2^-16 or above 1 - 2^-16 rounds to 0 or 1)."""
    dropped = round(p * 2**BITS)
    if not training or not 0 < dropped < 2**BITS or x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    return x * keep_mask(x.shape, p, x.device) * (2**BITS / (2**BITS - dropped))


class BertImplDropout(nn.Dropout):
    """nn.Dropout through `dropout`: the same module, with the mask drawn faster on CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
