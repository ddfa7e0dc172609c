"""bert-impl: BERT written from scratch as a transformers model.

Importing this package registers `bert_impl` with transformers' Auto classes (config, every head, and the tokenizer
from the `tokenization` package), so `AutoModelForX.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)`
give our classes without `trust_remote_code`. With peft installed, it also gives "bert_impl" peft's default target
modules and makes PeftModel move adapters between our module names and stock BERT's (`peft_support`).
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
from .model_card import write_model_card
from .patching import apply_bert_impl, revert_bert_impl
from .peft_support import (
    convert_adapter_to_stock,
    convert_adapters_on_save_and_load,
    convert_stock_adapter,
    register_peft_defaults,
)
from .compiled_encoder import compile_for_inference
from .quantization import quantize_for_inference
from .serving import optimize_for_inference


def _register() -> None:
    import transformers

    AutoConfig.register(BertImplConfig.model_type, BertImplConfig, exist_ok=True)
    for auto_name, model_class in AUTO_CLASSES.items():
        getattr(transformers, auto_name).register(BertImplConfig, model_class, exist_ok=True)
    AutoTokenizer.register(BertImplConfig, tokenizer_class=BertImplTokenizer, exist_ok=True)


_register()
register_peft_defaults()  # peft's default target_modules for "bert_impl" (nothing without peft)
convert_adapters_on_save_and_load()  # adapters in stock BERT's module names where the base is stock BERT

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
    "convert_stock_adapter",
    "convert_adapter_to_stock",
    "optimize_for_inference",
    "quantize_for_inference",
    "compile_for_inference",
]
