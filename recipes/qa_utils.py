"""SQuAD for `run_qa.py` and `answer.py`, in pure Python (no model or array library; the tokenizer is passed in), so
every step is unit-testable.

- `flatten_squad`: the official nested SQuAD JSON -> one record per question, in the `datasets` layout.
- `answer_mismatches`: the answers whose answer_start does not point at their text in the context.
- `tokenize_windows`: (question, context) pairs -> overlapping windows over the context, with offsets into it.
- `answer_token_span`: the token span of an answer inside one window of a tokenized context (training labels).
- `nbest_qa_predictions`: start/end logits of every window -> the best answer spans of each question, with scores and
  character offsets, and its null ([CLS]) score.
- `choose_answer`: a question's answer from those (the SQuAD v2 no-answer decision).
- `postprocess_qa_predictions`: both, for every question -> one answer text per question.
- `squad_metrics`: exact match and F1 as the official SQuAD v1.1 / v2.0 evaluation scripts compute them.
"""

import collections
import heapq
import math
import re
import string


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------
def flatten_squad(squad: dict) -> list[dict]:
    """The official nested layout `{"data": [{"title", "paragraphs": [{"context", "qas": [{"id", "question",
    "answers": [{"text", "answer_start"}], "is_impossible"}]}]}]}` -> records `{"id", "title", "context", "question",
    "answers": {"text": [...], "answer_start": [...]}}`. Impossible (v2) questions get empty answer lists; their
    `plausible_answers` are dropped. A paragraph or question without its required fields is a ValueError saying
    where it is (data[i].paragraphs[j])."""
    records = []
    for i, article in enumerate(squad["data"]):
        for j, paragraph in enumerate(article.get("paragraphs", [])):
            qas = paragraph.get("qas", [])
            for key in ("context", "qas"):
                if key not in paragraph:
                    ids = ", ".join(str(qa.get("id")) for qa in qas[:3]) or "none"
                    raise ValueError(f"data[{i}].paragraphs[{j}] has no {key!r} (its question ids: {ids})")
            for k, qa in enumerate(qas):
                missing = [key for key in ("id", "question") if key not in qa]
                if missing:
                    raise ValueError(f"data[{i}].paragraphs[{j}].qas[{k}] (id {qa.get('id')}) has no "
                                     f"{' and no '.join(map(repr, missing))}")
                answers = [] if qa.get("is_impossible", False) else qa.get("answers", [])
                records.append({
                    "id": str(qa["id"]),
                    "title": article.get("title", ""),
                    "context": paragraph["context"],
                    "question": qa["question"],
                    "answers": {
                        "text": [a["text"] for a in answers],
                        "answer_start": [int(a["answer_start"]) for a in answers],
                    },
                })
    return records


def answer_mismatches(records) -> list[tuple[str, str]]:
    """(id, what is wrong) of the records (`datasets` layout) with an answer that is not found at its answer_start in
    the context: the start is past the end of the context, or the context there holds other text."""
    bad = []
    for record in records:
        context, answers = record["context"], record["answers"]
        for text, start in zip(answers["text"], answers["answer_start"]):
            if not 0 <= start < len(context):
                bad.append((record["id"], f"answer_start {start} is outside the context ({len(context)} characters)"))
                break
            if context[start:start + len(text)] != text:
                found = context.find(text)
                hint = f"; the text is at {found}" if found >= 0 else "; the text is not in the context"
                bad.append((record["id"], f"answer_start {start} points at {context[start:start + len(text)]!r}, not "
                                          f"{text!r}{hint}"))
                break
    return bad


def tokenize_windows(tokenizer, questions: list[str], contexts: list[str], max_length: int, doc_stride: int,
                     max_query_length: int | None = None, padding=False):
    """Tokenize (question, context) pairs into windows of at most `max_length` tokens: the question, then as much of
    the context as fits; a longer context gets more windows, consecutive ones sharing `doc_stride` tokens.

    Questions lose their leading whitespace and, given `max_query_length`, are cut to their first that many tokens.
    Returns the tokenizer's encoding (one row per window), in which "overflow_to_sample_mapping" gives each window's
    pair and "offset_mapping" holds, per token, (char_start, char_end) into the context, or None for tokens that are
    not context (question, special tokens, padding): the layout `nbest_qa_predictions` reads.
    """
    questions, contexts = [q.lstrip() for q in questions], list(contexts)
    question_offsets = tokenizer(questions, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if max_query_length is not None:
        questions = [q[: o[max_query_length - 1][1]] if len(o) > max_query_length else q
                     for q, o in zip(questions, question_offsets)]
        question_offsets = [o[:max_query_length] for o in question_offsets]
    room = max_length - tokenizer.num_special_tokens_to_add(pair=True) - doc_stride  # context tokens past the stride
    for index, offsets in enumerate(question_offsets):
        if len(offsets) >= room:
            raise ValueError(
                f"question {index} is {len(offsets)} tokens long: with max_seq_length {max_length} and doc_stride "
                f"{doc_stride}, a question may have at most {room - 1} tokens; raise max_seq_length, lower doc_stride "
                f"or cut questions with max_query_length"
            )
    encoded = tokenizer(
        questions, contexts, truncation="only_second", max_length=max_length, stride=doc_stride,
        return_overflowing_tokens=True, return_offsets_mapping=True, padding=padding,
    )
    encoded["offset_mapping"] = [[o if s == 1 else None for o, s in zip(offsets, encoded.sequence_ids(i))]
                                 for i, offsets in enumerate(encoded["offset_mapping"])]
    return encoded


def answer_token_span(offsets, sequence_ids, start_char: int, end_char: int, cls_index: int = 0) -> tuple[int, int]:
    """The (start, end) token indices, both inclusive, of the answer characters [start_char, end_char) of the context
    within one tokenized window, or (cls_index, cls_index) when the answer is not wholly inside the window.

    offsets: (char_start, char_end) per token (None is fine off the context); sequence_ids: 1 on context tokens
    (0 question, None special/padding).
    """
    context = [i for i, s in enumerate(sequence_ids) if s == 1]
    if not context:
        return cls_index, cls_index
    first, last = context[0], context[-1]
    if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
        return cls_index, cls_index
    start = first
    while start <= last and offsets[start][0] <= start_char:
        start += 1
    end = last
    while end >= first and offsets[end][1] >= end_char:
        end -= 1
    return start - 1, end + 1


# ---------------------------------------------------------------------------------------------------------------------
# Post-processing
# ---------------------------------------------------------------------------------------------------------------------
def _as_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _top_indices(values: list, n: int) -> list[int]:
    return heapq.nlargest(n, range(len(values)), key=values.__getitem__)


def nbest_qa_predictions(
    examples,
    features,
    all_start_logits,
    all_end_logits,
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> dict[str, dict]:
    """Turn window-level logits into each question's best answer spans.

    examples: records with "id" and "context". features: one per window, in the order of the logits, with
    "example_id" (the id of its question) and "offset_mapping" (per token, (char_start, char_end) into the context,
    or None for tokens that are not context: question, special tokens, padding). all_start_logits, all_end_logits:
    per window, a sequence of logits (longer than the window is fine: trailing values are ignored).

    A candidate is a span (start, end) of context tokens in one window with end >= start and at most
    `max_answer_length` tokens, among the `n_best_size` best starts and ends of that window; its score is
    start_logit + end_logit. A span of the context found in several (overlapping) windows counts once, with its best
    score.

    Returns, per question id: {"spans": the `n_best_size` best spans, best first, each {"text", "start", "end",
    "score"} with the context's characters [start, end), and "null_score": the lowest [CLS] score (start_logit[0] +
    end_logit[0]) over the question's windows}. Equal scores keep the order in which they were reached (window by
    window, then by start and end logit).
    """
    features_by_example = collections.defaultdict(list)
    for index, feature in enumerate(features):
        features_by_example[feature["example_id"]].append(index)

    results = {}
    for example in examples:
        context = example["context"]
        best = {}  # (char_start, char_end) -> (score, order in which that score was reached)
        null_score, reached = math.inf, 0
        for index in features_by_example[example["id"]]:
            offsets = features[index]["offset_mapping"]
            start_logits = _as_list(all_start_logits[index])[: len(offsets)]
            end_logits = _as_list(all_end_logits[index])[: len(offsets)]
            null_score = min(null_score, start_logits[0] + end_logits[0])
            for start in _top_indices(start_logits, n_best_size):
                for end in _top_indices(end_logits, n_best_size):
                    if offsets[start] is None or offsets[end] is None:
                        continue
                    if end < start or end - start + 1 > max_answer_length:
                        continue
                    score = start_logits[start] + end_logits[end]
                    span = (offsets[start][0], offsets[end][1])
                    if span not in best or score > best[span][0]:
                        best[span] = (score, reached)
                    reached += 1
        ranked = sorted(best.items(), key=lambda item: (-item[1][0], item[1][1]))[:n_best_size]
        results[example["id"]] = {
            "spans": [{"text": context[s:e], "start": s, "end": e, "score": score} for (s, e), (score, _) in ranked],
            "null_score": null_score,
        }
    return results


def choose_answer(prediction: dict, version_2_with_negative: bool = False,
                  null_score_diff_threshold: float = 0.0) -> tuple[dict | None, float | None]:
    """A question's answer from its `nbest_qa_predictions` entry: (the best span, or None for no answer; null odds).

    Null odds are null score - best span score (+inf without any span), for v2 only (None for v1). With
    `version_2_with_negative` the answer is None when they exceed `null_score_diff_threshold`; else it is the best
    span (None only when there is no valid span).
    """
    spans = prediction["spans"]
    best = spans[0] if spans else None
    if not version_2_with_negative:
        return best, None
    odds = prediction["null_score"] - (best["score"] if best else -math.inf)
    return (None if odds > null_score_diff_threshold else best), odds


def postprocess_qa_predictions(
    examples,
    features,
    all_start_logits,
    all_end_logits,
    version_2_with_negative: bool = False,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    null_score_diff_threshold: float = 0.0,
) -> tuple[dict[str, str], dict[str, float]]:
    """Turn window-level logits into one answer per question: the text of `nbest_qa_predictions`' best span (same
    arguments), or "" when `choose_answer` decides for no answer (SQuAD v2: the null score, the lowest [CLS] score
    over the question's windows, beats the best span's by more than `null_score_diff_threshold`).

    Returns (predictions: id -> text, null_odds: id -> null score - best span score, for v2 only: empty for v1).
    A question without any valid span gets "" and, for v2, odds of +inf.
    """
    nbest = nbest_qa_predictions(examples, features, all_start_logits, all_end_logits, n_best_size, max_answer_length)
    predictions, null_odds = {}, {}
    for qid, prediction in nbest.items():
        answer, odds = choose_answer(prediction, version_2_with_negative, null_score_diff_threshold)
        predictions[qid] = answer["text"] if answer else ""
        if version_2_with_negative:
            null_odds[qid] = odds
    return predictions, null_odds


# ---------------------------------------------------------------------------------------------------------------------
# The official SQuAD metric
# ---------------------------------------------------------------------------------------------------------------------
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, remove punctuation, remove the articles a/an/the, collapse whitespace (the official scripts)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> int:
    return int(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str, version_2_with_negative: bool = True) -> float:
    """Token-level F1 of the normalized answers. v2.0 (no-answer) rule: when either is empty, 1 if both are, else 0;
    v1.1 gives 0 whenever they share no token."""
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if version_2_with_negative and (not pred_tokens or not gold_tokens):
        return float(pred_tokens == gold_tokens)
    common = sum((collections.Counter(pred_tokens) & collections.Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_metrics(
    predictions: dict[str, str],
    references: dict[str, list[str]],
    version_2_with_negative: bool = False,
    null_odds: dict[str, float] | None = None,
) -> dict:
    """Exact match and F1 in percent, each the best over a question's gold answers, averaged over `references`
    (id -> gold answer texts). A question missing from `predictions` counts as answered "".

    SQuAD v1.1 (the official v1.1 script): {"exact_match", "f1"}.
    SQuAD v2.0 (the official v2.0 script): gold answers that normalize to "" are dropped and a question without gold
    answers is a no-answer question, whose only gold is ""; {"exact", "f1", "total", "HasAns_exact", "HasAns_f1",
    "HasAns_total", "NoAns_exact", "NoAns_f1", "NoAns_total"} (a group only when it has questions), plus, given
    `null_odds`, "best_exact"/"best_f1" and their "_thresh": the scores at the best threshold on null_odds.
    """
    exact_scores, f1_scores, has_answer = {}, {}, {}
    for qid, golds in references.items():
        prediction = predictions.get(qid, "")
        if version_2_with_negative:
            golds = [g for g in golds if normalize_answer(g)] or [""]
        has_answer[qid] = golds != [""]
        exact_scores[qid] = max(exact_match(prediction, g) for g in golds)
        f1_scores[qid] = max(f1(prediction, g, version_2_with_negative) for g in golds)

    def mean(scores, ids):
        return 100.0 * sum(scores[i] for i in ids) / len(ids)

    ids = list(references)
    if not version_2_with_negative:
        return {"exact_match": mean(exact_scores, ids), "f1": mean(f1_scores, ids)}
    result = {"exact": mean(exact_scores, ids), "f1": mean(f1_scores, ids), "total": len(ids)}
    groups = {"HasAns": [i for i in ids if has_answer[i]], "NoAns": [i for i in ids if not has_answer[i]]}
    for group, members in groups.items():
        if members:
            result.update({
                f"{group}_exact": mean(exact_scores, members),
                f"{group}_f1": mean(f1_scores, members),
                f"{group}_total": len(members),
            })
    if null_odds is not None:
        for name, scores in (("exact", exact_scores), ("f1", f1_scores)):
            best, threshold = _best_threshold(predictions, scores, null_odds, has_answer)
            result[f"best_{name}"], result[f"best_{name}_thresh"] = best, threshold
    return result


def _best_threshold(predictions, scores, null_odds, has_answer) -> tuple[float, float]:
    """The official v2.0 `find_best_thresh`: the score when every question whose null odds exceed a threshold is
    answered "" and every other keeps its prediction, at the best such threshold."""
    score = best = sum(1 for qid in scores if not has_answer[qid])
    threshold = 0.0
    for qid in sorted((q for q in scores if q in null_odds), key=null_odds.__getitem__):
        if has_answer[qid]:
            score += scores[qid]
        else:
            score += -1 if predictions.get(qid, "") else 0
        if score > best:
            best, threshold = score, null_odds[qid]
    return 100.0 * best / len(scores), threshold
