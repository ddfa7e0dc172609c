"""Single queries as a server gets them: beside other work on the cores, and from several clients at once.

    python benchmarks/bench_serving.py --part busy          # batch-1 latency quiet, then with one core kept busy
    python benchmarks/bench_serving.py --part clients       # 1, 2 and 4 client threads sending single queries
    python benchmarks/bench_serving.py --part call          # the compiled call's own Python work, and its profile

all-MiniLM-L6-v2 (bench_engines.py's engines and their builders: 2 threads each, ONNX Runtime's without spinning,
OpenVINO's with a latency hint), float32. Queries: 1 x 16 tokens, and 1 x 16 padded from 12 real tokens, as a server
that pads to a fixed length sends them.

- busy: each engine's median latency over `--calls` calls per turn, engines in turns (the order reversed every round),
  first on the quiet machine, then with another process spinning on one core (a Python loop, started before and
  stopped after); the ratio busy / quiet. How much of the cores the process may use does not change: this is the
  neighbour a shared machine has.
- clients: for each engine in turn, `--clients` threads of this process (as a web server's workers call the model)
  each sending single queries back to back for `--seconds`; p50 and p99 latency and queries per second in all.
- call: `compile_for_inference`'s model on each query, its median latency; its program called directly on the inputs
  the call gives it (the call minus that is the call's own work, on the caches the program leaves behind, as a server
  meets it); the call with its program replaced by a stub that returns the program's outputs for the shape (its own
  work on warm caches); the three alternating; then cProfile's largest entries over the stubbed calls.
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engines  # noqa: E402
from bench_engines import Engine, loadavg, make_batch, minilm_dir, optional, torch_engine  # noqa: E402

from modeling_bert_impl import BertImplModel, compile_for_inference, optimize_for_inference  # noqa: E402
from modeling_bert_impl.inference.threads import QueryThreads  # noqa: E402

ENGINES = ["bert-impl optimized", "bert-impl compiled", "bert-impl compiled bf16", "ORT", "OpenVINO"]


def queries() -> dict:
    """The two single queries: dense 16 tokens, and 12 real tokens padded to 16."""
    generator = torch.Generator().manual_seed(0)
    dense = make_batch(torch.tensor([16]), 30522, generator)
    padded = make_batch(torch.tensor([12]), 30522, generator)
    padded = {k: torch.nn.functional.pad(v, (0, 4)) if k != "lengths" else v for k, v in padded.items()}
    return {"1 x 16": dense, "1 x 16 padded (12 real)": padded}


def build(names: list[str], workdir: str) -> dict:
    model = BertImplModel.from_pretrained(minilm_dir()).eval()
    builders = {
        "bert-impl optimized": lambda: torch_engine(optimize_for_inference(model)),
        "bert-impl compiled": lambda: torch_engine(compile_for_inference(model, os.path.join(workdir, "m.pt2"))),
        "bert-impl compiled bf16": lambda: bench_engines.bf16("bert-impl compiled bf16", lambda: torch_engine(
            compile_for_inference(model, os.path.join(workdir, "m_bf16.pt2"), dtype=torch.bfloat16))),
        "ORT": lambda: optional("ORT", "onnxruntime", lambda: bench_engines.ort_engine(minilm_dir(), workdir)),
        "OpenVINO": lambda: optional("OpenVINO", "openvino", lambda: bench_engines.openvino_engine(minilm_dir())),
    }
    engines = {name: builders[name]() for name in names}
    return {name: engine for name, engine in engines.items() if engine is not None}


def latencies(engine: Engine, inputs, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        engine.run(inputs)
        times.append(time.perf_counter() - start)
    return times


def turns(engines: dict, batch: dict, rounds: int, calls: int) -> dict:
    """name -> median ms over `rounds` turns of `calls` calls each, engines in turns, the order reversed each round."""
    prepared = {name: engine.prepare(batch) for name, engine in engines.items()}
    for name, engine in engines.items():  # warm up
        latencies(engine, prepared[name], 5)
    times = {name: [] for name in engines}
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            times[name] += latencies(engines[name], prepared[name], calls)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def busy_part(engines: dict, rounds: int, calls: int) -> None:
    rows = {}
    for query, batch in queries().items():
        print(f"{query}: quiet, load {loadavg()}")
        quiet = turns(engines, batch, rounds, calls)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(2)
            print(f"{query}: one core busy, load {loadavg()}")
            busy = turns(engines, batch, rounds, calls)
        finally:
            spinner.kill()
            spinner.wait()
        time.sleep(2)
        rows[query] = quiet, busy
    print("\n| engine | " + " | ".join(f"{q}: quiet, one core busy" for q in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name in engines:
        cells = [f"{quiet[name]:.2f} / {busy[name]:.2f} ms ({busy[name] / quiet[name]:.2f}x)"
                 for quiet, busy in rows.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


def clients_part(engines: dict, clients: list[int], seconds: float, threads: int) -> None:
    batch = queries()["1 x 16"]
    print("\n| engine | clients | p50 ms | p99 ms | queries/s |")
    print("|---|---:|---:|---:|---:|")
    for n in clients:
        for name, engine in engines.items():
            inputs = engine.prepare(batch)
            latencies(engine, inputs, 5)
            times, stop = [[] for _ in range(n)], time.perf_counter() + seconds

            def client(mine):
                torch.set_num_threads(threads)  # a thread's own OpenMP team
                while time.perf_counter() < stop:
                    start = time.perf_counter()
                    engine.run(inputs)
                    mine.append(time.perf_counter() - start)

            workers = [threading.Thread(target=client, args=(times[i],)) for i in range(n)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            every = sorted(t for mine in times for t in mine)
            p50, p99 = every[len(every) // 2] * 1e3, every[min(len(every) - 1, int(len(every) * 0.99))] * 1e3
            print(f"| {name} | {n} | {p50:.2f} | {p99:.2f} | {len(every) / seconds:.0f} |", flush=True)


def call_part(workdir: str, rounds: int, calls: int) -> None:
    model = compile_for_inference(BertImplModel.from_pretrained(minilm_dir()).eval(), os.path.join(workdir, "m.pt2"))
    encoder = model.compiled_encoder
    program, outputs, given = encoder.run, {}, {}

    def stub(args):  # the program's outputs for these inputs' shapes, computed once; the inputs kept
        key = tuple(a.shape for a in args)
        if key not in outputs:
            given[key], outputs[key] = list(args), program(args)
        return outputs[key]

    def median_us(inputs, run) -> float:
        encoder.run = run
        encoder.query_threads = QueryThreads()  # afresh: the stub's times would be its fastest
        times = []
        with torch.inference_mode():
            for _ in range(calls):
                start = time.perf_counter()
                model(**inputs)
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    def alone_us(args) -> float:  # the program called directly on the inputs the call gave it
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            program(list(args))
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    print("\n| query | the call (us) | its program alone (us) | the call's own work: call - program (us) | "
          "own work, program stubbed (warm caches; us) |\n|---|---:|---:|---:|---:|")
    for query, batch in queries().items():
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        given.clear(), outputs.clear()
        median_us(inputs, stub), median_us(inputs, program)  # warm up; the program's inputs kept
        (args,) = given.values()
        full, alone, own = [], [], []
        for _ in range(rounds):
            full.append(median_us(inputs, program))
            alone.append(alone_us(args))
            own.append(median_us(inputs, stub))
        full, alone = statistics.median(full), statistics.median(alone)
        print(f"| {query} | {full:.0f} | {alone:.0f} | {full - alone:.0f} | {statistics.median(own):.0f} |",
              flush=True)
    for query, batch in queries().items():
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        encoder.run, profile = stub, cProfile.Profile()
        with torch.inference_mode():
            profile.runcall(lambda: [model(**inputs) for _ in range(calls * rounds)])
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        print(f"\n{query}, {calls * rounds} stubbed calls under cProfile (its own cost included):")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip()
                        and not line.startswith(("   Ordered", "   List"))))
    encoder.run = program


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="*", default=["busy", "clients"], choices=["busy", "clients", "call"])
    parser.add_argument("--engines", nargs="*", default=ENGINES, choices=ENGINES)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=20, help="calls per engine's turn (busy, call)")
    parser.add_argument("--clients", nargs="*", type=int, default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=10.0, help="per engine and number of clients (clients)")
    parser.add_argument("--threads", type=int, default=bench_engines.THREADS,
                        help="torch's threads (each client thread's, with --part clients): the other engines keep 2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    print("command: python " + " ".join(sys.argv))
    print(f"torch {torch.__version__}; {args.threads} torch threads; {os.cpu_count()} CPUs "
          f"({torch.backends.cpu.get_cpu_capability()}); OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; "
          f"load {loadavg()}")
    with tempfile.TemporaryDirectory() as workdir:
        if "call" in args.part:
            call_part(workdir, args.rounds, args.calls)
        engines = build(args.engines, workdir) if {"busy", "clients"} & set(args.part) else {}
        if "busy" in args.part:
            busy_part(engines, args.rounds, args.calls)
        if "clients" in args.part:
            clients_part(engines, args.clients, args.seconds, args.threads)
    print(f"load after {loadavg()}")


if __name__ == "__main__":
    main()
