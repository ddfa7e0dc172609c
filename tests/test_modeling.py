"""The core model against transformers' own BERT on the same weights: the real MiniLM checkpoint for the encoder,
random small checkpoints written by transformers' BertForX for every head. fp32, eval mode."""

import importlib.util
import inspect
import json

import pytest
import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer, BertConfig

import helpers
import modeling_bert_impl as bi
from helpers import HEADS, SMALL, make_inputs, output_tensors
from modeling_bert_impl import BertImplConfig

TOL = 1e-5

PAIRS = [
    ("The quick brown fox jumps over the lazy dog.", "A dog sleeps in the sun."),
    ("BERT reads text in both directions.", "It was published in 2019 by Devlin et al."),
    ("Short one.", "Tiny."),
    ("Padding makes batches rectangular, which wastes compute on positions that carry no text at all.", "Yes."),
]


def real_tokens_max_diff(a, b, mask):
    return (a - b)[mask.bool()].abs().max().item()


@pytest.fixture(scope="module")
def minilm_batch(minilm_dir):
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    a, b = zip(*PAIRS)
    return dict(tokenizer(list(a), list(b), padding=True, return_tensors="pt"))


@pytest.mark.parametrize("reference_attn", ["eager", "sdpa"])
@pytest.mark.parametrize("our_attn", ["eager", "sdpa"])
def test_minilm_encoder_matches_transformers(minilm_dir, minilm_batch, reference_attn, our_attn):
    reference = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation=reference_attn).eval()
    ours, info = bi.BertImplModel.from_pretrained(minilm_dir, attn_implementation=our_attn, output_loading_info=True)
    ours.eval()
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert minilm_batch["attention_mask"].float().mean() < 0.9, "the batch must actually be padded"
    assert minilm_batch["token_type_ids"].max() == 1, "the batch must hold sentence pairs"
    with torch.no_grad():
        expected, got = reference(**minilm_batch), ours(**minilm_batch)
    hidden = real_tokens_max_diff(expected.last_hidden_state, got.last_hidden_state, minilm_batch["attention_mask"])
    pooled = (expected.pooler_output - got.pooler_output).abs().max().item()
    print(f"MiniLM {reference_attn} vs ours ({our_attn}): max |diff| hidden {hidden:.2e}, pooler {pooled:.2e}")
    assert hidden < TOL and pooled < TOL


def test_minilm_hidden_states_and_attentions(minilm_dir, minilm_batch):
    reference = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
    ours = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        expected = reference(**minilm_batch, output_hidden_states=True, output_attentions=True)
        got = ours(**minilm_batch, output_hidden_states=True, output_attentions=True)
    assert len(got.hidden_states) == len(expected.hidden_states) == 7
    assert len(got.attentions) == len(expected.attentions) == 6
    mask = minilm_batch["attention_mask"]
    for e, g in zip(expected.hidden_states, got.hidden_states):
        assert real_tokens_max_diff(e, g, mask) < TOL
    for e, g in zip(expected.attentions, got.attentions):  # (B, N, T, T): the rows of real queries (padding's
        assert g.shape == e.shape  # hidden states are zeros, by design, so its queries differ from stock's)
        assert real_tokens_max_diff(e.transpose(1, 2), g.transpose(1, 2), mask) < TOL
        assert (g.sum(-1) - 1).abs().max() < TOL  # every row a distribution, padding's too
    # Hidden states without attentions take the unpadded path: same values on real tokens.
    with torch.no_grad():
        unpadded = ours(**minilm_batch, output_hidden_states=True)
    for e, g in zip(expected.hidden_states, unpadded.hidden_states):
        assert real_tokens_max_diff(e, g, mask) < TOL


@pytest.mark.parametrize("stock_name,our_name,auto_name", HEADS, ids=[h[1] for h in HEADS])
def test_every_head_loads_stock_checkpoint_with_same_logits_and_loss(tmp_path, stock_name, our_name, auto_name):
    torch.manual_seed(0)
    num_labels = 2 if stock_name == "BertForQuestionAnswering" else 3  # start and end
    stock = getattr(transformers, stock_name)(BertConfig(**{**SMALL, "num_labels": num_labels})).eval()
    stock.save_pretrained(tmp_path)
    ours, info = getattr(bi, our_name).from_pretrained(tmp_path, output_loading_info=True)
    ours.eval()
    assert type(ours).__name__ == our_name
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info

    inputs, labels = make_inputs(stock_name, ours.config, torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = stock(**inputs), ours(**inputs)
        expected_loss = stock(**inputs, **labels).loss if labels else None
        got_loss = ours(**inputs, **labels).loss if labels else None
    if stock_name == "BertForQuestionAnswering":  # ours keeps spans off padding: the reference loss, masked likewise
        pad = inputs["attention_mask"] == 0
        start, end = (l.masked_fill(pad, torch.finfo(l.dtype).min) for l in (expected.start_logits, expected.end_logits))
        T = start.shape[1]
        s_pos, e_pos = labels["start_positions"].clamp(0, T), labels["end_positions"].clamp(0, T)
        ce = lambda l, p: torch.nn.functional.cross_entropy(l, p, ignore_index=T)
        expected_loss = (ce(start, s_pos) + ce(end, e_pos)) / 2
        with torch.no_grad():  # and without padding the loss is transformers' own
            full = {k: v[0:1] for k, v in inputs.items()}
            one = {k: v[0:1] for k, v in labels.items()}
            assert abs(stock(**full, **one).loss.item() - ours(**full, **one).loss.item()) < TOL
    mask = inputs["attention_mask"]
    for name, e in output_tensors(expected).items():
        g = output_tensors(got)[name]
        assert g.shape == e.shape, name
        if name in ("last_hidden_state",) or (e.dim() >= 2 and e.shape[:2] == mask.shape and e.dim() == 3):
            diff = real_tokens_max_diff(e, g, mask)
        elif e.shape == mask.shape:  # (B, T) span logits: compare real tokens
            diff = real_tokens_max_diff(e, g, mask)
        else:
            diff = (e - g).abs().max().item()
        assert diff < TOL, f"{name}: {diff}"
    if labels:
        assert torch.isfinite(got_loss)
        assert abs(expected_loss.item() - got_loss.item()) < TOL, (expected_loss, got_loss)


@pytest.mark.parametrize("problem", ["regression", "single_label_classification", "multi_label_classification"])
def test_sequence_classification_problem_types_match_transformers(tmp_path, problem):
    torch.manual_seed(0)
    num_labels = 1 if problem == "regression" else 3
    stock = transformers.BertForSequenceClassification(BertConfig(**{**SMALL, "num_labels": num_labels})).eval()
    stock.save_pretrained(tmp_path)
    ours = bi.BertImplForSequenceClassification.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 99, (4, 7))
    labels = {
        "regression": torch.randn(4),
        "single_label_classification": torch.tensor([0, 2, 1, 2]),
        "multi_label_classification": torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]]),
    }[problem]
    with torch.no_grad():
        e, g = stock(x, labels=labels), ours(x, labels=labels)
    assert ours.config.problem_type == problem == stock.config.problem_type
    assert abs(e.loss.item() - g.loss.item()) < TOL


@pytest.mark.parametrize("stock_name,our_name,auto_name", HEADS, ids=[h[1] for h in HEADS])
def test_our_checkpoint_round_trips_and_exports_to_stock(tmp_path, stock_name, our_name, auto_name):
    torch.manual_seed(0)
    num_labels = 2 if stock_name == "BertForQuestionAnswering" else 3
    ours = getattr(bi, our_name)(BertImplConfig(**{**SMALL, "num_labels": num_labels})).eval()
    inputs, _ = make_inputs(stock_name, ours.config, torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = output_tensors(ours(**inputs))

    ours.save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == "bert_impl" and config["architectures"] == [our_name]
    back = getattr(transformers, auto_name).from_pretrained(tmp_path / "ours").eval()
    assert type(back).__name__ == our_name

    stocks = []  # written by the model built here and by the one loaded from our folder (no conversion at its load)
    for source, folder in ((ours, tmp_path / "stock"), (back, tmp_path / "stock-from-ours")):
        source.save_stock_pretrained(folder)
        stock_config = json.loads((folder / "config.json").read_text())
        assert stock_config["model_type"] == "bert" and "auto_map" not in stock_config
        stocks.append(getattr(transformers, stock_name).from_pretrained(folder).eval())
        assert type(stocks[-1]).__name__ == stock_name
    with torch.no_grad():
        for reloaded in (back, *stocks):
            after = output_tensors(reloaded(**inputs))
            for name, b in before.items():
                mask = inputs["attention_mask"]
                diff = real_tokens_max_diff(b, after[name], mask) if b.shape[:mask.dim()] == mask.shape else (b - after[name]).abs().max()
                assert diff < TOL, (type(reloaded).__name__, name, diff)


def test_saved_folder_loads_as_remote_code_without_the_package(tmp_path, run_without_package):
    """Every Auto class on a folder of ours, in a Python that cannot import bert-impl: our class, same outputs."""
    torch.manual_seed(0)
    expected = {}
    for stock_name, our_name, auto_name in HEADS:
        num_labels = 2 if stock_name == "BertForQuestionAnswering" else 3
        model = getattr(bi, our_name)(BertImplConfig(**{**SMALL, "num_labels": num_labels})).eval()
        folder = tmp_path / our_name
        model.save_pretrained(folder)
        inputs, _ = make_inputs(stock_name, model.config, torch.Generator().manual_seed(3))
        torch.save(inputs, folder / "inputs.pt")
        with torch.no_grad():
            expected[our_name] = {k: v.tolist() for k, v in output_tensors(model(**inputs)).items()}
        config = json.loads((folder / "config.json").read_text())
        assert set(config["auto_map"]) >= {auto for _, _, auto in HEADS} | {"AutoConfig"}

    got = run_without_package(f"""
        import json, torch, transformers
        heads = {[(our, auto) for _, our, auto in HEADS]!r}
        result = {{}}
        for our_name, auto_name in heads:
            folder = {str(tmp_path)!r} + "/" + our_name
            model = getattr(transformers, auto_name).from_pretrained(folder, trust_remote_code=True).eval()
            inputs = torch.load(folder + "/inputs.pt")
            with torch.no_grad():
                out = model(**inputs)
            names = ("logits", "prediction_logits", "seq_relationship_logits", "start_logits", "end_logits",
                     "last_hidden_state", "pooler_output")
            result[our_name] = {{"class": type(model).__name__, "module": type(model).__module__,
                                 "outputs": {{n: getattr(out, n).tolist() for n in names if getattr(out, n, None) is not None}}}}
        print(json.dumps(result))
    """)
    for _, our_name, _ in HEADS:
        assert got[our_name]["class"] == our_name
        assert got[our_name]["module"].startswith("transformers_modules."), got[our_name]["module"]
        for name, values in expected[our_name].items():
            diff = (torch.tensor(values) - torch.tensor(got[our_name]["outputs"][name])).abs().max()
            assert diff < TOL, (our_name, name, diff)


def test_auto_classes_give_our_classes():
    assert isinstance(AutoConfig.for_model("bert_impl"), BertImplConfig)
    for _, our_name, auto_name in HEADS:
        config = BertImplConfig(**{**SMALL, "num_labels": 2 if auto_name.endswith("QuestionAnswering") else 3})
        model = getattr(transformers, auto_name).from_config(config)
        assert type(model).__name__ == our_name


def test_presets_have_the_papers_sizes():
    sizes = {}
    for name in ("base", "large"):
        with torch.device("meta"):
            model = bi.BertImplModel(BertImplConfig.from_preset(name))
        sizes[name] = sum(p.numel() for p in model.parameters())
    assert 108e6 < sizes["base"] < 111e6  # the paper's 110M
    assert 333e6 < sizes["large"] < 336e6  # the paper's 340M
    tiny = BertImplConfig.from_preset("tiny", vocab_size=1000)
    assert (tiny.num_hidden_layers, tiny.hidden_size, tiny.num_attention_heads, tiny.intermediate_size) == (2, 128, 2, 512)
    with pytest.raises(ValueError, match="preset"):
        BertImplConfig.from_preset("huge")


@pytest.mark.parametrize("bad,match", [
    (dict(hidden_size=100, num_attention_heads=3), "divisible"),
    (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(position_embedding_type="relative_key"), "position"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        BertImplConfig(**{**SMALL, **bad})


def test_init_weights_use_initializer_range():
    model = bi.BertImplForPreTraining(BertImplConfig.from_preset("mini", vocab_size=5000, initializer_range=0.05))
    std = model.bert.encoder.layer[0].intermediate.dense.weight.std().item()
    assert abs(std - 0.05) < 0.005
    assert model.bert.encoder.layer[0].intermediate.dense.bias.abs().max() == 0
    assert model.bert.embeddings.word_embeddings.weight[0].abs().max() == 0  # padding row
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


# --- bad input ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model():
    return helpers.small_model()


@pytest.mark.parametrize("case,match", [
    (lambda x: dict(input_ids=x.clone().index_fill_(1, torch.tensor([2]), 99)), "outside the vocabulary"),
    (lambda x: dict(input_ids=x.clone().index_fill_(1, torch.tensor([2]), -1)), "outside the vocabulary"),
    (lambda x: dict(input_ids=x, token_type_ids=torch.full_like(x, 2)), "token type id"),
    (lambda x: dict(input_ids=torch.randint(0, 99, (2, 65))), "position table"),
    (lambda x: dict(input_ids=x, attention_mask=torch.ones(2, 5)), "attention_mask has shape"),
    (lambda x: dict(input_ids=x, token_type_ids=torch.zeros(2, 6, dtype=torch.long)), "token_type_ids has shape"),
    (lambda x: dict(input_ids=x.float()), "integer"),
    (lambda x: dict(input_ids=x[0]), "batch, seq_len"),
    (lambda x: dict(input_ids=x, position_ids=torch.full_like(x, 64)), "position id"),
])
def test_bad_input_raises_clear_value_error(small_model, case, match):
    x = torch.randint(0, 99, (2, 8))
    with pytest.raises(ValueError, match=match):
        small_model(**case(x))


def test_all_padding_row_is_finite_and_leaves_other_rows_alone(small_model):
    x = torch.randint(1, 99, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0
    alone = mask.clone()
    with torch.no_grad():
        reference = small_model(x, attention_mask=mask)
        mask_with_empty = mask.clone()
        mask_with_empty[2] = 0
        for attn in ("eager", "sdpa"):
            small_model.set_attn_implementation(attn)
            out = small_model(x, attention_mask=mask_with_empty)
            assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
            assert real_tokens_max_diff(reference.last_hidden_state[:2], out.last_hidden_state[:2], alone[:2]) < TOL
            assert (reference.pooler_output[:2] - out.pooler_output[:2]).abs().max() < TOL
    small_model.set_attn_implementation("sdpa")


def test_truncated_safetensors_is_refused_naming_the_file(tmp_path):
    bi.BertImplModel(BertImplConfig(**SMALL)).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(OSError) as refused:
        bi.BertImplModel.from_pretrained(tmp_path)
    message = str(refused.value)
    assert str(weights) in message and "damaged" in message and "force_download=True" in message, message
    with pytest.raises(SafetensorError) as diagnosis:
        safe_open(weights, framework="pt")
    assert str(diagnosis.value) in message  # safetensors' own diagnosis is kept


# --- transformers contract -------------------------------------------------------------------------------------------
def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = bi.BertImplForSequenceClassification(BertImplConfig(**SMALL, hidden_dropout_prob=0.0,
                                                                attention_probs_dropout_prob=0.0)).train()
    x, mask, y = torch.randint(0, 99, (2, 8)), torch.tensor([[1] * 8, [1] * 5 + [0] * 3]), torch.tensor([0, 2])

    def grads():
        model.zero_grad()
        model(x, attention_mask=mask, labels=y).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = grads()
    # activation_checkpointing_enable in newer transformers 5.x; gradient_checkpointing_enable (its deprecated alias) before
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert all(layer.gradient_checkpointing for layer in model.bert.encoder.layer)
    checkpointed = grads()
    assert len(plain) == len(checkpointed) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, checkpointed))


def test_resize_token_embeddings_keeps_the_decoder_tied():
    model = bi.BertImplForMaskedLM(BertImplConfig(**SMALL))
    model.resize_token_embeddings(120)
    assert model.config.vocab_size == 120
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    assert model.cls.predictions.bias.shape == (120,)
    logits = model(torch.randint(0, 120, (2, 5))).logits
    assert logits.shape == (2, 5, 120)


def test_device_map_auto_loads(tmp_path):
    pytest.importorskip("accelerate")
    bi.BertImplForSequenceClassification(BertImplConfig(**SMALL)).save_pretrained(tmp_path)
    model = bi.BertImplForSequenceClassification.from_pretrained(tmp_path, device_map="auto")
    assert model(torch.randint(0, 99, (1, 4))).logits.shape == (1, 3)


def test_saved_weights_are_our_state_dict_so_trainer_resume_loads_them(tmp_path):
    """Trainer's resume_from_checkpoint / load_best_model_at_end call load_state_dict on the file's keys as they are."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = bi.BertImplForPreTraining(BertImplConfig(**SMALL))
    model.save_pretrained(tmp_path)
    fresh = bi.BertImplForPreTraining(BertImplConfig(**SMALL))
    result = fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert not result.unexpected_keys
    # tied to the word embeddings and to cls.predictions.bias, not stored (as stock BERT saves them)
    assert sorted(result.missing_keys) == ["cls.predictions.decoder.bias", "cls.predictions.decoder.weight"]
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_packed_batch_with_padding_is_refused(small_model):
    """Packing markers and an attention mask with zeros contradict each other: refuse rather than guess."""
    x = torch.randint(1, 99, (1, 8))
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 6:] = 0
    with pytest.raises(ValueError, match="packed batch"):
        small_model(x, attention_mask=mask, seq_idx=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))


# --- the transformers contract: tuples, dense MLM logits, losses, attention implementations, loading -------------------
@pytest.mark.parametrize("stock_name,our_name,auto_name", HEADS, ids=[h[1] for h in HEADS])
def test_return_dict_false_gives_stock_berts_tuple(tmp_path, stock_name, our_name, auto_name):
    """`return_dict=False` and `config.return_dict=False`: the tuple transformers' BertForX gives on the same weights
    (unpadded inputs, so every element compares exactly), our extra fields after stock's."""
    torch.manual_seed(0)
    num_labels = 2 if stock_name == "BertForQuestionAnswering" else 3
    stock = getattr(transformers, stock_name)(BertConfig(**{**SMALL, "num_labels": num_labels})).eval()
    stock.save_pretrained(tmp_path)
    ours = getattr(bi, our_name).from_pretrained(tmp_path).eval()
    inputs, labels = make_inputs(stock_name, ours.config, torch.Generator().manual_seed(4))
    inputs["attention_mask"].fill_(1)
    if stock_name == "BertForTokenClassification":
        labels["labels"] = torch.randint(0, num_labels, labels["labels"].shape)
    for kwargs in ({**inputs, **labels}, inputs):
        with torch.no_grad():
            expected = stock(**kwargs, output_hidden_states=True, return_dict=False)
            got = ours(**kwargs, output_hidden_states=True, return_dict=False)
            ours.config.return_dict = False
            from_config = ours(**kwargs, output_hidden_states=True)
            ours.config.return_dict = True
        assert type(expected) is tuple and type(got) is tuple and type(from_config) is tuple
        extra = 2 if stock_name == "BertForPreTraining" and labels.keys() <= kwargs.keys() else 0  # mlm_loss, nsp_loss
        assert len(got) == len(from_config) == len(expected) + extra
        for i, e in enumerate(expected):
            pairs = zip(e, got[i]) if isinstance(e, tuple) else [(e, got[i])]  # hidden states: a tuple of tensors
            for a, b in pairs:
                assert a.shape == b.shape and (a - b).abs().max() < TOL, (i, a.shape, b.shape)
        for a, b in zip(got, from_config):
            assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)
        if extra:
            mlm_loss, nsp_loss = got[-2:]
            assert abs((mlm_loss + nsp_loss).item() - got[0].item()) < TOL


def test_pretraining_tuple_unpacks_as_stocks():
    model = bi.BertImplForPreTraining(BertImplConfig(**SMALL)).eval()
    x = torch.randint(1, 99, (2, 6))
    labels = torch.full((2, 6), -100).index_fill_(1, torch.tensor([2]), 7)
    loss, logits, nsp_logits, *extra = model(x, labels=labels, next_sentence_label=torch.tensor([0, 1]), return_dict=False)
    assert loss.dim() == 0 and logits.shape == (2, 6, 99) and nsp_logits.shape == (2, 2) and len(extra) == 2


@pytest.mark.parametrize("head", [bi.BertImplForMaskedLM, bi.BertImplForPreTraining])
def test_mlm_logits_keep_their_shape_with_labels_unless_sparse_is_asked(head):
    torch.manual_seed(0)
    x = torch.randint(1, 99, (3, 7))
    labels = torch.full((3, 7), -100).index_fill_(1, torch.tensor([1, 4]), 5)
    name = "logits" if head is bi.BertImplForMaskedLM else "prediction_logits"
    model = head(BertImplConfig(**SMALL)).eval()
    assert model.config.sparse_prediction is False
    with torch.no_grad():
        dense = model(x, labels=labels)
        model.config.sparse_prediction = True
        sparse = model(x, labels=labels)
    assert getattr(dense, name).shape == (3, 7, 99)
    assert getattr(sparse, name).shape == (6, 99)  # the masked rows only
    assert (getattr(dense, name)[labels != -100] - getattr(sparse, name)).abs().max() < TOL
    assert abs(dense.loss.item() - sparse.loss.item()) < TOL


def test_run_mlm_style_compute_metrics_runs_under_trainer(tmp_path):
    """transformers' run_mlm: `preprocess_logits_for_metrics` keeps logits.argmax(-1), `compute_metrics` compares it
    with the labels at labels != -100. Its accuracy equals one computed from the model's own outputs."""
    import numpy as np
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = bi.BertImplForMaskedLM(BertImplConfig(**SMALL)).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 99, (12, 8), generator=g)
    labels = ids.masked_fill(torch.rand(12, 8, generator=g) > 0.3, -100)
    labels[0] = -100  # one example without any masked token
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 8] * 12, "labels": labels.tolist()})

    def preprocess_logits_for_metrics(logits, labels):
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        predictions, labels = eval_preds
        kept = labels != -100
        return {"accuracy": float(np.mean(predictions[kept] == labels[kept]))}

    args = TrainingArguments(tmp_path, per_device_eval_batch_size=5, report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, eval_dataset=data, compute_metrics=compute_metrics,
                      preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    metrics = trainer.evaluate()
    with torch.no_grad():
        predicted = model(ids).logits.argmax(-1)
    expected = (predicted == labels)[labels != -100].float().mean().item()
    assert abs(metrics["eval_accuracy"] - expected) < 1e-6 and np.isfinite(metrics["eval_loss"])


NO_LABELS = {  # every head's labels, all of them ignored
    "BertImplForPreTraining": lambda B, T: {"labels": torch.full((B, T), -100),
                                            "next_sentence_label": torch.full((B,), -100)},
    "BertImplForMaskedLM": lambda B, T: {"labels": torch.full((B, T), -100)},
    "BertImplForNextSentencePrediction": lambda B, T: {"labels": torch.full((B,), -100)},
    "BertImplForSequenceClassification": lambda B, T: {"labels": torch.full((B,), -100)},
    "BertImplForTokenClassification": lambda B, T: {"labels": torch.full((B, T), -100)},
    "BertImplForQuestionAnswering": lambda B, T: {"start_positions": torch.full((B,), T + 5),
                                                  "end_positions": torch.full((B,), T + 5)},  # outside: ignored
    "BertImplForMultipleChoice": lambda B, T: {"labels": torch.full((B,), -100)},
}


@pytest.mark.parametrize("our_name", list(NO_LABELS))
def test_a_batch_with_every_label_ignored_has_zero_loss_and_zero_gradients(our_name):
    """Deliberately unlike transformers' BERT, whose mean over no label is NaN (checked here too)."""
    torch.manual_seed(0)
    stock_name = our_name.replace("BertImpl", "Bert", 1)
    ours = getattr(bi, our_name)(BertImplConfig(**{**SMALL, "num_labels": 2}))
    stock = getattr(transformers, stock_name)(BertConfig(**{**SMALL, "num_labels": 2}))
    inputs, _ = make_inputs(stock_name, ours.config, torch.Generator().manual_seed(6))
    B, T = 3, inputs["input_ids"].shape[-1]
    labels = NO_LABELS[our_name](B, T)
    assert torch.isnan(stock(**inputs, **labels).loss)
    out = ours(**inputs, **labels)
    assert torch.isfinite(out.loss) and out.loss.item() == 0.0
    out.loss.backward()
    grads = [p.grad for p in ours.parameters() if p.grad is not None]
    assert grads and all(g.abs().max() == 0 for g in grads)
    if our_name == "BertImplForPreTraining":
        assert out.mlm_loss.item() == 0.0 and out.nsp_loss.item() == 0.0


def padded_and_packed_batches():
    g = torch.Generator().manual_seed(7)
    padded = {"input_ids": torch.randint(1, 99, (3, 9), generator=g), "attention_mask": torch.ones(3, 9, dtype=torch.long)}
    padded["attention_mask"][1, 6:] = 0
    padded["attention_mask"][2, :4] = 0  # left padding
    lengths = [4, 2, 3]
    packed = {"input_ids": torch.randint(1, 99, (1, sum(lengths)), generator=g),
              "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    return padded, packed, lengths


@pytest.mark.skipif(not bi.input_checks.TRACING_SUPPORTED, reason=f"attn_implementation='flex_attention' needs torch "
                    f">= 2.13 (installed: {torch.__version__}); its refusal: tests/test_torch_versions.py")
def test_flex_attention_matches_sdpa_and_eager_on_the_padded_path():
    """flex_attention on CPU, fp32, padded path (unpad_inputs=False): a padded batch (right and left padding) and a
    packed one (block-diagonal mask: each sequence alone), against eager, sdpa and eager in float64 (the CPU's flex
    check: tests/test_gpu.py runs flex on CUDA only, each CPU compile taking 25-45 s)."""
    torch.manual_seed(0)
    model = bi.BertImplModel(BertImplConfig(**SMALL, unpad_inputs=False)).eval()
    padded, packed, lengths = padded_and_packed_batches()
    outputs = {}
    with torch.no_grad():
        model.set_attn_implementation("eager")
        outputs["float64"] = (model.double()(**padded), model(**packed))
        model.float()
        for implementation in ("eager", "sdpa", "flex_attention"):
            model.set_attn_implementation(implementation)
            outputs[implementation] = (model(**padded), model(**packed))
    assert model.config._attn_implementation == "flex_attention"
    assert outputs["float64"][0].last_hidden_state.dtype == torch.float64
    mask = padded["attention_mask"]
    for implementation in ("float64", "eager", "sdpa"):
        reference, got = outputs[implementation], outputs["flex_attention"]
        assert real_tokens_max_diff(reference[0].last_hidden_state, got[0].last_hidden_state, mask) < TOL
        assert (reference[0].pooler_output - got[0].pooler_output).abs().max() < TOL
        assert (reference[1].last_hidden_state - got[1].last_hidden_state).abs().max() < TOL
    model.set_attn_implementation("sdpa")
    start = 0
    with torch.no_grad():
        for n in lengths:  # the packed batch: each sequence as if it were alone
            alone = model(packed["input_ids"][:, start:start + n]).last_hidden_state
            assert (alone - outputs["flex_attention"][1].last_hidden_state[:, start:start + n]).abs().max() < TOL
            start += n


def test_flash_attention_2_is_accepted_and_says_what_it_needs():
    """Declared supported. Without a CUDA GPU and the flash_attn package, asking for it fails at once, saying so;
    with them, it matches sdpa on a padded batch."""
    config = BertImplConfig(**SMALL, unpad_inputs=False)
    available = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
    if not available:
        with pytest.raises(ImportError, match="FlashAttention2"):
            bi.BertImplModel._from_config(config, attn_implementation="flash_attention_2")
        return
    torch.manual_seed(0)
    padded, _, _ = padded_and_packed_batches()
    padded = {k: v.cuda() for k, v in padded.items()}
    model = bi.BertImplModel._from_config(config, attn_implementation="flash_attention_2").cuda().half().eval()
    with torch.no_grad():
        flash = model(**padded).last_hidden_state
        model.set_attn_implementation("sdpa")
        sdpa = model(**padded).last_hidden_state
    assert real_tokens_max_diff(flash.float(), sdpa.float(), padded["attention_mask"]) < 5e-3


def test_stock_checkpoint_loads_without_the_model_type_warning(minilm_dir, tmp_path):
    """A stock `bert` config is translated into ours: no "model of type bert to instantiate a model of type
    bert_impl" warning. Real warnings still surface: the head's new classifier, and a config of another type."""
    import shutil
    import warnings

    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    logger = logging.get_logger("transformers")
    verbosity = logging.get_verbosity()
    logging.set_verbosity_warning()  # transformers' default (another test module may have lowered it)
    try:
        with CaptureLogger(logger) as captured, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            encoder = bi.BertImplModel.from_pretrained(minilm_dir)
            classifier = bi.BertImplForSequenceClassification.from_pretrained(minilm_dir, num_labels=2)
    finally:
        logging.set_verbosity(verbosity)
    assert encoder.config.model_type == "bert_impl" and encoder.config.architectures == ["BertImplModel"]
    assert isinstance(classifier, bi.BertImplForSequenceClassification)
    everything = captured.out + "\n".join(str(w.message) for w in caught)
    assert "to instantiate a model of type" not in everything, everything
    assert "classifier.weight" in captured.out  # transformers' report of the newly initialised head

    other = tmp_path / "roberta"
    shutil.copytree(minilm_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    logging.set_verbosity_warning()
    try:
        with CaptureLogger(logger) as captured:
            BertImplConfig.from_pretrained(other)
    finally:
        logging.set_verbosity(verbosity)
    assert "You are using a model of type `roberta` to instantiate a model of type `bert_impl`" in captured.out


def test_pretraining_recipe_turns_the_sparse_decoder_on(tmp_path):
    """The model's default is dense (B, T, V) logits; the pre-training recipe asks for the sparse decoder, for a new
    model and for one it continues from, and --config_overrides can still turn it off."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import run_pretraining

    class Tokenizer:
        pad_token_id = 0

        def __len__(self):
            return 99

    new = run_pretraining.load_model(run_pretraining.ModelArguments(config_name="tiny"), Tokenizer(), 64)
    assert new.config.sparse_prediction is True
    bi.BertImplForPreTraining(BertImplConfig(**SMALL)).save_pretrained(tmp_path)
    continued = run_pretraining.load_model(run_pretraining.ModelArguments(model_name_or_path=str(tmp_path)), Tokenizer(), 64)
    assert continued.config.sparse_prediction is True
    undone = run_pretraining.new_config(
        run_pretraining.ModelArguments(config_name="tiny", config_overrides="sparse_prediction=False"), Tokenizer())
    assert undone.sparse_prediction is False


def test_saved_folders_hold_stock_parameter_names(tmp_path):
    """save_pretrained and save_stock_pretrained write the same (stock) names; only the config and code files differ."""
    from safetensors import safe_open

    model = bi.BertImplForSequenceClassification(BertImplConfig(**SMALL))
    model.save_pretrained(tmp_path / "ours")
    model.save_stock_pretrained(tmp_path / "stock")
    keys = {name: set(safe_open(tmp_path / name / "model.safetensors", "pt").keys()) for name in ("ours", "stock")}
    assert keys["ours"] == keys["stock"]
    assert "bert.encoder.layer.0.attention.self.query.weight" in keys["ours"]
    assert json.loads((tmp_path / "stock" / "config.json").read_text())["model_type"] == "bert"
    assert not list((tmp_path / "stock").glob("*.py")) and list((tmp_path / "ours").glob("*.py"))


def decision_points(function) -> int:
    """if/for/while, each and/or, ternaries and comprehension ifs in a function's own source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.For, ast.While, ast.IfExp)):
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            count += len(node.ifs)
    return count


def test_the_encoder_forward_reads_like_transformers():
    """BertModel.forward stays plain (transformers' own has about 10 decision points), and so does the one function
    that chooses its layout (layouts.choose_layout) and the encoder's loop; the input checks choose nothing."""
    from modeling_bert_impl import input_checks, layouts

    forward = inspect.unwrap(bi.BertImplModel.forward)
    assert decision_points(forward) <= 5, decision_points(forward)  # 2 today
    assert decision_points(layouts.choose_layout) <= 6, decision_points(layouts.choose_layout)  # 4 today
    assert decision_points(bi.modeling_bert_impl.BertImplEncoder.forward) <= 5  # 3 today
    assert set(input_checks.BatchFacts._fields) == {"marked", "packable", "mask_has_padding", "nnz", "max_seqlen",
                                                    "num_sequences"}  # what was read, no layout
    # the compiled engine's eligibility: named reasons, each a function with its docstring, none of them long
    from modeling_bert_impl.inference import compiled_encoder as compiled

    reasons = [*compiled.STEP_ASIDE, compiled.program_ids, compiled.batch_positions, compiled.real_tokens]
    assert all(reason.__doc__ for reason in reasons)
    assert max(map(decision_points, reasons)) <= 10 and decision_points(compiled.CompiledBertImplModel.program_inputs) <= 2
    assert decision_points(lambda x: x if x and x > 1 else [y for y in x if y]) == 3  # the counter counts


# --- cached keys (prefix tuning) ------------------------------------------------------------------------------------
def cached_keys(model, hidden_states, C: int):
    """A DynamicCache with the keys and values each layer computes for the first C tokens, from `hidden_states` (the
    model's output_hidden_states on the whole sequence): what those tokens give the tokens after them."""
    cache = transformers.DynamicCache()
    for i, layer in enumerate(model.encoder.layer):
        attention, h = layer.attention.self, hidden_states[i][:, :C]  # (B, C, H)
        split = lambda t: t.view(*h.shape[:2], attention.num_attention_heads, -1).transpose(1, 2)  # noqa: E731
        cache.update(split(attention.key(h)), split(attention.value(h)), i)  # (B, N, C, D) each
    return cache


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mask_over", ["cache and tokens", "tokens", "none"])
@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_cached_keys_continue_the_sequence(attn, mask_over, name):
    """Tokens after C cached keys (PEFT's prefix tuning) equal the same tokens after those C tokens in one sequence:
    positions start at C and the cached keys are attended, as in transformers' BERT. Both argument names (transformers
    renamed past_key_values to cache in 5.24; peft passes the old one) and both masks peft or a user passes."""
    torch.manual_seed(0)
    model = bi.BertImplModel(BertImplConfig(**SMALL, attn_implementation=attn)).eval()
    B, C, T = 3, 4, 9
    ids = torch.randint(1, 99, (B, C + T))
    mask = torch.ones(B, C + T, dtype=torch.long)
    if mask_over != "none":
        mask[1, -3:] = 0  # padding after the second row's tokens
    with torch.no_grad():
        whole = model(ids, mask, output_hidden_states=True)
        masks = {"cache and tokens": mask, "tokens": mask[:, C:], "none": None}
        after = model(ids[:, C:], masks[mask_over], **{name: cached_keys(model, whole.hidden_states, C)})
    assert after.last_hidden_state.shape == (B, T, SMALL["hidden_size"])
    diff = (after.last_hidden_state - whole.last_hidden_state[:, C:]).abs().max().item()
    assert diff < TOL, diff


def test_cached_keys_refuse_a_masked_cache_and_a_packed_batch(small_model):
    ids = torch.randint(1, 99, (2, 12))
    with torch.no_grad():
        whole = small_model(ids, output_hidden_states=True)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 1] = 0  # one of the 4 cached keys masked
    with pytest.raises(ValueError, match="attention_mask's first 4 columns .* must be 1; 1 of them are 0"):
        small_model(ids[:, 4:], mask, cache=cached_keys(small_model, whole.hidden_states, 4))
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="need a padded batch, not a packed one"):
        small_model(ids[:1, 4:], position_ids=packed,
                    cache=cached_keys(small_model, [h[:1] for h in whole.hidden_states], 4))


def test_cached_keys_are_read_not_extended_and_survive_gradient_checkpointing():
    """The cache is the same after a call (an encoder extends nothing), so a layer that gradient checkpointing
    recomputes reads the same keys: training with cached keys gives the same gradients, those of the cached keys too,
    with checkpointing as without. (transformers' own layers drop a cache under checkpointing.)"""
    torch.manual_seed(0)
    config = BertImplConfig(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = bi.BertImplModel(config).train()
    ids = torch.randint(1, 99, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, -4:] = 0
    with torch.no_grad():
        hidden = model(ids, mask, output_hidden_states=True).hidden_states
    grads = []
    for checkpointing in (False, True):
        model.gradient_checkpointing_disable() if not checkpointing else model.gradient_checkpointing_enable()
        with torch.no_grad():
            cache = cached_keys(model, hidden, 4)
        prefix = cache.layers[0].keys.requires_grad_()  # a leaf: its gradient is kept
        model(ids[:, 4:], mask, cache=cache).pooler_output.square().sum().backward()
        assert cache.get_seq_length() == 4
        grads.append([prefix.grad.clone()] + [p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    assert grads[1][0].abs().max() > 0
    for without, within in zip(*grads):
        assert (without - within).abs().max() < TOL
