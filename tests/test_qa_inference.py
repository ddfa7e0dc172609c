"""Question answering at inference time (recipes/answer.py): a MiniLM QA head trained a few steps by run_qa.py on a
small SQuAD v2 file whose contexts each need several windows; `answer_questions` and the `answer.py` command must give
run_qa.py's own predictions (its predictions.json and null_odds.json) on the same model and data, v2 and v1."""

import json
import random
import sys
from pathlib import Path

import pytest
import transformers

import modeling_bert_impl  # noqa: F401  (registers bert_impl with the Auto classes)

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
sys.path.insert(0, str(RECIPES))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import answer  # noqa: E402
import run_qa  # noqa: E402
from qa_utils import choose_answer, nbest_qa_predictions, tokenize_windows  # noqa: E402
from recipe_data import CITIES, EXAMPLES, FEATURES, FILLER, PEOPLE, RECIPE_FLAGS, logits  # noqa: E402

WINDOWS = ["--max_seq_length", "48", "--doc_stride", "16"]


def assert_same_answers(got, expected, where="answers"):
    """got == expected for nested answers (lists, dicts, strings, None), numbers within 1e-6 relative. Field by field,
    naming the first difference: `pytest.approx` takes no nested structures from pytest 9.2 on."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), f"{where}: keys {got!r} != {expected!r}"
        for key in expected:
            assert_same_answers(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), f"{where}: {got!r} != {expected!r}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same_answers(g, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-6), f"{where}: {got!r} != {expected!r}"
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def test_nbest_counts_a_span_of_two_windows_once_by_hand():
    # "aa bb cc dd ee ff" in windows [aa bb cc] and [cc dd ee] (tokens 3-5 of each), 3 best starts and ends per window.
    # Window 1: starts 5, 4 (then 0), ends 5 (then 0, 1): "cc" = 2 + 2 = 4, "bb cc" = 1 + 2 = 3.
    # Window 2: starts 3 (then 0, 1), ends 3, 0, 4: "cc" = 3 + 3 = 6, "cc dd" = 3 + 1 = 4.
    starts = [logits(7, t5=2.0, t4=1.0), logits(7, t3=3.0, t0=1.0)]
    ends = [logits(7, t5=2.0), logits(7, t3=3.0, t4=1.0, t0=1.0)]
    prediction = nbest_qa_predictions(EXAMPLES, FEATURES, starts, ends, n_best_size=3)["q"]
    # "cc", in both windows, is listed once with its best score.
    assert [(s["text"], s["start"], s["end"], s["score"]) for s in prediction["spans"]] == [
        ("cc", 6, 8, 6.0), ("cc dd", 6, 11, 4.0), ("bb cc", 3, 8, 3.0)]
    assert prediction["null_score"] == 0.0  # window 1's [CLS] 0 + 0, window 2's 1 + 1: the lowest
    assert choose_answer(prediction) == (prediction["spans"][0], None)
    assert choose_answer(prediction, True) == (prediction["spans"][0], -6.0)
    assert choose_answer(prediction, True, null_score_diff_threshold=-7.0) == (None, -6.0)
    assert choose_answer({"spans": [], "null_score": 1.0}, True) == (None, float("inf"))


def article(rng, index, answerable):
    """A paragraph about where one person lives, among filler sentences (several windows of 48 tokens); the question
    asks where they live (answerable) or where they work, which the paragraph never says (v2: no answer)."""
    person, city = rng.choice(PEOPLE), rng.choice(CITIES)
    fact = f"{person} lives in {city}."
    sentences = rng.sample(FILLER, 6) + [fact]
    rng.shuffle(sentences)
    context = " ".join(sentences)
    answers = [{"text": city, "answer_start": context.index(fact) + len(f"{person} lives in ")}] if answerable else []
    qa = {"id": str(index), "question": f"Where does {person} {'live' if answerable else 'work'}?", "answers": answers,
          "is_impossible": not answerable}
    return {"title": str(index), "paragraphs": [{"context": context, "qas": [qa]}]}


@pytest.fixture(scope="module")
def trained(minilm_dir, tmp_path_factory):
    """run_qa.py trains on 36 questions (half without answer) and evaluates 12 (half without), SQuAD v2."""
    tmp = tmp_path_factory.mktemp("qa")
    rng = random.Random(0)
    for name, first, count in (("train", 0, 36), ("dev", 100, 12)):
        data = [article(rng, first + i, answerable=i % 2 == 0) for i in range(count)]
        (tmp / f"{name}.json").write_text(json.dumps({"version": "v2.0", "data": data}))
    out = tmp / "model"
    run_qa.main(["--model_name_or_path", minilm_dir, "--output_dir", str(out), "--train_file", str(tmp / "train.json"),
                 "--validation_file", str(tmp / "dev.json"), "--version_2_with_negative", "--do_train", "--do_eval",
                 *WINDOWS, "--learning_rate", "5e-4", "--per_device_train_batch_size", "16",
                 "--num_train_epochs", "10", *RECIPE_FLAGS])
    dev = run_qa.read_squad(str(tmp / "dev.json")).to_dict()  # column -> list
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    return tmp, out, dev, model, tokenizer


def read_json(path):
    return json.loads(Path(path).read_text())


@pytest.mark.slow  # run_qa.py trains the model
def test_answers_equal_run_qa_predictions_v2(trained):
    tmp, out, dev, model, tokenizer = trained
    # Every context needs several windows.
    windows = tokenize_windows(tokenizer, dev["question"], dev["context"], 48, 16)
    assert sorted(set(windows["overflow_to_sample_mapping"])) == list(range(len(dev["id"])))
    assert all(windows["overflow_to_sample_mapping"].count(i) >= 2 for i in range(len(dev["id"])))

    expected, expected_odds = read_json(out / "predictions.json"), read_json(out / "null_odds.json")
    got = answer.answer_questions(model, tokenizer, dev["question"], dev["context"], version_2_with_negative=True,
                                  max_seq_length=48, doc_stride=16, max_query_length=None, batch_size=5)
    assert {qid: a["answer"] for qid, a in zip(dev["id"], got)} == expected
    assert [a["null_odds"] for a in got] == pytest.approx([expected_odds[qid] for qid in dev["id"]], abs=1e-4)
    # The model learnt both kinds: answers where the person is in the paragraph, none where they are absent. (Ten epochs:
    # after three, whether it said "no answer" anywhere depended on dropout's random stream.)
    no_answer = [qid for qid, a in zip(dev["id"], dev["answers"]) if not a["text"]]
    assert sum(expected[qid] == "" for qid in no_answer) >= 2
    assert sum(expected[qid] == a["text"][0] for qid, a in zip(dev["id"], dev["answers"]) if a["text"]) >= 5
    for context, result in zip(dev["context"], got):
        if result["answer"]:  # the offsets locate the answer in its context
            assert context[result["start"]:result["end"]] == result["answer"]
            assert result["n_best"][0]["text"] == result["answer"] and result["score"] == result["n_best"][0]["score"]
        else:
            assert result["start"] is None and result["null_odds"] > 0
        spans = [(s["start"], s["end"]) for s in result["n_best"]]
        assert len(spans) == len(set(spans)) and 1 < len(spans) <= 20
        assert [s["score"] for s in result["n_best"]] == sorted((s["score"] for s in result["n_best"]), reverse=True)
        assert sum(s["probability"] for s in result["n_best"]) == pytest.approx(1.0)


@pytest.mark.slow  # run_qa.py trains the model
def test_answers_equal_run_qa_predictions_v1_and_the_command(trained, capsys):
    """The same model decoded as SQuAD v1.1 (always a span) by run_qa.py's evaluation alone, by the function, and by
    the command with the context in a file."""
    tmp, out, dev, model, tokenizer = trained
    squad = read_json(tmp / "dev.json")  # v1.1 data: the answerable questions
    squad["data"] = [a for a in squad["data"] if not a["paragraphs"][0]["qas"][0]["is_impossible"]]
    (tmp / "dev_v1.json").write_text(json.dumps(squad))
    v1 = tmp / "v1"
    run_qa.main(["--model_name_or_path", str(out), "--output_dir", str(v1), "--validation_file",
                 str(tmp / "dev_v1.json"), "--do_eval", *WINDOWS, *RECIPE_FLAGS])
    expected = read_json(v1 / "predictions.json")
    assert len(expected) == 6
    got = answer.answer_questions(model, tokenizer, dev["question"], dev["context"], max_seq_length=48,
                                  doc_stride=16, max_query_length=None)
    assert {qid: a["answer"] for qid, a in zip(dev["id"], got) if qid in expected} == expected
    assert all(a["answer"] and a["null_odds"] is None for a in got)

    (tmp / "context.txt").write_text(dev["context"][0])
    capsys.readouterr()
    answer.main(["--model_name_or_path", str(out), "--question", dev["question"][0], "--question", dev["question"][1],
                 "--context_file", str(tmp / "context.txt"), "--max_seq_length", "48", "--doc_stride", "16",
                 "--version_2_with_negative"])
    printed = json.loads(capsys.readouterr().out)
    same_context = answer.answer_questions(model, tokenizer, dev["question"][:2], dev["context"][0],
                                           version_2_with_negative=True, max_seq_length=48, doc_stride=16)
    assert [p.pop("question") for p in printed] == dev["question"][:2]
    assert_same_answers(printed, same_context)
    assert printed[0]["answer"] == read_json(out / "predictions.json")[dev["id"][0]]


@pytest.mark.slow  # run_qa.py trains the model
def test_bad_arguments_are_value_errors(trained):
    _, _, dev, model, tokenizer = trained
    ask = lambda **kw: answer.answer_questions(model, tokenizer, **{"questions": "Who?", "contexts": "Anna.", **kw})
    with pytest.raises(ValueError, match="one context, or one per question"):
        ask(questions=["a?", "b?"], contexts=["x", "y", "z"])
    with pytest.raises(ValueError, match=r"contexts\[0\] must be a non-empty string"):
        ask(contexts=" ")
    with pytest.raises(ValueError, match="doc_stride .16. must be smaller than max_seq_length .16."):
        ask(max_seq_length=16, doc_stride=16)
    with pytest.raises(ValueError, match="longer than the model's 512 positions"):
        ask(max_seq_length=513)
    long_question = "where " * 40 + "?"
    with pytest.raises(ValueError, match="question 0 is 41 tokens long.*at most 28 tokens"):
        ask(questions=long_question, max_seq_length=48, doc_stride=16, max_query_length=None)
    # Cut to max_query_length, the same question is answered.
    assert ask(questions=long_question, max_seq_length=48, doc_stride=16, max_query_length=8)[0]["answer"]
