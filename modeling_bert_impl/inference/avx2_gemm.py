"""The program's products and attention on an AVX2 CPU: C++ kernels of our own, `bert_impl::sgemm`, `qgemm` and
`attention` (csrc/sgemm_avx2.cpp).

On an AVX2 CPU (no AVX-512) oneDNN's float32 products are what keeps a short query slower than ONNX Runtime, whose
MLAS products take well under their time on few rows. The kernel streams each weight once, in the order it is stored:
packed into panels of 16 output columns (`pack`), each 6 rows x 16 columns of the output summed in AVX registers, the
next panel fetched into the cache meanwhile, the threads taking the panels one at a time (a core slowed by another
process takes fewer). In a compiled program, with the GELU in the product and the work shared, the whole model answers
short and 128-token queries faster than ONNX Runtime there (benchmarks/NOTES.md, "The AVX2 program's kernels").

int8 (`quantize_for_inference`): `bert_impl::qgemm` computes `Int8Linear`'s whole traced formulation, its product in
integers (`KernelInt8Linear`). Each row is scaled by the smoothing scales, divided by its largest magnitude and
quantized to uint8 as the formulation's quantize_per_tensor does, in one pass with the same float32 steps; the int8
weight is packed in panels of 16 columns x 4 inputs (`pack_int8`). vpmaddubsw adds pairs of uint8 x int8 products in
int16, which the 7-bit weights of a CPU without VNNI keep in range (`quantization.weight_levels`), and vpmaddwd sums the
pairs into int32 (one row's step in assembly: `qstep`); the row's scale and the bias are applied to the sums in
registers. It replaces oneDNN's non-VNNI int8 product, which repacked its weight on every call, and inductor's passes
over memory around it: with it the int8 program overtook ONNX Runtime's int8 on short queries, 128-token queries and
dense batches (benchmarks/NOTES.md, "The AVX2 program's kernels").

Attention (`bert_impl::attention`, float32 and int8 programs alike): softmax(q k^T * scaling) v of each head on the
fused q, k, v product as it comes, its two products by sgemm's blocks over k and v packed in panels, each row's softmax
in between (Cephes' exp, 8 at a time): at batch 1 faster than torch's CPU flash attention (SDPA), most of all on short
queries.

`compile_for_inference` runs the encoder's linear layers (and the pooler's) and attention through them
(`kernel_modules`) where `chosen`: an AVX2 CPU on Linux x86-64, the kernels built (and, for int8, weights of 7 bits);
on an AVX-512 CPU, the attention alone (`attention_chosen`), faster there too than torch's.
They are built once per torch release and source, with the C++ compiler that inductor uses (which compiling the program
needs too), into inductor's cache directory (`TORCHINDUCTOR_CACHE_DIR`), and loaded into the
process (`load`). A package compiled with them needs them loaded to load: `compile_for_inference` builds or finds them
first. A float32 feed-forward's exact GELU is taken in its first product's store (`gelu8`: a rational approximation of
erf, the GELU within 2.2e-7 max(1, |x|) of float64's; cheaper than inductor's loop after the product). sgemm's sums
run over the input in order, one float32 FMA at a time, qgemm's are exact integers: the programs' outputs are within
1e-5 of the eager paths' (tests/test_avx2_gemm.py).
"""

import functools
import platform
import subprocess
import sys
from contextlib import contextmanager

import torch
from torch import nn

from . import native
from .anatomy import encoder_linears, joined, layer_sites
from .fused_layers import QKVAttention
from .packed_linear import is_exact_gelu
from .quantization import Int8Linear, weight_levels

SOURCE = native.CSRC / "sgemm_avx2.cpp"
PANEL = 16  # output columns per panel (the C++ kernel's PANEL)
OP = "bert_impl::sgemm"
INT8_OP = "bert_impl::qgemm"
ATTENTION_OP = "bert_impl::attention"
OPS = (OP, INT8_OP, ATTENTION_OP)


def runs_here() -> bool:
    """Linux x86-64 with AVX2 or AVX-512 (which has AVX2 too): where the kernels' code runs."""
    return (sys.platform == "linux" and platform.machine() == "x86_64"
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def supported() -> bool:
    """An AVX2 CPU (where oneDNN's float32 products were measured slower: on AVX-512 they stay oneDNN's) on Linux
    x86-64."""
    return runs_here() and torch.backends.cpu.get_cpu_capability() == "AVX2"


def attention_chosen() -> bool:
    """Whether the programs' attention runs through the kernel's (`bert_impl::attention`): wherever its code runs
    (`runs_here`) and it is built and loaded, on AVX-512 CPUs too, whose products stay oneDNN's and inductor's: faster
    there as well than torch's CPU flash attention (SDPA) at BERT's head sizes, on single queries and batches, and the
    int8 programs faster with it on mixed batches (benchmarks/NOTES.md, "Attention in the programs on AVX-512")."""
    return runs_here() and load() is None


def chosen(base: nn.Module) -> bool:
    """Whether the program of `base` runs its encoder products and attention through the kernels: on a `supported`
    CPU, with the kernels built and loaded; float32 layers through `sgemm`, int8 ones (`quantize_for_inference`)
    through `qgemm` where their weights have 7 bits (`weight_levels`: the CPU has no VNNI, as an AVX2 one has not)."""
    int8 = encoder_linears(base.encoder, Int8Linear)
    if not supported() or not (encoder_linears(base.encoder) or int8) or (int8 and weight_levels() != 63):
        return False
    return load() is None


@functools.cache
def load() -> str | None:
    """Build the kernels if they are not in the cache and load them; None when loaded, else why they could not be."""
    try:
        torch.ops.load_library(build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return str(error)
    torch.library.register_fake(OP)(lambda x, packed, bias, out_features, gelu=False:
                                    x.new_empty(*x.shape[:-1], out_features))
    torch.library.register_fake(INT8_OP)(lambda x, smooth, packed, sums, scale, bias, out_features:
                                         x.new_empty(*x.shape[:-1], out_features))
    torch.library.register_fake(ATTENTION_OP)(lambda qkv, keep, heads, scaling:
                                              qkv.new_empty(*qkv.shape[:-1], qkv.shape[-1] // 3))
    return None


def build() -> str:
    """The kernels' shared library (`native.build`)."""
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++20", *native.torch_flags("torch_cpu", "c10")]
    return native.build(SOURCE, flags)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (panels, in, 16): panel j holds output columns 16j..16j+15, zeros past `out`."""
    out, inp = weight.shape
    panels = -(-out // PANEL)
    padded = weight.new_zeros(panels * PANEL, inp)
    padded[:out] = weight
    return padded.view(panels, PANEL, inp).transpose(1, 2).contiguous()


class KernelLinear(nn.Module):
    """A float32 product through the kernel, on its weight (out, in) packed once (a buffer: the program freezes it),
    the exact GELU taken of it where `gelu`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False):
        super().__init__()
        self.out_features, self.gelu = weight.shape[0], gelu
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.register_buffer("packed", pack(weight.detach()), persistent=False)

    @classmethod
    def of(cls, layers: list[nn.Linear], gelu: bool = False) -> "KernelLinear":
        """The product of `layers` (of one input) side by side: their weights and biases concatenated."""
        return cls(*joined(layers), gelu)

    def forward(self, x):  # (..., in) -> (..., out)
        return torch.ops.bert_impl.sgemm(x, self.packed, self.bias, self.out_features, self.gelu)


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) int8 -> (panels, ceil(in / 4), 16, 4): panel j holds output columns 16j..16j+15, each column's 4
    consecutive weights side by side; zeros past `out` and `in`."""
    out, inp = weight.shape
    panels, fours = -(-out // PANEL), -(-inp // 4)
    padded = weight.new_zeros(panels * PANEL, fours * 4)
    padded[:out, :inp] = weight
    return padded.view(panels, PANEL, fours, 4).permute(0, 2, 1, 3).contiguous()


class KernelInt8Linear(nn.Module):
    """An Int8Linear's forward through the kernel (`qgemm`: the traced formulation's steps, its product in integers, the
    row scaling and bias around it in the same loops), on its int8 weight packed once."""

    def __init__(self, layer: Int8Linear):
        super().__init__()
        self.out_features = layer.out_features
        for name in ("inv_smooth", "bias", "scale"):
            self.register_buffer(name, getattr(layer, name), persistent=False)
        self.register_buffer("packed", pack_int8(layer.weight_int8), persistent=False)
        self.register_buffer("column_sums", layer.weight_int8.sum(1, dtype=torch.int32), persistent=False)

    def forward(self, x):  # (..., in) float32 -> (..., out)
        return torch.ops.bert_impl.qgemm(x, self.inv_smooth, self.packed, self.column_sums, self.scale, self.bias,
                                         self.out_features)


def kernel_attention(qkv: torch.Tensor, num_heads: int, scaling: float, mask=None) -> torch.Tensor:
    """softmax(q k^T * scaling) v through the kernel (`bert_impl::attention`), `dense_attention`'s arguments: qkv
    (B, T, 3H) -> (B, T, H)."""
    if mask is not None and mask.dtype != torch.bool:  # eager attention's additive mask: 0 where a key is kept
        mask = mask == 0
    return torch.ops.bert_impl.attention(qkv, mask, num_heads, scaling)


def kernel_product(layers: list[nn.Module], gelu: bool = False) -> nn.Module:
    """The kernel's product of `layers` (one input; nn.Linear or Int8Linear) side by side."""
    if isinstance(layers[0], Int8Linear):
        return KernelInt8Linear(Int8Linear.concat(layers) if len(layers) > 1 else layers[0])
    return KernelLinear.of(layers, gelu)


@contextmanager
def kernel_modules(base: nn.Module):
    """While tracing the program: in each layer, the self-attention replaced by a `QKVAttention` with the kernel's
    attention on the kernel's one product of query, key and value, and the other linear layers by the kernel's products
    (`kernel_product`), the feed-forward's exact GELU taken in its first product's (the activation then an identity);
    the pooler's product too (faster than oneDNN's there as well). Put back after."""
    targets = []
    for layer in base.encoder.layer:
        (qkv, _), (out, [out_at]), (up, [up_at]), (down, [down_at]) = layer_sites(layer)
        gelu = isinstance(up[0], nn.Linear) and is_exact_gelu(layer.intermediate.intermediate_act_fn)
        attention = QKVAttention(layer.attention.self, kernel_product(qkv), kernel_attention)
        targets += [(layer.attention, "self", attention), (*out_at, kernel_product(out)),
                    (*up_at, kernel_product(up, gelu)), (*down_at, kernel_product(down))]
        targets += [(layer.intermediate, "intermediate_act_fn", nn.Identity())] if gelu else []
    if base.pooler is not None and isinstance(base.pooler.dense, nn.Linear):
        targets.append((base.pooler, "dense", kernel_product([base.pooler.dense])))
    with swapped(targets):
        yield


@contextmanager
def swapped(targets: list[tuple[nn.Module, str, nn.Module]]):
    """Each (parent, name, module): `module` set as parent's child `name` while the block runs, the original back
    after."""
    originals = [(parent, name, getattr(parent, name)) for parent, name, _ in targets]
    try:
        for parent, name, module in targets:
            setattr(parent, name, module)
        yield
    finally:
        for parent, name, module in reversed(originals):
            setattr(parent, name, module)
