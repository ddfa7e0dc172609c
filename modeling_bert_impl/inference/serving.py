"""One switch for CPU serving: `optimize_for_inference(model)`.

The encoder's linear layers take oneDNN's packed path in CPU inference without it (packed_linear.py); the switch sets
eval mode and gives the same path to the linear layers outside the encoder (the pooler and the heads: the MLM head's
decoder, a vocabulary-sized product, gains most), at the memory of one more copy of their weights. Same modules, same
parameters, same outputs to fp32 rounding, nothing compiled.
"""

from torch import nn

from .packed_linear import PackedLinear, packable_weight


def packable(module: nn.Module) -> bool:
    """A plain nn.Linear with a float32 weight on CPU that the packed path takes (`packable_weight`)."""
    return type(module) is nn.Linear and module.weight.device.type == "cpu" and packable_weight(module.weight)


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
