"""int8 inference on CPU: `quantize_for_inference(model, calibration)`.

Every linear layer of the encoder becomes an `Int8Linear`: weights int8 per output channel (7 bits where the CPU lacks
VNNI: `weight_levels`), activations quantized on each call per token, products accumulated in int32 by
`torch.ops.quantized.linear_dynamic` (oneDNN's kernels, VNNI / AMX, where the CPU has VNNI; FBGEMM's elsewhere:
`engine`). Per token, not per tensor: BERT's hidden states have a few tokens and channels far larger than the rest, and
one scale for a whole batch (as ONNX Runtime's `quantize_dynamic` and torch's legacy `quantize_dynamic` take) drowns the
others: per-tensor int8 of every encoder layer moves some token embeddings far from fp32's. Per token keeps them
close, and closer after SmoothQuant's channel balancing (Xiao et al. 2023): the input's channels are divided by
s_c = max|x_c|^0.5 / max|W_c|^0.5 and the weight's columns multiplied by it, which needs the largest |x_c| each layer
sees, from a few calibration batches of real text (random token ids give worse scales). The weights are rounded by
GPTQ (Frantar et al. 2023, `gptq_round`): column by column, each column's rounding error compensated in the columns not
yet rounded, from the second moments of each layer's inputs on the calibration text, closer again than rounding each
weight to its nearest level, most of all with the 7-bit weights of a CPU without VNNI (benchmarks/NOTES.md, "int8").

How: linear_dynamic quantizes its input with one scale per call; dividing each row by its largest |value| first makes
that one scale a per-token one, and the row's scale multiplies the output back (`Int8Linear.forward`).

Faster still: `compile_for_inference(model)` after quantizing compiles the int8 encoder into one C++ program
(compiled_encoder.py), whose products are inductor's C++ int8 GEMM on CPUs with AVX-512 VNNI, our own int8 kernel on
AVX2 CPUs (avx2_gemm.py: `bert_impl::qgemm`, the same integers), oneDNN's elsewhere, on weights packed at compile time,
with the quantizing and rescaling fused around them (`Int8Linear.forward`'s traced formulation).

The int8 model is an inference model (frozen_model.py): a copy of the model given, which stays float32 and
trainable. Query, key and value are quantized together (one smoothing and one rounding of their concatenated weight,
as they share their input) into three `Int8Linear` layers under their own names, and the fused encoder runs them as one
product (fused_layers.py); the heads and the pooler stay float32, on packed weights. Each Int8Linear holds its int8
weight twice (packed for the kernel, plain for tracing): half the float32 weight's size in all.
"""

import warnings

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)
import torch.nn.functional as F
from torch import nn

from .anatomy import encoder_linears, joined, layer_sites
from .frozen_model import fix_weights, inference_copy
from .fused_layers import LayerProducts, ModuleProduct, fuse_encoder
from .packed_linear import pack_linears, untraced_inference
from .serving import base_of, refuse_foreign_products

DECOMPOSED = torch.ops.quantized_decomposed
ROWS_UINT8 = (1 / 127, 128, 0, 255, torch.uint8)  # scale, zero point, range, dtype: [-1, 1] in 255 steps
DAMP = 0.01  # GPTQ's damping of the input moments, a fraction of their mean diagonal
GPTQ_BLOCK = 128  # columns GPTQ rounds before passing their errors on to the rest in one product
ALPHA = 0.5  # SmoothQuant's migration strength: how much of an input channel's range moves into the weight


def engine() -> str:
    """The int8 kernels of the eager path: oneDNN's where the CPU has VNNI, FBGEMM's elsewhere, whose AVX2 products are
    faster than oneDNN's there and as accurate (benchmarks/NOTES.md, "int8")."""
    if torch.cpu._is_vnni_supported() or "fbgemm" not in torch.backends.quantized.supported_engines:
        return "onednn"
    return "fbgemm"


def weight_levels() -> int:
    """The largest |int8 weight|: 127 where the CPU has VNNI (its int8 products accumulate in int32), 63 elsewhere.

    Without VNNI (AVX2, AVX-512 before Cascade Lake) oneDNN's and FBGEMM's int8 products add each pair of uint8 x int8
    products in int16 (vpmaddubsw), which saturates: 255 x 127 x 2 > 32767, moving token embeddings far from float32's.
    Weights of 7 bits keep every pair sum in range (255 x 63 x 2 = 32130) (benchmarks/NOTES.md, "int8")."""
    return 127 if torch.cpu._is_vnni_supported() else 63


def gptq_round(w: torch.Tensor, scale: torch.Tensor, moments: torch.Tensor, levels: int) -> torch.Tensor:
    """w / scale rounded to integers in [-levels, levels] so that x w^T stays closest to float32's on inputs x whose
    second moments x^T x are `moments`: GPTQ (Frantar et al. 2023). One column at a time, each column's rounding error
    is spread over the columns not yet rounded through the inverse of the moments (damped by DAMP of their mean
    diagonal); the columns after a block of GPTQ_BLOCK take a block's errors in one product.
    w (out, in), scale (out,), moments (in, in) -> (out, in) int8."""
    n = len(moments)
    h = moments.double() + DAMP * moments.diagonal().mean().clamp_min(1e-12) * torch.eye(n, dtype=torch.double)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # (in, in)
    w, scale = w.double().T.contiguous(), scale.double()  # (in, out): a column of w is a row here
    q = torch.empty_like(w)
    for start in range(0, n, GPTQ_BLOCK):
        end = min(start + GPTQ_BLOCK, n)
        errors = torch.empty(end - start, w.shape[1], dtype=torch.double)  # (block, out)
        for i in range(start, end):
            q[i] = (w[i] / scale).round_().clamp_(-levels, levels)
            errors[i - start] = (w[i] - q[i] * scale) / u[i, i]
            w[i + 1:end] -= u[i, i + 1:end, None] * errors[i - start]
        w[end:] -= u[start:end, end:].T @ errors
    return q.T.to(torch.int8)


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 (per output channel), x int8 per token (quantized on each call), after dividing x's
    channels by `smooth` (W's columns multiplied by it when it was quantized: `quantize`).

    Two formulations of the product, one per caller: in eager inference, the dynamic kernel (`engine`'s)
    (`quantized.linear_dynamic` on a packed weight; it quantizes and dequantizes inside, the fastest eager route);
    traced (`torch.export`, `torch.compile`, `compile_for_inference`), the rows quantized to uint8 and the weight
    dequantized as `quantized_decomposed` operations around a float product: the pattern PyTorch's own int8 programs
    have, which inductor turns into an int8 product on a weight packed at compile time (oneDNN's, or its own C++ GEMM
    template: compiled_encoder.gemm_configs; the packed weight of the eager kernel is an opaque object `torch.export`
    refuses). Both use the same int8 weight; the activations round slightly differently (the kernel: uint8 steps over
    the call's range; traced: steps of 1/127).

    weight_int8 (out, in) int8, scale (out,) the weight's steps, inv_smooth (in,) 1 / the smoothing scales, bias (out,).
    """

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, inv_smooth: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        weight_int8 = weight_int8.contiguous()  # (gptq_round's is a transposed view; inductor reads it as contiguous)
        zero_point = torch.zeros_like(scale, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated as a user-facing type; the ops are not
            warnings.simplefilter("ignore")
            q = torch._make_per_channel_quantized_tensor(weight_int8, scale.double(), zero_point, 0)
            previous, torch.backends.quantized.engine = torch.backends.quantized.engine, engine()
            try:  # in a tuple: torch.export refuses modules holding the packed weight's opaque object as an attribute
                self._packed = (torch.ops.quantized.linear_prepack(q, None),)
            finally:
                torch.backends.quantized.engine = previous
        self.register_buffer("inv_smooth", inv_smooth, persistent=False)  # (in,)
        self.register_buffer("bias", bias, persistent=False)  # (out,)
        self.register_buffer("weight_int8", weight_int8, persistent=False)  # (out, in)
        self.register_buffer("scale", scale.float(), persistent=False)  # (out,)
        self.register_buffer("zero_point", zero_point, persistent=False)  # (out,)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, input_max: torch.Tensor, alpha: float = ALPHA,
                 input_moments: torch.Tensor | None = None) -> "Int8Linear":
        """The int8 layer of a float32 one (weight (out, in), bias (out,) or None), its inputs' largest |x_c| being
        `input_max` (in,): SmoothQuant's scales, then W rounded by `gptq_round` where `input_moments` (the calibration
        inputs' x^T x, (in, in)) are given, else to the nearest level."""
        w = weight.detach().float()  # (out, in)
        smooth = input_max.float().clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)  # (in,)
        bias = bias.detach().float() if bias is not None else torch.zeros(w.shape[0])
        w = w * smooth
        scale = (w.abs().amax(1).clamp_min(1e-12) / weight_levels()).double()  # (out,)
        if input_moments is None:  # to the nearest level
            q = (w / scale[:, None]).round().clamp(-weight_levels(), weight_levels()).to(torch.int8)
        else:  # the moments of the smoothed inputs
            q = gptq_round(w, scale, input_moments / (smooth[:, None] * smooth[None, :]), weight_levels())
        return cls(q, scale.float(), 1 / smooth, bias)

    @classmethod
    def concat(cls, layers: list["Int8Linear"]) -> "Int8Linear":
        """One layer computing `layers` (of one input and the same smoothing) side by side: (..., in) -> (..., sum of
        their out)."""
        return cls(torch.cat([m.weight_int8 for m in layers]), torch.cat([m.scale for m in layers]),
                   layers[0].inv_smooth, torch.cat([m.bias for m in layers]))

    def split(self, sizes: list[int]) -> list["Int8Linear"]:
        """The layer cut along its outputs into layers of `sizes` outputs each; `concat`'s inverse."""
        parts = zip(*(t.split(sizes) for t in (self.weight_int8, self.scale, self.bias)))
        return [Int8Linear(w, s.contiguous(), self.inv_smooth, b.contiguous()) for w, s, b in parts]

    def forward(self, x):  # (..., in) float32 -> (..., out)
        x = x * self.inv_smooth
        # abs().amax(), not vector_norm(inf), the slower reduction here (benchmarks/NOTES.md, "int8")
        row_max = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)  # (..., 1)
        x = x / row_max  # rows in [-1, 1]: one scale per call fits every token
        if untraced_inference():
            # a row holding a NaN or an inf (its row_max NaN or inf) is zeroed for the kernel, whose one range over the
            # call would otherwise have no ends: its output is NaN through row_max, the other rows' are untouched
            y = torch.ops.quantized.linear_dynamic(x.nan_to_num_(0.0, 0.0, 0.0), self._packed[0], False)
        else:
            x = DECOMPOSED.dequantize_per_tensor(DECOMPOSED.quantize_per_tensor(x, *ROWS_UINT8), *ROWS_UINT8)
            w = DECOMPOSED.dequantize_per_channel(self.weight_int8, self.scale, self.zero_point, 0, -128, 127,
                                                  torch.int8)
            y = F.linear(x, w)
        return torch.addcmul(self.bias, y, row_max)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@torch.no_grad()
def quantize_for_inference(model: nn.Module, calibration) -> nn.Module:
    """An int8 inference model of `model` (any bert-impl head, on CPU in float32; the model itself is not changed).

    `calibration`: an iterable of model inputs (dicts as a tokenizer returns them, e.g. `tokenizer(texts,
    padding=True, return_tensors="pt")`) of real text like the model will see; a few hundred sentences are plenty. The
    copy runs on them once, in float32, to find each product's input range and second moments (for `gptq_round`; they
    take in x in floats per product until its weight is rounded: 67 MB for all-MiniLM-L6-v2, 0.54 GB for BERT-base).
    The rest of the model gets `optimize_for_inference`'s packed weights."""
    frozen = inference_copy(model, "quantize_for_inference")
    encoder = getattr(base_of(frozen), "encoder", None)
    targets = encoder_linears(encoder) if encoder is not None else []
    if not targets:
        raise ValueError(f"model: {type(model).__name__} has no encoder linear layers to quantize")
    refuse_foreign_products(encoder, "quantize_for_inference", (nn.Linear,))
    if any(layer.weight.device.type != "cpu" or layer.weight.dtype != torch.float32 for _, _, layer in targets):
        raise ValueError("model: int8 inference runs on CPU in float32; move the model with `.float().cpu()` first")
    sites = [site for layer in encoder.layer for site in layer_sites(layer)]
    input_max, moments = calibrate(frozen, [linears[0] for linears, _ in sites], calibration)
    products = []
    for linears, places in sites:
        first = linears[0]
        weight, bias = joined(linears)
        joint = Int8Linear.quantize(weight, bias, input_max[first], input_moments=moments.pop(first))
        parts = joint.split([m.out_features for m in linears]) if len(linears) > 1 else [joint]
        for (parent, name), part in zip(places, parts):
            setattr(parent, name, part)
        products.append(ModuleProduct(joint if len(linears) > 1 else parts[0]))
    pack_linears(frozen.eval())  # the new layers in eval mode too; the pooler and the heads packed
    fuse_encoder(encoder, [LayerProducts(*products[i:i + 4]) for i in range(0, len(products), 4)])
    return fix_weights(frozen)


def calibrate(model: nn.Module, layers: list[nn.Module], calibration) -> tuple[dict, dict]:
    """Run `model` on the calibration inputs, recording for each of `layers` its inputs' largest |x_c| (in,) and
    second moments x^T x (in, in)."""
    input_max, moments = {}, {}

    def record(layer, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1])  # (rows, in)
        largest = x.abs().amax(0)  # (in,)
        input_max[layer] = largest if layer not in input_max else torch.maximum(input_max[layer], largest)
        moments[layer] = x.T @ x if layer not in moments else moments[layer].addmm_(x.T, x)  # (in, in)

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        for inputs in calibration:
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    if len(input_max) != len(layers):
        raise ValueError("calibration: no batches, or batches that did not reach every encoder layer")
    return input_max, moments
