"""avx2_gemm (modeling_bert_impl/inference/avx2_gemm.py): the program's products and attention on an AVX2 CPU through
our C++ kernels, `bert_impl::sgemm` (float32), `bert_impl::qgemm` (int8) and `bert_impl::attention`. Their products are
float64's within float32's rounding on every shape the blocks and panels cut unevenly (qgemm's: the traced int8
formulation's integers exactly), and the attention is float64's within 3 times the error of torch's own float32 SDPA;
programs compiled with them run all the encoder's products (query, key and value as one) and attention through them
with the eager path's outputs;
the layers are put back after the trace; where the kernels cannot be built the program keeps oneDNN's products and
SDPA, and a package that needs them says so when they cannot be loaded.

The kernels are AVX2 code: the module runs where the CPU has AVX2 (AVX-512 CPUs too, where the program would not choose
them on its own), on Linux x86-64. Its programs are of a 2-layer model (20-45 s a compile on 2 cores), shared with
test_compiled.py through conftest: `small_lora_merged_package` without the kernels, and on an AVX2 CPU `small_packages`
and (without VNNI) `small_int8_package` with them; elsewhere it compiles those two itself."""

import platform
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modeling_bert_impl as bi
from modeling_bert_impl.inference import avx2_gemm, quantization
from modeling_bert_impl.inference.fused_layers import QKVAttention
from modeling_bert_impl.inference.packed_linear import PackedLinear, is_exact_gelu
from modeling_bert_impl.inference.quantization import Int8Linear
from modeling_bert_impl.inference.anatomy import encoder_linears
from modeling_bert_impl.modeling_bert_impl import BertImplSelfAttention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import SMALL, needs_tracing, small_ids, small_int8_model, small_model  # noqa: E402

AVX2 = (sys.platform == "linux" and platform.machine() == "x86_64"
        and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
pytestmark = pytest.mark.skipif(not AVX2, reason="the kernel is AVX2 code for Linux x86-64")


@pytest.fixture(scope="module")
def ops():
    why = avx2_gemm.load()
    assert why is None, why  # inductor's C++ compiler builds it (the program needs that compiler as well)
    return torch.ops.bert_impl


def assert_float32_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """y within float32's rounding of x w^T + b summed in float64: K + 1 roundings of at most eps each, relative to
    the sum of the terms' magnitudes."""
    x, w = x.double(), w.double()
    expected = F.linear(x, w, None if b is None else b.double())
    magnitude = F.linear(x.abs(), w.abs(), None if b is None else b.double().abs())
    bound = (w.shape[1] + 1) * torch.finfo(torch.float32).eps * magnitude
    assert y.dtype == torch.float32 and y.shape == expected.shape
    assert ((y.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("M", [1, 5, 6, 7, 13, 16, 130])
@pytest.mark.parametrize("K,N", [(1, 16), (7, 37), (384, 1152), (1536, 384)])
def test_products_are_float64s_within_rounding(ops, M, K, N):
    """Rows in blocks of 6 (and the 1-5 left over), output columns in panels of 16 (37: a last panel of 5)."""
    generator = torch.Generator().manual_seed(M * 1000 + K + N)
    x, w, b = (torch.randn(*shape, generator=generator) for shape in ((M, K), (N, K), (N,)))
    y = ops.sgemm(x, avx2_gemm.pack(w), b, N)
    assert_float32_close(y, x, w, b)
    assert (y - F.linear(x, w, b)).abs().max().item() < 1e-4 * max(1.0, K ** 0.5)


def test_leading_dimensions_strided_inputs_and_no_bias(ops):
    generator = torch.Generator().manual_seed(0)
    wide, w = torch.randn(2, 5, 60, generator=generator), torch.randn(37, 40, generator=generator)
    x = wide[..., 10:50]  # (2, 5, 40), not contiguous
    y = ops.sgemm(x, avx2_gemm.pack(w), None, 37)
    assert y.shape == (2, 5, 37)
    assert_float32_close(y, x, w, None)


def test_gelu_is_float64s_within_its_bound(ops):
    """sgemm's GELU (gelu=True) on every float32 it is likely to meet: through an identity weight (each output its
    input exactly), within 3e-7 max(1, |x|) of the exact (erf) GELU in float64, and on products the same sums as
    without it, then within the two GELUs' bounds of torch's float32 one. Rows of 6 and 5, a last panel of 5."""
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e4, -1e4, 40.0, -40.0])])
    x = F.pad(x, (0, -len(x) % 37)).view(-1, 37)
    y = ops.sgemm(x, avx2_gemm.pack(torch.eye(37)), None, 37, True)
    assert ((y.double() - F.gelu(x.double())).abs() <= 3e-7 * x.double().abs().clamp_min(1)).all()
    generator = torch.Generator().manual_seed(0)
    a, w, b = (torch.randn(*shape, generator=generator) for shape in ((11, 384), (1536, 384), (1536,)))
    z, y = ops.sgemm(a, avx2_gemm.pack(w), b, 1536), ops.sgemm(a, avx2_gemm.pack(w), b, 1536, True)
    assert ((y - F.gelu(z)).abs() <= 4e-7 * z.abs().clamp_min(1)).all()


def kernel_calls(model, op: str = avx2_gemm.OP, **inputs) -> int:
    """How many times the kernel `op` runs in one call of the model (the profiler sees the program's operators)."""
    with torch.no_grad(), torch.profiler.profile() as profile:
        model(**inputs)
    return sum(event.count for event in profile.key_averages() if event.key == op)


def reference_attention(qkv: torch.Tensor, keep: torch.Tensor | None, heads: int, dtype=torch.float64):
    """softmax(q k^T / sqrt(D), keys not kept masked) v by torch's SDPA in `dtype`: (B, T, 3 N D) -> (B, T, N D)."""
    B, T, _ = qkv.shape
    q, k, v = qkv.to(dtype).unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)  # each (B, N, T, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(B, T, -1)


@pytest.mark.parametrize("B,T,heads,D", [(1, 16, 12, 32), (2, 37, 4, 8), (3, 130, 2, 64), (1, 2, 3, 20)])
@pytest.mark.parametrize("mask", ["none", "padding", "random", "additive"])
def test_attention_is_float64s_within_sdpas_rounding(ops, B, T, heads, D, mask):
    """Queries in chunks of 64 and blocks of 6, keys in panels of 16 (37, 130: a last one cut short), head sizes not a
    multiple of 16 (8, 20); keep masks of padded keys (B, 1, 1, T), of random keys per query (B, 1, T, T), and eager
    attention's additive mask (0 or the dtype's minimum) as kernel_attention passes it on."""
    generator = torch.Generator().manual_seed(B * 1000 + T + heads + D)
    qkv = torch.randn(B, T, 3 * heads * D, generator=generator) * 2
    keep = None
    if mask == "padding":
        lengths = torch.randint(1, T + 1, (B,), generator=generator)
        keep = (torch.arange(T) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)
    elif mask in ("random", "additive"):
        keep = torch.rand(B, 1, T, T, generator=generator) < 0.7
        keep[..., 0] = True  # each query keeps a key
    given = keep
    if mask == "additive":
        given = torch.zeros(B, 1, T, T).masked_fill(~keep, torch.finfo(torch.float32).min) == 0
    y = ops.attention(qkv, given, heads, D ** -0.5)
    expected = reference_attention(qkv, keep, heads)
    error = (y.double() - expected).abs().max().item()
    sdpa_error = (reference_attention(qkv, keep, heads, torch.float32).double() - expected).abs().max().item()
    assert y.shape == (B, T, heads * D) and y.dtype == torch.float32
    assert error <= 3 * sdpa_error + 1e-6, (error, sdpa_error)


def test_a_query_that_keeps_no_key_gets_zeros(ops):
    """(the program never asks: a row of padding only takes the eager path) rather than SDPA's NaN."""
    qkv = torch.randn(1, 5, 3 * 2 * 4, generator=torch.Generator().manual_seed(0))
    keep = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    keep[0, 0, 2] = False
    y = ops.attention(qkv, keep, 2, 4 ** -0.5)
    assert (y[0, 2] == 0).all()
    others = [0, 1, 3, 4]
    assert (y[0, others].double() - reference_attention(qkv, None, 2)[0, others]).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def kernel_package(ops, tmp_path_factory, request):
    """A package of the SMALL model compiled with the kernel's products: on an AVX2 CPU, where the kernel is chosen,
    conftest's `small_packages` (test_compiled.py's too)."""
    if avx2_gemm.chosen(small_model()):
        path = request.getfixturevalue("small_packages")[True]
        return bi.compile_for_inference(small_model(), path), path
    path = tmp_path_factory.mktemp("kernel") / "small.pt2"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(avx2_gemm, "supported", lambda: True)  # an AVX-512 CPU runs the AVX2 code too
        model = bi.compile_for_inference(small_model(), path)
    return model, path


@needs_tracing
def test_the_float32_program_runs_every_encoder_product_through_the_kernel(kernel_package):
    """9 products (2 layers x query-key-value in one, attention output, up, down, and the pooler's) and 2 attentions a
    call, the GELU taken in the up product's; the compiled model's layers are its own again after the trace; the
    outputs are the eager path's."""
    model, _ = kernel_package
    hidden = model.config.hidden_size
    with avx2_gemm.kernel_modules(model):
        layers = model.encoder.layer
        assert [(type(layer.intermediate.dense), layer.intermediate.dense.gelu,
                 type(layer.intermediate.intermediate_act_fn)) for layer in layers] == [
            (avx2_gemm.KernelLinear, True, nn.Identity)] * 2
        assert not layers[0].output.dense.gelu and not layers[0].attention.output.dense.gelu
        assert [(type(layer.attention.self), layer.attention.self.attend, layer.attention.self.qkv.out_features)
                for layer in layers] == [(QKVAttention, avx2_gemm.kernel_attention, 3 * hidden)] * 2
    assert all(is_exact_gelu(layer.intermediate.intermediate_act_fn) for layer in model.encoder.layer)
    assert [type(layer) for _, _, layer in encoder_linears(model.encoder)] == [PackedLinear] * 12
    assert [type(layer.attention.self) for layer in model.encoder.layer] == [BertImplSelfAttention] * 2
    assert type(model.pooler.dense) is PackedLinear
    ids = torch.randint(1, SMALL["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
    assert kernel_calls(model, input_ids=ids) == 9
    assert kernel_calls(model, avx2_gemm.ATTENTION_OP, input_ids=ids) == 2
    with torch.no_grad():
        got = model(input_ids=ids)
        encoder, model.compiled_encoder = model.compiled_encoder, None
        expected = model(input_ids=ids)
        model.compiled_encoder = encoder
    for name in ("last_hidden_state", "pooler_output"):
        assert (got[name] - expected[name]).abs().max().item() < 1e-5, name


@needs_tracing
def test_without_the_kernel_the_program_keeps_onednns_products(ops, monkeypatch, small_lora_merged_package):
    """Where the kernels could not be built (`load` says why), no call reaches them (the program of conftest's
    `small_lora_merged_package`, compiled so): oneDNN's products and torch's attention. An int8 model chooses the
    products only where its weights have 7 bits (no VNNI): vpmaddubsw's int16 pair sums would saturate on 8."""
    for op in avx2_gemm.OPS:
        assert kernel_calls(small_lora_merged_package[0], op, input_ids=torch.ones(1, 9, dtype=torch.long)) == 0
    monkeypatch.setattr(avx2_gemm, "supported", lambda: True)
    int8 = int8_model()
    for levels, chosen in ((63, True), (127, False)):
        monkeypatch.setattr(avx2_gemm, "weight_levels", lambda: levels)
        assert avx2_gemm.chosen(int8) == chosen and avx2_gemm.chosen(small_model())


@needs_tracing
def test_the_programs_attention_is_the_kernels_wherever_it_runs(ops, small_packages, small_int8_package):
    """On any CPU the kernels run on (AVX-512 too, whose products stay oneDNN's and inductor's) the float32 and int8
    programs of conftest's packages attend through `bert_impl::attention`, once per layer; our products only where
    `chosen` (an AVX2 CPU)."""
    assert avx2_gemm.attention_chosen()
    model = bi.compile_for_inference(small_model(), small_packages[True])
    int8, _ = small_int8_package
    ids = small_ids(3, seed=4)
    for compiled, product, calls in ((model, avx2_gemm.OP, 9 * avx2_gemm.chosen(small_model())),
                                     (int8, avx2_gemm.INT8_OP, 8 * avx2_gemm.chosen(int8_model()))):
        assert kernel_calls(compiled, avx2_gemm.ATTENTION_OP, input_ids=ids) == 2
        assert kernel_calls(compiled, product, input_ids=ids) == calls


@needs_tracing
def test_a_package_that_needs_the_kernel_says_so(kernel_package, monkeypatch):
    """Loading a package compiled with the kernels, in a process that could not build them, names the package and
    why, before loading it; where the reason is a C++ compiler not on PATH, which one and how to get one."""
    _, path = kernel_package
    monkeypatch.setattr(avx2_gemm, "load", lambda: "g++ could not build it")
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda _: pytest.fail("the package was loaded"))
    with pytest.raises(ValueError, match=rf"{path} calls bert-impl's AVX2 kernels .*could not be \(g\+\+ could not"):
        bi.compile_for_inference(small_model(), path)
    with torch._inductor.config.patch({"cpp.cxx": (None, "no-such-g++")}):
        with pytest.raises(ValueError, match=rf"{path} calls .*compiler, and no-such-g\+\+ is not on PATH: install "
                                             r"it \(e.g. `apt install g\+\+`\).*TORCHINDUCTOR_CACHE_DIR"):
            bi.compile_for_inference(small_model(), path)
        with pytest.raises(ValueError, match=r"compiles with a C\+\+ compiler, and no-such-g\+\+ is not on PATH"):
            bi.compile_for_inference(small_model())


def test_a_compiler_that_fails_is_named(monkeypatch, tmp_path):
    """`build` in an empty cache with a compiler that fails: a RuntimeError with its name and message, nothing left
    in the cache."""
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'no AVX2 here' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch._inductor.cpp_builder, "get_cpp_compiler", lambda: str(compiler))
    with pytest.raises(RuntimeError, match=rf"{compiler} could not build .*sgemm_avx2.cpp: no AVX2 here"):
        avx2_gemm.build()
    assert list((tmp_path / "cache" / "bert_impl").iterdir()) == []


@pytest.mark.parametrize("M", [1, 3, 4, 5, 13, 130])
@pytest.mark.parametrize("K,N", [(7, 37), (32, 16), (384, 1152), (1536, 384)])
def test_int8_layers_are_the_traced_formulations_in_integers(ops, M, K, N):
    """qgemm's y = b + m (q - 128) W^T * scale / 127, q = round(127 x s / m) + 128 (x s, then / m, then * 127 in
    float32; to even, as the traced formulation's quantize_per_tensor rounds), m = max |x s|, against the same sum in
    float64: exact integers, then at most a few float32 roundings of the terms' magnitudes. Rows in blocks of 4 and the
    1-3 left, inputs 32 at a time and the rest, K not a multiple of 4."""
    generator = torch.Generator().manual_seed(M * 1000 + K + N)
    x = torch.randn(M, K, generator=generator) * 3
    smooth = torch.rand(K, generator=generator) + 0.5
    w = torch.randint(-63, 64, (N, K), generator=generator, dtype=torch.int8)
    scale, bias = torch.rand(N, generator=generator) / 100, torch.randn(N, generator=generator)
    y = ops.qgemm(x, smooth, avx2_gemm.pack_int8(w), w.sum(1, dtype=torch.int32), scale, bias, N)
    v = x * smooth
    m = v.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    q = torch.round(v / m * 127).double()  # q - 128
    expected = q @ w.double().T * scale.double() / 127 * m.double() + bias.double()
    magnitude = q.abs() @ w.double().abs().T * scale.double() / 127 * m.double() + bias.double().abs()
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert ((y.double() - expected).abs() <= 4 * torch.finfo(torch.float32).eps * magnitude).all()


@pytest.mark.parametrize("K", [40, 43])
def test_a_nan_or_inf_in_one_row_stays_in_that_row(ops, K):
    """qgemm quantizes each row on its own: a row holding a NaN (in the 8-wide steps or in the tail of the row) gives
    NaN outputs (as the traced formulation does: its row maximum is NaN), one holding an inf no finite output (its row
    maximum is inf; the next LayerNorm makes them NaN), the other rows what they give alone."""
    generator = torch.Generator().manual_seed(K)
    x = torch.randn(6, K, generator=generator)
    smooth = torch.rand(K, generator=generator) + 0.5
    w = torch.randint(-63, 64, (24, K), generator=generator, dtype=torch.int8)
    scale, bias = torch.rand(24, generator=generator) / 100, torch.randn(24, generator=generator)
    qgemm = lambda x: ops.qgemm(x, smooth, avx2_gemm.pack_int8(w), w.sum(1, dtype=torch.int32), scale, bias, 24)  # noqa
    bad = x.clone()
    bad[0, 3], bad[2, K - 1], bad[4, 5] = float("nan"), float("nan"), float("inf")
    got, alone = qgemm(bad), qgemm(x[[1, 3, 5]])
    assert got[[0, 2]].isnan().all() and not got[4].isfinite().any()
    assert torch.equal(got[[1, 3, 5]], alone)


def int8_model() -> bi.BertImplModel:  # the SMALL encoder of small_model(0)'s weights in int8 (calibration seed 3)
    return small_int8_model(small_model(0).state_dict(), seed=3)


@pytest.fixture
def int8_package(request, tmp_path):
    """An int8 SMALL model with 7-bit weights compiled through the kernel: on an AVX2 CPU without VNNI, where that is
    the CPU's own choice, conftest's `small_int8_package` (test_compiled.py's); elsewhere one compiled here as if."""
    if avx2_gemm.chosen(int8_model()):
        return request.getfixturevalue("small_int8_package")[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(avx2_gemm, "supported", lambda: True)
        patch.setattr(quantization, "weight_levels", lambda: 63)  # as on a CPU without VNNI
        patch.setattr(avx2_gemm, "weight_levels", lambda: 63)
        return bi.compile_for_inference(int8_model(), tmp_path / "int8.pt2")


@needs_tracing
def test_the_int8_program_runs_every_encoder_product_through_the_kernel(ops, int8_package):
    """An int8 model with 7-bit weights: 8 qgemm calls a call (query, key and value in one product of their int8
    weights concatenated), Int8Linear layers again after the trace, and the
    outputs of the traced formulation run eagerly (the same integers, summed in floats there)."""
    model = int8_package
    assert [type(layer) for _, _, layer in encoder_linears(model.encoder, Int8Linear)] == [Int8Linear] * 12
    ids = small_ids(3, seed=4)
    with torch.no_grad(), torch.profiler.profile() as profile:
        got = model(input_ids=ids)
    assert sum(event.count for event in profile.key_averages() if event.key == avx2_gemm.INT8_OP) == 8
    encoder, model.compiled_encoder = model.compiled_encoder, None
    expected = model(input_ids=ids)  # gradients on: the traced formulation, eagerly
    model.compiled_encoder = encoder
    for name in ("last_hidden_state", "pooler_output"):
        assert (got[name] - expected[name].detach()).abs().max().item() < 1e-5, name
