"""`apply_bert_impl()`: transformers' Auto classes (and so pipelines, sentence-transformers) build our classes for
stock BERT checkpoints, with transformers' outputs; `revert_bert_impl()` gives transformers' classes back; folders
saved meanwhile are stock folders. References: transformers' own BERT on the same weights, in the same process."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer, BertConfig

import modeling_bert_impl as bi
from helpers import layouts_built, max_diff

TOL = 1e-5
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "BERT reads text in both directions, which is what makes it a good encoder for retrieval.",
    "Short one.",
]
SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=64)


@pytest.fixture
def patched():
    bi.apply_bert_impl()
    try:
        yield
    finally:
        bi.revert_bert_impl()


@pytest.fixture(scope="module")
def classifier_dir(minilm_dir, tmp_path_factory):
    """A stock BertForSequenceClassification folder (MiniLM encoder, a seeded random classifier) with its tokenizer."""
    folder = tmp_path_factory.mktemp("stock-classifier")
    torch.manual_seed(0)
    transformers.BertForSequenceClassification.from_pretrained(minilm_dir, num_labels=3).save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(folder)
    return str(folder)


def test_auto_pipeline_and_sentence_transformers_run_ours_then_stock_after_undo(minilm_dir, classifier_dir):
    from sentence_transformers import CrossEncoder, SentenceTransformer

    padding_free = {}  # output -> whether our model ran it padding-free

    def measured(name, model, call):
        """call(), noting whether `model`, where it is one of ours, ran the padding-free layout."""
        if not isinstance(model, bi.BertImplPreTrainedModel):
            return call()
        with layouts_built(model) as built:
            result = call()
        padding_free[name] = bool(built)
        return result

    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")

    def run():
        extractor = transformers.pipeline("feature-extraction", model=minilm_dir, device="cpu")
        encoder = SentenceTransformer(minilm_dir, device="cpu")
        classifier = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
        cross = CrossEncoder(classifier_dir, device="cpu")
        pairs = [(SENTENCES[0], SENTENCES[1]), (SENTENCES[2], SENTENCES[0])]
        with torch.no_grad():
            outputs = {
                "features": measured("features", extractor.model, lambda: [torch.tensor(f[0]) for f in extractor(
                    SENTENCES)]),  # (T_i, H) each, no padding
                "embeddings": measured("embeddings", encoder[0].auto_model,
                                       lambda: encoder.encode(SENTENCES, convert_to_tensor=True)),
                "logits": measured("logits", classifier, lambda: classifier(**batch).logits),
                "cross": measured("cross", cross.model, lambda: cross.predict(pairs, convert_to_tensor=True)),
            }
        models = [extractor.model, encoder[0].auto_model, classifier, cross.model]
        return outputs, models

    bi.apply_bert_impl()
    try:
        ours, our_models = run()
    finally:
        bi.revert_bert_impl()
    stock, stock_models = run()

    for model in our_models:
        assert isinstance(model, bi.BertImplPreTrainedModel), type(model)
        assert type(model.config) is BertConfig and model.config.model_type == "bert"
    # One sentence at a time (the pipeline): no padding to skip; padded batches: the padding-free rows, by default.
    assert padding_free == {"features": False, "embeddings": True, "logits": True, "cross": True}
    for model in stock_models:
        assert type(model).__module__.startswith("transformers.models.bert."), type(model)
    diffs = {
        "features": max(max_diff(a, b) for a, b in zip(ours["features"], stock["features"])),
        **{key: max_diff(ours[key], stock[key]) for key in ("embeddings", "logits", "cross")},
    }
    print("patched vs stock, max |diff|:", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert all(diff < TOL for diff in diffs.values()), diffs


def test_folder_saved_after_the_call_is_the_stock_folder(minilm_dir, classifier_dir, tmp_path, patched):
    from sentence_transformers import SentenceTransformer

    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    assert isinstance(model, bi.BertImplForSequenceClassification)
    model.save_pretrained(tmp_path / "patched")
    encoder = AutoModel.from_pretrained(minilm_dir).eval()
    assert isinstance(encoder, bi.BertImplModel)
    encoder.save_pretrained(tmp_path / "patched-encoder")
    sentence_encoder = SentenceTransformer(minilm_dir, device="cpu")
    assert isinstance(sentence_encoder[0].auto_model, bi.BertImplModel)
    sentence_encoder.save(str(tmp_path / "patched-st"))
    transformers.BertForSequenceClassification.from_pretrained(classifier_dir).save_pretrained(tmp_path / "stock")

    read = lambda name: json.loads((tmp_path / name / "config.json").read_text())
    assert read("patched") == read("stock")  # model_type "bert", architectures, no field of ours
    assert sorted(p.name for p in (tmp_path / "patched").iterdir()) == ["config.json", "model.safetensors"]
    patched_weights, stock_weights = (load_file(tmp_path / name / "model.safetensors") for name in ("patched", "stock"))
    assert patched_weights.keys() == stock_weights.keys()
    assert all(torch.equal(patched_weights[k], stock_weights[k]) for k in stock_weights)
    assert read("patched-st")["model_type"] == "bert" and read("patched-st")["architectures"] == ["BertModel"]

    # Trainer reloads its (stock-format) checkpoints with load_state_dict: stock names are accepted.
    result = model.load_state_dict(stock_weights, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result

    # The folders load in plain transformers / sentence-transformers (after the undo, transformers' own classes) and
    # give the patched models' outputs.
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected_logits, expected_hidden = model(**batch).logits, encoder(**batch)
    expected_embeddings = sentence_encoder.encode(SENTENCES, convert_to_tensor=True)
    bi.revert_bert_impl()
    stock_classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "patched").eval()
    stock_encoder = AutoModel.from_pretrained(tmp_path / "patched-encoder").eval()
    assert type(stock_classifier) is transformers.BertForSequenceClassification
    assert type(stock_encoder) is transformers.BertModel
    stock_sentence_encoder = SentenceTransformer(str(tmp_path / "patched-st"), device="cpu")
    assert type(stock_sentence_encoder[0].auto_model) is transformers.BertModel
    with torch.no_grad():
        logits, hidden = stock_classifier(**batch).logits, stock_encoder(**batch)
    embeddings = stock_sentence_encoder.encode(SENTENCES, convert_to_tensor=True)
    diffs = {
        "logits": max_diff(logits, expected_logits),
        "last_hidden_state": max_diff(hidden.last_hidden_state[real], expected_hidden.last_hidden_state[real]),
        "pooler_output": max_diff(hidden.pooler_output, expected_hidden.pooler_output),
        "sentence_embeddings": max_diff(embeddings, expected_embeddings),
    }
    assert all(diff < TOL for diff in diffs.values()), diffs


def test_masked_lm_keeps_the_stock_output_contract(tmp_path, patched):
    torch.manual_seed(0)
    stock = transformers.BertForMaskedLM(BertConfig(**SMALL)).eval()
    stock.save_pretrained(tmp_path)
    ours = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert isinstance(ours, bi.BertImplForMaskedLM)
    input_ids = torch.randint(1, 99, (2, 7))
    attention_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    labels = torch.full((2, 7), -100)
    labels[:, 2] = 5
    with torch.no_grad():
        expected, got = (m(input_ids, attention_mask=attention_mask, labels=labels) for m in (stock, ours))
    assert got.logits.shape == expected.logits.shape == (2, 7, 99)  # full logits, as stock BERT (no sparse rows)
    real = attention_mask.bool()
    assert max_diff(got.logits[real], expected.logits[real]) < TOL and max_diff(got.loss, expected.loss) < TOL


def test_our_config_fields_are_from_pretrained_keywords(tmp_path, patched, skipping_always_pays):
    from modeling_bert_impl.stock_format import OUR_FIELDS

    assert {field: getattr(bi.BertImplConfig(), field) for field in OUR_FIELDS} == OUR_FIELDS  # the same defaults
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(BertConfig(**SMALL)).save_pretrained(tmp_path)
    batch = {"input_ids": torch.randint(1, 99, (2, 7)), "attention_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3])}
    for kwargs, padding_free in (({}, True), ({"unpad_inputs": False}, False)):
        model = AutoModelForSequenceClassification.from_pretrained(tmp_path, **kwargs).eval()
        assert isinstance(model, bi.BertImplForSequenceClassification)
        assert model.config.unpad_inputs is kwargs.get("unpad_inputs", None)
        with torch.no_grad(), layouts_built(model) as built:
            model(**batch)
        assert bool(built) is padding_free
    model = AutoModelForMaskedLM.from_pretrained(tmp_path, sparse_prediction=True)
    assert model.config.sparse_prediction is True


def test_our_folders_and_what_we_do_not_implement_are_unaffected(tmp_path, patched):
    ours = bi.BertImplModel(bi.BertImplConfig(**SMALL))
    ours.save_pretrained(tmp_path / "ours")
    assert type(AutoModel.from_pretrained(tmp_path / "ours")) is bi.BertImplModel
    # A decoder config stays transformers' (bert-impl is a bidirectional encoder only).
    assert type(AutoModel.from_config(BertConfig(**SMALL, is_decoder=True))) is transformers.BertModel
    assert isinstance(AutoModel.from_config(BertConfig(**SMALL)), bi.BertImplModel)
    bi.revert_bert_impl()
    assert type(AutoModel.from_config(BertConfig(**SMALL))) is transformers.BertModel


def test_sentence_transformers_folder_of_ours(minilm_dir, tmp_path, run_without_package):
    """The README's recipe: a sentence-transformers folder whose encoder is bert-impl, loaded with the package
    (our class) and without it (trust_remote_code), with the stock model's embeddings."""
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(minilm_dir, device="cpu")
    expected = encoder.encode(SENTENCES, convert_to_tensor=True)
    encoder[0].model = bi.BertImplModel.from_pretrained(minilm_dir)
    encoder.save(str(tmp_path / "st-bert-impl"))
    assert json.loads((tmp_path / "st-bert-impl" / "config.json").read_text())["model_type"] == "bert_impl"

    ours = SentenceTransformer(str(tmp_path / "st-bert-impl"), device="cpu")
    assert type(ours[0].auto_model) is bi.BertImplModel
    assert max_diff(ours.encode(SENTENCES, convert_to_tensor=True), expected) < TOL
    got = run_without_package(f"""
        import json
        from sentence_transformers import SentenceTransformer
        model = SentenceTransformer({str(tmp_path / "st-bert-impl")!r}, device="cpu", trust_remote_code=True)
        print(json.dumps({{"module": type(model[0].auto_model).__module__,
                          "embeddings": model.encode({SENTENCES!r}).tolist()}}))
    """)
    assert got["module"].startswith("transformers_modules.")
    assert max_diff(got["embeddings"], expected) < TOL


def test_a_patch_of_a_stock_class_is_said_when_a_model_is_loaded_past_it(classifier_dir, patched, monkeypatch):
    """After apply_bert_impl() the Auto classes build bert-impl's classes, which a patch of transformers' own class
    does not reach: loading such a model says so once, naming stock's class and ours to patch instead (a wrapper made
    with functools.wraps is told too); with no patch, nothing is said."""
    import functools

    from transformers.models.bert import modeling_bert
    from transformers.testing_utils import CaptureLogger

    logger = transformers.logging.get_logger(bi.integrations.patching.__name__)
    logger.warning_once.cache_clear()
    with CaptureLogger(logger) as unpatched:
        AutoModelForSequenceClassification.from_pretrained(classifier_dir)
    original = modeling_bert.BertSelfOutput.forward
    monkeypatch.setattr(modeling_bert.BertSelfOutput, "forward", functools.wraps(original)(
        lambda self, *args: original(self, *args)))
    with CaptureLogger(logger) as said:
        model = AutoModelForSequenceClassification.from_pretrained(classifier_dir)
    assert isinstance(model, bi.BertImplForSequenceClassification)
    assert unpatched.out == ""
    assert "transformers' BertSelfOutput had its forward replaced" in said.out and "BertImplSelfOutput" in said.out
