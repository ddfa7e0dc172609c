"""Fetches transformers' own common model tests for tests/test_transformers_common.py. They ship in transformers' sdist,
not its wheel: this downloads the sdist of the INSTALLED transformers from the package registry (`pip download`) and
keeps its top-level `tests/*.py` in `tests/.transformers/<version>/hf_common_tests/` (git-ignored), with minimal
stand-ins for three helpers the sdist leaves out (`_STAND_INS`). Run it after installing, before the suite (the
README's test command does):

    python tests/fetch_transformers_tests.py

The folder is complete or absent (written aside, then renamed), under a file lock so that two runs at once neither
collide nor fetch twice; with the folder there, it does nothing. Exit status 1, with pip's last words, when the
registry cannot be reached."""

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers
from filelock import FileLock

VERSION = transformers.__version__
PACKAGE = "hf_common_tests"  # the sdist's tests/ folder, imported under this name
HERE = Path(__file__).resolve().parent / ".transformers"

# Modules the sdist's test_modeling_common.py / test_configuration_common.py import but the sdist does not ship.
_STAND_INS = {
    # Export tests (torch.export, ONNX, transformers.exporters) are run by the project's own tests/test_export.py.
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    # BERT does not generate: the mixin only checks that such a model's tester does not inherit the generation tests.
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    # ConfigTester.check_config_arguments_init: common PreTrainedConfig arguments, each away from its default.
    "utils/test_configuration_utils.py": """\
config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertImplForMaskedLM"],
    "finetuning_task": "translation",
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
    "tokenizer_class": "BertImplTokenizer",
    "prefix": "prefix",
    "bos_token_id": 6,
    "eos_token_id": 8,
    "sep_token_id": 9,
    "decoder_start_token_id": 10,
}
""",
}


def tests_folder() -> Path:
    """The folder that holds `hf_common_tests/` for the installed transformers (fetched or not)."""
    return HERE / VERSION


def fetched() -> bool:
    return (tests_folder() / PACKAGE / "test_modeling_common.py").is_file()


def fetch() -> Path:
    """Download and unpack the tests once; returns tests_folder(). Raises RuntimeError when pip cannot fetch."""
    root = tests_folder()
    HERE.mkdir(exist_ok=True)
    with FileLock(str(HERE / f"{VERSION}.lock")):
        if fetched():
            return root
        with tempfile.TemporaryDirectory(dir=HERE) as tmp:
            dest = Path(tmp) / "sdist"
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                 "--no-binary", ":all:", "--retries", "1", "--timeout", "30", "-d", str(dest),
                 f"transformers=={VERSION}"], capture_output=True, text=True, timeout=300)
            files = list(dest.glob("*")) if dest.is_dir() else []
            if proc.returncode != 0 or len(files) != 1:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"pip could not download the transformers {VERSION} sdist: {last}")
            staged = Path(tmp) / "staged"
            package = staged / PACKAGE
            with tarfile.open(files[0]) as tar:
                for member in tar.getmembers():
                    parts = Path(member.name).parts  # transformers-X/tests/name.py: the top-level test modules
                    if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                        package.mkdir(parents=True, exist_ok=True)
                        (package / parts[2]).write_bytes(tar.extractfile(member).read())
            if not (package / "test_modeling_common.py").is_file():
                raise RuntimeError(f"the transformers {VERSION} sdist has no tests/test_modeling_common.py")
            (package / "__init__.py").touch()
            for name, text in _STAND_INS.items():
                (package / name).parent.mkdir(exist_ok=True)
                (package / name).parent.joinpath("__init__.py").touch()
                (package / name).write_text(text)
            shutil.rmtree(root, ignore_errors=True)
            os.replace(staged, root)
    return root


if __name__ == "__main__":
    try:
        print(f"transformers {VERSION}'s common tests in {fetch()}")
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        sys.exit(f"fetch_transformers_tests: {error}")
