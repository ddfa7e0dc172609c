"""The recipes on the data files and accidents users really have: every bad file is refused before training with a
ValueError that names the file and the line (or the example id) and says what to change; secrets never reach the
model card, a log line or a saved file; the output directory and resuming behave alike in every recipe.

Files are written here in the recipes' real formats. The refusals come before any model is loaded or trained, so each
case takes a fraction of a second; the few runs that train use a tiny bert-impl model (2 layers, H=128)."""

import csv
import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
sys.path.insert(0, str(RECIPES))

import checkpoints  # noqa: E402
import common  # noqa: E402
import redaction  # noqa: E402
import run_glue  # noqa: E402
import run_ner  # noqa: E402
import run_pretraining  # noqa: E402
import run_qa  # noqa: E402
import run_swag  # noqa: E402
import user_files  # noqa: E402

COMMON = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--seed", "0", "--max_seq_length", "32"]


@pytest.fixture(scope="module")
def tiny_dir(minilm_dir, tmp_path_factory):
    """A tiny, randomly initialised bert-impl model with MiniLM's tokenizer: fast enough to train a few steps."""
    import transformers

    from modeling_bert_impl import BertImplConfig, BertImplForPreTraining

    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    path = tmp_path_factory.mktemp("tiny")
    BertImplForPreTraining(BertImplConfig.from_preset("tiny", vocab_size=len(tokenizer))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def refused(recipe, model, out, *args, match: tuple[str, ...]) -> str:
    """Run `recipe` and return its ValueError's message, which must contain every string of `match`."""
    with pytest.raises(ValueError) as error:
        recipe.main(["--model_name_or_path", model, "--output_dir", str(out), *COMMON, *map(str, args)])
    message = str(error.value)
    for fragment in match:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


SENTENCES = [("a lovely film", "yes"), ("a dreadful film", "no"), ("great fun", "yes"), ("so boring", "no")]


# ---------------------------------------------------------------------------------------------------------------------
# Files that cannot be read: the file and the line
# ---------------------------------------------------------------------------------------------------------------------
def test_unreadable_files_name_the_file_and_the_line(minilm_dir, tmp_path):
    good = write_csv(tmp_path / "good.csv", ["sentence", "label"], SENTENCES)
    cases = {
        "empty.csv": (b"", ["empty.csv: the file is empty"]),
        "extra.csv": (b"sentence,label\na lovely film,yes\na dreadful, film,no\n",
                      ["extra.csv, line 3: 3 fields, but the header line has 2", "quote"]),
        "latin1.csv": ("sentence,label\na lovely film,yes\nun film d\u00e9cevant,no\n".encode("latin-1"),
                       ["latin1.csv, line 3, column 10: byte 0xe9 is not UTF-8"]),
        "cut.jsonl": (b'{"sentence": "a lovely film", "label": "yes"}\n{"sentence": "so bor',
                      ["cut.jsonl, line 2, column", "not a complete JSON object", "cut off"]),
        "header.tsv": (b"sentence\tlabel\n", ["header.tsv: a header line but no rows"]),
    }
    for name, (content, match) in cases.items():
        (tmp_path / name).write_bytes(content)
        refused(run_glue, minilm_dir, tmp_path / "out", "--train_file", tmp_path / name, "--validation_file", good,
                "--do_train", match=tuple(match))
    assert not (tmp_path / "out").exists()  # refused before anything was written


# ---------------------------------------------------------------------------------------------------------------------
# GLUE-style labels
# ---------------------------------------------------------------------------------------------------------------------
def test_glue_label_problems_are_refused_with_their_lines(minilm_dir, tmp_path):
    train = write_csv(tmp_path / "train.csv", ["sentence", "label"], SENTENCES)
    unseen = write_csv(tmp_path / "unseen.csv", ["sentence", "label"], SENTENCES[:2] + [("not sure", "maybe")])
    refused(run_glue, minilm_dir, tmp_path / "out", "--train_file", train, "--validation_file", unseen, "--do_train",
            "--do_eval", match=("unseen.csv, line 4", "train.csv never has (its labels: no, yes)"))
    unlabelled = write_csv(tmp_path / "unlabelled.csv", ["sentence"], [("a lovely film",)])
    refused(run_glue, minilm_dir, tmp_path / "out", "--train_file", train, "--validation_file", unlabelled,
            "--do_train", "--do_eval", match=("unlabelled.csv: no label column 'label'", "--test_file"))
    renamed = write_csv(tmp_path / "renamed.csv", ["sentence", "sentiment"], SENTENCES)  # the training file's fault
    good = write_csv(tmp_path / "good.csv", ["sentence", "label"], SENTENCES)
    message = refused(run_glue, minilm_dir, tmp_path / "out", "--train_file", renamed, "--validation_file", good,
                      "--do_train", "--do_eval", match=("renamed.csv: no label column among 'label', 'gold_label'",
                                                        "(its columns: sentence, sentiment)", "--label_column_name"))
    assert "good.csv" not in message and "None" not in message
    message = refused(run_glue, minilm_dir, tmp_path / "out", "--train_file", good, "--validation_file", good,
                      "--do_train", "--do_eval", "--label_column_name", "labels",
                      match=("good.csv: no label column 'labels' (--label_column_name)",
                             "(its columns: sentence, label)"))
    assert "pass --label_column_name" not in message
    blank = write_csv(tmp_path / "blank.csv", ["sentence", "label"], SENTENCES[:2] + [("great fun", "")])
    refused(run_glue, minilm_dir, tmp_path / "out", "--train_file", blank, "--do_train",
            match=("1 row(s) have an empty 'label'", "blank.csv, line 4"))


def test_glue_labels_written_as_integers_and_as_text_are_one_class(tiny_dir, tmp_path):
    """0/1 in a CSV and "0"/"1" in JSON lines: the same two classes, in numeric order (not a TypeError)."""
    train = write_csv(tmp_path / "train.csv", ["sentence", "label"], [(s, int(y == "yes")) for s, y in SENTENCES])
    dev = tmp_path / "dev.jsonl"
    dev.write_text("\n".join(json.dumps({"sentence": s, "label": str(int(y == "yes"))}) for s, y in SENTENCES))
    trainer = run_glue.main(["--model_name_or_path", tiny_dir, "--output_dir", str(tmp_path / "out"), *COMMON,
                             "--train_file", str(train), "--validation_file", str(dev), "--do_eval"])
    assert trainer.model.config.id2label == {0: "0", 1: "1"}
    assert "eval_accuracy" in json.loads((tmp_path / "out" / "all_results.json").read_text())


def test_glue_task_without_files_offline_says_to_give_files(minilm_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    refused(run_glue, minilm_dir, tmp_path / "out", "--task_name", "mrpc", "--do_train", "--cache_dir",
            tmp_path / "cache", match=("HF_HUB_OFFLINE is set", "'nyu-mll/glue' is not in the cache", "--train_file"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    refused(run_glue, minilm_dir, tmp_path / "out", "--task_name", "mrpc", "--do_train", "--cache_dir",
            tmp_path / "cache", match=("cannot be reached", "--train_file", "HF_HUB_OFFLINE=1"))


def test_a_model_name_that_is_no_folder_offline_says_the_hub_was_unreachable(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "out"
    write_csv(tmp_path / "t.csv", ["sentence", "label"], [["good", 1], ["bad", 0]])
    (tmp_path / "t.txt").write_text("One sentence. Another one.\n\nA second document.\n")
    for recipe, data in ((run_glue, "t.csv"), (run_pretraining, "t.txt")):  # common's and pre-training's loader
        refused(recipe, "bert-base-uncased", out, "--do_train", "--train_file", tmp_path / data,
                "--cache_dir", tmp_path / "cache",
                match=("--model_name_or_path 'bert-base-uncased' is not a local folder", "HF_HUB_OFFLINE",
                       "pass --model_name_or_path a local folder"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    message = refused(run_glue, "bert-base-uncased", out, "--do_train", "--train_file", tmp_path / "t.csv",
                      "--cache_dir", tmp_path / "cache", match=("the Hub (http://127.0.0.1:9) could not be reached",))
    assert "HF_HUB_OFFLINE" not in message
    refused(run_glue, "./no/such/folder", out, "--do_train", "--train_file", tmp_path / "t.csv",
            match=("'./no/such/folder': no such folder",))


# ---------------------------------------------------------------------------------------------------------------------
# NER, SWAG
# ---------------------------------------------------------------------------------------------------------------------
def test_ner_sentence_with_fewer_tags_than_words(minilm_dir, tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"tokens": ["Anna", "lives", "here"], "ner_tags": ["B-PER", "O", "O"]}) + "\n"
                    + json.dumps({"tokens": ["Peter", "left", "Oslo"], "ner_tags": ["B-PER", "O"]}) + "\n")
    refused(run_ner, minilm_dir, tmp_path / "out", "--train_file", path, "--do_train",
            match=("train.json, line 2", "one 'ner_tags' tag per 'tokens' word"))


def test_conll_files_that_cannot_be_read_name_the_file_and_the_line(minilm_dir, tmp_path):
    cases = {
        "latin1.conll": ("-DOCSTART- -X- -X- O\n\nJos\u00e9 NNP B-NP B-PER\nleft VBD B-VP O\n".encode("latin-1"),
                         ["latin1.conll, line 3, column 4: byte 0xe9 is not UTF-8", "save the file as UTF-8"]),
        "empty.txt": (b"\n\n", ["empty.txt: the file is empty"]),
        "docstart.conll": (b"-DOCSTART- -X- -X- O\n\n-DOCSTART- -X- -X- O\n\n",
                           ["docstart.conll: no sentences, only -DOCSTART- and blank lines", "a blank line between"]),
        "untagged.txt": (b"EU NNP B-NP B-ORG\nrejects\n", ["untagged.txt, line 2: expected a token and its tag"]),
    }
    for name, (content, match) in cases.items():
        (tmp_path / name).write_bytes(content)
        refused(run_ner, minilm_dir, tmp_path / "out", "--train_file", tmp_path / name, "--do_train",
                match=tuple(match))
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_swag_label_outside_the_endings(minilm_dir, tmp_path):
    row = {"sent1": "Anna was hungry.", "sent2": "So she", "ending0": "ate.", "ending1": "slept.", "ending2": "ran.",
           "ending3": "sang."}
    rows = [{**row, "label": label} for label in (0, 3, 4, 1)]
    path = tmp_path / "dev.csv"
    write_csv(path, list(rows[0]), [list(r.values()) for r in rows])
    refused(run_swag, minilm_dir, tmp_path / "out", "--validation_file", path, "--do_eval",
            match=("dev.csv, line 4", "not the index of an ending, 0 to 3"))


# ---------------------------------------------------------------------------------------------------------------------
# SQuAD
# ---------------------------------------------------------------------------------------------------------------------
def squad_file(path, questions, version="1.1"):
    """Nested SQuAD JSON, one paragraph per question: (id, context, question, answer text, answer_start or None)."""
    paragraphs = [{"context": context, "qas": [{
        "id": qid, "question": question, "is_impossible": start is None,
        "answers": [] if start is None else [{"text": text, "answer_start": start}]}]}
        for qid, context, question, text, start in questions]
    path.write_text(json.dumps({"version": version, "data": [{"title": "t", "paragraphs": paragraphs}]}))
    return path


def place_questions(n):
    out = []
    for i in range(n):
        context = f"Person {i} was born in a small town. Person {i} lives in Paris."
        out.append((f"q{i}", context, f"Where does person {i} live?", "Paris", context.index("Paris")))
    return out


def test_squad_answers_that_do_not_match_their_context(minilm_dir, tmp_path):
    questions = place_questions(10)
    for i in (2, 5, 7):  # off by 7 characters
        qid, context, question, text, start = questions[i]
        questions[i] = (qid, context, question, text, start - 7)
    questions[8] = questions[8][:4] + (500,)  # past the end of the context
    path = squad_file(tmp_path / "train.json", questions)
    refused(run_qa, minilm_dir, tmp_path / "out", "--train_file", path, "--do_train",
            match=("train.json: 4 of 10 answered questions", "id q2: answer_start", "not 'Paris'; the text is at",
                   "--answer_mismatch_tolerance"))
    message = refused(run_qa, minilm_dir, tmp_path / "out", "--train_file",
                      squad_file(tmp_path / "past.json", questions[8:9]), "--do_train", match=("id q8",))
    assert "answer_start 500 is outside the context (" in message


def test_squad_few_mismatches_are_left_out_of_training():
    questions = place_questions(200)
    qid, context, question, text, start = questions[3]
    questions[3] = (qid, context, question, text, start + 1)
    records = [{"id": q, "context": c, "question": qu, "title": "", "answers": {"text": [t], "answer_start": [s]}}
               for q, c, qu, t, s in questions]
    import datasets

    raw = datasets.DatasetDict({"train": datasets.Dataset.from_list(records)})
    run_qa.check_answers(raw, {"train": "train.json"}, run_qa.DataArguments(train_file="train.json"))
    assert len(raw["train"]) == 199 and "q3" not in raw["train"]["id"]


def test_squad_structure_v2_and_long_questions(minilm_dir, tmp_path):
    broken = {"data": [{"title": "t", "paragraphs": [{"context": "Anna lives in Oslo.", "qas": []},
                                                     {"qas": [{"id": "x7", "question": "Who?", "answers": []}]}]}]}
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    refused(run_qa, minilm_dir, tmp_path / "out", "--train_file", tmp_path / "broken.json", "--do_train",
            match=("broken.json: data[0].paragraphs[1] has no 'context'", "x7"))
    v2 = squad_file(tmp_path / "v2.json", place_questions(3) + [("nope", "Anna lives in Oslo.", "Who is king?", "",
                                                                  None)], version="v2.0")
    refused(run_qa, minilm_dir, tmp_path / "out", "--train_file", v2, "--do_train",
            match=("v2.json: 1 question(s) have no answer (ids nope)", "--version_2_with_negative"))
    long = place_questions(2)
    long[1] = (long[1][0], long[1][1], "Where, after all the many years and all the travels, " * 3 + "does she live?",
               *long[1][3:])
    refused(run_qa, minilm_dir, tmp_path / "out", "--train_file", squad_file(tmp_path / "long.json", long),
            "--do_train", "--doc_stride", "8",
            match=("long.json: 1 question(s) too long for --max_seq_length 32 with --doc_stride 8 (ids q1)",
                   "Raise --max_seq_length above"))


# ---------------------------------------------------------------------------------------------------------------------
# Pre-training corpora too small to split or to pair
# ---------------------------------------------------------------------------------------------------------------------
def test_pretraining_corpus_of_one_sentence_is_refused(minilm_dir, tmp_path):
    corpus = tmp_path / "one.txt"
    corpus.write_text("The only sentence there is.\n")
    args = ["--config_name", "tiny", "--tokenizer_name", minilm_dir, "--train_file", str(corpus), "--do_train",
            "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"), *COMMON]
    with pytest.raises(ValueError, match=re.escape(f"{corpus}: the training data holds 1 document(s): too few to hold "
                                                   "out 5%")):
        run_pretraining.main(args)
    with pytest.raises(ValueError, match=re.escape(f"{corpus}: the train data holds 1 document(s) with text") +
                       ".*at least 2.*blank line"):
        run_pretraining.main([*args, "--validation_split_percentage", "0"])


def test_pretraining_corpus_files_that_cannot_be_read_name_the_file_and_the_line(minilm_dir, tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("Anna lives in Oslo.\nShe works there.\n\nPeter left Rome.\nHe took the train.\n")
    (tmp_path / "latin1.txt").write_bytes("Anna lives in Oslo.\n\nUn caf\u00e9 noir.\n".encode("latin-1"))
    (tmp_path / "blank.txt").write_bytes(b"\n  \n\n")
    (tmp_path / "shard-1.txt").write_text(good.read_text())
    (tmp_path / "shard-2.txt").write_bytes((tmp_path / "latin1.txt").read_bytes())
    args = ["--config_name", "tiny", "--tokenizer_name", minilm_dir, "--do_train", "--do_eval",
            "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"), *COMMON]
    cases = [
        (["--train_file", tmp_path / "missing.txt"], "missing.txt: no such file"),
        (["--train_file", tmp_path / "blank.txt"], "blank.txt: the file is empty"),
        (["--train_file", tmp_path / "latin1.txt"], "latin1.txt, line 3, column 7: byte 0xe9 is not UTF-8"),
        (["--train_file", good, "--validation_file", tmp_path / "latin1.txt"], "latin1.txt, line 3, column 7"),
        (["--train_file", tmp_path / "shard-*.txt"], "shard-2.txt, line 3, column 7: byte 0xe9 is not UTF-8"),
        (["--train_file", good, tmp_path / "part-*.txt"], "part-*.txt: no file matches"),
    ]
    for files, match in cases:
        with pytest.raises(ValueError) as error:
            run_pretraining.main([*args, *map(str, files)])
        assert match in str(error.value) and str(tmp_path) in str(error.value), str(error.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()  # refused before anything was read


def test_text_chunks_reads_a_chunk_at_a_time_and_counts_lines_across_chunks(tmp_path):
    """Pre-training corpora are checked a chunk at a time: the text is the file's, and a bad byte is found at the same
    line and column whatever the chunk size (a character or a line cut by a chunk's end included)."""
    text = "".join(f"sentence {i} in a caf\u00e9\n" for i in range(50))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    chunks = list(user_files.text_chunks(str(path), chunk_bytes=7))
    assert "".join(chunks) == text and max(map(len, chunks)) <= 7 and len(chunks) > 50
    path.write_bytes(text.encode().replace("sentence 37 in a caf\u00e9".encode(), b"sentence 37 in a caf\xe9"))
    truncated = tmp_path / "truncated.txt"
    truncated.write_bytes(text.encode() + b"the end \xe2\x82")  # cut inside a 3-byte character
    for size in (1, 2, 3, 7, 1 << 20):
        with pytest.raises(ValueError, match=r"corpus.txt, line 38, column 21: byte 0xe9 is not UTF-8"):
            list(user_files.text_chunks(str(path), chunk_bytes=size))
        with pytest.raises(ValueError, match=r"truncated.txt, line 51, column 9: byte 0xe2 is not UTF-8"):
            list(user_files.text_chunks(str(truncated), chunk_bytes=size))


def test_pretraining_small_corpus_holds_out_two_documents(tmp_path):
    corpus = tmp_path / "ten.txt"
    corpus.write_text("\n\n".join(f"Document {i} has a sentence.\nAnd a second one." for i in range(10)) + "\n")
    data_args = run_pretraining.DataTrainingArguments(train_file=[str(corpus)])  # 5%: rounds to no document
    raw, _ = run_pretraining.load_raw_datasets(data_args, run_pretraining.ModelArguments(cache_dir=str(tmp_path)))
    assert (len(raw["train"]), len(raw["validation"])) == (8, 2)
    assert raw["validation"]["text"][0].startswith("Document 0") and raw["train"]["text"][0].startswith("Document 2")


# ---------------------------------------------------------------------------------------------------------------------
# --help, secrets
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", [run_glue, run_ner, run_qa, run_swag, run_pretraining])
def test_help_of_every_recipe(recipe, capsys):
    with pytest.raises(SystemExit) as exit:
        recipe.main(["--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert "--overwrite_output_dir" in text and "--resume_without_training_state" in text


def test_redact_hides_every_token_like_argument():
    argv = ["--hub_token", "hf_abcdefghijklmnop", "--token=hf_qrstuvwxyz123456", "--tokenizer_name", "bert-base",
            "--hub_model_id", "me/model", "--run_name", "HF_TOKEN=secret1", "--train_file",
            "https://alice:pa55@example.org/train.csv?access_token=secret2&x=1", "--db_password", "secret3",
            "--resume_from_checkpoint", "hf_zyxwvutsrqponm"]
    redacted = redaction.redact(argv)
    text = " ".join(redacted)
    for secret in ("hf_abcdefghijklmnop", "hf_qrstuvwxyz123456", "secret1", "pa55", "secret2", "secret3",
                   "hf_zyxwvutsrqponm"):
        assert secret not in text, secret
    assert redacted[:6] == ["--hub_token", "REDACTED", "--token=REDACTED", "--tokenizer_name", "bert-base",
                            "--hub_model_id"]
    assert "https://REDACTED@example.org/train.csv?access_token=REDACTED&x=1" in redacted


def test_log_lines_are_redacted():
    import io
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(redaction.RedactingFilter())
    log = logging.getLogger("test_recipe_errors.redaction")
    log.addHandler(handler)
    try:
        log.warning("pushing with %s to %s", "hf_abcdefghijklmnop", "https://bob:pw@example.org/x")
    finally:
        log.removeHandler(handler)
    assert stream.getvalue() == "pushing with REDACTED to https://REDACTED@example.org/x\n"


def test_hub_token_reaches_no_file_and_no_log_line(tiny_dir, tmp_path, capsys, caplog):
    secret = "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"
    train = write_csv(tmp_path / "train.csv", ["sentence", "label"], SENTENCES)
    out = tmp_path / "out"
    run_glue.main(["--model_name_or_path", tiny_dir, "--output_dir", str(out), *COMMON, "--train_file", str(train),
                   "--do_train", "--max_steps", "1", "--save_steps", "1", "--hub_token", secret,
                   "--log_level", "info"])
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in files) and (out / "README.md").is_file()
    for path in files:
        assert secret.encode() not in path.read_bytes(), path
    assert "--hub_token REDACTED" in (out / "README.md").read_text()
    logs = capsys.readouterr()
    assert secret not in logs.out + logs.err + caplog.text


# ---------------------------------------------------------------------------------------------------------------------
# Output directory and resuming, the same in every recipe (the runs as processes: tests/test_recipe_resume.py)
# ---------------------------------------------------------------------------------------------------------------------
CHECKPOINT_FILES = ("model.safetensors", "trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth")


def fake_checkpoint(output_dir: Path, step: int, files=CHECKPOINT_FILES) -> Path:
    """checkpoint-N holding `files`, each a tiny file in its real format (safetensors, torch.save's zip, JSON)."""
    import torch
    from safetensors.torch import save_file

    path = output_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    path.mkdir(parents=True)
    for name in files:
        if name.endswith(".safetensors"):
            save_file({"weight": torch.arange(64.0)}, path / name)
        elif name.endswith(".json"):
            (path / name).write_text(json.dumps({"global_step": step, "log_history": [{"step": step, "loss": 1.0}]}))
        else:
            torch.save({"step": step, "state": torch.arange(64.0)}, path / name)
    return path


def cut_off(path: Path) -> Path:
    """`path` cut to half its length, as a full disk or an interrupted copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


@pytest.mark.parametrize("recipe", [run_glue, run_ner, run_qa, run_swag, run_pretraining])
def test_every_recipe_resumes_last_and_guards_the_output_dir(recipe, minilm_dir, tmp_path):
    args = ["--model_name_or_path", minilm_dir] if recipe is not run_pretraining else ["--tokenizer_name", minilm_dir]
    args += ["--train_file", str(tmp_path / "train.csv"), "--do_train", "--output_dir", str(tmp_path), *COMMON]
    with pytest.raises(ValueError, match="--resume_from_checkpoint last: .* holds no complete checkpoint"):
        recipe.main([*args, "--resume_from_checkpoint", "last"])
    fake_checkpoint(tmp_path, 5)
    with pytest.raises(ValueError, match="holds an earlier run .*--resume_from_checkpoint last.*--overwrite_output_dir"):
        recipe.main(args)


def recipe_args(recipe, minilm_dir, folder: Path) -> list[str]:
    """Training arguments for `recipe` into `folder`, whose --train_file does not exist (an error once it is read)."""
    args = ["--model_name_or_path", minilm_dir] if recipe is not run_pretraining else ["--tokenizer_name", minilm_dir]
    return [*args, "--train_file", str(folder / "train.csv"), "--do_train", "--output_dir", str(folder), *COMMON]


@pytest.mark.parametrize("name,last", [("model.safetensors", "last"), ("optimizer.pt", "True"),
                                       ("trainer_state.json", "last")])
@pytest.mark.parametrize("recipe", [run_glue, run_ner, run_qa, run_swag, run_pretraining])
def test_every_recipe_names_a_damaged_checkpoint_file(recipe, name, last, minilm_dir, tmp_path, caplog):
    """checkpoint-30's `name` cut off: named as the checkpoint's path, it is refused with the file and checkpoint-20
    named; with `last` (or `True`) the run falls back to checkpoint-20, with a warning naming the file, and goes on
    (here to its missing data file)."""
    for step in (10, 20):
        fake_checkpoint(tmp_path, step)
    damaged = cut_off(fake_checkpoint(tmp_path, 30) / name)
    args = recipe_args(recipe, minilm_dir, tmp_path)
    with pytest.raises(ValueError) as error:
        recipe.main([*args, "--resume_from_checkpoint", str(damaged.parent)])
    message = str(error.value)
    assert message.startswith(f"--resume_from_checkpoint {damaged.parent}: damaged"), message
    assert f"{damaged} (" in message and "newest complete older checkpoint is " \
        f"{tmp_path / 'checkpoint-20'}: resume from it" in message, message
    with caplog.at_level(logging.WARNING, logger="checkpoints"), pytest.raises(ValueError, match="train.csv: no such file"):
        recipe.main([*args, "--resume_from_checkpoint", last])
    assert f"{damaged} (" in caplog.text and "Falling back" in caplog.text
    assert f"resuming from the newest complete checkpoint, {tmp_path / 'checkpoint-20'}" in caplog.text


def test_damaged_files_finds_each_kind_of_damage(tmp_path):
    """Every file the Trainer reads on resume, cut off, is named with what is wrong; intact files are not, nor a
    torch.save file in the pre-zip format (which cannot be checked cheaply)."""
    import torch

    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    checkpoint = fake_checkpoint(tmp_path, 10, files=(*CHECKPOINT_FILES, "training_args.bin", "config.json",
                                                      "scaler.pt", "rng_state_1.pth", *shards))
    index = checkpoint / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"a": shards[0], "b": shards[1]}}))
    torch.save({"old": 1}, checkpoint / "legacy.pt", _use_new_zipfile_serialization=False)
    assert checkpoints.damaged_files(str(checkpoint)) == []

    whys = {".safetensors": r"cut off: its tensors end at byte \d+, the file has \d+",
            ".json": r"not valid JSON: .*, line 1, column \d+", ".pt": "not a complete zip archive, torch.save's",
            ".pth": "not a complete zip archive", ".bin": "not a complete zip archive"}
    for path in sorted(checkpoint.iterdir()):
        if path.name == "legacy.pt":
            continue
        intact = path.read_bytes()
        cut_off(path)
        damaged = checkpoints.damaged_files(str(checkpoint))
        assert len(damaged) == 1 and damaged[0].startswith(f"{path} (") and \
            re.search(whys[path.suffix], damaged[0]), damaged
        path.write_bytes(intact)

    def problem(path: Path, data: bytes) -> str:
        intact = path.read_bytes()
        path.write_bytes(data)
        (found,) = checkpoints.damaged_files(str(checkpoint))
        path.write_bytes(intact)
        return found

    safetensors = checkpoint / "model.safetensors"
    assert "extra bytes: its tensors end at byte" in problem(safetensors, safetensors.read_bytes() + b"\0" * 8)
    assert "cut off: 5 bytes, too short for its header" in problem(safetensors, safetensors.read_bytes()[:5])
    assert "not a complete zip archive" in problem(checkpoint / "optimizer.pt", b"")
    assert "not valid JSON" in problem(checkpoint / "trainer_state.json", b"")
    (checkpoint / shards[1]).unlink()
    assert checkpoints.damaged_files(str(checkpoint)) == [f"{index} (names shards that are missing: {shards[1]})"]


def test_last_with_every_checkpoint_damaged_names_them_all(tmp_path):
    for step, name in ((10, "optimizer.pt"), (20, "model.safetensors")):
        cut_off(fake_checkpoint(tmp_path, step) / name)
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint last: every complete checkpoint of .* holds damaged"
                                         r" files: .*checkpoint-20/model.safetensors \(cut off.*; "
                                         r".*checkpoint-10/optimizer.pt \(not a complete zip archive"):
        training_args("--output_dir", tmp_path, "--resume_from_checkpoint", "last")
    with pytest.raises(ValueError, match=f"checkpoint-20: damaged.*{tmp_path} holds no complete older checkpoint"):
        training_args("--output_dir", tmp_path, "--resume_from_checkpoint", tmp_path / "checkpoint-20")


def training_args(*args):
    return common.parse_args(common.DataArguments, ["--model_name_or_path", "m", "--train_file", "t.csv",
                                                    "--do_train", *map(str, args)])[-1]


def test_last_is_the_newest_complete_checkpoint_and_needs_the_training_state(tmp_path):
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 20)
    fake_checkpoint(tmp_path, 30, files=("model.safetensors",))  # half-written by a killed run of another tool
    (tmp_path / checkpoints.STAGING_DIR).mkdir()
    args = training_args("--output_dir", tmp_path, "--resume_from_checkpoint", "True")
    assert args.resume_from_checkpoint == str(tmp_path / "checkpoint-20")
    with pytest.raises(ValueError, match="checkpoint-30: not a complete checkpoint"):
        training_args("--output_dir", tmp_path, "--resume_from_checkpoint", tmp_path / "checkpoint-30")

    for name in ("optimizer.pt", "rng_state.pth"):
        (tmp_path / "checkpoint-20" / name).unlink()
    with pytest.raises(ValueError, match="lacks optimizer.pt, rng_state.pth.*losses would differ.*"
                                         "--resume_without_training_state"):
        training_args("--output_dir", tmp_path, "--resume_from_checkpoint", "last")
    args = training_args("--output_dir", tmp_path, "--resume_from_checkpoint", "last",
                         "--resume_without_training_state")
    assert args.resume_from_checkpoint == str(tmp_path / "checkpoint-20")


def test_overwrite_output_dir_deletes_the_earlier_checkpoints_and_results(tmp_path):
    fake_checkpoint(tmp_path, 10)
    (tmp_path / checkpoints.STAGING_DIR).mkdir()
    for name in ("all_results.json", "trainer_state.json", "model.safetensors", "notes.txt"):
        (tmp_path / name).write_text("{}")
    training_args("--output_dir", tmp_path, "--overwrite_output_dir")
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "notes.txt"]


RECIPE_SCRIPTS = ["run_glue.py", "run_ner.py", "run_ner_features.py", "run_pretraining.py", "run_qa.py", "run_swag.py",
                  "answer.py"]


@pytest.mark.parametrize("script", RECIPE_SCRIPTS)
def test_a_recipe_without_the_recipes_extra_names_it(script):
    """After `pip install -e .` without the `recipes` extra, a recipe stops with the extra's name and the packages
    missing, before its imports would end in a bare ModuleNotFoundError; every package of the extra in
    pyproject.toml is checked."""
    import subprocess
    import tomllib

    import needs_extra

    extra = tomllib.loads((RECIPES.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["recipes"]
    assert sorted(needs_extra.RECIPES_EXTRA.values()) == sorted(re.split("[<>=]", r)[0] for r in extra)
    code = ("import runpy, sys; sys.modules['datasets'] = sys.modules['seqeval'] = None; "
            f"sys.argv = [{script!r}, '--help']; sys.path.insert(0, {str(RECIPES)!r}); "
            f"runpy.run_path({str(RECIPES / script)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"{script} needs datasets, seqeval, of bert-impl's `recipes` extra: run pip install "
                                   "-e \".[recipes]\" in the root of the bert-impl clone (or pip install datasets "
                                   "seqeval)")


# ---------------------------------------------------------------------------------------------------------------------
# The load report a newcomer reads
# ---------------------------------------------------------------------------------------------------------------------
def test_a_new_task_head_is_said_in_one_line_and_missing_encoder_weights_keep_the_report(minilm_dir, tmp_path,
                                                                                           caplog, monkeypatch):
    """Fine-tuning MiniLM (an encoder without a classifier): one INFO line says the classifier is new and that
    fine-tuning trains it, in place of transformers' table that calls it MISSING in red (a newcomer took it for an
    error). A checkpoint that lacks weights of the encoder itself keeps transformers' report, and its table."""
    from safetensors.torch import load_file, save_file

    from modeling_bert_impl import BertImplForSequenceClassification, BertImplModel

    # transformers' records reach caplog (the root logger) only where its logger propagates: off by default, on where
    # an earlier test in the process turned it on; on here whatever ran before
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    args = common.ModelArguments(model_name_or_path=minilm_dir)
    with caplog.at_level(logging.INFO):
        model = common.load_for_fine_tuning(BertImplForSequenceClassification, args, num_labels=2)
    assert model.config.num_labels == 2
    messages = [r.getMessage() for r in caplog.records]
    assert not any("LOAD REPORT" in m for m in messages), messages
    assert any(m.startswith("new task head: classifier.bias, classifier.weight, initialised at random") for m in
               messages), messages

    damaged = tmp_path / "damaged"
    BertImplModel.from_pretrained(minilm_dir).save_pretrained(damaged)
    weights = load_file(damaged / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layer.0.output.dense" not in k}, damaged / "model.safetensors",
              metadata={"format": "pt"})
    caplog.clear()
    with caplog.at_level(logging.INFO):
        common.load_for_fine_tuning(BertImplForSequenceClassification, common.ModelArguments(str(damaged)))
    report = next(m for m in (r.getMessage() for r in caplog.records) if "LOAD REPORT" in m)
    assert "layer.0.output.dense.weight" in report and "MISSING" in report
