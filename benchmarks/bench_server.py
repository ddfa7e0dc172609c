"""HTTP embedding servers under closed-loop load, each alone on the machine in turn, all-MiniLM-L6-v2 on the CPU:

    python benchmarks/bench_server.py                       # every server, 1, 4, 16 and 64 clients, both workloads
    python benchmarks/bench_server.py --servers bert-impl infinity-onnx --clients 16 64 --seconds 20

Servers (each a process of its own on 127.0.0.1, started, warmed up, measured, stopped):
- bert-impl: `bert-impl-serve` as a user starts it (its default engine: bfloat16 where the CPU has bfloat16 units,
  else float32), `bert-impl fp32` (`--dtype float32`) and `bert-impl int8` (`--int8 --compile`, calibrated on 256
  sentences of the corpus's kind drawn with another seed);
- infinity-torch (float32), infinity-torch-int8 (torch's `quantize_dynamic`) and, where the CPU has bfloat16 units,
  infinity-torch-bf16: Infinity's torch engine;
  infinity-onnx: its ONNX Runtime engine (optimum) on a folder with the model's `model.onnx`, mean pooling. Infinity
  pins an older transformers, so `--infinity-venv` (default /tmp/bench-infinity-venv) gets its own virtual
  environment, made by this script where it is missing (infinity-emb with its torch and optimum extras, the CPU torch
  this machine's pip gives);
- st-fastapi: a FastAPI route around sentence-transformers' `encode`, one forward per request, as people write it.

Three more parts, bert-impl alone:

    python benchmarks/bench_server.py --part overhead      # one client: the server's p50 against the engine's own call
    python benchmarks/bench_server.py --part overload --seconds 300   # 64 clients past a queue of 16
    python benchmarks/bench_server.py --part engine --servers "bert-impl int8"   # the engine's own sentences/s

- overhead: single sentences one after another, through the server (one client) and through the same engine called in
  this process (tokenizer and forward, as the server's worker runs them), alternating in blocks of the same sentences
  (which goes first alternating too); p50 of each and the difference, and the median of the blocks' paired
  differences. Then the floor under any server behind uvicorn on the machine: the round trip of a plain ASGI app that
  answers a fixed embedding at once, asked by the same client right after each call of the engine in this process (as
  a server is asked after its model ran) and asked back to back.
- overload: `--max-concurrent-requests 16`, 64 clients each sending its own sentences back to back for `--seconds`;
  every answer is 200 or 429, each 200 is checked against its own sentence's embedding (computed first, one at a
  time; cosine at least 0.999, since in bfloat16 a sentence batched with others differs from it alone in the third
  digit), and the server's RSS is sampled every 10 s.
- engine: each bert-impl engine of `--servers` in this process, no server, on each workload's requests packed into
  batches as the server's worker packs them, back to back for `--seconds`: the ceiling of that engine's server here.

Beside other work, for every server's run alike:
- `--busy N`: N processes each keep a core busy (a Python loop) while the load runs, started once the server is up and
  warmed (a neighbour arriving on a running server).
- `--cpu-quota Q`: every server starts inside a cgroup of its own with a CPU quota of Q CPUs (cgroup v2's `cpu.max`,
  or v1's `cpu.cfs_quota_us`: a Kubernetes `limits: cpu`), the client outside it; the times the server was throttled
  are printed. Where no cgroup can be made (not root, no writable cpu controller), said and the run skipped.
- `--client parse`: each client parses every answer's JSON, as users' clients do (the default, `light`, reads the
  bytes only).

Every server gets OpenAI's embeddings request (`input`: a list of texts). Workloads: one sentence of 8..128 tokens a
request, and 1..32 such sentences a request, drawn with a fixed seed from a corpus of words of the model's vocabulary.
Each of `--clients` threads sends requests back to back over its own keep-alive connection for `--seconds` (at most
`--max-requests` each). Prints, per server, workload and client count: sentences/s, p50 and p99 latency, errors; the
ratio of bert-impl's sentences/s to the best other server's at the same point; and writes it all as JSON
(`--output`). The load generator shares the machine's cores with the server, the same for every server.
"""

import argparse
import http.client
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engines import loadavg, minilm_dir  # noqa: E402

from modeling_bert_impl.inference import cpu_bf16_units  # noqa: E402

INFINITY = "infinity-emb[server,torch,optimum]==0.0.78"
ST_FASTAPI = '''
import os
from fastapi import FastAPI
from sentence_transformers import SentenceTransformer

model = SentenceTransformer(os.environ["ST_MODEL"], device="cpu")
app = FastAPI()


@app.post("/v1/embeddings")
def embeddings(body: dict):
    texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
    vectors = model.encode(texts, normalize_embeddings=True)
    return {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                                       for i, v in enumerate(vectors)]}


@app.get("/health")
def health():
    return {}
'''
NOOP_APP = '''
BODY = (b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":['
        + b",".join([b"0.0123456"] * 384) + b']}],"model":"minilm","usage":{"prompt_tokens":1,"total_tokens":1}}')


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    message = await receive()
    while message.get("more_body"):
        message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": BODY})
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def corpus(tokenizer, count: int = 2000, seed: int = 0) -> list[str]:
    """Sentences of 8..128 tokens (with [CLS] and [SEP]) of whole words from the model's vocabulary."""
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2]
    words.sort()
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        target = rng.randint(8, 128)
        text = " ".join(rng.choice(words) for _ in range(target - 2))
        ids = tokenizer(text, truncation=True, max_length=target)["input_ids"]
        sentences.append(tokenizer.decode(ids[1:-1]))
    return sentences


def calibration_file(workdir: str) -> str:
    """The int8 engine's calibration texts, a line each, in `workdir`: texts like those served, not the ones
    measured."""
    path = os.path.join(workdir, "calibration.txt")
    with open(path, "w") as f:
        f.write("\n".join(corpus(transformers.AutoTokenizer.from_pretrained(minilm_dir()), count=256, seed=1)) + "\n")
    return path


def requests(sentences: list[str], workload: str, count: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    size = (lambda: 1) if workload == "single" else (lambda: rng.randint(1, 32))
    return [[rng.choice(sentences) for _ in range(size())] for _ in range(count)]


def infinity_python(venv: str) -> str:
    """The Python of Infinity's own virtual environment, made where it is missing."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", INFINITY], check=True)
    return python


def onnx_folder(workdir: str) -> str:
    """MiniLM's folder with its ONNX graph beside it (bert-impl-export's), for Infinity's ONNX Runtime engine."""
    folder = os.path.join(workdir, "minilm-onnx")
    if not os.path.exists(os.path.join(folder, "model.onnx")):
        shutil.copytree(minilm_dir(), folder, dirs_exist_ok=True)
        subprocess.run([sys.executable, "-m", "modeling_bert_impl.integrations.export", minilm_dir(),
                        os.path.join(workdir, "onnx"), "--overwrite"], check=True, capture_output=True)
        shutil.copy(os.path.join(workdir, "onnx", "model.onnx"), os.path.join(folder, "model.onnx"))
    return folder


def commands(args, port: int, workdir: str) -> dict:
    """server name -> (its command, the route of OpenAI's embeddings request, the folder it starts in)."""
    model = minilm_dir()
    bin_dir = os.path.dirname(sys.executable)
    serve = [os.path.join(bin_dir, "bert-impl-serve"), model, "--port", str(port), *args.serve_args.split()]
    calibration = calibration_file(workdir)
    out = {"bert-impl": (serve, "/v1/embeddings", None),
           "bert-impl fp32": (serve + ["--dtype", "float32"], "/v1/embeddings", None),
           "bert-impl int8": (serve + ["--int8", "--calibration", calibration, "--compile"], "/v1/embeddings", None)}
    if any(name.startswith("infinity") for name in args.servers):
        python = infinity_python(args.infinity_venv)
        infinity = [os.path.join(os.path.dirname(python), "infinity_emb"), "v2", "--host", "127.0.0.1", "--port",
                    str(port), "--device", "cpu", "--no-model-warmup"]
        out["infinity-torch"] = (infinity + ["--model-id", model, "--engine", "torch"], "/embeddings", None)
        out["infinity-torch-int8"] = (infinity + ["--model-id", model, "--engine", "torch", "--dtype", "int8"],
                                      "/embeddings", None)
        if cpu_bf16_units():
            out["infinity-torch-bf16"] = (infinity + ["--model-id", model, "--engine", "torch", "--dtype",
                                                      "bfloat16"], "/embeddings", None)
        if "infinity-onnx" in args.servers:
            # started in the folder, as ".": Infinity hands optimum the ONNX file's path as it found it, and optimum
            # takes only a name relative to the folder
            out["infinity-onnx"] = (infinity + ["--model-id", ".", "--engine", "optimum", "--pooling-method", "mean"],
                                    "/embeddings", onnx_folder(workdir))
    script = os.path.join(workdir, "st_fastapi.py")
    with open(script, "w") as f:
        f.write(ST_FASTAPI)
    out["st-fastapi"] = ([sys.executable, "-m", "uvicorn", "--app-dir", workdir, "st_fastapi:app", "--port",
                          str(port), "--log-level", "warning"], "/v1/embeddings", None)
    return out


class CpuQuota:
    """A cgroup of this benchmark's own with a CPU quota of `cpus` CPUs (v2 where the cpu controller is there, else
    v1), which the servers start in (`enter`, as a process's `preexec_fn`); `throttled()` reads its counts. `error`:
    why none could be made (then nothing else works)."""

    def __init__(self, cpus: float, root: str = "/sys/fs/cgroup"):
        self.folder, self.error = None, None
        name = f"bench-server-{os.getpid()}"
        v2 = os.path.exists(os.path.join(root, "cgroup.controllers"))
        try:
            if v2:
                with open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
                    f.write("+cpu")
                self.folder = os.path.join(root, name)
                os.mkdir(self.folder)
                with open(os.path.join(self.folder, "cpu.max"), "w") as f:
                    f.write(f"{round(cpus * 100000)} 100000")
            else:
                self.folder = os.path.join(root, "cpu", name)
                os.mkdir(self.folder)
                with open(os.path.join(self.folder, "cpu.cfs_quota_us"), "w") as f:
                    f.write(str(round(cpus * int(open(os.path.join(self.folder, "cpu.cfs_period_us")).read()))))
        except OSError as error:
            self.error = f"no cgroup with a CPU quota can be made here ({error}); the --cpu-quota run is skipped"
            self.remove()

    def enter(self) -> None:
        with open(os.path.join(self.folder, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def throttled(self) -> dict:
        with open(os.path.join(self.folder, "cpu.stat")) as f:
            return {k: int(v) for k, v in (line.split() for line in f)}

    def remove(self) -> None:
        if self.folder is not None and os.path.isdir(self.folder):
            for _ in range(50):  # the server's process leaves the cgroup a moment after it exits
                try:
                    os.rmdir(self.folder)
                    return
                except OSError:
                    time.sleep(0.1)


def start(command: list[str], port: int, cwd: str | None = None, quota: CpuQuota | None = None) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "INFINITY_ANONYMOUS_USAGE_STATS": "0", "ST_MODEL": minilm_dir()}  # st-fastapi's model
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a server logging every request would fill a pipe and stall
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=quota.enter if quota else None)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{command[0]} exited: {log.read()[-2000:]}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{command[0]} did not answer /health in 300 s")


BUSY = "while True: pass"  # a neighbour keeping a core busy


def busy(count: int) -> list[subprocess.Popen]:
    """`count` processes, each keeping a core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]


def load(port: int, route: str, work: list[list[list[str]]], seconds: float, parse: bool = False) -> dict:
    """Closed loop: each client sends its requests back to back until `seconds` pass; latencies and sentences.
    `parse`: each answer's JSON parsed (and its count of embeddings checked), as users' clients do."""
    latencies, sentences, errors = [], [0], [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(requests_of_client):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for texts in requests_of_client:
            if time.monotonic() > stop_at:
                break
            body = json.dumps({"input": texts, "model": "minilm"})
            start_time = time.perf_counter()
            try:
                connection.request("POST", route, body, {"content-type": "application/json"})
                response = connection.getresponse()
                answer = response.read()
                ok = response.status == 200 and (not parse or len(json.loads(answer)["data"]) == len(texts))
            except OSError:
                ok = False
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            elapsed = time.perf_counter() - start_time
            with lock:
                if ok:
                    latencies.append(elapsed)
                    sentences[0] += len(texts)
                else:
                    errors[0] += 1

    threads = [threading.Thread(target=client, args=(w,)) for w in work]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    latencies.sort()

    def pick(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3 if latencies else float("nan")

    return {"sentences_per_s": sentences[0] / wall, "p50_ms": pick(0.5), "p99_ms": pick(0.99),
            "requests": len(latencies), "errors": errors[0]}


def post(connection, route: str, texts: list[str]) -> tuple[int, dict | None]:
    connection.request("POST", route, json.dumps({"input": texts, "model": "minilm"}),
                       {"content-type": "application/json"})
    response = connection.getresponse()
    body = response.read()
    return response.status, json.loads(body) if response.status == 200 else None


def overhead(sentences: list[str], rounds: int = 50, block: int = 10):
    """p50 of one sentence through the server with one client, and through the same engine in this process; and the
    median over rounds of the difference between the two's block medians, each round's block of the same sentences
    (the model's own time drifts by a millisecond between runs on a shared machine: pairing takes the drift out).
    Then the floor under any server behind uvicorn here: a plain ASGI app answering a fixed embedding at once, asked
    right after each engine call (the cores' state a server meets after its model ran) and back to back."""
    from modeling_bert_impl.server.engine import Engine, EngineChoice

    port = free_port()
    process = start([os.path.join(os.path.dirname(sys.executable), "bert-impl-serve"), minilm_dir(), "--port",
                     str(port)], port)
    engine = Engine(minilm_dir(), EngineChoice())  # on torch's threads as the engine sized them
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    times = {"server": [], "engine": []}
    paired = []
    rng = random.Random(3)
    try:
        for round_ in range(rounds):
            texts = [[rng.choice(sentences)] for _ in range(block)]
            medians = {}
            for name in ("server", "engine") if round_ % 2 else ("engine", "server"):
                block_times = []
                for text in texts:
                    start_time = time.perf_counter()
                    if name == "server":
                        assert post(connection, "/v1/embeddings", text)[0] == 200
                    else:
                        engine.run(engine.encode(text))
                    block_times.append(time.perf_counter() - start_time)
                times[name] += block_times
                medians[name] = statistics.median(block_times)
            paired.append(medians["server"] - medians["engine"])
    finally:
        process.terminate()
        process.wait(timeout=60)
    p50 = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"one sentence of 8..128 tokens, {engine.info()['model_dtype']}: server p50 {p50['server']:.2f} ms, engine's "
          f"own call p50 {p50['engine']:.2f} ms: the server adds {p50['server'] - p50['engine']:.2f} ms; paired by "
          f"round (the same sentences): {statistics.median(paired) * 1e3:.2f} ms (load {loadavg()})")
    with tempfile.TemporaryDirectory() as workdir:
        with open(os.path.join(workdir, "noop_app.py"), "w") as f:
            f.write(NOOP_APP)
        port = free_port()
        process = start([sys.executable, "-m", "uvicorn", "--app-dir", workdir, "noop_app:app", "--port", str(port),
                         "--log-level", "warning", "--no-access-log"], port)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        after, back_to_back = [], []
        try:
            for _ in range(rounds * block):
                text = [rng.choice(sentences)]
                engine.run(engine.encode(text))
                start_time = time.perf_counter()
                assert post(connection, "/v1/embeddings", text)[0] == 200
                after.append(time.perf_counter() - start_time)
            for _ in range(rounds * block):
                start_time = time.perf_counter()
                assert post(connection, "/v1/embeddings", [rng.choice(sentences)])[0] == 200
                back_to_back.append(time.perf_counter() - start_time)
        finally:
            process.terminate()
            process.wait(timeout=60)
    print(f"a plain ASGI app answering a fixed embedding at once, the same client: p50 "
          f"{statistics.median(after) * 1e3:.2f} ms asked right after each engine call, "
          f"{statistics.median(back_to_back) * 1e3:.2f} ms asked back to back (load {loadavg()})")


def engine_alone(sentences: list[str], args) -> None:
    """Each bert-impl engine of `--servers` called in this process, no server: each workload's requests packed as the
    server's worker packs them (whole requests up to its batch of tokens, tokenized before timing) and run back to back
    for `--seconds`: the most sentences/s a server of that engine could answer on this machine."""
    from modeling_bert_impl.server.app import BATCH_TOKENS
    from modeling_bert_impl.server.batching import Batcher
    from modeling_bert_impl.server.engine import Engine, EngineChoice

    with tempfile.TemporaryDirectory() as workdir:
        choices = {"bert-impl": EngineChoice(), "bert-impl fp32": EngineChoice(dtype="float32"),
                   "bert-impl int8": EngineChoice(int8_calibration=calibration_file(workdir), compile=True)}
        for name in [s for s in args.servers if s in choices]:
            engine = Engine(minilm_dir(), choices[name])  # on torch's threads as the engine sized them
            for workload in args.workloads:
                batcher = Batcher(engine.run, BATCH_TOKENS["cpu"], None, math.inf)  # its worker not started
                for request in requests(sentences, workload, 2000, seed=7):
                    batcher.submit(engine.encode(request))
                batches = []
                with batcher.ready:
                    while batcher.queue:
                        batches.append([e for job in batcher.take() for e in job.encodings])
                engine.run(batches[0])  # warm-up
                done, began = 0, time.perf_counter()
                while time.perf_counter() - began < args.seconds:
                    for batch in batches:
                        engine.run(batch)
                        done += len(batch)
                        if time.perf_counter() - began >= args.seconds:
                            break
                print(f"{name:20s} {workload:6s} engine alone, batches of up to {BATCH_TOKENS['cpu']} tokens: "
                      f"{done / (time.perf_counter() - began):8.1f} sentences/s (load {loadavg()})", flush=True)
            engine.close()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def overload(sentences: list[str], seconds: float, clients: int = 64):
    """64 clients past a queue of 16: every answer 200 or 429, each 200 its own sentence's, RSS sampled."""
    port = free_port()
    process = start([os.path.join(os.path.dirname(sys.executable), "bert-impl-serve"), minilm_dir(), "--port",
                     str(port), "--max-concurrent-requests", "16"], port)
    mine = [sentences[i::clients][:20] for i in range(clients)]  # each client's own sentences
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    expected = {t: post(connection, "/v1/embeddings", [t])[1]["data"][0]["embedding"] for own in mine for t in own}
    counts = {"200": 0, "429": 0, "other": 0, "wrong": 0}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    rss = [(0, rss_mb(process.pid))]

    def client(texts):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        i = 0
        while time.monotonic() < stop_at:
            text = texts[i % len(texts)]
            i += 1
            status, body = post(conn, "/v1/embeddings", [text])
            with lock:
                if status == 200:
                    counts["200"] += 1
                    got = body["data"][0]["embedding"]  # unit vectors: their dot product is their cosine
                    if sum(a * b for a, b in zip(got, expected[text])) < 0.999:
                        counts["wrong"] += 1
                else:
                    counts["429" if status == 429 else "other"] += 1

    threads = [threading.Thread(target=client, args=(own,)) for own in mine]
    began = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(10)
        rss.append((round(time.monotonic() - began), rss_mb(process.pid)))
    process.terminate()
    process.wait(timeout=60)
    print(f"overload, {clients} clients for {seconds:.0f} s, queue of 16: {counts} (wrong: a 200 whose embedding is "
          f"not its own sentence's: cosine below 0.999); RSS MB every 10 s: {[round(r) for _, r in rss]}; "
          f"max {max(r for _, r in rss):.0f} (load {loadavg()})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["servers", "overhead", "overload", "engine"], default="servers")
    parser.add_argument("--servers", nargs="+", default=["bert-impl", "bert-impl fp32", "bert-impl int8",
                                                         "infinity-torch", "infinity-torch-bf16", "infinity-torch-int8",
                                                         "infinity-onnx", "st-fastapi"])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--workloads", nargs="+", default=["single", "multi"], choices=["single", "multi"])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--max-requests", type=int, default=5000, help="per client, at most")
    parser.add_argument("--busy", type=int, default=0, help="processes keeping a core busy each while the load runs")
    parser.add_argument("--cpu-quota", type=float, default=None,
                        help="start every server in a cgroup with a quota of this many CPUs (root, cgroup v1 or v2)")
    parser.add_argument("--client", choices=["light", "parse"], default="light",
                        help="parse: each client parses every answer's JSON")
    parser.add_argument("--infinity-venv", default="/tmp/bench-infinity-venv")
    parser.add_argument("--serve-args", default="",
                        help="more flags for bert-impl-serve, e.g. '--max-batch-tokens 4096'")
    parser.add_argument("--output", default=None, help="a JSON file for the results")
    parser.add_argument("--plot", default=None, help="a PNG of sentences/s against p99, a panel per workload")
    args = parser.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    sentences = corpus(tokenizer)
    if args.part == "overhead":
        return overhead(sentences)
    if args.part == "overload":
        return overload(sentences, args.seconds)
    if args.part == "engine":
        return engine_alone(sentences, args)
    quota = None if args.cpu_quota is None else CpuQuota(args.cpu_quota)
    if quota is not None and quota.error:
        print(quota.error)
        return
    print(f"# {os.uname().machine}, {os.cpu_count()} CPUs, bfloat16 units: {cpu_bf16_units()}; loadavg {loadavg()}; "
          f"beside: {args.busy} busy cores, CPU quota {args.cpu_quota}, client {args.client}")
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        port = free_port()
        table = commands(args, port, workdir)
        try:
            for name in [s for s in args.servers if s in table]:
                results += measure(name, table[name], port, sentences, args, quota)
        finally:
            if quota is not None:
                quota.remove()
    print("\n# bert-impl's sentences/s against the best other server at each point (and its p99 against that one's)")
    for workload in args.workloads:
        for clients in args.clients:
            rows = {r["server"]: r for r in results if r["workload"] == workload and r["clients"] == clients}
            others = [r for n, r in rows.items() if not n.startswith("bert-impl")]
            ours = [r for n, r in rows.items() if n.startswith("bert-impl")]
            if others and ours:
                best = max(others, key=lambda r: r["sentences_per_s"])
                mine = max(ours, key=lambda r: r["sentences_per_s"])
                ratio = mine["sentences_per_s"] / best["sentences_per_s"]
                print(f"{workload:6s} {clients:3d} clients: {mine['server']} {ratio:.2f}x {best['server']}, "
                      f"p99 {mine['p99_ms']:.0f} vs {best['p99_ms']:.0f} ms")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.workloads, args.plot)


def measure(name: str, server: tuple, port: int, sentences: list[str], args, quota: CpuQuota | None) -> list[dict]:
    """One server started (in `quota`'s cgroup where given), warmed up, measured at each workload and client count
    (beside `--busy` busy cores), stopped; its rows."""
    command, route, cwd = server
    process = start(command, port, cwd, quota)
    rows = []
    try:
        load(port, route, [requests(sentences, "multi", 20, seed=99)], 60)  # warm-up: every shape once
        for workload in args.workloads:
            for clients in args.clients:
                work = [requests(sentences, workload, args.max_requests, seed=1000 * clients + c)
                        for c in range(clients)]
                before = quota.throttled() if quota else None
                neighbours = busy(args.busy)
                try:
                    row = {"server": name, "workload": workload, "clients": clients,
                           **load(port, route, work, args.seconds, args.client == "parse"), "loadavg": loadavg()}
                finally:
                    for neighbour in neighbours:
                        neighbour.kill()
                        neighbour.wait()
                throttled = ""
                if quota:
                    after = quota.throttled()
                    row["throttled_periods"] = after["nr_throttled"] - before["nr_throttled"]
                    row["periods"] = after["nr_periods"] - before["nr_periods"]
                    throttled = f"  throttled {row['throttled_periods']} of {row['periods']} periods"
                rows.append(row)
                print(f"{name:20s} {workload:6s} {clients:3d} clients: {row['sentences_per_s']:8.1f} "
                      f"sentences/s  p50 {row['p50_ms']:8.1f} ms  p99 {row['p99_ms']:8.1f} ms  "
                      f"errors {row['errors']}{throttled}  (load {row['loadavg']})", flush=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
    return rows


def plot(results: list[dict], workloads: list[str], path: str) -> None:
    """Each server's points (one per client count) of sentences/s against p99 latency."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for server in dict.fromkeys(r["server"] for r in results):
            rows = [r for r in results if r["server"] == server and r["workload"] == workload]
            ax.plot([r["p99_ms"] for r in rows], [r["sentences_per_s"] for r in rows], marker="o", label=server)
            for r in rows:
                ax.annotate(str(r["clients"]), (r["p99_ms"], r["sentences_per_s"]), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("p99 latency (ms, log scale); points labelled by clients")
        ax.set_ylabel("sentences/s")
        ax.set_title("one sentence a request" if workload == "single" else "1..32 sentences a request")
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
