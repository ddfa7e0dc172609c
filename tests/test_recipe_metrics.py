"""The recipes' metrics and SQuAD post-processing (recipes/metrics.py, recipes/qa_utils.py) on hand-made cases whose
answers are worked out by hand in the comments."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))

import metrics  # noqa: E402
import qa_utils  # noqa: E402
from qa_utils import answer_token_span, normalize_answer, postprocess_qa_predictions, squad_metrics  # noqa: E402
from recipe_data import EXAMPLES, FEATURES, SEQUENCE_IDS, WINDOW_1, WINDOW_2, logits  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------------
# Classification and regression
# ---------------------------------------------------------------------------------------------------------------------
# TP at 0, 1, 6; FN at 2; FP at 5; TN at 3, 4, 7.
REFERENCES = [1, 1, 1, 0, 0, 0, 1, 0]
PREDICTIONS = [1, 1, 0, 0, 0, 1, 1, 0]


def test_accuracy_f1_and_matthews_by_hand():
    assert metrics.accuracy(PREDICTIONS, REFERENCES) == {"accuracy": 6 / 8}
    # F1 = 2TP / (2TP + FP + FN) = 6 / 8
    assert metrics.accuracy_and_f1(PREDICTIONS, REFERENCES) == {"accuracy": 0.75, "f1": 0.75}
    # MCC = (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (9 - 1) / sqrt(4*4*4*4) = 0.5
    assert metrics.matthews_correlation(PREDICTIONS, REFERENCES)["matthews_correlation"] == pytest.approx(0.5)
    assert metrics.matthews_correlation([1, 0, 1, 0], [1, 0, 1, 0])["matthews_correlation"] == pytest.approx(1.0)
    assert metrics.matthews_correlation([0, 1, 0, 1], [1, 0, 1, 0])["matthews_correlation"] == pytest.approx(-1.0)


def test_pearson_and_spearman_by_hand():
    # x - mean = (-1, 0, 1), y - mean = (-1, 1, 0): r = 1 / sqrt(2 * 2) = 0.5; ranks equal the values, so rho = 0.5.
    assert metrics.pearson_and_spearman([1, 2, 3], [1, 3, 2]) == pytest.approx({"pearson": 0.5, "spearmanr": 0.5})
    # Ranks of y: (1, 3, 2, 4); d = (0, 1, 1, 0): rho = 1 - 6 * 2 / (4 * (16 - 1)) = 0.8.
    assert metrics.pearson_and_spearman([1, 2, 3, 4], [1, 3, 2, 100])["spearmanr"] == pytest.approx(0.8)


def test_glue_metrics_per_task():
    assert set(metrics.glue_metrics("cola", PREDICTIONS, REFERENCES)) == {"matthews_correlation"}
    assert set(metrics.glue_metrics("mrpc", PREDICTIONS, REFERENCES)) == {"accuracy", "f1"}
    assert set(metrics.glue_metrics("qqp", PREDICTIONS, REFERENCES)) == {"accuracy", "f1"}
    assert set(metrics.glue_metrics("stsb", [0.1, 2.0, 3.5], [0.0, 2.5, 3.0])) == {"pearson", "spearmanr"}
    for task in ("sst2", "mnli", "qnli", "rte", "wnli"):
        assert set(metrics.glue_metrics(task, PREDICTIONS, REFERENCES)) == {"accuracy"}
    with pytest.raises(ValueError, match="unknown GLUE task"):
        metrics.glue_metrics("squad", PREDICTIONS, REFERENCES)


# ---------------------------------------------------------------------------------------------------------------------
# NER: seqeval, entity level
# ---------------------------------------------------------------------------------------------------------------------
def test_seqeval_counts_whole_entities():
    references = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "I-ORG", "O"], ["B-PER", "I-PER"]]
    predictions = [
        ["B-PER", "I-PER", "O", "B-ORG"],  # PER right; LOC predicted as ORG: one wrong prediction, one miss
        ["B-ORG", "O", "O"],  # ORG cut short: the span differs, so wrong and missed, though 2 of 3 tags match
        ["I-PER", "I-PER"],  # conlleval reading: I- after O opens an entity, so this is the PER span, right
    ]
    # gold entities: PER, LOC, ORG, PER = 4; predicted: PER, ORG, ORG(short), PER = 4; right: PER, PER = 2
    # token accuracy: 9 tags, wrong at sentence 1 position 3, sentence 2 position 1, sentence 3 position 0 = 6/9
    result = metrics.seqeval_metrics(predictions, references)
    assert result == pytest.approx({"precision": 2 / 4, "recall": 2 / 4, "f1": 2 / 4, "accuracy": 6 / 9})


def test_seqeval_precision_and_recall_differ():
    references = [["B-PER", "O", "B-LOC", "O"]]
    predictions = [["B-PER", "O", "O", "O"]]  # one predicted entity, right; one of two gold entities found
    result = metrics.seqeval_metrics(predictions, references)
    assert result == pytest.approx({"precision": 1.0, "recall": 0.5, "f1": 2 / 3, "accuracy": 3 / 4})


# ---------------------------------------------------------------------------------------------------------------------
# The SQuAD metric
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, normalized", [
    ("The Eiffel Tower", "eiffel tower"),
    ("  an   apple, a pear!", "apple pear"),
    ("theater thematic", "theater thematic"),  # articles only as whole words
    ("U.S.-based", "usbased"),  # punctuation removed, not turned into spaces
    ("A", ""),
])
def test_normalize_answer_as_the_official_script(text, normalized):
    assert normalize_answer(text) == normalized


def test_exact_and_f1_by_hand():
    assert qa_utils.exact_match("the Cat.", "cat") == 1
    # "cat sat" vs "cat sat on mat": 2 shared tokens, P = 2/2, R = 2/4, F1 = 2 * 1 * 0.5 / 1.5 = 2/3
    assert qa_utils.f1("cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # shared tokens count with multiplicity: "x b b" vs "b b b": common = 2, P = 2/3, R = 2/3
    assert qa_utils.f1("x b b", "b b b") == pytest.approx(2 / 3)
    assert qa_utils.f1("", "") == 1.0  # v2: both no-answer
    assert qa_utils.f1("", "cat") == 0.0 and qa_utils.f1("cat", "") == 0.0
    assert qa_utils.f1("the", "a", version_2_with_negative=False) == 0.0  # v1.1: no shared token, 0


def test_squad_v1_takes_the_best_gold_answer_and_reports_percent():
    references = {"q1": ["Denver Broncos", "The Broncos"], "q2": ["Santa Clara, California"], "q3": ["1990"]}
    predictions = {"q1": "broncos", "q2": "Santa Clara", "q3": "in 1990"}
    # q1: exact vs "The Broncos" -> 1. q2: F1 = 2 * 1 * (2/3) / (5/3) = 0.8. q3: F1 = 2 * 0.5 * 1 / 1.5 = 2/3.
    result = squad_metrics(predictions, references)
    assert result == pytest.approx({"exact_match": 100 / 3, "f1": 100 * (1 + 0.8 + 2 / 3) / 3})


def test_squad_v2_groups_no_answer_questions():
    references = {"has1": ["Paris"], "has2": ["Rome"], "no1": [], "no2": [""]}
    predictions = {"has1": "Paris", "has2": "", "no1": "", "no2": "Oslo"}
    result = squad_metrics(predictions, references, version_2_with_negative=True)
    assert result == pytest.approx({
        "exact": 50.0, "f1": 50.0, "total": 4,
        "HasAns_exact": 50.0, "HasAns_f1": 50.0, "HasAns_total": 2,
        "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2,
    })


def test_squad_v2_best_threshold_as_the_official_script():
    references = {"a": ["Paris"], "b": ["Rome"], "c": []}
    predictions = {"a": "Paris", "b": "Milan", "c": "Oslo"}
    null_odds = {"a": -3.0, "b": 1.0, "c": 2.0}
    # Start from "answer nothing": 1 point (c). In order of null odds: a (+1, right) -> 2, best so far, threshold
    # -3.0; b (+0, wrong) -> 2; c (-1, answered a no-answer question) -> 1. Best 2 of 3 at -3.0.
    result = squad_metrics(predictions, references, version_2_with_negative=True, null_odds=null_odds)
    assert result["best_exact"] == pytest.approx(200 / 3) and result["best_exact_thresh"] == -3.0
    assert result["exact"] == pytest.approx(100 / 3)


def test_flatten_squad_keeps_every_question_and_empties_impossible_ones():
    squad = {"data": [{"title": "T", "paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "1", "question": "Where is Paris?", "answers": [{"text": "France", "answer_start": 12}]},
        {"id": "2", "question": "Where is Rome?", "answers": [], "is_impossible": True,
         "plausible_answers": [{"text": "France", "answer_start": 12}]},
    ]}]}]}
    records = qa_utils.flatten_squad(squad)
    assert records == [
        {"id": "1", "title": "T", "context": "Paris is in France.", "question": "Where is Paris?",
         "answers": {"text": ["France"], "answer_start": [12]}},
        {"id": "2", "title": "T", "context": "Paris is in France.", "question": "Where is Rome?",
         "answers": {"text": [], "answer_start": []}},
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Windows: labels and post-processing
# ---------------------------------------------------------------------------------------------------------------------


def test_answer_token_span_inside_one_window_else_cls():
    dd_ee = (9, 14)  # "dd ee"
    assert answer_token_span(WINDOW_1, SEQUENCE_IDS, *dd_ee) == (0, 0)  # not in the first window
    assert answer_token_span(WINDOW_2, SEQUENCE_IDS, *dd_ee) == (4, 5)
    assert answer_token_span(WINDOW_1, SEQUENCE_IDS, 6, 8) == (5, 5)  # "cc" is in both
    assert answer_token_span(WINDOW_2, SEQUENCE_IDS, 6, 8) == (3, 3)
    assert answer_token_span(WINDOW_1, SEQUENCE_IDS, 3, 11) == (0, 0)  # "bb cc dd" straddles the windows
    assert answer_token_span(WINDOW_2, SEQUENCE_IDS, 3, 11) == (0, 0)


def test_postprocess_takes_the_best_span_across_windows():
    # Window 1 favours "bb" (4 + 4 = 8); window 2 favours "dd ee" (5 + 6 = 11): the answer comes from window 2.
    starts = [logits(7, t4=4.0), logits(7, t4=5.0)]
    ends = [logits(7, t4=4.0), logits(7, t5=6.0)]
    predictions, null_odds = postprocess_qa_predictions(EXAMPLES, FEATURES, starts, ends)
    assert predictions == {"q": "dd ee"} and null_odds == {}


def test_postprocess_skips_invalid_spans():
    # Window 1 scores: (1, 1) = 18 on the question token, (5, 4) = 11 ends before it starts: both skipped.
    # (3, 4) "aa bb" = 10.5 is two tokens; of one-token spans (4, 4) "bb" = 8 beats (5, 5) "cc" = 5.
    starts = [logits(7, t1=9.0, t5=3.0, t3=2.5), logits(7)]
    ends = [logits(7, t1=9.0, t5=2.0, t4=8.0), logits(7)]
    predictions, _ = postprocess_qa_predictions(EXAMPLES, FEATURES, starts, ends, max_answer_length=1)
    assert predictions == {"q": "bb"}
    predictions, _ = postprocess_qa_predictions(EXAMPLES, FEATURES, starts, ends, max_answer_length=30)
    assert predictions == {"q": "aa bb"}


def test_postprocess_ignores_trailing_padding_logits():
    # Trainer pads logits across batches; positions past the window's offsets must not be read.
    starts = [logits(10, t9=50.0, t3=1.0), logits(10)]
    ends = [logits(10, t9=50.0, t3=1.0), logits(10)]
    assert postprocess_qa_predictions(EXAMPLES, FEATURES, starts, ends)[0] == {"q": "aa"}


def test_postprocess_no_answer_uses_the_lowest_null_score():
    # Null (CLS) scores: 6 + 6 = 12 in window 1, 2 + 2 = 4 in window 2 -> null score 4. Best span "dd" = 3 + 3 = 6.
    starts = [logits(7, t0=6.0), logits(7, t0=2.0, t4=3.0)]
    ends = [logits(7, t0=6.0), logits(7, t0=2.0, t4=3.0)]
    predictions, null_odds = postprocess_qa_predictions(EXAMPLES, FEATURES, starts, ends, version_2_with_negative=True)
    assert predictions == {"q": "dd"} and null_odds == {"q": pytest.approx(4.0 - 6.0)}
    # A null score above the span's wins, unless the threshold asks for more.
    starts[1][0] = ends[1][0] = 5.0  # null 10 vs span 6: odds +4
    for threshold, expected in ((0.0, ""), (3.9, ""), (4.1, "dd")):
        predictions, null_odds = postprocess_qa_predictions(
            EXAMPLES, FEATURES, starts, ends, version_2_with_negative=True, null_score_diff_threshold=threshold
        )
        assert predictions == {"q": expected} and null_odds["q"] == pytest.approx(4.0)


def test_postprocess_without_any_valid_span():
    starts, ends = [logits(7, t5=1.0), logits(7)], [logits(7, t3=1.0), logits(7)]
    predictions, null_odds = postprocess_qa_predictions(
        EXAMPLES, FEATURES, starts, ends, version_2_with_negative=True, n_best_size=1
    )
    assert predictions == {"q": ""} and null_odds["q"] == math.inf


def test_real_tokenizer_windows_round_trip(minilm_dir):
    """Real windows from the tokenizer: the answer lies in the second window only; logits pointing at the labelled
    tokens decode back to the answer text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    context = " ".join(f"Sentence number {i} says nothing at all." for i in range(8)) + " The key is hidden in Oslo."
    question, answer = "Where is the key?", "Oslo"
    start_char = context.index(answer)
    encoded = tokenizer(question, context, truncation="only_second", max_length=40, stride=10,
                        return_overflowing_tokens=True, return_offsets_mapping=True)
    assert len(encoded["input_ids"]) >= 2
    features, starts, ends, labels = [], [], [], []
    for i, offsets in enumerate(encoded["offset_mapping"]):
        sequence_ids = encoded.sequence_ids(i)
        start, end = answer_token_span(offsets, sequence_ids, start_char, start_char + len(answer))
        labels.append((start, end))
        context_offsets = [o if s == 1 else None for o, s in zip(offsets, sequence_ids)]
        features.append({"example_id": "q", "offset_mapping": context_offsets})
        starts.append(logits(len(offsets), **{f"t{start}": 10.0}))
        ends.append(logits(len(offsets), **{f"t{end}": 10.0}))
    assert labels[0] == (0, 0) and labels[-1] != (0, 0)  # not in the first window, found in the last
    predictions, _ = postprocess_qa_predictions([{"id": "q", "context": context}], features, starts, ends)
    assert predictions == {"q": answer}
