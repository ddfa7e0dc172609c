"""The paper's feature-based approach (recipes/run_ner_features.py): frozen MiniLM features (6 layers, so 7 hidden
states with the embeddings) feed a BiLSTM tagger per feature choice, on a small CoNLL file made here; one command
(--fine_tune: it also fine-tunes with run_ner.py's training) prints the paper's Table 7 for it, fine-tuning's row
included. Each row must beat chance by far, a second run must reuse the cached features and read fine-tuning's F1 from
--fine_tuned_dir, and a saved head must reload and tag the validation sentences as the run did."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
sys.path.insert(0, str(RECIPES))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_ner  # noqa: E402
import run_ner_features  # noqa: E402
from metrics import seqeval_metrics  # noqa: E402
from recipe_data import RECIPE_FLAGS, ner_sentence, write_conll  # noqa: E402

HEAD = ["--max_seq_length", "32", "--lstm_hidden_size", "32", "--learning_rate", "1e-2",
        "--per_device_train_batch_size", "8", "--num_train_epochs", "8"]


def chance_f1(train_tags, dev_tags, draws=20) -> float:
    """Entity F1 of a tagger that draws each word's tag at random with the training tags' frequencies (mean of
    `draws`)."""
    rng = random.Random(0)
    pool = [t for sentence in train_tags for t in sentence]
    scores = [seqeval_metrics([[rng.choice(pool) for _ in s] for s in dev_tags], dev_tags)["f1"] for _ in range(draws)]
    return sum(scores) / draws


@pytest.mark.slow
def test_feature_based_table(minilm_dir, tmp_path, capsys):
    rng = random.Random(0)
    write_conll(tmp_path / "train.txt", [ner_sentence(rng) for _ in range(64)])
    write_conll(tmp_path / "dev.txt", [ner_sentence(rng) for _ in range(40)])
    train, dev = run_ner.read_conll(str(tmp_path / "train.txt")), run_ner.read_conll(str(tmp_path / "dev.txt"))
    data = ["--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "dev.txt")]
    cache = tmp_path / "cache"
    command = ["--model_name_or_path", minilm_dir, *data, *HEAD, *RECIPE_FLAGS, "--feature_cache_dir", str(cache)]
    capsys.readouterr()
    # One command: every feature choice, and fine-tuning (run_ner.py's training, 16 steps) for the first row.
    results = run_ner_features.main([*command, "--output_dir", str(tmp_path / "out"), "--fine_tune",
                                     "--fine_tune_learning_rate", "5e-4", "--fine_tune_epochs", "2"])
    printed = capsys.readouterr().out
    fine_tuned = tmp_path / "out" / "fine_tuning"  # a run_ner.py --output_dir: model, tokenizer, results, card
    fine_tuned_f1 = json.loads((fine_tuned / "all_results.json").read_text())["eval_f1"]
    assert results["fine_tuning_f1"] == fine_tuned_f1 > 0.8
    assert json.loads((fine_tuned / "trainer_state.json").read_text())["max_steps"] == 16  # 64 sentences, batch 8,
    # --fine_tune_epochs 2 (not the heads' 8 epochs), at --fine_tune_learning_rate (not the heads' 1e-2)
    assert torch.load(fine_tuned / "training_args.bin", weights_only=False).learning_rate == 5e-4
    assert "--fine_tune" in (fine_tuned / "README.md").read_text()  # the card names the command that made it
    tuned_model = run_ner.BertImplForTokenClassification.from_pretrained(fine_tuned)
    assert set(tuned_model.config.label2id) == {t for s in [*train["ner_tags"], *dev["ner_tags"]] for t in s}

    chance = chance_f1(train["ner_tags"], dev["ner_tags"])
    assert chance < 0.1, chance
    rows = results["features"]
    assert list(rows) == list(run_ner_features.FEATURES)
    assert rows["sum_all"]["layers"] == list(range(7)) and rows["concat_last_four"]["layers"] == [3, 4, 5, 6]
    for name, row in rows.items():
        assert row["f1"] > 0.8, (name, row, chance)  # chance: about 0.08
    assert results["fine_tuning_f1"] == fine_tuned_f1
    # The table: a header, a rule, fine-tuning, then one row per choice with the user's F1 beside the paper's.
    table = results["table"]
    assert table in printed and table == (tmp_path / "out" / "feature_based_table.md").read_text()
    lines = table.splitlines()
    assert len(lines) == 3 + len(rows)
    assert lines[2].startswith("| Fine-tuning") and f"| {100 * fine_tuned_f1:.1f} | 96.4 |" in lines[2]
    for line, row in zip(lines[3:], rows.values()):
        assert line.startswith(f"| {row['title']} |") and f"| {100 * row['f1']:.1f} |" in line
    assert "| 96.1 |" in lines[3 + list(rows).index("concat_last_four")]
    assert all(not c["reused"] for c in results["feature_cache"].values())

    # A second run (one head) reads the cached features instead of running the encoder, and fine-tuning's F1 from the
    # first run's fine-tuning folder (--fine_tuned_dir: any run_ner.py --output_dir).
    again = run_ner_features.main([*command, "--output_dir", str(tmp_path / "again"), "--features", "last",
                                   "--fine_tuned_dir", str(fine_tuned)])
    assert again["feature_cache"] == {s: {**c, "reused": True} for s, c in results["feature_cache"].items()}
    assert again["features"]["last"]["f1"] == pytest.approx(rows["last"]["f1"])
    assert again["fine_tuning_f1"] == fine_tuned_f1 and not (tmp_path / "again" / "fine_tuning").exists()
    assert len(list(cache.iterdir())) == 2  # train and validation
    with pytest.raises(ValueError, match="already holds a run"):
        run_ner_features.main([*command, "--output_dir", str(tmp_path / "again")])

    # A saved head reloads with its encoder and tags the validation sentences as the run did.
    for name in ("sum_all", "concat_last_four"):
        head_dir = tmp_path / "out" / name
        assert (head_dir / "model.safetensors").is_file()
        expected = [line.split() for line in (head_dir / "eval_predictions.txt").read_text().splitlines()]
        assert run_ner_features.predict(str(head_dir), dev["tokens"]) == expected
        assert seqeval_metrics(expected, dev["ner_tags"])["f1"] == pytest.approx(rows[name]["f1"])


def test_bad_feature_choice_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="--features 'last,top': unknown \\['top'\\]"):
        run_ner_features.main(["--model_name_or_path", "x", "--train_file", "t.txt", "--output_dir", str(tmp_path),
                               "--features", "last,top"])


def test_fine_tune_and_fine_tuned_dir_together_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="--fine_tune .* or --fine_tuned_dir .*, not both"):
        run_ner_features.main(["--model_name_or_path", "x", "--train_file", "t.txt", "--output_dir", str(tmp_path),
                               "--fine_tune", "--fine_tuned_dir", str(tmp_path)])
