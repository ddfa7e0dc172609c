"""Padding-free attention through torch's own flash kernel (`aten::_flash_attention_forward`), which runs on CUDA only,
checked on the CPU by a stand-in registered for the op here: the op's math in float64, its dropout drawn from torch's
generator and replayed by the backward from the state the forward returns, as the CUDA kernel's philox state is. So
the arguments the encoder passes, the shapes, the dropout semantics and the backward's plumbing run in CI, eager and
under torch.compile; a CUDA machine runs the real kernel (tests/test_gpu.py, benchmarks/gpu_check.py)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel

import modeling_bert_impl.bert_padding as bp
from helpers import TINY, attention_per_sequence, mixed_batch, needs_tracing
from modeling_bert_impl import BertImplConfig, BertImplModel, layouts

LENGTHS = [9, 3, 14, 6, 1]
EXACT = 1e-10  # float64 throughout: the stand-in and SDPA's math differ in summation order only


# ---------------------------------------------------------------------------------------------------------------------
# The stand-in: the op's math (forward and backward) in float64, per sequence
# ---------------------------------------------------------------------------------------------------------------------
CALLS: list[dict] = []  # each forward's and backward's arguments, for the tests to read


def sequences(q, k, v, cu_seqlens, scale: float, dropout_p: float, seed: int):
    """Per sequence: its rows a:b, q, k, v (N, L, D) in float64, the probabilities (N, L, L) and the dropout's keep
    mask scaled by 1 / (1 - p), drawn in order from a generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qs, ks, vs = (t[a:b].double().transpose(0, 1) for t in (q, k, v))  # (N, L, D)
        scores = qs @ ks.transpose(-1, -2) * scale  # (N, L, L)
        keep = (torch.rand(scores.shape, generator=generator, dtype=torch.float64) >= dropout_p) / (1 - dropout_p)
        yield a, b, qs, ks, vs, scores, torch.softmax(scores, -1), keep


def flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None, **_):
    """-> output (nnz, N, D), logsumexp (N, nnz), rng state (the seed), unused, debug mask, as the op returns them."""
    seed = int(torch.randint(0, 2**31, ()))  # from torch's generator: torch.manual_seed replays it
    CALLS.append(dict(op="forward", shape=tuple(q.shape), dtype=q.dtype, cu_q=cu_q.clone(), cu_k=cu_k.clone(),
                      max_q=max_q, max_k=max_k, dropout_p=dropout_p, is_causal=is_causal, scale=scale, seed=seed,
                      contiguous=all(t.stride(-1) == 1 for t in (q, k, v))))
    out, lse = torch.zeros(q.shape, dtype=torch.float64), torch.zeros(q.shape[1], q.shape[0])
    for a, b, _, _, vs, scores, p, keep in sequences(q, k, v, cu_q, scale, dropout_p, seed):
        out[a:b] = ((p * keep) @ vs).transpose(0, 1)
        lse[:, a:b] = torch.logsumexp(scores, -1)
    rng_state = torch.tensor([seed, 0], dtype=torch.uint64)
    return out.to(q.dtype), lse, rng_state, torch.empty((), dtype=torch.uint64), q.new_empty(0)


def flash_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
                   scale=None, **_):
    """The attention's gradient by hand (the kernel runs below autograd), with the forward's dropout mask."""
    seed = int(rng_state[0].item())
    CALLS.append(dict(op="backward", seed=seed, dropout_p=dropout_p, scale=scale))
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    for a, b, qs, ks, vs, _, p, keep in sequences(q, k, v, cu_q, scale, dropout_p, seed):
        do = grad[a:b].double().transpose(0, 1)  # (N, L, D)
        dv[a:b] = ((p * keep).transpose(-1, -2) @ do).transpose(0, 1)
        dp = (do @ vs.transpose(-1, -2)) * keep
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale  # softmax's backward
        dq[a:b], dk[a:b] = (ds @ ks).transpose(0, 1), (ds.transpose(-1, -2) @ qs).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture(scope="module")
def stand_in():
    library = torch.library.Library("aten", "IMPL")
    library.impl("_flash_attention_forward", flash_forward, "CPU")
    library.impl("_flash_attention_backward", flash_backward, "CPU")
    yield CALLS
    library._destroy()


@pytest.fixture
def flash_on_cpu(stand_in, monkeypatch, skipping_always_pays):
    """The exact layout with torch's flash kernel taken on the CPU (the stand-in's): what a CUDA GPU runs."""
    monkeypatch.setattr(bp, "torch_flash_takes", lambda device, dtype, head_dim: True)
    monkeypatch.setattr(layouts, "bucketed", lambda x: False)
    stand_in.clear()
    return stand_in


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_the_stand_in_is_the_ops_math(stand_in, dropout_p):
    """The stand-in itself against autograd on the same formula: output, logsumexp, and q, k, v's gradients with the
    forward's own dropout mask (so the backward replays it)."""
    lengths = [5, 1, 9]
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).int()
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    stand_in.clear()
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 9, 9, dropout_p, False, False, scale=0.3)
    seed = stand_in[-1]["seed"]
    keeps = [keep for *_, keep in sequences(q, k, v, cu, 0.3, dropout_p, seed)]
    expected = attention_per_sequence(q, k, v, lengths, 0.3, keeps)
    assert (out - expected).abs().max() < EXACT
    scores = [qs.transpose(0, 1) @ ks.permute(1, 2, 0) * 0.3 for qs, ks in zip(q.split(lengths), k.split(lengths))]
    assert lse.shape == (2, sum(lengths)) and lse.dtype == torch.float32  # as the op returns it
    assert (lse - torch.cat([s.logsumexp(-1) for s in scores], -1)).abs().max() < 1e-6
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        assert (got - want).abs().max() < EXACT
    assert stand_in[-1] == dict(op="backward", seed=seed, dropout_p=dropout_p, scale=0.3)
    if dropout_p:
        dropped = torch.cat([(keep == 0).flatten() for keep in keeps]).double().mean()
        assert 0.15 < dropped < 0.35  # the rate drawn, of about 200 probabilities


def test_the_kernel_is_chosen_by_capability():
    """On this CPU torch's flash kernel is refused, saying why; where it takes the rows, varlen_kernel returns it."""
    cpu = torch.device("cpu")
    assert bp.torch_flash_refusal(cpu, torch.bfloat16, 64) == "torch's flash kernel runs on CUDA only, not cpu"
    assert not bp.torch_flash_takes(cpu, torch.bfloat16, 64)
    assert bp.varlen_kernel(torch.randn(4, 2, 8, dtype=torch.bfloat16)) is bp.repadded_attention
    if torch.cuda.is_available():
        gpu = torch.device("cuda", torch.cuda.current_device())
        assert "float16 and bfloat16" in bp.torch_flash_refusal(gpu, torch.float32, 64)
        q = torch.randn(4, 2, 64, dtype=torch.bfloat16, device=gpu)
        want = (bp.flash_varlen_attention if bp.flash_attn_varlen_func is not None else
                bp.torch_flash_attention if bp.torch_flash_takes(gpu, torch.bfloat16, 64) else bp.repadded_attention)
        assert bp.varlen_kernel(q) is want


def tiny_pair(**overrides) -> tuple[BertImplModel, BertModel]:
    """A float64 bert-impl model and transformers' BertModel (sdpa) with the same weights."""
    torch.manual_seed(0)
    model = BertImplModel(BertImplConfig(**{**TINY, **overrides})).double()
    stock = BertModel(BertConfig(**{**TINY, **overrides}, attn_implementation="sdpa")).double()
    stock.load_state_dict(model.state_dict())
    return model, stock


def test_a_padded_batch_attends_through_torch_flash_as_stock(flash_on_cpu):
    """Inference on a padded batch (a row left-padded): the op gets the real tokens' (nnz, N, D) rows, contiguous, the
    sequences' int32 boundaries, their longest length, 1/sqrt(D) and no dropout, once per layer; the last hidden
    state equals transformers' BertModel on the same weights."""
    model, stock = tiny_pair()
    batch = mixed_batch(99, LENGTHS, left={1})
    with torch.no_grad():
        got, want = model(**batch).last_hidden_state, stock(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert (got - want)[real].abs().max() < EXACT
    cu = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).int()
    assert len(flash_on_cpu) == TINY["num_hidden_layers"]
    for call in flash_on_cpu:
        assert call["shape"] == (sum(LENGTHS), 4, 8) and call["dtype"] == torch.float64 and call["contiguous"]
        assert torch.equal(call["cu_q"], cu) and torch.equal(call["cu_k"], cu) and call["cu_q"].dtype == torch.int32
        assert call["max_q"] == call["max_k"] == max(LENGTHS)
        assert call["dropout_p"] == 0.0 and call["is_causal"] is False and call["scale"] == pytest.approx(8 ** -0.5)


def test_a_packed_batch_attends_through_torch_flash_as_stock(flash_on_cpu):
    """Sequences packed into one row by position ids restarting at 0 (DataCollatorWithFlattening's form): each attends
    to itself, as stock does on the padded batch."""
    model, stock = tiny_pair()
    batch = mixed_batch(99, LENGTHS)
    real = batch["attention_mask"].bool()
    packed = {"input_ids": batch["input_ids"][real][None],
              "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None]}
    with torch.no_grad():
        got, want = model(**packed).last_hidden_state[0], stock(**batch).last_hidden_state[real]
    assert (got - want).abs().max() < EXACT
    assert all(torch.equal(c["cu_q"], F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).int()) for c in flash_on_cpu)


def training_step(model, batch, seed: int):
    """A weighted sum of the last hidden state at real tokens and the pooler's output, backward: (loss, every
    parameter's grad)."""
    model.zero_grad()
    torch.manual_seed(seed)
    out = model(**batch)
    weights = torch.linspace(-1, 1, out.last_hidden_state.numel(), dtype=torch.float64).view_as(out.last_hidden_state)
    loss = (out.last_hidden_state * weights * batch["attention_mask"][..., None]).sum() + out.pooler_output.sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_a_training_step_through_torch_flash_has_stocks_gradients(flash_on_cpu):
    """Without dropout: the loss and every parameter's gradient equal stock's; the backward ran once per layer."""
    model, stock = tiny_pair()
    batch = mixed_batch(99, LENGTHS)  # stock's pooler reads position 0 of a left-padded row, ours its [CLS]
    (loss, grads), (want_loss, want_grads) = training_step(model, batch, 0), training_step(stock, batch, 0)
    assert (loss - want_loss).abs() < EXACT
    assert max((a - b).abs().max().item() for a, b in zip(grads, want_grads)) < EXACT
    assert [c["op"] for c in flash_on_cpu].count("backward") == TINY["num_hidden_layers"]


def test_attention_dropout_is_the_ops_own_and_replays(flash_on_cpu):
    """In training the op takes the attention dropout (and none in eval); its mask comes from torch's generator, so
    the same seed replays a step exactly and another seed changes it; the backward gets the forward's state."""
    model, _ = tiny_pair(attention_probs_dropout_prob=0.2)
    batch = mixed_batch(99, LENGTHS, left={1})
    model.train()
    first = training_step(model, batch, 3)
    forwards = [c for c in flash_on_cpu if c["op"] == "forward"]
    backwards = [c for c in flash_on_cpu if c["op"] == "backward"]
    assert {c["dropout_p"] for c in forwards} == {0.2}
    assert [c["seed"] for c in backwards] == [c["seed"] for c in forwards][::-1]  # last layer's backward first
    again, other = training_step(model, batch, 3), training_step(model, batch, 4)
    assert torch.equal(first[0], again[0]) and all(torch.equal(a, b) for a, b in zip(first[1], again[1]))
    assert first[0] != other[0]
    model.eval()
    flash_on_cpu.clear()
    with torch.no_grad():
        model(**batch)
    assert {c["dropout_p"] for c in flash_on_cpu} == {0.0}


@needs_tracing
def test_a_compiled_training_step_takes_torch_flash(flash_on_cpu):
    """torch.compile(fullgraph=True): the training step's graph calls the op forward and backward (through its
    registered backward), with the dropout drawn as in eager, so loss and gradients equal eager's on the same seed."""
    model, _ = tiny_pair(attention_probs_dropout_prob=0.2)
    model.train()
    batch = mixed_batch(99, LENGTHS, left={1})
    want = training_step(model, batch, 5)
    flash_on_cpu.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = training_step(compiled, batch, 5)
    assert [c["op"] for c in flash_on_cpu].count("forward") == TINY["num_hidden_layers"]
    assert [c["op"] for c in flash_on_cpu].count("backward") == TINY["num_hidden_layers"]
    assert (got[0] - want[0]).abs() < EXACT
    assert max((a - b).abs().max().item() for a, b in zip(got[1], want[1])) < EXACT
