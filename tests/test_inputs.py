"""The model's own inputs: values a collator or a user can get wrong are refused with a ValueError that names the
argument, the value and what is expected, by every class (the encoder and its seven heads), on every path (unpadded and
padded), and checked in one host read."""

import pytest
import torch

import modeling_bert_impl as bi
from modeling_bert_impl import BertImplConfig

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
    with pytest.raises(TypeError, match="cu_seq_lens_q"):
        build(bi.BertImplForMultipleChoice, True)(ids(1), cu_seq_lens_q=cu)


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
