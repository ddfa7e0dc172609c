"""BERT's descendants through BERT's encoder: RoBERTa (Liu et al., 2019), XLM-RoBERTa and CamemBERT, with each stock
family's module tree, parameter names and heads.

They are BERT's layers with other embeddings and heads, as text-embeddings-inference serves them: positions counted
from padding_idx + 1 over the input ids, one token type, no next-sentence head; a classification head of its own on
each sequence's first token (<s>), and an LM head (dense, GELU, layer_norm, a decoder tied to the word embeddings). So
the layers, attention, layouts, path choice and input checks are BERT's (modeling_bert_impl.py, layouts.py,
input_checks.py), and so is every head that stock RoBERTa shares with stock BERT (token classification, question
answering, multiple choice). This file holds what differs; XLM-RoBERTa's and CamemBERT's classes are RoBERTa's under
their own names and configs, as transformers' are (`family_classes`).

Shapes: B batch, T tokens, H hidden, V vocabulary, C labels, S the sequences of a batch.
"""

import torch
from torch import nn
from transformers.activations import gelu

from .configuration_roberta_impl import CamembertImplConfig, RobertaImplConfig, XLMRobertaImplConfig
from .layouts import remember_forwards
from .modeling_bert_impl import (
    BertImplEmbeddings,
    BertImplForMaskedLM,
    BertImplForMultipleChoice,
    BertImplForQuestionAnswering,
    BertImplForSequenceClassification,
    BertImplForTokenClassification,
    BertImplModel,
    BertImplPreTrainedModel,
    classifier_dropout,
)


class RobertaImplEmbeddings(BertImplEmbeddings):
    """BERT's embeddings with RoBERTa's positions (`positions`) and stock's module order (word, token type, LayerNorm,
    dropout, position); the position table's padding_idx row is the padding token's position."""

    def __init__(self, config: RobertaImplConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.position_offset = self.padding_idx + 1
        del self.position_embeddings  # stock RoBERTa's comes last, with a padding row
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=self.padding_idx)

    def positions(self, input_ids, embeddings, cache_length: int = 0) -> torch.Tensor:
        """From the ids (`create_position_ids_from_input_ids`), (B, T); without ids, padding_idx + 1, ... (1, T)."""
        if input_ids is None:
            return self.position_ids[:, self.position_offset:self.position_offset + embeddings.shape[1]]
        return self.create_position_ids_from_input_ids(input_ids, self.padding_idx, cache_length)

    # Stock RobertaEmbeddings' position helpers, which user code calls on the class (and so on ours).
    @staticmethod
    def create_position_ids_from_input_ids(input_ids, padding_idx: int, cache_length: int = 0) -> torch.Tensor:
        """fairseq's `make_positions`: each row's tokens other than `padding_idx` counted from padding_idx + C + 1
        (C cached keys ahead of them), `padding_idx` at padding. (B, T) ids -> (B, T) int64."""
        tokens = input_ids.ne(padding_idx).long()  # (B, T)
        return (tokens.cumsum(1) + cache_length) * tokens + padding_idx

    @staticmethod
    def create_position_ids_from_inputs_embeds(inputs_embeds, padding_idx: int) -> torch.Tensor:
        """Without ids padding cannot be told apart: padding_idx + 1, ... for every row. (B, T, H) -> (B, T) int64."""
        B, T = inputs_embeds.shape[:2]
        positions = torch.arange(padding_idx + 1, T + padding_idx + 1, device=inputs_embeds.device)  # (T,)
        return positions[None].expand(B, T)


class RobertaImplLMHead(nn.Module):
    """dense, GELU, layer_norm, then the decoder to the vocabulary: its weight tied to the word embeddings, its bias to
    `bias`. (..., H) -> (..., V)."""

    def __init__(self, config: RobertaImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, features, **kwargs):
        return self.decoder(self.layer_norm(gelu(self.dense(features))))


class RobertaImplClassificationHead(nn.Module):
    """The sentence classifier on the first position of what it is given: dropout, dense, tanh, dropout, out_proj.
    Given each sequence's first token (<s>) by the model, (B, 1, H) or a packed batch's (S, 1, H) -> (B or S, C)."""

    def __init__(self, config: RobertaImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = classifier_dropout(config)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, features, **kwargs):
        x = self.dropout(features[:, 0])  # (B, H)
        return self.out_proj(self.dropout(torch.tanh(self.dense(x))))


class RobertaImplPreTrainedModel(BertImplPreTrainedModel):
    config_class = RobertaImplConfig
    config: RobertaImplConfig
    base_model_prefix = "roberta"
    _no_split_modules = ["RobertaImplEmbeddings", "BertImplLayer"]
    embeddings_class = RobertaImplEmbeddings

    def _init_weights(self, module):
        """BERT's, and the LM head's own bias zero."""
        super()._init_weights(module)
        if isinstance(module, RobertaImplLMHead):
            nn.init.zeros_(module.bias)


class RobertaImplModel(RobertaImplPreTrainedModel, BertImplModel):
    """RoBERTa's encoder: BERT's with RoBERTa's embeddings (a packed batch's positions restart at padding_idx + 1)."""


class RobertaImplForMaskedLM(RobertaImplPreTrainedModel, BertImplForMaskedLM):
    """BERT's masked LM with RoBERTa's LM head, `lm_head`."""

    _tied_weights_keys = {
        "lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    }

    def __init__(self, config: RobertaImplConfig):
        super(BertImplForMaskedLM, self).__init__(config)  # the modules are stock RoBERTa's, not BERT's head's
        self.add_base_model(add_pooling_layer=False)
        self.lm_head = RobertaImplLMHead(config)
        self.post_init()

    def vocabulary_head(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head.decoder = value


class RobertaImplForSequenceClassification(RobertaImplPreTrainedModel, BertImplForSequenceClassification):
    """RoBERTa's classification head on each sequence's first token ([CLS]'s place: <s>); the model has no pooler."""

    def __init__(self, config: RobertaImplConfig):
        super(BertImplForSequenceClassification, self).__init__(config)  # stock RoBERTa's modules
        self.num_labels = config.num_labels
        self.add_base_model(add_pooling_layer=False)
        self.classifier = RobertaImplClassificationHead(config)
        self.post_init()

    @property
    def reads_first_tokens(self) -> nn.Module:
        return self.classifier

    def logits(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled  # the classification head's output already


class RobertaImplForTokenClassification(RobertaImplPreTrainedModel, BertImplForTokenClassification):
    """BERT's: dropout and a linear classifier on every token."""


class RobertaImplForQuestionAnswering(RobertaImplPreTrainedModel, BertImplForQuestionAnswering):
    """BERT's: start and end logits from every token."""


class RobertaImplForMultipleChoice(RobertaImplPreTrainedModel, BertImplForMultipleChoice):
    """BERT's, with stock RoBERTa's dropout before the classifier (hidden_dropout_prob, whatever classifier_dropout
    says)."""

    def __init__(self, config: RobertaImplConfig):
        super().__init__(config)
        self.dropout.p = config.hidden_dropout_prob


# Every class above with the Auto class that loads it; written into saved configs as `auto_map`.
ROBERTA_AUTO_CLASSES = {
    "AutoModel": RobertaImplModel,
    "AutoModelForMaskedLM": RobertaImplForMaskedLM,
    "AutoModelForSequenceClassification": RobertaImplForSequenceClassification,
    "AutoModelForTokenClassification": RobertaImplForTokenClassification,
    "AutoModelForQuestionAnswering": RobertaImplForQuestionAnswering,
    "AutoModelForMultipleChoice": RobertaImplForMultipleChoice,
}


def encoder_model_last(init):
    """A head's constructor whose modules end with its encoder model: transformers' XLM-RoBERTa and CamemBERT heads
    register theirs after the head's own modules (`lm_head`, `roberta`), so their state dicts are in that order."""
    def __init__(self, config):
        init(self, config)
        self._modules[self.base_model_prefix] = self._modules.pop(self.base_model_prefix)
    return __init__


def family_classes(prefix: str, config_class: type) -> dict[str, type]:
    """RoBERTa's classes under another family's name and config, by Auto class: "XLMRoberta" gives
    XLMRobertaImplModel, XLMRobertaImplForMaskedLM, ... (transformers' XLM-RoBERTa and CamemBERT are RoBERTa's
    classes so, their heads' modules in another order: `encoder_model_last`). Each head's encoder model is the
    family's own."""
    classes = {}
    for auto, cls in ROBERTA_AUTO_CLASSES.items():
        name = cls.__name__.replace("Roberta", prefix, 1)
        own = {"config_class": config_class, "__module__": __name__, "__qualname__": name, "__doc__": cls.__doc__}
        if auto != "AutoModel":
            own["__init__"] = encoder_model_last(cls.__init__)
        classes[auto] = type(name, (cls,), own)
    for cls in classes.values():
        cls.base_model_class, cls.auto_classes = classes["AutoModel"], classes
    return classes


RobertaImplPreTrainedModel.base_model_class, RobertaImplPreTrainedModel.auto_classes = (RobertaImplModel,
                                                                                        ROBERTA_AUTO_CLASSES)
XLM_ROBERTA_AUTO_CLASSES = family_classes("XLMRoberta", XLMRobertaImplConfig)
CAMEMBERT_AUTO_CLASSES = family_classes("Camembert", CamembertImplConfig)
globals().update({cls.__name__: cls for classes in (XLM_ROBERTA_AUTO_CLASSES, CAMEMBERT_AUTO_CLASSES)
                  for cls in classes.values()})  # importable by name: remote code's auto_map, pickles
# transformers' model_type of each family's stock checkpoints -> our classes by Auto class
FAMILIES = {"roberta": ROBERTA_AUTO_CLASSES, "xlm-roberta": XLM_ROBERTA_AUTO_CLASSES,
            "camembert": CAMEMBERT_AUTO_CLASSES}
for _classes in FAMILIES.values():
    for _auto_class, _model_class in _classes.items():
        _model_class.register_for_auto_class(_auto_class)
    _classes["AutoModel"].config_class.register_for_auto_class()
remember_forwards(globals())
