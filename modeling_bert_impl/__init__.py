"""bert-impl: BERT written from scratch as a transformers model.

Importing this package registers `bert_impl` with transformers' Auto classes (config, every head, and the tokenizer
from the `tokenization` package), so `AutoModelForX.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)`
give our classes without `trust_remote_code`. peft's default target modules for "bert_impl" come with an explicit call,
`register_peft_defaults()` (`integrations.peft_support`).

Layout: the checkpoint's code (configuration, model, padding helpers, input checks, the stock format) flat here,
copied into saved folders, importing nothing else of the package; the CPU inference engine in `inference/`; PEFT,
`apply_bert_impl`, ONNX export and the model card in `integrations/`, given to the model by this file.
"""

from transformers import AutoConfig, AutoTokenizer

from tokenization import BertImplTokenizer

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
from .inference import compile_for_inference, optimize_for_inference, quantize_for_inference
from .integrations.model_card import replace_generic_card, write_model_card
from .integrations.patching import apply_bert_impl, revert_bert_impl
from .integrations.peft_support import register_peft_defaults


def _register() -> None:
    import transformers

    AutoConfig.register(BertImplConfig.model_type, BertImplConfig, exist_ok=True)
    for auto_name, model_class in AUTO_CLASSES.items():
        getattr(transformers, auto_name).register(BertImplConfig, model_class, exist_ok=True)
    AutoTokenizer.register(BertImplConfig, tokenizer_class=BertImplTokenizer, exist_ok=True)
    BertImplPreTrainedModel.card_writer = staticmethod(replace_generic_card)  # push_to_hub writes our model card


_register()

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
    "apply_bert_impl",
    "revert_bert_impl",
    "optimize_for_inference",
    "quantize_for_inference",
    "compile_for_inference",
    "register_peft_defaults",
]
