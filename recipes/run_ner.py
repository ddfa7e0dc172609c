"""Fine-tune bert-impl for token classification (named entities): CoNLL-2003, or your own files.

    python recipes/run_ner.py --model_name_or_path bert-base-cased --dataset_name conll2003 --do_train --do_eval \\
        --max_seq_length 128 --per_device_train_batch_size 32 --learning_rate 5e-5 --num_train_epochs 3 \\
        --output_dir outputs/conll2003

Data:
- `--dataset_name conll2003` (or any Hub data set with `tokens` and `ner_tags` columns).
- `.txt` / `.conll` files in the CoNLL column format: one token per line, its tag in the last column
  (`token POS chunk TAG` for CoNLL-2003), a blank line between sentences, `-DOCSTART-` lines skipped.
- JSON(L) or CSV files with a list of words (`tokens`) and a list of tag strings (`ner_tags`) per sentence; other
  column names with `--text_column_name`, `--label_column_name`.

Each word's tag goes on its first sub-token; the other sub-tokens are ignored by the loss, or, with
`--label_all_tokens`, trained on the word's tag too (B-X becoming I-X on continuations). Evaluation is always per
word (first sub-token): entity-level precision, recall and F1 as seqeval computes them, and word accuracy. Words
cut off by --max_seq_length are not scored.

Writes into --output_dir the model and tokenizer, `all_results.json`, with --do_predict `predictions.txt` (one line of
predicted tags per sentence), and a model card.
"""

import needs_extra  # noqa: F401  (first: says what to install where the recipes extra is missing)
import os
from dataclasses import dataclass, field

import datasets
import numpy as np
from transformers import DataCollatorForTokenClassification, Trainer, default_data_collator, set_seed

import checkpoints
import common
import user_files
from metrics import seqeval_metrics
from modeling_bert_impl import BertImplForTokenClassification


@dataclass
class DataArguments(common.DataArguments):
    text_column_name: str = field(default="tokens", metadata={"help": "The column with each sentence's words."})
    label_column_name: str = field(default="ner_tags", metadata={"help": "The column with each sentence's tags."})
    label_all_tokens: bool = field(
        default=False,
        metadata={"help": "Train every sub-token on its word's tag (B- becomes I- on continuations), not only the "
                          "first; evaluation stays per word."},
    )


def read_conll(path: str) -> datasets.Dataset:
    """A CoNLL column file as a Dataset with columns id, tokens, ner_tags (tag strings). A ValueError naming the file
    (and the line) when it is missing, empty, not UTF-8 (`user_files.read_text`), has a line without a tag, or holds no
    sentence."""
    sentences, tokens, tags = [], [], []
    for number, line in enumerate(user_files.read_text(path).split("\n"), 1):
        parts = line.split()
        if not parts or parts[0] == "-DOCSTART-":
            if tokens:
                sentences.append((tokens, tags))
                tokens, tags = [], []
            continue
        if len(parts) < 2:
            raise ValueError(f"{path}, line {number}: expected a token and its tag, got {line.strip()!r}")
        tokens.append(parts[0])
        tags.append(parts[-1])
    if tokens:
        sentences.append((tokens, tags))
    if not sentences:
        raise ValueError(f"{path}: no sentences, only -DOCSTART- and blank lines; a CoNLL file holds one word per line "
                         "with its tag in the last column, and a blank line between sentences")
    return datasets.Dataset.from_dict({
        "id": [str(i) for i in range(len(sentences))],
        "tokens": [s[0] for s in sentences],
        "ner_tags": [s[1] for s in sentences],
    })


def read_file(path: str) -> datasets.Dataset:
    if path.rsplit(".", 1)[-1].lower() in ("txt", "conll"):
        return read_conll(path)
    return user_files.read_table(path)


def refuse_sentences(path: str, rows: list[int], problem: str, advice: str) -> None:
    """`user_files.refuse_rows` for sentences: a CoNLL file's sentences are numbered, not located by line."""
    if rows and path.rsplit(".", 1)[-1].lower() in ("txt", "conll"):
        shown = ", ".join(str(i + 1) for i in rows[:5]) + (", ..." if len(rows) > 5 else "")
        raise ValueError(f"{path}: {len(rows)} sentence(s) {problem}: sentence(s) {shown}. {advice}")
    user_files.refuse_rows(path, rows, problem, advice)


def check_sentences(raw, files: dict[str, str], words: str, tags: str) -> None:
    """A ValueError naming the file and line of each file's first sentences whose words or tags are missing, or whose
    number of tags is not its number of words."""
    for split, path in files.items():
        columns = raw[split].column_names
        if words not in columns:
            raise ValueError(f"{path}: no {words!r} column (its columns: {', '.join(columns)}); name the column of the "
                             "words with --text_column_name")
        if tags not in columns:
            if split != "test":
                raise ValueError(f"{path}: no {tags!r} column (its columns: {', '.join(columns)}); name the column of "
                                 "the tags with --label_column_name")
            continue
        bad = [i for i, (w, t) in enumerate(zip(raw[split][words], raw[split][tags]))
               if not isinstance(w, list) or not isinstance(t, list) or len(w) != len(t) or None in w or None in t]
        refuse_sentences(path, bad, f"do not have one {tags!r} tag per {words!r} word (lists of equal length, no "
                         "empty item)", "Give each word its tag.")


def align_labels(word_ids: list, tag_ids: list[int], continuation: list[int] | None = None) -> list[int]:
    """One label per sub-token of a tokenized sentence: its word's tag id on the word's first sub-token, -100 (ignored)
    on special tokens and padding (word id None) and on the word's other sub-tokens, or, given `continuation` (tag id
    -> the id to train continuations on, B-X -> I-X), that id of the word's tag."""
    row, previous = [], None
    for word in word_ids:
        if word is None:
            row.append(-100)
        elif word != previous:
            row.append(tag_ids[word])
        else:
            row.append(continuation[tag_ids[word]] if continuation else -100)
        previous = word
    return row


def main(argv: list[str] | None = None) -> Trainer:
    """Run the recipe with `argv` (default: the command line) and return its Trainer."""
    model_args, data_args, training_args = common.parse_args(DataArguments, argv)
    common.setup_logging(training_args)
    return run(model_args, data_args, training_args, argv)


def run(model_args: common.ModelArguments, data_args: DataArguments, training_args: common.RecipeTrainingArguments,
        argv: list[str] | None = None, script: str = __file__) -> Trainer:
    """The recipe on parsed arguments (their output directory checked by `checkpoints.prepare_run`); `script` and `argv`
    are the command the model card records. run_ner_features.py --fine_tune calls it for the table's fine-tuning row."""
    preemption = checkpoints.preemption(training_args, script, argv)  # before the data: see its docstring
    set_seed(training_args.seed)

    raw = common.load_data(data_args, model_args.cache_dir, read_file)
    common.require_splits(raw, training_args)
    words, tags = data_args.text_column_name, data_args.label_column_name

    # Tag names in id order: the data set's ClassLabel names, else the sorted tags of the train and validation data
    # (else, to predict only, the fine-tuned model's).
    check_sentences(raw, common.data_files(data_args) if data_args.dataset_name is None else {}, words, tags)
    tagged = [raw[s] for s in ("train", "validation", "test") if s in raw and tags in raw[s].column_names]
    by_id = bool(tagged) and hasattr(getattr(tagged[0].features[tags], "feature", None), "names")
    labelled = [raw[s] for s in ("train", "validation") if s in raw and tags in raw[s].column_names]
    if by_id:
        label_list = list(tagged[0].features[tags].feature.names)
    elif labelled:
        label_list = [str(t) for t in sorted({t for d in labelled for sentence in d[tags] for t in sentence})]
    else:
        label_list = None
    config = {} if label_list is None else {
        "num_labels": len(label_list),
        "id2label": dict(enumerate(label_list)),
        "label2id": {label: i for i, label in enumerate(label_list)},
    }

    tokenizer = common.load_tokenizer(model_args)
    max_length = common.sequence_length(data_args, tokenizer)
    model = common.load_for_fine_tuning(BertImplForTokenClassification, model_args,
                                         ignore_mismatched_sizes=model_args.ignore_mismatched_sizes, **config)
    label_list = [model.config.id2label[i] for i in range(model.config.num_labels)]
    if not by_id and "test" in raw and tags in raw["test"].column_names:
        unknown = [i for i, sentence in enumerate(raw["test"][tags]) if not set(map(str, sentence)) <= set(label_list)]
        refuse_sentences(data_args.test_file or "the test split", unknown, "have tags the model does not know "
                         f"(it knows {', '.join(label_list)})", "Correct the tags, or drop them to predict only.")
    tag_to_id = None if by_id else {label: i for i, label in enumerate(label_list)}  # tag string -> id
    # B-X -> I-X (when the model has I-X), for the continuation sub-tokens of --label_all_tokens.
    b_to_i = [label_list.index("I-" + l[2:]) if l.startswith("B-") and "I-" + l[2:] in label_list else i
              for i, l in enumerate(label_list)]

    def tokenize_and_align(batch, label_all_tokens):
        encoded = tokenizer(batch[words], is_split_into_words=True, truncation=True, max_length=max_length,
                            padding="max_length" if data_args.pad_to_max_length else False)
        if tags not in batch:
            return encoded
        encoded["labels"] = []
        for i, sentence_tags in enumerate(batch[tags]):
            ids = sentence_tags if by_id else [tag_to_id[str(t)] for t in sentence_tags]
            encoded["labels"].append(align_labels(encoded.word_ids(i), ids, b_to_i if label_all_tokens else None))
        return encoded

    def prepare(split, n, label_all_tokens=False):
        dataset = common.take(raw[split], n)
        return common.preprocess(dataset, tokenize_and_align, training_args, data_args, f"Tokenizing {split}",
                                 fn_kwargs={"label_all_tokens": label_all_tokens}, remove_columns=dataset.column_names)

    def word_level(logits, label_ids):
        """Predicted and gold tag names of the scored sub-tokens (each word's first), per sentence."""
        predictions = np.argmax(logits, axis=-1)
        pairs = [[(label_list[p], label_list[g]) for p, g in zip(row_p, row_g) if g != -100]
                 for row_p, row_g in zip(predictions, label_ids)]
        return [[p for p, _ in row] for row in pairs], [[g for _, g in row] for row in pairs]

    def compute_metrics(p):
        return seqeval_metrics(*word_level(p.predictions, p.label_ids))

    train_dataset = None
    if training_args.do_train:
        train_dataset = prepare("train", data_args.max_train_samples, label_all_tokens=data_args.label_all_tokens)
    eval_dataset = prepare("validation", data_args.max_eval_samples) if training_args.do_eval else None
    collator = default_data_collator if data_args.pad_to_max_length else DataCollatorForTokenClassification(tokenizer)
    trainer = checkpoints.RecipeTrainer(
        model=model,
        args=training_args,
        callbacks=preemption,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
    )

    metrics = {}
    if training_args.do_train:
        metrics.update(common.train_and_save(trainer, training_args, len(train_dataset)))
    if training_args.do_eval:
        eval_metrics = common.evaluate_and_record(trainer, len(eval_dataset))
        metrics.update(eval_metrics)
    if training_args.do_predict:
        test = common.take(raw["test"], data_args.max_predict_samples)
        has_tags = tags in test.column_names
        if not has_tags:  # placeholder tags mark each word's first sub-token; they are not scored
            test = test.add_column(tags, [[0 if by_id else label_list[0]] * len(w) for w in test[words]])
        dataset = common.preprocess(test, tokenize_and_align, training_args, data_args, "Tokenizing test",
                                    fn_kwargs={"label_all_tokens": False}, remove_columns=test.column_names)
        output = trainer.predict(dataset, metric_key_prefix="predict")
        if has_tags:
            common.record(trainer, "predict", output.metrics)
        if trainer.is_world_process_zero():
            predicted, _ = word_level(output.predictions, output.label_ids)
            with open(os.path.join(training_args.output_dir, "predictions.txt"), "w") as f:
                f.writelines(" ".join(row) + "\n" for row in predicted)
    common.finish(trainer, model_args, data_args, metrics, script, argv)
    return trainer


if __name__ == "__main__":
    main()
    common.leave_process_group()
