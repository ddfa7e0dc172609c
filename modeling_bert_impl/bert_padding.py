"""The padding-free layouts' machinery: padding helpers as small pure functions, and the attention kernels.

layouts.py builds its layouts from these: `VarlenLayout` runs the exact varlen kernels (`varlen_kernel`), `BucketedLayout`
the CPU's bucketed rows (`bucketed_rows`, `bucketed_attention`).

Vocabulary: B batch, T padded length, nnz real (non-padding) tokens in the batch, cu_seqlens the cumulative sequence
lengths `(S + 1,)` int32 starting at 0 (S sequences; S = B for a padded batch, more for a packed one), P the rows the
unpadded encoder runs on: nnz in the exact layout; in the bucketed one, sequences sorted by length into a few groups,
each padded to its longest (P a few percent over nnz), so that attention takes each group as a plain padded batch
straight from views of the rows: no copies per layer, no per-sequence calls. On CPU this measured fastest: copies cost
more than the few padded rows there (benchmarks/NOTES.md, "Attention layout of the padding-free path on CPU").

Under torch.compile the steps that need the batch's values on the host (how many real tokens, which groups) run as
custom ops with data-dependent output sizes (`torch.library.custom_op`), so the compiled graph has no graph break and
no recompilation per batch; eager runs the same functions directly.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.utils import logging

from .dropout import dropout as apply_dropout

logger = logging.get_logger(__name__)

try:  # optional: flash-attention's variable-length kernel, used on CUDA for fp16/bf16
    from flash_attn import flash_attn_varlen_func
except (ImportError, OSError, RuntimeError):  # not installed, or built against another torch / CUDA
    flash_attn_varlen_func = None

# A new group (one more SDPA call) must save more than this many padded rows. 0 to 8 are within a few percent of each
# other on an idle machine, larger costs pad more; 8 holds up best when the cores are shared (an SDPA call then waits
# for both threads to be scheduled): benchmarks/NOTES.md, "Attention layout of the padding-free path on CPU".
BUCKET_GROUP_COST = 8


# ---------------------------------------------------------------------------------------------------------------------
# Padding helpers: small pure functions
# ---------------------------------------------------------------------------------------------------------------------
def unpad_indices(attention_mask: torch.Tensor, nnz: int) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_mask: (B, T) of 0/1 with `nnz` ones -> indices (nnz,) into the flattened (B * T) positions,
    cu_seqlens (B + 1,). Any padding layout (right, left, holes). Knowing nnz avoids a host-device sync."""
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)  # (B,)
    indices = torch.nonzero_static(attention_mask.flatten(), size=nnz).flatten()  # (nnz,)
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))  # (B + 1,)
    return indices, cu_seqlens


def unpad(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) -> (nnz, ...): the rows of the flattened batch at `indices`."""
    return x.flatten(0, 1)[indices]


def pad(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """(nnz, ...) -> (B, T, ...): scatter back to the padded layout; padding positions are zero."""
    out = x.new_zeros(batch * seqlen, *x.shape[1:])
    out[indices] = x
    return out.unflatten(0, (batch, seqlen))


def sequence_starts(position_ids: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
                    row_length: int | None = None) -> torch.Tensor:
    """The first token of each packed sequence, (B * T,) bool over the flattened rows: where `seq_idx` (the index of
    each token's sequence) changes, else where `position_ids` restart at 0 after a position that is not 0; the first
    token of each row (every `row_length` tokens; token 0 where None) always starts one.

    A packed BERT sequence holds at least [CLS] and [SEP], so a run of zeros never marks one-token sequences: it is one
    sequence whose positions are all 0 (captum's usual baseline), as stock BERT read it up to transformers 5.24 and
    reads it with an attention mask (docs/model.md)."""
    if seq_idx is not None:
        starts = F.pad(seq_idx[1:] != seq_idx[:-1], (1, 0))
    else:
        starts = (position_ids == 0) & F.pad(position_ids[:-1] != 0, (1, 0))
    tokens = torch.arange(starts.numel(), device=starts.device)
    return starts | (tokens % (row_length or starts.numel()) == 0)


def packed_position_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """cu_seqlens (S + 1,) of a packed (1, T) batch -> position ids (1, T) restarting at 0 in each sequence."""
    tokens = torch.arange(T, device=cu_seqlens.device)
    sequence = torch.bucketize(tokens, cu_seqlens[1:].long(), right=True)  # (T,)
    return (tokens - cu_seqlens.long()[sequence])[None]


def sequence_mask(cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """cu_seqlens (S + 1,) -> (S, max_seqlen) bool, True on the real tokens of each (left-aligned) sequence."""
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).unsqueeze(-1)  # (S, 1)
    return torch.arange(max_seqlen, device=cu_seqlens.device) < seqlens


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool -> additive mask of the same shape: 0 where allowed, the dtype's minimum elsewhere (finite, so a row with
    nothing allowed still gives a finite softmax)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def length_groups(seqlens: list[int], group_cost: int) -> list[list[int]]:
    """Host lengths (S,) -> groups of sequence indices, each group to be padded to its longest member.

    The sequences, sorted by length, are cut into runs that minimise padded rows + `group_cost` per group (exact
    dynamic programming over the cuts between distinct lengths). Empty sequences are in no group."""
    order = sorted((s for s, n in enumerate(seqlens) if n > 0), key=seqlens.__getitem__)
    cuts = [0] + [i + 1 for i in range(len(order)) if i + 1 == len(order) or seqlens[order[i + 1]] != seqlens[order[i]]]
    best, prev = [0] + [float("inf")] * (len(cuts) - 1), [0] * len(cuts)  # best[j]: cost of order[:cuts[j]]
    for j in range(1, len(cuts)):
        longest = seqlens[order[cuts[j] - 1]]
        for i in range(j):
            cost = best[i] + (cuts[j] - cuts[i]) * longest + group_cost
            if cost < best[j]:
                best[j], prev[j] = cost, i
    groups, j = [], len(cuts) - 1
    while j > 0:
        groups.append(order[cuts[prev[j]]:cuts[j]])
        j = prev[j]
    return groups[::-1]


def bucketed_rows(cu_seqlens: torch.Tensor, groups: list[list[int]], seqlens: list[int]):
    """cu_seqlens (S + 1,) over nnz tokens, groups from `length_groups`, seqlens the S lengths on the host -> the rows
    of the bucketed layout:

    rows (P,): the token each row holds; group after group, sequence after sequence, a sequence's tokens then copies
        of its last token up to its group's longest length T_g (P = sum of s_g * T_g);
    real (P,) bool: the rows that hold their token for the first time (nnz of them);
    shapes: (s_g, T_g, filler) per group, filler 1 where a sequence of the group is shorter than T_g (0: no row of the
        group is filler, its attention needs no mask).

    With no token at all (nnz = 0), one filler row holding token 0."""
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # (S,)
    rows, real, shapes = [], [], []
    for group in groups:
        g = torch.tensor(group, device=starts.device)  # (s_g,)
        shortest, T_g = min(seqlens[i] for i in group), max(seqlens[i] for i in group)
        pos = torch.arange(T_g, device=starts.device)  # (T_g,)
        rows.append((starts[g, None] + torch.minimum(pos, lengths[g, None] - 1)).flatten())  # (s_g * T_g,)
        real.append((pos < lengths[g, None]).flatten())
        shapes.append((len(group), T_g, int(shortest < T_g)))
    if not groups:
        return starts.new_zeros(1), torch.zeros(1, dtype=torch.bool, device=starts.device), [(1, 1, 1)]
    return torch.cat(rows), torch.cat(real), shapes


# ---------------------------------------------------------------------------------------------------------------------
# Attention kernels: q, k, v (P, N, D) -> (P, N, D), each token attending to the keys of its own sequence only
# ---------------------------------------------------------------------------------------------------------------------
class VarlenBatch(NamedTuple):
    """What the exact kernels need to treat nnz rows as S separate sequences."""

    cu_seqlens: torch.Tensor  # (S + 1,) int32
    max_seqlen: int
    indices: torch.Tensor  # (nnz,) each token's place in the left-aligned (S * max_seqlen) layout
    key_mask: torch.Tensor  # (S, 1, 1, max_seqlen) additive: 0 on real keys, dtype min on padding

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, max_seqlen: int, nnz: int, dtype: torch.dtype) -> "VarlenBatch":
        cu = cu_seqlens.long()
        sequence = torch.bucketize(torch.arange(nnz, device=cu.device), cu[1:], right=True)  # (nnz,)
        indices = sequence * max_seqlen + torch.arange(nnz, device=cu.device) - cu[sequence]  # (nnz,)
        key_mask = additive_mask(sequence_mask(cu_seqlens, max_seqlen), dtype)[:, None, None, :]
        return cls(cu_seqlens, max_seqlen, indices, key_mask)


def flash_varlen_attention(q, k, v, batch: VarlenBatch, scaling: float, dropout: float) -> torch.Tensor:
    """flash-attention's variable-length kernel (CUDA, fp16/bf16): no padding anywhere."""
    cu, t = batch.cu_seqlens, batch.max_seqlen
    return flash_attn_varlen_func(q, k, v, cu, cu, t, t, dropout_p=dropout, softmax_scale=scaling)


def repadded_attention(q, k, v, batch: VarlenBatch, scaling: float, dropout: float) -> torch.Tensor:
    """SDPA on the sequences laid out left-aligned at their own longest length T' (often shorter than the batch's T),
    padding keys masked. Static shapes and one call: the kernel everywhere but flash-attention's (SDPA on jagged nested
    tensors, the other exact CUDA kernel, spent its time in Python dispatch: benchmarks/NOTES.md, "The padding-free
    path on CUDA")."""
    S = batch.cu_seqlens.shape[0] - 1
    qkv = pad(torch.stack((q, k, v), dim=1), batch.indices, S, batch.max_seqlen)  # (S, T', 3, N, D)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (S, N, T', D)
    key_mask = batch.key_mask.to(q.dtype)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=dropout, scale=scaling)  # (S, N, T', D)
    return unpad(y.transpose(1, 2), batch.indices)  # (nnz, N, D)


def torch_flash_attention(q, k, v, batch: VarlenBatch, scaling: float, dropout: float) -> torch.Tensor:
    """torch's own flash kernel (`aten::_flash_attention_forward`, which SDPA's flash backend runs): flash-attention's
    variable-length algorithm without the package, no padding anywhere. It has a backward, traces under torch.compile,
    and draws its dropout from torch's CUDA generator (a step replays under torch.manual_seed)."""
    cu, t = batch.cu_seqlens, batch.max_seqlen
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, t, t, dropout, False, False, scale=scaling)[0]


TORCH_FLASH: dict[tuple, bool] = {}  # (device, dtype, head dim) -> whether torch's flash kernel takes it


@torch.compiler.assume_constant_result  # traced: decided at trace time, a constant in the graph
def torch_flash_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's flash kernel takes (P, N, head_dim) rows of `dtype` on `device`: CUDA, fp16/bf16, and what SDPA's
    own check accepts (the GPU's generation, the head dim). Decided once per key, said once in the log."""
    key = (device, dtype, head_dim)
    if key not in TORCH_FLASH:
        refusal = torch_flash_refusal(device, dtype, head_dim)
        TORCH_FLASH[key] = refusal is None
        if device.type == "cuda":
            logger.info(f"padding-free attention on {device} in {dtype}: "
                        + (f"SDPA on the sequences re-padded ({refusal})" if refusal else "torch's flash kernel"))
    return TORCH_FLASH[key]


def torch_flash_refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why torch's flash kernel cannot take such rows, or None where it can."""
    if device.type != "cuda":
        return f"torch's flash kernel runs on CUDA only, not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"torch's flash kernel takes float16 and bfloat16, not {dtype}"
    probe = torch.empty(1, 1, 8, head_dim, dtype=dtype, device=device)  # (B, N, T, D), as SDPA checks it
    if not torch.backends.cuda.can_use_flash_attention(torch.backends.cuda.SDPAParams(probe, probe, probe, None, 0.0,
                                                                                      False, False)):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        return f"torch's flash kernel refuses head dim {head_dim} in {dtype} on this GPU (compute capability " \
               f"{capability})"
    return None


def varlen_kernel(q: torch.Tensor):
    """The fastest exact varlen kernel for q's device, dtype and head dim (capabilities detected, never configured):
    flash-attention's where the package is installed (eager), else torch's own flash kernel where it takes q, else
    SDPA on the sequences re-padded."""
    if (q.is_cuda and flash_attn_varlen_func is not None and q.dtype in (torch.float16, torch.bfloat16)
            and not torch.compiler.is_compiling()):
        return flash_varlen_attention
    if torch_flash_takes(q.device, q.dtype, q.shape[-1]):
        return torch_flash_attention
    return repadded_attention


def bucketed_attention(q, k, v, key_mask: torch.Tensor, shapes, scaling: float, dropout: float) -> torch.Tensor:
    """The bucketed layout's attention: q, k, v (P, N, D) -> (P, N, D), one SDPA call per group on views of q, k, v.
    key_mask: (P,) additive, 0 on the rows that hold real tokens, the dtype's minimum on filler rows (masked as keys);
    shapes: (s_g, T_g, filler) per group (bucketed_rows); a group without filler rows attends unmasked."""
    sizes = [s * t for s, t, _ in shapes]
    y = []
    for (s, t, filler), m, qg, kg, vg in zip(shapes, key_mask.split(sizes), q.split(sizes), k.split(sizes),
                                             v.split(sizes)):
        qg, kg, vg = (x.unflatten(0, (s, t)).transpose(1, 2) for x in (qg, kg, vg))  # each (s_g, N, T_g, D)
        mask = m.view(s, 1, 1, t).to(qg.dtype) if filler else None  # (s_g, 1, 1, T_g)
        if dropout:  # training: SDPA's own arithmetic (its math path), with dropout.py's cheaper mask
            weights = torch.softmax(qg @ kg.transpose(-1, -2) * scaling + (0.0 if mask is None else mask), -1)
            yg = apply_dropout(weights, dropout) @ vg  # (s_g, N, T_g, D)
        else:
            yg = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scaling)
        y.append(yg.transpose(1, 2).flatten(0, 1))  # (s_g * T_g, N, D)
    return torch.cat(y) if len(y) > 1 else y[0]


# ---------------------------------------------------------------------------------------------------------------------
# Custom ops for torch.compile: the host-side steps, opaque to the compiler, with data-dependent output sizes
# ---------------------------------------------------------------------------------------------------------------------
def _bucketed_layout(tokens: torch.Tensor, cu_seqlens: torch.Tensor, group_cost: int):
    """tokens (nnz,) positions in the flattened batch, cu_seqlens (S + 1,) -> grid (P,) the position each row holds,
    real (P,) bool, real_rows (nnz,) the rows that hold a real token once, shapes (G, 3)."""
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    rows, real, shapes = bucketed_rows(cu_seqlens, length_groups(seqlens, group_cost), seqlens)
    grid = tokens[rows] if tokens.numel() else tokens.new_zeros(rows.shape)  # no tokens: the filler row, position 0
    return grid, real, real.nonzero().flatten(), shapes


def bucketed_layout(tokens: torch.Tensor, cu_seqlens: torch.Tensor, group_cost: int):
    """`_bucketed_layout`, read on the host; traced, inside a custom op (shapes then a (G, 3) tensor)."""
    if torch.compiler.is_compiling():
        return torch.ops.bert_impl.bucketed_layout(tokens, cu_seqlens, group_cost)
    return _bucketed_layout(tokens, cu_seqlens, group_cost)


def _register_custom_ops() -> None:
    """Once per process (a saved folder's copy of this file, loaded as remote code, finds them registered)."""
    if hasattr(torch.ops.bert_impl, "bucketed_attention"):
        return

    @torch.library.custom_op("bert_impl::nonzero", mutates_args=())
    def nonzero(x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x.flatten()).flatten()

    @nonzero.register_fake
    def _(x):
        return x.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.long)

    @torch.library.custom_op("bert_impl::bucketed_layout", mutates_args=())
    def bucketed_layout(tokens: torch.Tensor, cu_seqlens: torch.Tensor, group_cost: int) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        *tensors, shapes = _bucketed_layout(tokens, cu_seqlens, group_cost)
        return *tensors, torch.tensor(shapes, dtype=torch.long, device=tokens.device).view(-1, 3)

    @bucketed_layout.register_fake
    def _(tokens, cu_seqlens, group_cost):
        ctx = torch.library.get_ctx()
        P, nnz, G = ctx.new_dynamic_size(), ctx.new_dynamic_size(), ctx.new_dynamic_size()
        long = dict(dtype=torch.long, device=tokens.device)
        real = torch.empty(P, dtype=torch.bool, device=tokens.device)
        return torch.empty(P, **long), real, torch.empty(nnz, **long), torch.empty(G, 3, **long)

    @torch.library.custom_op("bert_impl::bucketed_attention", mutates_args=())
    def bucketed_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                              shapes: torch.Tensor, scaling: float) -> torch.Tensor:
        return bucketed_attention(q, k, v, key_mask, shapes.tolist(), scaling, 0.0)

    @bucketed_attention_op.register_fake
    def _(q, k, v, key_mask, shapes, scaling):
        return torch.empty_like(q)


_register_custom_ops()


# ---------------------------------------------------------------------------------------------------------------------
# Packing markers
# ---------------------------------------------------------------------------------------------------------------------
def cu_seqlens_from_markers(cu_seq_lens_q, seq_idx, position_ids, num_sequences: int | None,
                            row_length: int | None = None) -> torch.Tensor:
    """The (S + 1,) int32 boundaries of a packed batch's sequences in its flattened (B * T) tokens, from whichever
    marker the collator gave (position_ids (B, T), restarting in rows of `row_length` tokens; the other markers (1, T)).
    num_sequences: S read on the host (eager, no further sync), or None when traced."""
    if cu_seq_lens_q is not None:
        return cu_seq_lens_q.flatten().to(torch.int32)
    starts = sequence_starts(*(t.flatten() if t is not None else None for t in (position_ids, seq_idx)),
                             row_length)  # (B * T,)
    if num_sequences is None:
        boundaries = torch.ops.bert_impl.nonzero(starts)  # (S,)
    else:
        boundaries = torch.nonzero_static(starts, size=num_sequences).flatten()  # (S,)
    return torch.cat([boundaries, boundaries.new_tensor([starts.numel()])]).to(torch.int32)
