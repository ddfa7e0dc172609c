"""The model compiled ahead of time for CPU inference: `compile_for_inference(model, package_path)`.

A single short query is where eager PyTorch loses to ONNX Runtime: the products are small, and the dozen other
operations of each layer, each dispatched from Python, cost as much again even on the fused path (fused_layers.py).
`compile_for_inference` exports the encoder's forward on a batch and its attention mask (`torch.export`, batch and
length dynamic: embeddings, layers, pooler) and compiles it with AOTInductor into a package (.pt2): one C++ program with
the weights frozen in oneDNN's layout (on an AVX2 CPU: in the panels of our own product and attention kernels,
avx2_gemm.py, faster there than oneDNN's and SDPA; on AVX-512, our attention kernel alone, faster than SDPA there too),
the small operations fused into loops, no Python between them.
The inference model it returns (a copy of the model given, with `optimize_for_inference`'s packed weights and fused
layers: frozen_model.py) runs that program wherever the result is the same (`program_inputs`, the one place that
decides): a batch without padding in one run (above 2,048 tokens, one per group of sequences: `dense`); one query
padded to a fixed length on its real tokens; with an int8 model a padded batch too, as the eager path lays it out
(the bucketed layout, layouts.py): its sequences sorted by length and cut into groups padded to their longest, one run
per group, so that the products skip nearly all the padding. The heads run on its outputs as before, and everything
else (float32's padded batches of several rows, whose eager path is as fast; hidden states or
attention maps asked for, packed batches, inputs that need gradients, hooks or replaced modules) stays the eager path,
`optimize_for_inference`'s.
An int8 model (`quantize_for_inference`) compiles too, its products inductor's own C++ int8 GEMM in the program on a
CPU with AVX-512 VNNI (`INT8_CONFIGS`), our int8 kernel on an AVX2 CPU (avx2_gemm.py), oneDNN's elsewhere: the program
computes `Int8Linear`'s traced formulation, whose activations round a little differently from the eager int8 kernel's
(and, on some shapes, the template's fused quantizing rounds a few differently again).

Opting in, not the default: the compile takes a C++ compiler and tens of seconds (more the first time, to build the
kernels into inductor's cache), and the package, loaded, holds one more copy of the encoder's weights.
Compile once, keep the package, and load it in the serving processes: a `package_path` that exists is loaded, never
written over. A package is executable code (its shared object runs when loaded), so it is read as a zip archive first
(package_file.py): refused, before any of its code runs, where it is damaged (its content against the SHA-256 written
into it at compile time) or was compiled from other weights (a fingerprint of them), with another torch, or for other
vector instructions (its code uses them). A package compiled with our kernels (on Linux x86-64, wherever they could be
built: the attention at least) needs them where it is loaded: built there (the same compiler) or found in the cache.
"""

import functools
import hashlib
import json
import math
import os
import tempfile
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from . import avx2_gemm, native
from ..bert_padding import sequence_starts, unpad_indices
from ..input_checks import require_tracing_torch
from ..layouts import BucketedLayout, first_tokens
from ..modeling_bert_impl import BertImplModel
from .anatomy import joined, layer_sites
from .frozen_model import InferenceModule, ModuleTree, fix_weights, inference_class, inference_copy
from .fused_layers import UNMASKED_ATTENTION, QKVAttention, dense_attention, group_size
from .package_file import read_manifest, write_manifest
from .packed_linear import is_exact_gelu, untraced
from .quantization import Int8Linear
from .serving import base_of, check_dtype, optimize_copy, refuse_foreign_products
from .threads import QueryThreads

FORMAT = "bert-impl compiled model 7"  # what the package's metadata says it holds; a new layout gets a new number


class Program(nn.Module):
    """What the program computes: the model on a batch (B, T) of ids and attention mask -> last hidden state (B, T, H)
    and, with a pooler, the pooled output (B, H)."""

    def __init__(self, base: BertImplModel):
        super().__init__()
        self.base = base

    def forward(self, input_ids, attention_mask, token_type_ids, position_ids):
        return self.base(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, return_dict=False)


def compile_for_inference(model: nn.Module, package_path: str | os.PathLike | None = None,
                          dtype: torch.dtype = torch.float32) -> nn.Module:
    """An inference model of `model` (any bert-impl head, on CPU in float32, or the int8 model
    `quantize_for_inference` made of one; the model itself is not changed) whose encoder runs as a program compiled
    ahead of time, in eval mode, refusing training with a ValueError.

    `package_path`: where the compiled package (.pt2) goes. If it exists it is loaded instead, when it is whole (its
    content matches the SHA-256 written into it) and was compiled from the same weights by the same torch for the same
    CPU instructions (else a ValueError says what is wrong, before any of the package's code runs); None compiles into a
    temporary file, deleted once loaded. A package is executable code, as a pickle is: load only packages you compiled
    or trust (the digest finds damage, not a package someone rewrote). Calls with `input_ids` (batch 1, dense batches,
    at least 2 tokens, at most 64 in all in float32 on an AVX2 CPU: `token_limit`; one padded query; padded batches
    too in an int8 model), no hidden states or attention maps asked for, no labels, inputs that need no gradient, run
    the encoder (embeddings, layers, pooler) as that program (a padded batch once per group of sequences of similar
    length); the heads run as before, and every other call runs `optimize_for_inference`'s path. The weights are the
    model's at this call: changing the model afterwards does not change the inference model (compile again). An int8
    model's program runs `Int8Linear`'s traced formulation.

    `dtype=torch.bfloat16` (a CPU with AMX or AVX512-BF16, as `optimize_for_inference(dtype=torch.bfloat16)`): the
    program's products take their inputs rounded to bfloat16 and bfloat16 weights (`Bf16Product`), everything else in
    float32; the calls it does not run take `optimize_for_inference(dtype=torch.bfloat16)`'s path."""
    require_tracing_torch("compile_for_inference", "or use optimize_for_inference (nothing traced)")
    base = base_of(model)
    if not isinstance(base, BertImplModel):
        raise ValueError(f"model: {type(model).__name__} is not a bert-impl model")
    refuse_foreign_products(base.encoder, "compile_for_inference", (nn.Linear, Int8Linear))
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in base.parameters()):
        raise ValueError("model: compile_for_inference compiles for CPU in float32; move the model with "
                         "`.float().cpu()` first")
    check_dtype(model, dtype, "compile_for_inference")
    if dtype != torch.float32 and int8(base):
        raise ValueError("dtype: an int8 model (quantize_for_inference) compiles with its int8 products; leave dtype "
                         "at torch.float32")
    if base.config._attn_implementation not in UNMASKED_ATTENTION:
        raise ValueError(f"model: attention implementation {base.config._attn_implementation!r} is not compiled; "
                         f"load the model with attn_implementation in {UNMASKED_ATTENTION}")
    metadata = {"format": FORMAT, "torch": torch.__version__, "cpu": cpu_instructions(),
                "fingerprint": fingerprint(base), "dtype": str(dtype).removeprefix("torch.")}
    frozen = optimize_copy(inference_copy(model, "compile_for_inference"), dtype)
    frozen_base = base_of(frozen)
    if package_path is not None and os.path.exists(package_path):
        package_path = os.fspath(package_path)
        manifest = read_manifest(package_path, FORMAT)  # the file checked as a zip archive: none of its code runs
        check_metadata(manifest, metadata, package_path)
        program = load_package(package_path, manifest["kernels"])
    else:
        if (compiler := missing_compiler()) is not None:
            raise ValueError(f"model: compile_for_inference compiles with a C++ compiler, and {compiler} is not on "
                             f"PATH: {INSTALL_COMPILER}; or give package_path a package compiled for this CPU")
        if package_path is None:  # the program, once loaded, needs no file: the package goes with its folder
            with tempfile.TemporaryDirectory(prefix="bert_impl_") as folder:
                program = compile_package(frozen_base, os.path.join(folder, "model.pt2"), metadata, dtype)
        else:
            program = compile_package(frozen_base, os.fspath(package_path), metadata, dtype)
    frozen_base.__class__ = compiled_class(type(frozen_base))
    frozen_base.compiled_encoder = CompiledEncoder(program, frozen_base)
    fix_weights(frozen, native=True)
    frozen_base.program_tree = ModuleTree(frozen_base, native=True)  # its checks in C++ where it is built
    add_single_query(frozen_base)
    return frozen


def check_metadata(found: dict, metadata: dict, package_path: str) -> None:
    """A ValueError naming what differs between a package's metadata and what this call would compile."""
    differs = [key for key, value in metadata.items() if found.get(key) != value]
    if differs:
        what = {"format": "package format", "torch": "torch release", "cpu": "CPU instruction set",
                "fingerprint": "model or weights", "dtype": "precision"}
        raise ValueError(
            f"package_path: {package_path} was compiled from another "
            + " and ".join(what[k] for k in differs)
            + "".join(f" ({k} {found.get(k)!r}, here {metadata[k]!r})" for k in differs if k != "fingerprint")
            + "; give another path, or delete it to compile this model there"
        )


class CompiledBertImplModel(InferenceModule, BertImplModel):
    """The encoder model of `compile_for_inference`'s inference model (made by swapping the class of the copy's
    BertImplModel for `compiled_class` of it): its forward runs the compiled program where it stands in for the model
    (`program_inputs`), the model's own forward elsewhere."""

    # set by compile_for_inference: compiled_encoder (a CompiledEncoder, None to set it aside), program_tree,
    # single_query (`add_single_query`)
    def __call__(self, *args, **kwargs):
        """A single query straight to the program where `single_query` takes it (one look in C++ at the call and at
        everything that could change its answer); every other call through Module's call (the weights' check, hooks,
        `forward`), its arguments as given."""
        query, encoder = self.__dict__.get("single_query"), self.compiled_encoder
        if (query is not None and encoder is not None and not torch.compiler.is_compiling()
                and not torch._C._is_tracing() and not torch.is_autocast_enabled("cpu")
                and (found := query(args, kwargs))):
            inputs, padding = found  # a query padded to a fixed length: its real tokens, the padding around them
            outputs = encoder.query(inputs)
            if padding is not None:  # (1, n, H) -> (1, T, H), zeros at padding as `one_row` puts them
                outputs = [torch.constant_pad_nd(outputs[0], (0, 0, *padding)), *outputs[1:]]
            out = model_output(*outputs)
            return out if config_default(kwargs.get("return_dict"), self.config.return_dict) else out.to_tuple()
        return super().__call__(*args, **kwargs)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                output_attentions=None, output_hidden_states=None, cu_seq_lens_q=None, seq_idx=None,
                label_checks=None, return_dict=None, pool_with=None, **kwargs):
        call = Call(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                    output_hidden_states, cu_seq_lens_q, seq_idx, label_checks, kwargs)
        inputs = self.program_inputs(call)
        if inputs is not None:
            outputs = self.compiled_encoder(*inputs)  # the pooled output too where the model pools
            if pool_with is not None:  # a head's module in place of the pooler (RoBERTa's classification head)
                outputs = [outputs[0], pool_with(first_tokens(outputs[0], first_real_tokens(inputs[1])))]
            out = model_output(*outputs)
            return out if config_default(return_dict, self.config.return_dict) else out.to_tuple()
        if return_dict is not None:
            kwargs["return_dict"] = return_dict
        return super().forward(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                               cu_seq_lens_q=cu_seq_lens_q, seq_idx=seq_idx, label_checks=label_checks,
                               pool_with=pool_with, **kwargs)

    def program_inputs(self, call: "Call") -> tuple | None:
        """Where the program computes what the model would: its inputs, the ids, token types and positions, each
        (B, T) int64, and the batch's real tokens (B, T) bool, None without padding. Elsewhere None, and the eager path
        (`optimize_for_inference`'s) runs: for one of the reasons of `STEP_ASIDE`, read from the call alone, or where
        the values say so (`program_ids`)."""
        if any(reason(self, call) for reason in STEP_ASIDE):
            return None
        return program_ids(self, call)


class Call(NamedTuple):
    """A call of the compiled model's forward, as its eligibility reads it."""

    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    token_type_ids: torch.Tensor | None
    position_ids: torch.Tensor | None
    inputs_embeds: torch.Tensor | None
    output_attentions: bool | None
    output_hidden_states: bool | None
    cu_seq_lens_q: torch.Tensor | None
    seq_idx: torch.Tensor | None
    label_checks: list | None
    kwargs: dict


# Why the eager path runs a call instead of the program, each read from the call and the model alone. Written for few
# Python steps (tensors made once per shape): after the program has streamed the weights through the caches, every
# Python step runs several times slower than in a loop.
def set_aside(model, call: Call) -> bool:
    """The program set aside (`compiled_encoder` None), or the call traced or under autocast."""
    return model.compiled_encoder is None or not untraced()


def other_inputs(model, call: Call) -> bool:
    """Embeddings, a packed batch, or an argument the program does not take (a cache, ...)."""
    return call.inputs_embeds is not None or call.cu_seq_lens_q is not None or call.seq_idx is not None or bool(
        call.kwargs)


def other_outputs(model, call: Call) -> bool:
    """Attention maps or hidden states asked for, which the program does not give; labels, which the eager path
    checks and names."""
    config = model.config
    return bool(config_default(call.output_attentions, config.output_attentions) or call.label_checks
                or config_default(call.output_hidden_states, config.output_hidden_states))


def other_modules(model, call: Call) -> bool:
    """The modules not as compiled: weights converted or moved; modules hooked, replaced, patched or in training mode
    (`ModuleTree`)."""
    weight = model.embeddings.word_embeddings.weight
    return weight.dtype != torch.float32 or weight.device.type != "cpu" or not model.program_tree.unchanged()


def no_cpu_batch(model, call: Call) -> bool:
    """No input_ids, or not a (B, T) batch on the CPU."""
    ids = call.input_ids
    return ids is None or ids.dim() != 2 or ids.device.type != "cpu"


def other_size(model, call: Call) -> bool:
    """A length the program does not take (below 2, past the position table), or more tokens than where it is
    faster (`token_limit`)."""
    B, T = call.input_ids.shape
    encoder = model.compiled_encoder
    return not 2 <= T <= encoder.max_length or B * T > encoder.max_tokens


STEP_ASIDE = (set_aside, other_inputs, other_outputs, other_modules, no_cpu_batch, other_size)


def program_ids(model, call: Call) -> tuple | None:
    """The program's inputs where the values let it compute what the model would: positions of the call's own
    (`batch_positions`) or the model's (`model_positions`), token types or zeros, all (B, T) int64 on the CPU; the
    real tokens of a padded batch (`real_tokens`); every id inside its table (else the eager path names it: the
    program would fail its own check). Else None."""
    B, T = call.input_ids.shape
    encoder = model.compiled_encoder
    positions, zeros, _ = encoder.constants(B, T)
    position_ids = model_positions(model, call, positions) if call.position_ids is None else batch_positions(call, B, T)
    token_type_ids = zeros if call.token_type_ids is None else call.token_type_ids
    ids = (call.input_ids, token_type_ids, position_ids)
    if position_ids is None or token_type_ids.shape != (B, T) or not all(map(CPU_INT64, ids)):
        return None
    found, real = real_tokens(model, call, B, T)
    tables = zip((call.input_ids, call.token_type_ids, call.position_ids), encoder.tables)
    return (ids, real) if found and within_tables([entry for entry in tables if entry[0] is not None]) else None


def model_positions(model, call: Call, positions: torch.Tensor) -> torch.Tensor:
    """The positions the model gives where the call gives none: 0..T-1 ((B, T), made once per shape), or RoBERTa's,
    counted over the ids from padding_idx + 1 (modeling_roberta_impl.py)."""
    embeddings = model.embeddings
    return positions if not embeddings.position_offset else embeddings.positions(call.input_ids, None)


def batch_positions(call: Call, B: int, T: int) -> torch.Tensor | None:
    """The call's position_ids as (B, T); None where their shape is neither (B, T) nor (1, T), or where they restart
    at 0 inside a row without a mask (a packed batch: the eager path runs it)."""
    position_ids = call.position_ids
    if position_ids.shape == (1, T):
        position_ids = position_ids.expand(B, T).contiguous()
    if position_ids.shape != (B, T):
        return None
    packed = call.attention_mask is None and bool(sequence_starts(position_ids.flatten(), None, T).sum() > B)
    return None if packed else position_ids


def real_tokens(model, call: Call, B: int, T: int) -> tuple[bool, torch.Tensor | None]:
    """Whether the program takes the call's mask, and the real tokens (B, T) bool where it has padding (None
    without). Not taken: a mask of another shape or device; one with padding over several rows in a float32 program
    (its eager path is as fast; one row, a query padded to a fixed length, runs the program on its real tokens); a
    value other than 0 and 1 (the eager path refuses it) or a row of padding only."""
    mask, encoder = call.attention_mask, model.compiled_encoder
    if mask is None:
        return True, None
    if mask.shape != (B, T) or mask.device.type != "cpu":
        return False, None
    ones = encoder.constants(B, T)[2]
    if torch.equal(mask, ones if mask.dtype == torch.int64 else ones.to(mask.dtype)):
        return True, None
    real = mask != 0  # (B, T)
    takes = (encoder.padded_batches or B == 1) and torch.equal(mask, real.to(mask.dtype)) and bool(real.any(-1).all())
    return takes, real


def first_real_tokens(real: torch.Tensor | None) -> torch.Tensor | None:
    """Where each row's first real token is in the flattened (B * T) batch (`layouts.first_token_rows`): None for
    position 0 of every row (no padding), else (B,) from the real tokens (B, T) bool."""
    if real is None:
        return None
    return torch.arange(real.shape[0]) * real.shape[1] + real.int().argmax(-1)


def within_tables(given: list[tuple[torch.Tensor, int]]) -> bool:
    """Every id of each (ids, table size) in [0, size)."""
    for ids, size in given:
        low, high = torch.aminmax(ids)
        if low.item() < 0 or high.item() >= size:
            return False
    return True


def add_single_query(base: BertImplModel) -> None:
    """`base.single_query`: the check in C++ of a call that is a single query (csrc/quick_call.cpp: `SingleQuery`, the
    calls it takes and the program's inputs it gives) for the compiled model `base`, watching (a `native.snapshot`)
    the encoder's weights, the dicts its `program_tree` reads and its config: once one of them is touched (a weight
    changed, a hook added, even if removed again, a config field set) the calls go through `forward`, whose checks see
    what changed. None where the module is not built, for RoBERTa's positions (counted from the ids), or where the
    config asks for outputs the program does not give."""
    base.single_query = None
    module, config = native.quick_call(), base.config
    if module is None or base.embeddings.position_offset or config.output_attentions or config.output_hidden_states:
        return
    tensors = [*base.parameters(), *base.buffers()]
    watch = native.snapshot(tensors=tensors, dicts=[*base.program_tree.watched(), vars(config)])
    encoder = base.compiled_encoder
    base.single_query = module.SingleQuery((watch,), encoder.by_shape, config.vocab_size, config.type_vocab_size,
                                           encoder.max_length, min(encoder.max_tokens, 2**62))
    watch.take()  # with the attribute just set


@functools.cache
def compiled_class(cls: type) -> type:
    """CompiledBertImplModel's forward on `cls` (BertImplModel, or a subclass of it such as `apply_bert_impl`'s)."""
    if issubclass(cls, CompiledBertImplModel):
        return cls
    if cls in (BertImplModel, inference_class(BertImplModel)):
        return CompiledBertImplModel
    return type(f"Compiled{cls.__name__}", (CompiledBertImplModel, cls), {"__module__": __name__})


def config_default(value, default):
    return default if value is None else value


# An int8 model's products through inductor's own C++ GEMM template (VNNI micro-kernels, the per-token quantizing and
# the rescaling fused around them) instead of oneDNN's: faster on short queries, level on long ones and dense batches.
# The arithmetic is the same int32 one; activations round a little differently (as accurate against float32).
# Only where the CPU has AVX-512 VNNI: the template has no other int8 micro-kernel than a scalar one, an order of
# magnitude slower than oneDNN's qlinear on an AVX2 CPU. float32 stays on oneDNN: the template was slower there.
# ATEN beside it: torch 2.15's template offers no choice for the float products of an int8 model's program (inductor
# then refuses to compile), so autotuning needs another. (benchmarks/NOTES.md, "int8", on inductor's C++ int8 GEMM)
INT8_CONFIGS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def int8(base: BertImplModel) -> bool:
    return any(isinstance(m, Int8Linear) for m in base.modules())


def gemm_configs(base: BertImplModel) -> dict:
    """The inductor configs that pick the program's products: `INT8_CONFIGS` for an int8 model on a CPU with VNNI,
    else inductor's default (oneDNN)."""
    return INT8_CONFIGS if int8(base) and torch.cpu._is_vnni_supported() else {}


def token_limit(base: BertImplModel) -> int | None:
    """The most tokens (batch x length) a call may have to run the program; None for no limit. On an AVX2 CPU (no
    AVX-512) the float32 program with oneDNN's products is faster than the eager path up to 64 tokens and slower beyond;
    with our kernel's (avx2_gemm.py) up to 512, and beyond that the two are within the noise. On AVX-512 and in int8 it
    is faster at every size measured (benchmarks/NOTES.md, "`compile_for_inference`", the token limit on AVX2)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2" or int8(base):
        return None
    return 512 if avx2_gemm.chosen(base) else 64


def cpu_instructions() -> str:
    """The vector instructions the package's code is compiled for ("AVX512 VNNI", "AVX2", ...), read off the CPU: a
    package runs only where they are the same."""
    return torch.backends.cpu.get_cpu_capability() + (" VNNI" if torch.cpu._is_vnni_supported() else "")


INSTALL_COMPILER = "install it (e.g. `apt install g++`), or name an installed one in CXX before starting Python"


def missing_compiler() -> str | None:
    """The C++ compiler inductor builds with (CXX, else g++), named where it is not found; None where it is."""
    from torch._inductor import config
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
        return None
    except InvalidCxxCompiler:
        names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
        return " or ".join(name for name in names if name)


def load_package(package_path: str, kernels: bool):
    """The package's program, loaded (`native.program`; its manifest checked: `read_manifest`). A package compiled
    with our kernels (`kernels`: avx2_gemm.py; its attention at least, wherever they could be built) needs them loaded
    first, built here if they are not in inductor's cache."""
    if kernels:
        why = avx2_gemm.load() if avx2_gemm.runs_here() else "this is not Linux x86-64 with AVX2 or AVX-512"
        if why is not None:
            compiler = missing_compiler()
            raise ValueError(
                f"package_path: {package_path} calls bert-impl's AVX2 kernels (avx2_gemm.py), which are built "
                + (f"here once with a C++ compiler, and {compiler} is not on PATH: {INSTALL_COMPILER}"
                   if compiler is not None else f"here once and could not be ({why}); compile the model again here")
                + ". (Or load it where the kernels are in inductor's cache already: TORCHINDUCTOR_CACHE_DIR of a "
                "machine that built them with this torch.)")
    return native.program(package_path)


def compile_package(base: BertImplModel, package_path: str, metadata: dict[str, str],
                    dtype: torch.dtype = torch.float32):
    """Export the forward with batch and length dynamic, compile it with AOTInductor (weights frozen in oneDNN's
    layout, or on an AVX2 CPU in our kernels' panels: avx2_gemm.py; in bfloat16, `Bf16Product`s), write the package
    with its manifest (`write_manifest`: `metadata`, whether it calls our kernels, its digest) and load it."""
    # (B, T) an example; the program takes any B >= 1, 2 <= T <= positions. Contiguous, as the program's inputs will be:
    # AOTInductor compiles for the example's strides (positions expanded over the batch would be read from row 0 only).
    ids = torch.ones(2, 8, dtype=torch.long)
    example = (ids, torch.ones_like(ids), torch.zeros_like(ids), torch.arange(8).repeat(2, 1))
    batch = torch.export.Dim("batch", min=1)
    length = torch.export.Dim("length", min=2, max=base.config.max_position_embeddings)
    configs = {"freezing": True, **gemm_configs(base)}
    products = dtype == torch.float32 and avx2_gemm.chosen(base)  # our products and attention, else attention only
    kernels = products or avx2_gemm.attention_chosen()
    attention = avx2_gemm.kernel_attention if kernels else dense_attention
    gelus = rational_gelus(base)  # read before the kernels' modules stand in for the Int8Linears it looks for
    with torch.no_grad(), avx2_gemm.kernel_modules(base) if products else joint_attention(base, dtype, attention), \
            avx2_gemm.swapped(gelus):
        program = torch.export.export(Program(base), example,
                                      dynamic_shapes=({0: batch, 1: length},) * 4)
        written = torch._inductor.aoti_compile_and_package(program, package_path=package_path,
                                                           inductor_configs=configs)
    write_manifest(written, {**metadata, "kernels": kernels})
    return native.program(written)


def joint_product(layers: list[nn.Module]) -> nn.Module:
    """One module computing `layers` (of one input: nn.Linear or Int8Linear) side by side."""
    if isinstance(layers[0], Int8Linear):
        return Int8Linear.concat(layers)
    joint = nn.Linear(layers[0].in_features, sum(m.out_features for m in layers))
    joint.weight.data, joint.bias.data = joined(layers)
    return joint


def joint_attention(base: BertImplModel, dtype: torch.dtype = torch.float32, attend=dense_attention):
    """While tracing the program: each layer's self-attention a `QKVAttention` with `attend` (torch's attention, or
    our kernel's: avx2_gemm.attention_chosen) on one product of query, key and value (one GEMM in the program, as the
    fused layers run them); in bfloat16 every product of the encoder and the pooler a `Bf16Product`; put back after."""
    targets = []
    bf16 = dtype == torch.bfloat16
    for layer in base.encoder.layer:
        (qkv, _), *others = layer_sites(layer)
        joint = joint_product(qkv)
        targets.append((layer.attention, "self", QKVAttention(layer.attention.self, Bf16Product(joint) if bf16
                                                              else joint, attend)))
        if bf16:
            targets += [(parent, name, Bf16Product(module)) for (module,), ((parent, name),) in others]
    if bf16 and getattr(base, "pooler", None) is not None:
        targets.append((base.pooler, "dense", Bf16Product(base.pooler.dense)))
    return avx2_gemm.swapped(targets)


class Bf16Product(nn.Module):
    """A linear layer as the bfloat16 program traces it (`bf16_product`'s arithmetic): its input rounded to
    bfloat16, the product on the weight in bfloat16, the output back in float32 plus the float32 bias."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x):  # (..., in) float32 -> (..., out) float32
        y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y + self.bias


def rational_gelus(base: BertImplModel) -> list[tuple[nn.Module, str, nn.Module]]:
    """Where an int8 layer's exact GELU is to be traced as `RationalGELU` (for `avx2_gemm.swapped`): each layer whose
    first feed-forward product is an `Int8Linear`."""
    blocks = [layer.intermediate for layer in base.encoder.layer]
    return [(block, "intermediate_act_fn", RationalGELU()) for block in blocks
            if isinstance(block.dense, Int8Linear) and is_exact_gelu(block.intermediate_act_fn)]


class RationalGELU(nn.Module):
    """The exact (erf) GELU as an int8 program traces it: x (1 + erf(x / sqrt 2)) / 2 with erf(x / sqrt 2) as
    c P(c^2) / Q(c^2), c = x clamped to +-5.5437174 (where erf is 1 in float32): the rational of degree 5 that the AVX2
    kernel computes (`gelu8` in csrc/sgemm_avx2.cpp), within 2.7e-7 max(1, |x|) of float64's GELU (torch's float32
    GELU: 3.5e-7). The next product quantizes the GELU's rows: with torch's erf (an exp called out of the loop, and a
    division) inductor computed the activation in each of the two passes over a row (its largest |value|, then its
    steps), one of the program's costliest loops. This is about 20 multiply-adds, inlined, which inductor computes once
    into a buffer of the row (benchmarks/NOTES.md, "int8", the program's GELU)."""

    P = (4.496154e-08, 1.2704755e-05, 0.0003419076, 0.00937981, 0.06815178, 0.79788446)
    Q = (1.189699e-06, 7.425571e-05, 0.0018965162, 0.028770968, 0.25208142, 1.0)
    LIMIT = 5.5437174

    def forward(self, x):  # (..., I) float32 -> (..., I)
        c = x.clamp(-self.LIMIT, self.LIMIT)
        t = c * c
        p = functools.reduce(lambda acc, k: acc * t + k, self.P[1:], self.P[0])
        q = functools.reduce(lambda acc, k: acc * t + k, self.Q[1:], self.Q[0])
        half = x * 0.5
        return half * (c * p / q) + half


CPU_INT64 = lambda t: t.dtype == torch.int64 and t.device.type == "cpu"  # noqa: E731

# the config fields the program's arithmetic reads
ENCODER_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps")


def fingerprint(base: BertImplModel) -> str:
    """sha256 of what the program computes from: the encoder's config fields, parameters and buffers (names, shapes,
    values: `quantize_for_inference`'s int8 weights are buffers); not the heads', which run outside it."""
    digest = hashlib.sha256(json.dumps([getattr(base.config, name) for name in ENCODER_FIELDS]).encode())
    for name, p in [*base.named_parameters(), *base.named_buffers()]:
        digest.update(f"{name} {tuple(p.shape)}".encode())
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def model_output(hidden: torch.Tensor, pooled: torch.Tensor | None = None) -> BaseModelOutputWithPooling:
    """`BaseModelOutputWithPooling(hidden, pooled)` as its constructor builds it (every field an attribute, those not
    None also items, in field order) without the dataclass's bookkeeping (a `fields()` walk on each assignment), which
    on the cold caches right after the program is a visible part of a short query's time. Tested equal to the
    constructor's."""
    out = BaseModelOutputWithPooling.__new__(BaseModelOutputWithPooling)
    out.__dict__.update(OUTPUT_FIELDS, last_hidden_state=hidden, pooler_output=pooled)
    OrderedDict.__setitem__(out, "last_hidden_state", hidden)
    if pooled is not None:
        OrderedDict.__setitem__(out, "pooler_output", pooled)
    return out


OUTPUT_FIELDS = dict.fromkeys(BaseModelOutputWithPooling.__dataclass_fields__)  # each None, in field order


class CompiledEncoder:
    """The compiled program, called by CompiledBertImplModel in place of its own forward where it computes the same
    (`CompiledBertImplModel.program_inputs`). A copy of the model shares it (the weights it was compiled from are
    fixed)."""

    def __init__(self, program, base: BertImplModel):
        self.run = program  # native.program: a list of input tensors -> the list of outputs
        config = base.config
        self.max_length = config.max_position_embeddings
        self.tables = config.vocab_size, config.type_vocab_size, config.max_position_embeddings  # the ids' bounds
        self.by_shape = {}  # (B, T) -> `constants`
        # Padded batches: the program by groups for an int8 model (faster than the eager int8 path on mixed lengths);
        # float32's eager path lays them out the same way at the same speed or better, so it keeps those of several
        # rows (`real_tokens`: one row, a query padded to a fixed length, runs the program on its real tokens).
        self.padded_batches = int8(base)
        self.max_tokens = token_limit(base) or math.inf  # calls of more tokens take the eager path
        self.query_threads = QueryThreads()  # single queries on one thread while the cores are contended

    def __deepcopy__(self, memo):
        return self

    def __call__(self, ids: tuple[torch.Tensor, ...], real: torch.Tensor | None) -> list[torch.Tensor]:
        """The model's outputs on `program_inputs`' inputs: last hidden state (B, T, H) and, where the model pools,
        pooled output (B, H)."""
        if real is None:
            return self.dense(ids, self.constants(*ids[0].shape)[2])
        if real.shape[0] == 1 and (where := real[0].nonzero().squeeze(1)).numel() >= 2:
            return self.one_row(ids, where, real.shape[1])
        return self.padded(ids, real)

    def constants(self, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Position ids, token type ids and an attention mask where none are given (and a mask without padding
        is), each (B, T) int64, made once per shape (the last few shapes kept)."""
        found = self.by_shape.get((B, T))
        if found is None:
            if len(self.by_shape) >= 8:
                self.by_shape.clear()
            positions = torch.arange(T).repeat(B, 1)
            found = self.by_shape[B, T] = positions, torch.zeros_like(positions), torch.ones_like(positions)
        return found

    def program(self, input_ids, token_type_ids, position_ids, mask) -> list:
        """The program on (B, T) inputs; one row (a single query) on the threads `QueryThreads` chooses."""
        inputs = [input_ids.contiguous(), mask, token_type_ids.contiguous(), position_ids.contiguous()]
        return self.query(inputs) if input_ids.shape[0] == 1 else self.run(inputs)

    def query(self, inputs: list) -> list:
        """The program on a single query's inputs [ids, mask, token types, positions], each (1, T) and contiguous, on
        the threads `QueryThreads` chooses."""
        return self.query_threads(inputs[0].shape[1], lambda: self.run(inputs))

    def dense(self, ids: tuple[torch.Tensor, ...], ones: torch.Tensor) -> list:
        """A batch without padding (B, T): the program on groups of `group_size(T)` sequences, as the eager path runs
        the layers (`fused_encoder`: each product's inputs and outputs stay in the cache), the outputs concatenated."""
        B, T = ones.shape
        group = group_size(T)
        if B <= group:
            return self.program(*ids, ones)
        parts = [self.program(*(t[i:i + group] for t in ids), ones[i:i + group]) for i in range(0, B, group)]
        return [torch.cat(outputs) for outputs in zip(*parts)]

    def one_row(self, ids: tuple[torch.Tensor, ...], where: torch.Tensor, T: int) -> list:
        """One padded query (1, T), `where` its n >= 2 real tokens (n,): the program on those tokens (1, n), their
        positions kept, the hidden states put back in place, zeros at padding; the pooled output is the first real
        token's, as `padded` gives it, in fewer steps."""
        outputs = self.program(*(t.index_select(1, where) for t in ids), self.constants(1, where.numel())[2])
        hidden = outputs[0]  # (1, n, H)
        placed = torch.zeros(1, T, hidden.shape[2]).index_copy_(1, where, hidden)  # (1, T, H)
        return [placed, *outputs[1:]]

    def padded(self, ids: tuple[torch.Tensor, ...], real: torch.Tensor) -> list:
        """A padded batch (B, T), `real` its tokens, by groups: the sequences, sorted by length, cut into groups padded
        to their longest (the encoder's CPU layout, bert_padding.py), the program run on each group (s_g, T_g), the
        outputs put back in place, zeros at padding, as the eager path gives them."""
        B, T = real.shape
        layout = BucketedLayout.of_tokens(*unpad_indices(real, int(real.sum())), (B, T), torch.float32)
        rows = [layout.enter(t) for t in ids]  # each (P,)
        rows_real = (layout.key_mask == 0).long()  # (P,) 1 on the rows that hold a real token
        hidden, pooled, first, start = [], [], [], 0
        for s, t, _ in layout.shapes:
            group = slice(start, start + s * t)
            outputs = self.program(*(r[group].view(s, t) for r in rows), rows_real[group].view(s, t))
            hidden.append(outputs[0].flatten(0, 1))  # (s_g * T_g, H)
            pooled += outputs[1:]  # (s_g, H) where the model pools: each sequence's first row is its first token
            first.append(torch.arange(start, start + s * t, t))  # (s_g,) the rows that start a sequence
            start += s * t
        outputs = [layout.leave(torch.cat(hidden))]  # (B, T, H)
        if pooled:  # (B, H) in the groups' order -> the batch's
            pooled, sequence = torch.cat(pooled), layout.grid[torch.cat(first)] // T
            outputs.append(torch.empty_like(pooled).index_copy_(0, sequence, pooled))
        return outputs
