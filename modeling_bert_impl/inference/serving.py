"""`optimize_for_inference(model)`: an inference model for CPU serving, float32 (its products in bfloat16 on request,
on a CPU with bfloat16 units), nothing compiled.

It is a copy of the model (frozen_model.py), with the same module names and state dict, whose linear layers hold their
weights packed in oneDNN's layout (packed_linear.py) and whose encoder runs its layers fused (fused_layers.py), query,
key and value in one product. All of it is made once, at the call, from the weights the model has then: the model
given stays plain and trainable, and changing it afterwards never changes the inference model's answers (call
`optimize_for_inference` again for the new weights). Memory: the copy, and one more packed copy of the linear weights.
"""

import torch
from torch import nn

from .anatomy import LAYER_PRODUCTS, layer_products
from .frozen_model import fix_weights, inference_copy
from .fused_layers import fuse_encoder, packed_products
from .packed_linear import PackedLinear, cpu_bf16_units, pack_linears


def base_of(model: nn.Module) -> nn.Module:
    """The bert-impl encoder model inside `model` (itself, or a head's `bert`)."""
    return getattr(model, "base_model", model)


def optimize_for_inference(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An inference model of `model` (any bert-impl head; the model itself is not changed), in eval mode, refusing
    training with a ValueError.

    Its CPU float32 `nn.Linear` layers become `PackedLinear` (their weights packed now), and where every linear layer of
    the encoder did, the encoder becomes a `FusedEncoder`. Layers it cannot pack (GPU, other dtypes, a torch without
    oneDNN) stay as they are, and run as in the model given.

    `dtype=torch.bfloat16` packs the weights in bfloat16: each product then runs in bfloat16 on the CPU's bfloat16
    units (AMX or AVX512-BF16; a ValueError on a CPU without them), while inputs, outputs, the state dict, embeddings,
    LayerNorm, attention and GELU stay float32 (docs/cpu-inference.md gives its accuracy)."""
    check_dtype(model, dtype)
    return fix_weights(optimize_copy(inference_copy(model, "optimize_for_inference"), dtype))


def check_dtype(model: nn.Module, dtype: torch.dtype, engine: str = "optimize_for_inference") -> None:
    """A ValueError for a dtype the `engine` does not run: not float32 or bfloat16, or bfloat16 on a CPU without
    bfloat16 units, or for a model whose weights are not on the CPU."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{engine}: dtype={dtype} is not supported; use torch.float32 (the default) or torch.bfloat16")
    if dtype == torch.float32:
        return
    if cpu_bf16_units() is None:
        raise ValueError(f"{engine}: dtype=torch.bfloat16 needs a CPU with AMX or AVX512-BF16, and this one has "
                         f"neither ({torch.backends.cpu.get_cpu_capability()}): its bfloat16 products would run slower "
                         "than float32; use dtype=torch.float32 (the default)")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise ValueError(f"{engine}: dtype=torch.bfloat16 is for a model on the CPU, and this one is on "
                         f"{sorted(devices)}; on a GPU run the model under torch.autocast or in bfloat16 itself")


def optimize_copy(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """`optimize_for_inference`'s changes made to `model`, an inference copy, in place, its products in `dtype`; returns
    it."""
    pack_linears(model, dtype)
    encoder = getattr(base_of(model), "encoder", None)
    if encoder is not None and all(map(packed_layer, encoder.layer)):
        fuse_encoder(encoder, [packed_products(layer, dtype) for layer in encoder.layer])
    return model


def packed_layer(layer: nn.Module) -> bool:
    """Whether every product of `layer` is a PackedLinear (not int8, not replaced)."""
    return all(type(linear) is PackedLinear for linear in layer_products(layer))


def refuse_foreign_products(encoder: nn.Module, engine: str, kinds: tuple[type, ...]) -> None:
    """A ValueError naming the first product of the encoder's layers that is not one of `kinds` (a user's wrapper
    around a query, say), whose weights `engine` would read."""
    for i, layer in enumerate(encoder.layer):
        for path, module in zip(LAYER_PRODUCTS, layer_products(layer)):
            if not isinstance(module, kinds):
                raise ValueError(
                    f"model: `encoder.layer.{i}.{path}` is a {type(module).__name__}, not the linear layer {engine} "
                    f"takes there; call {engine} before replacing it, or use optimize_for_inference, which runs such "
                    "a module as it is")
