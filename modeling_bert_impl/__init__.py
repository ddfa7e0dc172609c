"""bert-impl: BERT written from scratch as a transformers model.

Importing this package registers `bert_impl` with transformers' Auto classes (config, every head, and the tokenizer),
so `AutoModelForX.from_pretrained(folder)` gives our classes without `trust_remote_code`.
"""

from transformers import AutoConfig

from .configuration_bert_impl import PRESETS, BertImplConfig
from .modeling_bert_impl import (
    AUTO_CLASSES,
    BertImplForMaskedLM,
    BertImplForMultipleChoice,
    BertImplForNextSentencePrediction,
    BertImplForPreTraining,
    BertImplForPreTrainingOutput,
    BertImplForQuestionAnswering,
    BertImplForSequenceClassification,
    BertImplForTokenClassification,
    BertImplModel,
    BertImplPreTrainedModel,
)


def _register() -> None:
    import transformers

    AutoConfig.register(BertImplConfig.model_type, BertImplConfig, exist_ok=True)
    for auto_name, model_class in AUTO_CLASSES.items():
        getattr(transformers, auto_name).register(BertImplConfig, model_class, exist_ok=True)


_register()

# Importing the tokenizer registers it with AutoTokenizer for BertImplConfig (so it comes after the config).
from tokenization import BertImplTokenizer  # noqa: E402

from .model_card import write_model_card  # noqa: E402
from .serving import optimize_for_inference  # noqa: E402

__all__ = [
    "PRESETS",
    "BertImplConfig",
    "BertImplPreTrainedModel",
    "BertImplModel",
    "BertImplForPreTraining",
    "BertImplForPreTrainingOutput",
    "BertImplForMaskedLM",
    "BertImplForNextSentencePrediction",
    "BertImplForSequenceClassification",
    "BertImplForTokenClassification",
    "BertImplForQuestionAnswering",
    "BertImplForMultipleChoice",
    "BertImplTokenizer",
    "write_model_card",
    "optimize_for_inference",
]
