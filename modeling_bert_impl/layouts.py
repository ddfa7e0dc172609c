"""Where the encoder's rows are and how they attend: the three layouts of a forward, and the one function that chooses
between them (`choose_layout`).

The encoder asks its layout to `enter` (the embeddings' (B, T, H) to the rows the layers run on) and to `leave` (rows
back to (B, T, H), zeros at padding); each layer's self-attention asks it to `attend`; the pooler takes its
`first_tokens`. Shapes: B batch, T tokens, H hidden, N heads, D head dim, S sequences, P the rows of a padding-free
layout.

- `PaddedLayout`, stock BERT's: the rows are the batch itself, (B, T, H), and attention runs through transformers'
  attention function of the implementation set (the self-attention module passes it), with the mask transformers'
  mask interface makes for it.
- `VarlenLayout`, padding-free and exact: the (nnz, H) rows of the real tokens, each sequence attending to itself
  through a variable-length kernel (bert_padding.py). On CUDA, and for training under torch.compile.
- `BucketedLayout`, padding-free on the CPU: the sequences sorted by length into groups, each padded to its group's
  longest (P a few percent over nnz), so that attention takes each group as a plain batch, from views of the rows.

Padding-free wherever there are rows to skip and skipping them pays (`skipping_pays`), except where only stock's
layout gives what is asked or what is attached needs it: attention maps or the `eager` implementation, cached keys
(prefix tuning), `config.unpad_inputs=False`, or (with `unpad_inputs` None, the default) code of the user's that
looks inside the encoder (`looking_inside`), so that it sees stock's (B, T, H) tensors.
"""

import functools
import itertools
import operator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    bidirectional_mask_function,
    packed_sequence_mask_function,
)
from transformers.utils import logging

from .bert_padding import (
    BUCKET_GROUP_COST,
    VarlenBatch,
    additive_mask,
    bucketed_attention,
    bucketed_layout,
    pad,
    unpad,
    unpad_indices,
    varlen_kernel,
)
from .input_checks import Batch

logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# The layouts
# ---------------------------------------------------------------------------------------------------------------------
class PaddedLayout:
    """Stock BERT's layout: every layer on the (B, T, H) batch, attention through transformers' attention functions.

    The mask travels as stock's `attention_mask` argument of the encoder, its layers and their attention (so a module
    called by itself with a mask attends with it: `STANDALONE`); `attention_mask` here is the one the forward made."""

    def __init__(self, attention_mask=None, padding: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                 implementation: str | None = None, cache=None):
        self.attention_mask = attention_mask  # in the form its implementation takes (`stock_mask`); None: unmasked
        self.padding = padding  # (B, T, 1) bool, True at padding (zeroed on leaving); None: none (or not zeroed)
        self.starts = starts  # `first_token_rows`
        self.implementation = implementation  # the attention implementation; None: the module's config's
        self.cache = cache  # a transformers Cache: C keys and values per layer ahead of the tokens' own (prefix tuning)

    @classmethod
    def build(cls, config, batch: Batch, x: torch.Tensor, implementation: str) -> "PaddedLayout":
        mask = batch.attention_mask
        padding = None if mask is None or batch.facts.mask_has_padding is False else (mask == 0).unsqueeze(-1)
        return cls(stock_mask(config, batch, x, implementation), padding, first_token_rows(batch), implementation,
                   batch.cache)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x  # (B, T, H)

    def attend(self, module, q, k, v, attention_mask, dropout: float, function):
        """q, k, v (B, T, N, D) -> (B, T, N, D) by `function`, transformers' attention function of `implementation`,
        and the attention weights (B, N, T, C + T) where it gives them (eager), else None. The cached keys and values
        (prefix tuning) are read, not extended (an encoder generates nothing), so a layer recomputed by gradient
        checkpointing reads the same ones."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, T, D)
        if self.cache is not None:
            cached = self.cache.layers[module.layer_idx]
            k, v = torch.cat([cached.keys, k], 2), torch.cat([cached.values, v], 2)  # (B, N, C + T, D)
        return function(module, q, k, v, attention_mask, scaling=module.scaling, dropout=dropout)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H) with zeros at padding: no real token reads a padding position, so zeroing them changes nothing
        else."""
        return x if self.padding is None else x.masked_fill(self.padding, 0)

    def kernel(self, q, k, v, attention_mask, scaling: float, dropout: float) -> torch.Tensor:
        """softmax(q k^T * scaling + mask) v through torch's SDPA, for the masks of the sdpa and eager implementations
        (bool, or additive) and without cached keys; q, k, v (B, T, N, D) -> (B, T, N, D). What the CPU inference
        engine's fused layers run (no module, no attention weights)."""
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)  # eager's additive mask, as it is
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, T, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
        return y.transpose(1, 2)

    def first_tokens(self, last: torch.Tensor) -> torch.Tensor:
        return first_tokens(last, self.starts)


STANDALONE = PaddedLayout()  # a module called by itself, not by the encoder: stock's layout, with the mask it is given


class UnpaddedLayout:
    """What the two padding-free layouts share: P rows gathered from the (B, T) batch once (`enter`) and scattered
    back once (`leave`)."""

    attention_mask = None  # the layers are given none: each sequence's keys are the layout's
    cache = None  # cached keys run the padded layout
    implementation = None  # transformers' attention functions are not called

    def __init__(self, grid: torch.Tensor, real: torch.Tensor | None, shape: tuple[int, int],
                 starts: torch.Tensor | None):
        self.grid = grid  # (P,) each row's position in the flattened (B * T) batch
        self.real = real  # (nnz,) the rows that hold real tokens, once each; None when every row does
        self.shape = shape  # (B, T)
        self.starts = starts  # `first_token_rows`

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return unpad(x, self.grid)  # (B, T, ...) -> (P, ...)

    def attend(self, module, q, k, v, attention_mask, dropout: float, function):
        """q, k, v (P, N, D) -> (P, N, D), each token attending to the keys of its own sequence only; no weights.
        `attention_mask` is None here (`UnpaddedLayout.attention_mask`), and transformers' `function` unused."""
        return self.kernel(q, k, v, attention_mask, module.scaling, dropout), None

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """(P, ...) -> (B, T, ...), zeros at padding."""
        if self.real is None:
            return pad(x, self.grid, *self.shape)
        return pad(x[self.real], self.grid[self.real], *self.shape)

    def first_tokens(self, last: torch.Tensor) -> torch.Tensor:
        return first_tokens(last, self.starts)


class VarlenLayout(UnpaddedLayout):
    """The exact padding-free layout: the rows are the nnz real tokens (P = nnz), attention through the fastest
    variable-length kernel for the device and dtype (`bert_padding.varlen_kernel`)."""

    def __init__(self, grid, shape, starts, sequences: VarlenBatch):
        super().__init__(grid, None, shape, starts)
        self.sequences = sequences

    @classmethod
    def build(cls, batch: Batch, x: torch.Tensor) -> "VarlenLayout":
        """The sequences laid out at their longest (read on the host, or given as max_length_q), else at T."""
        tokens, cu_seqlens = token_positions(batch, x.device)
        max_seqlen = batch.shape[1] if batch.max_seqlen is None else batch.max_seqlen
        sequences = VarlenBatch.build(cu_seqlens, max_seqlen, tokens.shape[0], x.dtype)
        return cls(tokens, batch.shape, first_token_rows(batch), sequences)

    def kernel(self, q, k, v, attention_mask, scaling: float, dropout: float) -> torch.Tensor:
        return varlen_kernel(q)(q, k, v, self.sequences, scaling, dropout)


class BucketedLayout(UnpaddedLayout):
    """The CPU's padding-free layout: groups of sequences of similar length, each padded to its longest, one after
    the other; a shorter sequence's extra rows repeat its last token, masked as keys (bert_padding.bucketed_rows)."""

    def __init__(self, grid, real, shape, starts, key_mask: torch.Tensor, shapes):
        super().__init__(grid, real, shape, starts)
        self.key_mask = key_mask  # (P,) additive: 0 on rows holding a real token, the dtype's minimum on filler rows
        self.shapes = shapes  # (s_g, T_g, filler) per group, in row order; a (G, 3) tensor when traced

    @classmethod
    def build(cls, batch: Batch, x: torch.Tensor) -> "BucketedLayout":
        return cls.of_tokens(*token_positions(batch, x.device), batch.shape, x.dtype, first_token_rows(batch))

    @classmethod
    def of_tokens(cls, tokens: torch.Tensor, cu_seqlens: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype,
                  starts: torch.Tensor | None = None) -> "BucketedLayout":
        """From the real tokens' positions (nnz,) in the flattened (B * T) batch and the sequences' boundaries (S + 1,);
        the groups are read on the host (traced: inside a custom op)."""
        grid, real, real_rows, shapes = bucketed_layout(tokens, cu_seqlens, BUCKET_GROUP_COST)
        return cls(grid, real_rows, shape, starts, additive_mask(real, dtype), shapes)  # filler keys masked once

    def kernel(self, q, k, v, attention_mask, scaling: float, dropout: float) -> torch.Tensor:
        if isinstance(self.shapes, torch.Tensor):  # traced: the group loop runs inside one opaque op
            return torch.ops.bert_impl.bucketed_attention(q, k, v, self.key_mask, self.shapes, scaling)
        return bucketed_attention(q, k, v, self.key_mask, self.shapes, scaling, dropout)


# ---------------------------------------------------------------------------------------------------------------------
# What the layouts are built from
# ---------------------------------------------------------------------------------------------------------------------
def token_positions(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens' positions (nnz,) in the flattened (B * T) batch and the sequences' boundaries cu_seqlens
    (S + 1,) int32: a packed batch's every position; a padded batch's ones of its mask (nnz read on the host, or,
    traced, found by a custom op of data-dependent size)."""
    if batch.packs is not None:  # packed, (B, T): every position is a token
        return torch.arange(batch.shape[0] * batch.shape[1], device=device), batch.packs
    mask = batch.attention_mask
    if batch.facts.nnz is not None:
        return unpad_indices(mask, batch.facts.nnz)
    cu_seqlens = F.pad(torch.cumsum(mask.sum(-1, dtype=torch.int32), 0, dtype=torch.int32), (1, 0))
    return torch.ops.bert_impl.nonzero(mask), cu_seqlens


def first_token_rows(batch: Batch) -> torch.Tensor | None:
    """Where the pooler reads each sequence: None for position 0 of every row (a batch without padding), else the
    (S,) positions in the flattened (B * T) batch of each sequence's first real token ([CLS]): a packed batch's
    sequence starts, a padded batch's first 1 of each row (position 0 of a row of padding only, which is zeros)."""
    if batch.packs is not None:
        return batch.packs[:-1].long()
    mask = batch.attention_mask
    if mask is None or batch.facts.mask_has_padding is False:  # None: traced, the mask decides
        return None
    B, T = batch.shape
    return torch.arange(B, device=mask.device) * T + (mask != 0).int().argmax(-1)  # (B,)


def first_tokens(last: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """What the pooler reads of last (B, T, H): the whole (it takes position 0), or each sequence's first token
    (S, 1, H)."""
    return last if starts is None else last.flatten(0, 1)[starts][:, None]


def stock_mask(config, batch: Batch, x: torch.Tensor, implementation: str):
    """The padded layout's mask for x (B, T, H), made by transformers' mask interface in the form the attention
    implementation takes: additive float (B, 1, T, T) for eager (masked scores at the dtype's minimum, so a row that
    is all padding still gives finite, uniform attention), bool for sdpa, a BlockMask for flex attention, the (B, T)
    mask for flash attention; None when nothing is masked. A packed batch attends block-diagonally: each token to its
    own sequence only. Whether the mask has padding was read with the checks (None when traced), so transformers need
    not look into it for itself (a second host-device sync). C cached keys (prefix tuning) ahead of the T tokens are
    always attended: the mask is then over C + T keys.

    sdpa without packing: the padding mask as it is, bool (B, 1, 1, T), the same for every query (SDPA broadcasts it),
    instead of transformers' copy of it for each query, (B, 1, T, T)."""
    (B, T), C, packs = batch.shape, batch.cache_length, batch.packs
    if C and packs is not None:
        raise ValueError("cached keys (cache / past_key_values, prefix tuning) need a padded batch, not a packed one")
    has_padding = batch.facts.mask_has_padding
    attention_mask = None if has_padding is False else batch.attention_mask  # all ones: nothing to mask but packing
    if attention_mask is None and packs is None:
        return None  # said here: under torch.export transformers would make an all-True mask for sdpa
    mask_function, skip_if_unmasked = bidirectional_mask_function, has_padding is not True
    if packs is not None:
        if implementation.startswith("flash_attention"):
            raise ValueError(f"{implementation} takes a packed batch on the unpadded path only: set "
                             "config.unpad_inputs=True")
        segment = torch.bucketize(torch.arange(B * T, device=x.device), packs[1:].long(), right=True)
        mask_function = and_masks(mask_function, packed_sequence_mask_function(segment.view(B, T)))  # (B, T) ids
        skip_if_unmasked = False
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=x.device, dtype=torch.bool)  # (B, T)
        if C:
            attention_mask = torch.cat([attention_mask.new_ones(B, C), attention_mask], -1)  # (B, C + T)
        if implementation == "sdpa" and packs is None:
            return attention_mask[:, None, None, :]  # (B, 1, 1, C + T)
    return ALL_MASK_ATTENTION_FUNCTIONS[implementation](
        batch_size=B, q_length=T, kv_length=C + T, mask_function=mask_function, attention_mask=attention_mask,
        allow_is_causal_skip=False, allow_is_bidirectional_skip=skip_if_unmasked, dtype=x.dtype, device=x.device,
        config=config,
    )


# ---------------------------------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------------------------------
# A padding-free layout's own cost in a forward (gathering and scattering the rows, grouping them on the host), as the
# FLOPs of dense work on padded rows it equals, per device type: with `unpad_inputs` None it runs where the padded
# rows it skips cost more (`skipping_pays`). Measured by `bench_model.py --break-even`: on a 2-core AVX-512 EPYC, 2
# threads, 40-340 MFLOP (MiniLM: 2-16 padded rows; a 2-layer H=128 model: 64-128), within a few percent either way
# near it (benchmarks/NOTES.md, "When skipping padding pays"). A device type not listed (CUDA: not measured yet) skips
# wherever there is padding.
BREAK_EVEN_FLOPS = {"cpu": 1e8}


def choose_layout(config, batch: Batch, x: torch.Tensor, encoder: nn.Module, output_attentions: bool):
    """The layout of a forward on `batch`, whose embeddings are x (B, T, H): padding-free where it may run
    (`padding_free`) and nothing of the user's looks inside the encoder (`observed`), `bucketed` or exact; else
    stock's."""
    implementation = "eager" if output_attentions else config._attn_implementation  # maps exist on eager only
    if not padding_free(config, batch, implementation, x.device) or observed(config, encoder):
        return PaddedLayout.build(config, batch, x, implementation)
    return (BucketedLayout if bucketed(x) else VarlenLayout).build(batch, x)


def padding_free(config, batch: Batch, implementation: str, device: torch.device) -> bool:
    """Whether a padding-free layout may run: rows to skip (padding, or packed sequences), and nothing asked that
    stock's layout alone gives: `unpad_inputs=False`, the `eager` implementation (attention maps), cached keys; with
    `unpad_inputs` None, where skipping pays (`skipping_pays`)."""
    return (batch.rows_to_skip and config.unpad_inputs is not False and implementation != "eager"
            and not batch.cache_length and (config.unpad_inputs or skipping_pays(config, batch, device)))


def skipping_pays(config, batch: Batch, device: torch.device) -> bool:
    """Whether the padded rows a padding-free layout skips cost more than the layout itself (`BREAK_EVEN_FLOPS`), by
    the FLOPs of the encoder's dense layers on them (`row_flops`). Packed batches always (the padded
    layout would attend to a block-diagonal mask over every row), traced ones always (nnz is not read)."""
    if batch.packs is not None or batch.facts.nnz is None:
        return True
    B, T = batch.shape
    return (B * T - batch.facts.nnz) * row_flops(config) >= BREAK_EVEN_FLOPS.get(device.type, 0)


def row_flops(config) -> int:
    """A row's FLOPs in the encoder's dense layers, forward: 2 L (4 H^2 + 2 H I) (query, key, value and the attention
    output's products, the feed-forward's two)."""
    H = config.hidden_size
    return 2 * config.num_hidden_layers * (4 * H * H + 2 * H * config.intermediate_size)


def bucketed(x: torch.Tensor) -> bool:
    """The bucketed layout on the CPU, except when training under torch.compile (its attention is then an opaque op
    without a backward); the exact one elsewhere."""
    return x.device.type == "cpu" and not (torch.compiler.is_compiling() and torch.is_grad_enabled())


def observed(config, encoder: nn.Module) -> bool:
    """With `config.unpad_inputs` None (the default): whether code of the user's looks inside the encoder
    (`looking_inside`), said once in the log (a traced program cannot log; the eager call before it did)."""
    if config.unpad_inputs is not None:
        return False
    observer = looking_inside(encoder)
    if observer is not None and not torch.compiler.is_compiling():
        logger.warning_once(
            f"{observer}: calls with padding run the padded layout, so that it sees stock BERT's (B, T, H) tensors; "
            "set config.unpad_inputs=True to keep the padding-free layout (hooks then see the (P, H) rows of real "
            "tokens)")
    return observer is not None


# ---------------------------------------------------------------------------------------------------------------------
# What of the user's looks inside the encoder
# ---------------------------------------------------------------------------------------------------------------------
# Where the code that runs inside the encoder on every call comes from when it reads no layout: torch itself (FSDP2,
# parametrizations), transformers (output capturing), the frameworks that hook every module (accelerate, DeepSpeed
# ZeRO-3), PEFT's tuner layers and quantized linears, and this package.
FRAMEWORKS = {"torch", "transformers", "accelerate", "deepspeed", "peft", "bitsandbytes", "torchao",
              __name__.split(".")[0]}
HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# Frameworks' layers that compute over the whole (B, T, H) batch, so that they need its layout: peft's Poly (each
# example through its own mix of LoRA modules) and Lily (its router averaged over every position, padding included).
BATCH_LAYOUT_LAYERS = ("peft.tuners.poly.", "peft.tuners.lily.")
# This package's module classes -> the `forward` each was defined with (`remember_forwards`), to tell a patch.
DEFINED_FORWARDS: dict[type, object] = {}


def remember_forwards(namespace: dict) -> None:
    """Record the `forward` of every module class defined in `namespace` (a module's globals, at its import), None for
    one that inherits its forward (so that a forward set on it later is told too)."""
    name = namespace["__name__"]
    DEFINED_FORWARDS.update({cls: cls.__dict__.get("forward") for cls in namespace.values() if isinstance(cls, type)
                             and issubclass(cls, nn.Module) and cls.__module__ == name})


def origin(thing) -> str:
    """The top-level package a function, hook or class was defined in."""
    thing = thing.func if isinstance(thing, functools.partial) else thing
    return (getattr(thing, "__module__", None) or type(thing).__module__ or "").partition(".")[0]


def foreign_hook(hooks: dict) -> str | None:
    """The package of the first hook in `hooks` (a module's hook dict) that is not a framework's, or None."""
    return next((package for hook in hooks.values() if (package := origin(hook)) not in FRAMEWORKS), None)


def patched_class(cls: type) -> type | None:
    """The class of this package in cls's bases (cls itself included) whose `forward` is no longer the one it was
    defined with: a patch such as `BertImplSelfOutput.forward = f`; None where there is none."""
    return next((k for k in cls.__mro__ if k in DEFINED_FORWARDS and k.__dict__.get("forward") is not
                 DEFINED_FORWARDS[k]), None)


def instance_forward(module: nn.Module) -> str | None:
    """What of the user's a `forward` set on `module` itself runs: a function of theirs
    (`module.forward = types.MethodType(f, module)`), or accelerate's wrapper around a hook of theirs
    (`add_hook_to_module(module, MyHook())`); None for accelerate's own hooks (device_map, offloading) and for the
    class's own forward put back (accelerate's `remove_hook_from_module`)."""
    forward = module.__dict__["forward"]
    hook = module.__dict__.get("_hf_hook")
    if hook is not None:  # accelerate's: its wrapper calls the hook around the module's own forward
        hooks = getattr(hook, "hooks", (hook,))  # a SequentialHook's, or the one
        theirs = next((h for h in hooks if origin(type(h)) not in FRAMEWORKS), None)
        return None if theirs is None else f"an accelerate hook {type(theirs).__name__} from {origin(type(theirs))!r}"
    if getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is type(module).forward:
        return None
    return f"a forward set on the module, from {origin(forward)!r}"


def looking_inside(encoder: nn.Module) -> str | None:
    """What of the user's can observe or change the tensors between the encoder's modules, or None: a hook of theirs
    on one of its modules (or on every module: a global hook), a submodule of a class of theirs, a `forward` replaced
    on one of its modules (`instance_forward`) or on a class of this package (`patched_class`), or a framework's layer
    that computes over the whole batch (`BATCH_LAYOUT_LAYERS`). Runs at each call with padding, so it takes one Python
    step per module and does the rest in C."""
    for kind in HOOKS:
        if package := foreign_hook(getattr(torch_module, f"_global{kind}")):
            return f"a global module hook ({kind[1:-1].replace('_', ' ')}) from {package!r}"
    modules = [encoder]
    for module in modules:  # grows as it goes: every submodule once (nn.Module.modules() takes several times as long)
        if module is not None:  # an empty submodule slot
            modules.extend(module._modules.values())
    modules = list(filter(functools.partial(operator.is_not, None), modules))
    for cls in set(map(type, modules)):
        if origin(cls) not in FRAMEWORKS or cls.__module__.startswith(BATCH_LAYOUT_LAYERS):
            module = next(m for m in modules if type(m) is cls)
            return f"`{name_in(encoder, module)}` is a {cls.__name__} (from {cls.__module__!r})"
        if (patched := patched_class(cls)) is not None:
            return f"{patched.__name__}.forward was replaced (by one from {origin(patched.forward)!r})"
    for module in itertools.compress(modules, map(operator.contains, map(vars, modules), itertools.repeat("forward"))):
        if (what := instance_forward(module)) is not None:  # a module with a forward of its own
            return f"`{name_in(encoder, module)}` has {what}"
    for kind in HOOKS:
        for module in filter(operator.attrgetter(kind), modules):  # the modules with such hooks
            if package := foreign_hook(getattr(module, kind)):
                return f"`{name_in(encoder, module)}` has a {kind[1:-1].replace('_', ' ')} from {package!r}"
    return None


def name_in(encoder: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in encoder.named_modules(prefix="encoder") if m is module)
