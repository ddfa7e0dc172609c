"""The GPU check's logic on the CPU: the MFU numerator against torch's own FLOP counter, and `gpu_check.py
--device cpu` end to end on its 2-process DDP part (gloo), results file included."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import modeling_bert_impl as bi

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_model  # noqa: E402
import gpu_check  # noqa: E402


@pytest.mark.parametrize("lengths", [[40, 40, 40], [16] * 5])
def test_model_flops_equal_torch_flop_counter(lengths):
    """bench_model.model_flops (the MFU numerator) for a pre-training step with sparse prediction, forward and
    backward, equals what torch.utils.flop_counter counts for the same step (every mm, addmm, bmm) on a full-length
    batch, as the MFU step runs."""
    config = bi.BertImplConfig(vocab_size=1500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=96, sparse_prediction=True)
    torch.manual_seed(0)
    model = bi.BertImplForPreTraining(config)
    model.set_attn_implementation("eager")  # attention as two bmm, which the counter counts exactly
    batch = bench_model.batch_from_lengths(torch.tensor(lengths), config.vocab_size, torch.Generator().manual_seed(0), "cpu")
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    masked = int((batch["labels"] != -100).sum())
    assert counter.get_total_flops() == bench_model.model_flops(config, lengths, masked)


@pytest.mark.slow
def test_gpu_check_cpu_runs_the_ddp_part_and_writes_its_results(tmp_path):
    """`python benchmarks/gpu_check.py --device cpu --part ddp`: the environment section, and the 2-process gloo DDP
    pre-training step, which ends with the same weights in both processes."""
    code = gpu_check.main(["--device", "cpu", "--part", "ddp", "--out", str(tmp_path), "--no-install"])
    text = (tmp_path / "gpu_check_cpu.md").read_text()
    assert code == 0, text
    assert "summary: ddp ok" in text and "## env" in text and "GPUs: 0" in text
    assert "DDP 2 processes (gloo, CPU)" in text
    assert "largest difference from rank 0: 0.0e+00" in text and "losses finite: True" in text


def test_gpu_check_on_one_gpu_says_the_ddp_step_was_not_run(monkeypatch):
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 1)
    assert gpu_check.part_command("ddp", "cuda") == (
        "not run: this machine has 1 GPU; the 2-process DDP step needs 2 or more")
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 2)
    assert "--nproc_per_node" in gpu_check.part_command("ddp", "cuda")


def test_the_bf16_parts_run_where_the_cpu_has_bf16_units_and_say_why_not_elsewhere(monkeypatch, tmp_path):
    """Each bf16_* part: "not run" naming the missing units on a CPU without them; where it has them, its command, and
    "not run" naming `datasets` for the recipe parts where that is missing."""
    def probe(has_datasets, units):
        gpu_check.bf16_host.cache_clear()  # the host is probed once a run: this test gives it three hosts
        return lambda command, timeout, env=None: (0, f"{has_datasets}\n{units}\n", 0.1)

    bf16_parts = [part for part in gpu_check.PARTS if part.startswith("bf16_")]
    monkeypatch.setattr(gpu_check, "run", probe(True, None))
    for part in bf16_parts:
        assert gpu_check.part_command(part, "cuda", tmp_path, {}).startswith("not run: this CPU has neither AMX nor")
    monkeypatch.setattr(gpu_check, "run", probe(True, "AMX"))
    for part in bf16_parts:
        assert isinstance(gpu_check.part_command(part, "cuda", tmp_path, {}), list), part
    monkeypatch.setattr(gpu_check, "run", probe(False, "AMX"))
    assert gpu_check.part_command("bf16_ttq", "cuda", tmp_path, {}).startswith("not run: `datasets` is not installed")
    assert "tests/test_pretraining.py" not in gpu_check.part_command("bf16_tests", "cuda", tmp_path, {})
    gpu_check.bf16_host.cache_clear()


def test_a_carried_datasets_archive_is_unpacked_onto_the_parts_pythonpath(tmp_path, monkeypatch):
    """--prepare-datasets' archive, carried beside the wheels, is unpacked once, and the folder it gives is what the
    bf16 probe (and so the recipe parts) import `datasets` from."""
    assert gpu_check.carried_site(tmp_path) is None
    package = tmp_path / "build" / "datasets-site" / "carried_probe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("WHERE = 'carried'\n")
    with tarfile.open(tmp_path / gpu_check.DATASETS_SITE, "w:xz") as tar:
        tar.add(package.parent, arcname="datasets-site")
    site = gpu_check.carried_site(tmp_path)
    assert site == tmp_path / "datasets-site"
    probe = subprocess.run([sys.executable, "-c", "import carried_probe; print(carried_probe.WHERE)"],
                           env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "carried"

    seen = []
    monkeypatch.setattr(gpu_check, "run", lambda command, timeout, env=None: seen.append(env) or (0, "True\nAMX\n", 0))
    gpu_check.bf16_host.cache_clear()
    assert gpu_check.part_command("bf16_recipe", "cuda", tmp_path, {"PYTHONPATH": f"{site}"})[1].endswith(
        "bench_pretraining_recipe.py")
    assert seen == [{"PYTHONPATH": str(site)}]
    gpu_check.bf16_host.cache_clear()


def test_the_lease_fits_one_device_call_and_the_glue_part_needs_datasets(monkeypatch, tmp_path):
    """--lease's limits leave a minute of a 10-minute call for the start and the environment; the glue part runs
    bench_finetune.py where `datasets` imports, and says why not elsewhere."""
    assert set(gpu_check.LEASE) <= set(gpu_check.PARTS) and sum(gpu_check.LEASE.values()) <= 540
    monkeypatch.setattr(gpu_check, "importable", lambda module, pythonpath="": False)
    assert gpu_check.part_command("glue", "cuda", tmp_path, {}).startswith("not run: `datasets` is not installed")
    monkeypatch.setattr(gpu_check, "importable", lambda module, pythonpath="": True)
    command = gpu_check.part_command("glue", "cuda", tmp_path, {})
    assert command[1] == "benchmarks/bench_finetune.py" and command[command.index("--model") + 1] == "base"
    assert "--repadded" in gpu_check.part_command("bench", "cuda")
