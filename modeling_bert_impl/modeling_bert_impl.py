"""BERT (Devlin et al., 2019) written from scratch as a transformers model, with stock BERT's module tree and names.

Shapes: B batch, T tokens, H hidden, N heads, D head dim (H = N * D), V vocabulary, S the sequences of a batch (B for a
padded batch, more for a packed one), P the rows of a padding-free layout (the real tokens, or a few more in the CPU's
bucketed layout).

A forward reads its batch once (input_checks.py: every check and what the rest needs, in one host-device transfer),
embeds it, and chooses a layout (layouts.py): where there is padding to skip (or the batch is packed), a padding-free
one, whose rows are the real tokens; else stock's padded one. The encoder asks the layout to enter (the embeddings'
(B, T, H) to its rows), each self-attention asks it to attend, and the encoder asks it to leave (rows back to (B, T, H),
zeros at padding). Code that looks inside the encoder (a hook of the user's, a module of the user's class, a replaced
`forward`) sees stock's (B, T, H) tensors all the same: the call then runs the padded layout (`layouts.looking_inside`;
`config.unpad_inputs` True or False overrides it).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    NextSentencePredictorOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput, TransformersKwargs, logging
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import capture_outputs
from typing_extensions import Unpack

from .configuration_bert_impl import BertImplConfig, check_supported
from .dropout import BertImplDropout
from .input_checks import (
    IGNORE_INDEX,
    class_label_checks,
    position_label_checks,
    read_batch,
    refuse_cross_attention,
    require_tracing_torch,
)
from .layouts import STANDALONE, choose_layout, remember_forwards
from .stock_format import old_names_conversion, stock_name, write_stock_config

logger = logging.get_logger(__name__)


# Folders saved before bert-impl took stock's names load through the map of their names to stock's (stock_format.py).
register_checkpoint_conversion_mapping("bert_impl", old_names_conversion(), overwrite=True)


# ---------------------------------------------------------------------------------------------------------------------
# Embeddings and attention
# ---------------------------------------------------------------------------------------------------------------------
class BertImplEmbeddings(nn.Module):
    """word + segment + learned position embeddings, LayerNorm, dropout: (B, T) ids -> (B, T, H). Stock's buffers of
    the default ids, `position_ids` (0, 1, ...) and `token_type_ids` (zeros), both (1, max_position_embeddings), not
    saved (code that slices them, as attribution tutorials do, finds them). Positions start at `position_offset`
    (0; RoBERTa's at padding_idx + 1: modeling_roberta_impl.py)."""

    position_offset = 0

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = BertImplDropout(config.hidden_dropout_prob)
        positions = torch.arange(config.max_position_embeddings)[None]  # (1, max_position_embeddings)
        self.register_buffer("position_ids", positions, persistent=False)
        self.register_buffer("token_type_ids", torch.zeros_like(positions), persistent=False)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, cache_length: int = 0,
                **kwargs):
        """cache_length: C keys and values ahead of the tokens (prefix tuning's virtual tokens): positions start at C,
        as in transformers' BERT (which named it `past_key_values_length` before 5.24)."""
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, H)
        T, C = x.shape[1], cache_length or kwargs.get("past_key_values_length", 0)
        if position_ids is None:
            position_ids = self.positions(input_ids, x, C)  # (1, T) or (B, T)
        if token_type_ids is None:
            token_type_ids = self.token_type_ids[:, :T]  # (1, T)
        x = x + self.token_type_embeddings(token_type_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(x))

    def positions(self, input_ids, embeddings, cache_length: int = 0) -> torch.Tensor:
        """The positions where none are given: C, C + 1, ... (1, T) for the T tokens of `embeddings` (B, T, H)."""
        T = embeddings.shape[1]
        return self.position_ids[:, cache_length:cache_length + T]


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The reference: softmax(q k^T * scaling + mask) v. q: (B, N, T, D); k, v: (B, N, C + T, D) with C cached keys
    (usually 0); mask additive (B, 1, T|1, C + T). Returns (B, T, N, D) and the attention weights (B, N, T, C + T)."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, N, T, C + T)
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class BertImplSelfAttention(nn.Module):
    """Multi-head self-attention on the rows of a layout (layouts.py): (B, T, H), or the (P, H) rows of a padding-free
    layout, each token attending to its own sequence. Returns the output and the attention weights (eager attention
    only; else None)."""

    is_causal = False  # read by transformers' attention functions

    def __init__(self, config: BertImplConfig, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = config.hidden_size
        self.scaling = self.attention_head_size**-0.5
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, layout=STANDALONE, **kwargs):
        """attention_mask: stock's argument, the padded layout's mask (None on the padding-free layouts, whose
        sequences are their own). The padded layout attends through transformers' attention function of its
        implementation (attention maps ask for eager); the padding-free ones through their own kernels."""
        shape = (*hidden_states.shape[:-1], self.num_attention_heads, self.attention_head_size)  # (..., N, D)
        q, k, v = (proj(hidden_states).view(shape) for proj in (self.query, self.key, self.value))
        dropout = self.dropout.p if self.training else 0.0
        implementation = layout.implementation or self.config._attn_implementation
        function = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        y, weights = layout.attend(self, q, k, v, attention_mask, dropout, function)  # (..., N, D)
        return y.flatten(-2), weights  # (..., H)


class BertImplSelfOutput(nn.Module):
    """LayerNorm(x + dropout(dense(attention output)))."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = BertImplDropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertImplAttention(nn.Module):
    def __init__(self, config: BertImplConfig, layer_idx: int | None = None):
        super().__init__()
        self.self = BertImplSelfAttention(config, layer_idx)
        self.output = BertImplSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, layout=STANDALONE, **kwargs):
        attention_output, weights = self.self(hidden_states, attention_mask=attention_mask, layout=layout, **kwargs)
        return self.output(attention_output, hidden_states), weights


class BertImplIntermediate(nn.Module):
    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states):
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertImplOutput(nn.Module):
    """LayerNorm(x + dropout(dense(intermediate))): the feed-forward's second product back to H. Its own class, as
    stock's BertOutput is, so that a patch of one of the two reaches what it reaches in stock."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = BertImplDropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertImplLayer(GradientCheckpointingLayer):
    """Post-LN Transformer layer: attention, then the feed-forward, each with its residual and LayerNorm, on the rows
    of a layout: (B, T, H) or (P, H) -> the same shape."""

    _can_checkpoint_with_cache = True  # read by transformers' gradient checkpointing: a layout's cache is only read

    def __init__(self, config: BertImplConfig, layer_idx: int | None = None):
        super().__init__()
        self.chunk_size_feed_forward = config.chunk_size_feed_forward  # rows the feed-forward takes at once; 0: all
        self.attention = BertImplAttention(config, layer_idx)
        self.intermediate = BertImplIntermediate(config)
        self.output = BertImplOutput(config)

    def forward(self, hidden_states, attention_mask=None, layout=STANDALONE, **kwargs):
        attention_output, _ = self.attention(hidden_states, attention_mask, layout=layout, **kwargs)
        if not self.chunk_size_feed_forward:
            return self.feed_forward(attention_output)
        chunks = attention_output.split(self.chunk_size_feed_forward, dim=-2)  # along T, or the P rows
        return torch.cat([self.feed_forward(chunk) for chunk in chunks], dim=-2)

    def feed_forward(self, attention_output):
        """Each token's feed-forward, residual and LayerNorm: the same rows whole or in chunks (stock's
        `chunk_size_feed_forward`, which trades time for the memory of the (T, intermediate_size) activations)."""
        return self.output(self.intermediate(attention_output), attention_output)


class BertImplEncoder(nn.Module):
    """The layers in turn, on the rows of a layout: hidden_states (B, T, H) enter it once and leave it once. Every
    hidden state returned is (B, T, H) with zeros at padding."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList(BertImplLayer(config, i) for i in range(config.num_hidden_layers))
        self.gradient_checkpointing = False

    def forward(self, hidden_states, attention_mask=None, layout=STANDALONE,
                output_hidden_states: bool | int | list[int] = False, **kwargs) -> BaseModelOutput:
        """`output_hidden_states`: True for the L + 1 hidden states (the embeddings', then each layer's), or the
        indices of those to return as transformers 5.24 takes them (`[0, -1]`), None in the others' places. The rows
        leave before each one returned, and the next layer reads what is returned (retain_grad on it works)."""
        kept = selected_hidden_states(output_hidden_states, len(self.layer))
        x = layout.enter(hidden_states)  # (B, T, H) or (P, H)
        all_hidden = []
        for i, layer in enumerate(self.layer):
            if i in kept:
                all_hidden.append(layout.leave(x))  # (B, T, H)
                x = layout.enter(all_hidden[-1])
            else:
                all_hidden.append(None)
            x = layer(x, attention_mask, layout=layout, **kwargs)
        last = layout.leave(x)  # (B, T, H)
        hidden_states = (*all_hidden, last if len(self.layer) in kept else None) if output_hidden_states else None
        return BaseModelOutput(last_hidden_state=last, hidden_states=hidden_states)


def selected_hidden_states(output_hidden_states: bool | int | list[int] | None, num_layers: int) -> set[int]:
    """The indices of the L + 1 hidden states that `output_hidden_states` selects: all for True, none for False or
    None, else those of an int or a list, negative ones counted from the end and those out of range dropped (as
    transformers' `capture_outputs` selects stock's)."""
    n = num_layers + 1
    if output_hidden_states is None or isinstance(output_hidden_states, bool):
        return set(range(n)) if output_hidden_states else set()
    chosen = [output_hidden_states] if isinstance(output_hidden_states, int) else output_hidden_states
    return {i % n for i in chosen if -n <= i < n}


class BertImplPooler(nn.Module):
    """tanh(W h + b) of the first position of each row it is given: (B, T, H) -> (B, H)."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        return self.activation(self.dense(hidden_states[:, 0]))


class BertImplPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = ACT2FN[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class BertImplLMPredictionHead(nn.Module):
    """transform, then the decoder to the vocabulary: its weight tied to the word embeddings, its bias to `bias`."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.transform = BertImplPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states):  # (..., H) -> (..., V)
        return self.decoder(self.transform(hidden_states))


class BertImplOnlyMLMHead(nn.Module):
    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.predictions = BertImplLMPredictionHead(config)

    def forward(self, sequence_output):
        return self.predictions(sequence_output)


class BertImplOnlyNSPHead(nn.Module):
    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, pooled_output):
        return self.seq_relationship(pooled_output)


class BertImplPreTrainingHeads(nn.Module):
    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.predictions = BertImplLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output, pooled_output):
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


# ---------------------------------------------------------------------------------------------------------------------
# Losses: one helper for every head
# ---------------------------------------------------------------------------------------------------------------------
def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of (..., C) logits against (...) labels over the labels that are not `ignore_index`;
    computed in float32.

    A batch whose labels are all `ignore_index` (say an MLM batch with no masked token) has a loss of 0 with zero
    gradients, where transformers' BERT (PyTorch's mean over no element) gives NaN: one such batch cannot poison a
    run. Every head's loss goes through here."""
    labels = labels.reshape(-1).to(logits.device, torch.long)  # any integer dtype; values checked by the encoder
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=ignore_index,
                            reduction="sum")
    return total / (labels != ignore_index).sum().clamp(min=1)


def masked_lm(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None, sparse: bool):
    """MLM logits and loss from hidden (B, T, H) and labels (B, T) (-100 where not masked) or None.

    With labels and `sparse`, the decoder (H x V, the largest matmul of pre-training) runs on the M masked positions
    only: logits are then (M, V), the rows of the full (B, T, V) logits at `labels != -100` in row-major order, and the
    loss is the same. Otherwise logits are (B, T, V)."""
    if labels is None:
        return head(hidden), None
    labels = labels.to(hidden.device)
    if sparse:
        masked = labels != IGNORE_INDEX  # (B, T)
        hidden, labels = hidden[masked], labels[masked]  # (M, H), (M,)
    logits = head(hidden)  # (B, T, V) or (M, V)
    return logits, cross_entropy(logits, labels)


def mlm_label_checks(labels: torch.Tensor | None, config: BertImplConfig) -> list:
    """MLM labels: token ids in [0, vocab_size) at masked positions, -100 elsewhere."""
    return class_label_checks("labels", labels, config.vocab_size, f"vocab_size={config.vocab_size}", "token ids")


def sequence_classification_label_checks(labels: torch.Tensor | None, config: BertImplConfig) -> list:
    """transformers' `problem_type` contract: regression (MSE), single-label (CE) or multi-label (BCE) classification.
    An unset problem_type is inferred from num_labels and the labels' dtype, and recorded in the config. Single-label
    labels are class ids in [0, num_labels) (or -100): their checks; the other two take floats as they come."""
    if labels is None:
        return []
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type != "single_label_classification":
        return []
    hint = (" (single-label classification; float labels are for regression, num_labels=1, or multi-label "
            "classification, problem_type='multi_label_classification')")
    return class_label_checks("labels", labels, config.num_labels, f"num_labels={config.num_labels}", "class ids", hint)


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config: BertImplConfig) -> torch.Tensor:
    """The loss of config.problem_type (set by `sequence_classification_label_checks`)."""
    labels = labels.to(logits.device)
    if config.problem_type == "regression":
        if config.num_labels == 1:
            return F.mse_loss(logits.squeeze().float(), labels.squeeze().float())
        return F.mse_loss(logits.float(), labels.float())
    if config.problem_type == "single_label_classification":
        return cross_entropy(logits, labels)
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------
class BertImplPreTrainedModel(PreTrainedModel):
    config_class = BertImplConfig
    config: BertImplConfig
    base_model_prefix = "bert"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    # The padded layout's attention goes through transformers' attention functions with a mask made by its mask
    # interface for each (layouts.stock_mask); the padding-free layouts' through bert_padding.py's kernels.
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    # Attention maps are recorded as stock BERT records them (they exist on the padded eager path only); hidden states
    # are collected by the encoder, which re-pads the padding-free path's (P, H) rows into (B, T, H).
    _can_record_outputs = {"attentions": BertImplSelfAttention}
    _no_split_modules = ["BertImplEmbeddings", "BertImplLayer"]
    # Losses are means over the batch; Trainer scales them for gradient accumulation itself.
    accepts_loss_kwargs = False
    # Older stock checkpoints carry the position-id buffer.
    _keys_to_ignore_on_load_unexpected = [r"embeddings\.position_ids"]
    # The family's own classes, set after they are defined (BERT's below; RoBERTa's in modeling_roberta_impl.py):
    # the encoder model with its embeddings, and every class with its Auto class (written into saved configs).
    base_model_class: type
    embeddings_class: type
    auto_classes: dict

    def __init__(self, config: BertImplConfig, *inputs, **kwargs):
        check_supported(config)  # a decoder's switches set on the config after it was made
        super().__init__(config, *inputs, **kwargs)

    def add_base_model(self, **kwargs) -> None:
        """A head's encoder model, as `self.<base_model_prefix>` (`self.bert`, `self.roberta`)."""
        setattr(self, self.base_model_prefix, self.base_model_class(self.config, **kwargs))

    def _flex_attn_can_dispatch(self, is_init_check: bool = False) -> bool:
        """flex attention compiles its kernel with inductor, which fails on this model's masks before torch 2.13."""
        require_tracing_torch("attn_implementation='flex_attention'", "or use 'sdpa' or 'eager'")
        return super()._flex_attn_can_dispatch(is_init_check)

    def _init_weights(self, module):
        """PreTrainedModel's (Linear and Embedding ~ N(0, initializer_range), biases and the padding embedding zero,
        LayerNorm to identity), the MLM head's own bias zero, and the embeddings' buffers of default ids (never loaded:
        they are not saved)."""
        super()._init_weights(module)
        if isinstance(module, BertImplLMPredictionHead):
            nn.init.zeros_(module.bias)
        if isinstance(module, BertImplEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1])[None])
            init.zeros_(module.token_type_ids)

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, *args, **kwargs):
        """transformers' loading step; a damaged (truncated, partly downloaded) safetensors file is named, with what to
        do, instead of safetensors' bare "Error while deserializing header"."""
        try:
            return PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, *args, **kwargs)
        except SafetensorError as error:
            for path in checkpoint_files or ():
                try:
                    safe_open(path, framework="pt")
                except SafetensorError as damaged:
                    raise OSError(
                        f"The weights file {path} is damaged ({damaged}): it was not completely downloaded or written. "
                        "Delete it and fetch it again: for a Hub model, from_pretrained(..., force_download=True); "
                        "for a folder of yours, save the model again."
                    ) from error
            raise

    def save_pretrained(self, save_directory, *args, **kwargs):
        """As transformers' save_pretrained, with `auto_map` naming every head, so that the saved folder (which
        carries the code files) loads through any Auto class with `trust_remote_code=True`. The weights' names are
        stock BERT's: stock `BertForX.from_pretrained` loads every one of them."""
        module = type(self).__module__.rsplit(".", 1)[-1]
        auto_map = {auto: f"{module}.{cls.__name__}" for auto, cls in self.auto_classes.items()}
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **auto_map}
        # Our names, not those of the folder it was loaded from (transformers would undo an old folder's renaming).
        kwargs.setdefault("save_original_format", False)
        return super().save_pretrained(save_directory, *args, **kwargs)

    # push_to_hub's writer of our model card, card_writer(folder, model, repo_id): given by the package
    # (modeling_bert_impl/__init__.py), which this checkpoint file does not import; None in a folder's copy of the code
    # loaded without the package (transformers' card stays).
    card_writer = None

    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        """push_to_hub's upload step (also `save_pretrained(push_to_hub=True)`'s): where bert-impl is installed, the
        README.md transformers has just written is replaced by our model card, unless it is one of ours already."""
        if self.card_writer is not None:
            self.card_writer(working_dir, self, repo_id)
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)

    def save_stock_pretrained(self, save_directory: str, **kwargs) -> None:
        """Write a folder that plain transformers loads as its own `BertModel` / `BertForX` (model_type "bert"): the
        same weights (their names are stock's already), a stock config, no code files."""
        import os

        PreTrainedModel.save_pretrained(self, save_directory, save_original_format=False, **kwargs)
        for name in os.listdir(save_directory):
            if name.endswith(".py"):
                os.remove(os.path.join(save_directory, name))
        write_stock_config(str(save_directory), stock_name(type(self)))


def config_default(value, default):
    return default if value is None else value


class BertImplModel(BertImplPreTrainedModel):
    """The bidirectional encoder: embeddings, L post-LN layers and (optionally) the tanh pooler on [CLS]."""

    def __init__(self, config: BertImplConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        self.encoder = BertImplEncoder(config)
        self.pooler = BertImplPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        label_checks: list | None = None,
        pool_with: nn.Module | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPooling:
        r"""
        A padded batch (`input_ids` (B, T) with `attention_mask`), or a packed one: rows of sequences concatenated,
        marked by `position_ids` restarting at 0 without a mask (transformers' `DataCollatorWithFlattening` makes one
        such row; a run of zeros is one sequence: a packed BERT sequence has at least two tokens), or one row marked
        by `cu_seq_lens_q`/`max_length_q` (`cu_seq_lens_k`/`max_length_k` must then be equal) or by `seq_idx`. Tokens
        never attend across sequences, and positions restart at 0 in each sequence whatever marks them.

        With a packed batch, `pooler_output` has one row per packed sequence (S, H). Hidden states (the last one and,
        with `output_hidden_states`, every layer's) are zero at padding positions on every path: transformers' BERT
        computes values there that no real token depends on. A row of padding only pools a zero vector.
        `attention_mask` holds 0 (padding) and 1 (token), as bool, integers or floats; other values are refused.
        `label_checks`: a head's checks of its labels (input_checks.py), read with the encoder's own in one transfer.
        `pool_with`: a head's module that reads each sequence's first token in place of the pooler (RoBERTa's
        classification head, whose model has no pooler); `pooler_output` is then what it returns.

        `cache` (or `past_key_values`, its name before transformers 5.24, which peft passes): a transformers `Cache`
        with C keys and values for every layer, attended ahead of the tokens' own, as PEFT's prefix tuning makes it;
        positions then start at C, as in transformers' BERT. The padded path runs it; `attention_mask` is the tokens'
        (B, T) or peft's (B, C + T) with ones over the C cached keys.

        `output_hidden_states`: True, or the indices of the hidden states to return (None in the others' places), as
        transformers 5.24 takes them. A decoder's inputs (`encoder_hidden_states`, `encoder_attention_mask`) are
        refused, as is a config switched to a decoder after the model was built (`check_supported`).
        """
        check_supported(self.config)
        refuse_cross_attention(kwargs)
        output_attentions = config_default(output_attentions, self.config.output_attentions)
        output_hidden_states = config_default(output_hidden_states, self.config.output_hidden_states)
        batch = read_batch(self.config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                           cu_seq_lens_q, cu_seq_lens_k, max_length_q, seq_idx, config_default(cache, past_key_values),
                           label_checks or (), self.embeddings.position_offset)
        x = self.embeddings(input_ids, token_type_ids, batch.position_ids, inputs_embeds,
                            cache_length=batch.cache_length)  # (B, T, H)
        layout = choose_layout(self.config, batch, x, self.encoder, output_attentions)
        encoded = self.encoder(x, layout.attention_mask, layout=layout, output_hidden_states=output_hidden_states,
                               output_attentions=output_attentions)
        last = encoded.last_hidden_state  # (B, T, H)
        pool = config_default(pool_with, self.pooler)
        pooled = pool(layout.first_tokens(last)) if pool is not None else None  # (S, H)
        return BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=pooled,
                                          hidden_states=encoded.hidden_states)


@dataclass
class BertImplForPreTrainingOutput(ModelOutput):
    """transformers' BertForPreTrainingOutput, then the two losses that make up `loss` = mlm_loss + nsp_loss (each a
    mean; present when its labels are given). Fields in this order, so `to_tuple()` (return_dict=False) gives stock
    BERT's tuple with the extra losses at its end."""

    loss: torch.FloatTensor | None = None
    prediction_logits: torch.FloatTensor | None = None  # (B, T, V); (M, V) masked rows with labels, sparse_prediction
    seq_relationship_logits: torch.FloatTensor | None = None  # (B, 2)
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    mlm_loss: torch.FloatTensor | None = None
    nsp_loss: torch.FloatTensor | None = None


class BertImplForPreTraining(BertImplPreTrainedModel):
    """BERT's pre-training heads: masked LM (decoder tied to the word embeddings) + next sentence prediction."""

    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.add_base_model()
        self.cls = BertImplPreTrainingHeads(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, value):
        self.cls.predictions.decoder = value
        self.cls.predictions.bias = value.bias

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, next_sentence_label=None, **kwargs: Unpack[TransformersKwargs]):
        r"""labels: (B, T) token ids at masked positions, -100 elsewhere. next_sentence_label: (B,) 0 = B follows A.

        `prediction_logits` is (B, T, V); with labels and `config.sparse_prediction` (off by default), the masked rows
        only: (M, V), M = (labels != -100).sum(), in row-major (B, T) order."""
        checks = mlm_label_checks(labels, self.config) + class_label_checks(
            "next_sentence_label", next_sentence_label, 2, "2", "class ids")
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True,
                              label_checks=checks, **kwargs)
        prediction_logits, mlm_loss = masked_lm(self.cls.predictions, out.last_hidden_state, labels, self.config.sparse_prediction)
        seq_relationship_logits = self.cls.seq_relationship(out.pooler_output)  # (B, 2)
        nsp_loss = cross_entropy(seq_relationship_logits, next_sentence_label) if next_sentence_label is not None else None
        losses = [l for l in (mlm_loss, nsp_loss) if l is not None]
        result = BertImplForPreTrainingOutput(
            loss=sum(losses) if losses else None, mlm_loss=mlm_loss, nsp_loss=nsp_loss,
            prediction_logits=prediction_logits, seq_relationship_logits=seq_relationship_logits,
            hidden_states=out.hidden_states, attentions=out.attentions,
        )
        return result


class BertImplForMaskedLM(BertImplPreTrainedModel):
    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.add_base_model(add_pooling_layer=False)
        self.cls = BertImplOnlyMLMHead(config)
        self.post_init()

    def vocabulary_head(self) -> nn.Module:
        """(..., H) hidden states -> (..., V) logits over the vocabulary."""
        return self.cls.predictions

    def get_output_embeddings(self):
        return self.vocabulary_head().decoder

    def set_output_embeddings(self, value):
        self.cls.predictions.decoder = value
        self.cls.predictions.bias = value.bias

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]):
        r"""labels: (B, T) token ids at masked positions, -100 elsewhere. `logits` is (B, T, V); with labels and
        `config.sparse_prediction` (off by default), the masked rows only: (M, V) in row-major (B, T) order."""
        checks = mlm_label_checks(labels, self.config)
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True,
                              label_checks=checks, **kwargs)
        logits, loss = masked_lm(self.vocabulary_head(), out.last_hidden_state, labels, self.config.sparse_prediction)
        result = MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)
        return result


class BertImplForNextSentencePrediction(BertImplPreTrainedModel):
    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.add_base_model()
        self.cls = BertImplOnlyNSPHead(config)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]):
        checks = class_label_checks("labels", labels, 2, "2", "class ids")
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True,
                              label_checks=checks, **kwargs)
        logits = self.cls(out.pooler_output)  # (B, 2)
        loss = cross_entropy(logits, labels) if labels is not None else None
        result = NextSentencePredictorOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result


def classifier_dropout(config: BertImplConfig) -> nn.Dropout:
    return BertImplDropout(config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout)


class BertImplForSequenceClassification(BertImplPreTrainedModel):
    """The classifier on the pooled [CLS]: classifier(dropout(pooler_output))."""

    reads_first_tokens = None  # the pooler reads them (RoBERTa's classification head reads them itself)

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.add_base_model()
        self.dropout = classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]):
        r"""labels: (B,) class ids, (B,) floats for regression (num_labels == 1), or (B, C) multi-hot floats."""
        checks = sequence_classification_label_checks(labels, self.config)
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True,
                              label_checks=checks, pool_with=self.reads_first_tokens, **kwargs)
        logits = self.logits(out.pooler_output)  # (B, C), or (S, C) for a packed batch
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        result = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result


    def logits(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(pooled))


class BertImplForTokenClassification(BertImplPreTrainedModel):
    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.add_base_model(add_pooling_layer=False)
        self.dropout = classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]):
        r"""labels: (B, T) class ids, -100 where no label applies (padding, special tokens, later sub-words)."""
        checks = class_label_checks("labels", labels, self.num_labels, f"num_labels={self.num_labels}", "class ids")
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True,
                              label_checks=checks, **kwargs)
        logits = self.classifier(self.dropout(out.last_hidden_state))  # (B, T, C)
        loss = cross_entropy(logits, labels) if labels is not None else None
        result = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)
        return result


class BertImplForQuestionAnswering(BertImplPreTrainedModel):
    def __init__(self, config: BertImplConfig):
        if config.num_labels != 2:
            raise ValueError(
                f"a question-answering head has num_labels=2 (start and end logits), got num_labels={config.num_labels}"
            )
        super().__init__(config)
        self.num_labels = config.num_labels
        self.add_base_model(add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                start_positions=None, end_positions=None, **kwargs: Unpack[TransformersKwargs]):
        r"""start_positions, end_positions: (B,) token indices of the answer span; positions outside the sequence
        are clamped to T and ignored (as in transformers).

        A span never starts or ends on padding: start/end logits there are the dtype's minimum, in the outputs and in
        the loss. (transformers' BERT lets padding into the softmax, so with padding its loss differs from ours.)"""
        checks = position_label_checks(start_positions=start_positions, end_positions=end_positions)
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True,
                              label_checks=checks, **kwargs)
        logits = self.qa_outputs(out.last_hidden_state)  # (B, T, 2)
        if attention_mask is not None:
            logits = logits.masked_fill((attention_mask == 0).unsqueeze(-1), torch.finfo(logits.dtype).min)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))  # each (B, T)
        loss = None
        if start_positions is not None and end_positions is not None:
            T = start_logits.shape[1]
            start, end = (p.reshape(-1).clamp(0, T) for p in (start_positions, end_positions))
            loss = (cross_entropy(start_logits, start, ignore_index=T) + cross_entropy(end_logits, end, ignore_index=T)) / 2
        result = QuestionAnsweringModelOutput(
            loss=loss, start_logits=start_logits, end_logits=end_logits,
            hidden_states=out.hidden_states, attentions=out.attentions,
        )
        return result


class BertImplForMultipleChoice(BertImplPreTrainedModel):
    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.add_base_model()
        self.dropout = classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]):
        r"""Inputs are (B, C, T) for C choices; labels: (B,) the index of the right choice."""
        reference = input_ids if input_ids is not None else inputs_embeds
        if reference is None or reference.dim() < 3:
            raise ValueError("multiple choice inputs must be (batch, num_choices, seq_len)")
        packing = sorted({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"} & set(kwargs))
        if packing:
            raise ValueError(f"multiple choice takes (batch, num_choices, seq_len) inputs, not a packed batch "
                             f"({', '.join(packing)})")
        num_choices = reference.shape[1]
        flat = lambda t: t.flatten(0, 1) if t is not None else None  # (B, C, ...) -> (B * C, ...)
        checks = class_label_checks("labels", labels, num_choices, f"num_choices={num_choices}", "choice indices")
        out = self.base_model(flat(input_ids), flat(attention_mask), flat(token_type_ids), flat(position_ids),
                              flat(inputs_embeds), return_dict=True, label_checks=checks, **kwargs)
        logits = self.classifier(self.dropout(out.pooler_output)).view(-1, num_choices)  # (B, C)
        loss = cross_entropy(logits, labels) if labels is not None else None
        result = MultipleChoiceModelOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result


# Every class above with the Auto class that loads it; written into saved configs as `auto_map`.
AUTO_CLASSES = {
    "AutoModel": BertImplModel,
    "AutoModelForPreTraining": BertImplForPreTraining,
    "AutoModelForMaskedLM": BertImplForMaskedLM,
    "AutoModelForNextSentencePrediction": BertImplForNextSentencePrediction,
    "AutoModelForSequenceClassification": BertImplForSequenceClassification,
    "AutoModelForTokenClassification": BertImplForTokenClassification,
    "AutoModelForQuestionAnswering": BertImplForQuestionAnswering,
    "AutoModelForMultipleChoice": BertImplForMultipleChoice,
}
BertImplPreTrainedModel.base_model_class, BertImplPreTrainedModel.embeddings_class = BertImplModel, BertImplEmbeddings
BertImplPreTrainedModel.auto_classes = AUTO_CLASSES
for _auto_class, _model_class in AUTO_CLASSES.items():
    _model_class.register_for_auto_class(_auto_class)
BertImplConfig.register_for_auto_class()
remember_forwards(globals())  # the module classes' own forwards, to tell a patch of them (layouts.looking_inside)
