"""Padding helpers: small pure functions that move between padded (B, T, ...) and unpadded (nnz, ...) layouts.

Vocabulary: B batch, T padded length, nnz real (non-padding) tokens in the batch, cu_seqlens the cumulative sequence
lengths `(S + 1,)` int32 starting at 0 (S sequences; S = B for a padded batch, more for a packed one). The bucketed
layout (CPU) groups the sequences by length and pads each group g of s_g sequences to its longest, T_g: P rows in all.
"""

import torch
import torch.nn.functional as F


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


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids: (nnz,) restarting at 0 for every packed sequence -> cu_seqlens (S + 1,)."""
    starts = torch.nonzero(position_ids == 0, as_tuple=False).flatten()  # (S,)
    return torch.cat([starts, starts.new_tensor([position_ids.numel()])]).to(torch.int32)


def cu_seqlens_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """seq_idx: (nnz,) the index of the packed sequence of each token (non-decreasing) -> cu_seqlens (S + 1,)."""
    _, counts = torch.unique_consecutive(seq_idx, return_counts=True)  # (S,)
    return F.pad(torch.cumsum(counts, dim=0, dtype=torch.int32), (1, 0))


def sequence_mask(cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """cu_seqlens (S + 1,) -> (S, max_seqlen) bool, True on the real tokens of each (left-aligned) sequence."""
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).unsqueeze(-1)  # (S, 1)
    return torch.arange(max_seqlen, device=cu_seqlens.device) < seqlens


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


def bucketed_rows(cu_seqlens: torch.Tensor, groups: list[list[int]]):
    """cu_seqlens (S + 1,) over nnz tokens, groups from `length_groups` -> the rows of the bucketed layout:

    rows (P,): the token each row holds; group after group, sequence after sequence, a sequence's tokens then copies
        of its last token up to its group's longest length T_g (P = sum of s_g * T_g);
    real (P,) bool: the rows that hold their token for the first time (nnz of them);
    first (S,): the row of each sequence's first token (0 for an empty sequence);
    shapes: (s_g, T_g) per group."""
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # (S,)
    first = torch.zeros_like(starts)
    rows, real, shapes, offset = [], [], [], 0
    for group in groups:
        g = torch.tensor(group, device=starts.device)  # (s_g,)
        T_g = int(lengths[g].max())
        pos = torch.arange(T_g, device=starts.device)  # (T_g,)
        rows.append((starts[g, None] + torch.minimum(pos, lengths[g, None] - 1)).flatten())  # (s_g * T_g,)
        real.append((pos < lengths[g, None]).flatten())
        first[g] = offset + torch.arange(len(group), device=starts.device) * T_g
        shapes.append((len(group), T_g))
        offset += len(group) * T_g
    empty = starts.new_zeros(0)
    return (torch.cat(rows) if rows else empty), (torch.cat(real) if real else empty.bool()), first, shapes
