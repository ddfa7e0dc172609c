"""What stock BERT's and RoBERTa's configs and forwards offer, honoured or refused, never ignored: every config field,
set away from its default after the config exists (as transformers' model testers, EncoderDecoderModel and user code
set them), against transformers' class of the same family built from the same config; a decoder's switches and
inputs refused with the field's name; the encoder side of EncoderDecoderModel; hidden states selected by index
(transformers 5.24); `output_attentions` visible in every head's signature; RoBERTa's position helpers."""

import copy
import dataclasses
import inspect

import pytest
import torch
import transformers
from torch import nn

import modeling_bert_impl as bi

SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=66, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
# family -> transformers' class prefix, its config class, ours, our class prefix, the padding id
FAMILIES = {
    "bert": ("Bert", transformers.BertConfig, bi.BertImplConfig, "BertImpl", 0),
    "roberta": ("Roberta", transformers.RobertaConfig, bi.RobertaImplConfig, "RobertaImpl", 1),
    "xlm-roberta": ("XLMRoberta", transformers.XLMRobertaConfig, bi.XLMRobertaImplConfig, "XLMRobertaImpl", 1),
    "camembert": ("Camembert", transformers.CamembertConfig, bi.CamembertImplConfig, "CamembertImpl", 1),
}
HEADS = {"bert": ["ForPreTraining", "ForSequenceClassification"],
         **{family: ["ForMaskedLM", "ForSequenceClassification"] for family in FAMILIES if family != "bert"}}

# Every field of the stock configs and of PreTrainedConfig that a model reads, away from its default: the model then
# computes what stock's does with it.
HONOURED = {
    "vocab_size": 77, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 8, "intermediate_size": 50,
    "hidden_act": "relu", "hidden_dropout_prob": 0.3, "attention_probs_dropout_prob": 0.2,
    "max_position_embeddings": 40, "type_vocab_size": 3, "initializer_range": 0.5, "layer_norm_eps": 1e-3,
    "pad_token_id": 5, "classifier_dropout": 0.4, "tie_word_embeddings": False,
    "use_cache": False,  # stock's encoder reads it only as a decoder: it caches nothing, as ours
    "bos_token_id": 7, "eos_token_id": 8,  # read by generation, which an encoder does not do: no effect on either
    "output_hidden_states": True, "return_dict": False, "chunk_size_feed_forward": 2,
    "problem_type": "multi_label_classification", "id2label": {i: f"L{i}" for i in range(4)},
}
# Fields that make stock a decoder: refused, with the field's name.
REFUSED = {"is_decoder": True, "add_cross_attention": True}
# The rest of PreTrainedConfig's fields, and why the table above leaves them out.
NOT_READ_BY_A_MODEL = {
    "transformers_version": "written by save_pretrained", "architectures": "names the classes of a saved folder",
    "dtype": "read by from_pretrained (transformers' common tests load in each dtype), not by a model's constructor",
    "label2id": "id2label's inverse; pipelines read it",
    "is_encoder_decoder": "read by generation and EncoderDecoderModel's wrapper; BERT is no encoder-decoder itself",
}


def stock_fields(config_class) -> set:
    """The fields of a stock config class, PreTrainedConfig's with them."""
    return {field.name for field in dataclasses.fields(config_class)}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tables_cover_every_stock_field(family):
    """A field stock's config gains in a later transformers fails here until it is honoured or refused."""
    covered = set(HONOURED) | set(REFUSED) | set(NOT_READ_BY_A_MODEL)
    assert stock_fields(FAMILIES[family][1]) - covered == set()


def built_pair(family: str, head: str, field: str, value, seed: int = 0):
    """transformers' head and ours, each from its family's SMALL config with `field` set after construction, ours
    holding stock's weights; and the weights each drew at construction (their init, drawn from the same seed)."""
    prefix, stock_config_class, config_class, ours_prefix, pad = FAMILIES[family]
    configs = [cls(**SMALL, pad_token_id=pad) for cls in (stock_config_class, config_class)]
    for config in configs:
        setattr(config, field, value)
        if field == "id2label":
            config.label2id = {v: k for k, v in value.items()}
    torch.manual_seed(seed)
    stock = getattr(transformers, prefix + head)(configs[0])
    torch.manual_seed(seed)
    ours = getattr(bi, ours_prefix + head)(configs[1])
    drawn = {name: p.detach().clone() for name, p in ours.named_parameters()}
    ours.load_state_dict(stock.state_dict())
    return stock, ours, drawn


def padded_batch(config, head: str) -> dict:
    """Three rows of 8, 6 and 4 real tokens (an even T: stock's chunked feed-forward needs one), padded with the
    padding id; labels of `head`."""
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(8) < torch.tensor([8, 6, 4])[:, None]).long()
    first = config.pad_token_id + 1
    ids = torch.randint(first, config.vocab_size, mask.shape, generator=g).masked_fill(mask == 0, config.pad_token_id)
    batch = {"input_ids": ids, "attention_mask": mask}
    if config.type_vocab_size > 1:
        batch["token_type_ids"] = torch.randint(0, config.type_vocab_size, mask.shape, generator=g)
    if head == "ForSequenceClassification" and config.problem_type == "multi_label_classification":
        batch["labels"] = torch.randint(0, 2, (3, config.num_labels), generator=g).float()
    elif head == "ForSequenceClassification":
        batch["labels"] = torch.randint(0, config.num_labels, (3,), generator=g)
    return batch


def dropouts(model) -> dict:
    return {name: m.p for name, m in model.named_modules() if isinstance(m, nn.Dropout)}


def tied(model) -> set:
    """The pairs of parameter names that share a tensor."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p.data_ptr(), []).append(name)
    return {tuple(sorted(n)) for n in names.values() if len(n) > 1}


def flat_outputs(out, mask) -> list:
    """Every tensor of an output (a ModelOutput or the tuple of return_dict=False), over real tokens only where it is
    (B, T, ...): stock computes values at padding that ours zeroes."""
    values = out.to_tuple() if hasattr(out, "to_tuple") else out
    tensors = []
    for value in values:
        for t in value if isinstance(value, tuple) else (value,):
            tensors.append(t[mask.bool()] if t.dim() >= 2 and t.shape[:2] == mask.shape else t)
    return tensors


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("field", HONOURED)
def test_a_stock_field_is_honoured(family, field):
    for head in HEADS[family]:
        stock, ours, drawn = built_pair(family, head, field, HONOURED[field])
        assert [(n, p.shape) for n, p in ours.state_dict().items()] == [
            (n, p.shape) for n, p in stock.state_dict().items()]
        assert dropouts(ours) == dropouts(stock)
        assert tied(ours) == tied(stock)
        for name, p in stock.named_parameters():  # the initializer's spread, from the config (0.02 by default)
            if p.dim() == 2 and p.shape[0] > 8:
                assert drawn[name].std().item() == pytest.approx(p.detach().std().item(), rel=0.3), name
        batch = padded_batch(ours.config, head)
        with torch.no_grad():
            expected, got = (flat_outputs(m.eval()(**batch), batch["attention_mask"]) for m in (stock, ours))
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("field", REFUSED)
def test_a_decoder_switch_is_refused(family, field):
    """At construction, on a model built from a config switched afterwards, and on the forward of a model whose
    config was switched after it was built."""
    config_class, pad = FAMILIES[family][2], FAMILIES[family][4]
    model_class = getattr(bi, FAMILIES[family][3] + "Model")
    with pytest.raises(ValueError, match=f"config.{field}=True"):
        config_class(**SMALL, **{field: True})
    config = config_class(**SMALL)
    setattr(config, field, True)
    with pytest.raises(ValueError, match=f"config.{field}=True: bert-impl is a bidirectional encoder"):
        model_class(config)
    model = model_class(config_class(**SMALL))
    ids = torch.tensor([[pad + 1, pad + 2, pad + 3]])
    model(ids)
    setattr(model.config, field, True)
    with pytest.raises(ValueError, match=f"config.{field}=True"):
        model(ids)


@pytest.mark.parametrize("name", ["encoder_hidden_states", "encoder_attention_mask"])
@pytest.mark.parametrize("head", ["BertImplModel", "BertImplForSequenceClassification", "RobertaImplForMaskedLM"])
def test_a_decoders_input_is_refused(name, head):
    model_class = getattr(bi, head)
    model = model_class(model_class.config_class(**SMALL)).eval()
    ids = torch.tensor([[2, 3, 4, 5]])
    value = torch.zeros(1, 3, SMALL["hidden_size"]) if name == "encoder_hidden_states" else torch.ones(1, 3)
    with pytest.raises(ValueError, match=f"{name} was given, but bert-impl is a bidirectional encoder"):
        model(ids, **{name: value})
    model(ids, **{name: None})  # None is no input


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_the_feed_forward_runs_in_chunks_of_chunk_size_feed_forward(family):
    """Stock's memory switch: each layer's feed-forward takes at most that many rows at a time (outputs are the same
    either way: test_a_stock_field_is_honoured), on the padding-free rows as on padded ones."""
    for unpad in (True, False):  # a hook looks inside the encoder: True keeps the padding-free layout all the same
        _, ours, _ = built_pair(family, "ForSequenceClassification", "chunk_size_feed_forward", 3)
        ours.config.unpad_inputs = unpad
        rows = []
        ours.base_model.encoder.layer[0].intermediate.register_forward_hook(
            lambda module, args, out: rows.append(args[0].shape[-2]))
        batch = padded_batch(ours.config, "ForSequenceClassification")
        ours.eval()(**batch)
        if unpad:  # the real tokens' rows (or a few more: the CPU's buckets), 3 at a time
            assert max(rows) == 3 and sum(rows) >= int(batch["attention_mask"].sum()), rows
        else:  # (B, T, H): T in chunks of 3
            assert rows == [3, 3, 2]


def test_a_position_embedding_type_set_afterwards_is_refused():
    config = bi.BertImplConfig(**SMALL)
    config.position_embedding_type = "relative_key"
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        bi.BertImplModel(config)


def encoder_decoder(encoder, decoder):
    model = transformers.EncoderDecoderModel(encoder=encoder, decoder=copy.deepcopy(decoder)).eval()
    model.config.decoder_start_token_id = model.generation_config.decoder_start_token_id = 2
    model.config.pad_token_id = model.generation_config.pad_token_id = 0
    return model


def test_encoder_decoder_model_with_a_bert_impl_encoder(tmp_path):
    """A bert-impl encoder beside a stock decoder (BertLMHeadModel with cross-attention): the same loss, logits and
    greedy generations as with stock's encoder of the same weights; built from folders, saved and loaded back."""
    torch.manual_seed(0)
    stock_encoder = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    encoder = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
    encoder.load_state_dict(stock_encoder.state_dict())
    decoder = transformers.BertLMHeadModel(transformers.BertConfig(**SMALL, is_decoder=True, add_cross_attention=True))
    ids = torch.randint(1, 99, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    targets = torch.randint(1, 99, (2, 4), generator=torch.Generator().manual_seed(2))
    runs = {}
    for name, enc in (("stock", stock_encoder), ("ours", encoder)):
        model = encoder_decoder(enc, decoder)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=targets, output_hidden_states=True)
        runs[name] = out, model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    (stock_out, stock_generated), (out, generated) = runs["stock"], runs["ours"]
    torch.testing.assert_close(out.loss, stock_out.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, stock_out.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(generated, stock_generated)

    encoder.save_pretrained(tmp_path / "encoder")
    decoder.save_pretrained(tmp_path / "decoder")
    model = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(tmp_path / "encoder",
                                                                            tmp_path / "decoder")
    assert isinstance(model.encoder, bi.BertImplModel)
    model.config.decoder_start_token_id, model.config.pad_token_id = 2, 0
    model.save_pretrained(tmp_path / "both")
    reloaded = transformers.EncoderDecoderModel.from_pretrained(tmp_path / "both").eval()
    assert isinstance(reloaded.encoder, bi.BertImplModel)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask, labels=targets).logits,
                                   stock_out.logits, atol=1e-5, rtol=1e-5)


SELECTIONS = [[0, 2], -1, 1, [0, -1], [-3], [5, 0], True, False, None]


@pytest.mark.parametrize("selection", SELECTIONS, ids=str)
@pytest.mark.parametrize("family,head", [("bert", "Model"), ("bert", "ForTokenClassification"),
                                         ("roberta", "ForMaskedLM")])
def test_hidden_states_selected_by_index_as_stock(family, head, selection):
    """`output_hidden_states` as indices (transformers 5.24): the selected hidden states of stock's full list, None in
    the others' places (negative indices from the end, those out of range dropped), on the padded and the
    padding-free path alike; and where the installed transformers selects so too, stock's own answer."""
    stock, ours, _ = built_pair(family, head, "num_hidden_layers", 2)
    batch = padded_batch(ours.config, head)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        every = stock.eval()(**batch, output_hidden_states=True).hidden_states  # L + 1 = 3
        n = len(every)
        chosen = [selection] if isinstance(selection, int) and not isinstance(selection, bool) else selection
        kept = set(range(n)) if selection is True else {i % n for i in chosen if -n <= i < n} if chosen else set()
        expected = tuple(h if i in kept else None for i, h in enumerate(every)) if selection else None
        if hasattr(transformers.utils.output_capturing, "selected_hidden_states"):  # transformers >= 5.24
            assert same_hidden_states(stock(**batch, output_hidden_states=selection).hidden_states, expected, mask)
        for unpad in (None, False):  # the padding-free layout, and the padded one
            ours.config.unpad_inputs = unpad
            assert same_hidden_states(ours.eval()(**batch, output_hidden_states=selection).hidden_states, expected,
                                      mask)


def same_hidden_states(got, expected, mask) -> bool:
    """Both None, or tuples of the same length with None in the same places and the same values at real tokens."""
    if got is None or expected is None:
        return got is None and expected is None
    return len(got) == len(expected) and all(
        (g is None and e is None) or (g is not None and e is not None and torch.allclose(g[mask], e[mask], atol=1e-5))
        for g, e in zip(got, expected))


@pytest.mark.parametrize("model_class", [*bi.AUTO_CLASSES.values(), *(c for classes in bi.FAMILIES.values()
                                                                     for c in classes.values())],
                         ids=lambda c: c.__name__)
def test_output_attentions_is_in_every_signature(model_class):
    """transformers' tests and tools find what a forward takes by introspection (test_eager_matches_sdpa_inference
    skipped every head before): `output_attentions` and `output_hidden_states` are in each forward's signature or
    its typed **kwargs (TransformersKwargs), as stock's heads declare them."""
    parameters = inspect.signature(model_class.forward).parameters
    for name in ("output_attentions", "output_hidden_states"):
        kwargs = parameters["kwargs"].annotation.__args__[0].__annotations__
        assert name in parameters or name in kwargs


@pytest.mark.parametrize("cache_length", [0, 3])
def test_roberta_position_helpers_as_stock(cache_length):
    """RobertaEmbeddings' static helpers, which user code calls, on our embeddings class: stock's results."""
    stock, ours = transformers.models.roberta.modeling_roberta.RobertaEmbeddings, bi.modeling_roberta_impl.RobertaImplEmbeddings
    ids = torch.tensor([[0, 5, 6, 7, 2], [0, 9, 2, 1, 1]])
    torch.testing.assert_close(ours.create_position_ids_from_input_ids(ids, 1, cache_length),
                               stock.create_position_ids_from_input_ids(ids, 1, cache_length))
    embeds = torch.zeros(2, 5, 4)
    torch.testing.assert_close(ours.create_position_ids_from_inputs_embeds(embeds, 1),
                               stock.create_position_ids_from_inputs_embeds(embeds, 1))
    assert bi.XLMRobertaImplModel(bi.XLMRobertaImplConfig(**SMALL)).embeddings.create_position_ids_from_input_ids(
        ids, 1).tolist() == [[2, 3, 4, 5, 6], [2, 3, 4, 1, 1]]
