"""A BERT layer's products, named once for the engines: its six linear layers by their stock names
(`LAYER_PRODUCTS`), where each sits, grouped by input into the four products an engine runs (`layer_sites`: query,
key and value as one), and the weights of a group side by side (`joined`). Each engine makes its own kind of product
from these: packed (fused_layers.py), int8 (quantization.py), the AVX2 kernel's (avx2_gemm.py) and the compiled
program's (compiled_encoder.py).
"""

import torch
from torch import nn

LAYER_PRODUCTS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                  "intermediate.dense", "output.dense")
GROUPS = ((0, 1, 2), (3,), (4,), (5,))  # indices into LAYER_PRODUCTS: query, key and value share their input


def layer_products(layer: nn.Module) -> list[nn.Module]:
    """The modules at a layer's LAYER_PRODUCTS (its linears, or whatever replaced them), in that order."""
    return [layer.get_submodule(path) for path in LAYER_PRODUCTS]


def layer_sites(layer: nn.Module) -> list[tuple[list[nn.Module], list[tuple[nn.Module, str]]]]:
    """A layer's four products (GROUPS), each as (its modules, where they sit: (parent, attribute) of each)."""
    places = [(layer.get_submodule(parent), name) for parent, _, name in (p.rpartition(".") for p in LAYER_PRODUCTS)]
    return [([getattr(*places[i]) for i in group], [places[i] for i in group]) for group in GROUPS]


def joined(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights (sum of out, in) and biases (sum of out,) of `linears` (of one input) side by side: one product
    computing them all."""
    return torch.cat([m.weight.detach() for m in linears]), torch.cat([m.bias.detach() for m in linears])


def encoder_linears(encoder: nn.Module, kind: type = nn.Linear) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) for every `kind` (nn.Linear, Int8Linear) inside the encoder's layers."""
    return [(parent, name, child) for parent in encoder.layer.modules() for name, child in parent.named_children()
            if isinstance(child, kind)]
