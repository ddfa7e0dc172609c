"""Padding helpers: small pure functions that move between padded (B, T, ...) and unpadded (nnz, ...) layouts.

Vocabulary: B batch, T padded length, nnz real (non-padding) tokens in the batch, cu_seqlens the cumulative sequence
lengths `(S + 1,)` int32 starting at 0 (S sequences; S = B for a padded batch, more for a packed one).
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
