"""What the recipes share: their command-line arguments (`parse_args`, which guards the output directory through
`checkpoints.prepare_run`), logging with secrets redacted, loading the tokenizer and the data, and the end of a run
(train, save the model and the tokenizer, record metrics, write the model card with the command line, secrets
redacted).

The recipes run as scripts (`python recipes/run_glue.py ...`, `torchrun ...`, `accelerate launch ...`): the script's
folder is first on `sys.path`, so they import this module and its neighbours (`checkpoints`, `user_files`, `sources`,
`redaction`, `metrics`, `qa_utils`) by their plain names.
"""

import gc
import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
import torch
import transformers
from transformers import AutoTokenizer, HfArgumentParser, Trainer, TrainingArguments

from modeling_bert_impl.inference import cpu_bf16_units
from modeling_bert_impl.integrations.preemption import DEFAULT_SIGNALS

from checkpoints import prepare_run
from redaction import RedactingFilter, redact
from sources import load_hub_dataset, require_sources
from user_files import read_table

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
    """`TrainingArguments` and the recipes' own flags: two that guard a user's earlier work (see `prepare_run`) and the
    signals that stop a run with a checkpoint (`checkpoints.preemption`)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an --output_dir that holds an earlier run: its checkpoints and results files are "
                          "deleted first. Without this flag (or --resume_from_checkpoint) such a folder is refused."},
    )
    save_on_signal: str = field(
        default=DEFAULT_SIGNALS,
        metadata={"help": "On these signals (comma-separated; none to turn off) the run finishes its step, writes one "
                          "checkpoint on every process together and exits with status 75 (preempted), to be resumed "
                          "with --resume_from_checkpoint auto. --enable_jit_checkpoint adds SIGTERM."},
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


def precision(training_args: TrainingArguments) -> tuple[str, bool]:
    """The run's precision in words, for its first log lines: bfloat16 autocast or float32, and on the CPU whether it
    has bfloat16 units (AMX, AVX512-BF16), without which bfloat16 products run slower than float32 ones; and whether
    that is so (bfloat16 autocast on a CPU without them)."""
    if training_args.device.type != "cpu":
        return "bfloat16 autocast" if training_args.bf16 else "fp16 autocast" if training_args.fp16 else "float32", False
    units = cpu_bf16_units()
    if training_args.bf16 and not units:
        return ("bfloat16 autocast on a CPU without AMX or AVX512-BF16: its bfloat16 products run slower than float32 "
                "ones (--bf16 false for float32)", True)
    if training_args.bf16:
        return f"bfloat16 autocast on the CPU's {units} (--bf16 false for float32)", False
    return f"float32 (--bf16 for bfloat16 autocast on the CPU's {units})" if units else "float32", False


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
    said, slower = precision(training_args)  # information, but a warning where bfloat16 runs slower than float32
    (logger.warning if slower else logger.info)(f"precision: {said}")


def load_tokenizer(model_args: ModelArguments):
    """The project's `BertImplTokenizer` when the `tokenization` package is importable, else `AutoTokenizer`."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    require_sources(model_args)
    try:
        from tokenization import BertImplTokenizer
    except ImportError:
        return AutoTokenizer.from_pretrained(name, cache_dir=model_args.cache_dir)
    return BertImplTokenizer.from_pretrained(name, cache_dir=model_args.cache_dir)


class HeldRecords(logging.Filter):
    """Keeps a logger's records instead of letting them out (`load_for_fine_tuning`)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


def load_for_fine_tuning(model_class, model_args: ModelArguments, **kwargs):
    """`model_class.from_pretrained(--model_name_or_path)` for fine-tuning, its load report said so that a newcomer
    reads it right: a task head the checkpoint lacks is new (initialised at random, what fine-tuning trains) and its
    other heads' weights go unused, each said in one line where transformers prints a table of MISSING and UNEXPECTED
    keys; missing weights of the encoder itself, or a failed load, get transformers' report as it is."""
    name = model_args.model_name_or_path
    report_logger = logging.getLogger("transformers.modeling_utils")
    held = HeldRecords()
    report_logger.addFilter(held)
    try:
        model, info = model_class.from_pretrained(name, cache_dir=model_args.cache_dir, output_loading_info=True,
                                                  **kwargs)
    except BaseException:
        report_logger.removeFilter(held)
        for record in held.records:
            report_logger.handle(record)
        raise
    report_logger.removeFilter(held)
    encoder = model.base_model_prefix + "."
    missing = sorted(info["missing_keys"])
    head = [k for k in missing if not k.startswith(encoder)]
    for record in held.records:  # the report aside, unless encoder weights are missing
        if "LOAD REPORT" not in record.getMessage() or len(head) < len(missing):
            report_logger.handle(record)
    if head:
        logger.info(f"new task head: {', '.join(head)}, initialised at random, as {name} has none; fine-tuning "
                    "trains it (transformers' load report calls these weights MISSING: expected here)")
    if info["unexpected_keys"]:
        unused = sorted(info["unexpected_keys"])
        logger.info(f"{len(unused)} weights of {name} not used (its other heads: {', '.join(unused[:3])}"
                    f"{', ...' if len(unused) > 3 else ''})")
    for key, stored, shape in info["mismatched_keys"]:  # with --ignore_mismatched_sizes
        logger.info(f"{key}: {name} holds {tuple(stored)}, this model takes {tuple(shape)}: initialised at random")
    return model


def sequence_length(data_args: DataArguments, tokenizer) -> int:
    """--max_seq_length, capped at what the tokenizer (and so the model) accepts."""
    if data_args.max_seq_length > tokenizer.model_max_length:
        logger.warning(f"max_seq_length {data_args.max_seq_length} is longer than the model accepts; "
                       f"using {tokenizer.model_max_length}")
        return tokenizer.model_max_length
    return data_args.max_seq_length


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


def finish(trainer: Trainer, model_args: ModelArguments, data_args: DataArguments, metrics: dict, script: str,
           argv: list[str] | None = None) -> None:
    """After a run that trained (--do_train; nothing otherwise): push to the Hub if asked, and write the model card
    (README.md: the model, `metrics`, the data set, the command line, secrets redacted) into --output_dir, on the main
    process only. Without the project's model_card module the card is skipped with a warning."""
    args = trainer.args
    if not args.do_train:
        return
    dataset, dataset_config = data_args.dataset_name, data_args.dataset_config_name
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


def leave_process_group() -> None:
    """The end of a distributed run (torchrun, accelerate launch), on every rank before the interpreter exits: what
    still holds the process group freed (the Trainer's DDP model outlives `main` in reference cycles), then the group
    left together. A gloo group torn down while the interpreter finalizes has aborted a rank ("terminate called without
    an active exception") after a run that had finished and saved."""
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
