"""The model's own inputs: values a collator or a user can get wrong are refused with a ValueError that names the
argument, the value and what is expected, by every class (the encoder and its seven heads), on every path (unpadded and
padded), and checked in one host read. Each head's labels too, in the same read."""

import pytest
import torch

import modeling_bert_impl as bi
from modeling_bert_impl import BertImplConfig
from helpers import needs_tracing

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)


CLASSES = list(bi.AUTO_CLASSES.values())  # the encoder and its seven heads
PACKING = [c for c in CLASSES if c is not bi.BertImplForMultipleChoice]  # multiple choice takes no packed batches


def build(cls, unpad):
    torch.manual_seed(0)
    model = cls(BertImplConfig(**TINY, unpad_inputs=unpad)).eval()
    if cls is bi.BertImplForMultipleChoice:  # (B, T) inputs as B examples of one choice: (B, 1, T)
        forward = model.forward
        choices = lambda t: t.unsqueeze(1) if torch.is_tensor(t) and t.dim() == 2 else t  # noqa: E731
        model.forward = lambda *a, **k: forward(*map(choices, a), **{n: choices(v) for n, v in k.items()})
    return model


@pytest.fixture(scope="module", params=[(c, u) for c in CLASSES for u in (True, False)],
                ids=[f"{c.__name__[8:] or 'Model'}-{'unpadded' if u else 'padded'}" for c in CLASSES for u in (1, 0)])
def model(request):
    return build(*request.param)


@pytest.fixture(scope="module", params=[(c, u) for c in PACKING for u in (True, False)],
                ids=[f"{c.__name__[8:] or 'Model'}-{'unpadded' if u else 'padded'}" for c in PACKING for u in (1, 0)])
def packing_model(request):
    return build(*request.param)


def ids(B=2, T=8):
    return torch.randint(1, 99, (B, T), generator=torch.Generator().manual_seed(0))


def mask_with(value):
    mask = torch.ones(2, 8)
    mask[1, 5] = value
    return mask


@pytest.mark.parametrize("value,shown", [(2, "2"), (-1, "-1"), (0.5, "0.5"), (float("nan"), "nan")])
def test_attention_mask_values_other_than_0_and_1(model, value, shown):
    with pytest.raises(ValueError, match=rf"attention_mask holds {shown}; expected 0 \(padding\) or 1 \(token\)"):
        model(ids(), attention_mask=mask_with(value))


def test_attention_mask_of_bools_and_floats_is_accepted(model):
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        expected = model(ids(), attention_mask=mask)[0]
        for other in (mask.bool(), mask.float()):
            assert torch.equal(model(ids(), attention_mask=other)[0], expected)


@pytest.mark.parametrize("cu,match", [
    ([0, 5, 3, 8], r"cu_seq_lens_q must increase strictly .* a step of -2 found"),
    ([0, 3, 3, 8], r"cu_seq_lens_q must increase strictly \(cumulative lengths of non-empty sequences\); a step of "
                   "0 found"),  # an empty packed sequence
    ([0, 0, 8], "cu_seq_lens_q must increase strictly .* a step of 0 found"),
    ([1, 3, 8], "cu_seq_lens_q starts at 1; expected 0"),
    ([0, 3, 7], "cu_seq_lens_q ends at 7; expected the packed length 8"),
    ([0, 3, 9], "cu_seq_lens_q ends at 9; expected the packed length 8"),  # one past the sequence
    ([0, 9, 8], "cu_seq_lens_q must increase strictly"),
])
def test_bad_cu_seq_lens_q(packing_model, cu, match):
    cu = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        packing_model(ids(1), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8, max_length_k=8)


def test_good_cu_seq_lens_q_is_accepted(packing_model):
    cu = torch.tensor([0, 1, 3, 8], dtype=torch.int32)  # a one-token sequence is not empty
    with torch.no_grad():
        packing_model(ids(1), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)


def test_multiple_choice_takes_no_packed_batch():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"not a packed batch \(cu_seq_lens_q\)"):
        build(bi.BertImplForMultipleChoice, True)(ids(1)[:, None], cu_seq_lens_q=cu)


def test_cu_seq_lens_k_must_equal_q(packing_model):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_k must equal cu_seq_lens_q; 1 entries differ"):
        packing_model(ids(1), cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must be \(num_sequences \+ 1,\)"):
        packing_model(ids(1), cu_seq_lens_q=torch.tensor([[0, 8]]))


def test_empty_batch(model):
    with pytest.raises(ValueError, match="empty batch: the batch size is 0"):
        model(torch.zeros(0, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="empty batch"):
        model(torch.zeros(0, 8, dtype=torch.long), attention_mask=torch.zeros(0, 8, dtype=torch.long))


def test_every_value_check_in_one_host_read(model, monkeypatch):
    """One `.tolist()` per forward and no `.item()` or `bool(tensor)`, whatever is checked (on CUDA each is a sync)."""
    reads = []
    for name in ("tolist", "item", "__bool__"):
        original = getattr(torch.Tensor, name)
        counted = lambda self, *a, _n=name, _o=original, **k: reads.append(_n) or _o(self, *a, **k)  # noqa: E731
        monkeypatch.setattr(torch.Tensor, name, counted)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        model(ids(), attention_mask=mask, token_type_ids=torch.zeros(2, 8, dtype=torch.long),
              position_ids=torch.arange(8)[None])
    monkeypatch.undo()
    host_reads = [r for r in reads if r != "tolist"]
    assert reads.count("tolist") == (2 if model.config.unpad_inputs else 1)  # + the bucketed layout's lengths (CPU)
    assert not host_reads, host_reads


# ---------------------------------------------------------------------------------------------------------------------
# Labels: each head's are checked in the encoder's one host read (B = 2, T = 8; num_labels 3, 4 choices)
# ---------------------------------------------------------------------------------------------------------------------
def head(cls, **config):
    torch.manual_seed(0)
    num_labels = 2 if cls is bi.BertImplForQuestionAnswering else 3
    return cls(BertImplConfig(**{**TINY, "num_labels": num_labels, **config})).eval()


def inputs(cls):
    """(B, T) ids, or (B, 4, T) for multiple choice."""
    return ids().unsqueeze(1).expand(-1, 4, -1) if cls is bi.BertImplForMultipleChoice else ids()


def tokens_with(value, dtype=torch.long):
    """(2, 8) token labels, -100 but at two positions: a good label and `value`."""
    labels = torch.full((2, 8), -100, dtype=dtype)
    labels[0, 2], labels[1, 6] = 1, value
    return labels


GOOD_LABELS = {
    bi.BertImplForPreTraining: lambda: dict(labels=tokens_with(5), next_sentence_label=torch.tensor([0, 1])),
    bi.BertImplForMaskedLM: lambda: dict(labels=tokens_with(98)),
    bi.BertImplForNextSentencePrediction: lambda: dict(labels=torch.tensor([1, -100])),
    bi.BertImplForSequenceClassification: lambda: dict(labels=torch.tensor([2, 0])),
    bi.BertImplForTokenClassification: lambda: dict(labels=tokens_with(2)),
    bi.BertImplForQuestionAnswering: lambda: dict(start_positions=torch.tensor([1, 30]),  # outside: clamped, ignored
                                                  end_positions=torch.tensor([3, -4])),
    bi.BertImplForMultipleChoice: lambda: dict(labels=torch.tensor([3, 0])),
}

# (class, labels, config, the message expected)
BAD_LABELS = [
    (bi.BertImplForSequenceClassification, dict(labels=torch.tensor([0, 3])), {},
     r"labels holds 3; expected class ids in \[0, num_labels=3\) or -100 \(ignored\)"),
    (bi.BertImplForSequenceClassification, dict(labels=torch.tensor([-1, 0])), {},
     r"labels holds -1; expected class ids in \[0, num_labels=3\) or -100"),
    (bi.BertImplForSequenceClassification, dict(labels=torch.tensor([0.0, 2.0])),
     dict(problem_type="single_label_classification"),
     r"labels must hold integer class ids, got dtype torch.float32 \(single-label classification; float labels are "
     r"for regression, num_labels=1, or multi-label classification, problem_type='multi_label_classification'\)"),
    (bi.BertImplForTokenClassification, dict(labels=tokens_with(5)), {},
     r"labels holds 5; expected class ids in \[0, num_labels=3\) or -100 \(ignored\)"),
    (bi.BertImplForTokenClassification, dict(labels=tokens_with(1, torch.float)), {},
     "labels must hold integer class ids, got dtype torch.float32"),
    (bi.BertImplForMaskedLM, dict(labels=tokens_with(99)), {},
     r"labels holds 99; expected token ids in \[0, vocab_size=99\) or -100 \(ignored\)"),
    (bi.BertImplForMaskedLM, dict(labels=tokens_with(120)), dict(sparse_prediction=True),  # decoder on masked rows
     r"labels holds 120; expected token ids in \[0, vocab_size=99\)"),
    (bi.BertImplForMaskedLM, dict(labels=tokens_with(1, torch.float)), {},
     "labels must hold integer token ids, got dtype torch.float32"),
    (bi.BertImplForPreTraining, dict(labels=tokens_with(1), next_sentence_label=torch.tensor([0, 2])), {},
     r"next_sentence_label holds 2; expected class ids in \[0, 2\) or -100 \(ignored\)"),
    (bi.BertImplForPreTraining, dict(labels=tokens_with(-5), next_sentence_label=torch.tensor([0, 1])), {},
     r"labels holds -5; expected token ids in \[0, vocab_size=99\)"),
    (bi.BertImplForNextSentencePrediction, dict(labels=torch.tensor([2, 0])), {},
     r"labels holds 2; expected class ids in \[0, 2\) or -100 \(ignored\)"),
    (bi.BertImplForNextSentencePrediction, dict(labels=torch.tensor([1.0, 0.0])), {},
     "labels must hold integer class ids, got dtype torch.float32"),
    (bi.BertImplForMultipleChoice, dict(labels=torch.tensor([4, 0])), {},
     r"labels holds 4; expected choice indices in \[0, num_choices=4\) or -100 \(ignored\)"),
    (bi.BertImplForMultipleChoice, dict(labels=torch.tensor([1.0, 0.0])), {},
     "labels must hold integer choice indices, got dtype torch.float32"),
    (bi.BertImplForQuestionAnswering, dict(start_positions=torch.tensor([1.0, 2.0]), end_positions=torch.tensor([3, 4])),
     {}, "start_positions must hold integer token indices, got dtype torch.float32"),
    (bi.BertImplForQuestionAnswering, dict(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3.0, 4.0])),
     {}, "end_positions must hold integer token indices, got dtype torch.float32"),
]


@pytest.mark.parametrize("cls,labels,config,match", BAD_LABELS,
                         ids=[f"{c.__name__[11:]}-{i}" for i, (c, *_) in enumerate(BAD_LABELS)])
@pytest.mark.parametrize("unpad", [True, False], ids=["unpadded", "padded"])
def test_bad_labels_are_named(cls, labels, config, match, unpad):
    model = head(cls, unpad_inputs=unpad, **config)
    with pytest.raises(ValueError, match=match), torch.no_grad():
        model(inputs(cls), **labels)


@pytest.mark.parametrize("cls", list(GOOD_LABELS), ids=lambda c: c.__name__[11:])
def test_good_labels_give_a_finite_loss(cls):
    with torch.no_grad():
        assert torch.isfinite(head(cls)(inputs(cls), **GOOD_LABELS[cls]()).loss)


@pytest.mark.parametrize("problem_type,labels", [
    ("regression", torch.tensor([0.5, -2.0])),  # num_labels = 1, inferred
    ("regression", torch.tensor([1, 0])),  # num_labels = 1: integer scores are regression targets too
    ("multi_label_classification", torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])),  # inferred from the floats
    ("single_label_classification", torch.tensor([2, 0], dtype=torch.int32)),
])
def test_sequence_classification_takes_every_problem_type(problem_type, labels):
    model = head(bi.BertImplForSequenceClassification, num_labels=1 if problem_type == "regression" else 3)
    with torch.no_grad():
        assert torch.isfinite(model(ids(), labels=labels).loss)
    assert model.config.problem_type == problem_type  # inferred and recorded, as transformers does


def test_question_answering_head_needs_two_labels():
    with pytest.raises(ValueError, match="a question-answering head has num_labels=2 .*, got num_labels=3"):
        bi.BertImplForQuestionAnswering(BertImplConfig(**TINY, num_labels=3))


@pytest.mark.parametrize("cls", list(GOOD_LABELS), ids=lambda c: c.__name__[11:])
def test_labels_read_in_the_encoders_one_host_read(cls, monkeypatch):
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.numel()) or original(self))
    model = head(cls, unpad_inputs=False)
    with torch.no_grad():
        model(inputs(cls), **GOOD_LABELS[cls]())
    monkeypatch.undo()
    assert len(reads) == 1


@needs_tracing
def test_compiled_head_refuses_bad_labels_with_a_traced_assert():
    model = head(bi.BertImplForTokenClassification)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.isfinite(compiled(ids(), labels=tokens_with(2)).loss)
        with pytest.raises(RuntimeError, match="out of range"):
            compiled(ids(), labels=tokens_with(3))
