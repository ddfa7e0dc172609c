"""modeling_bert_impl/dropout.py: dropout's mask drawn from random bits on CPU, against its definition (keep rate,
expectation, independence), and the padding-free attention's dropout against SDPA's arithmetic."""

import math

import pytest
import torch
import torch.nn.functional as F

from modeling_bert_impl import bert_padding, layouts
from modeling_bert_impl.dropout import BITS, BertImplDropout, dropout, keep_mask

N = 1 << 22  # elements: the keep rate's standard error is below 2.5e-4


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1e-5])
def test_keep_rate_is_one_minus_p_rounded_to_2_to_the_minus_15_in_every_part_of_a_draw(p):
    """Each of the four 16-bit parts of a 64-bit draw (element i reads part i mod 4; the last has one bit fewer than
    16 random ones) keeps at the same rate, that of p rounded to a multiple of 2^-15, within 5 standard errors."""
    torch.manual_seed(0)
    kept = keep_mask((N // 4, 4), p, "cpu").double().mean(0)  # (4,): the rate of each part
    rate = 1 - round(p * 2**BITS) / 2**BITS
    error = 5 * math.sqrt(rate * (1 - rate) / (N // 4)) + 1e-12
    assert ((kept - rate).abs() < error).all(), (kept, rate)


def test_dropout_keeps_the_expectation_and_scales_what_it_keeps():
    torch.manual_seed(0)
    x = torch.full((N,), 3.0)
    y = dropout(x, 0.1)
    kept = y != 0
    assert torch.allclose(y[kept], torch.tensor(3.0 * 2**BITS / (2**BITS - round(0.1 * 2**BITS))))
    assert abs(y.mean().item() - 3.0) < 5 * 3.0 * math.sqrt(0.1 / 0.9 / N)


def test_masks_follow_the_seed_and_differ_between_calls():
    x = torch.randn(64, 96)
    torch.manual_seed(7)
    a, b = dropout(x, 0.3), dropout(x, 0.3)
    torch.manual_seed(7)
    assert torch.equal(dropout(x, 0.3), a) and not torch.equal(a, b)


def test_module_is_nn_dropout_and_steps_aside_where_nothing_is_dropped():
    module = BertImplDropout(0.1)
    x = torch.randn(8, 16, requires_grad=True)
    assert isinstance(module, torch.nn.Dropout) and module.eval()(x) is x
    assert dropout(x, 0.0) is x and dropout(x, 0.1, training=False) is x
    assert torch.equal(dropout(x, 1.0), F.dropout(x, 1.0))  # p = 1: F.dropout's zeros
    for p in (1 - 1e-6, 1e-6):  # round to 1 and to 0: F.dropout itself (no division by zero, nothing left undropped)
        torch.manual_seed(3)
        ours = dropout(x, p)
        torch.manual_seed(3)
        assert torch.equal(ours, F.dropout(x, p))
    y = module.train()(x)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() * y.detach().div(x.detach()).nan_to_num())  # the same mask and scale


def test_padding_free_attention_dropout_averages_to_the_attention_without_it():
    """The bucketed layout's attention in training (softmax(q k^T) v with dropout.py's mask on the weights): its mean
    over 400 seeds is the attention without dropout (SDPA) within 4 standard errors, and each call differs from it."""
    torch.manual_seed(0)
    lengths = [5, 3, 7]
    mask = torch.zeros(3, 7, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    layout = layouts.BucketedLayout.of_tokens(*bert_padding.unpad_indices(mask, sum(lengths)), (3, 7), torch.float32)
    P = layout.enter(torch.zeros(3, 7, 1)).shape[0]
    q, k, v = (torch.randn(P, 2, 4) for _ in range(3))  # (P, N, D)
    exact = layout.kernel(q, k, v, None, 0.5, 0.0)
    runs = torch.stack([layout.kernel(q, k, v, None, 0.5, 0.2) for _ in range(400)])  # (400, P, N, D)
    assert (runs[0] - exact).abs().max() > 1e-3
    error = 4 * runs.std(0) / math.sqrt(len(runs)) + 1e-6
    assert ((runs.mean(0) - exact).abs() < error).float().mean() > 0.99
