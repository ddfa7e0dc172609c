"""Configuration of bert-impl: transformers' BERT field names, validated, with the paper's sizes as presets."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .stock_format import our_name

# name -> (num_hidden_layers, hidden_size, num_attention_heads); intermediate_size is 4 * hidden_size.
# tiny..medium are the compact models of Turc et al. (2019); base and large are the paper's.
PRESETS = {
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}


@strict
class BertImplConfig(PreTrainedConfig):
    r"""
    Configuration of a [`BertImplModel`]. Defaults give BERT-base (L=12, H=768, A=12, 110M parameters).

    Fields are transformers' `BertConfig` fields, so a stock BERT `config.json` reads as is. Beyond them:

    unpad_inputs (`bool` or `None`, defaults to `None`):
        Run the encoder without the batch's padding when the attention mask has some (or the batch is packed): unpad
        once per forward, re-pad the outputs. On CUDA the dense layers see real tokens only; on CPU sequences are
        bucketed by length and padded within their bucket (a few percent of extra rows, no copies per layer). Same
        outputs as the padded computation, less work. `None`: so where the padded rows skipped cost more than the
        padding-free layout itself (a batch with a few padded rows runs padded: `layouts.skipping_pays`), except on
        a call where code of the user's looks inside the encoder (a hook on one of its modules, a submodule replaced
        by a class of the user's), which runs the padded layout so that this code sees stock's (B, T, H) tensors.
        `True`: always (hooks inside the encoder then see the (P, H) rows of real tokens). `False`: never. The
        `eager` attention implementation and `output_attentions=True` always take the padded path.
    sparse_prediction (`bool`, defaults to `False`):
        With MLM `labels`, run the vocabulary decoder on the masked positions only (labels != -100): the masked-LM and
        pre-training heads then return logits for those M rows, (M, V) in row-major (B, T) order, and the same loss.
        Off by default, so logits are (B, T, V) as transformers' BERT gives them (and as `compute_metrics` written for
        it expects); the pre-training recipe turns it on (transformers' ModernBERT has the same switch, also off by
        default). Saved with the config, so a checkpoint of that recipe has it on: pass `sparse_prediction=False` to
        `from_pretrained` for full logits. Without labels, logits are always (B, T, V).
    """

    model_type = "bert_impl"
    stock_model_type = "bert"  # transformers' model type whose config.json this class reads as its own

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    classifier_dropout: float | int | None = None
    tie_word_embeddings: bool = True
    unpad_inputs: bool | None = None
    sparse_prediction: bool = False
    # Stock's decoder switches, there so that code reading them (transformers' EncoderDecoderModel, model testers)
    # finds stock's defaults; True is refused (`check_supported`).
    is_decoder: bool = False
    add_cross_attention: bool = False

    def __post_init__(self, **kwargs):
        # Stock BERT configs carry these: an older BERT's position_embedding_type (refused but for "absolute"), and
        # use_cache, which stock reads only in a decoder (an encoder has nothing to cache, as stock's does not).
        position_embedding_type = kwargs.pop("position_embedding_type", "absolute")
        if position_embedding_type != "absolute":
            self.position_embedding_type = position_embedding_type  # refused just below
        for stock_only in ("use_cache", "model_type", "gradient_checkpointing"):
            kwargs.pop(stock_only, None)
        check_supported(self)
        self._check_sizes()
        super().__post_init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' reading of a config.json, with a stock one of the family (model_type "bert" here,
        `stock_model_type`) translated into ours: the fields are the same; its model type and `BertForX` architectures
        become ours. Loading stock checkpoints is supported, so it is done deliberately here instead of through
        transformers' warning about a model of another type."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") == cls.stock_model_type:
            architectures = [our_name(name) for name in config_dict.get("architectures") or []]
            config_dict = {**config_dict, "model_type": cls.model_type, "architectures": architectures or None}
        return config_dict, kwargs

    def _check_sizes(self):
        """Sizes positive, heads dividing the hidden size, probabilities in [0, 1): a ValueError naming the field."""
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings", "type_vocab_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            p = getattr(self, name)
            if p is not None and not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")

    @classmethod
    def from_preset(cls, name: str, **kwargs) -> "BertImplConfig":
        """`BertImplConfig.from_preset("base")`; keyword arguments override the preset's fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        layers, hidden, heads = PRESETS[name]
        sizes = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden)
        return cls(**{**sizes, **kwargs})


def check_supported(config) -> None:
    """What a BERT config (ours, or a stock one given to a patched class: integrations/patching.py) can ask for and
    this encoder does not implement, refused with a ValueError naming the field: at construction, and again when a
    model is built and on every forward, since transformers' model testers, EncoderDecoderModel and user code set
    these on a config that exists (`config.is_decoder = True`)."""
    position_embedding_type = getattr(config, "position_embedding_type", "absolute")
    if position_embedding_type != "absolute":
        raise ValueError(f"config.position_embedding_type={position_embedding_type!r}: only 'absolute' (learned) "
                         "position embeddings are implemented")
    for name in ("is_decoder", "add_cross_attention"):
        if getattr(config, name, False):
            raise ValueError(
                f"config.{name}=True: bert-impl is a bidirectional encoder with no causal mask and no "
                "cross-attention. For a decoder take transformers' BertLMHeadModel (as EncoderDecoderModel's "
                "decoder it works beside a bert-impl encoder); set it back to False for an encoder"
            )
