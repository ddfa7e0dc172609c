"""What the server runs: a model folder (or Hub id) loaded into bert-impl's classes, the CPU inference engine chosen
for it (or the model itself on CUDA), and what the routes ask of it: pooled embeddings, class scores, relevance
scores.

Shapes: B inputs of a batch, T tokens (the longest), H hidden, C labels.
"""

import json
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import cached_file

from ..inference import compile_for_inference, cpu_bf16_units, optimize_for_inference, quantize_for_inference
from ..integrations.tasks import auto_class_of, head_class

# pooling -> the sentence-transformers Pooling config's field that chooses it
POOLINGS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Encoding(NamedTuple):
    """One input: its token ids and their token types (all 0 for a single text)."""

    ids: list[int]
    types: list[int]


@dataclass
class EngineChoice:
    """The engine a server runs, as its command line chose it."""

    dtype: str | None = None  # "float32" or "bfloat16"; None: bfloat16 where the CPU has the units (and no int8)
    int8_calibration: str | None = None  # a text file, one calibration text a line: quantize_for_inference
    compile: bool = False  # compile_for_inference (in the dtype, or of the int8 model)
    device: str | None = None  # None: CUDA where there is one, else the CPU


class Engine:
    """A model and its tokenizer, as one of three kinds: an `embedding` model (the encoder, pooled as its
    sentence-transformers folder says, or `pooling`), a `classifier` (a sequence-classification head) or a `reranker`
    (a sequence-classification head with one label: a cross-encoder scoring (query, text) pairs)."""

    def __init__(self, model_id: str, choice: EngineChoice = EngineChoice(), pooling: str | None = None):
        self.model_id = model_name(model_id)
        config = AutoConfig.from_pretrained(model_id)
        autos = [auto_class_of(name) for name in config.architectures or []]
        if "AutoModelForSequenceClassification" in autos:
            self.kind = "reranker" if config.num_labels == 1 else "classifier"
            model = head_class("text-classification", config.model_type).from_pretrained(model_id)
        else:
            self.kind = "embedding"
            model = head_class("feature-extraction", config.model_type).from_pretrained(model_id)
        self.config = model.config
        self.pooling, self.normalized = sentence_transformers_pooling(model_id)
        if pooling is not None:
            self.pooling = pooling
        self.tokenizer = AutoTokenizer.from_pretrained(model_id)
        self.backends = {}  # max_length -> `fixed_backend`
        self.max_input_length = min(self.tokenizer.model_max_length, model.config.max_position_embeddings
                                    - model.base_model.embeddings.position_offset)
        self.device = torch.device(choice.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype, self.engine = self.build(model.eval(), choice)

    def build(self, model, choice: EngineChoice):
        """The inference model the choice asks for, and its dtype's name and the engine's, for the log and /info."""
        dtype = choice.dtype or ("bfloat16" if cpu_bf16_units() and self.device.type == "cpu"
                                 and not choice.int8_calibration else "float32")
        if self.device.type != "cpu":
            self.model = model.to(self.device, DTYPES[dtype])
            return dtype, f"the model on {self.device}"
        if choice.int8_calibration:
            with open(choice.int8_calibration, encoding="utf-8") as f:
                texts = [line.strip() for line in f if line.strip()]
            if not texts:
                raise ValueError(f"--calibration {choice.int8_calibration}: no text in it (one text a line)")
            batches = [self.tokenizer(texts[i:i + 16], padding=True, truncation=True, return_tensors="pt")
                       for i in range(0, len(texts), 16)]
            model, engine, dtype = quantize_for_inference(model, batches), "quantize_for_inference (int8)", "int8"
            if choice.compile:
                model, engine = compile_for_inference(model), f"compile_for_inference of {engine}"
        elif choice.compile:
            model, engine = compile_for_inference(model, dtype=DTYPES[dtype]), "compile_for_inference"
        else:
            model, engine = optimize_for_inference(model, DTYPES[dtype]), "optimize_for_inference"
        self.model = model
        return dtype, engine

    def encode(self, texts: list, max_length: int | None = None) -> list[Encoding]:
        """Token ids of each text (or (text, text) pair), cut to `max_length` tokens where it is given; uncut else
        (the caller refuses what is too long). Safe to call from several threads at once (`backend`)."""
        backend = self.backend(max_length)
        if backend is not None:
            return [Encoding(e.ids, e.type_ids) for e in backend.encode_batch([t if isinstance(t, str) else tuple(t)
                                                                               for t in texts])]
        pairs = [not isinstance(t, str) for t in texts]
        if any(pairs) and not all(pairs):  # texts and pairs in one request: each kind in its own call
            return [self.encode([t], max_length)[0] for t in texts]
        first, second = ([t[0] for t in texts], [t[1] for t in texts]) if any(pairs) else (texts, None)
        out = self.tokenizer(first, second, truncation=max_length is not None, max_length=max_length,
                             return_token_type_ids=True)
        return [Encoding(ids, types) for ids, types in zip(out["input_ids"], out["token_type_ids"])]

    def tokens(self, texts: list[str], add_special_tokens: bool = True) -> list:
        """Each text's tokens, uncut, as the Rust tokenizer's `Encoding`s (ids, tokens, offsets, special tokens
        mask), for /tokenize; safe from several threads at once (`backend`). Needs a fast tokenizer."""
        backend = self.backend(None)
        if backend is None:
            raise ValueError(f"{self.model_id}: /tokenize needs a fast (Rust) tokenizer; this one is "
                             f"{type(self.tokenizer).__name__}")
        return backend.encode_batch(texts, add_special_tokens=add_special_tokens)

    def backend(self, max_length: int | None):
        """The Rust tokenizer set up for `max_length` (`fixed_backend`), made once per setting; None where the
        tokenizer has none. A copy per setting, not the tokenizer's own: its call sets up its one Rust tokenizer
        before each call, which another thread may be using ("Already borrowed")."""
        backend = self.backends.get(max_length)
        if backend is None and getattr(self.tokenizer, "backend_tokenizer", None) is not None:
            backend = self.backends[max_length] = fixed_backend(self.tokenizer, max_length)
        return backend

    @torch.inference_mode()
    def run(self, encodings: list[Encoding]) -> torch.Tensor:
        """One forward on a batch: (B, H) pooled embeddings (not normalized), (B, C) class logits, or (B,) relevance
        logits, float32 on the CPU."""
        T = max(len(e.ids) for e in encodings)
        pad = self.config.pad_token_id or 0
        ids = torch.tensor([e.ids + [pad] * (T - len(e.ids)) for e in encodings])  # (B, T)
        types = torch.tensor([e.types + [0] * (T - len(e.ids)) for e in encodings])  # (B, T)
        mask = (torch.arange(T)[None] < torch.tensor([len(e.ids) for e in encodings])[:, None]).long()  # (B, T)
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self.config.type_vocab_size > 1:
            inputs["token_type_ids"] = types
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        if self.kind != "embedding":
            logits = self.model(**inputs).logits.float().cpu()  # (B, C)
            return logits[:, 0] if self.kind == "reranker" else logits
        hidden = self.model(**inputs).last_hidden_state.float().cpu()  # (B, T, H)
        return pool(hidden, mask, self.pooling)

    def close(self) -> None:
        """Release the model (the engine serves no more): a compiled model's program, once freed, deletes the folder it
        unpacked its package into."""
        self.model = None

    def scores(self, logits: torch.Tensor, raw: bool) -> torch.Tensor:
        """A classifier's (B, C) logits as probabilities: softmax, or sigmoid for multi-label classification;
        `raw`: the logits."""
        if raw:
            return logits
        if self.config.problem_type == "multi_label_classification":
            return logits.sigmoid()
        return logits.softmax(-1)

    def info(self) -> dict:
        """What /info says of the model, in text-embeddings-inference's fields."""
        if self.kind == "embedding":
            model_type = {"embedding": {"pooling": self.pooling}}
        else:
            labels = {str(i): label for i, label in self.config.id2label.items()}
            model_type = {self.kind: {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}}
        return {"model_id": self.model_id, "model_dtype": self.dtype, "model_type": model_type, "engine": self.engine,
                "device": str(self.device)}


def fixed_backend(tokenizer, max_length: int | None):
    """A copy of a fast tokenizer's Rust tokenizer set up once as `tokenizer(texts, truncation=max_length is not None,
    max_length=max_length)` sets up its own before each call: no padding, truncation (longest first, on the
    tokenizer's side) at `max_length` or none. A copy per setting, so that threads tokenizing at once never change a
    tokenizer another one is using."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    if max_length is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(max_length, strategy="longest_first", direction=tokenizer.truncation_side)
    return backend


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """(B, T, H) hidden states and their (B, T) mask -> (B, H): the first token's, the mean or the max over real
    tokens."""
    if pooling == "cls":
        return hidden[:, 0]
    real = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    if pooling == "mean":
        return (hidden * real).sum(1) / real.sum(1).clamp_min(1)
    return hidden.masked_fill(real == 0, float("-inf")).amax(1)


def model_name(model_id: str) -> str:
    """The model's name as the server says it (/info, OpenAI's `model`, messages): a Hub id as given, or a folder's
    own name, never the path on the server's disk."""
    return os.path.basename(os.path.normpath(model_id)) if os.path.isdir(model_id) else model_id


def sentence_transformers_pooling(model_id: str) -> tuple[str, bool]:
    """The pooling of a sentence-transformers folder (its `modules.json` and the Pooling module's config.json), and
    whether it normalizes; ("cls", False) where it is no such folder, as text-embeddings-inference takes it."""
    modules_file = cached_file(model_id, "modules.json", _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
    if modules_file is None:
        return "cls", False
    with open(modules_file, encoding="utf-8") as f:
        modules = json.load(f)
    pooling, normalized = "cls", False
    for module in modules:
        if module["type"].endswith(".Pooling"):
            config_file = cached_file(model_id, os.path.join(module["path"], "config.json"),
                                      _raise_exceptions_for_missing_entries=False)
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
            pooling = next((name for name, field in POOLINGS.items() if config.get(field)), "cls")
        normalized = normalized or module["type"].endswith(".Normalize")
    return pooling, normalized
