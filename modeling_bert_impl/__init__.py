"""bert-impl: BERT written from scratch as a transformers model, and its descendants RoBERTa, XLM-RoBERTa and CamemBERT
through the same encoder.

Importing this package registers `bert_impl` (and `roberta_impl`, `xlm_roberta_impl`, `camembert_impl`) with
transformers' Auto classes (config, every head, and the tokenizer: BERT's from the `tokenization` package, the
families' transformers' own), so `AutoModelForX.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)`
give our classes without `trust_remote_code`; and, where peft is installed, gives peft's tables their default target
modules (`integrations.peft_support`).

Layout: the checkpoint's code (configurations, models, layouts, padding helpers, input checks, the stock format) flat
here, copied into saved folders, importing nothing else of the package; the CPU inference engine in `inference/`;
PEFT, `apply_bert_impl`, ONNX export and the model card in `integrations/`, given to the model by this file.
"""

from transformers import AutoConfig, AutoTokenizer

from tokenization import BertImplTokenizer

from .configuration_bert_impl import PRESETS, BertImplConfig
from .configuration_roberta_impl import CamembertImplConfig, RobertaImplConfig, XLMRobertaImplConfig
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
from .modeling_roberta_impl import (
    CAMEMBERT_AUTO_CLASSES,
    FAMILIES,
    XLM_ROBERTA_AUTO_CLASSES,
    RobertaImplForMaskedLM,
    RobertaImplForMultipleChoice,
    RobertaImplForQuestionAnswering,
    RobertaImplForSequenceClassification,
    RobertaImplForTokenClassification,
    RobertaImplModel,
    RobertaImplPreTrainedModel,
)
from .inference import compile_for_inference, optimize_for_inference, quantize_for_inference
from .integrations.model_card import replace_generic_card, write_model_card
from .integrations.patching import apply_bert_impl, revert_bert_impl
from .integrations.peft_support import fill_when_imported, register_peft_defaults


# Tokenizers of the families' folders that name none: transformers' own (their vocabularies are BPE and SentencePiece)
FAMILY_TOKENIZERS = {RobertaImplConfig: "RobertaTokenizer", XLMRobertaImplConfig: "XLMRobertaTokenizer",
                     CamembertImplConfig: "CamembertTokenizer"}


def _register() -> None:
    import transformers

    for config_class, classes in ((BertImplConfig, AUTO_CLASSES), *((c["AutoModel"].config_class, c)
                                                                     for c in FAMILIES.values())):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_name, model_class in classes.items():
            getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)
    AutoTokenizer.register(BertImplConfig, tokenizer_class=BertImplTokenizer, exist_ok=True)
    for config_class, tokenizer in FAMILY_TOKENIZERS.items():
        AutoTokenizer.register(config_class, tokenizer_class=getattr(transformers, tokenizer), exist_ok=True)
    BertImplPreTrainedModel.card_writer = staticmethod(replace_generic_card)  # push_to_hub writes our model card


_register()
fill_when_imported()  # peft's default target modules for our model types, when peft is imported
globals().update({cls.__name__: cls for classes in (XLM_ROBERTA_AUTO_CLASSES, CAMEMBERT_AUTO_CLASSES)
                  for cls in classes.values()})  # modeling_bert_impl.XLMRobertaImplModel, ...

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
    "RobertaImplConfig",
    "XLMRobertaImplConfig",
    "CamembertImplConfig",
    "RobertaImplPreTrainedModel",
    "RobertaImplModel",
    "RobertaImplForMaskedLM",
    "RobertaImplForSequenceClassification",
    "RobertaImplForTokenClassification",
    "RobertaImplForQuestionAnswering",
    "RobertaImplForMultipleChoice",
    *(cls.__name__ for classes in (XLM_ROBERTA_AUTO_CLASSES, CAMEMBERT_AUTO_CLASSES) for cls in classes.values()),
    "write_model_card",
    "apply_bert_impl",
    "revert_bert_impl",
    "optimize_for_inference",
    "quantize_for_inference",
    "compile_for_inference",
    "register_peft_defaults",
]
