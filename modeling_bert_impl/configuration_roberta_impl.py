"""Configuration of BERT's descendants in bert-impl: RoBERTa, XLM-RoBERTa and CamemBERT. Their stock configs have BERT's
fields (transformers' RobertaConfig, XLMRobertaConfig and CamembertConfig), so each class is `BertImplConfig` with its
family's model types and defaults."""

from huggingface_hub.dataclasses import strict

from .configuration_bert_impl import BertImplConfig


@strict
class RobertaImplConfig(BertImplConfig):
    r"""
    Configuration of a [`RobertaImplModel`]: `BertImplConfig`'s fields, with transformers' RobertaConfig's defaults
    (`vocab_size=50265`, `pad_token_id=1`, `bos_token_id=0`, `eos_token_id=2`). Positions count from
    `pad_token_id + 1` (RoBERTa checkpoints have `max_position_embeddings=514` for 512 tokens), and the padding token
    has position `pad_token_id`, as in fairseq and transformers.
    """

    model_type = "roberta_impl"
    stock_model_type = "roberta"

    vocab_size: int = 50265
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2

    def _check_sizes(self):
        super()._check_sizes()
        if self.pad_token_id is None or not 0 <= self.pad_token_id < self.max_position_embeddings - 1:
            raise ValueError(f"pad_token_id must be set, and leave positions for tokens after it in the position table "
                             f"(positions count from pad_token_id + 1): got pad_token_id={self.pad_token_id}, "
                             f"max_position_embeddings={self.max_position_embeddings}")


@strict
class XLMRobertaImplConfig(RobertaImplConfig):
    """Configuration of an [`XLMRobertaImplModel`]: RoBERTa's, with XLMRobertaConfig's defaults (`vocab_size=30522`)."""

    model_type = "xlm_roberta_impl"
    stock_model_type = "xlm-roberta"

    vocab_size: int = 30522


@strict
class CamembertImplConfig(RobertaImplConfig):
    """Configuration of a [`CamembertImplModel`]: RoBERTa's, with CamembertConfig's defaults (`vocab_size=30522`)."""

    model_type = "camembert_impl"
    stock_model_type = "camembert"

    vocab_size: int = 30522
