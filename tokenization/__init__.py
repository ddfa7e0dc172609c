"""bert-impl's tokenizer, `BertImplTokenizer`. This package stands alone: it imports nothing of the model package.

- `BertImplTokenizer.from_pretrained(folder)` loads any BERT tokenizer folder (`vocab.txt` and/or `tokenizer.json`).
- `AutoTokenizer.from_pretrained(folder)` returns a `BertImplTokenizer`, without `trust_remote_code`, once this package
  is imported (directly, or through `modeling_bert_impl`): for a folder whose `tokenizer_config.json` names
  `BertImplTokenizer` (what `save_pretrained` writes). `modeling_bert_impl` also maps its `bert_impl` config to the
  class, for a model folder whose tokenizer config names no class.
- `save_pretrained` also copies `tokenization_bert_impl.py` into the folder and records it in the `auto_map` of
  `tokenizer_config.json`, so the folder loads with `trust_remote_code=True` where bert-impl is not installed (and,
  being a BERT folder, with transformers' `BertTokenizer.from_pretrained(folder)`: the same ids, transformers' class).
"""

from transformers.models.auto import tokenization_auto

from .tokenization_bert_impl import BertImplTokenizer

BertImplTokenizer.register_for_auto_class("AutoTokenizer")
# AutoTokenizer finds the class a tokenizer_config.json names among the ones registered by name (what
# `AutoTokenizer.register` records, which also needs the model's config class, a part of the model package).
tokenization_auto.REGISTERED_TOKENIZER_CLASSES.setdefault(BertImplTokenizer.__name__, BertImplTokenizer)

__all__ = ["BertImplTokenizer"]
