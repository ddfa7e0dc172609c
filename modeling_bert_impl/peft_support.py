"""PEFT on bert-impl as on stock BERT.

- Default `target_modules`: peft picks them by model_type from its `TRANSFORMERS_MODELS_TO_*` tables; for every table
  with a "bert" entry, "bert_impl" gets the same modules under our names (query/key/value -> the fused `qkv`,
  `output.dense` -> `attn.out` and `ffn.down`). So `LoraConfig(task_type="SEQ_CLS")`, `IA3Config(...)` and the rest
  work without `target_modules` (every method with a "bert" default; Poly, which mixes its modules per example,
  switches our model to padded batches). Registered when this package is imported, if peft is installed (it adds about
  0.16 s to the package's 4-5 s import: measured with `python -X importtime`).
- Adapters travel both ways between stock BERT's module names and ours, with the same outputs:
  `convert_stock_adapter` (stock -> ours: query/key/value -> the fused `qkv`, ...) and `convert_adapter_to_stock`
  (ours -> stock), for the methods in `QKV_SPLIT`; the others are refused with the reason. With peft installed, from
  the import of this package on: `PeftModel.from_pretrained` / `load_adapter` convert an adapter to the names of the
  model it is loaded onto (ours or transformers' BERT), and `PeftModel.save_pretrained` writes the adapter of one of
  our models whose base is a stock BERT folder in stock names, since loading that folder (`AutoPeftModelFor...`)
  builds transformers' BERT.
"""

import contextlib
import copy
import inspect
import os
import tempfile

import torch
from transformers.utils import logging

from .modeling_bert_impl import STOCK_QKV, STOCK_TO_OURS, BertImplPreTrainedModel

logger = logging.get_logger(__name__)

# A stock BERT module name as peft's tables spell it -> ours (suffixes of module paths).
STOCK_TO_OUR_MODULES = {"query": ["qkv"], "key": ["qkv"], "value": ["qkv"], "output.dense": ["attn.out", "ffn.down"]}


def _tables_with_bert() -> list[dict]:
    """peft's model_type -> default modules tables that have a "bert" entry (none when peft is not installed)."""
    try:
        from peft.utils import constants
    except ImportError:
        return []
    return [
        table for name, table in vars(constants).items()
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and isinstance(table.get("bert"), list)
    ]


def _our_modules(stock: list[str]) -> list[str] | None:
    """Stock BERT module names -> ours, in order, without repeats; None if one has no counterpart we know."""
    if any(name not in STOCK_TO_OUR_MODULES for name in stock):
        return None
    return list(dict.fromkeys(ours for name in stock for ours in STOCK_TO_OUR_MODULES[name]))


def register_peft_defaults() -> None:
    """Give "bert_impl" the counterpart of every "bert" default in peft's tables, and make Poly adapters run our
    models on padded batches (`_padded_for_poly`)."""
    for table in _tables_with_bert():
        ours = _our_modules(table["bert"])
        if ours is not None:
            table.setdefault("bert_impl", ours)
    _padded_for_poly()


def _padded_for_poly() -> None:
    """Poly mixes its LoRA modules per example (by `task_ids`), so its layers need (B, T, H) inputs, which our
    unpadded path (tokens of all examples in one (N, H) matrix) does not give. When peft injects Poly into one of our
    models, the model switches to the padded path (`config.unpad_inputs = False`, same outputs), with a warning."""
    try:
        from peft.tuners.poly import PolyModel
    except ImportError:
        return
    original = PolyModel._pre_injection_hook
    if getattr(original, "_bert_impl", False):
        return

    def hook(self, model, config, adapter_name):
        if isinstance(model, BertImplPreTrainedModel) and model.config.unpad_inputs:
            logger.warning("Poly routes each example through its own mix of LoRA modules: the model now runs on "
                           "padded batches (config.unpad_inputs=False)")
            model.config.unpad_inputs = False
        return original(self, model, config, adapter_name)

    hook._bert_impl = True
    PolyModel._pre_injection_hook = hook


_stock_bert_defaults: dict[int, tuple[dict, list[str]]] = {}  # id(table) -> (table, its "bert" entry before)


def extend_stock_bert_defaults(extend: bool) -> None:
    """While `apply_bert_impl()` is in effect, stock BERT checkpoints load into our classes but keep model_type "bert":
    peft's "bert" defaults then also name our modules (unmatched names are ignored by peft). `False` restores them."""
    for table in _tables_with_bert():
        if extend and id(table) not in _stock_bert_defaults:
            ours = _our_modules(table["bert"])
            if ours is not None:
                _stock_bert_defaults[id(table)] = (table, table["bert"])
                table["bert"] = [*table["bert"], *(m for m in ours if m not in table["bert"])]
    if not extend:
        for table, stock in _stock_bert_defaults.values():
            table["bert"] = stock
        _stock_bert_defaults.clear()


# ---------------------------------------------------------------------------------------------------------------------
# Adapters between stock BERT's module names and ours. Every module keeps its path under `STOCK_TO_OURS`; a method on
# our fused qkv (3H output features) is the same method on query, key and value when each of its tensors either
# follows qkv's output features (split into three blocks of H rows) or acts on the input side (the three share it).
# ---------------------------------------------------------------------------------------------------------------------

# PEFT method -> {tensor name: the axis along which it follows qkv's output features, or None for an input-side tensor}
QKV_SPLIT = {
    "LORA": {"lora_A": None, "lora_B": 0, "lora_magnitude_vector": 0},  # B A (+ DoRA's norm per output row)
    "ADALORA": {"lora_A": None, "lora_E": None, "lora_B": 0},  # B (A * E)
    "IA3": {"ia3_l": 0},  # (3H, 1) scales the outputs; (1, H) on a feedforward module scales the input
    "LOHA": {"hada_w1_a": 0, "hada_w1_b": None, "hada_w2_a": 0, "hada_w2_b": None},  # (w1a w1b) * (w2a w2b)
    "HIRA": {"hira_A": None, "hira_B": 0},  # W * (B A)
    "OFT": {"oft_R": None},  # rotates the input
    "BOFT": {"boft_R": None, "boft_s": 0},  # rotates the input, scales each output
    "HRA": {"hra_u": None},  # Householder reflections of the input
    "BEFT": {"beft_bias": 1},  # (1, 3H) added to the outputs
}
# Why some methods' adapter on qkv is not three adapters on query/key/value (the others: not shown to be).
_SHARED_PROJECTIONS = ("its random projections are shared by all modules and each module uses their first rows, so "
                       "query, key and value would all read the rows that only query's part of qkv reads")
_BASE_DECOMPOSITION = ("it is built on a decomposition (SVD) of the whole (3H, H) base weight, which is not made of the "
                       "decompositions of query's, key's and value's (H, H) blocks")
NOT_SPLIT = {
    "LOKR": "its update is a Kronecker product whose factors peft sizes from the whole (3H, H) matrix; an (H, H) "
            "query gets factors of other shapes",
    "VERA": _SHARED_PROJECTIONS,
    "PVERA": _SHARED_PROJECTIONS,
    "RANDLORA": _SHARED_PROJECTIONS,
    "ADAMSS": _BASE_DECOMPOSITION,
    "FROD": _BASE_DECOMPOSITION,
    "PSOFT": _BASE_DECOMPOSITION,
    "TINYLORA": _BASE_DECOMPOSITION,
    "FOURIERFT": "its update is the inverse 2-D Fourier transform of a sparse spectrum over the whole (3H, H) matrix",
    "WAVEFT": "its update is an inverse 2-D wavelet transform over the whole (3H, H) matrix",
    "DELORA": "it normalises its update by the norms of B's columns, taken over all 3H rows",
}


def _refusal(peft_type: str) -> str | None:
    """Why an adapter of this PEFT method cannot be moved between our fused qkv and query/key/value; None if it can."""
    if peft_type in QKV_SPLIT:
        return None
    why = NOT_SPLIT.get(peft_type, "bert-impl splits only the methods each of whose tensors follows qkv's output "
                                   f"features or acts on its input ({', '.join(QKV_SPLIT)}); {peft_type}'s are not "
                                   "known to")
    return (f"A {peft_type} adapter on bert-impl's fused qkv cannot be converted exactly to one on stock BERT's "
            f"query, key and value (or back): {why}")


def _stock_module_paths(path: str) -> list[str]:
    """A module path in our model -> its path in stock BERT (`STOCK_TO_OURS` backwards); three for the fused qkv."""
    for source, target in reversed(STOCK_TO_OURS):
        path = path.replace(target, source)
    if path == "attn.qkv" or path.endswith(".attn.qkv"):
        return [path[: -len("attn.qkv")] + name for name in STOCK_QKV]
    return [path]


def _our_module_path(stock_path: str) -> tuple[str, int | None]:
    """A module path in a stock BERT model -> (its path in ours, None), or (the fused qkv's path, 0|1|2) for
    query/key/value."""
    for source, target in STOCK_TO_OURS:
        stock_path = stock_path.replace(source, target)
    for part, name in enumerate(STOCK_QKV):
        if stock_path == name or stock_path.endswith("." + name):
            return stock_path[: -len(name)] + "attn.qkv", part
    return stock_path, None


def _is_stock_name(path: str) -> bool:
    """A module name (or suffix, as peft's `target_modules` lists have them) of stock BERT's, not ours."""
    return path.split(".")[-1] in ("query", "key", "value") or _our_module_path(path)[0] != path


def _is_our_name(path: str) -> bool:
    """A module name (or suffix) of ours, not stock BERT's."""
    return path.split(".")[-1] == "qkv" or _stock_module_paths(path) != [path]


_PREFIX = "base_model.model."  # before every module path in a saved adapter


def _adapter_key(key: str, prefix: str) -> tuple[str | None, str, str]:
    """A saved adapter tensor's key -> (module path without `_PREFIX`, tensor name, rest): 'base_model.model.bert.
    layers.0.attn.qkv.lora_B.weight' -> ('bert.layers.0.attn.qkv', 'lora_B', '.weight'). (None, '', key) for a
    tensor of no adapted module (`modules_to_save`)."""
    parts = key.removeprefix(_PREFIX).split(".")
    at = next((i for i, part in enumerate(parts) if part.startswith(prefix)), None)
    if at is None or not key.startswith(_PREFIX):
        return None, "", key
    return ".".join(parts[:at]), parts[at], "".join("." + part for part in parts[at + 1:])


def _local_folder(adapter, revision: str | None = None) -> str:
    if os.path.isdir(adapter):
        return str(adapter)
    from huggingface_hub import snapshot_download

    return snapshot_download(str(adapter), revision=revision)


def _read_adapter(folder: str):
    """(its PeftConfig, its tensors, the weights file name)."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    config = PeftConfig.from_pretrained(folder)
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            weights = load_file(path) if name.endswith(".safetensors") else torch.load(path, weights_only=True)
            return config, weights, name
    raise ValueError(f"{folder}: no adapter_model.safetensors or adapter_model.bin")


def _write_adapter(output_dir, config, weights: dict, name: str) -> str:
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    config.save_pretrained(str(output_dir))
    weights = {key: value.contiguous() for key, value in weights.items()}
    if name.endswith(".safetensors"):
        save_file(weights, os.path.join(output_dir, name), metadata={"format": "pt"})
    else:
        torch.save(weights, os.path.join(output_dir, name))
    return str(output_dir)


def _pattern_value(patterns: dict | None, path: str):
    """The value a peft `rank_pattern`/`alpha_pattern` gives module `path`, as peft matches it (None: the config's
    default)."""
    from peft.utils.other import get_pattern_key

    key = get_pattern_key(patterns, path) if patterns else None
    return patterns[key] if patterns and key in patterns else None


def _prefix(config) -> str:
    """What the names of the method's tensors start with ("lora_", "ia3_", "hada_", ...)."""
    from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING

    return PEFT_TYPE_TO_PREFIX_MAPPING[config.peft_type]


def _renamed_config(config, renamed: dict[str, list[str]], rename):
    """`config` for the same modules under new paths. `renamed`: each adapted module's path (without `_PREFIX`) ->
    its new path(s); `rename`: other module names (`modules_to_save`). Modules are named by full path, and each gets
    the rank, alpha and feedforward setting it had."""
    new = copy.deepcopy(config)
    new.target_modules = sorted({path for paths in renamed.values() for path in paths})
    adalora = config.peft_type == "ADALORA"
    if adalora and config.rank_pattern:  # set by AdaLoRA's training: {module path + ".lora_E": the ranks it keeps}
        masks = {}
        for key, mask in config.rank_pattern.items():
            for path in renamed.get(key.removesuffix(".lora_E"), [key.removesuffix(".lora_E")]):
                if masks.setdefault(f"{path}.lora_E", mask) != mask:
                    raise ValueError(f"ADALORA: the modules that become {path} keep different ranks, so they are "
                                     "not one adapter there")
        new.rank_pattern = masks
    for field in ("alpha_pattern",) if adalora else ("rank_pattern", "alpha_pattern"):
        if getattr(config, field, None):
            values = {}
            for old, paths in renamed.items():
                if (value := _pattern_value(getattr(config, field), old)) is not None:
                    for path in paths:
                        if values.setdefault(path, value) != value:
                            raise ValueError(f"{config.peft_type}: the modules that become {path} have different "
                                             f"{field} values, so they are not one adapter there")
            setattr(new, field, values)
    if getattr(config, "feedforward_modules", None):  # IA3
        from peft.tuners.ia3 import IA3Model

        new.feedforward_modules = sorted({path for old, paths in renamed.items() for path in paths
                                          if IA3Model._check_target_module_feedforward(config, old)})
    if getattr(config, "modules_to_save", None):
        new.modules_to_save = [rename(name) for name in config.modules_to_save]
    for field in ("exclude_modules", "layers_to_transform", "layers_pattern"):
        if getattr(new, field, None) is not None:
            setattr(new, field, None)
    return new


def _check_convertible(config, adapter) -> str:
    """The adapter's PEFT method (a `QKV_SPLIT` key), or a ValueError saying why it cannot be converted."""
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    if (refusal := _refusal(peft_type)) is not None:
        raise ValueError(f"{adapter}: {refusal}.")
    if getattr(config, "target_parameters", None):
        raise ValueError(f"{adapter}: target_parameters adapters adapt parameters, not modules; they are not converted")
    return peft_type


def convert_adapter_to_stock(adapter: str | os.PathLike, output_dir: str | os.PathLike) -> str:
    """Rewrite an adapter trained on bert-impl in stock BERT's module names; returns `output_dir` (may be `adapter`).

    The result loads onto transformers' BERT (`PeftModel.from_pretrained(BertForX...)`, `AutoPeftModelForX` when
    `base_model_name_or_path` is a stock folder) with the same outputs, and back onto ours (`convert_stock_adapter`).
    Exact: a module on our fused qkv becomes the same method on query, key and value, each with its block of H rows of
    the tensors that follow the output features (LoRA's B, IA3's scale, ...) and a copy of those on the input side
    (LoRA's A, OFT's rotation, ...), with qkv's rank and alpha; `QKV_SPLIT` lists the methods this holds for, the
    others are refused with the reason (`NOT_SPLIT`). Other modules are renamed (attn.out -> attention.output.dense,
    ffn.up -> intermediate.dense, ffn.down -> output.dense). Modules are named by full path in the new config, and an
    adapter without a task type names transformers' class (BertModel, ...) for AutoPeftModel to build."""
    folder = _local_folder(adapter)
    config, weights, name = _read_adapter(folder)
    peft_type = _check_convertible(config, adapter)
    prefix = _prefix(config)
    out, renamed = {}, {}
    for key, tensor in weights.items():
        module, tensor_name, rest = _adapter_key(key, prefix)
        if module is None:
            out[_stock_module_paths(key)[0]] = tensor  # modules_to_save: renamed
            continue
        paths = renamed.setdefault(module, _stock_module_paths(module))
        if len(paths) == 1:
            out[f"{_PREFIX}{paths[0]}.{tensor_name}{rest}"] = tensor
            continue
        if tensor_name not in QKV_SPLIT[peft_type]:
            raise ValueError(f"{adapter}: {peft_type} tensor {key} is not one bert-impl knows how to split")
        axis = QKV_SPLIT[peft_type][tensor_name]
        shared = axis is None or tensor.shape[axis] == 1  # IA3 on a feedforward qkv scales its input
        for path, part in zip(paths, [tensor] * 3 if shared else tensor.chunk(3, dim=axis)):
            out[f"{_PREFIX}{path}.{tensor_name}{rest}"] = part.clone()
    converted = _renamed_config(config, renamed, lambda module: _stock_module_paths(module)[0])
    mapping = converted.auto_mapping or {}  # the class AutoPeftModel builds for an adapter without a task type
    if mapping.get("parent_library", "").startswith("modeling_bert_impl"):
        ours = mapping["base_model_class"].removesuffix("OnBertConfig")  # patching.py's classes: ours on a BertConfig
        converted.auto_mapping = {"base_model_class": ours.replace("BertImpl", "Bert", 1),
                                  "parent_library": "transformers"}
    return _write_adapter(output_dir, converted, out, name)


def convert_stock_adapter(adapter: str | os.PathLike, output_dir: str | os.PathLike) -> str:
    """Rewrite an adapter trained on transformers' BERT for bert-impl; returns `output_dir` (may be `adapter`).

    `adapter`: a folder or a Hub repo id (`adapter_config.json` + `adapter_model.safetensors`). The result loads with
    `PeftModel.from_pretrained(our_model, output_dir)` and gives the same outputs as the stock adapter on the stock
    model. Modules on query, key and value become one on our fused qkv:
    - all three with the same input-side tensors (as `convert_adapter_to_stock` writes them, for every `QKV_SPLIT`
      method): the output-side tensors concatenated, the rest as it is, the same rank and alpha; exact, bit for bit.
    - LoRA otherwise (typically query and value only): a LoRA of rank r_q + r_v (+ r_k), A the A's stacked and B
      holding each B in its own block (zeros for a missing key); each module's scaling (lora_alpha / r, or / sqrt(r)
      with rsLoRA, per-module `alpha_pattern` included) is folded into its B, so that module has scaling 1. Exact up
      to float rounding. DoRA and LoRA bias adapters cannot be folded this way and are refused.
    - other methods otherwise: refused.
    Other modules are renamed; modules are named by full path in the new config."""
    folder = _local_folder(adapter)
    config, weights, name = _read_adapter(folder)
    peft_type = _check_convertible(config, adapter)
    prefix = _prefix(config)
    out, renamed, parts_of = {}, {}, {}  # parts_of: our qkv path -> {part: (stock path, {tensor name + rest: tensor})}
    for key, tensor in weights.items():
        module, tensor_name, rest = _adapter_key(key, prefix)
        if module is None:
            out[_our_module_path(key)[0]] = tensor  # modules_to_save: renamed
            continue
        path, part = _our_module_path(module)
        if part is None:
            renamed[module] = [path]
            out[f"{_PREFIX}{path}.{tensor_name}{rest}"] = tensor
        else:
            parts_of.setdefault(path, {}).setdefault(part, (module, {}))[1][tensor_name + rest] = tensor
    folded = {}  # our qkv path -> the rank of its folded LoRA
    for path, parts in parts_of.items():
        fused = _fused(parts, QKV_SPLIT[peft_type], config)
        if fused is not None:
            renamed.update({module: [path] for module, _ in parts.values()})
        elif peft_type == "LORA":
            fused = _folded_lora(parts, config, adapter)
            folded[path] = fused["lora_A.weight"].shape[0]
        else:
            adapted = ", ".join(STOCK_QKV[p].split(".")[-1] for p in sorted(parts))
            raise ValueError(
                f"{adapter}: its {peft_type} modules on {adapted} of {path.removesuffix('.attn.qkv')} are not one "
                f"{peft_type} adapter on bert-impl's fused qkv: that takes all three of query, key and value adapted "
                "alike (the same input-side tensors and settings), as convert_adapter_to_stock writes them; only LoRA "
                "is converted otherwise (stacked into a LoRA of the summed rank)")
        out.update({f"{_PREFIX}{path}.{key}": tensor for key, tensor in fused.items()})
    converted = _renamed_config(config, renamed, lambda module: _our_module_path(module)[0])
    if folded:  # scaling 1: alpha = r (sqrt(r) with rsLoRA)
        converted.target_modules = sorted({*converted.target_modules, *folded})
        converted.rank_pattern = {**(converted.rank_pattern or {}), **folded}
        converted.alpha_pattern = {**(converted.alpha_pattern or {}),
                                   **{p: r**0.5 if config.use_rslora else r for p, r in folded.items()}}
    return _write_adapter(output_dir, converted, out, name)


def _fused(parts: dict, split: dict, config) -> dict | None:
    """query/key/value's tensors -> qkv's, when all three are adapted alike: the same tensors, equal input-side ones,
    the same rank/alpha patterns. None otherwise."""
    if sorted(parts) != [0, 1, 2] or len({tuple(sorted(tensors)) for _, tensors in parts.values()}) != 1:
        return None
    for field in ("rank_pattern", "alpha_pattern"):
        if len({repr(_pattern_value(getattr(config, field, None), path)) for path, _ in parts.values()}) != 1:
            return None
    fused = {}
    for key in parts[0][1]:
        tensors = [parts[p][1][key] for p in range(3)]
        axis = split.get(key.split(".")[0], "unknown")
        if axis == "unknown":
            return None
        if axis is None or tensors[0].shape[axis] == 1:  # input side: one tensor, shared by the three
            if not all(torch.equal(t, tensors[0]) for t in tensors):
                return None
            fused[key] = tensors[0]
        else:
            fused[key] = torch.cat(tensors, dim=axis)
    return fused


def _folded_lora(parts: dict, config, adapter) -> dict:
    """LoRA on some of query/key/value -> one on qkv: A stacked, each B (times its scaling) in its block of rows."""
    for flag in ("use_dora", "lora_bias"):
        if getattr(config, flag, None):
            raise ValueError(f"{adapter}: {flag} LoRA adapters on only some of query/key/value (or with different "
                             "A's) cannot be converted: their weights are not a low-rank update that can be stacked")
    H = next(iter(parts.values()))[1]["lora_B.weight"].shape[0]
    As, Bs = [], []
    for p in sorted(parts):
        module, tensors = parts[p]
        A, B = tensors["lora_A.weight"], tensors["lora_B.weight"]  # (r, H), (H, r)
        r = A.shape[0]
        alpha = _pattern_value(config.alpha_pattern, module) or config.lora_alpha
        As.append(A)
        Bs.append((p, B * (alpha / (r**0.5 if config.use_rslora else r))))
    A = torch.cat(As)  # (R, H)
    B = A.new_zeros(3 * H, A.shape[0])  # (3H, R)
    offset = 0
    for p, Bp in Bs:
        B[p * H:(p + 1) * H, offset:offset + Bp.shape[1]] = Bp
        offset += Bp.shape[1]
    return {"lora_A.weight": A, "lora_B.weight": B}


# ---------------------------------------------------------------------------------------------------------------------
# Both directions, automatically: PeftModel's save_pretrained, from_pretrained and load_adapter, while this package is
# imported (peft installed).
# ---------------------------------------------------------------------------------------------------------------------


def _adapter_names_modules(folder: str, model_id, config, convert_to) -> bool:
    """Whether the adapter at `folder` adapts modules under the other model's names: stock ones (`convert_to`
    "ours") or ours ("stock"). A list of `target_modules` says it; a regular expression (which peft matches against
    module paths) does not, and then the adapter's weights do."""
    targets = getattr(config, "target_modules", None)
    is_other = _is_stock_name if convert_to == "ours" else _is_our_name
    if isinstance(targets, (list, set)) and (convert_to == "ours" or any(is_other(t) for t in targets)):
        return any(is_other(t) for t in targets)
    weights = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        if isinstance(targets, str) and convert_to == "ours":
            raise ValueError(
                f"{model_id}: its target_modules is the regular expression {targets!r} and it has no "
                "adapter_model.safetensors, so it cannot be told whether it targets stock BERT's query/key/value "
                "(which our model fuses into qkv). Save it with safe_serialization (peft's default) and load it again, "
                "or load it on transformers' BertModel classes (revert_bert_impl())")
        return False
    from safetensors import safe_open

    prefix = _prefix(config)
    with safe_open(weights, "pt") as f:
        modules = {_adapter_key(key, prefix)[0] for key in f.keys()} - {None}
    return any(is_other(module) for module in modules)


def _names_of(model) -> str | None:
    """Whose module names `model` has: "ours", "stock" (transformers' BERT) or None (another model)."""
    from transformers import BertPreTrainedModel

    if isinstance(model, BertImplPreTrainedModel):
        return "ours"
    return "stock" if isinstance(model, BertPreTrainedModel) else None


_ORIGINAL = {}  # PeftModel attribute -> peft's own, while ours replace them


def _converted(model, model_id, config, kwargs, stack) -> str | None:
    """A temporary folder with the adapter at `model_id` converted for `model` (None if it needs no conversion)."""
    from peft import PeftConfig

    revision, convert_to = kwargs.get("revision"), _names_of(model)
    if convert_to is None or kwargs.get("subfolder") is not None:
        return None
    config = config or PeftConfig.from_pretrained(str(model_id), revision=revision)
    if config.is_prompt_learning or not _adapter_names_modules(_local_folder(model_id, revision), model_id, config,
                                                               convert_to):
        return None
    folder = stack.enter_context(tempfile.TemporaryDirectory())  # read into the model before it is removed
    convert = convert_stock_adapter if convert_to == "ours" else convert_adapter_to_stock
    kwargs.pop("revision", None)
    return convert(_local_folder(model_id, revision), folder)


def _from_pretrained(cls, model, model_id, *args, config=None, **kwargs):
    """PeftModel.from_pretrained, with an adapter converted to the model's module names on the way."""
    with contextlib.ExitStack() as stack:
        converted = _converted(model, model_id, config, kwargs, stack)
        if converted is not None:
            model_id, config = converted, None
        return _ORIGINAL["from_pretrained"].__func__(cls, model, model_id, *args, config=config, **kwargs)


def _load_adapter(self, model_id, adapter_name, *args, **kwargs):
    """PeftModel.load_adapter (Trainer's resume and best-model steps), with the same conversion."""
    with contextlib.ExitStack() as stack:
        converted = _converted(self.get_base_model(), model_id, None, kwargs, stack)
        return _ORIGINAL["load_adapter"](self, converted or model_id, adapter_name, *args, **kwargs)


def _is_stock_base(model, base_model_name_or_path) -> bool:
    """Whether the adapter's base is stock BERT: a model loaded through `apply_bert_impl()`, or a folder (Hub id)
    whose config says model_type "bert"."""
    if getattr(model.config, "model_type", None) == "bert":
        return True
    if not base_model_name_or_path:
        return False
    from transformers import PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(str(base_model_name_or_path), local_files_only=True)
    except (OSError, ValueError):
        return False
    return config.get("model_type") == "bert"


def _save_pretrained(self, save_directory, *args, **kwargs):
    """PeftModel.save_pretrained; then an adapter of our model whose base is a stock BERT folder is rewritten in
    stock module names (`convert_adapter_to_stock`), so that what loads that folder (transformers' BERT) takes it.
    A method that cannot be converted stays in our names, with a warning."""
    original = _ORIGINAL["save_pretrained"]
    original(self, save_directory, *args, **kwargs)
    arguments = inspect.signature(original).bind(self, save_directory, *args, **kwargs).arguments
    model = self.get_base_model()
    if not arguments.get("is_main_process", True) or not isinstance(model, BertImplPreTrainedModel):
        return
    for name in arguments.get("selected_adapters") or list(self.peft_config):
        config = self.peft_config[name]
        if config.is_prompt_learning or not _is_stock_base(model, config.base_model_name_or_path):
            continue
        folder = os.path.join(str(save_directory), name) if name != "default" else str(save_directory)
        try:
            convert_adapter_to_stock(folder, folder)
        except ValueError as refusal:
            logger.warning(f"{refusal} The adapter stays in bert-impl's module names: it loads onto bert-impl's "
                           f"models, not onto transformers' BERT that its base {config.base_model_name_or_path} "
                           "builds.")


def convert_adapters_on_save_and_load() -> None:
    """Make PeftModel save our models' adapters over stock bases in stock names, and convert adapters to the module
    names of the model they are loaded onto (ours or transformers' BERT). Nothing without peft. Idempotent."""
    try:
        from peft import PeftModel
    except ImportError:
        return
    if _ORIGINAL:
        return
    for name, ours in (("from_pretrained", classmethod(_from_pretrained)), ("load_adapter", _load_adapter),
                       ("save_pretrained", _save_pretrained)):
        _ORIGINAL[name] = getattr(PeftModel, name) if name != "from_pretrained" else PeftModel.__dict__[name]
        setattr(PeftModel, name, ours)
