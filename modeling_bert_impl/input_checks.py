"""Input validation for the encoder and its heads. Bad input is a ValueError that names the argument, the value and
the valid range; it never surfaces as a traceback from deep inside torch.

Shapes and dtypes are known on the host and checked at once. Values are not: every value check is a `ValueCheck`
(a 0-d tensor, the lowest and highest allowed, a message), and all of a forward's checks, the encoder's (ids, masks,
packing markers) and its head's (labels, from the `*_label_checks` helpers, passed to the encoder as
`label_checks`), are read in ONE host-device transfer together with the facts the forward needs about the batch
(`BatchFacts`). Under torch.compile and torch.export nothing is read: the checks become one assert in the graph.
"""

from typing import NamedTuple

import torch

from .bert_padding import cu_seqlens_from_markers, packed_position_ids, sequence_starts

IGNORE_INDEX = -100  # a label that no loss counts (padding, special tokens, unmasked positions), as in transformers
# The one torch gate. Tracing the model needs torch 2.13: on older releases torch.export fails a guard on the dynamic
# batch, torch.compile pools a packed batch to one row, torch 2.6 has no torch.compiler.is_exporting, and inductor's CPU
# lowering of flex attention fails on this model's masks. What traces refuses there (`require_tracing_torch`): a traced
# forward, flex attention, compile_for_inference (torch.export and AOTInductor) and ONNX export (torch.export).
TRACING_TORCH = (2, 13)
TRACING_SUPPORTED = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= TRACING_TORCH


def require_tracing_torch(feature: str, instead: str) -> None:
    """A ValueError where `feature` traces the model (or compiles with inductor) and this torch is older than
    TRACING_TORCH. `instead`: what the user can do without upgrading."""
    if not TRACING_SUPPORTED:
        raise ValueError(f"{feature} needs torch >= {'.'.join(map(str, TRACING_TORCH))} (installed: "
                         f"{torch.__version__}); upgrade torch, {instead}")


def refuse_cross_attention(kwargs: dict) -> None:
    """A decoder's inputs, which this bidirectional encoder has no cross-attention to read (stock BERT's encoder skips
    them without a word): a ValueError naming the argument, so that no caller believes they were attended."""
    for name in ("encoder_hidden_states", "encoder_attention_mask"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} was given, but bert-impl is a bidirectional encoder without cross-attention: it "
                             "would not read it. For a decoder that attends to an encoder's states, take transformers' "
                             "BertLMHeadModel (is_decoder=True, add_cross_attention=True)")


class ValueCheck(NamedTuple):
    value: torch.Tensor  # 0-d
    low: float  # lowest allowed
    high: float  # highest allowed
    message: str  # "{}" where the value goes


class BatchFacts(NamedTuple):
    """What the host read about a batch with its checks; None where only the host could say (eager reads them, a
    traced graph does not)."""

    marked: bool  # cu_seq_lens_q or seq_idx given: packing markers that need no read
    packable: bool  # marked, or position_ids without a mask (packed where they restart)
    mask_has_padding: bool | None  # a 0 in the attention mask (None: traced with a mask and no markers: unknown)
    nnz: int | None  # real tokens
    max_seqlen: int | None  # the longest sequence
    num_sequences: int | None  # S found by the packing markers (B where none mark sequences)


class Batch(NamedTuple):
    """One forward's batch as `read_batch` read it: what the embeddings and the layouts (layouts.py) need."""

    shape: tuple[int, int]  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T) over the tokens (a (B, C + T) mask over cached keys split off)
    facts: BatchFacts
    packs: torch.Tensor | None  # (S + 1,) int32: where the sequences of a packed batch start and end; None unpacked
    position_ids: torch.Tensor | None  # as given, or (1, T) restarting at 0 in each sequence packed by the markers
    max_seqlen: int | None  # the longest sequence: read on the host, or given (max_length_q); None when traced
    cache: object | None  # a transformers Cache of C keys and values per layer (prefix tuning), or None
    cache_length: int  # C
    rows_to_skip: bool  # padding or packing that the padding-free layouts would skip


def read_batch(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, cu_seq_lens_q,
               cu_seq_lens_k, max_length_q, seq_idx, cache=None, label_checks=(), position_offset: int = 0) -> Batch:
    """Validate a forward's inputs (`check_inputs`, with a head's `label_checks`) and read what the rest of the
    forward needs: whether and where sequences are packed (`is_packed`), their positions (restarting at
    `position_offset` in each packed sequence: 0 for BERT, padding_idx + 1 for RoBERTa), and whether there is anything
    for a padding-free layout to skip (`has_rows_to_skip`)."""
    C = cache.get_seq_length() if cache is not None else 0  # cached keys ahead of the tokens (prefix tuning)
    attention_mask, cache_checks = split_cache_mask(attention_mask, C, input_ids, inputs_embeds)  # (B, T)
    B, T, facts = check_inputs(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               cu_seq_lens_q, cu_seq_lens_k, seq_idx, [*cache_checks, *label_checks], position_offset)
    packed = is_packed(facts, B)
    rows = position_ids.expand(B, T) if packed and position_ids is not None else position_ids  # (B, T)
    packs = cu_seqlens_from_markers(cu_seq_lens_q, seq_idx, rows, facts.num_sequences, T) if packed else None
    if packs is not None and position_ids is None:
        position_ids = packed_position_ids(packs, T) + position_offset  # (1, T)
    return Batch((B, T), attention_mask, facts, packs, position_ids, facts.max_seqlen or max_length_q, cache, C,
                 has_rows_to_skip(facts, packed))


def is_packed(facts: BatchFacts, B: int) -> bool:
    """Sequences packed in rows: marked (one row), or (eager) more sequences than rows found where position_ids restart
    (as transformers' BERT reads them from 5.25 on: `DataCollatorWithFlattening`'s one row, or several), or (under
    torch.compile, which reads nothing) position_ids without a mask; under torch.export only the markers."""
    if not torch.compiler.is_compiling():
        return facts.marked or facts.num_sequences > B
    return facts.marked or (facts.packable and not torch.compiler.is_exporting())  # torch 2.6 has no is_exporting


def has_rows_to_skip(facts: BatchFacts, packed: bool) -> bool:
    """Whether a padding-free layout would skip anything: real tokens with padding beside them, or packed sequences.
    Traced, the mask decides at run time, except under torch.export, whose graph keeps the padded rows (no
    data-dependent shapes)."""
    if not torch.compiler.is_compiling():
        return facts.nnz > 0 and (packed or facts.mask_has_padding)
    return not torch.compiler.is_exporting() and (packed or facts.mask_has_padding is not False)


def check_inputs(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, cu_seq_lens_q,
                 cu_seq_lens_k, seq_idx, label_checks=(), position_offset: int = 0) -> tuple[int, int, BatchFacts]:
    """Validate the encoder's inputs (and a head's `label_checks`; positions, where none are given, from
    `position_offset`). Returns B, T and the facts about the batch. Eager: every value check and fact in one
    host-device transfer. Traced: one runtime assert, facts None."""
    B, T = _check_shapes(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         cu_seq_lens_q, cu_seq_lens_k, seq_idx, position_offset)
    marked = cu_seq_lens_q is not None or seq_idx is not None
    packable = marked or (attention_mask is None and position_ids is not None)
    checks = _value_checks(config, input_ids, attention_mask, token_type_ids, position_ids, cu_seq_lens_q,
                           cu_seq_lens_k, marked, T) + list(label_checks)

    if torch.compiler.is_compiling():
        require_tracing_torch("tracing a bert-impl model (torch.compile, torch.export)", "or run the model eagerly")
        if checks:
            device = checks[0].value.device
            values = torch.stack([c.value.double().to(device) for c in checks])
            low, high = (values.new_tensor([c[i] for c in checks]) for i in (1, 2))
            torch._assert_async(((values >= low) & (values <= high)).all(),
                                "bert-impl: an input value is out of range; run the model eagerly for which")
        return B, T, BatchFacts(marked, packable, None if attention_mask is not None and not marked else False, None,
                                None, None)

    # Eager: the batch's own statistics in the same read.
    facts = []
    if attention_mask is not None:
        real = attention_mask != 0
        facts += [real.sum(), real.sum(-1).max()]  # real tokens, longest sequence
    if packable and cu_seq_lens_q is not None:
        cu = cu_seq_lens_q
        facts += [cu.new_tensor(cu.shape[0] - 1), (cu[1:] - cu[:-1]).max()]  # sequences, longest sequence
    elif packable:  # the sequences and the longest run between their starts
        starts = sequence_starts(position_ids.expand(B, T).flatten() if position_ids is not None else None,
                                 seq_idx.flatten() if seq_idx is not None else None, T)  # (B * T,)
        tokens = torch.arange(starts.numel(), device=starts.device)
        start_of = torch.cummax(torch.where(starts, tokens, 0), 0).values
        facts += [starts.sum(), (tokens - start_of).max() + 1]
    read = [c.value for c in checks] + facts
    device = read[0].device if read else None
    # the one transfer: float64 holds every value exactly (int64 ones up to 2^53); stack promotes int64 to it
    read = [t if t.dtype in (torch.int64, torch.float64) else t.double() for t in read]
    stacked = torch.stack([t.to(device) for t in read]).double().tolist() if read else []
    values, facts = stacked[:len(checks)], [int(f) for f in stacked[len(checks):]]
    for value, check in zip(values, checks):
        if not check.low <= value <= check.high:  # NaN fails too
            raise ValueError(check.message.format(int(value) if value.is_integer() else value))

    nnz, max_seqlen = facts[:2] if attention_mask is not None else (B * T, T)
    num_sequences, packed_max = facts[-2:] if packable else (B, None)
    if marked or num_sequences > B:  # the longest sequence is the longest packed one
        max_seqlen = packed_max
    # bool(): under TorchScript's tracer B and T are tensors, and the path compares `padding` with False by identity
    return B, T, BatchFacts(marked, packable, bool(nnz < B * T), nnz, max_seqlen, num_sequences)


def split_cache_mask(attention_mask, cache_length: int, input_ids, inputs_embeds) -> tuple:
    """A mask over C cached keys and the T tokens, (B, C + T), as peft's prefix tuning passes it, split into the tokens'
    (B, T) mask and a check that the cached keys are all attended (ones). Any other mask is returned as it is."""
    tokens = input_ids if input_ids is not None else inputs_embeds
    if attention_mask is None or not cache_length or tokens is None or tokens.dim() < 2 \
            or attention_mask.shape[-1] != cache_length + tokens.shape[1]:
        return attention_mask, []
    cached = attention_mask[..., :cache_length] == 0
    check = ValueCheck(cached.sum(), 0, 0, f"attention_mask's first {cache_length} columns cover the cache's keys "
                       f"(prefix tuning's virtual tokens) and must be 1; {{}} of them are 0")
    return attention_mask[..., cache_length:], [check]


def _check_shapes(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, cu_seq_lens_q,
                  cu_seq_lens_k, seq_idx, position_offset: int = 0) -> tuple[int, int]:
    """Shapes and dtypes, on the host: B, T, or a ValueError."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(
                f"inputs_embeds must be (batch, seq_len, {config.hidden_size}), got shape {tuple(inputs_embeds.shape)}"
            )
        B, T = inputs_embeds.shape[:2]
    if B == 0:
        raise ValueError("empty batch: the batch size is 0")
    if T == 0:
        raise ValueError("empty sequences: seq_len is 0")
    for name, t in (("input_ids", input_ids), ("token_type_ids", token_type_ids), ("position_ids", position_ids),
                    ("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k), ("seq_idx", seq_idx)):
        if t is not None and not is_integer(t):
            raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if t is not None and tuple(t.shape) != (B, T):
            raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has shape {(B, T)}")
    if position_ids is not None and (
        position_ids.dim() != 2 or position_ids.shape[1] != T or position_ids.shape[0] not in (1, B)
    ):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected (1, {T}) or ({B}, {T})")
    if position_ids is None and position_offset + T > config.max_position_embeddings:
        longest = config.max_position_embeddings - position_offset
        raise ValueError(
            f"sequence length {T} is longer than the position table takes (max_position_embeddings="
            f"{config.max_position_embeddings}" + (f", positions from {position_offset}: {longest} tokens" if
                                                   position_offset else "") + "); truncate the input"
        )
    if (cu_seq_lens_q is not None or seq_idx is not None) and B != 1:
        raise ValueError(f"a packed batch has batch size 1 (sequences concatenated), got input of shape {(B, T)}")
    if cu_seq_lens_k is not None and (cu_seq_lens_q is None or cu_seq_lens_k.shape != cu_seq_lens_q.shape):
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q: BERT's self-attention has one set of sequences")
    if cu_seq_lens_q is not None and (cu_seq_lens_q.dim() != 1 or cu_seq_lens_q.shape[0] < 2):
        raise ValueError(f"cu_seq_lens_q must be (num_sequences + 1,), got shape {tuple(cu_seq_lens_q.shape)}")
    if seq_idx is not None and seq_idx.numel() != T:
        raise ValueError(f"seq_idx has shape {tuple(seq_idx.shape)}; expected (1, {T})")
    return B, T


def _value_checks(config, input_ids, attention_mask, token_type_ids, position_ids, cu_seq_lens_q, cu_seq_lens_k,
                  marked: bool, T: int) -> list[ValueCheck]:
    """The encoder's value checks, unread."""
    V, types, positions = config.vocab_size, config.type_vocab_size, config.max_position_embeddings
    checks = []
    if input_ids is not None:
        checks += _min_max(input_ids, 0, V - 1, f"token id {{}} is outside the vocabulary [0, {V})")
    if token_type_ids is not None:
        checks += _min_max(token_type_ids, 0, types - 1, f"token type id {{}} is outside [0, type_vocab_size={types})")
    if position_ids is not None:
        checks += _min_max(position_ids, 0, positions - 1,
                           f"position id {{}} is outside the position table [0, {positions})")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        message = "attention_mask holds {}; expected 0 (padding) or 1 (token)"
        if is_integer(attention_mask):  # 0 and 1 only: the smallest and largest in [0, 1]
            checks += _min_max(attention_mask, 0, 1, message)
        else:  # the first value that is neither 0 nor 1, else 0
            bad = ((attention_mask != 0) & (attention_mask != 1)).flatten()
            value = torch.where(bad, attention_mask.flatten(), 0).gather(0, bad.int().argmax()[None])[0]
            checks.append(ValueCheck(value, 0, 0, message))
    if cu_seq_lens_q is not None:
        cu = cu_seq_lens_q
        checks += [ValueCheck(cu[0], 0, 0, "cu_seq_lens_q starts at {}; expected 0 (cumulative sequence lengths)"),
                   ValueCheck(cu[-1], T, T, f"cu_seq_lens_q ends at {{}}; expected the packed length {T}"),
                   ValueCheck((cu[1:] - cu[:-1]).min(), 1, float("inf"),
                              "cu_seq_lens_q must increase strictly (cumulative lengths of non-empty sequences); a "
                              "step of {} found")]
        if cu_seq_lens_k is not None:
            checks.append(ValueCheck((cu_seq_lens_k != cu).sum(), 0, 0,
                                     "cu_seq_lens_k must equal cu_seq_lens_q; {} entries differ"))
    if marked and attention_mask is not None:
        checks.append(ValueCheck((attention_mask == 0).sum(), 0, 0, "a packed batch (cu_seq_lens_q or seq_idx) has no "
                                 "padding: its attention_mask must be all ones, it has {} zeros"))
    return checks


def _min_max(t: torch.Tensor, low: float, high: float, message: str) -> list[ValueCheck]:
    """Every value of t in [low, high]: its smallest and its largest (in one pass eagerly; traced, as min and max: the
    ONNX exporter has no aminmax over a whole tensor)."""
    smallest, largest = (t.min(), t.max()) if torch.compiler.is_compiling() else torch.aminmax(t)
    return [ValueCheck(smallest, low, high, message), ValueCheck(largest, low, high, message)]


def is_integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


# ---------------------------------------------------------------------------------------------------------------------
# Labels: each head builds its checks with these and passes them to the encoder (`label_checks`)
# ---------------------------------------------------------------------------------------------------------------------
def class_label_checks(name: str, labels: torch.Tensor | None, num_classes: int, bound: str, what: str,
                       hint: str = "") -> list[ValueCheck]:
    """Class ids in [0, num_classes), or IGNORE_INDEX. `bound` names num_classes in messages ("num_labels=3"),
    `what` the ids ("class ids", "token ids"). A non-integer dtype is refused at once (`hint` says what else to do)."""
    if labels is None:
        return []
    if not is_integer(labels):
        raise ValueError(f"{name} must hold integer {what}, got dtype {labels.dtype}{hint}")
    message = f"{name} holds {{}}; expected {what} in [0, {bound}) or {IGNORE_INDEX} (ignored)"
    return _min_max(labels.masked_fill(labels == IGNORE_INDEX, 0), 0, num_classes - 1, message)


def position_label_checks(**positions: torch.Tensor | None) -> list[ValueCheck]:
    """Question answering's start/end positions: integer token indices (any value: outside the sequence they are
    clamped and ignored, as in transformers). Nothing to read."""
    for name, t in positions.items():
        if t is not None and not is_integer(t):
            raise ValueError(f"{name} must hold integer token indices, got dtype {t.dtype}")
    return []
