"""Fine-tune bert-impl for sentence or sentence-pair classification (or regression): GLUE, or your own files.

    python recipes/run_glue.py --model_name_or_path bert-base-uncased --task_name mrpc --do_train --do_eval \\
        --max_seq_length 128 --per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 3 \\
        --output_dir outputs/mrpc

Data:
- `--task_name` (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli): the GLUE task from the Hub (nyu-mll/glue), scored
  with GLUE's metric (CoLA Matthews correlation, STS-B Pearson/Spearman, MRPC/QQP accuracy and F1, the others
  accuracy; MNLI on validation_matched and, suffixed `_mm`, validation_mismatched).
- `--train_file`/`--validation_file`/`--test_file`: CSV, JSON(L), or TSV (GLUE's original tab-separated files, header
  line, no quoting). The label is the `label` column (or GLUE's TSV names: gold_label, is_duplicate, score, Quality;
  or `--label_column_name`), the texts `--text_column_names`, else the task's columns, `sentence1`/`sentence2`,
  `sentence`, or the one or two other text columns. With `--task_name` too, the files are scored with that task's
  metric. Float labels (or stsb) mean regression; other labels (strings or integers) are classes, compared as text
  (`1` and `"1"` are one class), sorted (integers in numeric order), and kept in the model's `config.id2label`/
  `label2id`. Without a task the metric is accuracy (regression: Pearson/Spearman). Refused, naming the file and lines:
  an empty label, a validation label the training file never has, a validation file without labels under --do_eval.

Writes into --output_dir the model and tokenizer, `all_results.json` (train_*, eval_* metrics), with --do_predict
`predict_results_<task>.txt` (label names), and a model card.
"""

import needs_extra  # noqa: F401  (first: says what to install where the recipes extra is missing)
import logging
import os
import re
from dataclasses import dataclass, field

import numpy as np
from transformers import DataCollatorWithPadding, Trainer, default_data_collator, set_seed

import checkpoints
import common
import user_files
from metrics import accuracy, glue_metrics, pearson_and_spearman
from modeling_bert_impl import BertImplForSequenceClassification

logger = logging.getLogger(__name__)

TASK_TO_KEYS = {
    "cola": ("sentence", None),
    "sst2": ("sentence", None),
    "mrpc": ("sentence1", "sentence2"),
    "stsb": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"),
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}
INTEGER = re.compile(r"-?\d+")
# The label column of GLUE's original TSV files where it is not "label": MNLI, QQP, STS-B, MRPC.
TSV_LABEL_COLUMNS = ("gold_label", "is_duplicate", "score", "Quality")


@dataclass
class DataArguments(common.DataArguments):
    task_name: str | None = field(
        default=None, metadata={"help": "A GLUE task: " + ", ".join(TASK_TO_KEYS)}
    )
    text_column_names: str | None = field(
        default=None, metadata={"help": "The one or two text columns of the files, comma-separated."}
    )
    label_column_name: str | None = field(default=None, metadata={"help": "The label column of the files."})

    def __post_init__(self):
        if self.task_name is not None:
            self.task_name = self.task_name.lower()
            if self.task_name not in TASK_TO_KEYS:
                raise ValueError(f"unknown task {self.task_name!r}; choose one of {', '.join(TASK_TO_KEYS)}")
            if not (self.train_file or self.validation_file or self.test_file):
                self.dataset_name, self.dataset_config_name = "nyu-mll/glue", self.task_name
        super().__post_init__()


def find_label_column(columns, data_args) -> str | None:
    if data_args.label_column_name:
        return data_args.label_column_name
    return next((c for c in ("label", *TSV_LABEL_COLUMNS) if c in columns), None)


def require_label_column(raw, files: dict[str, str], label_column: str | None, data_args, training_args) -> None:
    """A ValueError naming the first split that needs labels and lacks the label column, the training file before the
    validation file: its file, the name looked for (the one --label_column_name gave, or the names tried) and its
    columns."""
    needs = [("train", training_args.do_train, ""),
             ("validation", training_args.do_eval, ", so --do_eval has nothing to score; add the labels, name their "
              "column with --label_column_name, or give the file as --test_file with --do_predict")]
    for split, needed, advice in needs:
        columns = raw[split].column_names if split in raw else None
        if not needed or columns is None or (label_column is not None and label_column in columns):
            continue
        where = files.get(split, f"the {split} split")
        if data_args.label_column_name:
            looked_for = f"{label_column!r} (--label_column_name)"
        else:
            tried = ", ".join(repr(c) for c in ("label", *TSV_LABEL_COLUMNS))
            looked_for = f"{label_column!r}" if label_column else f"among {tried}"
            advice = advice or "; name it with --label_column_name"
        raise ValueError(f"{where}: no label column {looked_for} (its columns: {', '.join(columns)}){advice}")


def find_text_columns(dataset, label_column, data_args) -> list[str]:
    """The one or two text columns: as given, the task's, sentence1/sentence2, sentence, or the other text columns."""
    columns = dataset.column_names
    if data_args.text_column_names:
        return [c.strip() for c in data_args.text_column_names.split(",")]
    candidates = [TASK_TO_KEYS[data_args.task_name]] if data_args.task_name else []
    candidates += [("sentence1", "sentence2"), ("sentence", None)]
    for keys in candidates:
        keys = [k for k in keys if k]
        if all(k in columns for k in keys):
            return keys
    texts = [c for c in columns
             if c != label_column and getattr(dataset.features[c], "dtype", None) in ("string", "large_string")]
    if len(texts) in (1, 2):
        return texts
    raise ValueError(f"cannot tell the text columns among {columns}; pass --text_column_names")


def check_labels(raw, files: dict[str, str], label_column: str, classes: bool) -> None:
    """A ValueError naming the file and lines of labelled rows of the --train_file / --validation_file that cannot be
    trained or scored: an empty label, or, for classes, a validation label that the training file never has."""
    labelled = [s for s in ("train", "validation") if s in files and label_column in raw[s].column_names]
    for split in labelled:
        empty = [i for i, v in enumerate(raw[split][label_column]) if v is None or v != v]  # None, NaN
        user_files.refuse_rows(files[split], empty, f"have an empty {label_column!r}", "Fill in the labels or remove the "
                           "rows.")
    if classes and labelled == ["train", "validation"]:
        known = {str(v) for v in raw["train"].unique(label_column)}
        unseen = [i for i, v in enumerate(raw["validation"][label_column]) if str(v) not in known]
        user_files.refuse_rows(files["validation"], unseen, f"have a {label_column!r} that {files['train']} never has "
                           f"(its labels: {', '.join(sorted(known))})", "The model cannot learn such a class: correct "
                           "the labels, or add training examples of it.")


def main(argv: list[str] | None = None) -> Trainer:
    """Run the recipe with `argv` (default: the command line) and return its Trainer."""
    model_args, data_args, training_args = common.parse_args(DataArguments, argv)
    preemption = checkpoints.preemption(training_args, __file__, argv)  # before the data: see its docstring
    common.setup_logging(training_args)
    set_seed(training_args.seed)

    raw = common.load_data(data_args, model_args.cache_dir)
    task = data_args.task_name
    if data_args.dataset_name is not None:  # GLUE from the Hub: MNLI has two validation and two test splits
        eval_splits = ["validation_matched", "validation_mismatched"] if task == "mnli" else ["validation"]
        test_splits = ["test_matched", "test_mismatched"] if task == "mnli" else ["test"]
    else:
        eval_splits, test_splits = ["validation"], ["test"]
    for flag, splits in (("do_eval", eval_splits), ("do_predict", test_splits)):
        if getattr(training_args, flag) and not all(s in raw for s in splits):
            raise ValueError(f"--{flag} needs the split(s) {splits}: give the matching --*_file")
    if training_args.do_train and "train" not in raw:
        raise ValueError("--do_train needs --train_file (or --task_name)")

    reference = raw["train"] if "train" in raw else raw[next(iter(raw))]
    label_column = find_label_column(reference.column_names, data_args)
    files = common.data_files(data_args) if data_args.dataset_name is None else {}
    require_label_column(raw, files, label_column, data_args, training_args)
    text_columns = find_text_columns(reference, label_column, data_args)
    logger.info(f"text columns {text_columns}, label column {label_column!r}")
    labelled = [raw[s] for s in ("train", "validation") if s in raw and label_column in raw[s].column_names]

    tokenizer = common.load_tokenizer(model_args)
    max_length = common.sequence_length(data_args, tokenizer)
    label_to_id = None  # str(raw label) -> class id, when the data's labels are not ids already
    if labelled:  # the labels come from the data
        feature = labelled[0].features[label_column]
        is_regression = task == "stsb" or (task is None and feature.dtype.startswith("float"))
        check_labels(raw, files, label_column, classes=not is_regression and training_args.do_train)
        if is_regression:
            config = {"num_labels": 1, "problem_type": "regression"}
        else:
            if hasattr(feature, "names"):  # a ClassLabel: ids already, with names
                labels = list(feature.names)
            else:  # compared as text, so that 1 in one file and "1" in the other are one class; integers in order
                labels = sorted({str(v) for d in labelled for v in d.unique(label_column)},
                                key=lambda v: (0, int(v), "") if INTEGER.fullmatch(v) else (1, 0, v))
                label_to_id = {label: i for i, label in enumerate(labels)}
            config = {
                "num_labels": len(labels),
                "id2label": {i: str(label) for i, label in enumerate(labels)},
                "label2id": {str(label): i for i, label in enumerate(labels)},
                "problem_type": "single_label_classification",
            }
    else:  # prediction only: the labels are the fine-tuned model's
        config = {}
    model = common.load_for_fine_tuning(BertImplForSequenceClassification, model_args,
                                         ignore_mismatched_sizes=model_args.ignore_mismatched_sizes, **config)
    is_regression = model.config.problem_type == "regression" or model.config.num_labels == 1
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]

    def tokenize(batch):
        texts = [[t if t is not None else "" for t in batch[c]] for c in text_columns]
        encoded = tokenizer(*texts, padding="max_length" if data_args.pad_to_max_length else False,
                            max_length=max_length, truncation=True)
        if label_column in batch:
            values = batch[label_column]
            encoded["labels"] = (
                [float(v) for v in values] if is_regression
                else [label_to_id[str(v)] for v in values] if label_to_id
                else values
            )
        return encoded

    def prepare(split, n, with_labels=True):
        dataset = common.take(raw[split], n)
        if not with_labels and label_column in dataset.column_names:
            dataset = dataset.remove_columns(label_column)
        return common.preprocess(dataset, tokenize, training_args, data_args, f"Tokenizing {split}",
                                 remove_columns=dataset.column_names)

    def compute_metrics(p):
        logits = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        predictions = np.squeeze(logits, -1) if is_regression else np.argmax(logits, axis=-1)
        if task is not None:
            return glue_metrics(task, predictions, p.label_ids)
        return (pearson_and_spearman if is_regression else accuracy)(predictions, p.label_ids)

    train_dataset = prepare("train", data_args.max_train_samples) if training_args.do_train else None
    eval_datasets = {s: prepare(s, data_args.max_eval_samples) for s in eval_splits} if training_args.do_eval else {}
    trainer = checkpoints.RecipeTrainer(
        model=model,
        args=training_args,
        callbacks=preemption,
        train_dataset=train_dataset,
        eval_dataset=next(iter(eval_datasets.values()), None),
        processing_class=tokenizer,
        data_collator=default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
    )

    metrics = {}
    if training_args.do_train:
        metrics.update(common.train_and_save(trainer, training_args, len(train_dataset)))
    if training_args.do_eval:
        eval_metrics = {}
        for split, dataset in eval_datasets.items():
            result = {**trainer.evaluate(eval_dataset=dataset), "eval_samples": len(dataset)}
            suffix = "_mm" if split == "validation_mismatched" else ""
            eval_metrics.update({k + suffix: v for k, v in result.items()})
        common.record(trainer, "eval", eval_metrics)
        metrics.update(eval_metrics)
    if training_args.do_predict:
        for split in test_splits:
            dataset = prepare(split, data_args.max_predict_samples, with_labels=False)
            logits = trainer.predict(dataset, metric_key_prefix="predict").predictions
            predictions = np.squeeze(logits, -1) if is_regression else np.argmax(logits, axis=-1)
            if trainer.is_world_process_zero():
                name = f"predict_results_{task or 'test'}{'_mm' if split == 'test_mismatched' else ''}.txt"
                with open(os.path.join(training_args.output_dir, name), "w") as f:
                    f.write("index\tprediction\n")
                    for i, p in enumerate(predictions):
                        f.write(f"{i}\t{p:.3f}\n" if is_regression else f"{i}\t{labels[p]}\n")
    common.finish(trainer, model_args, data_args, metrics, __file__, argv)
    return trainer


if __name__ == "__main__":
    main()
    common.leave_process_group()
