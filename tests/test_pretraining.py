"""BERT pre-training: the data pipeline's proportions (checked against binomial tolerances), the recipe end to end on a
small English corpus written here, under torchrun with 2 CPU processes, and exact resumption from a checkpoint.

Statistical checks allow 4 standard deviations of the binomial count (deterministic seeds: a check passes or fails
the same way on every run)."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import transformers

import modeling_bert_impl  # noqa: F401  (registers bert_impl with the Auto classes)
from modeling_bert_impl import BertImplForPreTraining

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
sys.path.insert(0, str(RECIPES))

import run_pretraining  # noqa: E402
from pretraining_data import (  # noqa: E402
    IS_NEXT,
    NOT_NEXT,
    DataCollatorForPreTraining,
    DatasetDocuments,
    build_examples,
    create_examples_from_document,
    document_rng,
    masked_lm_targets,
    split_documents,
    split_sentences,
    truncate_seq_pair,
    whole_word_starts,
)
from recipe_data import DOCUMENTS, PRETRAINING_FLAGS, synthetic_corpus, training_logs, within_binomial  # noqa: E402

CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    try:
        from tokenization import BertImplTokenizer
    except ImportError:
        return transformers.AutoTokenizer.from_pretrained(minilm_dir)
    return BertImplTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(DOCUMENTS) + "\n")
    return str(path)


def all_examples(docs, seed=0, **kwargs):
    return [ex for i in range(len(docs)) for ex in create_examples_from_document(docs, i, document_rng(seed, i), **kwargs)]


# ---------------------------------------------------------------------------------------------------------------------
# Text -> documents
# ---------------------------------------------------------------------------------------------------------------------
def test_split_documents_on_blank_lines_and_sentences_on_lines():
    text = "A one.\nA two.\n\n  \nB one.\n\n\n\nC one.  \n"
    assert split_documents(text) == [["A one.", "A two."], ["B one."], ["C one."]]
    assert split_documents("\n \n") == []
    assert split_sentences('He left. "Why?" she asked! Then 3 more came.') == ["He left.", '"Why?" she asked!', "Then 3 more came."]
    assert split_documents("First. Second one.\nThird", split_lines=True) == [["First.", "Second one.", "Third"]]


# ---------------------------------------------------------------------------------------------------------------------
# Documents -> examples
# ---------------------------------------------------------------------------------------------------------------------
def test_truncate_seq_pair_cuts_the_longer_segment_from_both_ends():
    rng = random.Random(0)
    fronts = backs = 0
    for _ in range(200):
        a, b = truncate_seq_pair(list(range(100)), list(range(100, 130)), 50, rng)
        assert (len(a), len(b)) == (25, 25)  # A is cut down to B's length first, then they alternate (B on a tie)
        assert a == list(range(a[0], a[0] + 25)) and b == list(range(b[0], b[0] + 25))  # contiguous slices
        fronts += a[0] > 0
        backs += a[-1] < 99
    assert fronts == backs == 200  # 75 tokens cut from A at random ends: both ends lose some every time
    assert truncate_seq_pair([1, 2], [3], 10, rng) == ([1, 2], [3])


def test_examples_are_cls_a_sep_b_sep_with_true_or_random_continuations():
    docs = synthetic_corpus(300, seed=1)
    doc_of = {t: d for d, doc in enumerate(docs) for s in doc for t in s}
    examples = all_examples(docs, max_seq_length=64, short_seq_prob=0.1, nsp_probability=0.5, cls_id=CLS, sep_id=SEP)
    for ex in examples:
        ids, types = ex["input_ids"], ex["token_type_ids"]
        assert len(ids) <= 64 and len(types) == len(ids)
        assert ids[0] == CLS and ids[-1] == SEP and ids.count(SEP) == 2 and ids.count(CLS) == 1
        sep = ids.index(SEP)
        a, b = ids[1:sep], ids[sep + 1:-1]
        assert a and b
        assert types == [0] * (sep + 1) + [1] * (len(b) + 1)
        assert a == list(range(a[0], a[0] + len(a))) and b == list(range(b[0], b[0] + len(b)))  # contiguous text
        assert ex["next_sentence_label"] in (IS_NEXT, NOT_NEXT)
        if ex["next_sentence_label"] == IS_NEXT:
            assert doc_of[b[0]] == doc_of[a[0]] and b[0] > a[-1]  # B follows A in the same document
        else:
            assert doc_of[b[0]] != doc_of[a[0]]  # B comes from another document
    n = len(examples)
    not_next = sum(ex["next_sentence_label"] == NOT_NEXT for ex in examples)
    assert n > 1000
    assert within_binomial(not_next, n, 0.5), f"NotNext {not_next}/{n}"
    # deterministic given the seed, different with another seed
    assert all_examples(docs[:20], seed=0, max_seq_length=64) == all_examples(docs[:20], seed=0, max_seq_length=64)
    assert all_examples(docs[:20], seed=0, max_seq_length=64) != all_examples(docs[:20], seed=1, max_seq_length=64)


def test_short_targets_and_nsp_probability():
    # Sentences of one token: a chunk then stops exactly at its target length, and so does a NotNext B, so an example
    # is target + 3 tokens long unless it reaches the end of a document (told by the unique ids, and left out).
    docs = synthetic_corpus(200, seed=2, sentences=(400, 600), tokens=(1, 1))
    last_ids = {doc[-1][0] for doc in docs}
    max_len = 128
    for short_seq_prob, nsp_probability in ((0.1, 0.5), (0.3, 0.2), (0.0, 0.8)):
        examples = all_examples(docs, max_seq_length=max_len, short_seq_prob=short_seq_prob,
                                nsp_probability=nsp_probability, cls_id=CLS, sep_id=SEP)
        inner = [e["input_ids"] for e in examples if not last_ids & set(e["input_ids"])]
        assert len(inner) > 0.6 * len(examples)
        short = [len(ids) for ids in inner if len(ids) < max_len]
        # the short target is uniform in [2, max_len - 3]: it is max_len - 3 (a full example) once in 124
        assert within_binomial(len(short), len(inner), short_seq_prob * (1 - 1 / (max_len - 4))), (len(short), len(inner))
        if short:
            assert min(short) >= 5 and abs(np.mean(short) - (2 + max_len - 4) / 2 - 3) < 10
        not_next = sum(e["next_sentence_label"] == NOT_NEXT for e in examples)
        assert within_binomial(not_next, len(examples), nsp_probability), (not_next, len(examples))


def test_build_examples_in_datasets_map_is_independent_of_batching_and_processes():
    docs = datasets.Dataset.from_dict({"sentences": synthetic_corpus(60, seed=3)})
    kwargs = {"documents": DatasetDocuments(docs), "seed": 7, "max_seq_length": 48, "cls_id": CLS, "sep_id": SEP}

    def run(**map_kwargs):
        out = docs.map(build_examples, batched=True, with_indices=True, remove_columns=["sentences"],
                       fn_kwargs=kwargs, load_from_cache_file=False, **map_kwargs)
        return out.to_dict()

    reference = run(batch_size=1000)
    assert reference == run(batch_size=7) == run(batch_size=16, num_proc=2)
    direct = all_examples(docs["sentences"], seed=7, max_seq_length=48, cls_id=CLS, sep_id=SEP)
    assert reference["input_ids"] == [e["input_ids"] for e in direct]


def test_tokenized_corpus_builds_examples(tokenizer, corpus_file, tmp_path):
    raw = datasets.load_dataset("text", data_files={"train": corpus_file}, sample_by="paragraph",
                                cache_dir=str(tmp_path), split="train")
    from pretraining_data import tokenize_documents

    docs = raw.map(tokenize_documents, batched=True, remove_columns=["text"],
                   fn_kwargs={"tokenizer": tokenizer, "text_column": "text", "split_lines": False})
    assert len(docs) == len(DOCUMENTS)
    assert [len(d) for d in docs["sentences"]] == [len(d.split("\n")) for d in DOCUMENTS]
    first = tokenizer(DOCUMENTS[0].split("\n")[0], add_special_tokens=False)["input_ids"]
    assert docs[0]["sentences"][0] == first


# ---------------------------------------------------------------------------------------------------------------------
# Examples -> masked batches
# ---------------------------------------------------------------------------------------------------------------------
def pretraining_features(count: int, seed: int = 0, max_seq_length: int = 64) -> list[dict]:
    """Examples as the builder makes them, over ids of ordinary word pieces (1000..29999), varied lengths."""
    rng = random.Random(seed)
    docs = [[[rng.randrange(1000, 30000) for _ in range(rng.randint(3, 20))] for _ in range(rng.randint(1, 12))]
            for _ in range(count)]
    return all_examples(docs, seed=seed, max_seq_length=max_seq_length, cls_id=CLS, sep_id=SEP)[:count]


def collate_all(collator, features, batch_size=32):
    batches = [collator(features[i:i + batch_size]) for i in range(0, len(features), batch_size)]
    return batches


def test_collator_masks_15_percent_80_10_10_never_special_or_padding(tokenizer):
    collator = DataCollatorForPreTraining(tokenizer, seed=0)
    features = pretraining_features(600)
    originals = {"maskable": 0, "selected": 0, "mask": 0, "random": 0, "kept": 0}
    for start in range(0, len(features), 32):
        chunk = features[start:start + 32]
        batch = collator(chunk)
        B, T = batch["input_ids"].shape
        assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
        assert batch["next_sentence_label"].tolist() == [f["next_sentence_label"] for f in chunk]
        for row, f in enumerate(chunk):
            n = len(f["input_ids"])
            original = torch.tensor(f["input_ids"])
            ids, labels = batch["input_ids"][row], batch["labels"][row]
            assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (T - n)
            assert batch["token_type_ids"][row, :n].tolist() == f["token_type_ids"]
            assert (ids[n:] == tokenizer.pad_token_id).all() and (labels[n:] == -100).all()  # padding untouched
            special = (original == CLS) | (original == SEP)
            assert (labels[:n][special] == -100).all() and torch.equal(ids[:n][special], original[special])
            selected = labels[:n] != -100
            assert torch.equal(labels[:n][selected], original[selected])  # labels are the original ids
            assert torch.equal(ids[:n][~selected], original[~selected])  # nothing else changes
            originals["maskable"] += int((~special).sum())
            originals["selected"] += int(selected.sum())
            picked, before = ids[:n][selected], original[selected]
            originals["mask"] += int((picked == tokenizer.mask_token_id).sum())
            originals["kept"] += int((picked == before).sum())
            originals["random"] += int(((picked != before) & (picked != tokenizer.mask_token_id)).sum())
    n, k = originals["maskable"], originals["selected"]
    assert n > 15000
    assert within_binomial(k, n, 0.15), originals
    # a random replacement can hit the original id or [MASK] with probability 2/30522: negligible here
    assert within_binomial(originals["mask"], k, 0.8), originals
    assert within_binomial(originals["random"], k, 0.1), originals
    assert within_binomial(originals["kept"], k, 0.1), originals


def test_masking_is_fresh_each_epoch_and_reproducible(tokenizer):
    features = pretraining_features(64, seed=1)
    collator = DataCollatorForPreTraining(tokenizer, seed=0)
    first = collator(features)
    # the same example masks alike in another batch, at another padded length
    alone = collator(features[5:6])
    n = len(features[5]["input_ids"])
    assert torch.equal(alone["labels"][0, :n], first["labels"][5, :n])
    assert torch.equal(alone["input_ids"][0, :n], first["input_ids"][5, :n])
    assert torch.equal(DataCollatorForPreTraining(tokenizer, seed=0)(features)["labels"], first["labels"])
    collator.set_epoch(1)
    second = collator(features)
    assert not torch.equal(first["labels"], second["labels"])
    assert not torch.equal(DataCollatorForPreTraining(tokenizer, seed=1)(features)["labels"], first["labels"])
    padded = DataCollatorForPreTraining(tokenizer, pad_to_multiple_of=16)(features)
    assert padded["input_ids"].shape[1] % 16 == 0


def test_masking_epoch_follows_the_trainer_state(tokenizer):
    collator = DataCollatorForPreTraining(tokenizer)
    callback = run_pretraining.MaskingEpochCallback(collator)
    for epoch, expected in ((0.0, 0), (1.0, 1), (1.3333333333333333, 1), (2.999, 2)):  # 1.33: resumed inside epoch 1
        callback.on_epoch_begin(None, transformers.TrainerState(epoch=epoch), None)
        assert collator.epoch == expected


def test_whole_word_masking_masks_every_piece_of_a_word(tokenizer):
    vocab = tokenizer.get_vocab()
    pieces = [i for t, i in vocab.items() if t.startswith("##") and t[2:].isalpha()]
    words = [i for t, i in vocab.items() if t.isalpha() and i >= 1000]
    rng = random.Random(0)
    features, word_lengths = [], []
    for _ in range(400):
        ids, lengths = [CLS], []
        for segment in range(2):
            for _ in range(rng.randint(3, 15)):
                length = rng.choice([1, 1, 2, 3, 4])
                ids += [rng.choice(words)] + [rng.choice(pieces) for _ in range(length - 1)]
                lengths.append(length)
            ids.append(SEP)
        features.append({"input_ids": ids, "token_type_ids": [0] * len(ids), "next_sentence_label": 0})
        word_lengths.append(lengths)
    collator = DataCollatorForPreTraining(tokenizer, whole_word_mask=True, seed=0)
    selected_tokens = total_tokens = 0
    for start in range(0, len(features), 50):
        batch = collator(features[start:start + 50])
        for row, lengths in enumerate(word_lengths[start:start + 50]):
            labels = batch["labels"][row].tolist()
            ids = features[start + row]["input_ids"]
            positions = [p for p, t in enumerate(ids) if t not in (CLS, SEP)]
            i = 0
            for length in lengths:
                word = [labels[p] != -100 for p in positions[i:i + length]]
                assert all(word) or not any(word), f"word split by masking: {word}"
                i += length
            assert all(labels[p] == -100 for p, t in enumerate(ids) if t in (CLS, SEP))
            selected_tokens += sum(labels[p] != -100 for p in positions)
            total_tokens += len(positions)
    # tokens are selected a word at a time: the standard deviation of the selected count is sqrt(p(1-p) sum len^2)
    all_lengths = [l for lengths in word_lengths for l in lengths]
    std = math.sqrt(0.15 * 0.85 * sum(l * l for l in all_lengths))
    assert abs(selected_tokens - 0.15 * total_tokens) <= 4 * std


def test_whole_word_starts_do_not_cross_special_tokens():
    ids = np.array([0, 1, 2, 3, 0, 4, 5, 0])  # 0 plays [CLS]/[SEP]; 2, 3, 4, 5 are ## pieces
    maskable = ids != 0
    is_continuation = np.array([False, False, True, True, True, True])
    starts = whole_word_starts(ids, maskable, is_continuation)
    assert starts.tolist() == [False, True, False, False, False, True, False, False]


# ---------------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------------
def test_mlm_metrics_read_full_and_masked_only_logits():
    torch.manual_seed(0)
    labels = torch.full((3, 5), -100)
    labels[0, 1], labels[1, 3], labels[2, 0], labels[2, 4] = 7, 2, 9, 1
    full = torch.randn(3, 5, 11)
    logits, targets = masked_lm_targets(full, labels)
    assert torch.equal(targets, torch.tensor([7, 2, 9, 1])) and torch.equal(logits, full[labels != -100])
    masked_only, same_targets = masked_lm_targets(logits.clone(), labels)
    assert torch.equal(masked_only, logits) and torch.equal(same_targets, targets)
    with pytest.raises(ValueError):
        masked_lm_targets(torch.randn(3, 11), labels)

    nsp_logits, nsp_labels = torch.randn(3, 2), torch.tensor([0, 1, 1])
    per_layout = []
    for layout in (full, logits):
        token_loss, predictions, nsp = run_pretraining.preprocess_logits_for_metrics((layout, nsp_logits), (labels, nsp_labels))
        eval_pred = transformers.EvalPrediction(
            predictions=(token_loss.numpy(), predictions.numpy(), nsp.numpy()), label_ids=(labels.numpy(), nsp_labels.numpy())
        )
        per_layout.append(run_pretraining.compute_metrics(eval_pred))
    metrics = per_layout[0]
    assert per_layout[0] == pytest.approx(per_layout[1])
    assert metrics["mlm_loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, targets).item(), rel=1e-5)
    assert metrics["mlm_accuracy"] == pytest.approx((logits.argmax(-1) == targets).float().mean().item())
    assert metrics["nsp_loss"] == pytest.approx(torch.nn.functional.cross_entropy(nsp_logits, nsp_labels).item(), rel=1e-5)
    assert metrics["nsp_accuracy"] == pytest.approx((nsp_logits.argmax(-1) == nsp_labels).float().mean().item())


def test_training_tally_is_the_same_for_full_and_masked_only_prediction_logits():
    torch.manual_seed(0)
    config = modeling_bert_impl.BertImplConfig.from_preset("tiny", vocab_size=200)
    model = BertImplForPreTraining(config).eval()
    ids = torch.randint(5, 200, (4, 12))
    labels = torch.where(torch.rand(4, 12) < 0.3, ids, torch.full_like(ids, -100))
    inputs = {"input_ids": ids, "labels": labels, "next_sentence_label": torch.tensor([0, 1, 1, 0])}
    summaries = []
    for sparse in (True, False):
        if hasattr(config, "sparse_prediction"):
            model.config.sparse_prediction = sparse
        tally = run_pretraining.PreTrainingTally()
        with torch.no_grad():
            tally.add(model(**inputs), inputs)
            tally.add(model(**inputs), inputs)
        summaries.append(run_pretraining.PreTrainingTally.summarize(tally.pop()))
        assert tally.pop() is None
    assert summaries[0] == pytest.approx(summaries[1], abs=1e-6)
    with torch.no_grad():
        model.config.sparse_prediction = False
        out = model(**inputs)
    selected = labels != -100
    accuracy = (out.prediction_logits[selected].argmax(-1) == labels[selected]).float().mean().item()
    assert summaries[0]["mlm_accuracy"] == pytest.approx(accuracy)
    assert summaries[0]["mlm_loss"] == pytest.approx(out.mlm_loss.item(), abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# The recipe end to end
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pretraining_reduces_the_loss_and_saves_an_auto_loadable_model(minilm_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    results = run_pretraining.main([
        *PRETRAINING_FLAGS, "--tokenizer_name", minilm_dir, "--train_file", corpus_file, "--validation_split_percentage", "20",
        "--do_train", "--do_eval", "--max_steps", "30", "--learning_rate", "2e-3", "--warmup_steps", "3",
        "--logging_steps", "3", "--save_strategy", "no", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"),
    ])
    logs = training_logs(out)
    assert len(logs) == 10
    for key in ("mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"):
        assert all(key in entry for entry in logs), key
    first, last = logs[0], logs[-1]
    print(f"loss {first['loss']:.3f} -> {last['loss']:.3f}, mlm_loss {first['mlm_loss']:.3f} -> {last['mlm_loss']:.3f}")
    assert last["loss"] < first["loss"] - 2.0
    assert last["mlm_loss"] < first["mlm_loss"] - 2.0
    assert last["mlm_accuracy"] > first["mlm_accuracy"]
    for key in ("eval_loss", "eval_mlm_loss", "eval_nsp_loss", "eval_mlm_accuracy", "eval_nsp_accuracy"):
        assert math.isfinite(results[key]), key
    assert results["eval_mlm_loss"] < math.log(30522) - 1.0  # well below a uniform guess over the vocabulary
    all_results = json.loads((out / "all_results.json").read_text())
    assert all_results["world_size"] == 1 and all_results["train_samples"] > 0

    model = transformers.AutoModelForPreTraining.from_pretrained(out)
    assert type(model) is BertImplForPreTraining
    assert model.config.vocab_size == 30522 and model.config.num_hidden_layers == 2
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer("The bread is done when the crust is deep [MASK].", return_tensors="pt")
    with torch.no_grad():
        assert model(**batch).prediction_logits.shape[-1] == 30522


@pytest.mark.parametrize("units", [None, "AMX"], ids=["cpu_without_bf16_units", "cpu_with_amx"])
def test_the_precision_is_bf16_by_default_on_a_cpu_with_bf16_units_and_the_first_log_lines_name_it(
        minilm_dir, corpus_file, tmp_path, monkeypatch, units, caplog):
    """Pre-training defaults to bfloat16 autocast on a CPU with AMX or AVX512-BF16 and to float32 elsewhere; --bf16
    (true or false) and accelerate's --mixed_precision are kept as given. The log names the precision, the units, and
    where there are none that --bf16 runs slower than float32."""
    monkeypatch.setattr(run_pretraining.common, "cpu_bf16_units", lambda: units)
    flags = [*PRETRAINING_FLAGS, "--tokenizer_name", minilm_dir, "--train_file", corpus_file, "--do_train"]
    cases = [([], units is not None, {}), (["--bf16", "false"], False, {}), (["--bf16=true"], True, {}),
             ([], False, {"ACCELERATE_MIXED_PRECISION": "no"})]
    for run, (given, expected, environ) in enumerate(cases):
        with monkeypatch.context() as patch:
            for name, value in environ.items():
                patch.setenv(name, value)
            training_args = run_pretraining.parse_args([*flags, *given, "--output_dir", str(tmp_path / str(run)),
                                                        "--log_level", "info"])[-1]
        assert training_args.bf16 is expected and training_args.mixed_precision == ("bf16" if expected else "no"), given
        with caplog.at_level("INFO"):
            run_pretraining.common.setup_logging(training_args)
        record = [r for r in caplog.records if r.getMessage().startswith("precision: ")][-1]
        said = record.getMessage()
        # information, logged at INFO; a warning only where bfloat16 runs slower than float32 would
        assert record.levelname == ("WARNING" if expected and not units else "INFO"), said
        if expected and units:
            assert said == f"precision: bfloat16 autocast on the CPU's {units} (--bf16 false for float32)"
        elif expected:
            assert said.startswith("precision: bfloat16 autocast on a CPU without") and "slower than float32" in said
        else:
            assert said == ("precision: float32" + (f" (--bf16 for bfloat16 autocast on the CPU's {units})" if units
                                                    else ""))


@pytest.mark.slow
def test_bf16_training_on_the_cpu_gives_falling_losses_and_a_float32_checkpoint(minilm_dir, corpus_file, tmp_path):
    """--bf16 true on the CPU (its bfloat16 units where it has them, emulated elsewhere): finite, falling losses, and a
    float32 checkpoint that loads and predicts."""
    out = tmp_path / "out"
    run_pretraining.main([
        *PRETRAINING_FLAGS, "--tokenizer_name", minilm_dir, "--train_file", corpus_file, "--bf16", "true",
        "--validation_split_percentage", "0", "--do_train", "--max_steps", "30", "--learning_rate", "2e-3",
        "--warmup_steps", "3", "--logging_steps", "3", "--save_strategy", "no", "--output_dir", str(out),
        "--cache_dir", str(tmp_path / "cache"),
    ])
    losses = [entry["loss"] for entry in training_logs(out)]
    print(f"bf16 loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 2.0
    model = transformers.AutoModelForPreTraining.from_pretrained(out)
    assert model.dtype == torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        out = model(**tokenizer("The bread is done when the crust is [MASK].", return_tensors="pt"))
    assert torch.isfinite(out.prediction_logits).all()


@pytest.mark.slow
def test_torchrun_two_cpu_processes_train_data_parallel(minilm_dir, corpus_file, tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(RECIPES / "run_pretraining.py"), *PRETRAINING_FLAGS, "--tokenizer_name", minilm_dir, "--train_file", corpus_file,
        "--validation_split_percentage", "0", "--do_train", "--max_steps", "3", "--logging_steps", "1",
        "--save_strategy", "no", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "all_results.json").read_text())
    assert results["world_size"] == 2 and results["torch_distributed"] is True
    logs = training_logs(out)
    assert len(logs) == 3 and all(math.isfinite(entry["mlm_loss"]) for entry in logs)


@pytest.mark.slow
def test_resume_from_checkpoint_reproduces_the_uninterrupted_losses(minilm_dir, corpus_file, tmp_path):
    """Run 15 steps with a checkpoint at step 8; resume from it in a fresh Trainer; the logged losses of steps 9..15
    must be those of the uninterrupted run. With ~50 examples, 8 a step, the checkpoint lies inside the second epoch
    (resuming skips that epoch's first batches, masks keyed by epoch 1) and the run goes on into the third."""
    k, n = 8, 15
    common = [
        *PRETRAINING_FLAGS, "--tokenizer_name", minilm_dir, "--train_file", corpus_file, "--validation_split_percentage", "0",
        "--do_train", "--max_steps", str(n), "--logging_steps", "1", "--learning_rate", "1e-3",
        "--cache_dir", str(tmp_path / "cache"),
    ]
    full = tmp_path / "full"
    run_pretraining.main([*common, "--output_dir", str(full), "--save_strategy", "steps", "--save_steps", str(k)])
    checkpoint = full / f"checkpoint-{k}"
    assert (checkpoint / "model.safetensors").exists()
    resumed = tmp_path / "resumed"
    run_pretraining.main([*common, "--output_dir", str(resumed), "--save_strategy", "no",
                          "--resume_from_checkpoint", str(checkpoint)])
    reference = {entry["step"]: entry for entry in training_logs(full)}
    after = [entry for entry in training_logs(resumed) if entry["step"] > k]
    assert [entry["step"] for entry in after] == list(range(k + 1, n + 1))
    assert 1.0 < reference[k]["epoch"] < 2.0 < reference[n]["epoch"]
    worst = 0.0
    for entry in after:
        for key in ("loss", "mlm_loss", "nsp_loss", "grad_norm", "mlm_accuracy", "nsp_accuracy"):
            worst = max(worst, abs(entry[key] - reference[entry["step"]][key]))
    print(f"largest difference after resuming: {worst:.2e}")
    assert worst <= 1e-6
    # all_results.json's train_loss is the whole run's mean (it was that of steps 9..15 only)
    train_loss = {name: json.loads((folder / "all_results.json").read_text())["train_loss"]
                  for name, folder in (("resumed", resumed), ("full", full))}
    assert abs(train_loss["resumed"] - train_loss["full"]) <= 1e-6, train_loss
