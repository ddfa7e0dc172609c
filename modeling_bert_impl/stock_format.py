"""The stock BERT format, both ways: what a folder of transformers' `BertModel` / `BertForX` holds, and how bert-impl's
folders and classes map onto it. Checkpoint code (copied into saved folders with the model); it imports no other file
of the package.

- parameter names: bert-impl's are stock's; folders saved before it took them (`bert.layers.N.attn.qkv`, `ffn.up`,
  `mlm_head`, ...) load through one map of their names to stock's (`OLD_TO_STOCK`, `old_names_conversion`);
- config: a stock config.json has none of our fields (`OUR_FIELDS`); `write_stock_config` writes one;
- class names: `stock_name` (ours -> transformers') and `our_name` (transformers' -> ours), for every family
  (`STOCK_FAMILIES`: BERT and its descendants RoBERTa, XLM-RoBERTa, CamemBERT).
"""

import json
import os
import re

from transformers.core_model_loading import Chunk, WeightConverter, WeightRenaming

OLD_TO_STOCK = [
    (r"embeddings\.norm\.", "embeddings.LayerNorm."),
    (r"^bert\.layers\.", "bert.encoder.layer."),
    (r"^layers\.", "encoder.layer."),
    (r"\.attn\.out\.", ".attention.output.dense."),
    (r"\.attn_norm\.", ".attention.output.LayerNorm."),
    (r"\.ffn\.up\.", ".intermediate.dense."),
    (r"\.ffn\.down\.", ".output.dense."),
    (r"\.ffn_norm\.", ".output.LayerNorm."),
    (r"^mlm_head\.dense\.", "cls.predictions.transform.dense."),
    (r"^mlm_head\.norm\.", "cls.predictions.transform.LayerNorm."),
    (r"^mlm_head\.decoder\.bias", "cls.predictions.bias"),  # stock ties the decoder's bias to this one
    (r"^mlm_head\.decoder\.", "cls.predictions.decoder."),
    (r"^nsp_head\.", "cls.seq_relationship."),
]

# transformers' class-name prefix of each family -> its model_type; ours insert "Impl" after the prefix
# (XLMRobertaForMaskedLM -> XLMRobertaImplForMaskedLM)
STOCK_FAMILIES = {"Bert": "bert", "Roberta": "roberta", "XLMRoberta": "xlm-roberta", "Camembert": "camembert"}

# bert-impl's config fields beyond stock's, with their defaults (BertImplConfig declares the same), and auto_map
OUR_FIELDS = {"unpad_inputs": None, "sparse_prediction": False}
OUR_CONFIG_FIELDS = ("auto_map", *OUR_FIELDS)


def old_names_conversion() -> list:
    """What transformers applies to the keys of a folder with the old names when loading it (stock keys and ours pass
    through untouched): the renamings, then the fused QKV projection cut into query, key and value."""
    renamings = [WeightRenaming(source, target) for source, target in OLD_TO_STOCK]
    qkv = WeightConverter(r"attn\.qkv\.", [r"attention.self.query.", r"attention.self.key.", r"attention.self.value."],
                          operations=[Chunk(dim=0)])
    return renamings + [qkv]


def write_stock_config(folder: str, architecture: str) -> None:
    """Rewrite `folder`/config.json as plain transformers writes it for its class `architecture` (e.g. "BertModel"):
    its family's model_type ("bert"), no fields of ours, no `auto_map`."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key in OUR_CONFIG_FIELDS:
        config.pop(key, None)
    config.update(model_type=STOCK_FAMILIES[family(architecture)], architectures=[architecture])
    with open(path, "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def family(name: str) -> str | None:
    """The family prefix of a class name, ours or transformers' (XLMRobertaImplModel -> "XLMRoberta"), or None."""
    match = re.match(r"(XLMRoberta|Roberta|Camembert|Bert)(Impl)?(Model|For)", name)
    return match and match[1]


def stock_name(model_class: type) -> str:
    """Our class -> transformers' class of the same head: BertImplForMaskedLM -> BertForMaskedLM,
    XLMRobertaImplModelOnXLMRobertaConfig -> XLMRobertaModel."""
    return re.sub(r"On\w+Config$", "", model_class.__name__).replace("Impl", "", 1)


def our_name(architecture: str) -> str:
    """transformers' class name -> ours (BertForMaskedLM -> BertImplForMaskedLM, RobertaModel -> RobertaImplModel);
    other names as they are."""
    prefix = family(architecture)
    if prefix is None or architecture.startswith(f"{prefix}Impl") or architecture.endswith("ForCausalLM"):
        return architecture
    return f"{prefix}Impl{architecture[len(prefix):]}"
