"""Fine-tune bert-impl for multiple choice: SWAG, or your own files in its layout.

    python recipes/run_swag.py --model_name_or_path bert-base-uncased --dataset_name swag \\
        --dataset_config_name regular --do_train --do_eval --max_seq_length 128 --per_device_train_batch_size 16 \\
        --learning_rate 2e-5 --num_train_epochs 3 --output_dir outputs/swag

Data: `--dataset_name swag --dataset_config_name regular`, or CSV / JSON(L) files with SWAG's columns: `sent1` (the
context), `sent2` (the start of the next sentence), `ending0`..`ending3` and `label` (the index of the right ending).
Each choice is the pair (sent1, sent2 + " " + ending); the model scores the four and is trained with cross-entropy
over them. Metric: accuracy.

Writes into --output_dir the model and tokenizer, `all_results.json`, with --do_predict `predict_results.txt` (the
chosen ending per example), and a model card.
"""

import needs_extra  # noqa: F401  (first: says what to install where the recipes extra is missing)
import os

import numpy as np
import torch
from transformers import Trainer, set_seed

import checkpoints
import common
import user_files
from metrics import accuracy
from modeling_bert_impl import BertImplForMultipleChoice

NUM_CHOICES = 4
ENDINGS = [f"ending{i}" for i in range(NUM_CHOICES)]


def check_examples(raw, files: dict[str, str]) -> None:
    """A ValueError naming the file (and lines) when a column is missing, a text is empty, or a label is not the index
    of an ending (0..3)."""
    for split, path in files.items():
        dataset = raw[split]
        required = ["sent1", "sent2", *ENDINGS] + (["label"] if split != "test" else [])
        missing = [c for c in required if c not in dataset.column_names]
        if missing:
            raise ValueError(f"{path}: no column(s) {', '.join(missing)} (its columns: {', '.join(dataset.column_names)})"
                             f"; SWAG files have sent1, sent2, {', '.join(ENDINGS)} and label")
        for column in ("sent1", "sent2", *ENDINGS):
            empty = [i for i, v in enumerate(dataset[column]) if v is None]
            user_files.refuse_rows(path, empty, f"have an empty {column!r}", "Fill it in or remove the rows.")
        if "label" in dataset.column_names and split != "test":
            bad = [i for i, v in enumerate(dataset["label"])
                   if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v not in range(NUM_CHOICES)]
            user_files.refuse_rows(path, bad, f"have a label that is not the index of an ending, 0 to {NUM_CHOICES - 1}",
                               "Correct the labels.")


def main(argv: list[str] | None = None) -> Trainer:
    """Run the recipe with `argv` (default: the command line) and return its Trainer."""
    model_args, data_args, training_args = common.parse_args(common.DataArguments, argv)
    preemption = checkpoints.preemption(training_args, __file__, argv)  # before the data: see its docstring
    common.setup_logging(training_args)
    set_seed(training_args.seed)

    raw = common.load_data(data_args, model_args.cache_dir)
    common.require_splits(raw, training_args)
    if data_args.dataset_name is None:
        check_examples(raw, common.data_files(data_args))
    tokenizer = common.load_tokenizer(model_args)
    max_length = common.sequence_length(data_args, tokenizer)
    model = common.load_for_fine_tuning(BertImplForMultipleChoice, model_args)

    def tokenize(batch):
        """Four (context, ending) pairs per example, tokenized flat and regrouped: every field becomes (4, T)."""
        contexts = [context for context in batch["sent1"] for _ in ENDINGS]
        endings = [f"{start} {batch[e][i]}" for i, start in enumerate(batch["sent2"]) for e in ENDINGS]
        encoded = tokenizer(contexts, endings, truncation=True, max_length=max_length,
                            padding="max_length" if data_args.pad_to_max_length else False)
        grouped = {k: [v[i : i + NUM_CHOICES] for i in range(0, len(v), NUM_CHOICES)] for k, v in encoded.items()}
        if "label" in batch:
            grouped["labels"] = batch["label"]
        return grouped

    def prepare(split, n, with_labels=True):
        dataset = common.take(raw[split], n)
        if not with_labels and "label" in dataset.column_names:
            dataset = dataset.remove_columns("label")
        return common.preprocess(dataset, tokenize, training_args, data_args, f"Tokenizing {split}",
                                 remove_columns=dataset.column_names)

    def collate(examples):
        """Pad a batch of examples, each (choices, T): flatten the choices, pad them together, regroup."""
        choices = [{k: v[i] for k, v in example.items() if k != "labels"}
                   for example in examples for i in range(NUM_CHOICES)]
        padded = tokenizer.pad(choices, return_tensors="pt")
        batch = {k: v.view(len(examples), NUM_CHOICES, -1) for k, v in padded.items()}
        if "labels" in examples[0]:
            batch["labels"] = torch.tensor([example["labels"] for example in examples])
        return batch

    def compute_metrics(p):
        return accuracy(np.argmax(p.predictions, axis=-1), p.label_ids)

    train_dataset = prepare("train", data_args.max_train_samples) if training_args.do_train else None
    eval_dataset = prepare("validation", data_args.max_eval_samples) if training_args.do_eval else None
    trainer = checkpoints.RecipeTrainer(
        model=model,
        args=training_args,
        callbacks=preemption,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collate,
        compute_metrics=compute_metrics,
    )

    metrics = {}
    if training_args.do_train:
        metrics.update(common.train_and_save(trainer, training_args, len(train_dataset)))
    if training_args.do_eval:
        eval_metrics = common.evaluate_and_record(trainer, len(eval_dataset))
        metrics.update(eval_metrics)
    if training_args.do_predict:
        logits = trainer.predict(prepare("test", data_args.max_predict_samples, with_labels=False)).predictions
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "predict_results.txt"), "w") as f:
                f.write("index\tprediction\n")
                f.writelines(f"{i}\t{p}\n" for i, p in enumerate(np.argmax(logits, axis=-1)))
    common.finish(trainer, model_args, data_args, metrics, __file__, argv)
    return trainer


if __name__ == "__main__":
    main()
    common.leave_process_group()
