"""Ask a question-answering model questions about contexts of any length: what transformers' removed
`question-answering` pipeline did, with `run_qa.py`'s windowing and post-processing (`qa_utils`), so the answers are
the ones `run_qa.py` would predict.

    python recipes/answer.py --model_name_or_path outputs/squad --question "Who wrote it?" --context_file doc.txt
    python recipes/answer.py --model_name_or_path outputs/squad_v2 --version_2_with_negative \\
        --question "Where does Anna live?" --question "Who is the king?" --context "Anna lives in Oslo."

From Python (`recipes/` on `sys.path`):

    from answer import answer_questions
    answers = answer_questions(model, tokenizer, ["Who wrote it?"], [document])

A context longer than `max_seq_length` is cut into windows sharing `doc_stride` tokens; each question's answer is the
best span over its windows (at most `max_answer_length` tokens, among the `n_best_size` best starts and ends of each
window). For a SQuAD v2 model (`version_2_with_negative`), the answer is none when the null ([CLS]) score beats the
best span's by more than `null_score_diff_threshold`.
"""

import needs_extra  # noqa: F401  (first: says what to install where the recipes extra is missing)
import argparse
import json
import math
import os
import sys

import torch
from transformers import AutoModelForQuestionAnswering

import common
import modeling_bert_impl  # noqa: F401  (registers bert_impl with the Auto classes)
from qa_utils import choose_answer, nbest_qa_predictions, tokenize_windows

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def answer_questions(model, tokenizer, questions: str | list[str], contexts: str | list[str], *,
                     version_2_with_negative: bool = False, null_score_diff_threshold: float = 0.0,
                     max_seq_length: int = 384, doc_stride: int = 128, max_query_length: int | None = 64,
                     n_best_size: int = 20, max_answer_length: int = 30, batch_size: int = 32) -> list[dict]:
    """Answer each question from its context (one context may serve every question).

    model: a question-answering model (`BertImplForQuestionAnswering`, or any whose outputs have `start_logits` and
    `end_logits`), used as it is (call `.eval()` first). tokenizer: its fast tokenizer. The defaults are run_qa.py's
    and the original BERT's (384 tokens per window, stride 128, questions cut to 64 tokens).

    Returns one dict per question:
    - "answer": the answer text, "" for no answer; "start", "end": its characters [start, end) in the context (None
      for no answer); "score": its start_logit + end_logit (None for no answer).
    - "null_odds" (v2 models only, else None): null score - best span score; no answer when above the threshold.
    - "n_best": the best distinct spans, best first (at most `n_best_size`), each {"text", "start", "end", "score",
      "probability"}; probability is the softmax of the scores over these spans.
    """
    questions, contexts = _as_pairs(questions, contexts)
    for name, value, least in (("max_seq_length", max_seq_length, 1), ("doc_stride", doc_stride, 0),
                               ("max_query_length", max_query_length, 1), ("n_best_size", n_best_size, 1),
                               ("max_answer_length", max_answer_length, 1), ("batch_size", batch_size, 1)):
        if value is not None and (not isinstance(value, int) or value < least):
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    longest = model.config.max_position_embeddings
    if max_seq_length > longest:
        raise ValueError(f"max_seq_length {max_seq_length} is longer than the model's {longest} positions")
    if doc_stride >= max_seq_length:
        raise ValueError(f"doc_stride ({doc_stride}) must be smaller than max_seq_length ({max_seq_length})")

    windows = tokenize_windows(tokenizer, questions, contexts, max_seq_length, doc_stride, max_query_length)
    start_logits, end_logits = [], []
    with torch.no_grad():
        for first in range(0, len(windows["input_ids"]), batch_size):
            rows = range(first, min(first + batch_size, len(windows["input_ids"])))
            batch = tokenizer.pad({k: [windows[k][i] for i in rows] for k in MODEL_INPUTS if k in windows},
                                  return_tensors="pt").to(model.device)
            output = model(**batch)  # start_logits, end_logits: (B, T)
            for row, i in enumerate(rows):
                length = len(windows["input_ids"][i])
                start_logits.append(output.start_logits[row, :length].float().tolist())
                end_logits.append(output.end_logits[row, :length].float().tolist())

    examples = [{"id": str(i), "context": context} for i, context in enumerate(contexts)]
    features = [{"example_id": str(pair), "offset_mapping": offsets}
                for pair, offsets in zip(windows["overflow_to_sample_mapping"], windows["offset_mapping"])]
    nbest = nbest_qa_predictions(examples, features, start_logits, end_logits, n_best_size, max_answer_length)

    results = []
    for example in examples:
        prediction = nbest[example["id"]]
        answer, odds = choose_answer(prediction, version_2_with_negative, null_score_diff_threshold)
        spans = prediction["spans"]
        top = max((s["score"] for s in spans), default=0.0)
        weights = [math.exp(s["score"] - top) for s in spans]
        results.append({
            "answer": answer["text"] if answer else "",
            "start": answer["start"] if answer else None,
            "end": answer["end"] if answer else None,
            "score": answer["score"] if answer else None,
            "null_odds": odds,
            "n_best": [{**s, "probability": w / sum(weights)} for s, w in zip(spans, weights)],
        })
    return results


def _as_pairs(questions, contexts) -> tuple[list[str], list[str]]:
    """Questions and contexts as two lists of strings of the same length (one context serves every question)."""
    questions = [questions] if isinstance(questions, str) else list(questions)
    contexts = [contexts] if isinstance(contexts, str) else list(contexts)
    if len(contexts) == 1:
        contexts = contexts * len(questions)
    if not questions or len(contexts) != len(questions):
        raise ValueError(f"questions and contexts: expected one context, or one per question, for at least one "
                         f"question; got {len(questions)} questions and {len(contexts)} contexts")
    for name, texts in (("questions", questions), ("contexts", contexts)):
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{name}[{i}] must be a non-empty string, got {text!r}")
    return questions, contexts


def main(argv: list[str] | None = None) -> list[dict]:
    """The command: answers printed as JSON (one record per question, its question included)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="A question-answering model (folder or Hub id).")
    parser.add_argument("--question", action="append", required=True, help="A question (repeat for more).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--context", help="The text the answers come from.")
    source.add_argument("--context_file", help="A UTF-8 text file holding it.")
    parser.add_argument("--version_2_with_negative", action="store_true",
                        help="The model was trained on SQuAD v2: it may answer nothing.")
    parser.add_argument("--null_score_diff_threshold", type=float, default=0.0,
                        help="Answer nothing when null score - best span score exceeds this (v2).")
    parser.add_argument("--max_seq_length", type=int, default=384, help="Tokens per window (question and context).")
    parser.add_argument("--doc_stride", type=int, default=128, help="Tokens shared by consecutive windows.")
    parser.add_argument("--max_query_length", type=int, default=64, help="Questions are cut to this many tokens.")
    parser.add_argument("--n_best_size", type=int, default=20, help="Spans returned; starts and ends tried per window.")
    parser.add_argument("--max_answer_length", type=int, default=30, help="The longest answer, in tokens.")
    args = parser.parse_args(argv)
    if args.context_file is not None:
        if not os.path.isfile(args.context_file):
            raise ValueError(f"--context_file {args.context_file}: no such file")
        with open(args.context_file, encoding="utf-8") as f:
            args.context = f.read()
    tokenizer = common.load_tokenizer(common.ModelArguments(model_name_or_path=args.model_name_or_path))
    model = AutoModelForQuestionAnswering.from_pretrained(args.model_name_or_path).eval()
    answers = answer_questions(
        model, tokenizer, args.question, args.context, version_2_with_negative=args.version_2_with_negative,
        null_score_diff_threshold=args.null_score_diff_threshold, max_seq_length=args.max_seq_length,
        doc_stride=args.doc_stride, max_query_length=args.max_query_length, n_best_size=args.n_best_size,
        max_answer_length=args.max_answer_length,
    )
    answers = [{"question": q, **a} for q, a in zip(args.question, answers)]
    json.dump(answers, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return answers


if __name__ == "__main__":
    main()
