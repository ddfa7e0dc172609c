"""`optimize_for_inference` (modeling_bert_impl/inference/): an inference model of packed linear layers
(packed_linear.py) and fused layers (fused_layers.py), made from a copy of the model. Outputs as transformers' BERT
and as the plain model's, for every head and layout; the fast paths really taken, and never where they could change
anything (inputs that need gradients, hooks, replaced modules, other dtypes); the model given is left as it was, and
changing it afterwards (through the parameter, through `.data`, by `load_state_dict`) never changes the inference
model's answers; training an inference model is refused; loading and calling under `torch.inference_mode()` works."""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import modeling_bert_impl as bi
import modeling_bert_impl.inference.fused_layers as fused_layers
import modeling_bert_impl.inference.packed_linear as packed_linear
import modeling_bert_impl.inference.serving as serving
from modeling_bert_impl.inference.fused_layers import FusedEncoder
from modeling_bert_impl.inference.packed_linear import PackedLinear, pack, packed_product
from modeling_bert_impl.inference.serving import optimize_for_inference
sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import (  # noqa: E402
    BF16_SENTENCE_COSINE, BF16_TOKEN_COSINE, HEADS, LAYOUTS, NUMPY_WRITES, SMALL, assert_same_state, layout_inputs,
    model_state, numpy_writes_are_refused, output_tensors, small_lora,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def reference(minilm_dir):
    return transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="sdpa").eval()


def batch(lengths: list[int], seed: int = 0) -> dict:
    """Random ids, [CLS] first, right padding to the longest length."""
    generator = torch.Generator().manual_seed(seed)
    T = max(lengths)
    real = torch.arange(T) < torch.tensor(lengths)[:, None]  # (B, T)
    ids = torch.randint(1000, 30000, (len(lengths), T), generator=generator).masked_fill(~real, 0)
    ids[:, 0] = 101
    return dict(input_ids=ids, attention_mask=real.long(), token_type_ids=torch.zeros_like(ids))


def max_diff(a, b, inputs) -> float:
    real = inputs["attention_mask"].bool()
    return (a.last_hidden_state[real] - b.last_hidden_state[real]).abs().max().item()


@pytest.fixture
def packed_calls(monkeypatch):
    """Counts the products that run on packed weights."""
    calls = []
    real = packed_linear.packed_product
    counted = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(packed_linear, "packed_product", counted)
    monkeypatch.setattr(fused_layers, "packed_product", counted)
    return calls


@pytest.fixture
def fused_calls(monkeypatch):
    """The input shape of each layer run through `fused_layer` (as FusedEncoder and `fused_encoder` call it)."""
    calls = []
    real = fused_layers.fused_layer
    monkeypatch.setattr(fused_layers, "fused_layer", lambda *args: calls.append(args[1].shape) or real(*args))
    return calls


@pytest.mark.parametrize("optimized", [False, True], ids=["default", "optimize_for_inference"])
@pytest.mark.parametrize("lengths", [[16], [128], [5, 37, 12, 64, 1, 30]], ids=["1x16", "1x128", "mixed"])
def test_outputs_match_transformers(minilm_dir, reference, packed_calls, lengths, optimized):
    """The plain model as loaded, and its inference model: transformers' outputs; the inference model runs every
    product on packed weights (4 a layer, query, key and value in one, and the pooler's), the plain model none."""
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    if optimized:
        model = optimize_for_inference(model)
    linear = PackedLinear if optimized else torch.nn.Linear
    assert type(model.encoder.layer[0].intermediate.dense) is type(model.pooler.dense) is linear
    assert (type(model.encoder) is FusedEncoder) == optimized
    inputs = batch(lengths)
    with torch.inference_mode():
        expected, got = reference(**inputs), model(**inputs)
    assert max_diff(got, expected, inputs) < 1e-5
    assert (got.pooler_output - expected.pooler_output).abs().max() < 1e-5
    assert len(packed_calls) == (4 * model.config.num_hidden_layers + 1 if optimized else 0)


@pytest.mark.parametrize("fuse", [True, False], ids=["in oneDNN (AVX-512)", "after it (AVX2)"])
def test_the_packed_gelu_is_the_exact_gelu(monkeypatch, fuse):
    """The exact GELU on the packed path, inside the product's oneDNN call (`fuse_gelu`: on AVX-512) or after it."""
    monkeypatch.setattr(packed_linear, "fuse_gelu", lambda: fuse)
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(3, 8)
    act = transformers.activations.ACT2FN["gelu"]
    with torch.no_grad():
        got = packed_product(x, pack(layer.weight).value, layer.bias, act)
        expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert (got - expected).abs().max() < 1e-6


def test_inputs_that_need_gradients_take_the_modules(minilm_dir, reference, packed_calls, fused_calls):
    """Gradients with respect to the inputs (as captum asks for them) through the inference model: the modules run,
    nothing packed or fused, and the loss and input gradients are the plain model's and transformers'."""
    plain = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    model = optimize_for_inference(plain)
    inputs = batch([9, 4], seed=1)
    real = inputs["attention_mask"].bool()
    grads = {}
    for name, m in (("optimized", model), ("plain", plain), ("transformers", reference)):
        embeds = m.embeddings.word_embeddings(inputs["input_ids"]).detach().requires_grad_()
        out = m(inputs_embeds=embeds, attention_mask=inputs["attention_mask"])
        out.last_hidden_state[real].square().mean().backward()
        grads[name] = embeds.grad
    assert packed_calls == [] and fused_calls == []
    assert (grads["optimized"] - grads["plain"]).abs().max() < 1e-7
    assert (grads["optimized"] - grads["transformers"]).abs().max() < 1e-6
    assert all(p.grad is None for p in model.parameters())


UPDATES = {
    "parameter": lambda model, name, delta: model.get_parameter(name).add_(delta),
    "data": lambda model, name, delta: model.get_parameter(name).data.add_(delta),
    "load_state_dict": lambda model, name, delta: model.load_state_dict(
        {**model.state_dict(), name: model.get_parameter(name) + delta}),
}


@pytest.mark.parametrize("lengths", [[9, 4], [9]], ids=["padded", "1x9"])
@pytest.mark.parametrize("update", UPDATES)
def test_changing_the_model_never_changes_its_inference_model(minilm_dir, update, lengths):
    """After an inference call, a weight of the trainable model changed in place (an optimizer's update through the
    parameter; through `.data`, as PEFT's merge_adapter, on rows no check would read; load_state_dict): the model
    answers with the new weight, its inference model keeps the answers of the weights it was made from, and
    optimize_for_inference again gives the new ones."""
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    optimized = optimize_for_inference(model)
    inputs = batch(lengths, seed=1)
    name = "encoder.layer.2.intermediate.dense.weight"
    weight = model.get_parameter(name)
    original = weight.detach().clone()
    delta = torch.zeros_like(weight)
    delta[7:9] = 0.5 * torch.randn(2, weight.shape[1])  # two rows, as a sparse or low-rank update touches few
    with torch.no_grad():
        before = optimized(**inputs).last_hidden_state
        UPDATES[update](model, name, delta)
        got, new = optimized(**inputs).last_hidden_state, model(**inputs).last_hidden_state
        again = optimize_for_inference(model)(**inputs).last_hidden_state
    assert torch.equal(got, before)
    assert (new - before).abs().max() > 1e-3
    assert (again - new).abs().max() < 1e-5
    assert torch.equal(optimized.get_parameter(name), original)


EDITS = {  # a weight of an inference model changed in place (name, how), refused at the next call; {weight}: a
    # product's weight (the int8 model's is weight_int8)
    "a norm's bias": ("bert.encoder.layer.1.output.LayerNorm.bias", lambda t: t.add_(0.1)),
    "a product's bias": ("bert.encoder.layer.0.intermediate.dense.bias", lambda t: t.mul_(2)),
    "the embeddings, a new .data": ("bert.embeddings.word_embeddings.weight", lambda t: setattr(t, "data", t * 2)),
    "the classifier, copy_": ("classifier.weight", lambda t: t.copy_(torch.zeros_like(t))),
    "a product's weight, through .data": ("bert.encoder.layer.1.attention.self.query.{weight}",
                                          lambda t: t.data.mul_(2)),
    "a norm's weight, rows through .data": ("bert.encoder.layer.0.output.LayerNorm.weight",
                                            lambda t: t.data[3:5].fill_(0.5)),
    "the position ids, through .data": ("bert.embeddings.position_ids", lambda t: t.data[:, 1:].sub_(1)),
}


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("engine", ["optimize_for_inference", "quantize_for_inference"])
def test_a_weight_changed_in_place_is_refused_at_the_next_call(engine, edit):
    """An inference model whose own weight (a parameter, or an int8 model's buffer; through the tensor or its `.data`)
    was changed in place after it was made refuses its next call with a ValueError naming the weight and what to do; a
    copy of it (copy.deepcopy) keeps refusing; the model it was made from, unchanged, gives the inference model's first
    answers again."""
    torch.manual_seed(0)
    model = bi.BertImplForSequenceClassification(bi.BertImplConfig(**SMALL)).eval()
    inputs = {"input_ids": torch.randint(1, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))}
    inference = bi.optimize_for_inference(model) if engine == "optimize_for_inference" else \
        bi.quantize_for_inference(model, [inputs])
    name, change = EDITS[edit]
    name = name.format(weight="weight" if engine == "optimize_for_inference" else "weight_int8")
    with torch.no_grad():
        before = inference(**inputs).logits
        change(dict([*inference.named_parameters(), *inference.named_buffers()])[name])
        refusal = f"`{name}` was changed in place after {engine} made this inference model"
        with pytest.raises(ValueError, match=re.escape(refusal)):
            inference(**inputs)
        with pytest.raises(ValueError, match=re.escape(refusal)):
            copy.deepcopy(inference)(**inputs)
        again = getattr(bi, engine)(model, *([[inputs]] if engine == "quantize_for_inference" else []))
        assert (again(**inputs).logits - before).abs().max() < 1e-6


@pytest.mark.parametrize("write", NUMPY_WRITES)
def test_a_write_through_numpy_is_refused_and_the_answers_stay_one_set(write):
    """An inference model's weights are read-only to NumPy (their views, slices and state dict too): a write through
    NumPy, which no version counter sees, used to leave the packed products on the old values while LayerNorm and the
    embeddings read the new ones. (The compiled model: tests/test_compiled.py.)"""
    torch.manual_seed(0)
    model = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
    numpy_writes_are_refused(optimize_for_inference(model), model, write)


def test_the_model_given_is_left_as_it_was(minilm_dir):
    """optimize_for_inference works on a copy: the model given keeps its classes, modes, parameter values and
    gradient flags (here in training mode), and trains on."""
    model = bi.BertImplForSequenceClassification.from_pretrained(minilm_dir, num_labels=2).train()
    state = model_state(model)
    optimized = optimize_for_inference(model)
    assert_same_state(model, state)
    assert optimized is not model and not optimized.training
    assert all(not p.requires_grad for p in optimized.parameters())
    model(**batch([5, 3], seed=2), labels=torch.tensor([0, 1])).loss.backward()
    assert model.bert.encoder.layer[0].attention.self.query.weight.grad is not None


def test_training_an_inference_model_is_refused(minilm_dir):
    """`.train()`, `requires_grad_(True)` and `load_state_dict` on the inference model (or on its encoder model or
    encoder) raise a ValueError that says what to do; nothing was switched to training mode; `.eval()` is allowed."""
    optimized = optimize_for_inference(bi.BertImplForSequenceClassification.from_pretrained(minilm_dir, num_labels=2))
    what_to_do = ("this is an inference model made by optimize_for_inference, whose weights were fixed then. Train (or "
                  "load weights into) the model you passed to optimize_for_inference, then call optimize_for_inference "
                  "again on it.")
    for module in (optimized, optimized.bert, optimized.bert.encoder):
        with pytest.raises(ValueError, match=re.escape(f"{type(module).__name__}.train(): {what_to_do}")):
            module.train()
        with pytest.raises(ValueError, match="inference model"):
            module.requires_grad_()
    with pytest.raises(ValueError, match=re.escape("load_state_dict(): this is an inference model")):
        optimized.load_state_dict(optimized.state_dict())
    wrapper = torch.nn.ModuleDict({"model": optimized})  # as a PEFT model or other wrapper loads: module by module
    weight = "model.bert.encoder.layer.0.attention.self.query.weight"
    with pytest.raises(ValueError, match=re.escape(f"loading {weight}: this is an inference model")):
        wrapper.load_state_dict({weight: torch.zeros(384, 384)}, strict=False)
    assert optimized.bert.encoder.layer[0].attention.self.query.weight.abs().max() > 0
    assert not any(m.training for m in optimized.modules())
    assert optimized.eval() is optimized and optimized.train(False) is optimized


@pytest.mark.parametrize("optimized", [False, True], ids=["default", "optimize_for_inference"])
def test_loaded_and_called_under_inference_mode(minilm_dir, reference, optimized):
    """A serving function decorated with torch.inference_mode() that loads the model and calls it: transformers'
    outputs, on one sentence and on a padded batch."""
    with torch.inference_mode():
        model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
        if optimized:
            model = optimize_for_inference(model)
        for lengths in ([7], [9, 4]):
            inputs = batch(lengths, seed=3)
            got, expected = model(**inputs), reference(**inputs)
            assert max_diff(got, expected, inputs) < 1e-5


def test_state_dict_copies_and_dtypes(minilm_dir, reference):
    """The inference model's state dict is the model's (the packed weights are not state); a copy of it answers as it
    does; in float64 it runs the modules, as transformers in float64."""
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    optimized = optimize_for_inference(model)
    state, expected_state = optimized.state_dict(), model.state_dict()
    assert list(state) == list(expected_state)
    assert all(torch.equal(state[k], v) for k, v in expected_state.items())
    inputs = batch([7, 3], seed=2)
    with torch.no_grad():
        expected = optimized(**inputs)
        clone = copy.deepcopy(optimized)
        assert type(clone.encoder) is FusedEncoder
        assert max_diff(clone(**inputs), expected, inputs) == 0
    double = copy.deepcopy(optimized).double()
    with torch.no_grad():
        got = double(**inputs)
        assert max_diff(got, reference.double()(**inputs), inputs) < 1e-10
    reference.float()


def paragraphs(count: int) -> list[str]:
    """Real English prose, with some code: the first `count` paragraphs of pydoc's topics (in every Python install)."""
    import pydoc_data.topics

    texts = [" ".join(p.split()) for text in pydoc_data.topics.topics.values() for p in text.split("\n\n")]
    return [t for t in texts if len(t.split()) >= 4][:count]


def test_bfloat16_is_refused_by_name_where_the_cpu_has_no_bfloat16_units(minilm_dir, monkeypatch):
    """dtype=torch.bfloat16 on a CPU without AMX or AVX512-BF16, and a dtype the engine does not run: a ValueError
    naming the dtype and what to use instead."""
    model = bi.BertImplModel.from_pretrained(minilm_dir)
    monkeypatch.setattr(serving, "cpu_bf16_units", lambda: None)
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 needs a CPU with AMX or AVX512-BF16.*dtype=torch."
                                         r"float32 \(the default\)"):
        optimize_for_inference(model, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype=torch.float16 is not supported; use torch.float32"):
        optimize_for_inference(model, dtype=torch.float16)


@pytest.mark.skipif(packed_linear.cpu_bf16_units() is None, reason="needs a CPU with AMX or AVX512-BF16 (the "
                    "refusal elsewhere: test_bfloat16_is_refused_by_name_where_the_cpu_has_no_bfloat16_units)")
def test_bfloat16_inference_stays_within_its_stated_bound_of_float32(minilm_dir):
    """optimize_for_inference(dtype=torch.bfloat16) on 64 paragraphs of real text, padded batches of 16 and one
    sentence at a time: its products are bfloat16 ones (the packed weights, an output that is not float32's), and its
    last hidden state is within the stated per-token and mean-pooled cosine of the float32 inference model's."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    full, half = optimize_for_inference(model), optimize_for_inference(model, dtype=torch.bfloat16)
    assert half.encoder.layer[0].output.dense.packed.packed.value.dtype == torch.bfloat16
    texts = paragraphs(64)
    batches = [tokenizer(texts[i:i + 16], padding=True, truncation=True, max_length=256, return_tensors="pt")
               for i in range(0, len(texts), 16)]
    batches += [tokenizer(text, truncation=True, max_length=256, return_tensors="pt") for text in texts[:4]]
    tokens, sentences = [], []
    with torch.inference_mode():
        for inputs in batches:
            expected, got = full(**inputs).last_hidden_state, half(**inputs).last_hidden_state
            assert got.dtype == torch.float32 and not torch.equal(got, expected)
            real = inputs["attention_mask"].bool()
            tokens.append(torch.cosine_similarity(got[real], expected[real], dim=-1))
            pool = lambda h: (h * real[..., None]).sum(1) / real.sum(1, keepdim=True)  # noqa: E731 (mean pooling)
            sentences.append(torch.cosine_similarity(pool(got), pool(expected), dim=-1))
    tokens, sentences = torch.cat(tokens), torch.cat(sentences)
    print(f"bfloat16 against float32: per-token cosine min {tokens.min():.5f}, mean {tokens.mean():.6f} "
          f"({len(tokens):,} tokens); sentence cosine min {sentences.min():.6f}")
    assert tokens.min() >= BF16_TOKEN_COSINE["min"] and tokens.mean() >= BF16_TOKEN_COSINE["mean"]
    assert sentences.min() >= BF16_SENTENCE_COSINE


class Scaled(torch.nn.Module):
    """A user's wrapper around a linear layer."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 0.5


def test_a_wrapped_query_runs_as_it_is_or_is_refused_by_name(tmp_path):
    """A user's wrapper around `attention.self.query`: optimize_for_inference runs it as it is (the eager model's
    answers); quantize_for_inference and compile_for_inference, which read a linear layer's weights there, refuse
    with a ValueError naming it (it was an AttributeError from inside the engine)."""
    torch.manual_seed(0)
    model = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
    model.encoder.layer[1].attention.self.query = Scaled(model.encoder.layer[1].attention.self.query)
    ids = torch.randint(1, SMALL["vocab_size"], (3, 9))
    mask = (torch.arange(9) < torch.tensor([9, 5, 2])[:, None]).long()
    with torch.no_grad():
        expected = model(ids, mask).last_hidden_state
        got = bi.optimize_for_inference(model)(ids, mask).last_hidden_state
    assert (got - expected).abs().max() < 1e-5
    refusal = re.escape("`encoder.layer.1.attention.self.query` is a Scaled, not the linear layer ")
    with pytest.raises(ValueError, match=refusal + "quantize_for_inference takes"):
        bi.quantize_for_inference(model, [{"input_ids": ids, "attention_mask": mask}])
    if bi.input_checks.TRACING_SUPPORTED:  # below torch 2.13 compile_for_inference refuses first (the torch gate)
        with pytest.raises(ValueError, match=refusal + "compile_for_inference takes"):
            bi.compile_for_inference(model, tmp_path / "wrapped.pt2")


def test_observed_layers_take_the_modules(minilm_dir, fused_calls):
    """A forward hook on a layer of the inference model sees what it always saw (the product before the GELU): with
    it the layers run as modules; without it, fused again."""
    model = optimize_for_inference(bi.BertImplModel.from_pretrained(minilm_dir))
    seen = []
    up = model.encoder.layer[1].intermediate.dense
    hook = up.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    inputs = batch([6], seed=3)
    with torch.no_grad():
        hooked = model(**inputs).last_hidden_state
        hook.remove()
        fused = model(**inputs).last_hidden_state
    (x, out), = seen
    assert (out - torch.nn.functional.linear(x, up.weight, up.bias)).abs().max() < 1e-5
    assert len(fused_calls) == model.config.num_hidden_layers
    assert (hooked - fused).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# Fused layers (fused_layers.py)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stock_name,our_name,auto_name", HEADS, ids=[h[1] for h in HEADS])
def test_fused_layers_equal_the_layers_for_every_head(fused_calls, stock_name, our_name, auto_name, layout):
    """Every output tensor as the plain model's layers give it, on one sequence, a dense batch and a padded one (the
    unpadded layout); with hidden states asked for, the layers run as modules, every hidden state the plain model's."""
    torch.manual_seed(0)
    config = bi.BertImplConfig(**{**SMALL, "num_labels": 2 if "Question" in our_name else 3})
    plain = getattr(bi, our_name)(config).eval()
    model = optimize_for_inference(plain)
    inputs = layout_inputs(stock_name, config, layout, torch.Generator().manual_seed(1))
    with torch.inference_mode():
        fused = model(**inputs)
        assert len(fused_calls) == config.num_hidden_layers
        hidden = model(**inputs, output_hidden_states=True)
        layers = plain(**inputs, output_hidden_states=True)
    assert len(fused_calls) == config.num_hidden_layers  # the second call did not fuse
    expected = {**output_tensors(layers), **{f"hidden_states[{i}]": h for i, h in enumerate(layers.hidden_states)}}
    got = {**output_tensors(hidden), **{f"hidden_states[{i}]": h for i, h in enumerate(hidden.hidden_states)}}
    assert got.keys() == expected.keys()
    assert output_tensors(fused).keys() == output_tensors(layers).keys()
    got.update({f"fused {name}": t for name, t in output_tensors(fused).items()})
    expected.update({f"fused {name}": t for name, t in output_tensors(layers).items()})
    for name, e in expected.items():
        assert got[name].shape == e.shape, name
        assert (got[name] - e).abs().max().item() < 1e-5, name


def test_dense_batches_go_through_the_layers_in_groups(fused_calls, minilm_dir, reference, monkeypatch):
    """A dense batch of more than CHUNK_TOKENS tokens runs through all layers a group of sequences at a time (here 15
    tokens a group, sequences of 7: two a group), every output as one pass gives it and as transformers' does; with
    hidden states asked for, the layers as modules."""
    model = optimize_for_inference(bi.BertImplModel.from_pretrained(minilm_dir))
    inputs = batch([7] * 5, seed=2)  # (5, 7)
    with torch.inference_mode():
        whole = model(**inputs)
        assert fused_calls == [(5, 7, 384)] * 6
        monkeypatch.setattr(fused_layers, "CHUNK_TOKENS", 15)  # two sequences a group: 2 + 2 + 1
        grouped = model(**inputs)
        hidden = model(**inputs, output_hidden_states=True)
        expected = reference(**inputs)
    assert fused_calls[6:18] == [(2, 7, 384)] * 12 and fused_calls[18:24] == [(1, 7, 384)] * 6
    assert fused_calls[24:] == []
    for got in (grouped, hidden):
        assert (got.last_hidden_state - whole.last_hidden_state).abs().max() < 1e-5
        assert (got.pooler_output - whole.pooler_output).abs().max() < 1e-5
    assert max_diff(grouped, expected, inputs) < 1e-5
    assert (grouped.pooler_output - expected.pooler_output).abs().max() < 1e-5


def uncompiled_flex_attention(monkeypatch):
    """transformers' flex attention run eagerly: where only the layers it runs in count (its compile on the CPU takes
    10-25 s; its answers are checked in test_modeling.py). Returns the shapes of the queries it was called with."""
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import flex_attention

    calls = []
    def uncompiled(query, key, value, training=False, **kwargs):
        calls.append(query.shape)
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", uncompiled)
    return calls


def test_fused_layers_only_where_nothing_can_tell(fused_calls, minilm_dir, monkeypatch):
    """Not fused: inputs that need gradients, attention maps asked for, a hook on a layer's module (the hook runs),
    a global forward hook, a forward patched on a module or on one of the package's classes, flex attention; fused
    again when they are gone. PEFT adapters put on the
    inference model replace modules: the layers run as modules, with the adapters (as on the plain model)."""
    plain = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    model = optimize_for_inference(plain)
    inputs = batch([9], seed=4)
    seen = []
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    assert len(fused_calls) == 6
    embeds = model.embeddings.word_embeddings(inputs["input_ids"]).requires_grad_()
    model(inputs_embeds=embeds)  # autograd
    with torch.no_grad():
        model(**inputs, output_attentions=True)
        hook = model.encoder.layer[3].attention.output.LayerNorm.register_forward_hook(
            lambda m, a, out: seen.append(out))
        hooked = model(**inputs).last_hidden_state
        hook.remove()
        hook = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
        model(**inputs)
        hook.remove()
        norm = model.encoder.layer[0].output.LayerNorm
        norm.forward = lambda x: torch.zeros_like(x)  # a patched forward
        patched = model(**inputs).last_hidden_state
        del norm.forward
        output_class = type(model.encoder.layer[0].output)
        original = output_class.forward
        monkeypatch.setattr(output_class, "forward", lambda self, h, x: original(self, h, x) * 0.5)
        class_patched = model(**inputs).last_hidden_state
        monkeypatch.setattr(output_class, "forward", original)
        if bi.input_checks.TRACING_SUPPORTED:  # flex attention refuses below torch 2.13 (test_torch_versions.py)
            flex_calls = uncompiled_flex_attention(monkeypatch)
            model.set_attn_implementation("flex_attention")
            model(**inputs)
            assert len(flex_calls) == model.config.num_hidden_layers
            model.set_attn_implementation("sdpa")
        assert len(fused_calls) == 6 and len(seen) == 1 and (hooked - expected).abs().max() < 1e-5
        assert (patched - expected).abs().max() > 1e-3 and (class_patched - expected).abs().max() > 1e-3  # they ran
        model(**inputs)  # attention maps were asked for once: transformers' recording hooks do not count
    assert len(fused_calls) == 12
    adapted, adapted_plain = small_lora(model), small_lora(copy.deepcopy(plain))
    with torch.no_grad():
        got, want = adapted(**inputs).last_hidden_state, adapted_plain(**inputs).last_hidden_state
    assert len(fused_calls) == 12
    assert (got - want).abs().max() < 1e-5 < (got - expected).abs().max()


ONEDNN_CACHES = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import modeling_bert_impl as bi
from helpers import SMALL
model = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
ids = torch.randint(1, SMALL["vocab_size"], (2, 9))
with torch.no_grad():
    model(input_ids=ids)  # the model as loaded runs no oneDNN product
try:
    optimized = bi.optimize_for_inference(model)
except ValueError as error:
    print("refused:", error)
else:
    with torch.no_grad():
        assert (optimized(input_ids=ids).last_hidden_state - model(input_ids=ids).last_hidden_state).abs().max() < 1e-5
    print("caches:", os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"])
"""


@pytest.mark.parametrize("lru", ["0", pytest.param("32", marks=pytest.mark.slow), pytest.param(None, marks=pytest.mark.slow)],
                         ids=["LRU_CACHE_CAPACITY=0", "LRU_CACHE_CAPACITY=32", "unset"])
def test_onednn_caches_are_bounded_and_a_cache_turned_off_is_refused(lru):
    """In a process of its own (both caches are sized at oneDNN's first use): where the environment does not size
    oneDNN's caches the engine sets them to CACHE_CAPACITY entries; a size given is kept; LRU_CACHE_CAPACITY=0, with
    which torch's packed products crash the process (SIGSEGV), is refused by name, and the model as loaded still
    runs."""
    env = {k: v for k, v in os.environ.items() if k not in packed_linear.CACHES}
    if lru is not None:
        env["LRU_CACHE_CAPACITY"] = lru
    done = subprocess.run([sys.executable, "-c", ONEDNN_CACHES.format(tests=str(Path(__file__).resolve().parent))],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    capacity = packed_linear.CACHE_CAPACITY
    expected = {"0": "refused: LRU_CACHE_CAPACITY=0: optimize_for_inference's oneDNN products crash (SIGSEGV",
                "32": f"caches: 32 {capacity}", None: f"caches: {capacity} {capacity}"}[lru]
    assert done.stdout.startswith(expected), done.stdout
