"""bert-impl's tokenizer, `BertImplTokenizer`. This package stands alone: it imports nothing of the model package.

- `BertImplTokenizer.from_pretrained(folder)` loads any BERT tokenizer folder (`vocab.txt` and/or `tokenizer.json`).
- `AutoTokenizer.from_pretrained(folder)` returns a `BertImplTokenizer` once `modeling_bert_impl` is imported (it
  registers the class with `AutoTokenizer` for its `bert_impl` config): for a folder whose config is a `bert_impl`
  one, or whose `tokenizer_config.json` names `BertImplTokenizer`.
- `save_pretrained` also copies `tokenization_bert_impl.py` into the folder and records it in the `auto_map` of
  `tokenizer_config.json`, so the folder loads with `trust_remote_code=True` where bert-impl is not installed.
"""

from .tokenization_bert_impl import BertImplTokenizer

BertImplTokenizer.register_for_auto_class("AutoTokenizer")

__all__ = ["BertImplTokenizer"]
