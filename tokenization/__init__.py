"""bert-impl's tokenizer. Importing this package registers `BertImplTokenizer` with `AutoTokenizer`.

- `AutoTokenizer.from_pretrained(folder)` returns a `BertImplTokenizer` for a folder whose config is a `bert_impl`
  one, or whose `tokenizer_config.json` names `BertImplTokenizer`.
- `save_pretrained` also copies `tokenization_bert_impl.py` into the folder and records it in the `auto_map` of
  `tokenizer_config.json`, so the folder loads with `trust_remote_code=True` where this package is not installed.
"""

# The class is imported before the configuration: importing `modeling_bert_impl.configuration_bert_impl` runs
# `modeling_bert_impl/__init__.py`, which imports this package, and must then find `BertImplTokenizer` defined.
from .tokenization_bert_impl import BertImplTokenizer  # noqa: I001

from modeling_bert_impl.configuration_bert_impl import BertImplConfig
from transformers import AutoTokenizer

AutoTokenizer.register(BertImplConfig, tokenizer_class=BertImplTokenizer, exist_ok=True)
BertImplTokenizer.register_for_auto_class("AutoTokenizer")

__all__ = ["BertImplTokenizer"]
