"""PEFT on bert-impl as on stock BERT.

- Default `target_modules`: peft picks them by model_type from its `TRANSFORMERS_MODELS_TO_*` tables; for every table
  with a "bert" entry, "bert_impl" gets the same modules under our names (query/key/value -> the fused `qkv`,
  `output.dense` -> `attn.out` and `ffn.down`). So `LoraConfig(task_type="SEQ_CLS")`, `IA3Config(...)` and the rest
  work without `target_modules` (every method with a "bert" default; Poly, which mixes its modules per example,
  switches our model to padded batches). Registered when this package is imported, if peft is installed (it adds about
  0.16 s to the package's 4-5 s import: measured with `python -X importtime`).
- `convert_stock_lora`: a LoRA adapter trained on transformers' BERT (typically `target_modules=["query", "value"]`)
  rewritten for our fused `qkv`, with the same outputs. While `apply_bert_impl()` is in effect this happens on load:
  `PeftModel.from_pretrained` (and so `AutoPeftModelFor...`) converts such an adapter when the model is ours.
"""

import copy
import os
import tempfile
from collections import Counter

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


_peft_from_pretrained = None  # PeftModel.from_pretrained as peft defines it, while ours replaces it


def _is_stock_lora_for(model, config, model_id, revision: str | None = None) -> bool:
    """A LoRA adapter (`config`, at `model_id`) trained on stock BERT's query/key/value, to be loaded on one of our
    models. `target_modules` as a list names them; as a regular expression (which peft matches against module paths),
    the adapter's weights say which modules it selected: stock ones (query/key/value, output.dense, ...) mean a stock
    adapter."""
    targets = getattr(config, "target_modules", None)
    if not isinstance(model, BertImplPreTrainedModel) or getattr(config, "peft_type", None) != "LORA":
        return False
    if isinstance(targets, (list, set)):
        return any(t.split(".")[-1] in ("query", "key", "value") for t in targets)
    if not isinstance(targets, str):
        return False
    folder = str(model_id) if os.path.isdir(model_id) else _download(str(model_id), revision)
    weights = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        raise ValueError(
            f"{model_id}: its target_modules is the regular expression {targets!r} and it has no "
            "adapter_model.safetensors, so it cannot be told whether it targets stock BERT's query/key/value (which "
            "our model fuses into qkv). Save it with safe_serialization (peft's default) and load it again, or load it "
            "on transformers' BertModel classes (revert_bert_impl())")
    from safetensors import safe_open

    with safe_open(weights, "pt") as f:
        paths = {key.split(".lora_")[0] for key in f.keys() if ".lora_" in key}
    return any(_our_module_path(path)[0] != path for path in paths)


def _from_pretrained_converting(cls, model, model_id, *args, config=None, **kwargs):
    """PeftModel.from_pretrained, with a stock BERT LoRA adapter converted for our model on the way."""
    from peft import PeftConfig

    original = _peft_from_pretrained.__func__
    peft_config = config
    if peft_config is None and kwargs.get("subfolder") is None:
        peft_config = PeftConfig.from_pretrained(str(model_id), revision=kwargs.get("revision"))
    if not _is_stock_lora_for(model, peft_config, model_id, kwargs.get("revision")):
        return original(cls, model, model_id, *args, config=config, **kwargs)
    with tempfile.TemporaryDirectory() as converted:  # the weights are read into the model before it is removed
        folder = model_id if os.path.isdir(model_id) else _download(str(model_id), kwargs.get("revision"))
        convert_stock_lora(folder, converted)
        kwargs.pop("revision", None)
        return original(cls, model, converted, *args, **kwargs)


def _download(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision)


def convert_stock_adapters_on_load(enable: bool) -> None:
    """Replace (True) or restore (False) `PeftModel.from_pretrained` by one that converts stock BERT LoRA adapters
    for our models (`apply_bert_impl()` / `revert_bert_impl()` call this). Nothing without peft."""
    global _peft_from_pretrained
    try:
        from peft import PeftModel
    except ImportError:
        return
    if enable and _peft_from_pretrained is None:
        _peft_from_pretrained = PeftModel.__dict__["from_pretrained"]
        PeftModel.from_pretrained = classmethod(_from_pretrained_converting)
    elif not enable and _peft_from_pretrained is not None:
        PeftModel.from_pretrained = _peft_from_pretrained
        _peft_from_pretrained = None


def _our_module_path(stock_path: str) -> tuple[str, int | None]:
    """A module path in a stock BERT model -> (its path in ours, None), or (the fused qkv's path, 0|1|2) for
    query/key/value."""
    for source, target in STOCK_TO_OURS:
        stock_path = stock_path.replace(source, target)
    for part, name in enumerate(STOCK_QKV):
        if stock_path == name or stock_path.endswith("." + name):
            return stock_path[: -len(name)] + "attn.qkv", part
    return stock_path, None


def convert_stock_lora(adapter: str | os.PathLike, output_dir: str | os.PathLike) -> str:
    """Rewrite a LoRA adapter trained on transformers' BERT for bert-impl; returns `output_dir`.

    `adapter`: a folder or a Hub repo id (`adapter_config.json` + `adapter_model.safetensors`). The result loads with
    `PeftModel.from_pretrained(our_model, output_dir)` and gives the same outputs as the stock adapter on the stock
    model. Exact: LoRA on query (rank r_q) and value (r_v) is a LoRA on the fused qkv of rank r_q + r_v, with A the
    two A's stacked and B holding each B in its own block (zeros for key); each module's scaling (lora_alpha / r, or
    / sqrt(r) with rsLoRA, per-module `alpha_pattern` included) is folded into its B, so every converted module has
    scaling 1 (lora_alpha = r). Other targeted modules and `modules_to_save` are renamed only. Modules are named
    by full path in the new config. DoRA, LoRA bias and `target_parameters` adapters are refused."""
    from peft import LoraConfig, PeftConfig
    from peft.utils.other import get_pattern_key
    from safetensors.torch import load_file, save_file

    folder = str(adapter) if os.path.isdir(adapter) else _download(str(adapter), None)
    config = PeftConfig.from_pretrained(folder)
    if not isinstance(config, LoraConfig):
        raise ValueError(f"{adapter}: only LoRA adapters can be converted, this one is {config.peft_type}")
    for flag in ("use_dora", "lora_bias", "target_parameters"):
        if getattr(config, flag, None):
            raise ValueError(f"{adapter}: {flag} adapters cannot be converted (its weights are not a low-rank update)")
    weights = load_file(os.path.join(folder, "adapter_model.safetensors"))

    prefix = "base_model.model."
    out, lora = {}, {}  # lora: our module path -> {part (None, 0, 1, 2): (A, B * scaling)}
    for key in [k for k in weights if ".lora_A." in k]:
        stock_path = key.split(".lora_A.")[0]
        A, B = weights.pop(key), weights.pop(key.replace(".lora_A.", ".lora_B."))  # (r, in), (out, r)
        name = stock_path.removeprefix(prefix)
        r, alpha = A.shape[0], config.alpha_pattern.get(get_pattern_key(config.alpha_pattern, name), config.lora_alpha)
        scaling = alpha / (r**0.5 if config.use_rslora else r)
        path, part = _our_module_path(stock_path)
        lora.setdefault(path, {})[part] = (A, B * scaling)
    if any(".lora_" in k for k in weights):
        raise ValueError(f"{adapter}: LoRA weights other than lora_A/lora_B ({next(k for k in weights if '.lora_' in k)})")
    for key, value in weights.items():  # modules_to_save and the like
        out[_our_module_path(key)[0]] = value

    ranks = {}
    for path, parts in lora.items():
        if None in parts:
            A, B = parts[None]
        else:  # query/key/value: A stacked, B block-placed in the (3H, R) matrix
            H = next(iter(parts.values()))[1].shape[0]
            A = torch.cat([parts[p][0] for p in sorted(parts)])  # (R, H)
            B = A.new_zeros(3 * H, A.shape[0])  # (3H, R)
            offset = 0
            for p in sorted(parts):
                r = parts[p][0].shape[0]
                B[p * H:(p + 1) * H, offset:offset + r] = parts[p][1]
                offset += r
        out[f"{path}.lora_A.weight"], out[f"{path}.lora_B.weight"] = A.contiguous(), B.contiguous()
        ranks[path.removeprefix(prefix)] = A.shape[0]

    r = Counter(ranks.values()).most_common(1)[0][0]
    other = {name: rank for name, rank in ranks.items() if rank != r}
    converted = copy.deepcopy(config)
    for field, value in dict(
        target_modules=sorted(ranks), layers_to_transform=None, layers_pattern=None,
        r=r, lora_alpha=r, use_rslora=False, rank_pattern=other, alpha_pattern=dict(other),
    ).items():
        setattr(converted, field, value)
    os.makedirs(output_dir, exist_ok=True)
    converted.save_pretrained(str(output_dir))
    save_file(out, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    return str(output_dir)
