"""BERT's descendants through bert-impl's encoder: RoBERTa, XLM-RoBERTa and CamemBERT, against transformers' own classes
of each family on the same weights, in this process. Random small configs with the checkpoints' conventions (padding
index 1, positions from padding_idx + 1, one token type, the LM decoder tied to the word embeddings); padded,
padding-free and packed batches; hooks inside the encoder; folders both ways, `apply_bert_impl()`, remote code,
sentence-transformers; the CPU inference engines; each family's tokenizer built here (no Hub)."""

import json

import pytest
import torch
import transformers
from tokenizers import ByteLevelBPETokenizer, SentencePieceUnigramTokenizer

import modeling_bert_impl as bi
from helpers import layouts_built, max_diff, needs_tracing

TOL = 1e-5
# family (transformers' model type) -> transformers' class prefix, its config, ours
FAMILIES = {
    "roberta": ("Roberta", transformers.RobertaConfig, bi.RobertaImplConfig),
    "xlm-roberta": ("XLMRoberta", transformers.XLMRobertaConfig, bi.XLMRobertaImplConfig),
    "camembert": ("Camembert", transformers.CamembertConfig, bi.CamembertImplConfig),
}
HEADS = ["Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
         "ForMultipleChoice"]
PAD = 1
# positions 2..65: 64 tokens at most, as roberta-base's 514 positions give 512
SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=66, type_vocab_size=1, pad_token_id=PAD, layer_norm_eps=1e-5,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
LENGTHS = [9, 6, 4]


def classes(family: str, head: str) -> tuple[type, type]:
    """transformers' class and ours for a family's head: (RobertaForMaskedLM, RobertaImplForMaskedLM)."""
    prefix = FAMILIES[family][0]
    return getattr(transformers, f"{prefix}{head}"), getattr(bi, f"{prefix}Impl{head}")


def stock_folder(family: str, head: str, folder, seed: int = 0, **config):
    """transformers' model of the family's head, random (seeded, its heads' weights away from zero), saved."""
    num_labels = 2 if head == "ForQuestionAnswering" else 3
    torch.manual_seed(seed)
    stock = classes(family, head)[0](FAMILIES[family][1](**{**SMALL, "num_labels": num_labels, **config})).eval()
    stock.save_pretrained(folder)
    return stock


def padded_batch(head: str, seed: int = 1, lengths=LENGTHS, left: bool = False) -> dict:
    """Rows of random ids padded with the padding id to the longest, right padded (or left padded: the same rows,
    their tokens moved to the end), with the labels of `head`; (B, 2, T) choices for multiple choice."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, SMALL["vocab_size"], (B, T), generator=g).masked_fill(mask == 0, PAD)
    if left:
        ids, mask = (torch.stack([row.roll(T - n) for row, n in zip(t, lengths)]) for t in (ids, mask))
    batch = {"input_ids": ids, "attention_mask": mask}
    if head == "ForMultipleChoice":
        batch = {k: torch.stack([v, v.roll(1, 0)], 1) for k, v in batch.items()}  # (B, 2, T)
        batch["labels"] = torch.tensor([0, 1, 1])
    elif head == "ForMaskedLM":
        batch["labels"] = torch.full((B, T), -100).index_put_((torch.arange(B), mask.argmax(-1) + 1),
                                                              torch.tensor([5, 7, 11]))
    elif head == "ForSequenceClassification":
        batch["labels"] = torch.tensor([0, 2, 1])
    elif head == "ForTokenClassification":
        batch["labels"] = torch.randint(0, 3, (B, T), generator=g).masked_fill(mask == 0, -100)
    elif head == "ForQuestionAnswering":
        batch["start_positions"], batch["end_positions"] = torch.tensor([1, 2, 0]), torch.tensor([3, 4, 2])
    return batch


def compared(out, mask: torch.Tensor) -> dict:
    """The outputs to compare, padding positions left out of the per-token ones (ours zeroes them, transformers'
    computes values no real token depends on; ours keeps a QA span off padding)."""
    found = {}
    for name in ("logits", "start_logits", "end_logits", "last_hidden_state", "pooler_output"):
        value = getattr(out, name, None)
        if value is not None:
            per_token = value.dim() >= 2 and value.shape[:mask.dim()] == mask.shape
            found[name] = value[mask.bool()] if per_token else value
    return found


def assert_same(got, expected, mask):
    got, expected = compared(got, mask), compared(expected, mask)
    assert got.keys() == expected.keys() and got
    for name, value in expected.items():
        assert max_diff(got[name], value) < TOL, name


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("family", FAMILIES)
def test_stock_checkpoints_load_with_stock_names_outputs_and_losses(family, head, tmp_path, skipping_always_pays):
    """Each head of each family: transformers' model saved, ours loading it with every weight, the same module and
    state-dict names, the same outputs on a padded batch padding-free and padded, the same loss (QA aside: ours keeps
    spans off padding), and ours saved loading back into transformers' class with the same tensors."""
    stock_class, our_class = classes(family, head)
    stock = stock_folder(family, head, tmp_path / "stock")
    ours, info = our_class.from_pretrained(tmp_path / "stock", output_loading_info=True)
    assert not any(info.values()), info
    assert type(ours) is our_class and ours.config.model_type == FAMILIES[family][2].model_type
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in stock.named_modules()]
    assert list(ours.state_dict()) == list(stock.state_dict())
    batch = padded_batch(head)
    labels = {k: batch.pop(k) for k in ("labels", "start_positions", "end_positions") if k in batch}
    mask = batch["attention_mask"]
    with torch.no_grad():
        expected = stock(**batch, **labels)
        with layouts_built(ours) as built:
            got = ours.eval()(**batch, **labels)
        ours.config.unpad_inputs = False
        padded = ours(**batch, **labels)
    assert built  # the padding-free layout ran
    assert_same(got, expected, mask)
    assert_same(padded, expected, mask)
    if head not in ("Model", "ForQuestionAnswering"):
        assert abs(got.loss.item() - expected.loss.item()) < TOL
    ours.save_pretrained(tmp_path / "ours")
    back, info = stock_class.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info.values()), info
    assert all(torch.equal(t, ours.state_dict()[n]) for n, t in back.state_dict().items())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_checkpoints_conventions(family, tmp_path):
    """Positions count from padding_idx + 1 over the ids that are not padding (so a left-padded row has its
    right-padded outputs), and from padding_idx + 1 for embeddings given directly; one token type (a type id of 1 is
    refused by name); the position table holds max_position_embeddings - padding_idx - 1 tokens (a longer batch is
    refused by name); the LM decoder's weight and bias are the word embeddings' and the head's bias."""
    stock = stock_folder(family, "ForMaskedLM", tmp_path)
    ours = classes(family, "ForMaskedLM")[1].from_pretrained(tmp_path).eval()
    right, left = padded_batch("Model"), padded_batch("Model", left=True)
    embeds = ours.roberta.embeddings.word_embeddings(right["input_ids"])
    with torch.no_grad():
        for batch in (right, left, {"inputs_embeds": embeds}):
            mask = batch.get("attention_mask", torch.ones(embeds.shape[:2]))
            assert max_diff(ours(**batch).logits[mask.bool()], stock(**batch).logits[mask.bool()]) < TOL
        assert max_diff(ours(**right).logits[right["attention_mask"].bool()],
                        ours(**left).logits[left["attention_mask"].bool()]) < TOL
    with pytest.raises(ValueError, match=r"token type id 1 is outside \[0, type_vocab_size=1\)"):
        ours(**right, token_type_ids=torch.ones_like(right["input_ids"]))
    with pytest.raises(ValueError, match="sequence length 65 is longer than the position table takes .*64 tokens"):
        ours(input_ids=torch.full((1, 65), 5))
    assert ours.lm_head.decoder.weight is ours.roberta.embeddings.word_embeddings.weight
    assert ours.lm_head.decoder.bias is ours.lm_head.bias


@pytest.mark.parametrize("marker", ["seq_idx", "cu_seq_lens_q"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_batch_equals_each_sequence_alone(family, marker, tmp_path):
    """Sequences packed in one row (marked by seq_idx or cu_seq_lens_q, no position ids) give each sequence's own
    outputs, positions restarting at padding_idx + 1 in each; the classification head reads each sequence's first
    token: (S, C) logits."""
    stock_folder(family, "ForSequenceClassification", tmp_path)
    model = classes(family, "ForSequenceClassification")[1].from_pretrained(tmp_path).eval()
    rows = [padded_batch("Model")["input_ids"][i, :n] for i, n in enumerate(LENGTHS)]
    lengths = torch.tensor(LENGTHS)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    markers = {"seq_idx": {"seq_idx": torch.repeat_interleave(torch.arange(3), lengths)[None]},
               "cu_seq_lens_q": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}}[marker]
    with torch.no_grad():
        packed = model(input_ids=torch.cat(rows)[None], **markers).logits
        alone = torch.cat([model(input_ids=row[None]).logits for row in rows])
    assert packed.shape == (3, 3) and max_diff(packed, alone) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_inside_the_encoder_see_stock_tensors(family, tmp_path):
    """A forward hook changing `roberta.encoder.layer[1].output` by position on a padded batch, default config: it sees
    transformers' (B, T, H) tensor, and the logits are transformers' with the same hook."""
    stock = stock_folder(family, "ForTokenClassification", tmp_path)
    ours = classes(family, "ForTokenClassification")[1].from_pretrained(tmp_path).eval()
    batch, seen, logits = padded_batch("Model"), {}, {}
    for name, model in (("stock", stock), ("ours", ours)):
        def shift(module, args, out, name=name):
            seen[name] = out.shape
            return out + torch.linspace(0, 1, out.shape[1])[:, None]
        model.roberta.encoder.layer[1].output.register_forward_hook(shift)
        with torch.no_grad():
            logits[name] = model(**batch).logits[batch["attention_mask"].bool()]
    assert seen["ours"] == seen["stock"] == (3, 9, 32)
    assert max_diff(logits["ours"], logits["stock"]) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_bert_impl_builds_ours_and_saves_stock_folders(family, tmp_path):
    """After apply_bert_impl(), transformers' Auto classes build ours for the family's stock checkpoints (same
    logits), whose folders stay stock folders; revert_bert_impl() gives transformers' classes back."""
    stock = stock_folder(family, "ForSequenceClassification", tmp_path / "stock")
    batch = padded_batch("Model")
    bi.apply_bert_impl()
    try:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "stock").eval()
        model.save_pretrained(tmp_path / "saved")
    finally:
        bi.revert_bert_impl()
    assert isinstance(model, classes(family, "ForSequenceClassification")[1])
    with torch.no_grad():
        assert max_diff(model(**batch).logits, stock(**batch).logits) < TOL
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == family
    assert config["architectures"] == [f"{FAMILIES[family][0]}ForSequenceClassification"]
    assert not list((tmp_path / "saved").glob("*.py"))
    reverted = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved")
    assert type(reverted) is classes(family, "ForSequenceClassification")[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_folders_load_as_remote_code(family, tmp_path):
    """Our folder carries the code files and an auto_map for each Auto class of the family; the folder's own copy of
    the code (what trust_remote_code loads) gives the same logits."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    stock_folder(family, "ForSequenceClassification", tmp_path / "stock")
    ours = classes(family, "ForSequenceClassification")[1].from_pretrained(tmp_path / "stock").eval()
    ours.save_pretrained(tmp_path / "ours")
    auto_map = json.loads((tmp_path / "ours" / "config.json").read_text())["auto_map"]
    assert set(auto_map) == {"AutoConfig", *(f"AutoModel{h[:0] if h == 'Model' else h}" for h in HEADS)}
    assert {"modeling_roberta_impl.py", "modeling_bert_impl.py", "layouts.py"} <= {
        p.name for p in (tmp_path / "ours").glob("*.py")}
    remote = get_class_from_dynamic_module(auto_map["AutoModelForSequenceClassification"], tmp_path / "ours")
    assert remote.__module__.startswith("transformers_modules.")
    batch = padded_batch("Model")
    with torch.no_grad():
        assert max_diff(remote.from_pretrained(tmp_path / "ours").eval()(**batch).logits, ours(**batch).logits) < TOL


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers of the families, sentence-transformers
# ---------------------------------------------------------------------------------------------------------------------
TEXTS = ["The quick brown fox jumps over the lazy dog.", "RoBERTa reads text in both directions at once.",
         "Short one.", "Le chat est sur la table, et le chien dort."]


def family_tokenizer(family: str):
    """A tokenizer of the family's own kind trained here on TEXTS: RoBERTa's byte-level BPE, XLM-RoBERTa's and
    CamemBERT's SentencePiece unigram; special tokens <s> 0, <pad> 1, </s> 2, <unk> 3, <mask> 4 as in their
    checkpoints."""
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    if family == "roberta":
        trainer = ByteLevelBPETokenizer()
        trainer.train_from_iterator(TEXTS * 10, vocab_size=SMALL["vocab_size"], min_frequency=1, special_tokens=special)
        model = json.loads(trainer._tokenizer.to_str())["model"]
        return transformers.RobertaTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    trainer = SentencePieceUnigramTokenizer()
    trainer.train_from_iterator(TEXTS * 10, vocab_size=SMALL["vocab_size"], special_tokens=special, unk_token="<unk>")
    vocab = [tuple(piece) for piece in json.loads(trainer._tokenizer.to_str())["model"]["vocab"]]
    return getattr(transformers, f"{FAMILIES[family][0]}Tokenizer")(vocab=vocab)


@pytest.mark.parametrize("family", FAMILIES)
def test_sentence_transformers_encodes_as_stock_after_apply_bert_impl(family, tmp_path):
    """A sentence-transformers folder of the family (its tokenizer trained here, mean pooling): with
    apply_bert_impl() its encoder is ours, and the embeddings are stock's within 1e-5."""
    from sentence_transformers import SentenceTransformer, models

    tokenizer = family_tokenizer(family)
    assert tokenizer.pad_token_id == PAD and tokenizer.cls_token_id == 0
    stock_folder(family, "Model", tmp_path / "encoder", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "encoder")
    encoder = models.Transformer(str(tmp_path / "encoder"))
    SentenceTransformer(modules=[encoder, models.Pooling(32, "mean")]).save(str(tmp_path / "st"))
    expected = SentenceTransformer(str(tmp_path / "st")).encode(TEXTS, convert_to_tensor=True)
    bi.apply_bert_impl()
    try:
        model = SentenceTransformer(str(tmp_path / "st"))
    finally:
        bi.revert_bert_impl()
    assert isinstance(model[0].auto_model, classes(family, "Model")[1])
    assert max_diff(model.encode(TEXTS, convert_to_tensor=True), expected) < TOL


# ---------------------------------------------------------------------------------------------------------------------
# The CPU inference engines
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_optimize_and_quantize_for_inference_take_the_families(family, tmp_path):
    """optimize_for_inference gives the model's outputs within 1e-5 on a padded batch and one sentence (its fused
    layers ran), quantize_for_inference within int8's bound (per-token cosine to float32 at least 0.99)."""
    stock_folder(family, "ForTokenClassification", tmp_path)
    model = classes(family, "ForTokenClassification")[1].from_pretrained(tmp_path).eval()
    batch = padded_batch("Model")
    optimized = bi.optimize_for_inference(model)
    int8 = bi.quantize_for_inference(model, [batch])
    assert type(optimized.roberta.encoder).__name__ == "FusedEncoder"
    with torch.no_grad():
        for inputs in (batch, {"input_ids": batch["input_ids"][:1]}):
            mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
            expected = model(**inputs, output_hidden_states=True)
            assert max_diff(optimized(**inputs).logits, expected.logits) < TOL
            hidden = int8(**inputs, output_hidden_states=True).hidden_states[-1][mask]
            cosine = torch.nn.functional.cosine_similarity(hidden, expected.hidden_states[-1][mask], dim=-1)
            assert cosine.min() > 0.99


@pytest.mark.slow
@needs_tracing
@pytest.mark.parametrize("family", ["xlm-roberta"])
def test_compile_for_inference_takes_the_families(family, tmp_path):
    """compile_for_inference of a family's classifier: its program takes one sentence and a batch without padding,
    with RoBERTa's positions counted over the ids (given to the program as the model gives them) and the
    classification head on each sequence's first token, within 1e-5 of the model; a padded batch takes the eager
    path with the same answer."""
    stock_folder(family, "ForSequenceClassification", tmp_path / "stock")
    model = classes(family, "ForSequenceClassification")[1].from_pretrained(tmp_path / "stock").eval()
    compiled = bi.compile_for_inference(model, tmp_path / "model.pt2")
    runs = []
    run = compiled.roberta.compiled_encoder.run
    compiled.roberta.compiled_encoder.run = lambda args: runs.append(1) or run(args)
    batch = padded_batch("Model")
    with torch.no_grad():
        for inputs in ({"input_ids": batch["input_ids"][:1]}, {"input_ids": batch["input_ids"][:, :4]}, batch):
            assert max_diff(compiled(**inputs).logits, model(**inputs).logits) < TOL
    assert len(runs) == 2


@pytest.mark.slow
@needs_tracing
def test_the_export_command_takes_the_families(tmp_path):
    """bert-impl-export on a stock XLM-RoBERTa classifier folder exports the family's class (its positions from the
    ids included) within its tolerance of PyTorch, writing a stock XLM-RoBERTa config."""
    from modeling_bert_impl.integrations import export

    stock_folder("xlm-roberta", "ForSequenceClassification", tmp_path / "stock")
    diff = export.export(str(tmp_path / "stock"), str(tmp_path / "onnx"))
    assert diff < 1e-4
    exported = json.loads((tmp_path / "onnx" / "export.json").read_text())
    assert exported["class"] == "XLMRobertaImplForSequenceClassification" and exported["task"] == "text-classification"
    assert json.loads((tmp_path / "onnx" / "config.json").read_text())["model_type"] == "xlm-roberta"
    assert sorted(path.name for path in (tmp_path / "onnx").iterdir()) == ["config.json", "export.json", "model.onnx"]


def test_the_export_command_makes_up_no_tokenizer(tmp_path):
    """A folder without tokenizer files has no tokenizer to export (transformers would build a placeholder for
    XLM-RoBERTa: a Unigram vocabulary of 5 entries); a folder with a tokenizer's files has it."""
    from modeling_bert_impl.integrations import export

    stock_folder("xlm-roberta", "ForSequenceClassification", tmp_path / "stock")
    assert export.load_tokenizer(str(tmp_path / "stock")) is None
    transformers.BertModel(transformers.BertConfig(**SMALL)).save_pretrained(tmp_path / "bert")
    (tmp_path / "bert" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "dog"]))
    tokenizer = export.load_tokenizer(str(tmp_path / "bert"))
    assert tokenizer("the dog")["input_ids"] == [2, 5, 6, 3]


def test_the_model_card_names_the_familys_head(tmp_path):
    """The model card of an XLM-RoBERTa classifier names the family and its head."""
    from modeling_bert_impl.integrations import model_card

    stock_folder("xlm-roberta", "ForSequenceClassification", tmp_path / "stock")
    model = bi.XLMRobertaImplForSequenceClassification.from_pretrained(tmp_path / "stock")
    card = str(model_card.model_card(model, "org/xlmr"))
    assert "An XLM-RoBERTa encoder with the `XLMRobertaImplForSequenceClassification` head" in card
