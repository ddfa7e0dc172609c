"""`PreemptionCallback` in a user's own `Trainer` script (not a recipe), in this process, with real signals sent to
it: a signal during a step, during an evaluation and before training; what the recipes add to it (the signal flag,
`--resume_from_checkpoint auto`, resuming on another number of processes) on their arguments. The recipes stopped by
signals as real processes, alone and under torchrun, are in test_preemption_runs.py and test_preemption_nodes.py."""

import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from modeling_bert_impl import BertImplConfig, BertImplForSequenceClassification
from modeling_bert_impl.integrations.preemption import PREEMPTED_EXIT_STATUS, PreemptionCallback, parse_signals

from helpers import TINY

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
sys.path.insert(0, str(RECIPES))

import checkpoints  # noqa: E402
import common  # noqa: E402


def rows(n: int = 24) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, TINY["vocab_size"], (n, 8), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones(8, dtype=torch.long), "labels": int(row[0] % 2)}
            for row in ids]


class SignalAt(TrainerCallback):
    """Sends `number` to this process at the start of step `step` (or during the first evaluation batch)."""

    def __init__(self, number: int, step: int | None = None, in_evaluation: bool = False):
        self.number, self.step, self.in_evaluation, self.sent = number, step, in_evaluation, False

    def send(self):
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.number)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self.send()

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.in_evaluation:
            self.send()


def trainer(out: Path, *callbacks, **overrides) -> Trainer:
    torch.manual_seed(0)
    model = BertImplForSequenceClassification(BertImplConfig(**{**TINY, "hidden_dropout_prob": 0.1}, num_labels=2))
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=10, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, **overrides)
    data = rows()
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8], callbacks=list(callbacks))


def losses(log_history: list[dict]) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in log_history if "loss" in entry}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    run = trainer(tmp_path_factory.mktemp("uninterrupted"))
    run.train()
    return losses(run.state.log_history)


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_during_a_step_saves_that_step_stops_and_the_resumed_run_has_the_same_losses(
        number, uninterrupted, tmp_path, caplog):
    out = tmp_path / "out"
    before = signal.getsignal(number)
    run = trainer(out, PreemptionCallback(), SignalAt(number, step=4))
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as stopped:
        run.train()
        run.save_model()  # what the user's script does after train(): never reached
    assert stopped.value.code == PREEMPTED_EXIT_STATUS
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4"]  # no final model beside it
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()
    assert signal.getsignal(number) == before  # the handlers are given back
    said = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert said == [f"preempted ({number.name}) at step 4: saved {out / 'checkpoint-4'}. Resume: "
                    f"trainer.train(resume_from_checkpoint={str(out / 'checkpoint-4')!r})"]

    resumed = trainer(out, PreemptionCallback())
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert losses(resumed.state.log_history) == uninterrupted  # the same process, CPU, float32: bitwise


def test_transformers_jit_checkpoint_is_taken_over(uninterrupted, tmp_path):
    """With --enable_jit_checkpoint too: the callback's handler, not transformers' (which waits 3 s and lets train()
    return as if finished), so the run still stops with the preempted status and one checkpoint of that step."""
    out = tmp_path / "out"
    run = trainer(out, PreemptionCallback(), SignalAt(signal.SIGTERM, step=3), enable_jit_checkpoint=True)
    with pytest.raises(SystemExit) as stopped:
        run.train()
    assert stopped.value.code == PREEMPTED_EXIT_STATUS
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]


def test_a_signal_during_evaluation_saves_that_step_once_the_evaluation_ends(tmp_path):
    out = tmp_path / "out"
    run = trainer(out, PreemptionCallback(), SignalAt(signal.SIGUSR1, in_evaluation=True), eval_strategy="steps",
                  eval_steps=3)
    with pytest.raises(SystemExit) as stopped:
        run.train()
    assert stopped.value.code == PREEMPTED_EXIT_STATUS
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "eval_loss" in e] == [3]  # the evaluation itself finished


def test_a_signal_before_training_stops_at_its_start_with_nothing_to_save(tmp_path, caplog):
    """A signal while the data is prepared (after the callback is made, before train())."""
    out = tmp_path / "out"
    callback = PreemptionCallback("SIGTERM")
    os.kill(os.getpid(), signal.SIGTERM)
    run = trainer(out, callback)
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as stopped:
        run.train()
    assert stopped.value.code == PREEMPTED_EXIT_STATUS
    assert not out.exists() or not any(out.iterdir())
    assert any("nothing to save: stopped before step 1" in r.getMessage() for r in caplog.records)


def test_signal_names():
    assert parse_signals("SIGTERM,SIGUSR1") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals(" term , usr1,TERM") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("none") == ()
    for bad in ("SIGKILL", "SIGTERN"):
        with pytest.raises(ValueError, match=f"{bad} is not a signal a process can catch"):
            parse_signals(bad)


def recipe_args(out: Path, **fields) -> common.RecipeTrainingArguments:
    return common.RecipeTrainingArguments(output_dir=str(out), do_train=True, use_cpu=True, report_to="none",
                                          **fields)


def test_the_signal_flag_and_jit_checkpoint_choose_the_signals(tmp_path):
    callbacks = checkpoints.preemption(recipe_args(tmp_path, save_on_signal="SIGUSR1"), "run_glue.py", ["--x", "1"])
    try:
        assert callbacks[0].signals == (signal.SIGUSR1,)
        assert callbacks[0].resume == "python recipes/run_glue.py --x 1 --resume_from_checkpoint auto"
    finally:
        callbacks[0].restore()
    assert checkpoints.preemption(recipe_args(tmp_path, save_on_signal="none"), "run_glue.py", []) == []
    callbacks = checkpoints.preemption(recipe_args(tmp_path, save_on_signal="none", enable_jit_checkpoint=True),
                                       "run_glue.py", [])
    callbacks[0].restore()
    assert callbacks[0].signals == (signal.SIGTERM,)
    with pytest.raises(ValueError, match="--save_on_signal 'SIGFOO': SIGFOO is not a signal"):
        checkpoints.prepare_run(recipe_args(tmp_path, save_on_signal="SIGFOO"))


def test_the_resume_command_replaces_the_resume_flag_and_hides_secrets():
    argv = ["--output_dir", "o", "--resume_from_checkpoint", "o/checkpoint-2", "--hub_token", "hf_abcdefghijkl",
            "--resume_from_checkpoint=last"]
    assert checkpoints.resume_command("/x/run_ner.py", argv) == \
        "python recipes/run_ner.py --output_dir o --hub_token REDACTED --resume_from_checkpoint auto"


def write_checkpoint(out: Path, step: int, **position) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({}, folder / name)
    state = {"global_step": step, "stateful_callbacks": {"DataPosition": {"args": {}, "attributes": position}}}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def test_resume_auto_starts_resumes_or_leaves_a_finished_run_alone(tmp_path, caplog):
    out = tmp_path / "out"
    args = recipe_args(out, resume_from_checkpoint="auto")
    with caplog.at_level(logging.WARNING):
        checkpoints.prepare_run(args)
    assert args.resume_from_checkpoint is None
    assert "no checkpoint in" in caplog.text and "training from the beginning" in caplog.text

    (out / checkpoints.STAGING_DIR).mkdir(parents=True)  # what a kill during the first save leaves
    checkpoints.prepare_run(args := recipe_args(out, resume_from_checkpoint="auto"))
    assert args.resume_from_checkpoint is None

    position = dict(processes=1, per_device=8, accumulation=1)
    write_checkpoint(out, 2, **position)
    newest = write_checkpoint(out, 4, **position)
    checkpoints.prepare_run(args := recipe_args(out, resume_from_checkpoint="AUTO", per_device_train_batch_size=8))
    assert args.resume_from_checkpoint == str(newest)

    with pytest.raises(ValueError, match="auto continues the run in --output_dir, --overwrite_output_dir deletes it"):
        checkpoints.prepare_run(recipe_args(out, resume_from_checkpoint="auto", overwrite_output_dir=True))

    (out / "train_results.json").write_text("{}")
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as finished:
        checkpoints.prepare_run(recipe_args(out, resume_from_checkpoint="auto"))
    assert finished.value.code == 0 and "holds a finished run" in caplog.text


def test_resuming_with_another_batch_per_step_is_refused_with_the_flag_that_keeps_it(tmp_path, caplog):
    """A checkpoint of 2 processes x 4 x 1 (8 samples a step) on this 1 process: 4 x 2 is the same batch and goes on
    (said); 4 x 1 would resume at another sample and is refused, naming the flags that keep 8."""
    written = write_checkpoint(tmp_path, 6, processes=2, per_device=4, accumulation=1)
    with caplog.at_level(logging.WARNING):
        checkpoints.prepare_run(recipe_args(tmp_path, resume_from_checkpoint=str(written),
                                            per_device_train_batch_size=4, gradient_accumulation_steps=2))
    assert "this run takes 1 x 4 x 2, the same 8 a step: it goes on from sample 48" in caplog.text
    with pytest.raises(ValueError) as refused:
        checkpoints.prepare_run(recipe_args(tmp_path, resume_from_checkpoint=str(written),
                                            per_device_train_batch_size=4))
    said = str(refused.value)
    assert "written by 2 process(es) x 4 per device x 1 accumulation step(s) = 8 samples a step, at sample 48" in said
    assert "this run would take 1 x 4 x 1 = 4" in said
    assert "pass --gradient_accumulation_steps 2 or --per_device_train_batch_size 8 to keep 8" in said
    with pytest.raises(ValueError, match="no per-device batch and accumulation steps make 8 on 3 process"):
        checkpoints.check_position(str(written), type("Args", (), dict(world_size=3, per_device_train_batch_size=4,
                                                                        gradient_accumulation_steps=1))())
