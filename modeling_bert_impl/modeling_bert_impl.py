"""BERT (Devlin et al., 2019) written from scratch as a transformers model.

Shapes: B batch, T tokens, H hidden, N heads, D head dim (H = N * D), V vocabulary, nnz the real tokens of a batch
without its padding, S the sequences of such a batch (B for a padded batch, more for a packed one), P the rows the
unpadded encoder runs on (nnz, or a few more in the CPU's bucketed layout).

The encoder runs padded or unpadded. Padded: (B, T, H) with an additive attention mask, through transformers'
attention functions (`eager`, `sdpa`, ...). Unpadded: (P, H), every dense layer on (nearly) real tokens only,
attention per sequence. The model unpads once per forward when the batch has padding or is packed, and re-pads its
outputs once at the end; how (layouts, varlen kernels) is bert_padding.py's business.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, WeightConverter, WeightRenaming
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    bidirectional_mask_function,
    packed_sequence_mask_function,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    NextSentencePredictorOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput
from transformers.utils.generic import can_return_tuple

from .bert_padding import UnpaddedLayout, cu_seqlens_from_markers
from .configuration_bert_impl import BertImplConfig
from .input_checks import IGNORE_INDEX, check_inputs, class_label_checks, position_label_checks
from . import fused_layers
from .fused_layers import fused_encoder, fused_weights
from .packed_linear import linear, unobserved


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints: one declarative map from stock BERT keys (transformers' BertModel / BertForX) to ours. transformers
# applies it when loading (renamings in order, then the QKV fusion; our own names pass through untouched), so stock
# folders load into our classes; `save_stock_pretrained` applies it in reverse to write stock folders.
# ---------------------------------------------------------------------------------------------------------------------
STOCK_TO_OURS = [
    ("embeddings.LayerNorm", "embeddings.norm"),
    ("encoder.layer.", "layers."),
    ("attention.output.dense", "attn.out"),
    ("attention.output.LayerNorm", "attn_norm"),
    ("intermediate.dense", "ffn.up"),
    ("output.dense", "ffn.down"),  # after attention.output.dense has been renamed
    ("output.LayerNorm", "ffn_norm"),
    ("cls.predictions.transform.dense", "mlm_head.dense"),
    ("cls.predictions.transform.LayerNorm", "mlm_head.norm"),
    ("cls.predictions.decoder", "mlm_head.decoder"),
    ("cls.predictions.bias", "mlm_head.decoder.bias"),  # the stock MLM bias is tied to its decoder's bias
    ("cls.seq_relationship", "nsp_head"),
]
STOCK_QKV = ["attention.self.query", "attention.self.key", "attention.self.value"]


def checkpoint_conversion() -> list:
    """The transforms transformers applies to a checkpoint's keys when loading (and reversed, when saving)."""
    renamings = [WeightRenaming(source, target) for source, target in STOCK_TO_OURS]
    return renamings + [WeightConverter(STOCK_QKV, "attn.qkv", operations=[Concatenate(dim=0)])]


register_checkpoint_conversion_mapping("bert_impl", checkpoint_conversion(), overwrite=True)


# ---------------------------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------------------------
def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The reference: softmax(q k^T * scaling + mask) v. q, k, v: (B, N, T, D); mask additive (B, 1, T|1, T).
    Returns (B, T, N, D) and the attention weights (B, N, T, T)."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, N, T, T)
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class BertImplAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection."""

    is_causal = False  # read by transformers' attention functions

    def __init__(self, config: BertImplConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_probs_dropout_prob
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, attention_mask=None, varlen: UnpaddedLayout | None = None, output_attentions: bool = False):
        dropout = self.dropout if self.training else 0.0
        if varlen is not None:  # x: (P, H), the rows of an unpadded layout (bert_padding.py)
            q, k, v = linear(self.qkv, x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)  # each (P, N, D)
            y, weights = varlen.attend(q, k, v, self.scaling, dropout), None  # (P, N, D)
        else:  # x: (B, T, H)
            qkv = linear(self.qkv, x).unflatten(-1, (3, self.num_heads, self.head_dim))  # (B, T, 3, N, D)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, N, T, D)
            # Attention maps exist only on the eager path; asking for them selects it for this call.
            implementation = "eager" if output_attentions else self.config._attn_implementation
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
            y, weights = attend(self, q, k, v, attention_mask, scaling=self.scaling, dropout=dropout)  # (B, T, N, D)
        return linear(self.out, y.flatten(-2)), weights  # (..., H)


class BertImplFeedForward(nn.Module):
    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):  # linear(): in CPU inference through oneDNN, the GELU fused into `up` (packed_linear.py)
        return linear(self.down, linear(self.up, x, self.act))


class BertImplLayer(GradientCheckpointingLayer):
    """Post-LN Transformer layer: x = LN(x + attn(x)); x = LN(x + ffn(x)). Any leading shape: (B, T, H) or (P, H)."""

    def __init__(self, config: BertImplConfig, layer_idx: int):
        super().__init__()
        self.attn = BertImplAttention(config, layer_idx)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = BertImplFeedForward(config)
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, attention_mask=None, varlen: UnpaddedLayout | None = None, output_attentions: bool = False):
        a, weights = self.attn(x, attention_mask, varlen, output_attentions)
        x = self.attn_norm(x + self.dropout(a))
        x = self.ffn_norm(x + self.dropout(self.ffn(x)))
        return x, weights

    def fused_linears(self) -> tuple | None:
        """(qkv, out, up, down) where `fused_layer` computes what calling this layer does (fused_layers.py): eval mode,
        and its modules ours and unobserved (no hooks, no patched forward), the linear layers aside (`linear()` calls
        those when they are observed or replaced: PEFT, int8); else None."""
        modules = self._modules  # read directly: this runs on every CPU inference call
        attn, ffn = modules["attn"], modules["ffn"]
        parts = (self, attn, ffn, modules["attn_norm"], modules["ffn_norm"], modules["dropout"])
        if tuple(map(type, parts)) != FUSABLE_PARTS or any(m.training or not unobserved(m) for m in parts):
            return None
        return attn.qkv, attn.out, ffn.up, ffn.down


FUSABLE_PARTS = (BertImplLayer, BertImplAttention, BertImplFeedForward, nn.LayerNorm, nn.LayerNorm, nn.Dropout)


class BertImplEmbeddings(nn.Module):
    """word + segment + learned position embeddings, LayerNorm, dropout. Any leading shape: (B, T) or (nnz,)."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids, position_ids, inputs_embeds=None):
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # (..., H)
        x = x + self.token_type_embeddings(token_type_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.norm(x))


class BertImplPooler(nn.Module):
    """tanh(W h_[CLS] + b)."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_hidden):  # (S, H) -> (S, H)
        return torch.tanh(self.dense(cls_hidden))


class BertImplMLMHead(nn.Module):
    """dense, GELU, LayerNorm, then the decoder to the vocabulary (its weight tied to the word embeddings)."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, x):  # (..., H) -> (..., V)
        return self.decoder(self.norm(self.act(self.dense(x))))


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
    # The padded path's attention goes through transformers' attention functions with a mask made by its mask
    # interface for each (see BertImplModel._padded_attention_mask).
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    # Hidden states and attentions are collected by hand, not by transformers' output capture (`_can_record_outputs`):
    # it records what each layer returns, which on the unpadded path is (P, H) rows of the CPU's bucketed or the
    # exact layout, not (B, T, H); BertImplModel.forward re-pads each one.
    _no_split_modules = ["BertImplEmbeddings", "BertImplLayer"]
    # Losses are means over the batch; Trainer scales them for gradient accumulation itself.
    accepts_loss_kwargs = False
    # Older stock checkpoints carry the position-id buffer and a duplicate of the MLM bias.
    _keys_to_ignore_on_load_unexpected = [r"embeddings\.position_ids", r"cls\.predictions\.decoder\.bias"]

    # Weights are initialised by PreTrainedModel._init_weights: Linear and Embedding ~ N(0, initializer_range), biases
    # and the padding embedding zero, LayerNorm to identity.

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

    def save_pretrained(self, save_directory, *args, save_original_format: bool = False, **kwargs):
        """As transformers' save_pretrained, with `auto_map` naming every head, so that the saved folder (which
        carries the code files) loads through any Auto class with `trust_remote_code=True`.

        Weights are written under this model's own parameter names: Trainer's `--resume_from_checkpoint` and
        `load_best_model_at_end` load a checkpoint's state dict as it is, and must find our names in it. (Loading
        accepts both our names and stock ones; `save_stock_pretrained` writes the stock ones.)"""
        module = type(self).__module__.rsplit(".", 1)[-1]
        auto_map = {auto: f"{module}.{cls.__name__}" for auto, cls in AUTO_CLASSES.items()}
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **auto_map}
        return super().save_pretrained(save_directory, *args, save_original_format=save_original_format, **kwargs)

    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        """push_to_hub's upload step (also `save_pretrained(push_to_hub=True)`'s): where bert-impl is installed, the
        README.md transformers has just written is replaced by our model card, unless it is one of ours already."""
        try:  # model_card.py is not a code file of saved folders: without the package, transformers' card stays
            from modeling_bert_impl.model_card import replace_generic_card
        except ImportError:
            pass
        else:
            replace_generic_card(working_dir, self, repo_id)
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)

    def save_stock_pretrained(self, save_directory: str, **kwargs) -> None:
        """Write a folder that plain transformers loads as its own `BertModel` / `BertForX` (model_type "bert").

        The weights are written under stock key names (`checkpoint_conversion()` reversed), and the config with the
        stock model_type and architecture, no `auto_map`, no fields of ours; no code files."""
        import json
        import os

        # transformers reverses the conversions that loaded this model (`_weight_conversions`, none when it was loaded
        # from a folder of ours, already in our names); our parameters always take the whole map back to stock names.
        loaded_with = self.__dict__.get("_weight_conversions")
        self._weight_conversions = checkpoint_conversion()
        try:
            self.save_pretrained(save_directory, save_original_format=True, **kwargs)
        finally:
            if loaded_with is None:
                del self._weight_conversions
            else:
                self._weight_conversions = loaded_with
        for name in os.listdir(save_directory):
            if name.endswith(".py"):
                os.remove(os.path.join(save_directory, name))
        path = os.path.join(save_directory, "config.json")
        with open(path) as f:
            config = json.load(f)
        for key in ("auto_map", "unpad_inputs", "sparse_prediction"):
            config.pop(key, None)
        config.update(model_type="bert", architectures=[type(self).__name__.replace("BertImpl", "Bert", 1)])
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def identity(h: torch.Tensor) -> torch.Tensor:
    return h


def zero_padding(attention_mask: torch.Tensor | None):
    """(B, T, H) -> (B, T, H) with zeros where attention_mask (B, T) is 0; the identity without a mask."""
    if attention_mask is None:
        return identity
    padding = (attention_mask == 0).unsqueeze(-1)  # (B, T, 1)
    return lambda h: h.masked_fill(padding, 0)


class BertImplModel(BertImplPreTrainedModel):
    """The bidirectional encoder: embeddings, L post-LN layers and (optionally) the tanh pooler on [CLS]."""

    def __init__(self, config: BertImplConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertImplEmbeddings(config)
        self.layers = nn.ModuleList(BertImplLayer(config, i) for i in range(config.num_hidden_layers))
        self.pooler = BertImplPooler(config) if add_pooling_layer else None
        self.compiled_encoder = None  # this model compiled ahead of time: compile_for_inference (compiled_encoder.py)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
        label_checks: list | None = None,
    ) -> BaseModelOutputWithPooling | tuple:
        r"""
        A padded batch (`input_ids` (B, T) with `attention_mask`), or a packed one as transformers'
        `DataCollatorWithFlattening` makes it: B = 1, sequences concatenated, marked by `position_ids` restarting at 0,
        by `cu_seq_lens_q`/`max_length_q` (`cu_seq_lens_k`/`max_length_k` must then be equal), or by `seq_idx`.
        Tokens never attend across sequences.

        With a packed batch, `pooler_output` has one row per packed sequence (S, H). Hidden states (the last one
        and, with `output_hidden_states`, every layer's) are zero at padding positions, on every path (unpadded,
        padded, compiled, exported): transformers' BERT computes values there that no real token depends on. A row
        of padding only pools a zero vector; attention maps at padding queries are those of a zero hidden state.
        `attention_mask` holds 0 (padding) and 1 (token), as bool, integers or floats; other values are refused.
        `label_checks`: a head's checks of its labels (input_checks.py), read with the encoder's own in one transfer.

        Under `torch.compile` the unpadded path runs too (its host-side steps as custom ops, bert_padding.py); under
        `torch.export` the graph is the padded path, and only `cu_seq_lens_q` / `seq_idx` mark a packed batch.
        """
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if (self.compiled_encoder is not None and inputs_embeds is None and not output_attentions
                and not output_hidden_states and cu_seq_lens_q is None and seq_idx is None and not label_checks):
            # the compiled program where it can stand in (compiled_encoder.py); it checks the values itself
            out = self.compiled_encoder(input_ids, attention_mask, token_type_ids, position_ids)
            if out is not None:
                return out if return_dict else out.to_tuple()
        B, T, batch = check_inputs(self.config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                   cu_seq_lens_q, cu_seq_lens_k, seq_idx, label_checks or ())
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        if token_type_ids is None:
            token_type_ids = torch.zeros(B, T, dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = torch.arange(T, device=device).expand(B, T)
        position_ids = position_ids.expand(B, T)

        packed_cu_seqlens = (
            cu_seqlens_from_markers(cu_seq_lens_q, seq_idx, position_ids, batch.num_sequences) if batch.packed else None
        )  # (S + 1,)
        unpadded = (
            batch.unpaddable
            and self.config.unpad_inputs
            and not output_attentions
            and self.config._attn_implementation != "eager"
        )

        if unpadded:
            dtype = inputs_embeds.dtype if inputs_embeds is not None else self.embeddings.word_embeddings.weight.dtype
            layout = UnpaddedLayout.build(
                attention_mask, packed_cu_seqlens, (B, T), batch.nnz, batch.max_seqlen or max_length_q, dtype, device,
                # CPU: the bucketed layout; when training under torch.compile, the exact one (the bucketed attention
                # is then an opaque op without a backward)
                bucketed=device.type == "cpu" and not (torch.compiler.is_compiling() and torch.is_grad_enabled()),
            )
            x = self.embeddings(*map(layout.unpad, (input_ids, token_type_ids, position_ids, inputs_embeds)))  # (P, H)
            repad, clear = layout.repad, identity  # (P, H) rows: no padding to clear
            mask = None
        else:
            layout = None
            x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)  # (B, T, H)
            implementation = "eager" if output_attentions else self.config._attn_implementation  # as attention picks
            padding = None if batch.nnz is None else batch.nnz < B * T  # None: traced, the host cannot say
            mask = self._padded_attention_mask(x, attention_mask, packed_cu_seqlens, implementation, padding)
            # Zeros at padding, as the unpadded path re-pads. No real token reads a padding position, so they are
            # cleared once at the end; where every layer's hidden states are returned, in the stream itself after each
            # layer (they must be the tensors the next layer reads: retain_grad on them works).
            repad, clear = identity, zero_padding(attention_mask if padding is not False and not batch.packed else None)
        per_layer = clear if output_hidden_states else identity

        x = per_layer(x)
        all_hidden = [repad(x)] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        # CPU inference without padding to mask: each layer in one pass (fused_layers.py), the same arithmetic
        fused = (fused_weights(x, self.layers, self.config._attn_implementation)
                 if mask is None and not output_attentions else None)
        if fused and not output_hidden_states:
            x = fused_encoder(self.layers, x, fused, layout)
        else:
            for i, layer in enumerate(self.layers):
                x, weights = ((fused_layers.fused_layer(layer, x, fused[i], layout), None) if fused
                              else layer(x, mask, layout, output_attentions))
                x = per_layer(x)
                if output_hidden_states:
                    all_hidden.append(repad(x))
                if output_attentions:
                    all_attentions.append(weights)

        last = repad(x if output_hidden_states else clear(x))  # (B, T, H)
        pooled = None
        if self.pooler is not None:  # [CLS] is the first real token of each sequence (a row of padding only: zeros)
            if batch.packed:
                pooled = self.pooler(last[0, packed_cu_seqlens[:-1].long()])  # (S, H)
            elif attention_mask is None or batch.nnz == B * T:  # no padding: the first token
                pooled = self.pooler(last[:, 0])  # (B, H)
            else:
                first = (attention_mask != 0).int().argmax(-1)  # (B,)
                pooled = self.pooler(last[torch.arange(B, device=device), first])  # (B, H)

        out = BaseModelOutputWithPooling(
            last_hidden_state=last,
            pooler_output=pooled,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_attentions) if output_attentions else None,
        )
        return out if return_dict else out.to_tuple()

    def _padded_attention_mask(self, x, attention_mask, packed_cu_seqlens, implementation: str,
                               padding: bool | None = None):
        """The padded path's mask for x (B, T, H), made by transformers' mask interface in the form `implementation`
        takes: additive float (B, 1, T, T) for eager (masked scores at the dtype's minimum, so a row that is all
        padding still gives finite, uniform attention), bool for sdpa, a BlockMask for flex attention, the (B, T) mask
        for flash attention; None when nothing is masked. A packed batch (`packed_cu_seqlens`, no padding) attends
        block-diagonally: each token to its own sequence only. `padding` is whether the batch has padding, as the
        forward's one host read found (None when traced): knowing it, transformers need not look into the mask for
        itself (`mask.all()`, a second host-device sync).

        sdpa without packing: the padding mask as it is, bool (B, 1, 1, T), the same for every query (SDPA broadcasts
        it). transformers writes it out for each query, (B, 1, T, T): in a compiled program, 6 copies of it cost 0.9 ms
        of a 26 ms call at 1 x 128 (benchmarks/RESULTS.md, "eleventh pass")."""
        B, T = x.shape[:2]
        if padding is False:
            attention_mask = None  # all ones: nothing to mask but, for a packed batch, the sequence boundaries
        if attention_mask is None and packed_cu_seqlens is None:
            return None  # said here: under torch.export transformers would make an all-True mask for sdpa
        mask_function, skip_if_unmasked = bidirectional_mask_function, padding is not True
        if packed_cu_seqlens is not None:
            if implementation.startswith("flash_attention"):
                raise ValueError(
                    f"{implementation} takes a packed batch on the unpadded path only: set config.unpad_inputs=True"
                )
            segment = torch.bucketize(torch.arange(T, device=x.device), packed_cu_seqlens[1:].long(), right=True)
            mask_function = and_masks(mask_function, packed_sequence_mask_function(segment[None]))  # (1, T) ids
            skip_if_unmasked = False
        if attention_mask is not None:
            attention_mask = attention_mask.to(device=x.device, dtype=torch.bool)  # (B, T)
            if implementation == "sdpa" and packed_cu_seqlens is None:
                return attention_mask[:, None, None, :]  # (B, 1, 1, T)
        return ALL_MASK_ATTENTION_FUNCTIONS[implementation](
            batch_size=B, q_length=T, kv_length=T, mask_function=mask_function, attention_mask=attention_mask,
            allow_is_causal_skip=False, allow_is_bidirectional_skip=skip_if_unmasked, dtype=x.dtype, device=x.device,
            config=self.config,
        )


# ---------------------------------------------------------------------------------------------------------------------
# Heads. Each returns a typed ModelOutput; with return_dict=False (or config.return_dict=False) transformers'
# `can_return_tuple` turns it into a tuple, its fields in stock BERT's order and the Nones left out.
# ---------------------------------------------------------------------------------------------------------------------
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

    _tied_weights_keys = {"mlm_head.decoder.weight": "bert.embeddings.word_embeddings.weight"}

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config)
        self.mlm_head = BertImplMLMHead(config)
        self.nsp_head = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def get_output_embeddings(self):
        return self.mlm_head.decoder

    def set_output_embeddings(self, value):
        self.mlm_head.decoder = value

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, next_sentence_label=None, output_attentions=None, output_hidden_states=None,
                **packing):
        r"""labels: (B, T) token ids at masked positions, -100 elsewhere. next_sentence_label: (B,) 0 = B follows A.

        `prediction_logits` is (B, T, V); with labels and `config.sparse_prediction` (off by default), the masked rows
        only: (M, V), M = (labels != -100).sum(), in row-major (B, T) order."""
        checks = mlm_label_checks(labels, self.config) + class_label_checks(
            "next_sentence_label", next_sentence_label, 2, "2", "class ids")
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                        output_hidden_states, return_dict=True, label_checks=checks, **packing)
        prediction_logits, mlm_loss = masked_lm(self.mlm_head, out.last_hidden_state, labels, self.config.sparse_prediction)
        seq_relationship_logits = self.nsp_head(out.pooler_output)  # (B, 2)
        nsp_loss = cross_entropy(seq_relationship_logits, next_sentence_label) if next_sentence_label is not None else None
        losses = [l for l in (mlm_loss, nsp_loss) if l is not None]
        result = BertImplForPreTrainingOutput(
            loss=sum(losses) if losses else None, mlm_loss=mlm_loss, nsp_loss=nsp_loss,
            prediction_logits=prediction_logits, seq_relationship_logits=seq_relationship_logits,
            hidden_states=out.hidden_states, attentions=out.attentions,
        )
        return result


class BertImplForMaskedLM(BertImplPreTrainedModel):
    _tied_weights_keys = {"mlm_head.decoder.weight": "bert.embeddings.word_embeddings.weight"}

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config, add_pooling_layer=False)
        self.mlm_head = BertImplMLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.mlm_head.decoder

    def set_output_embeddings(self, value):
        self.mlm_head.decoder = value

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, **packing):
        r"""labels: (B, T) token ids at masked positions, -100 elsewhere. `logits` is (B, T, V); with labels and
        `config.sparse_prediction` (off by default), the masked rows only: (M, V) in row-major (B, T) order."""
        checks = mlm_label_checks(labels, self.config)
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                        output_hidden_states, return_dict=True, label_checks=checks, **packing)
        logits, loss = masked_lm(self.mlm_head, out.last_hidden_state, labels, self.config.sparse_prediction)
        result = MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)
        return result


class BertImplForNextSentencePrediction(BertImplPreTrainedModel):
    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config)
        self.nsp_head = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, **packing):
        checks = class_label_checks("labels", labels, 2, "2", "class ids")
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                        output_hidden_states, return_dict=True, label_checks=checks, **packing)
        logits = self.nsp_head(out.pooler_output)  # (B, 2)
        loss = cross_entropy(logits, labels) if labels is not None else None
        result = NextSentencePredictorOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result


def classifier_dropout(config: BertImplConfig) -> nn.Dropout:
    return nn.Dropout(config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout)


class BertImplForSequenceClassification(BertImplPreTrainedModel):
    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertImplModel(config)
        self.dropout = classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, **packing):
        r"""labels: (B,) class ids, (B,) floats for regression (num_labels == 1), or (B, C) multi-hot floats."""
        checks = sequence_classification_label_checks(labels, self.config)
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                        output_hidden_states, return_dict=True, label_checks=checks, **packing)
        logits = self.classifier(self.dropout(out.pooler_output))  # (B, C)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        result = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result


class BertImplForTokenClassification(BertImplPreTrainedModel):
    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertImplModel(config, add_pooling_layer=False)
        self.dropout = classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, **packing):
        r"""labels: (B, T) class ids, -100 where no label applies (padding, special tokens, later sub-words)."""
        checks = class_label_checks("labels", labels, self.num_labels, f"num_labels={self.num_labels}", "class ids")
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                        output_hidden_states, return_dict=True, label_checks=checks, **packing)
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
        self.bert = BertImplModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                start_positions=None, end_positions=None, output_attentions=None, output_hidden_states=None,
                **packing):
        r"""start_positions, end_positions: (B,) token indices of the answer span; positions outside the sequence
        are clamped to T and ignored (as in transformers).

        A span never starts or ends on padding: start/end logits there are the dtype's minimum, in the outputs and in
        the loss. (transformers' BERT lets padding into the softmax, so with padding its loss differs from ours.)"""
        checks = position_label_checks(start_positions=start_positions, end_positions=end_positions)
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                        output_hidden_states, return_dict=True, label_checks=checks, **packing)
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
        self.bert = BertImplModel(config)
        self.dropout = classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None):
        r"""Inputs are (B, C, T) for C choices; labels: (B,) the index of the right choice."""
        reference = input_ids if input_ids is not None else inputs_embeds
        if reference is None or reference.dim() < 3:
            raise ValueError("multiple choice inputs must be (batch, num_choices, seq_len)")
        num_choices = reference.shape[1]
        flat = lambda t: t.flatten(0, 1) if t is not None else None  # (B, C, ...) -> (B * C, ...)
        checks = class_label_checks("labels", labels, num_choices, f"num_choices={num_choices}", "choice indices")
        out = self.bert(flat(input_ids), flat(attention_mask), flat(token_type_ids), flat(position_ids),
                        flat(inputs_embeds), output_attentions, output_hidden_states, return_dict=True,
                        label_checks=checks)
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
for _auto_class, _model_class in AUTO_CLASSES.items():
    _model_class.register_for_auto_class(_auto_class)
BertImplConfig.register_for_auto_class()
