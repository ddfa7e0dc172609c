"""Pre-training as people run it today (issue 36): the MLM-only objective on full windows (`--objective mlm`), windows
that attend within their documents (`--document_attention`), length phases in one run (`--phases`), a wall-clock
budget (`--time_budget`) and the logs' throughput fields. Small corpora written here, CPU, the tiny preset.

Statistical checks allow 4 standard deviations of the binomial count (deterministic seeds)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import modeling_bert_impl  # noqa: F401  (registers bert_impl with the Auto classes)
from modeling_bert_impl import BertImplConfig, BertImplForMaskedLM, BertImplForSequenceClassification

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(RECIPES))

import run_glue  # noqa: E402
import run_pretraining  # noqa: E402
from pretraining_data import DataCollatorForPreTraining, build_windows, document_positions  # noqa: E402
from recipe_data import DOCUMENTS, PRETRAINING_FLAGS, synthetic_corpus, training_logs, within_binomial  # noqa: E402

CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return run_pretraining.load_tokenizer(run_pretraining.ModelArguments(tokenizer_name=minilm_dir))


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> str:
    """The 12 documents of test_pretraining, in the BERT file format (a sentence a line, blank lines between)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(DOCUMENTS) + "\n")
    return str(path)


def recipe_args(minilm_dir, corpus_file, tmp_path, *extra) -> list[str]:
    return [*PRETRAINING_FLAGS, "--tokenizer_name", minilm_dir, "--train_file", corpus_file, "--cache_dir",
            str(tmp_path / "cache"), "--objective", "mlm", *map(str, extra)]


# ---------------------------------------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------------------------------------
def test_windows_are_full_contiguous_text_with_sep_after_each_document():
    docs = synthetic_corpus(40, seed=5)  # token ids unique and increasing through the corpus
    stream = [t for doc in docs for t in [*(t for s in doc for t in s), SEP]]
    windows = build_windows({"sentences": docs}, max_seq_length=48, cls_id=CLS, sep_id=SEP)["input_ids"]
    assert len(windows) == len(stream) // 47 > 20
    assert all(len(w) == 48 and w[0] == CLS and CLS not in w[1:] for w in windows)
    assert [t for w in windows for t in w[1:]] == stream[:47 * len(windows)]  # the stream, in order, cut every 47
    ends = [i for i, t in enumerate(stream) if t == SEP]
    assert [stream[i - 1] for i in ends] == [doc[-1][-1] for doc in docs]  # a [SEP] after each document's last token


def test_document_positions_restart_at_each_window_and_after_each_sep():
    ids = np.array([[CLS, 5, 6, SEP, 7, 8, 9, SEP], [CLS, SEP, 4, 4, 4, 4, SEP, 3]])
    assert document_positions(ids, SEP).tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 0]]


def test_mlm_windows_of_a_corpus_file_have_no_padding_and_the_masked_share_is_mlm_probability(
        tokenizer, corpus_file, tmp_path):
    data_args = run_pretraining.DataTrainingArguments(
        train_file=[corpus_file], objective="mlm", max_seq_length=32, validation_split_percentage=0)
    model_args = run_pretraining.ModelArguments(cache_dir=str(tmp_path))
    raw, split_lines = run_pretraining.load_raw_datasets(data_args, model_args)
    windows = run_pretraining.prepare_examples(raw["train"], tokenizer, data_args, 0, split_lines, "train")
    lines = [line for doc in DOCUMENTS for line in doc.split("\n")]
    tokens = sum(len(ids) for ids in tokenizer(lines, add_special_tokens=False)["input_ids"])
    assert len(windows) == (tokens + len(DOCUMENTS)) // 31  # every token and each document's [SEP], cut every 31
    assert set(windows.column_names) == {"input_ids"}
    rows = windows["input_ids"]
    assert all(len(r) == 32 and r[0] == tokenizer.cls_token_id for r in rows)
    assert sum(r.count(tokenizer.sep_token_id) for r in rows) >= len(DOCUMENTS) - 1  # documents end inside windows
    for probability, whole_words in ((0.3, False), (0.15, False), (0.3, True)):
        collator = DataCollatorForPreTraining(tokenizer, mlm_probability=probability, whole_word_mask=whole_words)
        selected = maskable = 0
        for epoch in range(8):  # fresh masks each epoch: more draws
            collator.set_epoch(epoch)
            batch = collator([{"input_ids": r} for r in rows])
            assert batch["input_ids"].shape == (len(rows), 32) and bool(batch["attention_mask"].all())  # no padding
            assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels"}  # no NSP label
            special = torch.isin(torch.tensor(rows), torch.tensor([tokenizer.cls_token_id, tokenizer.sep_token_id]))
            assert bool((batch["labels"][special] == -100).all())
            selected += int((batch["labels"] != -100).sum())
            maskable += int((~special).sum())
        if whole_words:  # words are drawn, not tokens: a looser check (a word is about 1.2 pieces here)
            assert abs(selected / maskable - probability) < 0.03, (selected, maskable)
        else:
            assert within_binomial(selected, maskable, probability), (probability, selected, maskable)


def test_mlm_windows_of_several_files_are_those_of_the_files_joined(tokenizer, corpus_file, tmp_path):
    parts = [tmp_path / "part-1.txt", tmp_path / "part-2.txt"]
    parts[0].write_text("\n\n".join(DOCUMENTS[:5]) + "\n")
    parts[1].write_text("\n\n".join(DOCUMENTS[5:]) + "\n")

    def windows(files):
        data_args = run_pretraining.DataTrainingArguments(
            train_file=files, objective="mlm", max_seq_length=24, validation_split_percentage=0)
        model_args = run_pretraining.ModelArguments(cache_dir=str(tmp_path / "cache"))
        raw, split_lines = run_pretraining.load_raw_datasets(data_args, model_args)
        windows = run_pretraining.prepare_examples(raw["train"], tokenizer, data_args, 0, split_lines, "train")
        return windows["input_ids"]

    assert windows([str(tmp_path / "part-*.txt")]) == windows([corpus_file])


def test_packed_windows_attend_within_documents_only():
    """A window packed by document gives each document's tokens the outputs of that document run alone, from
    position 0; without --document_attention the window attends across (different outputs)."""
    torch.manual_seed(0)
    model = BertImplForMaskedLM(BertImplConfig.from_preset("tiny", vocab_size=300)).eval()
    # the first window ends on a document's first token: a one-token document followed by the next window's [CLS]
    windows = torch.tensor([[CLS, 50, 51, 52, 53, 54, SEP, 60, 61, 62, SEP, 70],
                            [CLS, 20, 21, 22, SEP, 30, 31, SEP, 40, 41, 42, 43]])
    positions = torch.from_numpy(document_positions(windows.numpy(), SEP))
    packed = run_pretraining.pack_documents({"input_ids": windows, "position_ids": positions,
                                             "labels": torch.full_like(windows, -100)})
    del packed["labels"]
    with torch.no_grad():
        got = model(**packed).logits.reshape(2, 12, -1)
        across = model(input_ids=windows).logits
        for row in range(2):
            starts = [i for i in range(12) if positions[row, i] == 0] + [12]
            for start, end in zip(starts, starts[1:]):
                alone = model(input_ids=windows[row:row + 1, start:end]).logits[0]
                torch.testing.assert_close(got[row, start:end], alone, atol=1e-5, rtol=1e-5)
    assert (across - got).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [("90s", 90), ("45m", 2700), ("2h", 7200), ("1h30m", 5400), ("1.5h", 5400),
                                           (" 20S ", 20)])
def test_time_budget_strings(text, seconds):
    assert run_pretraining.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["90", "2 hours", "h", "", "-5s", "0s", "1d"])
def test_bad_time_budget_is_a_value_error_naming_the_flag(text):
    with pytest.raises(ValueError, match="--time_budget"):
        run_pretraining.RunArguments(time_budget=text)


def test_phases_parse_and_bad_phases_are_value_errors():
    Phase = run_pretraining.Phase
    assert run_pretraining.parse_phases("128:0.9,512:0.1") == [Phase(128, 0.9), Phase(512, 0.1)]
    assert run_pretraining.parse_phases("64:0.5:32, 128:0.25, 256:0.25:8")[2] == Phase(256, 0.25, 8)
    for bad, message in (("128:0.9,512:0.2", "sum to 1.1"), ("128:0.9;512:0.1", "not LENGTH:FRACTION"),
                         ("128", "not LENGTH:FRACTION"), ("128:1.5,512:-0.5", "fraction in"), ("0:1", "positive")):
        with pytest.raises(ValueError, match=message) as error:
            run_pretraining.DataTrainingArguments(train_file=["x"], phases=bad)
        assert "--phases" in str(error.value)
    assert run_pretraining.phase_steps(run_pretraining.parse_phases("128:0.9,512:0.1"), 1000) == [900, 100]
    assert run_pretraining.phase_steps(run_pretraining.parse_phases("8:0.33,16:0.33,32:0.34"), 10) == [3, 4, 3]
    with pytest.raises(ValueError, match="gets no step"):
        run_pretraining.phase_steps(run_pretraining.parse_phases("128:0.99,512:0.01"), 10)


def test_unknown_objective_and_document_attention_without_mlm_are_value_errors():
    with pytest.raises(ValueError, match="--objective 'nsp'"):
        run_pretraining.DataTrainingArguments(train_file=["x"], objective="nsp")
    with pytest.raises(ValueError, match="--document_attention needs --objective mlm"):
        run_pretraining.DataTrainingArguments(train_file=["x"], document_attention=True)
    with pytest.raises(ValueError, match="--peak_tflops"):
        run_pretraining.RunArguments(peak_tflops=0)


def test_flop_count_and_peak_table_are_the_gpu_checks():
    sys.path.insert(0, str(BENCHMARKS))
    import bench_model

    config = BertImplConfig.from_preset("mini", vocab_size=1000)
    lengths, masked = [32, 20, 7], 9
    ours = run_pretraining.model_flops(config, sum(lengths), sum(t * t for t in lengths), masked, len(lengths))
    assert ours == bench_model.model_flops(config, lengths, masked)
    assert run_pretraining.DATASHEET_BF16_PEAK == bench_model.DATASHEET_BF16_PEAK
    mask = torch.zeros(3, 32, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    tokens, squares = run_pretraining.attention_spans({"input_ids": torch.ones(3, 32, dtype=torch.long),
                                                       "attention_mask": mask})
    assert (tokens.item(), squares.item()) == (59, 32 * 32 + 20 * 20 + 7 * 7)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    tokens, squares = run_pretraining.attention_spans({"input_ids": torch.ones(1, 9, dtype=torch.long),
                                                       "position_ids": positions})
    assert (tokens.item(), squares.item()) == (9, 9 + 4 + 16)
    assert run_pretraining.peak_flops(torch.device("cpu"), None) is None
    assert run_pretraining.peak_flops(torch.device("cpu"), 2.5) == 2.5e12


def test_budget_progress_bar_counts_the_budget(tmp_path):
    """With --time_budget the progress bar's total is the budget in seconds (it read 15/1000000000 steps, with an ETA
    of a million hours): its count is the seconds spent (a resumed run's included), and it shows the step and the
    time the budget ends."""
    budget = run_pretraining.TimeBudget(60.0)
    args = transformers.TrainingArguments(tmp_path, report_to=[], use_cpu=True, max_steps=10**9)
    model = BertImplForMaskedLM(BertImplConfig.from_preset("tiny", vocab_size=99))
    trainer = run_pretraining.PreTrainingTrainer(model=model, args=args, budget=budget)
    progress = transformers.trainer_callback.ProgressCallback
    bars = [c for c in trainer.callback_handler.callbacks if isinstance(c, progress)]
    assert [type(bar) for bar in bars] == [run_pretraining.BudgetProgress]
    bar, state = bars[0], transformers.TrainerState(max_steps=10**9, global_step=0)
    budget.spent_before = 12.0  # a resumed run
    bar.on_train_begin(args, state, None)
    assert (bar.training_bar.total, bar.training_bar.n) == (60, 12)
    budget.measured, state.global_step = 27.4, 15
    bar.on_step_end(args, state, None)
    assert bar.training_bar.n == 27 and "step 15, ends " in str(bar.training_bar)
    bar.on_train_end(args, state, None)
    without = run_pretraining.PreTrainingTrainer(model=model, args=args)
    assert [type(c) for c in without.callback_handler.callbacks if isinstance(c, progress)] == [progress]


def test_time_budget_resumes_with_the_time_spent(tmp_path):
    budget = run_pretraining.TimeBudget(100.0, step_limit=50)
    saved = run_pretraining.TimeBudget(100.0, step_limit=50)
    saved.spent_before = 40.0
    transformers.TrainerState(stateful_callbacks=[saved]).save_to_json(tmp_path / "trainer_state.json")
    state = transformers.TrainerState.load_from_json(tmp_path / "trainer_state.json")  # as a resumed run loads it
    budget.on_train_begin(None, state, None)
    assert budget.measured == pytest.approx(40.0) and budget.progress(0) == pytest.approx(0.4)
    assert budget.progress(45) == pytest.approx(0.9)  # the steps, when they are further along
    fresh = run_pretraining.TimeBudget(100.0)
    fresh.on_train_begin(None, transformers.TrainerState(stateful_callbacks=[fresh]), None)
    assert fresh.measured == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# The recipe end to end
# ---------------------------------------------------------------------------------------------------------------------
POSITIVE = ["great", "wonderful", "excellent", "delightful", "lovely", "superb"]
NEGATIVE = ["awful", "terrible", "horrible", "dreadful", "boring", "poor"]
THINGS = ["movie", "food", "service", "hotel", "book", "concert", "show", "trip"]


@pytest.mark.slow
def test_mlm_objective_saves_a_masked_lm_that_run_glue_fine_tunes(minilm_dir, corpus_file, tmp_path):
    out = tmp_path / "mlm"
    results = run_pretraining.main(recipe_args(
        minilm_dir, corpus_file, tmp_path, "--max_seq_length", 32, "--mlm_probability", 0.3,
        "--validation_split_percentage", 20, "--do_train", "--do_eval", "--max_steps", 12, "--learning_rate", 2e-3,
        "--logging_steps", 3, "--save_strategy", "no", "--output_dir", out))
    logs = training_logs(out)
    assert len(logs) == 4
    for entry in logs:
        assert entry["seq_length"] == 32 and entry["tokens_per_second"] > 0 and math.isfinite(entry["mlm_loss"])
        assert "nsp_loss" not in entry and "nsp_accuracy" not in entry and "mfu" not in entry  # CPU: no peak known
    assert logs[-1]["mlm_loss"] < logs[0]["mlm_loss"]
    assert math.isfinite(results["eval_mlm_loss"]) and "eval_nsp_loss" not in results
    n = results["train_samples"]  # windows: each epoch takes them all, the last batch of an epoch is smaller
    sizes = [min(8, n - 8 * (step % math.ceil(n / 8))) for step in range(12)]
    assert results["train_tokens"] == sum(sizes) * 32  # every token of a window is real
    assert results["train_tokens_per_second"] == pytest.approx(results["train_tokens"] / results["train_runtime"])
    model = transformers.AutoModelForMaskedLM.from_pretrained(out)
    assert type(model) is BertImplForMaskedLM and not hasattr(model, "nsp_head")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertImplForMaskedLM"]

    rows = [(f"the {thing} was {word} .", label) for thing in THINGS for words, label in ((POSITIVE, 1), (NEGATIVE, 0))
            for word in words]
    (tmp_path / "train.csv").write_text("sentence,label\n" + "".join(f"{s},{l}\n" for s, l in rows))
    glue = tmp_path / "glue"
    trainer = run_glue.main(["--model_name_or_path", str(out), "--train_file", str(tmp_path / "train.csv"),
                             "--validation_file", str(tmp_path / "train.csv"), "--output_dir", str(glue),
                             "--do_train", "--do_eval", "--max_seq_length", "16", "--num_train_epochs", "1",
                             "--per_device_train_batch_size", "16", "--use_cpu", "--report_to", "none",
                             "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0"])
    assert type(trainer.model) is BertImplForSequenceClassification
    glue_results = json.loads((glue / "all_results.json").read_text())
    assert math.isfinite(glue_results["train_loss"]) and 0.0 <= glue_results["eval_accuracy"] <= 1.0
    # the classifier started from the pre-trained encoder: the layers it did not train are the pre-trained ones
    pretrained = model.bert.state_dict()
    fine_tuned = transformers.AutoModelForSequenceClassification.from_pretrained(glue).bert.state_dict()
    assert pretrained.keys() <= fine_tuned.keys()
    positions = "embeddings.position_embeddings.weight"
    assert not torch.equal(pretrained[positions][:16], fine_tuned[positions][:16])  # trained
    assert torch.equal(pretrained[positions][16:], fine_tuned[positions][16:])  # rows no 16-token input reaches


@pytest.mark.slow
def test_streaming_mlm_with_document_attention_and_whole_words(minilm_dir, corpus_file, tmp_path):
    out = tmp_path / "stream"
    run_pretraining.main(recipe_args(
        minilm_dir, corpus_file, tmp_path, "--max_seq_length", 32, "--streaming", "--document_attention",
        "--whole_word_masking", "--do_train", "--max_steps", 4, "--logging_steps", 2, "--save_strategy", "no",
        "--peak_tflops", 1, "--output_dir", out))
    logs = training_logs(out)
    assert len(logs) == 2 and all(e["seq_length"] == 32 and e["tokens_per_second"] > 0 for e in logs)
    # mfu x peak / tokens/s: the FLOPs a token, between the layers' alone and with attention over the whole window and
    # the MLM head on every token
    config = BertImplConfig.from_preset("tiny", vocab_size=30522)
    L, H, I, V = config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size
    layers = 6 * L * (4 * H * H + 2 * H * I)
    for entry in logs:
        per_token = entry["mfu"] * 1e12 / entry["tokens_per_second"]
        assert layers < per_token < layers + 12 * L * H * 32 + 6 * (H * H + H * V), entry
    assert type(transformers.AutoModelForMaskedLM.from_pretrained(out)) is BertImplForMaskedLM


@pytest.mark.slow
def test_phases_switch_length_at_their_step_and_resume_in_phase_two_exactly(minilm_dir, corpus_file, tmp_path):
    """16 tokens x 8 for steps 1-5, then 32 tokens x 4 for steps 6-10, one linear schedule; a checkpoint at step 7 (in
    phase 2) resumed in a fresh run gives steps 8-10 the uninterrupted run's losses."""
    common = recipe_args(minilm_dir, corpus_file, tmp_path, "--phases", "16:0.5,32:0.5:4", "--do_train",
                         "--validation_split_percentage", 0, "--max_steps", 10, "--logging_steps", 1,
                         "--learning_rate", 1e-3, "--warmup_steps", 2, "--document_attention")
    full = tmp_path / "full"
    run_pretraining.main([*common, "--output_dir", str(full), "--save_strategy", "steps", "--save_steps", "7"])
    logs = training_logs(full)
    assert [e["step"] for e in logs] == list(range(1, 11))
    assert [e["seq_length"] for e in logs] == [16] * 5 + [32] * 5
    rates = [e["learning_rate"] for e in logs]  # one warm-up and one linear decay over both phases
    np.testing.assert_allclose(rates, [1e-3 * (k / 2 if k < 2 else (10 - k) / 8) for k in range(10)], rtol=1e-6)
    resumed = tmp_path / "resumed"
    run_pretraining.main([*common, "--output_dir", str(resumed), "--save_strategy", "no",
                          "--resume_from_checkpoint", str(full / "checkpoint-7")])
    reference = {e["step"]: e for e in logs}
    after = [e for e in training_logs(resumed) if e["step"] > 7]
    assert [e["step"] for e in after] == [8, 9, 10]
    worst = max(abs(e[key] - reference[e["step"]][key]) for e in after
                for key in ("loss", "mlm_loss", "grad_norm", "mlm_accuracy", "learning_rate"))
    print(f"largest difference after resuming in phase 2: {worst:.2e}")
    assert worst <= 1e-6


@pytest.mark.slow
def test_max_steps_before_the_budget_ends_the_run_with_the_schedule_at_its_end(minilm_dir, corpus_file, tmp_path):
    out = tmp_path / "steps_first"
    run_pretraining.main(recipe_args(
        minilm_dir, corpus_file, tmp_path, "--max_seq_length", 32, "--validation_split_percentage", 0, "--do_train",
        "--time_budget", "1h", "--max_steps", 6, "--warmup_steps", 2, "--logging_steps", 1, "--save_strategy", "no",
        "--lr_scheduler_type", "polynomial", "--lr_scheduler_kwargs", '{"lr_end": 1e-5}', "--learning_rate", 1e-3,
        "--output_dir", out))
    rates = [e["learning_rate"] for e in training_logs(out)]  # the rate each step trained with
    expected = [0.0, 5e-4, 1e-3] + [1e-3 - (1e-3 - 1e-5) * k / 4 for k in (1, 2, 3)]  # the step schedule
    np.testing.assert_allclose(rates, expected, rtol=1e-5)


@pytest.mark.slow
def test_time_budget_ends_the_run_on_time_with_the_schedule_at_its_end_and_a_loadable_checkpoint(
        minilm_dir, corpus_file, tmp_path, caplog):
    """A 20 s budget (the issue's 60 s case was checked by hand, see the commit): training time within 15%, the
    schedule at its end value in the final checkpoint's scheduler, which resumes and loads; the log estimates the
    steps the budget holds."""
    budget, lr_end = 20.0, 1e-5
    out = tmp_path / "budget"
    results = run_pretraining.main(recipe_args(
        minilm_dir, corpus_file, tmp_path, "--max_seq_length", 32, "--validation_split_percentage", 20, "--do_train",
        "--do_eval", "--time_budget", f"{budget:g}s", "--warmup_steps", 0.1, "--logging_steps", 1,
        "--lr_scheduler_type", "polynomial", "--lr_scheduler_kwargs", json.dumps({"lr_end": lr_end}),
        "--learning_rate", 1e-3, "--save_strategy", "steps", "--save_steps", 100000, "--output_dir", out))
    print(f"train_runtime {results['train_runtime']:.2f} s, budget spent {results['train_budget_seconds_spent']:.2f} s")
    assert "ends at the time budget, after about " in caplog.text
    assert abs(results["train_runtime"] - budget) <= 0.15 * budget
    assert abs(results["train_budget_seconds_spent"] - budget) <= 0.15 * budget
    assert math.isfinite(results["eval_mlm_loss"])
    step = training_logs(out)[-1]["step"]
    checkpoint = out / f"checkpoint-{step}"  # written when the budget ran out
    scheduler = torch.load(checkpoint / "scheduler.pt", weights_only=False)
    assert scheduler["_last_lr"] == pytest.approx([lr_end] * len(scheduler["_last_lr"]), rel=1e-9)  # each group
    rates = [e["learning_rate"] for e in training_logs(out)]  # each step's: up over 10% of the time, then down
    top = int(np.argmax(rates))
    # The peak comes after 10% of the time, which is a fraction of the steps only as steady as their times are: a loaded
    # machine put it at step 16 of 37 once.
    assert 0.9e-3 < rates[top] <= 1e-3 and 0.02 < top / len(rates) < 0.5, (top, len(rates))
    assert all(a <= b for a, b in zip(rates[:top], rates[1:top + 1]))
    assert all(a >= b for a, b in zip(rates[top:], rates[top + 1:]))
    # The last step lands within a step or two of the budget's end: the rate is near lr_end, by at most two steps'
    # worth of decay (a slow machine fits fewer steps into the budget, each a larger decrement).
    decrement = (rates[top] - lr_end) / (len(rates) - top)
    assert rates[-1] - lr_end < max(0.05 * 1e-3, 2 * decrement), (rates[-1], decrement, len(rates))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["TimeBudget"]["attributes"]["spent_before"] >= budget
    model = transformers.AutoModelForMaskedLM.from_pretrained(checkpoint)
    assert type(model) is BertImplForMaskedLM


@pytest.mark.slow
def test_torchrun_two_cpu_processes_train_phases_data_parallel(minilm_dir, corpus_file, tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(RECIPES / "run_pretraining.py"), *recipe_args(minilm_dir, corpus_file, tmp_path),
        "--phases", "16:0.5,32:0.5:4", "--document_attention", "--validation_split_percentage", "0", "--do_train",
        "--max_steps", "4", "--logging_steps", "1", "--save_strategy", "no", "--output_dir", str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "all_results.json").read_text())
    assert results["world_size"] == 2
    logs = training_logs(out)
    assert [e["seq_length"] for e in logs] == [16, 16, 32, 32]
    # tokens of both processes: 2 x 8 x 16 a step, then 2 x 4 x 32 (tokens/s x the interval is not logged: the ratio
    # of the two phases' rates is not asserted, only that both processes count)
    assert all(e["tokens_per_second"] > 0 for e in logs)
    assert "estimated time remaining" in proc.stdout + proc.stderr
