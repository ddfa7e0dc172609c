"""The padding-free encoder: padding helpers, attention kernels and layouts, packed batches, sparse MLM, compile,
autocast. Small configs except the MiniLM parity and packing tests; no timing is asserted here (see
benchmarks/bench_model.py)."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import BertModel, DataCollatorWithFlattening

import modeling_bert_impl.bert_padding as bp
from modeling_bert_impl import BertImplConfig, BertImplForMaskedLM, BertImplForPreTraining, BertImplModel, layouts
from modeling_bert_impl.bert_padding import (
    bucketed_rows,
    cu_seqlens_from_markers,
    length_groups,
    pad,
    sequence_mask,
    unpad,
    unpad_indices,
)
from helpers import TINY, attention_per_sequence, layouts_built, mixed_batch, needs_tracing
from modeling_bert_impl.input_checks import read_batch

TOL = 1e-5


def real_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """max |a - b| over the real (mask != 0) positions of (B, T, ...) tensors."""
    return (a - b)[mask.bool()].abs().max().item()


# ---------------------------------------------------------------------------------------------------------------------
# Padding helpers, on hand-made cases
# ---------------------------------------------------------------------------------------------------------------------
def test_unpad_indices_any_padding_layout():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 1, 1]])  # right, left, none, a hole
    indices, cu_seqlens = unpad_indices(mask, nnz=7)
    assert indices.tolist() == [0, 1, 6, 7, 12, 14, 15]
    assert cu_seqlens.tolist() == [0, 2, 4, 4, 7] and cu_seqlens.dtype == torch.int32


def test_unpad_pad_round_trip():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    x = torch.arange(12.0).view(2, 3, 2)
    indices, _ = unpad_indices(mask, nnz=4)
    rows = unpad(x, indices)
    assert rows.tolist() == [[0, 1], [2, 3], [8, 9], [10, 11]]
    assert torch.equal(pad(rows, indices, 2, 3), x * mask[..., None])  # zeros at padding


def test_cu_seqlens_from_packing_markers():
    for num_sequences in (3, None):  # read on the host (eager), or not (traced: a custom op of data-dependent size)
        positions = torch.tensor([0, 1, 2, 0, 1, 0])
        assert cu_seqlens_from_markers(None, None, positions, num_sequences).tolist() == [0, 3, 5, 6]
        seq_idx = torch.tensor([0, 0, 1, 1, 1, 2])
        assert cu_seqlens_from_markers(None, seq_idx, positions, num_sequences).tolist() == [0, 2, 5, 6]
    # a first sequence that does not start at position 0 is still a sequence
    assert cu_seqlens_from_markers(None, None, torch.tensor([3, 4, 0, 1]), 2).tolist() == [0, 2, 4]
    assert sequence_mask(torch.tensor([0, 2, 2, 5]), 3).tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]


def test_length_groups():
    lengths = [3, 5, 0, 3, 9, 8]
    assert length_groups(lengths, group_cost=0) == [[0, 3], [1], [5], [4]]  # one group per distinct length
    assert length_groups(lengths, group_cost=100) == [[0, 3, 1, 5, 4]]  # one group, sorted; the empty one left out
    assert length_groups(lengths, group_cost=2) == [[0, 3], [1], [5, 4]]  # 8 -> 9 costs 1 padded row < 2
    assert length_groups([0, 0], group_cost=1) == []


def test_bucketed_rows():
    cu_seqlens = torch.tensor([0, 3, 5, 5, 6])  # lengths 3, 2, 0, 1
    rows, real, shapes = bucketed_rows(cu_seqlens, [[3], [1, 0]], [3, 2, 0, 1])
    assert rows.tolist() == [5, 3, 4, 4, 0, 1, 2]  # seq 3 | seq 1, its last token repeated | seq 0
    assert real.tolist() == [True, True, True, False, True, True, True]
    assert shapes == [(1, 1, 0), (2, 3, 1)]  # (sequences, longest, filler rows?) per group


# ---------------------------------------------------------------------------------------------------------------------
# Attention kernels and layouts: every one against softmax attention run on each sequence alone
# ---------------------------------------------------------------------------------------------------------------------
LENGTHS = [5, 0, 9, 1, 7, 7]


def test_varlen_kernel_exact():
    kernel = bp.repadded_attention
    torch.manual_seed(0)
    cu_seqlens = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).int()
    qkv = torch.randn(sum(LENGTHS), 3, 2, 8, requires_grad=True)
    q, k, v = qkv.unbind(1)
    batch = bp.VarlenBatch.build(cu_seqlens, max(LENGTHS), sum(LENGTHS), torch.float32)
    expected = attention_per_sequence(q, k, v, LENGTHS, 0.3)
    got = kernel(q, k, v, batch, 0.3, 0.0)
    assert (got - expected).abs().max() < TOL
    grad = torch.randn_like(got)
    (g_expected,), (g_got,) = (torch.autograd.grad(y, qkv, grad) for y in (expected, got))
    assert (g_got - g_expected).abs().max() < TOL


@pytest.mark.parametrize("group_cost", [0, 3, 10**6])
def test_bucketed_layout_exact(group_cost):
    torch.manual_seed(0)
    cu_seqlens = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).int()
    qkv = torch.randn(sum(LENGTHS), 3, 2, 8, requires_grad=True)
    rows, real, shapes = bucketed_rows(cu_seqlens, length_groups(LENGTHS, group_cost), LENGTHS)
    q, k, v = qkv[rows].unbind(1)  # (P, N, D) each
    got = bp.bucketed_attention(q, k, v, bp.additive_mask(real, q.dtype), shapes, 0.3, 0.0)[real]  # sorted by length
    expected = attention_per_sequence(*qkv.unbind(1), LENGTHS, 0.3)[rows[real]]
    assert (got - expected).abs().max() < TOL
    grad = torch.randn_like(got)
    (g_expected,), (g_got,) = (torch.autograd.grad(y, qkv, grad) for y in (expected, got))
    assert (g_got - g_expected).abs().max() < TOL


# ---------------------------------------------------------------------------------------------------------------------
# The model: unpadded vs padded vs eager vs transformers
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm(minilm_dir):
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        ours = BertImplModel.from_pretrained(minilm_dir).eval()
        stock = BertModel.from_pretrained(minilm_dir, attn_implementation="sdpa").eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
    return ours, stock


def test_minilm_unpadded_matches_transformers_and_eager(minilm):
    ours, stock = minilm
    batch = mixed_batch(ours.config.vocab_size, [37, 5, 0, 61, 12, 61, 30, 2], left={4, 6})  # a padding-only row
    real = batch["attention_mask"]
    nonempty = real.sum(-1) > 0
    with torch.no_grad():
        expected = stock(**batch)
        got = ours(**batch)  # unpadded (bucketed on CPU)
        ours.set_attn_implementation("eager")
        eager = ours(**batch)  # padded, the reference
        ours.set_attn_implementation("sdpa")
    assert real_diff(got.last_hidden_state, expected.last_hidden_state, real) <= TOL
    assert real_diff(got.last_hidden_state, eager.last_hidden_state, real) <= TOL
    assert (got.last_hidden_state[real == 0] == 0).all()  # padding positions are zero after re-padding
    # [CLS] pooling: the first real token, also under left padding (transformers pools position 0 whatever it holds)
    right = nonempty.clone()
    right[[4, 6]] = False
    assert (got.pooler_output - expected.pooler_output)[right].abs().max() <= TOL
    assert (got.pooler_output - eager.pooler_output)[nonempty].abs().max() <= TOL


def read(config, **inputs) -> "layouts.Batch":
    """The batch as the forward reads it (input_checks.read_batch)."""
    names = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds", "cu_seq_lens_q",
             "cu_seq_lens_k", "max_length_q", "seq_idx")
    return read_batch(config, *(inputs.get(name) for name in names))


def test_padded_sdpa_mask_is_transformers_for_every_query():
    """The padded layout's sdpa mask is the padding mask once, (B, 1, 1, T): broadcast over the queries it is the
    (B, 1, T, T) mask transformers' sdpa_mask writes out, padding-only row included; packed batches keep
    transformers' block-diagonal one."""
    config = BertImplConfig(**TINY)
    mask = mixed_batch(99, [9, 3, 0, 14, 6], left={3})["attention_mask"]  # (5, 14)
    x = torch.randn(*mask.shape, 32)
    got = layouts.stock_mask(config, read(config, inputs_embeds=x, attention_mask=mask), x, "sdpa")
    expected = transformers.masking_utils.sdpa_mask(
        batch_size=5, q_length=14, kv_length=14, mask_function=transformers.masking_utils.bidirectional_mask_function,
        attention_mask=mask.bool(), allow_is_bidirectional_skip=False)
    assert got.shape == (5, 1, 1, 14) and expected.shape == (5, 1, 14, 14)
    assert torch.equal(got.expand(5, 1, 14, 14), expected)
    cu = torch.tensor([0, 4, 14], dtype=torch.int32)
    packed = layouts.stock_mask(config, read(config, inputs_embeds=x[:1], cu_seq_lens_q=cu), x[:1], "sdpa")
    assert packed.shape == (1, 1, 14, 14) and not packed[0, 0, 0, 4] and packed[0, 0, 5, 4]


def test_the_padding_free_layout_runs_where_skipping_pays(monkeypatch):
    """With `unpad_inputs` None the padded rows' FLOPs in the dense layers, 2 L (4 H^2 + 2 H I) a row, must reach the
    layout's own cost (`layouts.BREAK_EVEN_FLOPS`, here set to 10 rows of TINY): 9 padded rows run the padded layout,
    10 the padding-free one, `unpad_inputs=True` the padding-free one at 1; outputs the same either way. Packed and
    traced batches always skip; a device type not measured skips wherever there is padding."""
    config = BertImplConfig(**TINY)
    row_flops = 2 * 2 * (4 * 32 * 32 + 2 * 32 * 37)  # hand-computed: L=2, H=32, I=37
    monkeypatch.setattr(layouts, "BREAK_EVEN_FLOPS", {"cpu": 10 * row_flops})
    model = BertImplModel(config).eval()
    for padded_rows, unpad_inputs, padding_free in ((9, None, False), (10, None, True), (1, True, True)):
        batch = mixed_batch(99, [14, 14 - padded_rows, 14])
        model.config.unpad_inputs = unpad_inputs
        with torch.no_grad(), layouts_built(model) as built:
            got = model(**batch).last_hidden_state
        assert bool(built) is padding_free, (padded_rows, unpad_inputs)
        model.config.unpad_inputs = False
        with torch.no_grad():
            expected = model(**batch).last_hidden_state
        assert real_diff(got, expected, batch["attention_mask"]) <= TOL
    nine = read(config, **mixed_batch(99, [14, 5, 14]))
    assert not layouts.skipping_pays(config, nine, torch.device("cpu"))
    assert layouts.skipping_pays(config, nine, torch.device("cuda"))  # not measured there: skip wherever padding
    assert layouts.skipping_pays(config, nine._replace(facts=nine.facts._replace(nnz=None)), torch.device("cpu"))
    packed = read(config, input_ids=torch.randint(1, 99, (1, 14)), cu_seq_lens_q=torch.tensor([0, 7, 14]).int())
    assert layouts.skipping_pays(config, packed, torch.device("cpu"))


def test_batch_of_padding_only_runs():
    model = BertImplModel(BertImplConfig(**TINY)).eval()
    with torch.no_grad():
        out = model(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.zeros(2, 5, dtype=torch.long))
    assert out.last_hidden_state.shape == (2, 5, 32) and torch.isfinite(out.pooler_output).all()


@pytest.mark.slow
@needs_tracing
def test_compiled_model_matches_in_both_layouts():
    """Under torch.compile: inference takes the bucketed layout (its host steps as custom ops), training the exact one."""
    torch.manual_seed(0)
    model = BertImplModel(BertImplConfig(**TINY)).eval()
    batch = mixed_batch(99, [9, 3, 0, 14, 6], left={3})
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        expected = model(**batch).last_hidden_state  # bucketed layout
        got = compiled(**batch).last_hidden_state  # bucketed layout, custom ops
    assert real_diff(got, expected, batch["attention_mask"]) <= TOL
    got = compiled(**batch).last_hidden_state  # with grad: exact layout, re-padded kernel
    assert real_diff(got.detach(), expected, batch["attention_mask"]) <= TOL


def test_gradients_equal_padded_unpadded_eager():
    torch.manual_seed(0)
    batch = mixed_batch(99, [9, 3, 14, 6, 1, 14], left={1})
    weights = torch.randn(*batch["input_ids"].shape, 32) * batch["attention_mask"][..., None]
    grads = {}
    for name, unpad_inputs, attn in (("unpadded", True, "sdpa"), ("padded", False, "sdpa"), ("eager", True, "eager")):
        torch.manual_seed(1)
        model = BertImplModel(BertImplConfig(**TINY, unpad_inputs=unpad_inputs))
        model.set_attn_implementation(attn)
        out = model(**batch)
        ((out.last_hidden_state * weights).sum() + out.pooler_output.sum()).backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    for other in ("padded", "eager"):
        for n, g in grads["unpadded"].items():  # summed over tokens: fp32 rounding grows with the gradient's size
            assert (g - grads[other][n]).abs().max() <= TOL * max(1.0, g.abs().max().item()), (other, n)


# ---------------------------------------------------------------------------------------------------------------------
# Packed batches (transformers' DataCollatorWithFlattening): no attention across sequences, on every path
# ---------------------------------------------------------------------------------------------------------------------
PACKING = {
    "position_ids": dict(),
    "flash_attn_kwargs": dict(return_flash_attn_kwargs=True),
    "seq_idx": dict(return_seq_idx=True),
}


@pytest.mark.parametrize("path", ["unpadded", "padded sdpa", "eager"])
@pytest.mark.parametrize("marker", list(PACKING))
def test_packed_batch_equals_each_sequence_alone(minilm, marker, path):
    ours, _ = minilm
    g = torch.Generator().manual_seed(2)
    lengths = [7, 19, 3, 11]
    sequences = [[101] + torch.randint(1000, 30000, (n - 2,), generator=g).tolist() + [102] for n in lengths]
    packed = DataCollatorWithFlattening(**PACKING[marker])([{"input_ids": s} for s in sequences])
    packed.pop("labels")
    ours.config.unpad_inputs = path == "unpadded"
    ours.set_attn_implementation("eager" if path == "eager" else "sdpa")
    try:
        with torch.no_grad():
            out = ours(**packed)
            alone = [ours(input_ids=torch.tensor([s])) for s in sequences]
    finally:
        ours.config.unpad_inputs = True
        ours.set_attn_implementation("sdpa")
    expected = torch.cat([a.last_hidden_state[0] for a in alone])  # (nnz, H)
    assert (out.last_hidden_state[0] - expected).abs().max() <= TOL
    assert (out.pooler_output - torch.cat([a.pooler_output for a in alone])).abs().max() <= TOL  # (S, H)


# ---------------------------------------------------------------------------------------------------------------------
# Pre-training: sparse MLM decoder, compile, autocast
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head", [BertImplForPreTraining, BertImplForMaskedLM], ids=lambda h: h.__name__)
def test_sparse_prediction_same_loss_and_gradients(head):
    batch = mixed_batch(99, [9, 3, 14, 6], left={1})
    labels = torch.full_like(batch["input_ids"], -100)
    labels[0, 2], labels[2, 5], labels[2, 9], labels[3, 1] = 7, 8, 9, 10
    extra = {"next_sentence_label": torch.tensor([0, 1, 1, 0])} if head is BertImplForPreTraining else {}
    results = {}
    for sparse in (True, False):
        torch.manual_seed(0)
        model = head(BertImplConfig(**TINY, sparse_prediction=sparse))
        out = model(**batch, labels=labels, **extra)
        out.loss.backward()
        logits = out.prediction_logits if head is BertImplForPreTraining else out.logits
        results[sparse] = out.loss, logits, {n: p.grad for n, p in model.named_parameters()}
    (loss_s, logits_s, grads_s), (loss_f, logits_f, grads_f) = results[True], results[False]
    assert logits_s.shape == (4, 99) and logits_f.shape == (4, 14, 99)  # (M, V) vs (B, T, V)
    assert (logits_s - logits_f[labels != -100]).abs().max() <= TOL
    assert abs(loss_s.item() - loss_f.item()) <= TOL
    for n, g in grads_s.items():
        assert (g - grads_f[n]).abs().max() <= TOL, n
    with torch.no_grad():  # without labels: the full logits
        assert head(BertImplConfig(**TINY))(**batch).to_tuple()[0].shape == (4, 14, 99)


# At most this many graphs for a model compiled once: the first batch's shape (static), then one graph with the batch
# and length dynamic, and one for each of torch's 0/1 specializations of them (a batch of 1, a length of 1, both).
# The padding-free layout adds none: its real-token count and groups are data-dependent sizes of custom ops.
MAX_GRAPHS = 5


@pytest.mark.slow  # a minute on 2 cores
@needs_tracing
def test_a_compiled_training_step_keeps_its_graphs_bounded_over_1000_random_batches():
    """torch.compile(fullgraph=True) of a training step (dropout on, the exact padding-free layout) over 1,000 batches
    of 1 to 8 sequences of 1 to 99 tokens, each padded to its longest: at most MAX_GRAPHS graphs, and none compiled in
    the second half (its outputs against eager: test_compiled_model_matches_in_both_layouts, tests/test_gpu.py)."""
    config = BertImplConfig(**{**TINY, "max_position_embeddings": 128, "hidden_dropout_prob": 0.1,
                               "attention_probs_dropout_prob": 0.1})
    torch.manual_seed(0)
    model = BertImplModel(config).train()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for step in range(1000):
        lengths = torch.randint(1, 100, (int(torch.randint(1, 9, (), generator=generator)),), generator=generator)
        mask = (torch.arange(int(lengths.max())) < lengths[:, None]).long()  # (B, T)
        ids = torch.randint(1, 99, mask.shape, generator=generator) * mask
        out = compiled(input_ids=ids, attention_mask=mask)
        (out.last_hidden_state.square().mean() + out.pooler_output.sum()).backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] <= MAX_GRAPHS, f"{graphs[-1]} graphs over 1,000 batches"
    assert graphs[499] == graphs[-1], "graphs compiled in the second half: recompiles do not settle"


@needs_tracing
def test_bucketed_lengths_on_the_padded_layout_compile_one_static_graph_each():
    """What CUDA graphs (torch.compile's mode="reduce-overhead") need, checked on the CPU: the padded layout
    (`unpad_inputs=False`) on batches of 8 padded to a multiple of 32 tokens, compiled with dynamic=False, holds one
    graph per length bucket (4 over 200 batches of 1 to 128 tokens) and no op of data-dependent size; the padding-free
    layout's graph has one (its real-token count), which is why inductor records no CUDA graph for it."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def data_dependent(gm) -> bool:
        return any("nonzero" in str(node.target) for node in gm.graph.nodes)

    torch.manual_seed(0)
    model = BertImplModel(BertImplConfig(**{**TINY, "max_position_embeddings": 128, "unpad_inputs": False})).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=recording_backend)
    generator, buckets = torch.Generator().manual_seed(0), set()
    with torch.no_grad():
        for _ in range(200):
            longest = int(torch.randint(1, 129, (), generator=generator))
            lengths = torch.randint(1, longest + 1, (8,), generator=generator)
            T = -(-int(lengths.max()) // 32) * 32  # DataCollatorWithPadding(pad_to_multiple_of=32)
            buckets.add(T)
            mask = (torch.arange(T) < lengths[:, None]).long()
            compiled(input_ids=torch.randint(1, 99, (8, T), generator=generator) * mask, attention_mask=mask)
        assert len(buckets) == len(graphs) == 4 and not any(map(data_dependent, graphs))
        model.config.unpad_inputs = True
        torch._dynamo.reset()
        graphs.clear()
        mask = (torch.arange(32) < torch.tensor([32, 5, 17, 9, 32, 2, 30, 11])[:, None]).long()
        torch.compile(model, fullgraph=True, dynamic=False, backend=recording_backend)(
            input_ids=torch.randint(1, 99, (8, 32)) * mask, attention_mask=mask)
        assert len(graphs) == 1 and data_dependent(graphs[0])


@needs_tracing
def test_layers_compile_without_graph_breaks():
    torch.manual_seed(0)
    config = BertImplConfig(**TINY)
    model = BertImplModel(config).eval()
    layer = model.encoder.layer[0]
    lengths = [5, 9, 2]
    cu_seqlens = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).int()
    x = torch.randn(sum(lengths), config.hidden_size)
    tokens = torch.arange(sum(lengths))
    padded = read(config, input_ids=torch.ones(3, 9, dtype=torch.long), attention_mask=sequence_mask(cu_seqlens, 9).long())
    x_padded = torch.randn(3, 9, config.hidden_size)
    stock = layouts.PaddedLayout.build(config, padded, x_padded, "sdpa")
    exact = layouts.VarlenLayout(tokens, (3, 9), None, bp.VarlenBatch.build(cu_seqlens, 9, sum(lengths), torch.float32))
    bucketed = layouts.BucketedLayout.of_tokens(tokens, cu_seqlens, (3, 9), torch.float32)
    inputs = {  # a layer's arguments: its rows, stock's mask argument, the layout
        "padded": (x_padded, stock.attention_mask, stock),
        "exact": (x, None, exact),
        "bucketed": (bucketed.enter(x[None]), None, bucketed),
    }
    for name, args in inputs.items():
        torch._dynamo.reset()
        rows, mask, layout = args
        assert torch._dynamo.explain(layer)(rows, mask, layout=layout).graph_break_count == 0, name
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert (compiled(rows, mask, layout=layout) - layer(rows, mask, layout=layout)).abs().max() <= TOL, name


@pytest.mark.parametrize("unpad_inputs", [True, False])
def test_bf16_autocast_on_cpu_close_to_fp32(unpad_inputs):
    torch.manual_seed(0)
    model = BertImplForPreTraining(BertImplConfig(**TINY, unpad_inputs=unpad_inputs))
    batch = mixed_batch(99, [9, 3, 14, 6], left={1})
    labels = batch["input_ids"].masked_fill(torch.rand(batch["input_ids"].shape) > 0.3, -100)
    with torch.no_grad():
        fp32 = model(**batch, labels=labels, output_hidden_states=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(**batch, labels=labels, output_hidden_states=True)
    bf16.loss.backward()
    assert torch.isfinite(bf16.loss) and abs(bf16.loss.item() - fp32.loss.item()) < 0.05 * fp32.loss.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    last = bf16.hidden_states[-1].float().detach()
    assert real_diff(last, fp32.hidden_states[-1], batch["attention_mask"]) < 0.1
