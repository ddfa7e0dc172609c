"""One switch for CPU serving: `optimize_for_inference(model)`.

The encoder's linear layers take oneDNN's packed path in CPU inference without it (packed_linear.py); the switch sets
eval mode and gives the same path to the linear layers outside the encoder (the pooler and the heads: the MLM head's
decoder, a vocabulary-sized product, gains most), at the memory of one more copy of their weights. Same modules, same
parameters, same outputs to fp32 rounding, nothing compiled.
"""

import torch
from torch import nn

from .packed_linear import ONEDNN, PackedLinear


def packable(module: nn.Module) -> bool:
    """A plain nn.Linear with float32 weights on CPU, and a torch built with oneDNN."""
    weight = module.weight if type(module) is nn.Linear else None
    return ONEDNN and weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32


def optimize_for_inference(model: nn.Module) -> nn.Module:
    """Set `model` to eval mode and give its CPU float32 `nn.Linear` layers the packed path of the encoder's, in place;
    returns the model.

    Each such layer becomes a `PackedLinear` (its class is swapped: parameters, hooks, tied weights and optimizer
    references are untouched). Layers it cannot pack (GPU, other dtypes, a torch without oneDNN) stay as they are, and
    a packed layer moved to another device or dtype later runs as a plain `nn.Linear` again."""
    model.eval()
    for module in model.modules():
        if packable(module):
            module.__class__ = PackedLinear
    return model
