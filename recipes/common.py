"""What the recipes share: their command-line arguments, the output directory and resuming (`prepare_run`),
checkpoints written all-or-nothing (`RecipeTrainer`), reading and checking data files (`read_table`, `locate`), loading
the tokenizer and the data, and the end of a run (train, save the model and the tokenizer, record metrics, write the
model card with the command line, secrets redacted: `redact`).

The recipes run as scripts (`python recipes/run_glue.py ...`, `torchrun ...`, `accelerate launch ...`): the script's
folder is first on `sys.path`, so they import this module, `metrics` and `qa_utils` by their plain names.
"""

import codecs
import csv
import json
import logging
import os
import re
import shutil
import sys
import zipfile
from dataclasses import dataclass, field

import datasets
import transformers
from transformers import AutoTokenizer, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        metadata={"help": "A bert-impl folder, a stock BERT folder (model_type 'bert') or a Hub id of either."}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "The tokenizer's folder or Hub id, if not the model's."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to keep models and data from the Hub."})
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Re-initialise a checkpoint's head when its number of labels differs."}
    )


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A data set on the Hub."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration."})
    train_file: str | None = field(default=None, metadata={"help": "Training data file."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data file."})
    test_file: str | None = field(default=None, metadata={"help": "Prediction data file (labels optional)."})
    max_seq_length: int = field(
        default=128, metadata={"help": "Tokens per sequence after tokenization; longer inputs are truncated."}
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={"help": "Pad every sequence to max_seq_length (default: pad each batch to its longest sequence)."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N evaluation examples."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep the first N test examples."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for preprocessing."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo the preprocessing instead of reusing it."})

    def __post_init__(self):
        if self.dataset_name is None and not (self.train_file or self.validation_file or self.test_file):
            raise ValueError("give --dataset_name (or --task_name) or at least one of --train_file, --validation_file, "
                             "--test_file")


@dataclass
class RecipeTrainingArguments(TrainingArguments):
    """`TrainingArguments` and the two flags with which the recipes guard a user's earlier work (see `prepare_run`)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an --output_dir that holds an earlier run: its checkpoints and results files are "
                          "deleted first. Without this flag (or --resume_from_checkpoint) such a folder is refused."},
    )
    resume_without_training_state: bool = field(
        default=False,
        metadata={"help": "Resume from a checkpoint that lacks optimizer.pt, scheduler.pt or rng_state.pth: the missing "
                          "state starts afresh, so the losses differ from those of an uninterrupted run."},
    )


def parse_args(data_class: type, argv: list[str] | None = None):
    """(ModelArguments, data_class, RecipeTrainingArguments) from `argv` (default: the command line), or from the one
    JSON file `argv` names; then `prepare_run` checks the output directory and resolves the checkpoint to resume."""
    parser = HfArgumentParser((ModelArguments, data_class, RecipeTrainingArguments))
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if len(argv) == 1 and argv[0].endswith(".json"):
        parsed = parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    else:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    prepare_run(parsed[-1])
    return parsed


# ---------------------------------------------------------------------------------------------------------------------
# The output directory, checkpoints and resuming
# ---------------------------------------------------------------------------------------------------------------------
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
      scheduler.pt, rng_state.pth) is refused unless --resume_without_training_state.
    - An --output_dir holding an earlier run (checkpoints, results, a trained model) is refused unless the run resumes
      or --overwrite_output_dir is given; that flag deletes the earlier checkpoints and results files first, so that the
      folder never mixes two runs."""
    if not args.do_train:
        return
    output_dir, resume = args.output_dir, args.resume_from_checkpoint
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


# ---------------------------------------------------------------------------------------------------------------------
# Secrets
# ---------------------------------------------------------------------------------------------------------------------
REDACTED = "REDACTED"  # no shell metacharacters: the card quotes the command line for a shell
SECRET_FLAG = re.compile(r"^--?(?:\w+_)?(?:token|secret|password|passwd|api_key|apikey|credentials?)$", re.IGNORECASE)
SECRET_TEXT = (
    (re.compile(r"\bhf_[A-Za-z0-9]{8,}"), REDACTED),  # a Hugging Face token
    # NAME=value whose name ends like a secret's (HF_TOKEN=..., --hub_token=..., ?access_token=... in a URL)
    (re.compile(r"(?i)\b([A-Za-z_]*(?:token|secret|password|passwd|api_key|apikey)=)[^\s&]+"), rf"\1{REDACTED}"),
    (re.compile(r"(://)[^/\s@]+@"), rf"\1{REDACTED}@"),  # user:password@ in a URL
)


def redact_text(text: str) -> str:
    """`text` with Hub tokens, NAME=secret pairs and the credentials of URLs replaced by REDACTED."""
    for pattern, replacement in SECRET_TEXT:
        text = pattern.sub(replacement, text)
    return text


def redact(argv: list[str]) -> list[str]:
    """A command line fit to be written down: the value of every secret-like flag (--hub_token, --token,
    --*_password, ...) and any token-like text (see `redact_text`) replaced by REDACTED."""
    out, secret_next = [], False
    for arg in map(str, argv):
        name, equals, _ = arg.partition("=")
        if secret_next:
            out.append(REDACTED)
            secret_next = False
        elif SECRET_FLAG.match(name):
            out.append(f"{name}={REDACTED}" if equals else arg)
            secret_next = not equals
        else:
            out.append(redact_text(arg))
    return out


class RedactingFilter(logging.Filter):
    """Redacts secrets (`redact_text`) from every record a handler emits."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def setup_logging(training_args: TrainingArguments) -> None:
    """Log to stdout; the main process at the level asked for (default: warnings), the others at warnings only; secrets
    redacted from every line (`RedactingFilter`)."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    level = training_args.get_process_log_level()
    logging.getLogger().setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    for name in (None, "transformers", "datasets"):  # the libraries' loggers have handlers of their own
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())
    logger.info(f"Training/evaluation parameters {training_args}")


def load_tokenizer(model_args: ModelArguments):
    """The project's `BertImplTokenizer` when the `tokenization` package is importable, else `AutoTokenizer`."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    require_sources(model_args)
    try:
        from tokenization import BertImplTokenizer
    except ImportError:
        return AutoTokenizer.from_pretrained(name, cache_dir=model_args.cache_dir)
    return BertImplTokenizer.from_pretrained(name, cache_dir=model_args.cache_dir)


def sequence_length(data_args: DataArguments, tokenizer) -> int:
    """--max_seq_length, capped at what the tokenizer (and so the model) accepts."""
    if data_args.max_seq_length > tokenizer.model_max_length:
        logger.warning(f"max_seq_length {data_args.max_seq_length} is longer than the model accepts; "
                       f"using {tokenizer.model_max_length}")
        return tokenizer.model_max_length
    return data_args.max_seq_length


# ---------------------------------------------------------------------------------------------------------------------
# Data files
# ---------------------------------------------------------------------------------------------------------------------
TABLE_EXTENSIONS = ("csv", "tsv", "json", "jsonl")
CHUNK_BYTES = 1 << 20  # what `text_chunks` reads at a time


def text_chunks(path: str, chunk_bytes: int = CHUNK_BYTES):
    """The text of a UTF-8 file, decoded a chunk at a time (memory: one chunk, whatever the file's size); a ValueError
    naming the file (and, for bytes that are not UTF-8, the line and the column) when it is missing, empty (nothing but
    whitespace) or not UTF-8. The errors come as the reading reaches them: read to the end before trusting the file."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    decoder = codecs.getincrementaldecoder("utf-8")()
    start, lines, line_start, has_text = 0, 0, 0, False  # offset of the chunk; newlines and last line's start before it
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                # error.object: the bytes of an unfinished character held back from the last chunk, then this chunk
                bad = start - (len(error.object) - len(chunk)) + error.start
                before = chunk[:max(bad - start, 0)]  # a held-back byte is never a newline
                if b"\n" in before:
                    lines, line_start = lines + before.count(b"\n"), start + before.rfind(b"\n") + 1
                raise ValueError(f"{path}, line {lines + 1}, column {bad - line_start + 1}: byte "
                                 f"{error.object[error.start]:#04x} is not UTF-8; save the file as UTF-8 (e.g. "
                                 "`iconv -f latin1 -t utf-8 old > new`)") from None
            if not chunk:
                break
            lines += chunk.count(b"\n")
            if b"\n" in chunk:
                line_start = start + chunk.rfind(b"\n") + 1
            start += len(chunk)
            has_text = has_text or bool(text.strip())
            yield text
    if not has_text:
        raise ValueError(f"{path}: the file is empty")


def check_text_file(path: str) -> None:
    """`text_chunks`' checks, by reading the file through once without keeping it (for corpora of any size)."""
    for _ in text_chunks(path):
        pass


def read_text(path: str) -> str:
    """The text of a UTF-8 file; a ValueError naming the file (and the line) when it is missing, empty or not UTF-8
    (`text_chunks`)."""
    return "".join(text_chunks(path))


def csv_rows(path: str, text: str):
    """(line number, fields) of each row of a CSV (or, .tsv, GLUE's tab-separated unquoted) file, header first; blank
    lines skipped, as the loader skips them."""
    dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if path.lower().endswith(".tsv") else {}
    reader = csv.reader(text.splitlines(keepends=True), **dialect)
    end = 0
    for fields in reader:
        start, end = end + 1, reader.line_num
        if fields:
            yield start, fields


def json_records(path: str, text: str):
    """(line number or None, record) of a JSON file holding a list of objects, or of a JSON-lines file (one object per
    line); a ValueError naming the line when one is not a JSON object."""
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {error.lineno}, column {error.colno}: not valid JSON ({error.msg})") from None
        lines = [None] * len(records)
    else:
        numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        records, lines = [], []
        for n, line in numbered:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                cut = " (the file looks cut off)" if n == numbered[-1][0] else ""
                raise ValueError(f"{path}, line {n}, column {error.colno}: not a complete JSON object ({error.msg}){cut}; "
                                 "a JSON-lines file holds one JSON object per line") from None
            lines.append(n)
    for n, (line, record) in enumerate(zip(lines, records)):
        if not isinstance(record, dict):
            where = f"line {line}" if line else f"record {n + 1}"
            raise ValueError(f"{path}, {where}: expected a JSON object of named fields, got {type(record).__name__}")
    return zip(lines, records)


def check_table(path: str) -> None:
    """A ValueError naming the file and the line for what the `datasets` loaders would only report as "An error
    occurred while generating the dataset": a missing, empty or non-UTF-8 file, a CSV row whose number of fields is
    not the header's, a line of a JSON-lines file that is not one complete JSON object."""
    text = read_text(path)
    if path.rsplit(".", 1)[-1].lower() in ("csv", "tsv"):
        rows = csv_rows(path, text)
        _, header = next(rows)
        count = 0
        for line, fields in rows:
            count += 1
            if len(fields) != len(header):
                hint = "quote the fields that contain a comma" if path.lower().endswith(".csv") else \
                    "a text field must not contain a tab"
                raise ValueError(f"{path}, line {line}: {len(fields)} fields, but the header line has {len(header)} "
                                 f"({', '.join(header)}); {hint}, or fill in the missing fields")
        if not count:
            raise ValueError(f"{path}: a header line but no rows")
    else:
        if not any(True for _ in json_records(path, text)):
            raise ValueError(f"{path}: no records")


def read_table(path: str) -> datasets.Dataset:
    """A CSV, TSV (tab-separated, unquoted: GLUE's original files), JSON (a list of objects) or JSON-lines file as a
    Dataset, checked first (`check_table`)."""
    extension = path.rsplit(".", 1)[-1].lower()
    if extension not in TABLE_EXTENSIONS:
        raise ValueError(f"{path}: expected a .csv, .tsv, .json or .jsonl file")
    check_table(path)
    try:
        if extension == "tsv":
            return datasets.load_dataset("csv", data_files=path, delimiter="\t", quoting=csv.QUOTE_NONE,
                                         split="train")
        if extension == "csv":
            return datasets.load_dataset("csv", data_files=path, split="train")
        return datasets.load_dataset("json", data_files=path, split="train")
    except datasets.exceptions.DatasetGenerationError as error:  # what check_table does not foresee
        raise ValueError(f"{path}: could not be read: {error.__cause__ or error}") from error


def locate(path: str, indices: list[int]) -> list[str]:
    """Where rows `indices` (0-based, in file order) of a data file are: "FILE, line N" (CSV, TSV, JSON lines) or
    "FILE, record N" (a JSON list). Re-reads the file: for error messages only."""
    if path.rsplit(".", 1)[-1].lower() in ("csv", "tsv"):
        rows = csv_rows(path, read_text(path))
        next(rows)  # the header
    else:
        rows = json_records(path, read_text(path))
    lines = dict(enumerate(line for line, _ in rows))
    return [f"{path}, line {lines[i]}" if lines.get(i) else f"{path}, record {i + 1}" for i in indices]


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hub answers at all (one request, no retries): False at once when HF_HUB_OFFLINE is set."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:  # any failure to connect: DNS, refused, timeout, proxy, TLS
        return False
    return True


def require_sources(model_args) -> None:
    """`require_source` for --model_name_or_path and --tokenizer_name (any recipe's model arguments)."""
    require_source(model_args.model_name_or_path, "--model_name_or_path", model_args.cache_dir)
    require_source(model_args.tokenizer_name, "--tokenizer_name", model_args.cache_dir)


def require_source(name: str | None, flag: str, cache_dir: str | None = None) -> None:
    """A model or tokenizer name must be a folder, a Hub id already in the cache, or a Hub id with the Hub reachable;
    else a ValueError at once that says so and what to pass (instead of the loaders' minutes of retries, then an
    error about a missing file)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if name is None or os.path.isdir(name):
        return
    files = ("config.json", "tokenizer_config.json", "vocab.txt", "tokenizer.json")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ValueError(f"{flag} {name!r}: no such folder (a Hub id has the form 'name' or 'owner/name')")
    try:
        if any(isinstance(try_to_load_from_cache(name, f, cache_dir=cache_dir), str) for f in files):
            return
    except ValueError as error:  # huggingface_hub's word on an invalid id
        raise ValueError(f"{flag} {name!r}: no such folder, and not a Hub id ({error})") from None
    if hub_reachable():
        return
    hub = f"the Hub ({constants.ENDPOINT}) could not be reached"
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else hub
    raise ValueError(
        f"{flag} {name!r} is not a local folder and not in the Hugging Face cache, and cannot be downloaded ({why}): "
        f"pass {flag} a local folder holding the model's files (config.json, model.safetensors, the tokenizer's "
        "files: a folder written by save_pretrained, or a copy of the Hub repository), or connect to download it once"
    )


def load_hub_dataset(name: str, config: str | None, cache_dir: str | None) -> datasets.DatasetDict:
    """A data set from the Hub, or from the cache when offline; when neither can serve it, a ValueError saying at once
    that the data must be given as files (instead of the loaders' minute of retries)."""
    from huggingface_hub import constants

    advice = "give the data as files instead: --train_file, --validation_file, --test_file"
    if not constants.HF_HUB_OFFLINE and not hub_reachable():
        raise ValueError(f"the Hub ({constants.ENDPOINT}) cannot be reached to download the data set {name!r}: "
                         f"{advice} (or set HF_HUB_OFFLINE=1 to use a copy already in the cache)")
    try:
        return datasets.load_dataset(name, config, cache_dir=cache_dir)
    except ConnectionError as error:
        if not constants.HF_HUB_OFFLINE:
            raise
        raise ValueError(f"HF_HUB_OFFLINE is set and the data set {name!r} is not in the cache: {advice}") from error


def load_data(data_args: DataArguments, cache_dir: str | None = None, read_file=read_table) -> datasets.DatasetDict:
    """--dataset_name (with --dataset_config_name) from the Hub (`load_hub_dataset`), or the --train_file,
    --validation_file and --test_file files as the splits "train", "validation" and "test", each read by
    `read_file(path)`."""
    if data_args.dataset_name is not None:
        return load_hub_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir)
    return datasets.DatasetDict({split: read_file(path) for split, path in data_files(data_args).items()})


def data_files(data_args: DataArguments) -> dict[str, str]:
    """{split: path} of the --train_file, --validation_file and --test_file given."""
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    return {split: path for split, path in files.items() if path}


def refuse_rows(path: str, rows: list[int], problem: str, advice: str) -> None:
    """A ValueError for the rows (indices) of file `path` that have `problem`: how many, where the first few are."""
    if rows:
        where = "; ".join(locate(path, rows[:5])) + ("; ..." if len(rows) > 5 else "")
        raise ValueError(f"{len(rows)} row(s) {problem}: {where}. {advice}")


def require_splits(raw: datasets.DatasetDict, training_args: TrainingArguments) -> None:
    """A clear error when --do_train / --do_eval / --do_predict has no train / validation / test split to read."""
    for flag, split in (("do_train", "train"), ("do_eval", "validation"), ("do_predict", "test")):
        if getattr(training_args, flag) and split not in raw:
            raise ValueError(f"--{flag} needs the {split} split: give --{split}_file")


def take(dataset: datasets.Dataset, n: int | None) -> datasets.Dataset:
    """The first n examples (all of them when n is None)."""
    return dataset if n is None else dataset.select(range(min(n, len(dataset))))


def preprocess(dataset, function, training_args: TrainingArguments, data_args: DataArguments, desc: str, **kwargs):
    """`dataset.map(function, batched=True)`, the main process first so that the others reuse its cache."""
    with training_args.main_process_first(desc=desc):
        return dataset.map(
            function,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache,
            desc=desc,
            **kwargs,
        )


def train_and_save(trainer: Trainer, training_args: TrainingArguments, num_examples: int) -> dict:
    """Train (from the checkpoint `prepare_run` resolved, if any), save the model (`save_pretrained`) and the tokenizer
    into --output_dir, and record the train metrics."""
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()  # the model and, as the Trainer's processing_class, the tokenizer
    trainer.save_state()
    metrics = {**result.metrics, "train_samples": num_examples}
    record(trainer, "train", metrics)
    return metrics


def evaluate_and_record(trainer: Trainer, num_examples: int) -> dict:
    """Evaluate on the Trainer's eval set, record the metrics (with eval_samples) and return them."""
    metrics = {**trainer.evaluate(), "eval_samples": num_examples}
    record(trainer, "eval", metrics)
    return metrics


def record(trainer: Trainer, split: str, metrics: dict) -> None:
    """Log metrics and save them to {split}_results.json and, merged with the other splits', all_results.json."""
    trainer.log_metrics(split, metrics)
    trainer.save_metrics(split, metrics)


def finish(trainer: Trainer, model_args: ModelArguments, metrics: dict, script: str, argv: list[str] | None = None,
           dataset: str | None = None, dataset_config: str | None = None) -> None:
    """After the run: push to the Hub if asked, and write the model card (README.md: the model, `metrics`, the command
    line, secrets redacted) into --output_dir, on the main process only. Without the project's model_card module the card is skipped
    with a warning."""
    args = trainer.args
    if args.push_to_hub:
        trainer.push_to_hub()  # uploads transformers' generic card; ours replaces it below
    if not trainer.is_world_process_zero():
        return
    try:
        from modeling_bert_impl.integrations.model_card import write_model_card
    except ImportError as error:
        logger.warning(f"no model card written: {error}")
        return
    command = ["python", f"recipes/{os.path.basename(script)}", *redact(sys.argv[1:] if argv is None else argv)]
    base_model = None if os.path.isdir(model_args.model_name_or_path) else model_args.model_name_or_path
    readme = write_model_card(
        args.output_dir, trainer.model, metrics=metrics, command=command, base_model=base_model,
        datasets=[dataset] if dataset else None, dataset_config=dataset_config,
        repo_id=trainer.hub_model_id if args.push_to_hub else None,
    )
    if args.push_to_hub:
        from huggingface_hub import HfApi

        HfApi().upload_file(path_or_fileobj=readme, path_in_repo="README.md", repo_id=trainer.hub_model_id)
