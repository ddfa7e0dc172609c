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

`activation` is applied to the output and `residual` added to it; on the packed path the residual sum runs inside the
same oneDNN call, and so does the exact (erf) GELU that the feed-forward block's first product asks for, on a CPU with
AVX-512 (`fuse_gelu`).
"""

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks
from transformers.activations import GELUActivation

ONEDNN = torch.backends.mkldnn.is_available()
PROBE_ROWS, PROBE_WIDTH = 16, 16  # weight entries compared on each packed call (see `packed_weight`)
_PACKED: dict[int, "Packed"] = {}  # id(weight) -> its packed copy and what it was packed from
_GROUPS: dict[tuple, tuple] = {}  # ids of a model's weights -> (their `_PACKED` entries, their probes' values)


def is_exact_gelu(act) -> bool:
    return act is F.gelu or (type(act) is GELUActivation and act.act is F.gelu)


def fuse_gelu() -> bool:
    """Whether the exact GELU runs inside the product's oneDNN call: on a CPU with AVX-512. oneDNN's AVX2 GELU post-op
    is slower than the product followed by torch's GELU (an AVX2 Zen 3: 1.11x the time at 16 x 384 -> 1536, 1.28x at
    256 rows; the model took 0.90x the time at 1 x 128 tokens: benchmarks/RESULTS.md, "seventh pass")."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def packed_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of x with `weight` can run on the packed path: CPU float32 inference, not traced."""
    return packable_weight(weight) and cpu_inference(x)


def packable_weight(weight: torch.Tensor) -> bool:
    return ONEDNN and weight.dtype == torch.float32 and weight.is_contiguous()


def cpu_inference(x: torch.Tensor) -> bool:
    """x is float32 on CPU in `untraced_inference`."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and untraced_inference()


def untraced_inference() -> bool:
    """No gradient is wanted, no autocast, not traced (`torch.compile` / `torch.export`, and TorchScript's tracer, as
    `torch.onnx.export(dynamo=False)` runs it: its graph would hold oneDNN's own ops)."""
    return (
        not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not torch.is_autocast_enabled("cpu")
    )


def plain(layer: nn.Module) -> bool:
    """A plain nn.Linear (or PackedLinear) that nothing observes or replaces: calling it is exactly F.linear."""
    return type(layer) in (nn.Linear, PackedLinear) and unobserved(layer) and not global_hooks()


def unobserved(module: nn.Module) -> bool:
    """No hooks on the module and no `forward` patched onto it (global hooks: `global_hooks`)."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def global_hooks() -> bool:
    """Forward hooks registered for every module (`nn.modules.module.register_module_forward_hook`)."""
    return bool(module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks)


def linear(layer: nn.Module, x: torch.Tensor, activation=None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`activation(layer(x))` (`layer(x)` without one), plus `residual` if given (..., out); on the packed path where it
    cannot change anything. (..., in) -> (..., out)"""
    if plain(layer) and packed_path(x, layer.weight):
        return packed_product(x, packed_weight(layer.weight), layer.bias, activation, residual)
    y = layer(x)
    y = y if activation is None else activation(y)
    return y if residual is None else y + residual


def packed_product(x, packed, bias, activation=None, residual=None):
    """activation(x W^T + b) (+ residual) with W packed by `packed_weight`."""
    fused = is_exact_gelu(activation) and fuse_gelu()
    if residual is not None and activation is None:  # the residual sum inside the same oneDNN call
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
    # "gelu" with algorithm "none": oneDNN's erf GELU (not the tanh approximation)
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu" if fused else "none", [], "none" if fused else "")
    y = y if fused or activation is None else activation(y)
    return y if residual is None else y + residual


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's layout, packed again when it changed. An update through the parameter moves its version
    counter, a new tensor (`.to()`, `weight.data = ...`) its storage; an update through `.data` (`weight.data += delta`,
    as PEFT's `merge_adapter` does) moves neither, so 256 entries spread over the matrix (`probe`, a view of the
    weight, kept) are compared with their packed-time values as well."""
    entry = _PACKED.get(id(weight))
    ours = entry is not None and entry.weight() is weight
    if ours and entry.key == (weight.data_ptr(), weight._version) and torch.equal(entry.probe, entry.probed):
        return entry.packed
    if not ours:  # the first packing of this weight: its entry goes with it
        weakref.finalize(weight, _PACKED.pop, id(weight), None)
    w = weight.detach()
    view = probe(w)
    _PACKED[id(weight)] = Packed(weakref.ref(weight), (w.data_ptr(), weight._version), view, view.clone(),
                                 torch.ops.mkldnn._reorder_linear_weight(w))
    return _PACKED[id(weight)].packed


def packed_weights(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """`packed_weight` of each of a model's weights at once. Where none of them was replaced or updated through the
    parameter since it was packed, their probes are compared in one operation (one pass over a model's scattered
    entries, not one per product: 25 comparisons took 0.4 ms of a 5 ms query, each reading entries no cache holds)."""
    if not weights:
        return []
    key = tuple(map(id, weights))
    group = _GROUPS.get(key)
    if group is not None:
        entries, probed = group
        if (all(e is _PACKED.get(k) and e.key == (w.data_ptr(), w._version) for e, k, w in zip(entries, key, weights))
                and torch.equal(torch.cat([e.probe for e in entries]), probed)):
            return [e.packed for e in entries]
    packed = [packed_weight(w) for w in weights]  # each compared on its own, packed again where it changed
    if group is None:  # dropped with the first of its weights to go
        for w in weights:
            weakref.finalize(w, _GROUPS.pop, key, None)
    entries = tuple(_PACKED[id(w)] for w in weights)
    _GROUPS[key] = (entries, torch.cat([e.probed for e in entries]))
    return packed


class Packed(NamedTuple):
    weight: weakref.ref  # to the parameter
    key: tuple[int, int]  # its storage and version counter when packed
    probe: torch.Tensor  # (rows, width) a view of its entries
    probed: torch.Tensor  # their values when packed
    packed: torch.Tensor  # the packed copy


def probe(w: torch.Tensor) -> torch.Tensor:  # (out, in) -> (rows, width) a view
    """PROBE_ROWS rows spread evenly over the weight, PROBE_WIDTH consecutive entries of each, at a column that moves
    along with the row: a few entries in every part of the matrix, in few cache lines and pages (reading 256 entries
    one per page took 3x as long)."""
    (out, inp), rows, width = w.shape, min(PROBE_ROWS, w.shape[0]), min(PROBE_WIDTH, w.shape[1])
    return w.as_strided((rows, width), ((out // rows) * inp + (inp - width) // rows, 1), w.storage_offset())


class PackedLinear(nn.Linear):
    """An nn.Linear that takes the packed path itself (`optimize_for_inference` makes the layers outside the encoder
    ones)."""

    def forward(self, x):
        if packed_path(x, self.weight):
            return packed_product(x, packed_weight(self.weight), self.bias)
        return F.linear(x, self.weight, self.bias)
