#!/usr/bin/env python
"""Pre-train BERT (masked LM + next sentence prediction, Devlin et al., 2019) with transformers' `Trainer`.

Every `TrainingArguments` flag works (`--bf16`, `--gradient_checkpointing`, `--resume_from_checkpoint`,
`--push_to_hub`, `--report_to`, ...), and the script runs as is under `torchrun` and `accelerate launch`.
See recipes/PRETRAINING.md for the paper's two-phase schedule. As in the fine-tuning recipes (`common.py`), an
--output_dir holding an earlier run is refused without --overwrite_output_dir, checkpoints are written all-or-nothing,
and `--resume_from_checkpoint last` takes the newest complete one.

    python recipes/run_pretraining.py --config_name base --tokenizer_name bert-base-uncased \
        --train_file corpus/*.txt --max_seq_length 128 --do_train --do_eval --output_dir out/phase1

Training logs carry loss, mlm_loss, nsp_loss, mlm_accuracy and nsp_accuracy (means since the previous log, over all
processes); evaluation adds eval_mlm_loss, eval_nsp_loss, eval_mlm_accuracy, eval_nsp_accuracy, eval_mlm_perplexity.
"""

import copy
import glob
import logging
import math
import os
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from datasets import IterableDataset, load_dataset
from transformers import AutoTokenizer, HfArgumentParser, TrainerCallback, TrainingArguments, set_seed

import common
from modeling_bert_impl import PRESETS, BertImplConfig, BertImplForPreTraining
from pretraining_data import (
    DataCollatorForPreTraining,
    DatasetDocuments,
    build_examples,
    masked_lm_targets,
    tokenize_documents,
)

logger = logging.getLogger(__name__)

EXAMPLE_FEATURES = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "token_type_ids": datasets.List(datasets.Value("int8")),
    "next_sentence_label": datasets.Value("int8"),
})


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

    def __post_init__(self):
        if not self.dataset_name and not self.train_file and not self.validation_file:
            raise ValueError("pass --dataset_name or --train_file/--validation_file")
        if self.max_seq_length < 5:
            raise ValueError(f"max_seq_length must leave room for [CLS] A [SEP] B [SEP], got {self.max_seq_length}")


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer, model
# ---------------------------------------------------------------------------------------------------------------------
def load_tokenizer(model_args: ModelArguments):
    """bert-impl's tokenizer where the package is there, transformers' otherwise."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        raise ValueError("pass --tokenizer_name (a BERT tokenizer folder or Hub id), or --model_name_or_path")
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


def load_model(model_args: ModelArguments, tokenizer, max_seq_length: int) -> BertImplForPreTraining:
    if model_args.model_name_or_path:
        if model_args.config_name or model_args.config_overrides:
            raise ValueError("--config_name/--config_overrides make a new model; drop them with --model_name_or_path")
        model = BertImplForPreTraining.from_pretrained(
            model_args.model_name_or_path, cache_dir=model_args.cache_dir, token=model_args.token, sparse_prediction=True
        )
        if len(tokenizer) > model.config.vocab_size:
            model.resize_token_embeddings(len(tokenizer))
    else:
        model = BertImplForPreTraining(new_config(model_args, tokenizer))
    if max_seq_length > model.config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length {max_seq_length} exceeds the model's max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"BertImplForPreTraining: {n_params / 1e6:.1f}M parameters, config {model.config.to_diff_dict()}")
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
    (`common.check_text_file`, a chunk at a time): a ValueError naming the file when one is missing, empty or not UTF-8
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
            common.check_text_file(path)
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
    """Rows of text -> tokenized documents -> pre-training examples (columns of `EXAMPLE_FEATURES`), cached. A split of
    fewer than MIN_DOCUMENTS documents is a ValueError, naming `source` (the files it comes from) when given."""
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
    if not streaming and len(documents) < MIN_DOCUMENTS:
        where = f"{source}: " if source else ""
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
    """On-device sums over the training micro-batches since the last log: no host sync per step."""

    FIELDS = ("mlm_loss", "nsp_loss", "batches", "mlm_correct", "mlm_total", "nsp_correct", "nsp_total")

    def __init__(self):
        self.sums = None  # (len(FIELDS),) float32

    @torch.no_grad()
    def add(self, outputs, inputs: dict) -> None:
        logits, targets = masked_lm_targets(outputs.prediction_logits, inputs["labels"])  # (M, V), (M,)
        nsp_logits, nsp_labels = outputs.seq_relationship_logits, inputs["next_sentence_label"]  # (B, 2), (B,)
        values = torch.stack([
            outputs.mlm_loss.float(), outputs.nsp_loss.float(), torch.ones((), device=targets.device),
            (logits.argmax(-1) == targets).sum().float(), torch.tensor(targets.numel(), device=targets.device).float(),
            (nsp_logits.argmax(-1) == nsp_labels).sum().float(), torch.tensor(nsp_labels.numel(), device=targets.device).float(),
        ])
        self.sums = values if self.sums is None else self.sums + values

    def pop(self) -> torch.Tensor | None:
        sums, self.sums = self.sums, None
        return sums

    @classmethod
    def summarize(cls, sums: torch.Tensor) -> dict[str, float]:
        s = dict(zip(cls.FIELDS, sums.tolist()))
        return {
            "mlm_loss": s["mlm_loss"] / s["batches"],
            "nsp_loss": s["nsp_loss"] / s["batches"],
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_total"], 1.0),
            "nsp_accuracy": s["nsp_correct"] / max(s["nsp_total"], 1.0),
        }


def preprocess_logits_for_metrics(logits: tuple, labels: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep what `compute_metrics` needs instead of the (B, T, V) logits.

    logits: (prediction_logits (B, T, V) or (M, V) masked rows only, seq_relationship_logits (B, 2));
    labels: (labels (B, T), next_sentence_label (B,)).
    Returns MLM loss per token (B, T) and predicted ids (B, T), both -100 where nothing is predicted, and the NSP
    logits (B, 2)."""
    prediction_logits, nsp_logits = logits
    mlm_labels = labels[0]
    selected = mlm_labels != -100
    masked_logits, targets = masked_lm_targets(prediction_logits, mlm_labels)
    token_loss = torch.full(mlm_labels.shape, -100.0, device=mlm_labels.device)
    token_loss[selected] = F.cross_entropy(masked_logits.float(), targets, reduction="none")
    predictions = torch.full_like(mlm_labels, -100)
    predictions[selected] = masked_logits.argmax(-1)
    return token_loss, predictions, nsp_logits.float()


def compute_metrics(eval_pred) -> dict[str, float]:
    """MLM loss (per masked token), accuracy and perplexity; NSP loss and accuracy, over the whole evaluation set."""
    token_loss, predictions, nsp_logits = eval_pred.predictions
    mlm_labels, nsp_labels = eval_pred.label_ids
    selected = mlm_labels != -100
    mlm_loss = float(token_loss[selected].mean()) if selected.any() else float("nan")
    nsp_logits = nsp_logits.astype(np.float64)
    top = nsp_logits.max(-1, keepdims=True)
    log_z = (top + np.log(np.exp(nsp_logits - top).sum(-1, keepdims=True)))[:, 0]  # (N,)
    nsp_labels = nsp_labels.astype(np.int64)
    return {
        "mlm_loss": mlm_loss,
        "mlm_accuracy": float((predictions[selected] == mlm_labels[selected]).mean()) if selected.any() else float("nan"),
        "mlm_perplexity": math.exp(min(mlm_loss, 50.0)),
        "nsp_loss": float((log_z - nsp_logits[np.arange(len(nsp_labels)), nsp_labels]).mean()),
        "nsp_accuracy": float((nsp_logits.argmax(-1) == nsp_labels).mean()),
    }


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


class PreTrainingTrainer(common.RecipeTrainer):
    """`Trainer` that logs the MLM and NSP losses and accuracies of the training steps, and evaluates with fixed masks.

    The model returns per-batch mean losses, so the Trainer divides them by the accumulation steps itself
    (`model_accepts_loss_kwargs = False`; the model's `**packing` keyword arguments are not loss arguments)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = False
        self.tally = PreTrainingTally()
        self.eval_collator = copy.copy(self.data_collator)  # epoch stays 0: every evaluation masks alike
        if hasattr(self.data_collator, "set_epoch"):
            self.add_callback(MaskingEpochCallback(self.data_collator))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        if model.training:
            self.tally.add(outputs, inputs)
        if not return_outputs:
            return outputs.loss
        # evaluation reads every output but the loss as logits: give it the two heads' logits, in this order
        return outputs.loss, {"loss": outputs.loss, "prediction_logits": outputs.prediction_logits,
                              "seq_relationship_logits": outputs.seq_relationship_logits}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log, made on every process at the same step: reduce the tallies
            sums = self.tally.pop()
            if sums is not None:
                logs.update(PreTrainingTally.summarize(self.accelerator.reduce(sums, reduction="sum")))
        super().log(logs, start_time)

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
    """The three argument groups, then `common.prepare_run`: the output directory guard and the checkpoint to resume."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, common.RecipeTrainingArguments))
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        parsed = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    common.prepare_run(parsed[-1])
    return parsed


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


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, training_args = parse_args(argv)
    setup_logging(training_args)
    check_data_parallel(training_args)
    set_seed(training_args.seed)
    if data_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming needs --max_steps")
    if training_args.dataloader_num_workers > 0 and training_args.dataloader_persistent_workers:
        logger.warning("persistent dataloader workers keep the epoch they started with: masks repeat across epochs")

    tokenizer = load_tokenizer(model_args)
    raw, split_lines = load_raw_datasets(data_args, model_args)
    sources = file_sources(data_args)
    with training_args.main_process_first(desc="pre-training data"):
        splits = {
            name: prepare_examples(raw_split, tokenizer, data_args, training_args.seed, split_lines, name,
                                   sources.get(name))
            for name, raw_split in raw.items()
        }
    train_dataset = truncate(splits.get("train"), data_args.max_train_samples) if training_args.do_train else None
    eval_dataset = truncate(splits.get("validation"), data_args.max_eval_samples) if training_args.do_eval else None
    if training_args.do_train and train_dataset is None:
        raise ValueError("--do_train needs training data")
    if training_args.do_eval and eval_dataset is None:
        raise ValueError(
            "--do_eval needs a validation split, --validation_file, or --validation_split_percentage > 0 (which a "
            "streamed data set cannot use)"
        )

    model = load_model(model_args, tokenizer, data_args.max_seq_length)
    if training_args.ddp_find_unused_parameters is None:  # both heads use every parameter: skip DDP's extra graph walk
        training_args.ddp_find_unused_parameters = False
    collator = DataCollatorForPreTraining(
        tokenizer,
        mlm_probability=data_args.mlm_probability,
        mask_replace_prob=data_args.mask_replace_prob,
        random_replace_prob=data_args.random_replace_prob,
        whole_word_mask=data_args.whole_word_masking,
        pad_to_multiple_of=data_args.pad_to_multiple_of,
        seed=training_args.seed,
    )
    trainer = PreTrainingTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
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
        metrics = {**train_result.metrics, **distributed}
        if not isinstance(train_dataset, IterableDataset):
            metrics["train_samples"] = len(train_dataset)
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
