"""End-to-end runs of the fine-tuning recipes: the real MiniLM checkpoint fine-tuned on small, easy data sets written
here in each recipe's real file format (GLUE TSV, CoNLL columns, SQuAD nested JSON, SWAG CSV), on CPU, offline.

Each run must score clearly above chance, write all_results.json, and save a folder that the Auto class loads back as
our class with the trained model's logits. The recipes run in this process through `main(argv)`, as
`python recipes/run_x.py argv` would run them (one torchrun test runs a script as a command)."""

import csv
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import modeling_bert_impl  # noqa: F401  (registers bert_impl with the Auto classes)
from modeling_bert_impl import (
    BertImplForMultipleChoice,
    BertImplForQuestionAnswering,
    BertImplForSequenceClassification,
    BertImplForTokenClassification,
)

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
sys.path.insert(0, str(RECIPES))

import run_glue  # noqa: E402
import run_ner  # noqa: E402
import run_qa  # noqa: E402
import run_swag  # noqa: E402
from recipe_data import (  # noqa: E402
    FILLER, RECIPE_FLAGS, ner_sentence, sentiment_rows, squad_article, sst2_files, swag_rows, write_conll, write_csv,
)


def run(recipe, minilm_dir, out, *args, train=True):
    flags = ["--do_train", "--do_eval"] if train else ["--do_eval"]
    return recipe.main(["--model_name_or_path", minilm_dir, "--output_dir", str(out), *flags, *RECIPE_FLAGS, *map(str, args)])


def results(out) -> dict:
    return json.loads((Path(out) / "all_results.json").read_text())


def assert_reloads(trainer, out, auto_class, our_class, batch):
    """The saved folder loads through the Auto class as our class, with the trained model's logits (and the
    tokenizer saved next to it)."""
    reloaded = getattr(transformers, auto_class).from_pretrained(out).eval()
    assert type(reloaded) is our_class
    assert (Path(out) / "tokenizer_config.json").is_file() and (Path(out) / "vocab.txt").is_file()
    trained = trainer.model.eval()
    with torch.no_grad():
        expected, got = trained(**batch), reloaded(**batch)
    for name in ("logits", "start_logits", "end_logits"):
        if name in expected:
            assert torch.equal(expected[name], got[name]), name


# ---------------------------------------------------------------------------------------------------------------------
# File readers
# ---------------------------------------------------------------------------------------------------------------------
def test_read_conll_skips_docstart_and_splits_on_blank_lines(tmp_path):
    path = tmp_path / "data.conll"
    path.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n\n"
                    "-DOCSTART- -X- -X- O\n\nPeter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\n")
    dataset = run_ner.read_conll(str(path))
    assert dataset["tokens"] == [["EU", "rejects"], ["Peter", "Blackburn"]]
    assert dataset["ner_tags"] == [["B-ORG", "O"], ["B-PER", "I-PER"]]


def test_read_squad_nested_and_flat_files_agree(tmp_path):
    squad = {"version": "v2.0", "data": [squad_article(random.Random(0), 0)]}
    squad["data"][0]["paragraphs"][0]["qas"].append(
        {"id": "x", "question": "Who is the king?", "answers": [], "is_impossible": True})
    (tmp_path / "nested.json").write_text(json.dumps(squad))
    nested = run_qa.read_squad(str(tmp_path / "nested.json"))
    (tmp_path / "flat.jsonl").write_text("\n".join(json.dumps(r) for r in nested.to_list()))
    (tmp_path / "flat.json").write_text(json.dumps({"data": nested.to_list()}))
    for name in ("flat.jsonl", "flat.json"):
        assert run_qa.read_squad(str(tmp_path / name)).to_list() == nested.to_list()
    assert nested[1]["answers"] == {"text": [], "answer_start": []}
    context, answer = nested[0]["context"], nested[0]["answers"]
    assert context[answer["answer_start"][0]:].startswith(answer["text"][0])


# ---------------------------------------------------------------------------------------------------------------------
# GLUE: SST-2's TSV layout
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_glue_sst2_tsv(minilm_dir, tmp_path):
    sst2_files(tmp_path, seed=0, train=64, dev=48)
    out = tmp_path / "out"
    trainer = run(run_glue, minilm_dir, out, "--task_name", "sst2", "--train_file", tmp_path / "train.tsv",
                  "--validation_file", tmp_path / "dev.tsv", "--max_seq_length", 32, "--learning_rate", 3e-4,
                  "--per_device_train_batch_size", 16, "--num_train_epochs", 2)
    metrics = results(out)
    assert metrics["eval_accuracy"] > 0.9, metrics
    assert metrics["eval_samples"] == 48 and metrics["train_samples"] == 64
    batch = trainer.processing_class(["a truly awful meal .", "the show was lovely ."], padding=True,
                                     return_tensors="pt")
    assert_reloads(trainer, out, "AutoModelForSequenceClassification", BertImplForSequenceClassification, batch)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bert_impl" and config["id2label"] == {"0": "0", "1": "1"}
    assert (out / "README.md").is_file()  # the model card


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pairs_csv_string_labels", "regression_json"])
def test_run_glue_file_layouts_evaluate(minilm_dir, tmp_path, layout):
    """No training: the data path alone (pairs, string labels mapped to ids, regression), on the untrained head."""
    rng = random.Random(1)
    sentences = [s for s, _ in sentiment_rows(rng, 40)]
    if layout == "pairs_csv_string_labels":
        path, task = tmp_path / "dev.csv", ["--task_name", "mrpc"]
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence1", "sentence2", "label"])
            writer.writerows((a, b, "yes" if i % 2 else "no") for i, (a, b) in enumerate(zip(sentences, sentences[1:])))
        expected_keys, expected_labels = {"eval_accuracy", "eval_f1"}, {"0": "no", "1": "yes"}
    else:
        path, task = tmp_path / "dev.json", []
        path.write_text("\n".join(json.dumps({"text": s, "label": rng.uniform(0, 5)}) for s in sentences))
        expected_keys, expected_labels = {"eval_pearson", "eval_spearmanr"}, None
    out = tmp_path / "out"
    trainer = run(run_glue, minilm_dir, out, *task, "--validation_file", path, "--max_seq_length", 32, train=False)
    assert expected_keys <= results(out).keys()
    config = trainer.model.config
    if expected_labels:
        assert {str(k): v for k, v in config.id2label.items()} == expected_labels
    else:
        assert config.num_labels == 1 and config.problem_type == "regression"


# ---------------------------------------------------------------------------------------------------------------------
# NER: CoNLL-2003 columns
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_ner_conll(minilm_dir, tmp_path):
    rng = random.Random(0)
    write_conll(tmp_path / "train.txt", [ner_sentence(rng) for _ in range(64)])
    write_conll(tmp_path / "dev.conll", [ner_sentence(rng) for _ in range(40)])
    out = tmp_path / "out"
    trainer = run(run_ner, minilm_dir, out, "--train_file", tmp_path / "train.txt", "--validation_file",
                  tmp_path / "dev.conll", "--max_seq_length", 32, "--learning_rate", 5e-4,
                  "--per_device_train_batch_size", 16, "--num_train_epochs", 2, "--label_all_tokens")
    metrics = results(out)
    assert metrics["eval_f1"] > 0.9 and metrics["eval_accuracy"] > 0.9, metrics
    assert set(trainer.model.config.label2id) == {"B-LOC", "B-ORG", "B-PER", "I-ORG", "I-PER", "O"}
    batch = trainer.processing_class(["Anna", "lives", "in", "Oslo", "."], is_split_into_words=True,
                                     return_tensors="pt")
    assert_reloads(trainer, out, "AutoModelForTokenClassification", BertImplForTokenClassification, dict(batch))


# ---------------------------------------------------------------------------------------------------------------------
# QA: SQuAD's nested JSON, contexts longer than one window
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_qa_squad_json(minilm_dir, tmp_path):
    rng = random.Random(0)
    for name, start, count in (("train", 0, 32), ("dev", 100, 16)):
        squad = {"version": "1.1", "data": [squad_article(rng, start + i) for i in range(count)]}
        (tmp_path / f"{name}.json").write_text(json.dumps(squad))
    out = tmp_path / "out"
    trainer = run(run_qa, minilm_dir, out, "--train_file", tmp_path / "train.json", "--validation_file",
                  tmp_path / "dev.json", "--max_seq_length", 64, "--doc_stride", 24, "--learning_rate", 4e-4,
                  "--per_device_train_batch_size", 16, "--num_train_epochs", 2)
    metrics = results(out)
    assert metrics["eval_exact_match"] > 80 and metrics["eval_f1"] > 80, metrics  # percent, as SQuAD reports them
    predictions = json.loads((out / "predictions.json").read_text())
    assert len(predictions) == 16
    # The contexts need two windows of 64 tokens: the long-context path was exercised.
    assert trainer.train_dataset.num_rows > 32
    question, context = "Where does Emma live?", "Emma lives in Rome. " + " ".join(FILLER[:2])
    batch = trainer.processing_class(question, context, return_tensors="pt")
    assert_reloads(trainer, out, "AutoModelForQuestionAnswering", BertImplForQuestionAnswering, batch)


# ---------------------------------------------------------------------------------------------------------------------
# SWAG: its CSV columns
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_swag_csv(minilm_dir, tmp_path):
    rng = random.Random(0)
    write_csv(tmp_path / "train.csv", swag_rows(rng, 48))
    write_csv(tmp_path / "dev.csv", swag_rows(rng, 40))
    out = tmp_path / "out"
    trainer = run(run_swag, minilm_dir, out, "--train_file", tmp_path / "train.csv", "--validation_file",
                  tmp_path / "dev.csv", "--max_seq_length", 32, "--learning_rate", 3e-4,
                  "--per_device_train_batch_size", 8, "--num_train_epochs", 2)
    metrics = results(out)
    assert metrics["eval_accuracy"] > 0.6, metrics  # chance is 0.25
    endings = ["went straight to bed.", "ate a big sandwich.", "called a doctor.", "looked at a map."]
    encoded = trainer.processing_class(["Anna felt very hungry."] * 4, [f"So she {e}" for e in endings],
                                       padding=True, return_tensors="pt")
    batch = {k: v.unsqueeze(0) for k, v in encoded.items()}  # (1 example, 4 choices, T)
    assert_reloads(trainer, out, "AutoModelForMultipleChoice", BertImplForMultipleChoice, batch)


# ---------------------------------------------------------------------------------------------------------------------
# Distributed: the script as a command under torchrun, two processes
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")
def test_run_glue_under_torchrun(minilm_dir, tmp_path):
    sst2_files(tmp_path, seed=2, train=48, dev=16)
    out = tmp_path / "out"
    command = ["torchrun", "--standalone", "--nproc_per_node", "2", str(RECIPES / "run_glue.py"), "--model_name_or_path", minilm_dir, "--output_dir", str(out),
               "--train_file", str(tmp_path / "train.tsv"), "--validation_file", str(tmp_path / "dev.tsv"),
               "--do_train", "--do_eval", "--max_seq_length", "32", "--per_device_train_batch_size", "8",
               "--max_steps", "2", *RECIPE_FLAGS]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = results(out)
    assert metrics["eval_samples"] == 16 and 0 <= metrics["eval_accuracy"] <= 1
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert type(reloaded) is BertImplForSequenceClassification


LEAVE_GROUP = """
import json, sys, weakref
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import common
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
holder = {"model": torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))}
holder["self"] = holder  # a reference cycle, as the Trainer's objects form around its model
model = weakref.ref(holder["model"])
del holder
held = model() is not None
common.leave_process_group()
print(json.dumps({"held": held, "freed": model() is None, "initialized": dist.is_initialized()}))
"""


@pytest.mark.slow  # two ranks under torchrun
def test_a_distributed_run_frees_its_model_and_leaves_the_group_before_exit(tmp_path):
    """`common.leave_process_group` (each recipe's last call): the DDP model left in reference cycles after `main`,
    which holds the gloo group, is freed while the interpreter is whole, then the group is left (one process here)."""
    proc = subprocess.run([sys.executable, "-c", LEAVE_GROUP, str(RECIPES), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"held": True, "freed": True, "initialized": False}
