"""The encoder's linear layers on CPU inference: oneDNN with packed weights, with no opting in.

Where there is no padding to skip (batch 1, dense batches), the encoder's time on CPU is mostly its linear layers
(benchmarks/RESULTS.md "Engines": 84% of a dense 64 x 128 forward), which `F.linear` runs at 1.4x-1.7x the time of the
same products with their weights laid out once in oneDNN's blocked format. The encoder calls its `nn.Linear` layers
through `linear(layer, x)`, which runs the product through oneDNN (`torch.ops.mkldnn._linear_pointwise`) on a packed
copy of the weight wherever that cannot change anything autograd, tracing or the user's code sees:

- the layer is a plain `nn.Linear` (not one wrapped or replaced by PEFT, a quantizer, ...), with no hooks and no
  patched `forward`;
- float32 input and weight on CPU, a torch built with oneDNN;
- no gradient wanted (`torch.no_grad()` / `torch.inference_mode()`, as pipelines and sentence-transformers call), no
  autocast, not being traced (`torch.compile` / `torch.export` see the plain layer).

Elsewhere it is `layer(x)`, so training is never affected. The modules stay `nn.Linear` with their parameters, and
nothing is added to them or to the state dict: the packed copies live in a table keyed by the weight, dropped with it.
A copy is made on the first such call and made again after the weight changes (an optimizer step, `load_state_dict`,
`.to()`, PEFT's `merge_adapter`: `packed_weight`); it costs one more copy of the weight (for the encoder of BERT-base,
85M floats: 340 MB; all-MiniLM-L6-v2: 10.6M floats, 42 MB).

`activation` is applied to the output; the exact (erf) GELU runs inside the same oneDNN call on the packed path (the
feed-forward block's first product asks for it).
"""

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks
from transformers.activations import GELUActivation

ONEDNN = torch.backends.mkldnn.is_available()
PROBES = 256  # weight entries compared on each packed call (see `packed_weight`)
_PACKED: dict[int, tuple] = {}  # id(weight) -> (weakref to it, (storage, version), probe, packed weight)


def is_exact_gelu(act) -> bool:
    return act is F.gelu or (type(act) is GELUActivation and act.act is F.gelu)


def packed_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of x with `weight` can run on the packed path: CPU float32 inference, not traced."""
    return (
        ONEDNN
        and not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
    )


def plain(layer: nn.Module) -> bool:
    """A plain nn.Linear (or PackedLinear) that nothing observes or replaces: calling it is exactly F.linear."""
    return (
        type(layer) in (nn.Linear, PackedLinear)
        and not (layer._forward_hooks or layer._forward_pre_hooks or "forward" in layer.__dict__)
        and not (module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks)
    )


def linear(layer: nn.Module, x: torch.Tensor, activation=None) -> torch.Tensor:  # (..., in) -> (..., out)
    """`activation(layer(x))` (`layer(x)` without one), on the packed path where it cannot change anything."""
    if plain(layer) and packed_path(x, layer.weight):
        return packed_product(x, layer.weight, layer.bias, activation)
    y = layer(x)
    return y if activation is None else activation(y)


def packed_product(x, weight, bias, activation=None):
    fused = is_exact_gelu(activation)
    # "gelu" with algorithm "none": oneDNN's erf GELU (not the tanh approximation)
    y = torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "gelu" if fused else "none", [],
                                           "none" if fused else "")
    return y if fused or activation is None else activation(y)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's layout, packed again when it changed. An update through the parameter moves its version
    counter, a new tensor (`.to()`, `weight.data = ...`) its storage; an update through `.data` (`weight.data += delta`,
    as PEFT's `merge_adapter` does) moves neither, so PROBES entries spread over every row and many columns are compared
    with their packed-time values as well."""
    w = weight.detach()
    key = (w.data_ptr(), weight._version)
    entry = _PACKED.get(id(weight))
    if entry is None or entry[0]() is not weight:
        weakref.finalize(weight, _PACKED.pop, id(weight), None)
    elif entry[1] == key and torch.equal(probe(w), entry[2]):
        return entry[3]
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    _PACKED[id(weight)] = (weakref.ref(weight), key, probe(w).clone(), packed)
    return packed


def probe(w: torch.Tensor) -> torch.Tensor:  # (out, in) -> (<= PROBES,) entries, a step coprime with `in` apart
    step = max(1, w.numel() // PROBES)
    while math.gcd(step, w.shape[1]) != 1:
        step += 1
    return w.reshape(-1)[::step]


class PackedLinear(nn.Linear):
    """An nn.Linear that takes the packed path itself (`optimize_for_inference` makes the layers outside the encoder
    ones)."""

    def forward(self, x):
        if packed_path(x, self.weight):
            return packed_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
