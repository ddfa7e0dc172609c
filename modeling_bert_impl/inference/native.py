"""The engine's C++ pieces (csrc/), built where they are used with the C++ compiler inductor uses, once per source,
torch release and flags, into inductor's cache directory (`TORCHINDUCTOR_CACHE_DIR`): the AVX2 kernels (avx2_gemm.py)
and what a compiled model's call checks and runs (csrc/quick_call.cpp: `Snapshot`, used by frozen_model.py;
`SingleQuery` and `Program`, by compiled_encoder.py)."""

import functools
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

from ..input_checks import TRACING_SUPPORTED
from .threads import usable_cpus

CSRC = Path(__file__).with_name("csrc")
logger = logging.getLogger(__name__)


def torch_flags(*libraries: str) -> list[str]:
    """Compile and link against this torch: its headers, ABI and `libraries`."""
    library = cpp_extension.library_paths()[0]
    return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(flag for path in cpp_extension.include_paths() for flag in ("-I", path)),
            "-L", library, *(f"-l{name}" for name in libraries), f"-Wl,-rpath,{library}"]


def build(source: Path, flags: list[str], suffix: str = ".so") -> str:
    """The shared object of `source` built with `flags`, in inductor's cache directory, compiled there first if it is
    not: its name holds a hash of the source, the torch release and the flags. Written to a temporary name and renamed,
    so that processes building it at once never load half a file. RuntimeError where the compiler fails."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = hashlib.sha256("\n".join([source.read_text(), torch.__version__, *flags]).encode()).hexdigest()[:20]
    folder = os.path.join(cache_dir(), "bert_impl")
    target = os.path.join(folder, f"{source.stem}_{key}{suffix}")
    if not os.path.exists(target):
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            written = os.path.join(scratch, source.stem + suffix)
            compiler = get_cpp_compiler()
            done = subprocess.run([compiler, str(source), "-o", written, *flags], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} could not build {source}: {done.stderr.strip()[-2000:]}")
            os.replace(written, target)
    return target


@functools.cache
def quick_call():
    """csrc/quick_call.cpp's module, built and imported; None where it cannot be (not Linux, no compiler, no Python
    headers: the checks stay in Python, logged once at INFO)."""
    if sys.platform != "linux":
        return None
    flags = ["-O2", "-shared", "-fPIC", "-std=c++20", "-w", "-I", sysconfig.get_paths()["include"],
             *torch_flags("c10", "torch_cpu", "torch_python"),
             *(["-DRUNNERS_ARGUMENT"] if TRACING_SUPPORTED else [])]  # the releases whose loader takes a count
    try:
        path = build(CSRC / "quick_call.cpp", flags, sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        spec = importlib.util.spec_from_file_location("quick_call", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as error:
        logger.info("bert-impl: the compiled model's checks stay in Python (quick_call.cpp not built: %s)", error)
        return None
    return module


def snapshot(tensors: list = (), dicts: list = ()):
    """`quick_call().Snapshot` of these (csrc/quick_call.cpp), or None where the module cannot be built."""
    module = quick_call()
    return None if module is None else module.Snapshot(list(tensors), list(dicts))


def program(package_path: str):
    """An AOTInductor package's program: a callable of a list of input tensors, returning the list of outputs.
    `quick_call().Program`, which releases the GIL while it runs and runs as many calls at once as the process may run
    threads (`usable_cpus`: a server's model streams), or AOTInductor's own loader (which holds the GIL, one call at a
    time) where the module cannot be built."""
    module = quick_call()
    if module is None:
        return torch._inductor.aoti_load_package(package_path).loader.boxed_run
    return module.Program(package_path, usable_cpus())
