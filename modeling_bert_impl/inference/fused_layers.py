"""The encoder's layers in one pass for CPU inference: what ONNX Runtime's fused Attention, SkipLayerNorm and BiasGelu
kernels do for it, in eager PyTorch.

A single short query leaves the products little to do: at batch 1 x 16 tokens, all-MiniLM-L6-v2's 24 products take 2.9
ms back to back, and the layers called as modules took 5.7 ms in all. The rest was Python and small operations around
the products (a dozen module calls per layer, dropout, transformers' attention wrapper, reshapes, a check per product
that its packed weight is current), each slower than it looks because the products before it have streamed the weights
through the caches. `fused_layer` is a layer's arithmetic with less of that: no module calls but those of replaced
linear layers, the residual sums inside the products (oneDNN's binary post-op), the GELU inside the first feed-forward
product (on AVX-512: `packed_linear.fuse_gelu`), attention in one call of torch's kernel, and the packed weights of all
layers checked at once (`packed_weights`): 5.2 ms for that query, benchmarks/RESULTS.md. BertImplModel runs its layers
through it where that cannot change anything (`fused_weights`), a dense batch a group of sequences at a time
(`fused_encoder`); outputs equal the layers' own to float32 rounding (tests/test_serving.py)."""

import torch
import torch.nn.functional as F

from .packed_linear import cpu_inference, global_hooks, linear, packable_weight, packed_product, packed_weights, plain

UNMASKED_ATTENTION = ("sdpa", "eager")  # attention implementations whose arithmetic, with no mask, is softmax(q k^T) v
# Tokens a dense batch's group of sequences may hold on its way through all the layers (`fused_encoder`): a group's
# activations (its feed-forward's 2048 x 1536 floats: 12 MB) and a layer's weights then stay in a 32 MB L3 cache
CHUNK_TOKENS = 2048


def fused_weights(x: torch.Tensor, layers, attn_implementation: str) -> list[list] | None:
    """None where `fused_layer` may not run `layers` (BertImplLayer modules) on x; else, for each layer, the packed
    weights of its qkv, out, up and down products (None for one that `linear()` must call: observed, replaced).

    It may where x is CPU float32 inference, not traced, the attention implementation's arithmetic is `fused_layer`'s
    (sdpa and eager: softmax(q k^T) v), no global hooks, and every layer gives its `fused_linears` (eval mode,
    nothing observed or replaced but linear layers)."""
    if attn_implementation not in UNMASKED_ATTENTION or not cpu_inference(x) or global_hooks():
        return None
    linears = []
    for layer in layers:
        four = layer.fused_linears()
        if four is None:
            return None
        linears += four
    packable = [plain(m) and packable_weight(m.weight) for m in linears]
    packed = iter(packed_weights([m.weight for m, p in zip(linears, packable) if p]))
    flat = [next(packed) if p else None for p in packable]
    return [flat[i:i + 4] for i in range(0, len(flat), 4)]


def group_size(T: int) -> int:
    """How many sequences of T tokens a dense batch's group holds: CHUNK_TOKENS // T, at least one."""
    return max(1, CHUNK_TOKENS // T)


def fused_encoder(layers, x: torch.Tensor, packed: list[list], layout=None) -> torch.Tensor:
    """`fused_layer` of each of `layers` in turn. A dense batch x (B, T, H) of more than CHUNK_TOKENS tokens goes
    through all of them a group of `group_size(T)` sequences at a time (attention never crosses sequences), each
    product's inputs and outputs staying in the cache: 64 x 128 tokens in 0.84-0.91x the time of one pass, 16 x 512 in
    0.84-0.85x (all-MiniLM-L6-v2 on an AVX2 Zen 3: benchmarks/RESULTS.md, "seventh pass")."""
    if layout is None and x.shape[0] > group_size(x.shape[1]):  # (B, T, H) -> groups (group, T, H)
        return torch.cat([fused_encoder(layers, part, packed) for part in x.split(group_size(x.shape[1]))])
    for layer, weights in zip(layers, packed):
        x = fused_layer(layer, x, weights, layout)
    return x


def fused_layer(layer, x: torch.Tensor, packed: list, layout=None) -> torch.Tensor:
    """`layer(x, None, layout)[0]` in inference: x (B, T, H) with no padding, or (P, H) on an unpadded `layout`;
    `packed` from `fused_weights`."""
    attn, ffn = layer.attn, layer.ffn
    qkv = product(attn.qkv, x, packed[0])  # (..., 3H)
    if layout is None:
        y = dense_attention(qkv, attn.num_heads, attn.scaling)  # (B, T, H)
    else:
        q, k, v = qkv.unflatten(-1, (3, attn.num_heads, attn.head_dim)).unbind(1)  # each (P, N, D)
        y = layout.attend(q, k, v, attn.scaling, 0.0).flatten(-2)  # (P, H)
    # the norms' own forward, without the module call (`fused_linears` saw no hooks on them)
    x = layer.attn_norm.forward(product(attn.out, y, packed[1], residual=x))
    h = product(ffn.up, x, packed[2], ffn.act)
    return layer.ffn_norm.forward(product(ffn.down, h, packed[3], residual=x))


def product(layer, x, packed, activation=None, residual=None):
    """`linear(layer, x, activation, residual)`, with the packed weight given (None: through `linear()`)."""
    if packed is None:
        return linear(layer, x, activation, residual)
    return packed_product(x, packed, layer.bias, activation, residual)


def dense_attention(qkv: torch.Tensor, num_heads: int, scaling: float) -> torch.Tensor:
    """softmax(q k^T * scaling) v per sequence and head, no mask: qkv (B, T, 3H) -> (B, T, H)."""
    B, T, H3 = qkv.shape
    q, k, v = qkv.view(B, T, 3, num_heads, H3 // (3 * num_heads)).permute(2, 0, 3, 1, 4)  # each (B, N, T, D)
    return F.scaled_dot_product_attention(q, k, v, scale=scaling).transpose(1, 2).reshape(B, T, H3 // 3)

