#!/usr/bin/env python
"""Pre-train BERT with transformers' `Trainer`: the paper's masked LM + next sentence prediction (Devlin et al., 2019,
`--objective mlm_nsp`, the default) or masked LM alone on full windows of contiguous text (`--objective mlm`, as
RoBERTa, MosaicBERT, Cramming and ModernBERT train), optionally in length phases (`--phases 128:0.9,512:0.1`) and
within a wall-clock budget (`--time_budget 2h`).

Every `TrainingArguments` flag works (`--bf16`, `--gradient_checkpointing`, `--resume_from_checkpoint`,
`--push_to_hub`, `--report_to`, ...), and the script runs as is under `torchrun` and `accelerate launch`. On a CPU with
AMX or AVX512-BF16 it trains in bfloat16 autocast unless told a precision (`--bf16 false` for float32): there it
reached float32's held-out accuracy in less time (benchmarks/NOTES.md, "bfloat16 as the pre-training recipe's
default on the CPU"). The first log lines say the precision.
See recipes/PRETRAINING.md for the paper's recipe and the modern one side by side. As in the fine-tuning recipes
(`checkpoints.py`), an --output_dir holding an earlier run is refused without --overwrite_output_dir, checkpoints are
written all-or-nothing, and `--resume_from_checkpoint last` takes the newest complete one.

    python recipes/run_pretraining.py --config_name base --tokenizer_name bert-base-uncased \
        --train_file corpus/*.txt --max_seq_length 128 --do_train --do_eval --output_dir out/phase1

Training logs carry loss, mlm_loss, nsp_loss, mlm_accuracy and nsp_accuracy (means since the previous log, over all
processes; no nsp_* with --objective mlm), seq_length (the batches' mean padded length), tokens_per_second (real,
non-padding tokens of all processes) and, on CUDA or with --peak_tflops, mfu; after the first logging interval one line
estimates the time left. Evaluation adds eval_mlm_loss, eval_mlm_accuracy, eval_mlm_perplexity (and eval_nsp_loss,
eval_nsp_accuracy).
"""

import needs_extra  # noqa: F401  (first: says what to install where the recipes extra is missing)
import copy
import dataclasses
import glob
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from datasets import IterableDataset, load_dataset
from tqdm.auto import tqdm
from transformers import AutoTokenizer, HfArgumentParser, TrainerCallback, TrainingArguments, get_scheduler, set_seed
from transformers.trainer_callback import ExportableState, ProgressCallback

import checkpoints
import common
import sources
import user_files
from modeling_bert_impl import PRESETS, BertImplConfig, BertImplForMaskedLM, BertImplForPreTraining
from pretraining_data import (
    DataCollatorForPreTraining,
    DatasetDocuments,
    build_examples,
    build_windows,
    masked_lm_targets,
    tokenize_documents,
)

logger = logging.getLogger(__name__)

EXAMPLE_FEATURES = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "token_type_ids": datasets.List(datasets.Value("int8")),
    "next_sentence_label": datasets.Value("int8"),
})
WINDOW_FEATURES = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
OBJECTIVES = ("mlm_nsp", "mlm")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Continue from this checkpoint: a folder of ours (e.g. phase 1's output) or a stock BERT one."},
    )
    config_name: str | None = field(
        default=None,
        metadata={"help": f"A new model: a preset ({', '.join(PRESETS)}) or a config path/folder. Default: base."},
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Overrides of the new model's config, e.g. 'hidden_dropout_prob=0.0,max_position_embeddings=1024'."},
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer folder or Hub id; defaults to --model_name_or_path."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloaded models and data sets are stored."})
    token: str | None = field(default=None, metadata={"help": "Hub token, for private models and data sets."})


@dataclass
class DataTrainingArguments:
    dataset_name: list[str] | None = field(
        default=None,
        metadata={"help": "Hub data set(s), each NAME or NAME:CONFIG, concatenated (e.g. bookcorpus wikipedia:20220301.en)."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The config of a single --dataset_name."})
    text_column_name: str = field(default="text", metadata={"help": "The column of the Hub data set holding the text."})
    train_file: list[str] | None = field(
        default=None,
        metadata={"help": "Text file(s) or globs in the BERT format: one sentence per line, blank lines between documents."},
    )
    validation_file: list[str] | None = field(default=None, metadata={"help": "Validation file(s), same format."})
    validation_split_percentage: int = field(
        default=5,
        metadata={"help": "Without a validation split or file, hold out this percentage of the training documents "
                          "(at least 2 documents)."},
    )
    streaming: bool = field(default=False, metadata={"help": "Stream the data (needs --max_steps)."})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per example, [CLS] and [SEP]s included."})
    short_seq_prob: float = field(default=0.1, metadata={"help": "Probability of a shorter, random target length."})
    nsp_probability: float = field(default=0.5, metadata={"help": "Probability that B is from another document."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Share of the tokens to predict."})
    mask_replace_prob: float = field(default=0.8, metadata={"help": "Share of the predicted tokens replaced by [MASK]."})
    random_replace_prob: float = field(default=0.1, metadata={"help": "Share replaced by a random token."})
    whole_word_masking: bool = field(default=False, metadata={"help": "Mask a word's ## pieces together."})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad batches to a multiple of this length."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo the preprocessing instead of using the cache."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only this many evaluation examples."})
    objective: str = field(
        default="mlm_nsp",
        metadata={"help": "mlm_nsp: the paper's sentence pairs, masked LM + next sentence prediction. mlm: masked LM "
                          "alone on windows of exactly max_seq_length tokens of contiguous text, documents joined by "
                          "[SEP] (RoBERTa, MosaicBERT, Cramming, ModernBERT); saves a BertImplForMaskedLM."},
    )
    document_attention: bool = field(
        default=False,
        metadata={"help": "With --objective mlm: a window's tokens attend only within their own document (the model's "
                          "packed path, positions restarting per document). Default off: attend across documents, as "
                          "RoBERTa, MosaicBERT and Cramming do, on the dense path (no mask, no packed layout)."},
    )
    phases: str | None = field(
        default=None,
        metadata={"help": "Length phases in one run, LENGTH:FRACTION[:BATCH],... e.g. 128:0.9,512:0.1 (fractions of "
                          "--max_steps summing to 1; BATCH: the phase's per-device batch size, default "
                          "--per_device_train_batch_size). Replaces --max_seq_length; evaluation uses the last "
                          "phase's."},
    )

    def __post_init__(self):
        if not self.dataset_name and not self.train_file and not self.validation_file:
            raise ValueError("pass --dataset_name or --train_file/--validation_file")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective {self.objective!r}: unknown; choose one of {', '.join(OBJECTIVES)}")
        if self.document_attention and self.objective != "mlm":
            raise ValueError("--document_attention needs --objective mlm (a sentence pair is one document already)")
        self.phase_list = parse_phases(self.phases) if self.phases else None
        shortest = 2 if self.objective == "mlm" else 5
        for length in [p.length for p in self.phase_list] if self.phase_list else [self.max_seq_length]:
            if length < shortest:
                what = "[CLS] and a token" if self.objective == "mlm" else "[CLS] A [SEP] B [SEP]"
                raise ValueError(f"max_seq_length must leave room for {what}, got {length}")


@dataclass
class RunArguments:
    time_budget: str | None = field(
        default=None,
        metadata={"help": "Train for this wall-clock time (e.g. 90s, 45m, 2h, 1h30m): the learning-rate schedule "
                          "(warm-up, decay to its end value) is fitted to it from the measured speed, and the run ends "
                          "at it with a checkpoint and the final evaluation. With --max_steps, whichever comes first."},
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={"help": "The device's peak dense TFLOP/s for the mfu log field (default: a table of common GPUs, "
                          "bf16 tensor-core datasheet figures)."},
    )

    def __post_init__(self):
        self.budget_seconds = parse_duration(self.time_budget) if self.time_budget is not None else None
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"--peak_tflops must be positive, got {self.peak_tflops}")


@dataclass(frozen=True)
class Phase:
    length: int  # max_seq_length of the phase
    fraction: float  # of --max_steps
    batch_size: int | None = None  # per device; None: --per_device_train_batch_size


def parse_phases(text: str) -> list[Phase]:
    """"128:0.9,512:0.1" (or with a per-device batch size, "128:0.9:256,512:0.1:64") -> [Phase, ...]; a ValueError
    naming --phases and the entry for anything else, or when the fractions do not sum to 1."""
    phases = []
    for entry in text.split(","):
        parts = entry.strip().split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            phase = Phase(int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) == 3 else None)
        except ValueError:
            raise ValueError(f"--phases {text!r}: entry {entry!r} is not LENGTH:FRACTION[:BATCH], "
                             "e.g. 128:0.9") from None
        if phase.length < 1 or not 0 < phase.fraction <= 1 or (phase.batch_size is not None and phase.batch_size < 1):
            raise ValueError(f"--phases {text!r}: entry {entry!r} needs a positive length and batch size and a "
                             "fraction in (0, 1]")
        phases.append(phase)
    total = sum(p.fraction for p in phases)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"--phases {text!r}: the fractions sum to {total:g}, not 1")
    return phases


DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_duration(text: str) -> float:
    """"2h", "45m", "90s", "1h30m", "1.5h" -> seconds; a ValueError naming --time_budget for anything else (a bare
    number is refused: its unit would be a guess)."""
    match = DURATION.match(text.strip().lower())
    if not text.strip() or not match or not any(match.groups()):
        raise ValueError(f"--time_budget {text!r}: expected a duration such as 90s, 45m, 2h or 1h30m")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError(f"--time_budget {text!r}: the budget must be positive")
    return total


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer, model
# ---------------------------------------------------------------------------------------------------------------------
def load_tokenizer(model_args: ModelArguments):
    """bert-impl's tokenizer where the package is there, transformers' otherwise."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        raise ValueError("pass --tokenizer_name (a BERT tokenizer folder or Hub id), or --model_name_or_path")
    sources.require_sources(model_args)
    kwargs = {"cache_dir": model_args.cache_dir, "token": model_args.token}
    try:
        from tokenization import BertImplTokenizer
    except ImportError:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    return BertImplTokenizer.from_pretrained(name, **kwargs)


def new_config(model_args: ModelArguments, tokenizer) -> BertImplConfig:
    """A preset or a config file, with the tokenizer's vocabulary size and padding id, then --config_overrides."""
    name = model_args.config_name or "base"
    # sparse_prediction: the MLM decoder on the masked rows only (same loss, less work); --config_overrides may undo it.
    sizes = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, "sparse_prediction": True}
    if name in PRESETS:
        config = BertImplConfig.from_preset(name, **sizes)
    else:
        config = BertImplConfig.from_pretrained(name, cache_dir=model_args.cache_dir, token=model_args.token, **sizes)
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    return config


def load_model(model_args: ModelArguments, tokenizer, max_seq_length: int, objective: str = "mlm_nsp"):
    """BertImplForPreTraining (--objective mlm_nsp) or BertImplForMaskedLM (mlm: no NSP head to train or save), new
    or continued from --model_name_or_path (an mlm_nsp checkpoint continues as mlm without its NSP head)."""
    model_class = BertImplForMaskedLM if objective == "mlm" else BertImplForPreTraining
    if model_args.model_name_or_path:
        if model_args.config_name or model_args.config_overrides:
            raise ValueError("--config_name/--config_overrides make a new model; drop them with --model_name_or_path")
        model = model_class.from_pretrained(
            model_args.model_name_or_path, cache_dir=model_args.cache_dir, token=model_args.token, sparse_prediction=True
        )
        if len(tokenizer) > model.config.vocab_size:
            model.resize_token_embeddings(len(tokenizer))
    else:
        model = model_class(new_config(model_args, tokenizer))
    if max_seq_length > model.config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length {max_seq_length} exceeds the model's max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"{model_class.__name__}: {n_params / 1e6:.1f}M parameters, config {model.config.to_diff_dict()}")
    return model


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------
def hub_sources(data_args: DataTrainingArguments) -> list[tuple[str, str | None]]:
    """--dataset_name entries NAME or NAME:CONFIG -> (name, config); --dataset_config_name serves a single NAME."""
    sources = [entry.partition(":")[::2] for entry in data_args.dataset_name]
    default = data_args.dataset_config_name if len(sources) == 1 else None
    return [(name, config or default) for name, config in sources]


def load_hub_text(data_args: DataTrainingArguments, model_args: ModelArguments, split: str):
    """The text column of the --dataset_name data sets' `split`, as one data set (concatenated or interleaved)."""
    parts = []
    for name, config in hub_sources(data_args):
        ds = load_dataset(name, config, split=split, streaming=data_args.streaming, cache_dir=model_args.cache_dir,
                          token=model_args.token)
        ds = ds.select_columns([data_args.text_column_name])
        parts.append(ds.rename_column(data_args.text_column_name, "text") if data_args.text_column_name != "text" else ds)
    if len(parts) == 1:
        return parts[0]
    return datasets.interleave_datasets(parts) if data_args.streaming else datasets.concatenate_datasets(parts)


def corpus_files(patterns: list[str]) -> list[str]:
    """The files that --train_file / --validation_file `patterns` (paths or globs) name, each read through once
    (`user_files.check_text_file`, a chunk at a time): a ValueError naming the file when one is missing, empty or not UTF-8
    (with the line and column of the first bad byte), or when a glob matches nothing. Remote paths (`hf://`,
    `https://`) are passed on unchecked."""
    paths = []
    for pattern in patterns:
        if "://" in pattern:
            paths.append(pattern)
            continue
        matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matched:
            raise ValueError(f"{pattern}: no file matches")
        for path in matched:
            user_files.check_text_file(path)
        paths += matched
    return paths


def file_sources(data_args: DataTrainingArguments) -> dict[str, str]:
    """{split: the files it comes from, as given} for the error messages; {} for Hub data. A validation split held out
    of the training files comes from them."""
    def named(files: list[str]) -> str:
        return ", ".join(files[:3]) + (f" (and {len(files) - 3} more)" if len(files) > 3 else "")

    if data_args.dataset_name:
        return {}
    files = {"train": data_args.train_file, "validation": data_args.validation_file or data_args.train_file}
    return {split: named(paths) for split, paths in files.items() if paths}


def load_raw_datasets(data_args: DataTrainingArguments, model_args: ModelArguments) -> tuple[dict, bool]:
    """{"train": ..., "validation": ...} of rows with a "text" column (either may be missing), and whether lines
    still need splitting into sentences (Hub text: yes; the BERT file format: no, a line is a sentence)."""
    pct = data_args.validation_split_percentage
    if data_args.dataset_name:
        load, split_lines = (lambda split: load_hub_text(data_args, model_args, split)), True
        has_validation = all(
            "validation" in datasets.get_dataset_split_names(name, config, token=model_args.token)
            for name, config in hub_sources(data_args)
        )
    else:
        files = {k: corpus_files(v) for k, v in (("train", data_args.train_file),
                                                 ("validation", data_args.validation_file)) if v}

        def load(split):
            file_split = split.split("[")[0]
            return load_dataset("text", data_files={file_split: files[file_split]}, split=split, sample_by="paragraph",
                                streaming=data_args.streaming, cache_dir=model_args.cache_dir)
        split_lines, has_validation = False, "validation" in files
    raw = {}
    if data_args.train_file or data_args.dataset_name:
        raw["train"] = load("train")
        if not has_validation and pct > 0 and not data_args.streaming:
            raw["train"], raw["validation"] = hold_out(raw["train"], pct, file_sources(data_args).get("train"))
    if has_validation:
        raw["validation"] = load("validation")
    return raw, split_lines


MIN_DOCUMENTS = 2  # NotNext pairs take their second segment from another document


def hold_out(rows, pct: int, source: str | None = None):
    """(train, validation): the first `pct` percent of the rows (documents) held out, rounded as datasets' "train[:5%]"
    rounds, but at least MIN_DOCUMENTS, with a warning when the percentage rounds to fewer (10 documents at 5% round to
    none). A ValueError when too few rows are left on either side, naming `source` (the files) when given."""
    n = len(rows)
    k = int(round(pct * n / 100))
    if n - max(k, MIN_DOCUMENTS) < MIN_DOCUMENTS:
        where = f"{source}: " if source else ""
        raise ValueError(f"{where}the training data holds {n} document(s): too few to hold out {pct}% for validation "
                         f"and keep {MIN_DOCUMENTS} for training; give --validation_file, or "
                         "--validation_split_percentage 0, and more documents (separated by blank lines)")
    if k < MIN_DOCUMENTS:
        logger.warning(f"--validation_split_percentage {pct} of {n} documents rounds to {k}: holding out "
                       f"{MIN_DOCUMENTS} documents for validation")
        k = MIN_DOCUMENTS
    return rows.select(range(k, n)), rows.select(range(k))


def prepare_examples(raw_split, tokenizer, data_args: DataTrainingArguments, seed: int, split_lines: bool, name: str,
                     source: str | None = None):
    """Rows of text -> tokenized documents -> pre-training examples, cached: sentence pairs (columns of
    `EXAMPLE_FEATURES`) for --objective mlm_nsp, windows (`WINDOW_FEATURES`, `build_windows`) for mlm. A split of
    fewer than MIN_DOCUMENTS documents (mlm_nsp), or with too little text for one window (mlm), is a ValueError, naming
    `source` (the files it comes from) when given."""
    streaming = isinstance(raw_split, IterableDataset)
    map_kwargs = {} if streaming else {
        "num_proc": data_args.preprocessing_num_workers,
        "load_from_cache_file": not data_args.overwrite_cache,
    }
    describe = (lambda text: {}) if streaming else (lambda text: {"desc": f"{text} ({name})"})
    documents = raw_split.map(
        tokenize_documents, batched=True, remove_columns=["text"],
        fn_kwargs={"tokenizer": tokenizer, "text_column": "text", "split_lines": split_lines},
        **map_kwargs, **describe("Tokenizing documents"),
    )
    where = f"{source}: " if source else ""
    if data_args.objective == "mlm":
        windows = documents.map(
            build_windows, batched=True, remove_columns=["sentences"], features=WINDOW_FEATURES,
            fn_kwargs={"max_seq_length": data_args.max_seq_length, "cls_id": tokenizer.cls_token_id,
                       "sep_id": tokenizer.sep_token_id},
            **map_kwargs, **describe(f"Cutting windows of {data_args.max_seq_length} tokens"),
        )
        if not streaming and len(windows) == 0:
            raise ValueError(f"{where}the {name} data holds too little text for one window of max_seq_length "
                             f"{data_args.max_seq_length} tokens: give more text or a shorter --max_seq_length")
        return windows
    if not streaming and len(documents) < MIN_DOCUMENTS:
        raise ValueError(f"{where}the {name} data holds {len(documents)} document(s) with text: BERT pre-training "
                         f"needs at least {MIN_DOCUMENTS} (a NotNext pair takes its second segment from another "
                         "document). In a --train_file or --validation_file, separate documents by a blank line")
    example_kwargs = {
        "seed": seed,
        "max_seq_length": data_args.max_seq_length,
        "short_seq_prob": data_args.short_seq_prob,
        "nsp_probability": data_args.nsp_probability,
        "cls_id": tokenizer.cls_token_id,
        "sep_id": tokenizer.sep_token_id,
        # NotNext segments from the whole corpus; a stream only has the current batch of documents to offer
        "documents": None if streaming else DatasetDocuments(documents),
    }
    return documents.map(
        build_examples, batched=True, with_indices=True, remove_columns=["sentences"], features=EXAMPLE_FEATURES,
        fn_kwargs=example_kwargs, **map_kwargs, **describe("Building sentence pairs"),
    )


def truncate(dataset, n: int | None):
    if n is None:
        return dataset
    return dataset.take(n) if isinstance(dataset, IterableDataset) else dataset.select(range(min(n, len(dataset))))


# ---------------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------------
class PreTrainingTally:
    """On-device sums over the training micro-batches since the last log: no host sync per step.

    Besides the losses and accuracies, the work done: real (non-padding) tokens, the squared lengths of the spans that
    attend to each other (rows of a padded batch, documents of a packed one), the batches' padded widths, and the
    sequences that feed the NSP head, for tokens/s and the FLOP count of `model_flops`."""

    FIELDS = ("mlm_loss", "nsp_loss", "batches", "mlm_correct", "mlm_total", "nsp_correct", "nsp_total",
              "tokens", "span_squares", "width", "nsp_sequences")

    def __init__(self):
        self.sums = None  # (len(FIELDS),) float32
        self.tokens = None  # real tokens since the start of train(), never popped: the train metrics' train_tokens

    @torch.no_grad()
    def add(self, outputs, inputs: dict, width: int | None = None) -> None:
        """outputs: BertImplForPreTraining's (prediction_logits, mlm_loss, nsp_loss) or BertImplForMaskedLM's (logits,
        loss); inputs: the model's inputs (a packed batch as run by `--document_attention`, or padded); width: the
        batch's padded length before packing (default: the inputs')."""
        mlm_logits = getattr(outputs, "prediction_logits", None)
        mlm_logits = outputs.logits if mlm_logits is None else mlm_logits
        mlm_loss = outputs.mlm_loss if getattr(outputs, "mlm_loss", None) is not None else outputs.loss
        logits, targets = masked_lm_targets(mlm_logits, inputs["labels"])  # (M, V), (M,)
        device, zero = targets.device, torch.zeros((), device=targets.device)
        nsp_labels = inputs.get("next_sentence_label")  # (B,)
        if nsp_labels is not None:
            nsp_logits = outputs.seq_relationship_logits  # (B, 2)
            nsp = [outputs.nsp_loss.float(), (nsp_logits.argmax(-1) == nsp_labels).sum().float(),
                   torch.tensor(float(nsp_labels.numel()), device=device)]
        else:
            nsp = [zero, zero, zero]
        tokens, span_squares = attention_spans(inputs)
        values = torch.stack([
            mlm_loss.float(), nsp[0], torch.ones((), device=device),
            (logits.argmax(-1) == targets).sum().float(), torch.tensor(float(targets.numel()), device=device),
            nsp[1], nsp[2], tokens.float(), span_squares.float(),
            torch.tensor(float(width or inputs["input_ids"].shape[-1]), device=device), nsp[2],
        ])
        self.sums = values if self.sums is None else self.sums + values
        self.tokens = tokens.long() if self.tokens is None else self.tokens + tokens.long()

    def pop(self) -> torch.Tensor | None:
        sums, self.sums = self.sums, None
        return sums

    @classmethod
    def summarize(cls, sums: torch.Tensor) -> dict[str, float]:
        """The losses and accuracies (the NSP ones only where the batches had NSP labels)."""
        s = dict(zip(cls.FIELDS, sums.tolist()))
        summary = {
            "mlm_loss": s["mlm_loss"] / s["batches"],
            "nsp_loss": s["nsp_loss"] / s["batches"],
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_total"], 1.0),
            "nsp_accuracy": s["nsp_correct"] / max(s["nsp_total"], 1.0),
        }
        if not s["nsp_total"]:
            del summary["nsp_loss"], summary["nsp_accuracy"]
        return summary

    @classmethod
    def work(cls, sums: torch.Tensor) -> dict[str, float]:
        """What the batches held: tokens, span_squares, mlm_total (masked tokens), nsp_sequences, and the mean
        padded width of a batch (seq_length)."""
        s = dict(zip(cls.FIELDS, sums.tolist()))
        return {"tokens": s["tokens"], "span_squares": s["span_squares"], "masked": s["mlm_total"],
                "nsp_sequences": s["nsp_sequences"], "seq_length": s["width"] / max(s["batches"], 1.0)}


def attention_spans(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(real tokens, sum over the spans that attend to each other of their length squared), on the device, without a
    host sync: a packed batch (position_ids restarting at each document, no attention_mask) counts its documents, a
    padded one its rows' real lengths, a full one (no mask) its rows."""
    input_ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    if mask is not None:
        lengths = mask.sum(-1).float()  # (B,)
        return lengths.sum(), (lengths * lengths).sum()
    positions = inputs.get("position_ids")
    if positions is not None and input_ids.shape[0] == 1:  # packed: a span starts where the positions restart
        starts = (positions.flatten() == 0).long()
        starts[0] = 1
        span = torch.cumsum(starts, 0) - 1  # (N,) each token's span
        ones = torch.ones_like(span, dtype=torch.float)
        counts = torch.zeros(span.numel(), device=span.device).scatter_add_(0, span, ones)  # (N,) tokens a span
        return torch.tensor(float(span.numel()), device=span.device), (counts * counts).sum()
    B, T = input_ids.shape
    return torch.tensor(float(B * T), device=input_ids.device), torch.tensor(float(B * T * T), device=input_ids.device)


def model_flops(config, tokens: float, span_squares: float, masked: float, nsp_sequences: float) -> float:
    """FLOPs of training (forward + backward = 3x the forward's; a multiply-add is 2 FLOPs) on `tokens` real tokens,
    counting matrix products only, with benchmarks/bench_model.py `model_flops`'s formula (the GPU check's MFU):

        6 * n * L * (4 H^2 + 2 H I)        the dense layers (QKV, attention output, FFN) on the n real tokens
      + 12 * L * H * sum_s T_s^2           attention scores and their weighted sum, per span of T_s tokens
      + 6 * M * (H^2 + H * V)              the MLM head (transform + decoder) on the M masked tokens
      + 6 * S * (H^2 + 2 H)                pooler and NSP classifier on the S sentence pairs (none with --objective mlm)
    """
    L, H, I, V = config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size
    return (6 * tokens * L * (4 * H * H + 2 * H * I) + 12 * L * H * span_squares + 6 * masked * (H * H + H * V)
            + 6 * nsp_sequences * (H * H + 2 * H))


# Dense bf16 tensor-core peaks from the datasheets (without sparsity), FLOP/s, by a substring of the device name (the
# first that matches): benchmarks/bench_model.py's table, which the GPU check's MFU divides by.
DATASHEET_BF16_PEAK = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "H800": 989e12,
                       "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def peak_flops(device: torch.device, peak_tflops: float | None) -> float | None:
    """The MFU denominator of one device: --peak_tflops, else the datasheet figure of a known GPU, else None (no mfu
    logged: CPUs, unknown GPUs)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DATASHEET_BF16_PEAK.items() if key in name), None)


def preprocess_logits_for_metrics(logits, labels) -> tuple[torch.Tensor, ...]:
    """Keep what `compute_metrics` needs instead of the (B, T, V) logits.

    logits: (prediction_logits, seq_relationship_logits (B, 2)) with NSP, or the masked LM's logits alone; MLM logits
    are (B, T, V), or (M, V) for the masked rows only. labels: (labels (B, T), next_sentence_label (B,)), or labels.
    Returns MLM loss per token (B, T) and predicted ids (B, T), both -100 where nothing is predicted, and with NSP
    its logits (B, 2)."""
    prediction_logits, nsp_logits = logits if isinstance(logits, (tuple, list)) else (logits, None)
    mlm_labels = labels[0] if isinstance(labels, (tuple, list)) else labels
    selected = mlm_labels != -100
    masked_logits, targets = masked_lm_targets(prediction_logits, mlm_labels)
    token_loss = torch.full(mlm_labels.shape, -100.0, device=mlm_labels.device)
    token_loss[selected] = F.cross_entropy(masked_logits.float(), targets, reduction="none")
    predictions = torch.full_like(mlm_labels, -100)
    predictions[selected] = masked_logits.argmax(-1)
    return (token_loss, predictions) if nsp_logits is None else (token_loss, predictions, nsp_logits.float())


def compute_metrics(eval_pred) -> dict[str, float]:
    """MLM loss (per masked token), accuracy and perplexity; with NSP its loss and accuracy, over the whole evaluation
    set."""
    token_loss, predictions = eval_pred.predictions[:2]
    labels = eval_pred.label_ids
    mlm_labels = labels[0] if isinstance(labels, (tuple, list)) else labels
    selected = mlm_labels != -100
    mlm_loss = float(token_loss[selected].mean()) if selected.any() else float("nan")
    metrics = {
        "mlm_loss": mlm_loss,
        "mlm_accuracy": float((predictions[selected] == mlm_labels[selected]).mean()) if selected.any() else float("nan"),
        "mlm_perplexity": math.exp(min(mlm_loss, 50.0)),
    }
    if len(eval_pred.predictions) == 3:
        nsp_logits, nsp_labels = eval_pred.predictions[2].astype(np.float64), labels[1].astype(np.int64)
        top = nsp_logits.max(-1, keepdims=True)
        log_z = (top + np.log(np.exp(nsp_logits - top).sum(-1, keepdims=True)))[:, 0]  # (N,)
        metrics["nsp_loss"] = float((log_z - nsp_logits[np.arange(len(nsp_labels)), nsp_labels]).mean())
        metrics["nsp_accuracy"] = float((nsp_logits.argmax(-1) == nsp_labels).mean())
    return metrics


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------
class MaskingEpochCallback(TrainerCallback):
    """Gives the collator the epoch, so that masks are drawn afresh each epoch and a resumed run masks as the
    uninterrupted one (the epoch of a resumed run is that of its checkpoint)."""

    def __init__(self, collator: DataCollatorForPreTraining):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.set_epoch(math.floor(state.epoch or 0))


def pack_documents(inputs: dict) -> dict:
    """A batch of windows (B, T) with position_ids restarting at each document (the collator's
    `document_positions_for`) -> one packed row (1, B * T), the model's padding-free layout, in which no token attends
    across a document (nor a window) boundary. The windows have no padding, so the attention mask goes; the token
    types are all 0, the model's default. The documents are marked by `seq_idx` too: position ids alone mark packed
    sequences of at least two tokens, and a window may end on a document's first token."""
    position_ids = inputs["position_ids"].reshape(1, -1)  # (1, B * T)
    seq_idx = torch.cumsum(position_ids == 0, dim=-1) - 1  # (1, B * T) each token's document
    return {"input_ids": inputs["input_ids"].reshape(1, -1), "position_ids": position_ids, "seq_idx": seq_idx,
            "labels": inputs["labels"].reshape(1, -1)}


class TimeBudget(TrainerCallback, ExportableState):
    """A wall-clock budget for training (--time_budget): the clock behind the learning-rate schedule and the stop.

    Training time runs from the start of `train()` (after data preparation and model loading), periodic evaluations and
    checkpoint saves included; a resumed run adds the time its checkpoint had spent (kept in trainer_state.json as
    this callback's state). The time is read once per optimizer step, before the scheduler's step, as the largest of
    all processes' clocks, so that every process takes the same learning rate and stops at the same step.

    `progress(step)`: the fraction of the run done, the larger of time spent / budget and step / --max_steps (when
    given), at most 1. At 1 the schedule is at its end value, and the step ends the run: logged, and checkpointed
    unless --save_strategy no."""

    def __init__(self, seconds: float, step_limit: int | None = None):
        self.seconds, self.step_limit = seconds, step_limit
        self.spent_before = 0.0  # seconds spent by the run this one resumes
        self.started = None  # perf_counter() at the start of this train() call
        self.measured = 0.0  # seconds spent, as read at the last optimizer step

    def spent(self) -> float:
        return self.spent_before + (time.perf_counter() - self.started if self.started is not None else 0.0)

    def progress(self, step: float) -> float:
        done = self.measured / self.seconds
        if self.step_limit:
            done = max(done, step / self.step_limit)
        return min(done, 1.0)

    def state(self) -> dict:
        return {"args": {"seconds": self.seconds, "step_limit": self.step_limit},
                "attributes": {"spent_before": self.spent()}}

    def on_train_begin(self, args, state, control, **kwargs):
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        saved = saved[-1] if isinstance(saved, list) and saved else saved
        self.spent_before = float(saved["attributes"]["spent_before"]) if isinstance(saved, dict) else 0.0
        self.started = time.perf_counter()
        self.measured = self.spent_before
        if self.spent_before:
            logger.warning(f"--time_budget: the resumed run had spent {format_duration(self.spent_before)} of "
                           f"{format_duration(self.seconds)}")

    def on_optimizer_step(self, args, state, control, **kwargs):
        spent = self.spent()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            spent = torch.tensor(spent, dtype=torch.float64, device=args.device)
            torch.distributed.all_reduce(spent, op=torch.distributed.ReduceOp.MAX)
        self.measured = float(spent)

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress(state.global_step) >= 1.0:
            control.should_training_stop = True
            control.should_log = True
            if args.save_strategy != "no":
                control.should_save = True


class BudgetProgress(ProgressCallback):
    """transformers' progress bar, counting the time budget (--time_budget) instead of the steps, whose limit the
    budget reaches first: seconds spent of the budget (a resumed run's included), then the step and the time the
    budget ends. The rest (evaluation bars, logs written above the bar) is transformers'."""

    def __init__(self, budget: TimeBudget):
        super().__init__()
        self.budget = budget

    def on_train_begin(self, args, state, control, **kwargs):
        self.current_step = 0
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=round(self.budget.seconds), initial=round(self.budget.spent_before),
                                     unit="s", desc="time budget", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            spent = min(round(self.budget.measured), self.training_bar.total)
            self.training_bar.update(spent - self.training_bar.n)
            ends = time.localtime(time.time() + max(self.budget.seconds - self.budget.measured, 0.0))
            self.training_bar.set_postfix_str(f"step {state.global_step}, ends {time.strftime('%H:%M:%S', ends)}")


NOMINAL_STEPS = 1_000_000  # the budget's schedule is transformers' schedule over this many steps, read at progress x it


def budget_schedule(args: TrainingArguments, optimizer, budget: TimeBudget):
    """transformers' schedule of --lr_scheduler_type (warm-up, then decay to its end value: 0, or lr_end for
    polynomial), laid over the budget instead of the steps (Cramming's budget schedules): at step k the learning
    rate is the schedule's at `budget.progress(k)` of the run. The warm-up is --warmup_steps as a fraction of the run
    (a value below 1), or in steps over --max_steps."""
    warmup = args.warmup_steps
    if warmup >= 1:
        if not budget.step_limit:
            raise ValueError(f"--warmup_steps {warmup:g} with --time_budget and no --max_steps: give the warm-up as a "
                             "fraction of the budget instead, e.g. --warmup_steps 0.06")
        warmup = warmup / budget.step_limit
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                              num_warmup_steps=round(min(warmup, 1.0) * NOMINAL_STEPS),
                              num_training_steps=NOMINAL_STEPS, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        raise ValueError(f"--time_budget needs a schedule of the step (linear, cosine, polynomial, constant...): "
                         f"--lr_scheduler_type {args.lr_scheduler_type} is not one")

    def over_budget(schedule):  # a plain function: LambdaLR keeps no state of it in scheduler.pt
        return lambda step: schedule(budget.progress(step) * NOMINAL_STEPS)

    scheduler.lr_lambdas = [over_budget(schedule) for schedule in scheduler.lr_lambdas]
    return scheduler


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, minutes = seconds // 3600, seconds // 60 % 60
    return f"{hours}h {minutes:02d}m {seconds % 60:02d}s" if hours else f"{minutes}m {seconds % 60:02d}s"


class PhasedData:
    """The data of a phased run (--phases): each phase's examples (of its own max_seq_length), and the batches that the
    run takes, in order: phase 1's for its steps, then phase 2's, and so on, so that the data and the batch size switch
    at the phase's first step and the learning-rate schedule runs over the whole run (one Trainer epoch).

    A batch is a list of keys (row of the concatenated phases, pass): the pass over the phase's examples (each pass a
    fresh permutation keyed by (seed, phase, pass)) keys the example's masks (`mask_epoch`), so repeated examples are
    masked afresh. The order is a function of the seed alone: a resumed run skips the batches already trained and
    goes on with the same ones. With W processes each micro-step holds W consecutive batches, one per process, as
    accelerate's batch sampler sharding deals them out."""

    def __init__(self, datasets_: list, phases: list[Phase], steps: list[int], batch_sizes: list[int],
                 gradient_accumulation_steps: int, world_size: int, seed: int):
        self.datasets, self.phases, self.steps, self.batch_sizes = datasets_, phases, steps, batch_sizes
        self.micro_batches = [n * gradient_accumulation_steps * world_size for n in steps]
        self.offsets = np.cumsum([0] + [len(d) for d in datasets_]).tolist()
        self.seed = seed
        self.dataset, self.sampler = PhasedDataset(self), PhasedBatchSampler(self)

    def keys(self, phase: int):
        """Endless (row, pass) keys of phase `phase`: pass after pass, each a permutation of its examples."""
        size, offset = len(self.datasets[phase]), self.offsets[phase]
        for epoch in range(1 << 62):
            for row in np.random.default_rng([self.seed, phase, epoch]).permutation(size):
                yield offset + int(row), epoch

    def batches(self):
        for phase, (count, size) in enumerate(zip(self.micro_batches, self.batch_sizes)):
            keys = self.keys(phase)
            for _ in range(count):
                yield [next(keys) for _ in range(size)]


class PhasedDataset(torch.utils.data.Dataset):
    """The phases' examples behind (row, pass) keys; each example carries its pass as "mask_epoch"."""

    def __init__(self, data: PhasedData):
        self.data = data

    def __len__(self) -> int:
        return self.data.offsets[-1]

    def __getitem__(self, key):
        row, epoch = key
        phase = int(np.searchsorted(self.data.offsets, row, side="right")) - 1
        return {**self.data.datasets[phase][row - self.data.offsets[phase]], "mask_epoch": epoch}


class PhasedBatchSampler(torch.utils.data.Sampler):
    def __init__(self, data: PhasedData):
        self.data = data

    def __len__(self) -> int:
        return sum(self.data.micro_batches)

    def __iter__(self):
        return self.data.batches()


def phase_steps(phases: list[Phase], max_steps: int) -> list[int]:
    """The steps of each phase: its fraction of max_steps, the boundaries rounded to the nearest step; a ValueError
    naming --phases when a phase would get none."""
    ends = [round(max_steps * f) for f in np.cumsum([p.fraction for p in phases])]
    ends[-1] = max_steps
    steps = [end - start for start, end in zip([0] + ends[:-1], ends)]
    for phase, n in zip(phases, steps):
        if n < 1:
            raise ValueError(f"--phases: the phase at length {phase.length} ({phase.fraction:g} of --max_steps "
                             f"{max_steps}) gets no step; raise --max_steps or its fraction")
    return steps


class IntervalClock(TrainerCallback):
    """Starts the trainer's first logging interval when training starts (after data and model set-up)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.interval_start, self.trainer.interval_step = time.perf_counter(), state.global_step


class PreTrainingTrainer(checkpoints.RecipeTrainer):
    """`Trainer` that logs the MLM (and NSP) losses and accuracies and the throughput of the training steps, evaluates
    with fixed masks, and optionally packs windows by document (`document_attention`), trains in length phases
    (`phased`, a `PhasedData`) and within a wall-clock budget (`budget`, a `TimeBudget`).

    The model returns per-batch mean losses, so the Trainer divides them by the accumulation steps itself
    (`model_accepts_loss_kwargs = False`; the model's `**packing` keyword arguments are not loss arguments)."""

    def __init__(self, *args, document_attention: bool = False, phased: PhasedData | None = None,
                 budget: TimeBudget | None = None, peak_tflops: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = False
        self.tally = PreTrainingTally()
        self.document_attention, self.phased, self.budget = document_attention, phased, budget
        self.peak = peak_flops(self.args.device, peak_tflops)
        self.interval_start, self.interval_step, self.estimated = None, 0, False
        self.eval_collator = copy.copy(self.data_collator)  # epoch stays 0: every evaluation masks alike
        if hasattr(self.data_collator, "set_epoch"):
            self.add_callback(MaskingEpochCallback(self.data_collator))
        self.add_callback(IntervalClock(self))
        if budget is not None:
            self.add_callback(budget)
            if self.pop_callback(ProgressCallback) is not None:  # the bar counts the budget's time, not the steps
                self.add_callback(BudgetProgress(budget))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        model_inputs = pack_documents(inputs) if self.document_attention else inputs
        outputs = model(**model_inputs)
        if model.training:
            self.tally.add(outputs, model_inputs, inputs["input_ids"].shape[-1])
        if not return_outputs:
            return outputs.loss
        # evaluation reads every output but the loss as logits: give it the heads' logits, in this order
        if getattr(outputs, "seq_relationship_logits", None) is not None:
            return outputs.loss, {"loss": outputs.loss, "prediction_logits": outputs.prediction_logits,
                                  "seq_relationship_logits": outputs.seq_relationship_logits}
        logits = outputs.logits
        if self.document_attention and logits.dim() == 3:  # (1, B * T, V) -> (B, T, V), the labels' layout
            logits = logits.reshape(*inputs["input_ids"].shape, -1)
        return outputs.loss, {"loss": outputs.loss, "logits": logits}

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.budget is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = budget_schedule(self.args, optimizer or self.optimizer, self.budget)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def get_train_dataloader(self):
        if self.phased is None:
            return super().get_train_dataloader()
        loader = torch.utils.data.DataLoader(
            self.phased.dataset, batch_sampler=self.phased.sampler, collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
        )
        # The phases' batches have no one batch size, which accelerate 1.7 (our lowest) refuses to shard with even_batches;
        # there is nothing to even out: every process gets the same number of them (PhasedData.micro_batches).
        even_batches, self.accelerator.even_batches = self.accelerator.even_batches, False
        try:
            return self.accelerator.prepare(loader)
        finally:
            self.accelerator.even_batches = even_batches

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log, made on every process at the same step: reduce the tallies
            sums, now = self.tally.pop(), time.perf_counter()
            if sums is not None:
                sums = self.accelerator.reduce(sums, reduction="sum")
                logs.update(PreTrainingTally.summarize(sums))
                if self.interval_start is not None:
                    logs.update(self.throughput(PreTrainingTally.work(sums), now - self.interval_start))
                    self.estimate_remaining(now - self.interval_start, self.state.global_step - self.interval_step)
            self.interval_start, self.interval_step = now, self.state.global_step
        super().log(logs, start_time)

    def throughput(self, work: dict[str, float], seconds: float) -> dict[str, float]:
        """The log's seq_length, tokens_per_second (real tokens, all processes) and, with a known peak, mfu (model
        FLOPs of the interval / its time / the peak of all processes' devices)."""
        out = {"seq_length": round(work["seq_length"], 2), "tokens_per_second": round(work["tokens"] / seconds, 1)}
        if self.peak:
            flops = model_flops(self.model.config, work["tokens"], work["span_squares"], work["masked"],
                                work["nsp_sequences"])
            out["mfu"] = round(flops / seconds / (self.peak * self.args.world_size), 6)
        return out

    def token_metrics(self, runtime: float) -> dict[str, float]:
        """train_tokens (the real tokens this train() call trained on, all processes) and train_tokens_per_second
        (over train_runtime: the whole training loop, the first steps included)."""
        if self.tally.tokens is None:
            return {}
        tokens = float(self.accelerator.reduce(self.tally.tokens, reduction="sum"))
        return {"train_tokens": tokens, "train_tokens_per_second": tokens / runtime if runtime > 0 else float("nan")}

    def estimate_remaining(self, seconds: float, steps: int) -> None:
        """Once, after the first logging interval: the run's remaining time at the interval's speed (per token, in a
        phased run, whose later phases take more tokens a step), and within the budget."""
        if self.estimated or steps <= 0 or not self.is_world_process_zero():
            return
        self.estimated = True
        step, per_step = self.state.global_step, seconds / steps
        if self.phased is not None:  # tokens a step differ between phases: count the steps left in phase-1 steps
            ends = np.cumsum(self.phased.steps).tolist()
            starts = [end - n for end, n in zip(ends, self.phased.steps)]
            work = [p.length * b for p, b in zip(self.phased.phases, self.phased.batch_sizes)]  # tokens a step
            now = work[min(i for i, end in enumerate(ends) if step < end or i == len(ends) - 1)]
            left = sum(max(0, end - max(step, start)) * w / now for start, end, w in zip(starts, ends, work))
        else:
            left = self.state.max_steps - step
        remaining = left * per_step
        limit = "steps"
        if self.budget is not None:
            budget_left = max(self.budget.seconds - self.budget.spent(), 0.0)
            if self.budget.step_limit is None or budget_left < remaining:
                total = step + round(budget_left / per_step)
                remaining, limit = budget_left, f"time budget, after about {total:,} steps"
        logger.warning(f"estimated time remaining: {format_duration(remaining)} (step {step}, {per_step:.3f} s a step "
                       f"over the last {steps}; ends at the {limit})")

    def get_eval_dataloader(self, eval_dataset=None):
        train_collator, self.data_collator = self.data_collator, self.eval_collator
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.data_collator = train_collator


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None):
    """The four argument groups (model, data, run, training), then `checkpoints.prepare_run`: the output directory guard and
    the checkpoint to resume."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, RunArguments, common.RecipeTrainingArguments))
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        given = {f"--{key}" for key in json.loads(Path(sys.argv[1]).read_text())}
        parsed = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else map(str, argv))}
        parsed = parser.parse_args_into_dataclasses(args=argv)
    default_precision(parsed[-1], given=bool(given & {"--bf16", "--fp16"}))
    checkpoints.prepare_run(parsed[-1])
    return parsed


def default_precision(training_args: TrainingArguments, given: bool) -> None:
    """bfloat16 autocast where training runs on a CPU with bfloat16 units (AMX, AVX512-BF16) and no precision was
    given (`--bf16`, `--fp16`, either true or false, or accelerate's --mixed_precision)."""
    if given or "ACCELERATE_MIXED_PRECISION" in os.environ or common.cpu_bf16_units() is None:
        return
    if training_args.device.type == "cpu":
        training_args.bf16, training_args.mixed_precision = True, "bf16"  # what TrainingArguments sets from --bf16


def setup_logging(training_args: TrainingArguments) -> None:
    common.setup_logging(training_args)
    logger.warning(
        f"process rank {training_args.process_index}, world size {training_args.world_size}, "
        f"device {training_args.device}, distributed {torch.distributed.is_initialized()}"
    )


def check_data_parallel(training_args: TrainingArguments) -> None:
    """Refuse a launch of N processes that the Trainer would run as N independent single-process trainings (torchrun
    or accelerate on a machine without GPUs and without --use_cpu): they would all write the same output_dir."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size == 1:
        raise RuntimeError(
            f"{launched} processes were launched but each trains alone (world size 1): on CPU pass --use_cpu for data "
            "parallel training over gloo"
        )


def check_run(data_args: DataTrainingArguments, run_args: RunArguments, training_args: TrainingArguments) -> None:
    """The flags that only work together: --streaming and --phases need --max_steps (a budget stands in for it with
    --streaming), --phases a data set on disk. A budget without --max_steps lifts the step limit (the budget ends the
    run)."""
    if training_args.max_steps <= 0 and run_args.budget_seconds is not None and not data_args.phase_list:
        training_args.max_steps = BUDGET_ONLY_MAX_STEPS
    if data_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming needs --max_steps (or --time_budget)")
    if data_args.phase_list and data_args.streaming:
        raise ValueError("--phases needs the data on disk: each phase's examples are prepared before training; drop "
                         "--streaming")
    if data_args.phase_list and training_args.max_steps <= 0:
        raise ValueError("--phases needs --max_steps: the phases are fractions of it")


BUDGET_ONLY_MAX_STEPS = 10**9  # --time_budget without --max_steps: a step limit the budget always reaches first


def prepare_phases(raw: dict, tokenizer, data_args: DataTrainingArguments, training_args: TrainingArguments,
                   split_lines: bool, sources: dict) -> PhasedData:
    """Each phase's training examples at its own max_seq_length (cached like a single-length run's), and the batches of
    the run (`PhasedData`)."""
    phases = data_args.phase_list
    datasets_ = []
    for phase in phases:
        phase_args = dataclasses.replace(data_args, max_seq_length=phase.length, phases=None)
        examples = prepare_examples(raw["train"], tokenizer, phase_args, training_args.seed, split_lines, "train",
                                    sources.get("train"))
        datasets_.append(truncate(examples, data_args.max_train_samples))
    steps = phase_steps(phases, training_args.max_steps)
    sizes = [p.batch_size or training_args.per_device_train_batch_size for p in phases]
    logger.warning("phases: " + ", ".join(f"{p.length} tokens x {b} per device for steps {sum(steps[:i]) + 1}-"
                                          f"{sum(steps[:i + 1])}" for i, (p, b) in enumerate(zip(phases, sizes))))
    return PhasedData(datasets_, phases, steps, sizes, training_args.gradient_accumulation_steps,
                      training_args.world_size, training_args.seed)


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, run_args, training_args = parse_args(argv)
    preemption = checkpoints.preemption(training_args, __file__, argv)  # before the data: see its docstring
    setup_logging(training_args)
    check_data_parallel(training_args)
    set_seed(training_args.seed)
    check_run(data_args, run_args, training_args)
    if training_args.dataloader_num_workers > 0 and training_args.dataloader_persistent_workers:
        logger.warning("persistent dataloader workers keep the epoch they started with: masks repeat across epochs")

    tokenizer = load_tokenizer(model_args)
    raw, split_lines = load_raw_datasets(data_args, model_args)
    sources = file_sources(data_args)
    phases = data_args.phase_list
    # without phases every split has --max_seq_length; with them, evaluation takes the last phase's length
    final_args = dataclasses.replace(data_args, max_seq_length=phases[-1].length, phases=None) if phases else data_args
    phased = None
    with training_args.main_process_first(desc="pre-training data"):
        splits = {
            name: prepare_examples(raw_split, tokenizer, final_args, training_args.seed, split_lines, name,
                                   sources.get(name))
            for name, raw_split in raw.items() if not (phases and name == "train")
        }
        if phases and training_args.do_train and "train" in raw:
            phased = prepare_phases(raw, tokenizer, data_args, training_args, split_lines, sources)
    train_dataset = truncate(splits.get("train"), data_args.max_train_samples) if training_args.do_train else None
    if phased is not None:
        train_dataset = phased.dataset
    eval_dataset = truncate(splits.get("validation"), data_args.max_eval_samples) if training_args.do_eval else None
    if training_args.do_train and train_dataset is None:
        raise ValueError("--do_train needs training data")
    if training_args.do_eval and eval_dataset is None:
        raise ValueError(
            "--do_eval needs a validation split, --validation_file, or --validation_split_percentage > 0 (which a "
            "streamed data set cannot use)"
        )

    longest = max(p.length for p in phases) if phases else data_args.max_seq_length
    model = load_model(model_args, tokenizer, longest, data_args.objective)
    if training_args.ddp_find_unused_parameters is None:  # the heads use every parameter: skip DDP's extra graph walk
        training_args.ddp_find_unused_parameters = False
    collator = DataCollatorForPreTraining(
        tokenizer,
        mlm_probability=data_args.mlm_probability,
        mask_replace_prob=data_args.mask_replace_prob,
        random_replace_prob=data_args.random_replace_prob,
        whole_word_mask=data_args.whole_word_masking,
        # windows are full: padding them would only break the packed layout of --document_attention
        pad_to_multiple_of=None if data_args.document_attention else data_args.pad_to_multiple_of,
        seed=training_args.seed,
        document_positions_for=tokenizer.sep_token_id if data_args.document_attention else None,
    )
    budget = None
    if run_args.budget_seconds is not None:
        step_limit = training_args.max_steps if training_args.max_steps != BUDGET_ONLY_MAX_STEPS else None
        budget = TimeBudget(run_args.budget_seconds, step_limit)
    trainer = PreTrainingTrainer(
        model=model,
        args=training_args,
        callbacks=preemption,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
        document_attention=data_args.document_attention,
        phased=phased,
        budget=budget,
        peak_tflops=run_args.peak_tflops,
    )
    distributed = {
        "world_size": trainer.args.world_size,
        "torch_distributed": torch.distributed.is_available() and torch.distributed.is_initialized(),
        "distributed_type": str(trainer.accelerator.distributed_type.value),
    }

    results = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        tokens = trainer.token_metrics(train_result.metrics["train_runtime"])
        metrics = {**train_result.metrics, **tokens, **distributed}
        if not isinstance(train_dataset, IterableDataset):
            metrics["train_samples"] = len(train_dataset)
        if budget is not None:
            metrics["train_budget_seconds_spent"] = budget.spent()
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results.update(metrics)
    if training_args.do_eval:
        metrics = {**trainer.evaluate(), **distributed}
        if not isinstance(eval_dataset, IterableDataset):
            metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
    if training_args.push_to_hub:
        trainer.push_to_hub(tasks="fill-mask", model_name=os.path.basename(training_args.output_dir))
    return results


if __name__ == "__main__":
    main()
    common.leave_process_group()
