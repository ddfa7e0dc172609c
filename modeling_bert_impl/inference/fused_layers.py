"""The encoder's layers in one pass for CPU inference: what ONNX Runtime's fused Attention, SkipLayerNorm and BiasGelu
kernels do for it, in eager PyTorch.

A single short query leaves the products little to do: what costs is Python and the small operations around the
products (a dozen module calls per layer, dropout, transformers' attention wrapper, reshapes), each slower than it
looks because the products before it have streamed the weights through the caches. `fused_layer` is a layer's
arithmetic with less of that: one product for query, key and value (their weights concatenated when the inference
model is made), no module calls, the residual sums inside the products (oneDNN's binary post-op), the GELU inside the
first feed-forward product (on AVX-512: `packed_linear.fuse_gelu`), attention in one call of torch's kernel.

`FusedEncoder` is the encoder of an inference model: it runs its layers that way, on any layout (layouts.py: each
has the attention `kernel` its rows take), wherever that computes what the layers would (CPU float32 inference, the
sdpa or eager implementation, no hidden states, attention maps or cached keys asked for; nothing hooked, replaced or
patched), a dense batch a group of sequences at a time (`fused_encoder`), and calls the layers as modules everywhere
else. Outputs equal the layers' own to float32 rounding (tests/test_serving.py).
"""

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from ..layouts import STANDALONE
from ..modeling_bert_impl import BertImplEncoder
from .anatomy import joined, layer_sites
from .frozen_model import InferenceModule, ModuleTree
from .packed_linear import Frozen, cpu_inference, pack, packed_product

UNMASKED_ATTENTION = ("sdpa", "eager")  # attention implementations whose masks SDPA takes (the layouts' `kernel`)
# Tokens a dense batch's group of sequences may hold on its way through all the layers (`fused_encoder`): a group's
# activations (its feed-forward's 2048 x 1536 floats: 12 MB) and a layer's weights then stay in a 32 MB L3 cache
CHUNK_TOKENS = 2048


class PackedProduct(NamedTuple):
    """activation(x W^T + b) (+ residual) on W packed (packed_linear.pack)."""

    weight: Frozen
    bias: torch.Tensor | None

    def __call__(self, x, activation=None, residual=None):
        return packed_product(x, self.weight.value, self.bias, activation, residual)


class ModuleProduct(NamedTuple):
    """activation(module(x)) (+ residual): a product of a module's own (int8 layers)."""

    module: nn.Module

    def __call__(self, x, activation=None, residual=None):
        y = self.module(x)
        y = y if activation is None else activation(y)
        return y if residual is None else y + residual


class LayerProducts(NamedTuple):
    """A layer's four products: query, key and value in one (..., H) -> (..., 3H), the attention output's, the
    feed-forward's two."""

    qkv: Callable
    out: Callable
    up: Callable
    down: Callable


def packed_products(layer: nn.Module, dtype: torch.dtype = torch.float32) -> LayerProducts:
    """The products of a layer whose linear layers are PackedLinear (packed_linear.py) packed in `dtype`, query, key
    and value concatenated and packed once in it too."""
    (qkv, _), *others = layer_sites(layer)
    weight, bias = joined(qkv)  # (3H, H), (3H,)
    packed = PackedProduct(pack(weight, dtype), bias)
    return LayerProducts(packed, *(PackedProduct(m.packed.packed, m.bias) for (m,), _ in others))


class FusedEncoder(InferenceModule, BertImplEncoder):
    """An inference model's encoder (made by swapping a BertImplEncoder's class, `fuse_encoder`): its layers through
    `fused_encoder` where that computes what they would, as modules elsewhere."""

    products: list[LayerProducts]
    tree: ModuleTree

    def forward(self, hidden_states, attention_mask=None, layout=STANDALONE, output_hidden_states=False,
                **kwargs) -> BaseModelOutput:
        if not self.fusable(hidden_states, layout, output_hidden_states, kwargs):
            return super().forward(hidden_states, attention_mask, layout=layout,
                                   output_hidden_states=output_hidden_states, **kwargs)
        x = fused_encoder(self.layer, layout.enter(hidden_states), self.products, layout, attention_mask)
        return BaseModelOutput(last_hidden_state=layout.leave(x))  # (B, T, H)

    def fusable(self, x, layout, output_hidden_states, kwargs) -> bool:
        """No hidden states, attention maps or cached keys asked for, an attention implementation whose masks the
        layouts' `kernel` takes, CPU float32 inference, and the modules as they were made (`ModuleTree`)."""
        return (not output_hidden_states and not kwargs.get("output_attentions") and layout.cache is None
                and self.config._attn_implementation in UNMASKED_ATTENTION
                and cpu_inference(x) and self.tree.unchanged())


def fuse_encoder(encoder: BertImplEncoder, products: list[LayerProducts]) -> None:
    """Make `encoder` a FusedEncoder running `products` (one LayerProducts per layer), in place."""
    encoder.__class__ = FusedEncoder
    encoder.products = products
    encoder.tree = ModuleTree(encoder)


def group_size(T: int) -> int:
    """How many sequences of T tokens a dense batch's group holds: CHUNK_TOKENS // T, at least one."""
    return max(1, CHUNK_TOKENS // T)


def fused_encoder(layers, x: torch.Tensor, products: list[LayerProducts], layout, attention_mask=None):
    """`fused_layer` of each of `layers` in turn, on the rows of `layout`. A dense batch x (B, T, H) of more than
    CHUNK_TOKENS tokens goes through all of them a group of `group_size(T)` sequences at a time (attention never
    crosses sequences), each product's inputs and outputs staying in the cache."""
    if x.dim() == 3 and attention_mask is None and x.shape[0] > group_size(x.shape[1]):  # (B, T, H) -> groups
        return torch.cat([fused_encoder(layers, part, products, layout) for part in x.split(group_size(x.shape[1]))])
    for layer, layer_products in zip(layers, products):
        x = fused_layer(layer, x, layer_products, layout, attention_mask)
    return x


def fused_layer(layer, x: torch.Tensor, products: LayerProducts, layout, attention_mask=None) -> torch.Tensor:
    """`layer(x, attention_mask, layout=layout)` in inference: x the rows of `layout`, (B, T, H) or (P, H)."""
    attention = layer.attention.self
    qkv = products.qkv(x).unflatten(-1, (3, attention.num_attention_heads, attention.attention_head_size))
    y = layout.kernel(*qkv.unbind(-3), attention_mask, attention.scaling, 0.0).flatten(-2)  # (..., H)
    # the norms' own forward, without the module call (the ModuleTree saw no hooks on them)
    x = layer.attention.output.LayerNorm.forward(products.out(y, residual=x))
    h = products.up(x, layer.intermediate.intermediate_act_fn)
    return layer.output.LayerNorm.forward(products.down(h, residual=x))


def dense_attention(qkv: torch.Tensor, num_heads: int, scaling: float, mask=None) -> torch.Tensor:
    """softmax(q k^T * scaling) v per sequence and head: qkv (B, T, 3H) -> (B, T, H). `mask`: None, a bool mask (True
    where a key is attended) or eager attention's additive one, broadcast to (B, N, T, T)."""
    B, T, H3 = qkv.shape
    q, k, v = qkv.view(B, T, 3, num_heads, H3 // (3 * num_heads)).permute(2, 0, 3, 1, 4)  # each (B, N, T, D)
    if mask is not None and mask.dtype != torch.bool:  # eager's additive mask, as it is
        mask = mask.to(q.dtype)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)  # (B, N, T, D)
    return y.transpose(1, 2).reshape(B, T, H3 // 3)


class QKVAttention(nn.Module):
    """A layer's self-attention (BertImplSelfAttention) as the compiled programs trace it: query, key and value in one
    product (`qkv`, of their weights joined), then `attend(qkv, num_heads, scaling, mask)`: torch's attention
    (`dense_attention`) or the AVX2 kernel's (`avx2_gemm.kernel_attention`). No attention map."""

    def __init__(self, attention: nn.Module, qkv: nn.Module, attend: Callable = dense_attention):
        super().__init__()
        self.qkv, self.attend = qkv, attend
        self.num_heads, self.scaling = attention.num_attention_heads, attention.scaling

    def forward(self, hidden_states, attention_mask=None, **kwargs):  # (B, T, H) -> (B, T, H), None
        return self.attend(self.qkv(hidden_states), self.num_heads, self.scaling, attention_mask), None
