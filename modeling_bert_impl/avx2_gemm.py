"""The float32 program's products on an AVX2 CPU: a C++ kernel of our own, `bert_impl::sgemm` (csrc/sgemm_avx2.cpp).

On an AVX2 CPU (no AVX-512) oneDNN's float32 products are what keeps a short query slower than ONNX Runtime: the 24
products of all-MiniLM-L6-v2 on 16 rows take oneDNN 5.6-6.2 ms, ONNX Runtime's MLAS 3.3-3.7 ms (an AVX2 Zen 3, 2
threads, each engine alone: benchmarks/RESULTS.md, "ninth pass"). The kernel streams each weight once, in the order it
is stored: packed into panels of 16 output columns (`pack`), each 6 rows x 16 columns of the output summed in AVX
registers, the next panel fetched into the cache meanwhile, the panels split over the threads. In a compiled program the
same 24 products took 4.1 ms at 16 rows (before the prefetch; ONNX Runtime 4.4, oneDNN 7.4 in that run) and 22.0 ms at
128 (21.5, 26.8); the whole model answers a 16-token query in 3.66 ms and a 128-token one in 22.93 ms, ONNX Runtime in
4.34 and 24.19 ms (bench_engines.py run X).

`compile_for_inference` runs the float32 encoder's linear layers through it (`kernel_products`) where `chosen`: an
AVX2 CPU on Linux x86-64, the kernel built. It is built once per torch release and source, with the C++ compiler that
inductor uses (which compiling the program needs too: 11-16 s on 2 cores), into inductor's cache directory
(`TORCHINDUCTOR_CACHE_DIR`), and loaded into the process (`load`). A package compiled with it needs it loaded to load:
`compile_for_inference` builds or finds it first. Sums run over the input in order, one float32 FMA at a time: within
1e-5 of F.linear's on the model's outputs (tests/test_avx2_gemm.py).
"""

import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.utils import cpp_extension

from .quantization import encoder_linears

SOURCE = Path(__file__).with_name("csrc") / "sgemm_avx2.cpp"
PANEL = 16  # output columns per panel (the C++ kernel's PANEL)
OP = "bert_impl::sgemm"


def supported() -> bool:
    """An AVX2 CPU (where oneDNN's float32 products were measured slower: on AVX-512 they stay oneDNN's) on Linux
    x86-64."""
    return (sys.platform == "linux" and platform.machine() == "x86_64"
            and torch.backends.cpu.get_cpu_capability() == "AVX2")


def chosen(base: nn.Module) -> bool:
    """Whether the program of `base` (a float32 encoder: an int8 one has no nn.Linear left in its layers) runs its
    products through the kernel: on a `supported` CPU, with the kernel built and loaded."""
    return supported() and bool(encoder_linears(base)) and load() is None


@functools.cache
def load() -> str | None:
    """Build the kernel if it is not in the cache and load it; None when loaded, else why it could not be."""
    try:
        torch.ops.load_library(build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return str(error)
    torch.library.register_fake(OP)(lambda x, packed, bias, out_features: x.new_empty(*x.shape[:-1], out_features))
    return None


def build() -> str:
    """The kernel's shared library in inductor's cache directory, compiled there first if it is not: its name holds a
    hash of the source, the torch release and the flags. Written to a temporary name and renamed, so that processes
    building it at once never load half a file."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    library = cpp_extension.library_paths()[0]
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-I", cpp_extension.include_paths()[0],
             "-L", library, "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{library}"]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, *flags]).encode()).hexdigest()[:20]
    folder = os.path.join(cache_dir(), "bert_impl")
    target = os.path.join(folder, f"sgemm_avx2_{key}.so")
    if not os.path.exists(target):
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            written = os.path.join(scratch, "sgemm_avx2.so")
            compiler = get_cpp_compiler()
            done = subprocess.run([compiler, str(SOURCE), "-o", written, *flags], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} could not build {SOURCE}: {done.stderr.strip()[-2000:]}")
            os.replace(written, target)
    return target


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (panels, in, 16): panel j holds output columns 16j..16j+15, zeros past `out`."""
    out, inp = weight.shape
    panels = -(-out // PANEL)
    padded = weight.new_zeros(panels * PANEL, inp)
    padded[:out] = weight
    return padded.view(panels, PANEL, inp).transpose(1, 2).contiguous()


class KernelLinear(nn.Module):
    """An nn.Linear's product through the kernel, on its weight packed once (a buffer: the program freezes it); its
    parameters are the layer's own, so the program's inputs stay the same."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.out_features = layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        self.register_buffer("packed", pack(layer.weight.detach()), persistent=False)

    def forward(self, x):  # (..., in) -> (..., out)
        return torch.ops.bert_impl.sgemm(x, self.packed, self.bias, self.out_features)


@contextmanager
def kernel_products(base: nn.Module):
    """While tracing the program: every nn.Linear in the encoder's layers replaced by a `KernelLinear`, put back
    after."""
    targets = encoder_linears(base)
    try:
        for parent, name, layer in targets:
            setattr(parent, name, KernelLinear(layer))
        yield
    finally:
        for parent, name, layer in targets:
            setattr(parent, name, layer)
