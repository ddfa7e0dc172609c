"""A user's earlier work survives the accidents that really happen, with run_glue.py run as real processes on a tiny
bert-impl model (2 layers, H=128) and MiniLM's tokenizer:

- a second run into the same --output_dir is refused and leaves the first run's checkpoints untouched;
  --overwrite_output_dir replaces them without leaving a mix of two runs;
- a run SIGKILLed while writing a checkpoint leaves no half-written checkpoint-N: `--resume_from_checkpoint last` takes
  the newest complete one and logs the same losses as the uninterrupted run.

The kill is deterministic: a wrapper script pauses the save of one step after part of the checkpoint is written
(model, optimizer, random state; trainer_state.json not yet), writes a sentinel file, and the test kills it then.

run_ner.py, run_qa.py and run_swag.py resume the same way (`--resume_from_checkpoint last` or `True`), run in this
process on the same tiny model: the resumed run trains only the steps after the checkpoint's. A checkpoint with a file
cut off (a full disk, an interrupted copy) is refused by name when it is named, and skipped by last/True."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
sys.path.insert(0, str(RECIPES))

import checkpoints  # noqa: E402
import run_glue  # noqa: E402
import run_ner  # noqa: E402
import run_qa  # noqa: E402
import run_swag  # noqa: E402
from recipe_data import (SENTENCES, logged_losses, ner_sentence, squad_article, swag_rows,  # noqa: E402
                         write_conll, write_csv)


# Pauses the save of step PAUSE_STEP after the random state is written, the last file before trainer_state.json.
PAUSING_RUN = """
import sys, time
sys.path.insert(0, {recipes!r})
import transformers
save_rng_state = transformers.Trainer._save_rng_state
def pausing(self, output_dir):
    save_rng_state(self, output_dir)
    if self.state.global_step == {step}:
        open({sentinel!r}, "w").close()
        time.sleep(600)
transformers.Trainer._save_rng_state = pausing
import run_glue
run_glue.main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def setup(minilm_dir, tmp_path_factory):
    """(tiny model folder, training file)."""
    import transformers

    from modeling_bert_impl import BertImplConfig, BertImplForPreTraining

    root = tmp_path_factory.mktemp("resume")
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    BertImplForPreTraining(BertImplConfig.from_preset("tiny", vocab_size=len(tokenizer))).save_pretrained(root / "m")
    tokenizer.save_pretrained(root / "m")
    train = root / "train.csv"
    train.write_text("sentence,label\n" + "".join(f"{s},{i % 2}\n" for i, s in enumerate(SENTENCES)))
    return str(root / "m"), str(train)


def command(setup, out, *extra, script=None):
    model, train = setup
    return [sys.executable, script or str(RECIPES / "run_glue.py"), "--model_name_or_path", model,
            "--train_file", train, "--do_train", "--output_dir", str(out), "--max_seq_length", "16",
            "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--max_steps", "6", "--save_steps", "2",
            "--logging_steps", "1", "--seed", "0", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
            "--dataloader_num_workers", "0", *extra]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(RECIPES.parent)}


def run(cmd) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)


def checkpoint_names(out) -> list[str]:
    return sorted(p.name for p in Path(out).iterdir() if p.name.startswith("checkpoint-"))


def digest(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """The output folder of an uninterrupted run of 6 steps, checkpoints at 2, 4 and 6."""
    out = tmp_path_factory.mktemp("reference") / "out"
    done = run(command(setup, out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert checkpoint_names(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    return out


@pytest.mark.slow
def test_second_run_refused_and_overwrite_leaves_one_run(setup, reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = digest(out)

    second = run(command(setup, out, "--save_total_limit", "1"))
    assert second.returncode != 0
    message = second.stderr.strip().splitlines()[-1]
    assert message.startswith("ValueError: --output_dir") and "holds an earlier run" in message
    assert "--resume_from_checkpoint last" in message and "--overwrite_output_dir" in message
    assert digest(out) == before  # not a file of the first run changed

    third = run(command(setup, out, "--overwrite_output_dir", "--max_steps", "4"))
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert checkpoint_names(out) == ["checkpoint-2", "checkpoint-4"]  # the first run's checkpoint-6 is gone: no mix
    assert sorted(logged_losses(out)) == [1, 2, 3, 4]


@pytest.mark.slow
def test_killed_while_saving_resumes_from_the_newest_complete_checkpoint(setup, reference, tmp_path):
    out, sentinel = tmp_path / "out", tmp_path / "saving"
    script = tmp_path / "pausing_run.py"
    script.write_text(PAUSING_RUN.format(recipes=str(RECIPES), step=6, sentinel=str(sentinel)))
    log = tmp_path / "killed.log"
    with open(log, "w") as output:
        process = subprocess.Popen(command(setup, out, script=str(script)), env=ENV, stdout=output, stderr=output)
    try:
        deadline = time.monotonic() + 240
        while not sentinel.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sentinel.exists(), log.read_text()[-3000:]
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    # The half-written checkpoint-6 is aside, not under its final name; checkpoints 2 and 4 are intact.
    assert checkpoint_names(out) == ["checkpoint-2", "checkpoint-4"]
    staged = out / ".incomplete-checkpoint" / "checkpoint-6"
    assert (staged / "rng_state.pth").is_file() and not (staged / "trainer_state.json").exists()
    for step in (2, 4):
        assert digest(out / f"checkpoint-{step}").keys() == digest(reference / f"checkpoint-{step}").keys()

    resumed = run(command(setup, out, "--resume_from_checkpoint", "last"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from the newest complete checkpoint" in resumed.stdout + resumed.stderr
    assert checkpoint_names(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not (out / ".incomplete-checkpoint").exists()
    expected, got = logged_losses(reference), logged_losses(out)
    assert sorted(got) == list(range(1, 7))
    worst = max(abs(got[step] - expected[step]) for step in (5, 6))
    print(f"largest loss difference after resuming: {worst:.2e}")
    assert worst <= 1e-6
    # all_results.json's train_loss: the whole run's mean, not that of the steps after the checkpoint
    train_loss = {name: json.loads((folder / "all_results.json").read_text())["train_loss"]
                  for name, folder in (("resumed", out), ("reference", reference))}
    assert abs(train_loss["resumed"] - train_loss["reference"]) <= 1e-6, train_loss
    assert abs(train_loss["reference"] - sum(expected.values()) / 6) <= 1e-6


def ner_data(folder: Path) -> list[str]:
    rng = random.Random(0)
    write_conll(folder / "train.txt", [ner_sentence(rng) for _ in range(24)])
    return ["--train_file", str(folder / "train.txt")]


def qa_data(folder: Path) -> list[str]:
    rng = random.Random(0)
    (folder / "train.json").write_text(json.dumps({"version": "1.1", "data": [squad_article(rng, i) for i in range(4)]}))
    return ["--train_file", str(folder / "train.json"), "--max_seq_length", "32", "--doc_stride", "8"]


def swag_data(folder: Path) -> list[str]:
    write_csv(folder / "train.csv", swag_rows(random.Random(0), 24))
    return ["--train_file", str(folder / "train.csv")]


def cut_off(path: Path) -> None:
    """`path` cut to half its length, as a full disk or an interrupted copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.slow
def test_damaged_checkpoint_files_are_named(setup, reference, tmp_path):
    """Each file of a real checkpoint-6 that the Trainer reads on resume, cut off: run_glue refuses checkpoint-6 when
    it is named, naming the file and checkpoint-4, before anything is loaded."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    newest = out / f"{PREFIX_CHECKPOINT_DIR}-6"
    names = sorted(p.name for p in newest.iterdir() if p.suffix in (".safetensors", ".pt", ".pth", ".bin", ".json"))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin",
            "trainer_state.json"} <= set(names)
    for name in names:
        intact = (newest / name).read_bytes()
        cut_off(newest / name)
        with pytest.raises(ValueError) as error:
            run_glue.main(command(setup, out, "--resume_from_checkpoint", str(newest))[2:])
        (newest / name).write_bytes(intact)
        print(error.value)
        assert str(error.value).startswith(f"--resume_from_checkpoint {newest}: damaged, as a full disk or a copy cut "
                                           f"off leaves a file: {newest / name} (")
        assert str(error.value).endswith(f"The newest complete older checkpoint is {out}/checkpoint-4: resume from it "
                                         f"with --resume_from_checkpoint {out}/checkpoint-4 (--resume_from_checkpoint "
                                         "last takes it, skipping damaged ones)")


# Per recipe: the file cut off in its newest checkpoint, and the --resume_from_checkpoint value that skips it.
DAMAGED = {"run_ner": ("model.safetensors", "last"), "run_qa": ("optimizer.pt", "True"),
           "run_swag": ("trainer_state.json", "last")}


@pytest.mark.slow
@pytest.mark.parametrize("recipe,data", [(run_ner, ner_data), (run_qa, qa_data), (run_swag, swag_data)],
                         ids=["run_ner", "run_qa", "run_swag"])
def test_fine_tuning_recipes_resume_last_and_true(recipe, data, setup, tmp_path, monkeypatch, caplog):
    """A run of 4 steps saves checkpoint-2 and checkpoint-4; with checkpoint-4 removed, `--resume_from_checkpoint last`
    (then `True`) continues from checkpoint-2: the second run trains steps 3 and 4 only, on the checkpoint's state.
    Then with a file of checkpoint-4 cut off (`DAMAGED`): checkpoint-4 named is refused, last/True resume from
    checkpoint-2 the same way and the run's new checkpoint-4 replaces the damaged one."""
    out = tmp_path / "out"
    args = ["--model_name_or_path", setup[0], "--do_train", "--output_dir", str(out), "--max_seq_length", "16",
            "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--max_steps", "4", "--save_steps", "2",
            "--logging_steps", "1", "--seed", "0", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
            "--dataloader_num_workers", "0", *data(tmp_path)]
    trained_from = []  # the global step before each optimizer step of the current run
    training_step = checkpoints.RecipeTrainer.training_step

    def counting(self, *a, **k):  # one training step per optimizer step: no gradient accumulation here
        trained_from.append(self.state.global_step)
        return training_step(self, *a, **k)

    monkeypatch.setattr(checkpoints.RecipeTrainer, "training_step", counting)
    recipe.main(args)
    assert trained_from == [0, 1, 2, 3]
    assert checkpoint_names(out) == ["checkpoint-2", "checkpoint-4"]
    first = logged_losses(out)
    checkpoint = out / f"{PREFIX_CHECKPOINT_DIR}-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2

    damaged_name, damaged_resume = DAMAGED[recipe.__name__]
    for resume, damage in (("last", None), ("True", None), (damaged_resume, damaged_name)):
        newest = out / f"{PREFIX_CHECKPOINT_DIR}-4"
        if damage is None:
            shutil.rmtree(newest)
        else:  # cut off: refused when named, skipped by last/True, then replaced by the resumed run's checkpoint-4
            cut_off(newest / damage)
            with pytest.raises(ValueError) as error:
                recipe.main([*args, "--resume_from_checkpoint", str(newest)])
            print(error.value)
            assert f"{newest / damage} (" in str(error.value)
            assert f"newest complete older checkpoint is {checkpoint}: resume from it" in str(error.value)
        trained_from.clear()
        trainer = recipe.main([*args, "--resume_from_checkpoint", resume])
        assert trainer.args.resume_from_checkpoint == str(checkpoint)
        if damage is not None:
            skipped = [r.message for r in caplog.records if "Falling back" in r.message]
            print(skipped)
            assert len(skipped) == 1 and f"{newest / damage} (" in skipped[0]
        assert trained_from == [2, 3], f"--resume_from_checkpoint {resume} trained from step {trained_from[0]}"
        assert trainer.state.global_step == 4 and checkpoint_names(out) == ["checkpoint-2", "checkpoint-4"]
        resumed = logged_losses(out)  # steps 1 and 2 from the checkpoint's log history, 3 and 4 trained again
        assert sorted(resumed) == [1, 2, 3, 4]
        assert all(abs(resumed[step] - first[step]) <= 1e-6 for step in (1, 2, 3, 4)), (resumed, first)
    assert checkpoints.damaged_files(str(newest)) == []
