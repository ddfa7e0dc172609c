"""bert-impl: BERT written from scratch as a transformers model. Importing this package registers `bert_impl`."""

from .configuration_bert_impl import PRESETS, BertImplConfig

__all__ = ["PRESETS", "BertImplConfig"]
