"""The data pipeline of BERT pre-training (Devlin et al., 2019, section 3.1 and appendix A.1), as pure functions and a
collator.

1. Text -> documents -> sentences (`split_documents`): documents are separated by blank lines, sentences are lines
   (the original BERT file format: one sentence per line, a blank line between documents), optionally split further
   with a simple regular expression for text that holds paragraphs on a line.
2. Sentences -> token ids (`tokenize_documents`, run in `datasets.map`, cached, `num_proc`).
3. Documents -> examples (`create_examples_from_document`): `[CLS] A [SEP] B [SEP]` of at most `max_seq_length`
   tokens, token type 0 on `[CLS] A [SEP]` and 1 on `B [SEP]`. B is the text that follows A with probability
   1 - nsp_probability (next_sentence_label 0, IsNext) and otherwise a span of another document (label 1, NotNext),
   the labels of transformers' `BertForPreTraining`. The pair is cut to length by removing tokens from the longer
   segment, at its front or back at random, as Google's create_pretraining_data.py does; with probability
   `short_seq_prob` the example aims at a shorter random length. Deterministic given a seed, whatever `num_proc`.
3'. Or, for the MLM-only objective (RoBERTa's FULL-SENTENCES, as MosaicBERT, Cramming and ModernBERT train):
   documents -> windows (`build_windows`): the documents' tokens joined into one stream, each document followed by
   `[SEP]`, cut into windows of exactly `max_seq_length` tokens, `[CLS]` first; no pairs, no NSP label, no padding.
4. Examples -> batches (`DataCollatorForPreTraining`): padding and dynamic masking, drawn afresh every epoch:
   `mlm_probability` of the tokens (never special tokens nor padding) become prediction targets, of which
   `mask_replace_prob` are replaced with `[MASK]`, `random_replace_prob` with a random token and the rest left
   unchanged; optionally whole words (a word and its `##` pieces) are masked together.

The masking of an example is a function of (seed, epoch, the example's tokens) only: it does not depend on the batch,
the data order, the number of processes or dataloader workers, and a run resumed from a checkpoint masks exactly as
the uninterrupted run did.
"""

import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# A sentence (or document) is a list of token ids; a document a list of sentences.
Sentence = list[int]
Document = list[Sentence]

IS_NEXT, NOT_NEXT = 0, 1  # next_sentence_label values, as in transformers' BertForPreTraining

# A sentence ends at . ! or ? (possibly followed by closing quotes or brackets) before whitespace and an upper-case
# letter, a digit or an opening quote/bracket. Good enough for encyclopedic and book text; abbreviations such as
# "Dr. Smith" are split too, which only moves a sentence boundary.
_SENTENCE_BOUNDARY = re.compile(r"""([.!?]["')\]]*)\s+(?=["'(\[]?[A-Z0-9])""")
_BLANK_LINES = re.compile(r"\n\s*\n")


# ---------------------------------------------------------------------------------------------------------------------
# 1. Text -> documents of sentences
# ---------------------------------------------------------------------------------------------------------------------
def split_sentences(line: str) -> list[str]:
    """One line of prose -> its sentences, split after sentence-final punctuation (see `_SENTENCE_BOUNDARY`)."""
    return [s.strip() for s in _SENTENCE_BOUNDARY.sub("\\1\n", line).split("\n") if s.strip()]


def split_documents(text: str, split_lines: bool = False) -> list[list[str]]:
    """Text -> documents (separated by blank lines) -> sentences (one per non-empty line; each line also split with
    `split_sentences` when `split_lines`). Whitespace-only lines count as blank; empty documents are dropped."""
    documents = []
    for block in _BLANK_LINES.split(text):
        lines = [line.strip() for line in block.split("\n") if line.strip()]
        sentences = [s for line in lines for s in split_sentences(line)] if split_lines else lines
        if sentences:
            documents.append(sentences)
    return documents


# ---------------------------------------------------------------------------------------------------------------------
# 2. Sentences -> token ids
# ---------------------------------------------------------------------------------------------------------------------
def tokenize_documents(batch: dict[str, list], tokenizer, text_column: str, split_lines: bool) -> dict[str, list]:
    """A `datasets.map(batched=True)` function: rows of text -> rows of tokenized documents.

    batch[text_column]: N texts, each holding one or more documents (see `split_documents`).
    Returns {"sentences": M documents}, each a list of sentences, each a list of token ids without special tokens.
    M may differ from N; sentences without tokens and documents without sentences are dropped.
    """
    documents = [doc for text in batch[text_column] if text for doc in split_documents(text, split_lines)]
    flat = [sentence for doc in documents for sentence in doc]
    ids = tokenizer(flat, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False,
                    verbose=False)["input_ids"] if flat else []
    out, start = [], 0
    for doc in documents:
        sentences = [s for s in ids[start:start + len(doc)] if s]
        start += len(doc)
        if sentences:
            out.append(sentences)
    return {"sentences": out}


# ---------------------------------------------------------------------------------------------------------------------
# 3. Documents -> [CLS] A [SEP] B [SEP] examples with NSP labels
# ---------------------------------------------------------------------------------------------------------------------
def truncate_seq_pair(tokens_a: list, tokens_b: list, max_num_tokens: int, rng: random.Random) -> tuple[list, list]:
    """Cut (A, B) to at most `max_num_tokens` tokens together: one token at a time from the longer segment (B on a
    tie), from its front or its back with equal probability. Returns the two kept slices (new lists)."""
    spans = [[0, len(tokens_a)], [0, len(tokens_b)]]  # [start, end) kept of A and of B
    length = lambda span: span[1] - span[0]
    while length(spans[0]) + length(spans[1]) > max_num_tokens:
        longer = spans[0] if length(spans[0]) > length(spans[1]) else spans[1]
        if rng.random() < 0.5:
            longer[0] += 1
        else:
            longer[1] -= 1
    return tokens_a[spans[0][0]:spans[0][1]], tokens_b[spans[1][0]:spans[1][1]]


def pack_pair(tokens_a: Sentence, tokens_b: Sentence, next_sentence_label: int, cls_id: int, sep_id: int) -> dict:
    """(A, B, label) -> {"input_ids": [CLS] A [SEP] B [SEP], "token_type_ids": 0 on [CLS] A [SEP], 1 on B [SEP],
    "next_sentence_label"}."""
    return {
        "input_ids": [cls_id, *tokens_a, sep_id, *tokens_b, sep_id],
        "token_type_ids": [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1),
        "next_sentence_label": next_sentence_label,
    }


def random_segment(documents: Sequence[Document], index: int, target_length: int, rng: random.Random) -> Sentence:
    """The NotNext B: sentences of a random document other than documents[index] (the same one when it is the only
    one), from a random sentence on, until `target_length` tokens (at least one sentence)."""
    other = index
    if len(documents) > 1:
        other = rng.randrange(len(documents) - 1)
        other += other >= index  # uniform over the other documents
    document = documents[other]
    tokens = []
    for sentence in document[rng.randrange(len(document)):]:
        tokens.extend(sentence)
        if len(tokens) >= target_length:
            break
    return tokens


def create_examples_from_document(
    documents: Sequence[Document],
    index: int,
    rng: random.Random,
    max_seq_length: int = 128,
    short_seq_prob: float = 0.1,
    nsp_probability: float = 0.5,
    cls_id: int = 101,
    sep_id: int = 102,
) -> list[dict]:
    """All the examples of documents[index] (Google's create_instances_from_document, with two changes noted below).

    documents: any sequence of documents (a list, or a lazy view of a tokenized dataset); documents[index] is split
    into examples, the other documents only supply NotNext segments. rng: the only source of randomness.

    Sentences are gathered into a chunk until it reaches the target length (max_seq_length - 3, or with probability
    `short_seq_prob` a random length in [2, max_seq_length - 3]); A is the chunk's first 1..n-1 sentences. With
    probability `nsp_probability` B comes from another document (label NOT_NEXT) and the chunk's sentences after A
    are put back for the next example; otherwise B is the rest of the chunk (label IS_NEXT). Then the pair is
    truncated with `truncate_seq_pair`.

    Changes from Google's code, so that NotNext is drawn with probability exactly `nsp_probability`: the label is
    drawn first, and an IsNext chunk of a single sentence takes the document's next sentence as B (or, at the end of
    the document, is split inside the sentence) instead of falling back to NotNext. The short target length is drawn
    again for every example, not once per document.
    """
    document = documents[index]
    max_num_tokens = max_seq_length - 3

    def draw_target() -> int:
        return rng.randint(2, max_num_tokens) if rng.random() < short_seq_prob else max_num_tokens

    examples = []
    target = draw_target()
    chunk, chunk_length, i = [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target:
            is_random_next = rng.random() < nsp_probability
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
            if is_random_next:
                tokens_b = random_segment(documents, index, target - len(tokens_a), rng)
                i -= len(chunk) - a_end  # the sentences after A were not used: start the next chunk with them
            elif len(chunk) >= 2:
                tokens_b = [t for sentence in chunk[a_end:] for t in sentence]
            elif i + 1 < len(document):  # a single long sentence: B is the next one
                i += 1
                tokens_b = list(document[i])
            elif len(tokens_a) >= 2:  # the document's last sentence alone: B is its end
                cut = rng.randint(1, len(tokens_a) - 1)
                tokens_a, tokens_b = tokens_a[:cut], tokens_a[cut:]
            else:  # a one-token sentence cannot be split
                tokens_b, is_random_next = random_segment(documents, index, target - 1, rng), True
            tokens_a, tokens_b = truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
            examples.append(pack_pair(tokens_a, tokens_b, NOT_NEXT if is_random_next else IS_NEXT, cls_id, sep_id))
            chunk, chunk_length = [], 0
            target = draw_target()
        i += 1
    return examples


def document_rng(seed: int, index: int) -> random.Random:
    """The random generator of document `index`: examples depend on (seed, document) only, not on batching."""
    return random.Random(f"bert-pretraining-examples:{seed}:{index}")


class DatasetDocuments(Sequence):
    """A lazy `Sequence[Document]` over a tokenized `datasets.Dataset` (column "sentences"), read row by row, so that
    NotNext segments come from the whole corpus without loading it."""

    def __init__(self, dataset, column: str = "sentences"):
        self.dataset, self.column = dataset, column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Document:
        return self.dataset[int(index)][self.column]


def build_examples(
    batch: dict[str, list],
    indices: list[int],
    documents: Sequence[Document] | None = None,
    seed: int = 0,
    **example_kwargs,
) -> dict[str, list]:
    """A `datasets.map(batched=True, with_indices=True)` function: tokenized documents -> examples.

    batch["sentences"]: the documents of this batch, at dataset `indices`. documents: the whole corpus (a
    `DatasetDocuments`) to draw NotNext segments from; None (streaming) draws them from this batch only.
    example_kwargs: `create_examples_from_document`'s max_seq_length, short_seq_prob, nsp_probability, cls_id, sep_id.
    Returns columns input_ids, token_type_ids, next_sentence_label (one row per example).
    """
    out = {"input_ids": [], "token_type_ids": [], "next_sentence_label": []}
    for position, index in enumerate(indices):
        source, where = (documents, index) if documents is not None else (batch["sentences"], position)
        for example in create_examples_from_document(source, where, document_rng(seed, index), **example_kwargs):
            for key, value in example.items():
                out[key].append(value)
    return out


def build_windows(batch: dict[str, list], max_seq_length: int, cls_id: int, sep_id: int) -> dict[str, list]:
    """A `datasets.map(batched=True)` function: tokenized documents -> windows of contiguous text (the MLM objective).

    batch["sentences"]: documents, each a list of sentences of token ids. Their tokens are joined into one stream, a
    `[SEP]` after each document, and the stream is cut into windows of `max_seq_length - 1` tokens, each given a
    `[CLS]` in front: every window is exactly `max_seq_length` tokens, with no padding. The stream's remainder (shorter
    than a window) is dropped, as transformers' run_mlm.py `group_texts` drops it, once per map batch: with the default
    map batch of 1,000 documents that loses under one window per 1,000 documents.
    Returns {"input_ids": windows}."""
    stream = []
    for document in batch["sentences"]:
        for sentence in document:
            stream.extend(sentence)
        stream.append(sep_id)
    width = max_seq_length - 1
    return {"input_ids": [[cls_id, *stream[start:start + width]]
                          for start in range(0, len(stream) - width + 1, width)]}


def document_positions(input_ids: np.ndarray, sep_id: int) -> np.ndarray:
    """(B, T) token ids of windows -> (B, T) position ids that restart at 0 at each window's start and after each
    `[SEP]` (where a document ends): the packing markers with which the model keeps attention inside a document
    (`--document_attention`), and positions that count from each document's start."""
    B, T = input_ids.shape
    starts = np.zeros((B, T), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == sep_id
    index = np.broadcast_to(np.arange(T), (B, T))
    start_of = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return index - start_of


# ---------------------------------------------------------------------------------------------------------------------
# 4. Examples -> padded, dynamically masked batches
# ---------------------------------------------------------------------------------------------------------------------
def example_key(input_ids: Sequence[int]) -> int:
    """A 63-bit digest of an example's token ids: with the seed and the epoch, it keys the example's masking."""
    digest = hashlib.blake2b(np.asarray(input_ids, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def whole_word_starts(input_ids: np.ndarray, maskable: np.ndarray, is_continuation: np.ndarray) -> np.ndarray:
    """(T,) bool: True on the first piece of each maskable word. A piece starts a word unless it is a `##`
    continuation that follows a maskable piece (a `##` piece right after [SEP] or [CLS] is a word of its own)."""
    previous_maskable = np.concatenate([[False], maskable[:-1]])
    return maskable & ~(is_continuation[input_ids] & previous_maskable)


def mask_tokens(
    input_ids: np.ndarray,
    maskable: np.ndarray,
    rng: np.random.Generator,
    mask_token_id: int,
    vocab_size: int,
    mlm_probability: float = 0.15,
    mask_replace_prob: float = 0.8,
    random_replace_prob: float = 0.1,
    word_starts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Mask one example. input_ids, maskable: (T,). Returns (masked input ids (T,), labels (T,) with the original id
    at the selected positions and -100 elsewhere).

    Each maskable token is selected with probability `mlm_probability`; with `word_starts` (T,) each whole word is
    (a word: a start and the continuation pieces after it), so the expected share of selected tokens is the same.
    Each selected token independently becomes `[MASK]` (mask_replace_prob), a uniformly random id of the vocabulary
    (random_replace_prob) or stays as it is (the rest). The same number of draws is made whatever is selected.
    """
    T = input_ids.shape[0]
    if word_starts is None:
        selected = maskable & (rng.random(T) < mlm_probability)
    else:
        word = np.cumsum(word_starts) - 1  # (T,) index of the word each piece belongs to (-1 before the first word)
        word_selected = rng.random(T) < mlm_probability  # one draw per word, indexed by the word's number
        selected = maskable & word_selected[np.maximum(word, 0)]
    kind = rng.random(T)  # < mask_replace_prob: [MASK]; then < mask + random: a random token; else unchanged
    random_ids = rng.integers(0, vocab_size, size=T)
    labels = np.where(selected, input_ids, -100)
    masked = input_ids.copy()
    masked[selected & (kind < mask_replace_prob)] = mask_token_id
    use_random = selected & (kind >= mask_replace_prob) & (kind < mask_replace_prob + random_replace_prob)
    masked[use_random] = random_ids[use_random]
    return masked, labels


@dataclass
class DataCollatorForPreTraining:
    """Pads BERT pre-training examples and masks them, afresh every epoch.

    Takes the options of transformers' `DataCollatorForLanguageModeling` (mlm_probability, mask_replace_prob,
    random_replace_prob, whole_word_mask, pad_to_multiple_of, seed) and adds NSP labels and token type ids.

    features: examples with "input_ids" (T_i,), optionally "token_type_ids" (T_i,), "next_sentence_label" () and
    "mask_epoch" () (the pass over the data the example is drawn in, which then keys its masks instead of `epoch`:
    the phased sampler of run_pretraining.py passes it, since a phased run is one Trainer epoch).
    Returns LongTensors input_ids, token_type_ids, attention_mask, labels (B, T) (-100 where nothing is predicted,
    padding included), and next_sentence_label (B,) when the examples have it; T is the longest example, rounded up to
    `pad_to_multiple_of`. With `document_positions_for` (the [SEP] id), also position_ids (B, T) restarting at each
    document (`document_positions`), for `--document_attention`.

    The masking of an example is drawn from a generator keyed by (seed, epoch, the example's token ids); the training
    loop calls `set_epoch` (see `MaskingEpochCallback` in run_pretraining.py). Two identical examples are masked alike
    within an epoch. Special tokens (the tokenizer's `all_special_ids`) and padding are never selected. Unlike
    transformers' whole-word collator, whole-word masking keeps the random/unchanged replacements, token by token, as
    Google's implementation does.
    """

    tokenizer: Any
    mlm_probability: float = 0.15
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    whole_word_mask: bool = False
    pad_to_multiple_of: int | None = None
    seed: int = 0
    epoch: int = 0
    document_positions_for: int | None = None
    special_ids: np.ndarray = field(init=False, repr=False)
    is_continuation: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        if self.tokenizer.mask_token_id is None or self.tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a mask token and a padding token")
        for name in ("mlm_probability", "mask_replace_prob", "random_replace_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.mask_replace_prob + self.random_replace_prob > 1.0:
            raise ValueError("mask_replace_prob + random_replace_prob must not exceed 1")
        self.vocab_size = len(self.tokenizer)
        self.special_ids = np.asarray(sorted(set(self.tokenizer.all_special_ids)), dtype=np.int64)
        self.is_continuation = np.zeros(self.vocab_size, dtype=bool)  # (V,) True on "##" pieces
        for token, token_id in self.tokenizer.get_vocab().items():
            if token.startswith("##") and token_id < self.vocab_size:
                self.is_continuation[token_id] = True

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def example_rng(self, input_ids: np.ndarray, epoch: int | None = None) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch if epoch is None else int(epoch), example_key(input_ids)])

    def mask_example(self, input_ids: Sequence[int], epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(T,) token ids -> (masked ids (T,), labels (T,)); see `mask_tokens`. `epoch` overrides the collator's."""
        ids = np.asarray(input_ids, dtype=np.int64)
        maskable = ~np.isin(ids, self.special_ids)
        starts = whole_word_starts(ids, maskable, self.is_continuation) if self.whole_word_mask else None
        return mask_tokens(
            ids, maskable, self.example_rng(ids, epoch), self.tokenizer.mask_token_id, self.vocab_size,
            self.mlm_probability, self.mask_replace_prob, self.random_replace_prob, starts,
        )

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        B = len(features)
        T = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = np.full((B, T), self.tokenizer.pad_token_id, dtype=np.int64)
        labels = np.full((B, T), -100, dtype=np.int64)
        token_type_ids = np.zeros((B, T), dtype=np.int64)
        attention_mask = np.zeros((B, T), dtype=np.int64)
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            input_ids[row, :n], labels[row, :n] = self.mask_example(feature["input_ids"], feature.get("mask_epoch"))
            if feature.get("token_type_ids") is not None:
                token_type_ids[row, :n] = feature["token_type_ids"]
            attention_mask[row, :n] = 1
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_type_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
        }
        if "next_sentence_label" in features[0]:
            batch["next_sentence_label"] = torch.tensor([int(f["next_sentence_label"]) for f in features])
        if self.document_positions_for is not None:
            originals = np.where(labels != -100, labels, input_ids)  # the positions follow the unmasked text
            batch["position_ids"] = torch.from_numpy(document_positions(originals, self.document_positions_for))
        return batch


# ---------------------------------------------------------------------------------------------------------------------
# Metrics: MLM predictions whatever the layout of the model's prediction logits
# ---------------------------------------------------------------------------------------------------------------------
def masked_lm_targets(prediction_logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and targets of the masked positions. labels: (B, T), -100 where nothing is predicted.
    prediction_logits: (B, T, V) for every position, or (M, V) for the M masked positions only (row-major order).
    Returns (M, V) logits and (M,) target ids."""
    selected = labels != -100  # (B, T)
    if prediction_logits.shape[:-1] == labels.shape:
        return prediction_logits[selected], labels[selected]
    if prediction_logits.dim() == 2 and prediction_logits.shape[0] == selected.sum():
        return prediction_logits, labels[selected]
    raise ValueError(
        f"prediction_logits of shape {tuple(prediction_logits.shape)} match neither every position nor the masked "
        f"positions of labels {tuple(labels.shape)}"
    )

