"""The recipes' output directory and checkpoints: an earlier run is never overwritten unasked (`prepare_run`),
checkpoints are written all-or-nothing (`RecipeTrainer`), a damaged one is found without loading it (`damaged_files`)
and skipped or refused by name, a resumed run reports the whole run's `train_loss`, `--resume_from_checkpoint auto`
continues whatever the folder holds, and a signal stops a run with a checkpoint (`preemption`)."""

import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import zipfile

from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from modeling_bert_impl.integrations.preemption import PreemptionCallback, parse_signals
from redaction import redact

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
STAGING_DIR = ".incomplete-checkpoint"  # a checkpoint being written; renamed to checkpoint-N once complete
TRAINING_STATE = ("optimizer.pt", "scheduler.pt", "rng_state.pth")
RUN_FILES = ("trainer_state.json", "training_args.bin", "model.safetensors", "config.json")


def complete_checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoint-N folders of `output_dir`, oldest step first. A checkpoint is complete when it holds
    trainer_state.json, the file the Trainer writes last (the recipes' own checkpoints only get their name once
    complete, see `RecipeTrainer`; this also skips a half-written one left by another tool)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match, path = CHECKPOINT_NAME.match(name), os.path.join(output_dir, name)
        if match and os.path.isfile(os.path.join(path, "trainer_state.json")):
            found.append((int(match[1]), path))
    return [path for _, path in sorted(found)]


def missing_training_state(checkpoint: str) -> list[str]:
    """Which of optimizer.pt, scheduler.pt, rng_state.pth (rng_state_<rank>.pth with several processes; other
    optimizer layouts for FSDP and DeepSpeed) `checkpoint` lacks."""
    names = os.listdir(checkpoint)
    present = {
        "optimizer.pt": any(n.startswith(("optimizer", "global_step")) for n in names),
        "scheduler.pt": "scheduler.pt" in names,
        "rng_state.pth": any(re.fullmatch(r"rng_state(_\d+)?\.pth", n) for n in names),
    }
    return [name for name in TRAINING_STATE if not present[name]]


TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\x0a"  # how torch.save's pre-zip format starts (a pickled magic number)


def safetensors_damage(path: str) -> str | None:
    """Why a .safetensors file is damaged, or None: its 8-byte header length, its JSON header and the file's size
    against the tensors' offsets (what a file cut off fails; nothing but the header is read)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or 8 + length > size:
            return f"cut off: {size} bytes, too short for its header"
        try:
            header = json.loads(f.read(length))
            end = 8 + length + max((entry["data_offsets"][1] for name, entry in header.items()
                                    if name != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not a safetensors header"
    if end != size:
        return f"{'cut off' if size < end else 'extra bytes'}: its tensors end at byte {end}, the file has {size}"
    return None


def torch_file_damage(path: str) -> str | None:
    """Why a torch.save file (.pt, .pth, .bin) is damaged, or None: it must be a zip archive whose central directory,
    written last, is whole (a file cut off has none). Files in torch.save's pre-zip format are not checked."""
    with open(path, "rb") as f:
        if f.read(len(TORCH_LEGACY_MAGIC)) == TORCH_LEGACY_MAGIC:
            return None
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except zipfile.BadZipFile as error:
        return f"not a complete zip archive, torch.save's format: {error}"
    return None if entries else "an empty zip archive"


def json_damage(path: str) -> str | None:
    """Why a .json file is damaged, or None: it must parse; an index of shards (*.index.json) must name shards that
    are there."""
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except UnicodeDecodeError:
        return "not UTF-8"
    except json.JSONDecodeError as error:
        return f"not valid JSON: {error.msg}, line {error.lineno}, column {error.colno}"
    if path.endswith(".index.json") and isinstance(content, dict) and isinstance(content.get("weight_map"), dict):
        folder = os.path.dirname(path)
        missing = sorted({s for s in content["weight_map"].values() if not os.path.isfile(os.path.join(folder, s))})
        if missing:
            return f"names shards that are missing: {', '.join(missing)}"
    return None


FILE_CHECKS = {".safetensors": safetensors_damage, ".json": json_damage, ".pt": torch_file_damage,
               ".pth": torch_file_damage, ".bin": torch_file_damage}


def damaged_files(checkpoint: str) -> list[str]:
    """"PATH (why)" for each file of `checkpoint` (subfolders too) that a full disk or a copy cut off damaged: the
    weights (.safetensors, sharded or not, .bin), optimizer.pt, scheduler.pt, rng_state*.pth, training_args.bin,
    trainer_state.json and the other JSON files; each checked cheaply (`FILE_CHECKS`), without loading it."""
    found = []
    for folder, subfolders, names in os.walk(checkpoint):
        subfolders.sort()
        for name in sorted(names):
            check, path = FILE_CHECKS.get(os.path.splitext(name)[1]), os.path.join(folder, name)
            problem = check(path) if check else None
            if problem:
                found.append(f"{path} ({problem})")
    return found


def usable_checkpoints(output_dir: str, before: int | None = None, skip: str | None = None):
    """(checkpoint, damaged files) for the complete checkpoints of `output_dir` (`complete_checkpoints`) before step
    `before` (all when None) other than `skip`, newest first; checked lazily, so that taking the first intact one
    reads only as far as needed."""
    for path in reversed(complete_checkpoints(output_dir)):
        step = int(CHECKPOINT_NAME.match(os.path.basename(path))[1])
        if (before is None or step < before) and (skip is None or not os.path.samefile(path, skip)):
            yield path, damaged_files(path)


def newest_older_checkpoint(checkpoint: str) -> str:
    """A sentence naming the newest complete, undamaged checkpoint older than `checkpoint` (beside it in its folder),
    for a message that refuses `checkpoint`."""
    checkpoint = os.path.normpath(checkpoint)
    parent, match = os.path.dirname(checkpoint) or ".", CHECKPOINT_NAME.match(os.path.basename(checkpoint))
    for path, damaged in usable_checkpoints(parent, before=int(match[1]) if match else None, skip=checkpoint):
        if not damaged:
            return (f"The newest complete older checkpoint is {path}: resume from it with --resume_from_checkpoint "
                    f"{path} (--resume_from_checkpoint last takes it, skipping damaged ones)")
    return f"{parent} holds no complete older checkpoint to resume from"


def resolve_last(output_dir: str, resume: str) -> str:
    """The checkpoint `--resume_from_checkpoint true|last` resumes: the newest complete checkpoint of `output_dir`
    whose files are intact (`damaged_files`). A newer damaged one (a crash or a full disk while saving) is skipped with
    a warning: the older one continues the same run, its steps after it re-trained with the same losses, and the run
    replaces the damaged one when it saves that step again."""
    skipped = []
    for path, damaged in usable_checkpoints(output_dir):
        if not damaged:
            if skipped:
                logger.warning(f"--resume_from_checkpoint {resume}: the newer checkpoint(s) hold damaged files: "
                               f"{'; '.join(skipped)}. Falling back to the newest complete checkpoint, {path}: the run "
                               "continues from there with the losses of an uninterrupted run, and replaces a damaged "
                               "checkpoint when it saves that step again")
            logger.warning(f"resuming from the newest complete checkpoint, {path}")
            return path
        skipped.extend(damaged)
    if skipped:
        raise ValueError(f"--resume_from_checkpoint {resume}: every complete checkpoint of {output_dir} holds damaged "
                         f"files: {'; '.join(skipped)}. Restore them from a copy, or train afresh into another "
                         "--output_dir")
    raise ValueError(f"--resume_from_checkpoint {resume}: {output_dir} holds no complete checkpoint "
                     f"({PREFIX_CHECKPOINT_DIR}-N folder with trainer_state.json); give a checkpoint's path")


def resolve_auto(args: TrainingArguments) -> str | None:
    """The checkpoint `--resume_from_checkpoint auto` resumes: the newest intact complete one of --output_dir, as
    `last`; None where there is none yet (the run starts from the beginning). A folder whose run finished (it holds
    train_results.json, written once training ended) is not trained again: the process exits with status 0."""
    output_dir = args.output_dir
    if args.overwrite_output_dir:
        raise ValueError("--resume_from_checkpoint auto continues the run in --output_dir, --overwrite_output_dir "
                         "deletes it: pass one of them")
    if os.path.isfile(os.path.join(output_dir, "train_results.json")):
        logger.warning(f"--resume_from_checkpoint auto: {output_dir} holds a finished run (train_results.json): "
                       f"nothing to train (its results: {os.path.join(output_dir, 'all_results.json')})")
        raise SystemExit(0)
    if complete_checkpoints(output_dir):
        return resolve_last(output_dir, "auto")  # the newest intact one; an error naming the files if all are damaged
    logger.warning(f"--resume_from_checkpoint auto: no checkpoint in {output_dir} yet: training from the beginning")
    return None


def check_position(checkpoint: str, args: TrainingArguments) -> None:
    """Resuming on another number of processes: the Trainer resumes by steps, so the run continues at the checkpoint's
    sample (its `DataPosition`) only where a step still takes as many samples (processes x per-device batch x
    accumulation steps). Said where the processes change; a ValueError naming the flag that keeps the batch where it
    changed. Checkpoints without a `DataPosition` (not the recipes') are not checked."""
    with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
        state = json.load(f)
    saved = state.get("stateful_callbacks", {}).get(DataPosition.__name__)
    if not saved:
        return
    was = (saved[0] if isinstance(saved, list) else saved)["attributes"]
    before = was["processes"] * was["per_device"] * was["accumulation"]
    seen = state["global_step"] * before
    processes, per_device, accumulation = args.world_size, args.per_device_train_batch_size, \
        args.gradient_accumulation_steps
    now = processes * per_device * accumulation
    written = (f"{checkpoint} was written by {was['processes']} process(es) x {was['per_device']} per device x "
               f"{was['accumulation']} accumulation step(s) = {before} samples a step, at sample {seen}")
    if now == before:
        if processes != was["processes"]:
            logger.warning(f"{written}; this run takes {processes} x {per_device} x {accumulation}, the same "
                           f"{now} a step: it goes on from sample {seen} as the run would have")
        return
    keep = [f"--gradient_accumulation_steps {before // (processes * per_device)}"
            if before % (processes * per_device) == 0 else None,
            f"--per_device_train_batch_size {before // (processes * accumulation)}"
            if before % (processes * accumulation) == 0 else None]
    keep = [k for k in keep if k]
    advice = (f"pass {' or '.join(keep)} to keep {before}" if keep else
              f"no per-device batch and accumulation steps make {before} on {processes} process(es): resume on "
              "another number of processes")
    raise ValueError(f"--resume_from_checkpoint {checkpoint}: {written}; this run would take {processes} x "
                     f"{per_device} x {accumulation} = {now}. The Trainer resumes by steps, so it would go on at "
                     f"another sample than the one it stopped at, repeating or skipping examples: {advice}")


def preemption(args: TrainingArguments, script: str, argv: list[str] | None = None) -> list[TrainerCallback]:
    """[the `PreemptionCallback` of --save_on_signal (with SIGTERM where --enable_jit_checkpoint asks for it)], or []
    where the run does not train or listens to no signal. Make it before the data is prepared: its handlers are
    installed at once. Its last line gives the command that resumes: this one with --resume_from_checkpoint auto."""
    signals = parse_signals(args.save_on_signal)
    if getattr(args, "enable_jit_checkpoint", False):
        signals = tuple(dict.fromkeys((*signals, signal.SIGTERM)))
    if not args.do_train or not signals:
        return []
    return [PreemptionCallback(signals, resume=resume_command(script, argv))]


def resume_command(script: str, argv: list[str] | None = None) -> str:
    """The command line that resumes this run: its own (secrets redacted) with --resume_from_checkpoint auto."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    script = f"recipes/{os.path.basename(script)}"
    if len(argv) == 1 and argv[0].endswith(".json"):
        return f'{script} {argv[0]}, with "resume_from_checkpoint": "auto" in the file'
    kept, skip = [], False
    for arg in argv:
        if skip or arg.split("=")[0] == "--resume_from_checkpoint":
            skip = not skip and "=" not in arg
            continue
        kept.append(arg)
    command = shlex.join([script, *redact(kept), "--resume_from_checkpoint", "auto"])
    launched = "WORLD_SIZE" in os.environ  # torchrun and accelerate launch set it
    return f"the same launcher (torchrun, accelerate launch) with {command}" if launched else f"python {command}"


def earlier_run(output_dir: str) -> list[str]:
    """What an earlier run left in `output_dir`: checkpoints (complete or not), results files, a trained model."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(n for n in os.listdir(output_dir)
                  if CHECKPOINT_NAME.match(n) or n == STAGING_DIR or n in RUN_FILES or n.endswith("_results.json"))


def prepare_run(args: TrainingArguments) -> None:
    """Before anything is written, on every process: with --do_train, resolve --resume_from_checkpoint and guard
    --output_dir.

    - `--resume_from_checkpoint true` or `last`: the newest complete checkpoint of --output_dir whose files are intact
      (`resolve_last`: newer damaged ones are skipped with a warning; an error when there is none); a path: that
      checkpoint, refused when a file of it is damaged (`damaged_files`), with the newest complete older one named.
      args.resume_from_checkpoint becomes the path. A checkpoint without its training state (optimizer.pt,
      scheduler.pt, rng_state.pth) is refused unless --resume_without_training_state, and one whose samples a step
      this run would change is refused by `check_position`.
    - `--resume_from_checkpoint auto`: `resolve_auto` (`last` where there is a checkpoint, the beginning where there is
      none, an exit with status 0 where the run has finished).
    - --save_on_signal must name signals (or none).
    - An --output_dir holding an earlier run (checkpoints, results, a trained model) is refused unless the run resumes
      or --overwrite_output_dir is given; that flag deletes the earlier checkpoints and results files first, so that the
      folder never mixes two runs."""
    auto = (args.resume_from_checkpoint or "").lower() == "auto"
    if not args.do_train:
        if auto:
            args.resume_from_checkpoint = None
        return
    try:
        parse_signals(args.save_on_signal)
    except ValueError as error:
        raise ValueError(f"--save_on_signal {error}") from None
    output_dir, resume = args.output_dir, args.resume_from_checkpoint
    if auto:
        resume = args.resume_from_checkpoint = resolve_auto(args)
        if resume is None:  # the beginning, over whatever an attempt stopped before its first checkpoint left
            return
    if resume is not None and resume.lower() in ("true", "last"):
        resume = args.resume_from_checkpoint = resolve_last(output_dir, resume)
    if resume is not None:
        if not os.path.isdir(resume):
            raise ValueError(f"--resume_from_checkpoint {resume}: no such checkpoint folder")
        if not os.path.isfile(os.path.join(resume, "trainer_state.json")):
            raise ValueError(f"--resume_from_checkpoint {resume}: not a complete checkpoint (no trainer_state.json, "
                             f"the file the Trainer writes last). {newest_older_checkpoint(resume)}")
        damaged = damaged_files(resume)
        if damaged:  # the user named this checkpoint: refused, not silently replaced by an older one
            raise ValueError(f"--resume_from_checkpoint {resume}: damaged, as a full disk or a copy cut off leaves a "
                             f"file: {'; '.join(damaged)}. {newest_older_checkpoint(resume)}")
        missing = missing_training_state(resume)
        if missing and not args.resume_without_training_state:
            raise ValueError(
                f"--resume_from_checkpoint {resume}: the checkpoint lacks {', '.join(missing)}, so the run would not "
                "continue where it stopped (the optimizer, the learning-rate schedule or the random state would start "
                "afresh) and its losses would differ from those of an uninterrupted run. Resume from a complete "
                "checkpoint, or pass --resume_without_training_state to resume anyway")
        if missing:
            logger.warning(f"resuming from {resume} without {', '.join(missing)}: the losses will differ from those of "
                           "an uninterrupted run")
        check_position(resume, args)
        return
    previous = earlier_run(output_dir)
    if previous and not args.overwrite_output_dir:
        shown = ", ".join(previous[:6]) + (", ..." if len(previous) > 6 else "")
        raise ValueError(
            f"--output_dir {output_dir} holds an earlier run ({shown}). Pass --resume_from_checkpoint last to continue "
            "it, --overwrite_output_dir to delete its checkpoints and results and train afresh, or choose another "
            "--output_dir")
    if previous and args.should_save:
        logger.warning(f"--overwrite_output_dir: deleting the earlier run's checkpoints and results in {output_dir}")
        for name in previous:
            path = os.path.join(output_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif name == "trainer_state.json" or name.endswith("_results.json"):  # the model is replaced when saved
                os.remove(path)


class RecipeTrainer(Trainer):
    """`Trainer` whose checkpoints are all-or-nothing, whose saved arguments (training_args.bin) hold no Hub token, and
    whose resumed runs report the whole run's `train_loss`.

    transformers writes checkpoint-N file by file in place, so a run killed while saving leaves a half-written newest
    checkpoint. Here every process writes its part into --output_dir/.incomplete-checkpoint/checkpoint-N, and once all
    are done the main process renames it to --output_dir/checkpoint-N (atomic on one file system); only then are the
    oldest checkpoints deleted (--save_total_limit, by step) and the checkpoint pushed (--push_to_hub).

    transformers' `train_loss` is the mean over the steps of one `train()` call: after a resume, of the steps after the
    checkpoint only. Here it is the mean over the whole run, the steps before the checkpoint read from its log history,
    so that a resumed run reports the uninterrupted run's."""

    _staging: str | None = None  # while a checkpoint is being written: the folder it is written into
    _push_pending = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_start = RunStart()
        self.add_callback(self.run_start)
        self.add_callback(DataPosition())

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "train_loss" in logs and self.run_start.step:
            logs["train_loss"] = whole_run_loss(self.state.log_history, self.run_start.step, logs["train_loss"],
                                                self.state.global_step)
        super().log(logs, *args, **kwargs)

    def _get_output_dir(self, trial) -> str:
        return self._staging or super()._get_output_dir(trial)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._staging:  # not from the folder about to be renamed: from the final one, below
            self._push_pending = True
            return
        super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = self._get_output_dir(trial)
        staging = os.path.join(run_dir, STAGING_DIR)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staged, final = os.path.join(staging, name), os.path.join(run_dir, name)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # what a run killed while saving left
        self.accelerator.wait_for_everyone()
        self._staging = staging
        try:
            super()._save_checkpoint(model, trial)  # writes into `staged`, through _get_output_dir
        finally:
            self._staging = None
        if self.state.best_model_checkpoint == staged:
            self.state.best_model_checkpoint = final
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
        self.accelerator.wait_for_everyone()  # every process has written its part
        if self.args.should_save:
            if os.path.exists(final):  # the same step saved by an earlier attempt: replace it
                os.rename(final, os.path.join(staging, "replaced"))
            os.rename(staged, final)
            shutil.rmtree(staging)
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()
        if self._push_pending:
            self._push_pending = False
            super()._push_from_checkpoint(final)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        token, self.args.hub_token = self.args.hub_token, None  # training_args.bin pickles the arguments
        try:
            super()._save(output_dir, state_dict)
        finally:
            self.args.hub_token = token


class RunStart(TrainerCallback):
    """The step a `train()` call starts from: 0, or the step of the checkpoint it resumes."""

    step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


class DataPosition(TrainerCallback, ExportableState):
    """The run's place in its data, kept in every checkpoint's trainer_state.json: the samples a step (processes x
    per-device batch x accumulation steps), which with the state's global_step gives the samples seen, and which a
    resume must keep (`check_position`)."""

    processes = per_device = accumulation = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.processes, self.per_device = args.world_size, args.per_device_train_batch_size
        self.accumulation = args.gradient_accumulation_steps

    def state(self) -> dict:
        return {"args": {}, "attributes": {"processes": self.processes, "per_device": self.per_device,
                                           "accumulation": self.accumulation}}


def whole_run_loss(log_history: list[dict], resumed_at: int, mean_after: float, step: int) -> float:
    """The mean training loss of a run resumed at step `resumed_at` and now at `step`: the losses logged up to
    `resumed_at` (each the mean over its logging interval), and `mean_after`, transformers' mean over the steps after
    it. Steps before the checkpoint after its last logged loss have no known loss (transformers keeps none): they
    count in neither."""
    total, logged = 0.0, 0
    for entry in log_history:
        if "loss" in entry and entry["step"] <= resumed_at:
            total, logged = total + entry["loss"] * (entry["step"] - logged), entry["step"]
    return (total + mean_after * (step - resumed_at)) / max(logged + step - resumed_at, 1)
