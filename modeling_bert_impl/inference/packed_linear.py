"""Linear layers on oneDNN's packed weights, for CPU inference models (`optimize_for_inference`).

Where there is no padding to skip (batch 1, dense batches), the encoder's time on CPU is mostly its linear layers, which
`F.linear` runs markedly slower than the same products with their weights laid out once in oneDNN's blocked format
(benchmarks/NOTES.md, "Packed weights and fused layers (`optimize_for_inference`)").
An inference model's weights are fixed when it is made, so each weight is packed once, then: `PackedLinear` holds its
packed copy, and the fused layers (fused_layers.py) call `packed_product` on them. The packed copy costs one more copy
of the weight.

`activation` is applied to the output and `residual` added to it; the residual sum runs inside the same oneDNN call,
and so does the exact (erf) GELU that the feed-forward block's first product asks for, on a CPU with AVX-512
(`fuse_gelu`).
"""

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation

ONEDNN = torch.backends.mkldnn.is_available()
# oneDNN keeps what it builds for each shape of a product in two caches, ideep's (LRU_CACHE_CAPACITY entries) and its
# own primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1,024 each by default: serving calls of many shapes filled them
# to several hundred MB. The engine sets both to CACHE_CAPACITY where the process has not (`bound_onednn_caches`):
# about 50 shapes of a BERT's products kept, the RSS of such a process flat. A shape not kept costs its product's
# setup again (under a millisecond each).
CACHE_CAPACITY = 256
CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


class Frozen:
    """What an inference model computes from, made once at the engine's call and never changed: packed weights (which
    cannot be copied: oneDNN's layout has no storage), compiled programs. A copy of the model shares it."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


def bound_onednn_caches(engine: str, capacity: int = CACHE_CAPACITY) -> None:
    """Set oneDNN's caches to `capacity` entries each where the environment does not size them. Both are sized at
    oneDNN's first use in the process, so the engine does this before its first packed weight (and a server, with its
    own capacity, before the engine): a process that ran oneDNN before keeps the sizes it had. LRU_CACHE_CAPACITY=0 is
    refused with a ValueError: torch's packed and int8 oneDNN products crash the process (SIGSEGV) with ideep's cache
    off, at their first call."""
    if os.environ.get("LRU_CACHE_CAPACITY", "").strip() == "0":
        raise ValueError(f"LRU_CACHE_CAPACITY=0: {engine}'s oneDNN products crash (SIGSEGV, a torch bug) with oneDNN's "
                         f"cache off; unset it ({engine} then keeps {capacity} shapes' products), or set it to a small "
                         "number of entries, before starting Python")
    for name in CACHES:
        os.environ.setdefault(name, str(capacity))


def is_exact_gelu(act) -> bool:
    return act is F.gelu or (type(act) is GELUActivation and act.act is F.gelu)


def fuse_gelu() -> bool:
    """Whether the exact GELU runs inside the product's oneDNN call: on a CPU with AVX-512. oneDNN's AVX2 GELU post-op
    is slower than the product followed by torch's GELU."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def cpu_bf16_units() -> str | None:
    """The CPU's bfloat16 units, "AMX" or "AVX512-BF16", or None where it has neither: there torch runs bfloat16
    products by converting to float32, slower than float32 products themselves."""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    return "AVX512-BF16" if torch.cpu._is_avx512_bf16_supported() else None


def packable_weight(weight: torch.Tensor) -> bool:
    """A float32 CPU weight, with a torch built with oneDNN."""
    return ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32


def untraced_inference() -> bool:
    """No gradient is wanted, no autocast, not traced (`torch.compile` / `torch.export`, and TorchScript's tracer, as
    `torch.onnx.export(dynamo=False)` runs it: its graph would hold oneDNN's own ops)."""
    return not torch.is_grad_enabled() and untraced()


def untraced() -> bool:
    return (not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not torch.is_autocast_enabled("cpu"))


def cpu_inference(x: torch.Tensor) -> bool:
    """x is float32 on CPU, needs no gradient, and nothing traces or autocasts: the packed products may run on it."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad and untraced()


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> Frozen:
    """`weight` (out, in) in `dtype` (float32, or bfloat16 on a CPU with `cpu_bf16_units`) in oneDNN's layout."""
    return Frozen(torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous()))


class PackedWeight(NamedTuple):
    packed: Frozen  # `pack(weight)`
    weight: torch.Tensor  # the parameter it was packed from (a copy of the model holds its own)


def packed_product(x, packed: torch.Tensor, bias, activation=None, residual=None):
    """activation(x W^T + b) (+ residual) with W packed by `pack`. (..., in) -> (..., out)"""
    if packed.dtype != torch.float32:
        return bf16_product(x, packed, bias, activation, residual)
    fused = activation is not None and is_exact_gelu(activation) and fuse_gelu()
    if residual is not None and activation is None:  # the residual sum inside the same oneDNN call
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
    # "gelu" with algorithm "none": oneDNN's erf GELU (not the tanh approximation)
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu" if fused else "none", [], "none" if fused else "")
    y = y if fused or activation is None else activation(y)
    return y if residual is None else y + residual


def bf16_product(x, packed: torch.Tensor, bias, activation=None, residual=None):
    """`packed_product` with W packed in bfloat16: x (float32, or a bfloat16 output of this function) rounded to
    bfloat16 for the product; the bias, activation and residual in float32, and a float32 output. Except where the
    exact GELU runs inside oneDNN's call (`fuse_gelu`): with the bias, in bfloat16, and that bfloat16 output is the
    next product's input as it is (the feed-forward's intermediate, 4H wide, never converted)."""
    low = x.to(packed.dtype)
    if activation is not None and residual is None and is_exact_gelu(activation) and fuse_gelu():
        return torch.ops.mkldnn._linear_pointwise(low, packed, None if bias is None else bias.to(packed.dtype), "gelu",
                                                  [], "none")
    y = torch.ops.mkldnn._linear_pointwise(low, packed, None, "none", [], "").float()
    y = y if bias is None else y + bias
    y = y if activation is None else activation(y)
    return y if residual is None else y + residual


class PackedLinear(nn.Linear):
    """An nn.Linear of an inference model, with its weight packed at the engine's call (`packed`); the product runs on
    it in CPU float32 inference, and as `F.linear` elsewhere (traced, autocast, gradients, another dtype or device, a
    weight parameter replaced). Made by swapping an nn.Linear's class (`pack_linears`): parameters, hooks and tied
    weights stay."""

    packed: PackedWeight

    def forward(self, x):
        packed = self.packed
        if packed.weight is self.weight and cpu_inference(x) and packable_weight(self.weight):
            return packed_product(x, packed.packed.value, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Every plain nn.Linear of `model` with a packable weight becomes a PackedLinear whose products run in `dtype`, in
    place."""
    for module in model.modules():
        if type(module) is nn.Linear and packable_weight(module.weight):
            module.__class__ = PackedLinear
            module.packed = PackedWeight(pack(module.weight, dtype), module.weight)
