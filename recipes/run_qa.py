"""Fine-tune bert-impl for extractive question answering: SQuAD v1.1 / v2.0, or your own files.

    python recipes/run_qa.py --model_name_or_path bert-base-uncased --dataset_name squad --do_train --do_eval \\
        --max_seq_length 384 --doc_stride 128 --per_device_train_batch_size 32 --learning_rate 3e-5 \\
        --num_train_epochs 2 --output_dir outputs/squad

Data:
- `--dataset_name squad` or `squad_v2` (the latter turns on --version_2_with_negative).
- The official nested SQuAD JSON files (`{"data": [{"title", "paragraphs": [{"context", "qas": [...]}]}]}`), or the
  flattened `datasets` layout as JSON / JSON lines: one record per question with id, title, context, question,
  answers {text: [...], answer_start: [...]} (empty lists: no answer).
- Checked before training: each answer against its context at answer_start (more than --answer_mismatch_tolerance of
  the answered questions missing their text stops the run; fewer are left out of training), unanswerable questions
  without --version_2_with_negative, questions too long for a window (`check_answers`, `check_question_lengths`).

A context longer than --max_seq_length is cut into windows that overlap by --doc_stride tokens; training labels each
window with the answer's tokens, or with [CLS] when the answer is not wholly inside it. Predictions take, over a
question's windows, the best span of at most --max_answer_length tokens among the --n_best_size best starts and ends;
with --version_2_with_negative the answer is "" when the [CLS] (null) score beats the best span's by more than
--null_score_diff_threshold. Metrics are the official SQuAD ones (`qa_utils.squad_metrics`), in percent.

Writes into --output_dir the model and tokenizer, `all_results.json`, `predictions.json` (id -> answer) and for v2
`null_odds.json` (id -> null score - best span score), with --do_predict `predict_predictions.json`, and a model card.
"""

import needs_extra  # noqa: F401  (first: says what to install where the recipes extra is missing)
import json
import logging
import os
from dataclasses import dataclass, field

import datasets
from transformers import DataCollatorWithPadding, Trainer, default_data_collator, set_seed

import checkpoints
import common
import user_files
from modeling_bert_impl import BertImplForQuestionAnswering
from qa_utils import (
    answer_mismatches, answer_token_span, flatten_squad, postprocess_qa_predictions, squad_metrics, tokenize_windows,
)

logger = logging.getLogger(__name__)

SQUAD_FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "title": datasets.Value("string"),
    "context": datasets.Value("string"),
    "question": datasets.Value("string"),
    "answers": {
        "text": datasets.List(datasets.Value("string")),
        "answer_start": datasets.List(datasets.Value("int32")),
    },
})


@dataclass
class DataArguments(common.DataArguments):
    max_seq_length: int = field(
        default=384, metadata={"help": "Tokens per window (question and context); longer contexts get more windows."}
    )
    doc_stride: int = field(default=128, metadata={"help": "Tokens shared by consecutive windows of a context."})
    version_2_with_negative: bool = field(default=False, metadata={"help": "Questions may have no answer (SQuAD v2)."})
    null_score_diff_threshold: float = field(
        default=0.0, metadata={"help": "Answer nothing when null score - best span score exceeds this (v2)."}
    )
    n_best_size: int = field(default=20, metadata={"help": "Best start and end positions tried per window."})
    max_answer_length: int = field(default=30, metadata={"help": "The longest answer, in tokens."})
    answer_mismatch_tolerance: float = field(
        default=0.01,
        metadata={"help": "Share of a file's answered questions whose answer_start may miss the answer text (they are "
                          "left out of training, with a warning); more stops the run."},
    )

    def __post_init__(self):
        if self.dataset_name == "squad_v2" or (self.dataset_name or "").endswith("/squad_v2"):
            self.version_2_with_negative = True
        super().__post_init__()


def read_squad(path: str) -> datasets.Dataset:
    """A SQuAD file: the official nested JSON, or flattened records as a JSON list, {"data": [...]} or JSON lines.
    A record without id, context or question is a ValueError naming the file and where in it."""
    text = user_files.read_text(path)
    if path.endswith(".jsonl"):
        numbered = [(f"line {line}", record) for line, record in user_files.json_records(path, text)]
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {error.lineno}, column {error.colno}: not valid JSON ({error.msg})") from None
        if isinstance(records, dict):
            if not isinstance(records.get("data"), list):
                raise ValueError(f"{path}: expected SQuAD's {{\"data\": [...]}} or a list of records")
            if records["data"] and "paragraphs" in records["data"][0]:
                try:
                    records = flatten_squad(records)
                except ValueError as error:
                    raise ValueError(f"{path}: {error}") from None
            else:
                records = records["data"]
        numbered = [(f"record {n + 1}", record) for n, record in enumerate(records)]
    empty = {"text": [], "answer_start": []}
    rows = []
    for where, r in numbered:
        missing = [key for key in ("id", "context", "question") if not isinstance(r, dict) or key not in r]
        if missing:
            raise ValueError(f"{path}, {where} (id {r.get('id') if isinstance(r, dict) else None}): no "
                             f"{' and no '.join(map(repr, missing))}; every question needs an id, a context and a "
                             "question")
        rows.append({"id": str(r["id"]), "title": r.get("title", ""), "context": r["context"],
                     "question": r["question"], "answers": r.get("answers") or empty})
    return datasets.Dataset.from_list(rows, features=SQUAD_FEATURES)


def check_answers(raw, files: dict[str, str], data_args: DataArguments) -> None:
    """Every labelled file's answers against its contexts (`answer_mismatches`): more than --answer_mismatch_tolerance
    of the answered questions is a ValueError listing the first ids; fewer are warned about and left out of training.
    Unanswerable questions without --version_2_with_negative are a ValueError (SQuAD v2 data)."""
    for split, path in files.items():
        if split == "test":  # answers optional, only scored as text
            continue
        examples = raw[split]
        answered = [bool(a["text"]) for a in examples["answers"]]
        if not data_args.version_2_with_negative and not all(answered):
            ids = [i for i, a in zip(examples["id"], answered) if not a]
            raise ValueError(f"{path}: {len(ids)} question(s) have no answer (ids {', '.join(ids[:5])}"
                             f"{', ...' if len(ids) > 5 else ''}): this is SQuAD v2 data; pass "
                             "--version_2_with_negative, or remove those questions")
        bad = answer_mismatches(examples.select_columns(["id", "context", "answers"]))
        if not bad:
            continue
        shown = "; ".join(f"id {qid}: {problem}" for qid, problem in bad[:3]) + ("; ..." if len(bad) > 3 else "")
        report = f"{path}: {len(bad)} of {sum(answered)} answered questions have an answer_start that misses the " \
                 f"answer text ({shown})"
        if len(bad) > data_args.answer_mismatch_tolerance * sum(answered):
            raise ValueError(f"{report}. Correct answer_start (the character offset of the answer in the context), or "
                             f"raise --answer_mismatch_tolerance (now {data_args.answer_mismatch_tolerance}) to leave "
                             "such questions out of training")
        logger.warning(report + (": left out of training" if split == "train" else ""))
        if split == "train":
            ids = {qid for qid, _ in bad}
            raw[split] = examples.filter(lambda qid: qid not in ids, input_columns="id")


def check_question_lengths(raw, files: dict[str, str], tokenizer, max_length: int, doc_stride: int) -> None:
    """A ValueError listing the questions too long for a window: one needs the question, 3 special tokens and more
    than --doc_stride tokens of context within --max_seq_length."""
    for split, examples in raw.items():
        lengths = [len(ids) for ids in tokenizer([q.lstrip() for q in examples["question"]],
                                                  add_special_tokens=False)["input_ids"]]
        long = [i for i, n in enumerate(lengths) if n + 3 + doc_stride >= max_length]
        if long:
            longest = max(long, key=lengths.__getitem__)
            ids = ", ".join(examples[i]["id"] for i in long[:5]) + (", ..." if len(long) > 5 else "")
            raise ValueError(
                f"{files.get(split, f'the {split} split')}: {len(long)} question(s) too long for --max_seq_length {max_length} with --doc_stride "
                f"{doc_stride} (ids {ids}): a window holds the question, 3 special tokens and more than doc_stride "
                f"context tokens, and question {examples[longest]['id']} has {lengths[longest]} tokens. Raise "
                f"--max_seq_length above {lengths[longest] + 3 + doc_stride}, lower --doc_stride, or shorten those "
                "questions")


def main(argv: list[str] | None = None) -> Trainer:
    """Run the recipe with `argv` (default: the command line) and return its Trainer."""
    model_args, data_args, training_args = common.parse_args(DataArguments, argv)
    preemption = checkpoints.preemption(training_args, __file__, argv)  # before the data: see its docstring
    common.setup_logging(training_args)
    set_seed(training_args.seed)

    raw = common.load_data(data_args, model_args.cache_dir, read_squad)
    common.require_splits(raw, training_args)
    if data_args.dataset_name is None:
        check_answers(raw, common.data_files(data_args), data_args)
    tokenizer = common.load_tokenizer(model_args)
    max_length = common.sequence_length(data_args, tokenizer)
    if data_args.doc_stride >= max_length:
        raise ValueError(f"--doc_stride ({data_args.doc_stride}) must be smaller than --max_seq_length ({max_length})")
    check_question_lengths(raw, common.data_files(data_args), tokenizer, max_length, data_args.doc_stride)
    model = common.load_for_fine_tuning(BertImplForQuestionAnswering, model_args)

    def windows(batch):
        """Tokenize (question, context) pairs into overlapping windows over the context. Each window gets the answer's
        token span (or [CLS] = 0), its question's id, and offsets into the context (None off the context)."""
        encoded = tokenize_windows(tokenizer, batch["question"], batch["context"], max_length, data_args.doc_stride,
                                   padding="max_length" if data_args.pad_to_max_length else False)
        example_of = encoded.pop("overflow_to_sample_mapping")
        encoded.update(start_positions=[], end_positions=[], example_id=[])
        for i, offsets in enumerate(encoded["offset_mapping"]):
            sequence_ids = encoded.sequence_ids(i)
            answers = batch["answers"][example_of[i]]
            if answers["answer_start"]:
                start_char = answers["answer_start"][0]
                start, end = answer_token_span(offsets, sequence_ids, start_char, start_char + len(answers["text"][0]))
            else:
                start = end = 0
            encoded["start_positions"].append(start)
            encoded["end_positions"].append(end)
            encoded["example_id"].append(batch["id"][example_of[i]])
        return encoded

    def prepare(split, n):
        examples = common.take(raw[split], n)
        features = common.preprocess(examples, windows, training_args, data_args, f"Windowing {split}",
                                     remove_columns=examples.column_names)
        return examples, features

    def decode(examples, features, start_logits, end_logits):
        return postprocess_qa_predictions(
            examples.select_columns(["id", "context"]).to_list(),
            features.select_columns(["example_id", "offset_mapping"]).to_list(),
            start_logits, end_logits,
            version_2_with_negative=data_args.version_2_with_negative, n_best_size=data_args.n_best_size,
            max_answer_length=data_args.max_answer_length,
            null_score_diff_threshold=data_args.null_score_diff_threshold,
        )

    def score(examples, predictions, null_odds):
        references = dict(zip(examples["id"], (a["text"] for a in examples["answers"])))
        v2 = data_args.version_2_with_negative
        return squad_metrics(predictions, references, v2, null_odds if v2 else None)

    def save_predictions(prefix, predictions, null_odds):
        if not trainer.is_world_process_zero():
            return
        outputs = {"predictions.json": predictions}
        if data_args.version_2_with_negative:
            outputs["null_odds.json"] = null_odds
        for name, content in outputs.items():
            with open(os.path.join(training_args.output_dir, prefix + name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2, ensure_ascii=False)

    model_inputs = lambda features: features.remove_columns(["example_id", "offset_mapping"])
    train_dataset = model_inputs(prepare("train", data_args.max_train_samples)[1]) if training_args.do_train else None
    if training_args.do_eval:
        eval_examples, eval_features = prepare("validation", data_args.max_eval_samples)
    last_eval = {}  # the latest evaluation's predictions, written to predictions.json at the end

    def compute_metrics(p):
        """Evaluation windows carry their answer positions as labels (so the Trainer reports a loss and calls this);
        the metric is computed on the answers decoded from all windows."""
        last_eval["predictions"], last_eval["null_odds"] = decode(eval_examples, eval_features, *p.predictions)
        return score(eval_examples, last_eval["predictions"], last_eval["null_odds"])

    trainer = checkpoints.RecipeTrainer(
        model=model,
        args=training_args,
        callbacks=preemption,
        train_dataset=train_dataset,
        eval_dataset=model_inputs(eval_features) if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics if training_args.do_eval else None,
    )

    metrics = {}
    if training_args.do_train:
        metrics.update(common.train_and_save(trainer, training_args, len(train_dataset)))
    if training_args.do_eval:
        eval_metrics = common.evaluate_and_record(trainer, len(eval_examples))
        save_predictions("", last_eval["predictions"], last_eval["null_odds"])
        metrics.update(eval_metrics)
    if training_args.do_predict:
        test_examples, test_features = prepare("test", data_args.max_predict_samples)
        inputs = model_inputs(test_features).remove_columns(["start_positions", "end_positions"])
        output = trainer.predict(inputs, metric_key_prefix="predict")
        predictions, null_odds = decode(test_examples, test_features, *output.predictions)
        save_predictions("predict_", predictions, null_odds)
        if any(a["text"] for a in test_examples["answers"]):  # answers given: score them
            predict_metrics = {f"predict_{k}": v for k, v in score(test_examples, predictions, null_odds).items()}
            common.record(trainer, "predict", predict_metrics)
    common.finish(trainer, model_args, data_args, metrics, __file__, argv)
    return trainer


if __name__ == "__main__":
    main()
    common.leave_process_group()
