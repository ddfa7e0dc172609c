"""A data-parallel pre-training step under torchrun: DistributedDataParallel over the processes, NCCL on CUDA (one GPU
per process), gloo on CPU.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_ddp.py --preset base --seq_len 128   # 2 GPUs
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_ddp.py --device cpu --preset tiny --seq_len 32

Each process builds the same `BertImplForPreTraining` (same seed), takes its own full-length batches (as
bench_model.py's MFU step: [CLS] A [SEP] B [SEP], 15% masked, the MLM decoder on the masked rows) and runs training
steps (bf16 autocast on CUDA). After the steps it checks what DDP promises: every process holds the same weights
(their checksum all-reduced; the largest difference from rank 0's is printed). Rank 0 prints the median step time,
the tokens/s of all processes together, and on CUDA the MFU per GPU (bench_model.model_flops).
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import batch_from_lengths, datasheet_peak_flops, model_flops, synchronize  # noqa: E402

from modeling_bert_impl import BertImplConfig, BertImplForPreTraining  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=None, help="per process (default: 32768 tokens / seq_len "
                                                                     "on CUDA, 4 on CPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        torch.set_num_threads(1)
        device = "cpu"
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    batch_size = args.batch_size or (32768 // args.seq_len if args.device == "cuda" else 4)

    config = BertImplConfig.from_preset(args.preset, sparse_prediction=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(BertImplForPreTraining(config).to(device).train())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    generator = torch.Generator().manual_seed(1 + rank)  # each process its own batches
    batches = [batch_from_lengths(torch.full((batch_size,), args.seq_len), config.vocab_size, generator, device)
               for _ in range(2)]

    def step(batch):
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(args.warmup):
        step(batches[i % 2])
    times, losses = [], []
    for i in range(args.steps):
        synchronize(args.device)
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(batches[i % 2]))
        synchronize(args.device)
        times.append(time.perf_counter() - start)

    # Same weights everywhere: each parameter's largest difference from rank 0's copy.
    drift = torch.zeros((), device=device)
    for p in model.parameters():
        reference = p.detach().clone()
        dist.broadcast(reference, src=0)
        drift = torch.maximum(drift, (p.detach() - reference).abs().max().float())
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    finite = torch.tensor(float(all(torch.isfinite(loss).item() for loss in losses)), device=device)
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    step_time = statistics.median(times)
    masked = int((batches[0]["labels"] != -100).sum())
    flops = model_flops(config, [args.seq_len] * batch_size, masked)
    if rank == 0:
        print(f"DDP {world} processes ({'NCCL, ' + torch.cuda.get_device_name() if args.device == 'cuda' else 'gloo, CPU'}"
              f"), preset {args.preset}, {batch_size} x {args.seq_len} tokens per process, "
              f"{'bf16 autocast' if args.device == 'cuda' else 'fp32'}")
        print(f"  step time (median of {args.steps}): {1e3 * step_time:,.1f} ms; {world * batch_size * args.seq_len / step_time:,.0f} "
              f"tokens/s over all processes; losses finite: {bool(finite.item())}; last loss {losses[-1].item():.4f}")
        peak = datasheet_peak_flops(torch.cuda.get_device_name()) if args.device == "cuda" else None
        if peak:
            print(f"  MFU per GPU: {flops / step_time / peak:.1%} of {peak / 1e12:.0f} TFLOP/s")
        print(f"  weights after {args.warmup + args.steps} steps, largest difference from rank 0: {drift.item():.1e}")
    dist.barrier()
    dist.destroy_process_group()
    ok = drift.item() == 0 and finite.item()
    if not ok:
        print("DDP check failed: the processes' weights differ, or a loss was not finite", file=sys.stderr)
    # Leave at once, with this function's objects alive: freeing them (the DDP reducer, with the gloo process group)
    # hung a process for good now and then (1 run in 4 on CPU, torch 2.13), after all its work was done.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
