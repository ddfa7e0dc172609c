"""One switch for CPU serving: `optimize_for_inference(model)`.

Where there is no padding to skip (batch 1, dense batches), the encoder's time on CPU is mostly its linear layers
(benchmarks/RESULTS.md "Engines": 84% of a dense 64 x 128 forward even after the switch), which `F.linear` ran at
1.4x-1.7x the time of the same products with their weights laid out once for oneDNN. The switch packs every linear
layer's weight once, in oneDNN's blocked layout, and runs the layers through oneDNN, with the feed-forward's GELU fused
into its first product. Same modules, same parameters (the packed copy is extra memory, one more copy of the linear
weights), same outputs to fp32 rounding (2e-6 to 8e-6 from transformers' on MiniLM), every batch shape and the
padding-free path as before, nothing compiled.

The packed path runs only where no gradient is wanted (`torch.no_grad()` / `torch.inference_mode()`), outside
autocast; elsewhere a layer runs as the `nn.Linear` it is, so training after the switch stays correct. A weight changed
after packing (an optimizer step, `load_state_dict`) is packed again on its next call.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation

from .modeling_bert_impl import BertImplFeedForward

ACTIVATIONS = {"none": None, "gelu": F.gelu}  # oneDNN's fused post-ops that we use; "gelu" is the exact (erf) GELU


class PackedLinear(nn.Linear):
    """nn.Linear with a oneDNN-packed copy of its weight for calls without autograd; `activation` (a key of
    ACTIVATIONS) is applied to the output, inside the same oneDNN call on the packed path."""

    activation, _packed, _packed_key = "none", None, None

    def packed(self, activation: str = "none") -> "PackedLinear":
        self.activation = activation
        self._packed, self._packed_key = None, None
        return self

    def forward(self, x):  # (..., in) -> (..., out)
        eligible = x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32
        if not eligible or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
            y = F.linear(x, self.weight, self.bias)
            return y if ACTIVATIONS[self.activation] is None else ACTIVATIONS[self.activation](y)
        key = (self.weight.data_ptr(), self.weight._version)  # changes when the weight is replaced or updated in place
        if key != self._packed_key:
            self._packed, self._packed_key = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach()), key
        algorithm = "none" if self.activation == "gelu" else ""  # "none": erf GELU, not the tanh approximation
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, self.activation, [], algorithm)


def packable(module: nn.Module) -> bool:
    """A plain nn.Linear with float32 weights on CPU, and a torch built with oneDNN."""
    return (
        type(module) is nn.Linear
        and torch.backends.mkldnn.is_available()
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    )


def is_exact_gelu(act) -> bool:
    return act is F.gelu or (type(act) is GELUActivation and act.act is F.gelu)


def optimize_for_inference(model: nn.Module) -> nn.Module:
    """Set `model` to eval mode and pack its linear layers for CPU inference, in place; returns the model.

    Every CPU float32 `nn.Linear` becomes a `PackedLinear` (its class is swapped: parameters, hooks, tied weights and
    optimizer references are untouched); in each feed-forward block with the exact GELU, the GELU moves into the first
    linear layer. Layers it cannot pack (GPU, other dtypes, a torch without oneDNN) stay as they are, and a packed
    layer moved to another device or dtype later runs as a plain `nn.Linear` again."""
    model.eval()
    for module in model.modules():
        if packable(module):
            module.__class__ = PackedLinear
            module.packed()
    for module in model.modules():
        if isinstance(module, BertImplFeedForward) and type(module.up) is PackedLinear and is_exact_gelu(module.act):
            module.up.packed("gelu")
            module.act = nn.Identity()
    return model
