"""The features that need a newer torch than the model does, in one table, and the check each makes where it is called.

pyproject.toml allows every torch on which the model, training, saving and loading, PEFT, pipelines and
sentence-transformers work; a feature that is wrong or fails on the older of those releases refuses there with a
ValueError naming the feature, the torch installed and the torch it needs, instead of failing deep inside torch or,
worse, answering wrongly.
"""

import torch
from packaging.version import Version

from .input_checks import TRACING_TORCH

INSTALLED = torch.__version__  # read by `require_torch`; a test may set another
TRACING = ".".join(map(str, TRACING_TORCH))

NEEDS = {  # feature -> the lowest torch release it works on
    # Checked by the traced forward itself (input_checks.check_inputs: checkpoint code, which imports nothing else).
    # Below it torch.export fails a guard on the dynamic batch (2.7) or cannot trace transformers' output capturing
    # (2.6), and torch.compile pools a packed batch to one row (2.7).
    "tracing a bert-impl model (torch.compile, torch.export)": TRACING,
    "compile_for_inference": TRACING,  # torch.export and AOTInductor
    "ONNX export": TRACING,  # torch.onnx.export(dynamo=True) runs torch.export
    # Checked by the model when the implementation is chosen: inductor's CPU lowering of flex attention fails on these
    # masks (2.7; 2.6 once the kernel is recompiled for dynamic shapes).
    "attn_implementation='flex_attention'": TRACING,
}


def require_torch(feature: str) -> None:
    """A ValueError if the installed torch is older than what `feature` (a key of NEEDS) needs."""
    needed = NEEDS[feature]
    if Version(INSTALLED).release < Version(needed).release:
        raise ValueError(f"{feature} needs torch >= {needed} (installed: {INSTALLED}); upgrade torch "
                         f"(pip install 'torch>={needed}') to use it")
