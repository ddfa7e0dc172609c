"""CPU inference's packed path (packed_linear.py) and fused layers (fused_layers.py), taken without opting in, and the
`optimize_for_inference` switch: outputs as transformers' BERT and as the layers called as modules, for every head and
layout, the fast paths really taken, and never taken where they could change anything: with autograd, in training
mode, with hooks, after a weight update (through the parameter, through `.data`, by `load_state_dict`), in copies,
pickles and other dtypes, and nothing added to the state dict."""

import copy
import pickle
import sys
from pathlib import Path

import peft
import pytest
import torch
import transformers

import modeling_bert_impl as bi
import modeling_bert_impl.fused_layers as fused_layers
import modeling_bert_impl.packed_linear as packed_linear
from modeling_bert_impl.packed_linear import _PACKED, PackedLinear, linear
from modeling_bert_impl.serving import optimize_for_inference
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_modeling import HEADS, LAYOUTS, SMALL, layout_inputs, output_tensors  # noqa: E402

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


def packed(model, encoder_only: bool = True) -> list[bool]:
    """For each linear layer of `model` (of its encoder layers): whether it has a packed copy of its weight."""
    modules = model.layers.modules() if encoder_only else model.modules()
    return [id(m.weight) in _PACKED for m in modules if isinstance(m, torch.nn.Linear)]


def max_diff(a, b, inputs) -> float:
    real = inputs["attention_mask"].bool()
    return (a.last_hidden_state[real] - b.last_hidden_state[real]).abs().max().item()


@pytest.mark.parametrize("switch", [False, True], ids=["default", "optimize_for_inference"])
@pytest.mark.parametrize("lengths", [[16], [128], [5, 37, 12, 64, 1, 30]], ids=["1x16", "1x128", "mixed"])
def test_packed_path_matches_transformers(minilm_dir, reference, lengths, switch):
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    if switch:
        optimize_for_inference(model)
    assert type(model.layers[0].ffn.up) is type(model.pooler.dense) is (PackedLinear if switch else torch.nn.Linear)
    inputs = batch(lengths)
    assert not any(packed(model))
    with torch.inference_mode():
        expected, got = reference(**inputs), model(**inputs)
    assert max_diff(got, expected, inputs) < 1e-5
    assert (got.pooler_output - expected.pooler_output).abs().max() < 1e-5
    assert packed(model) and all(packed(model))  # the packed path ran, in every encoder layer
    assert all(packed(model, encoder_only=False)) == switch  # and the pooler too with the switch


@pytest.mark.parametrize("fuse", [True, False], ids=["in oneDNN (AVX-512)", "after it (AVX2)"])
def test_the_packed_gelu_is_the_exact_gelu(monkeypatch, fuse):
    """The exact GELU on the packed path, inside the product's oneDNN call (`fuse_gelu`: on AVX-512) or after it."""
    monkeypatch.setattr(packed_linear, "fuse_gelu", lambda: fuse)
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(3, 8)
    act = transformers.activations.ACT2FN["gelu"]
    with torch.no_grad():
        got = linear(layer, x, act)
        assert id(layer.weight) in _PACKED
        expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert (got - expected).abs().max() < 1e-6


def test_autograd_never_takes_the_packed_path(minilm_dir, reference):
    """With gradients (training, or eval with grad) the layers are plain nn.Linear: the same loss as transformers', and
    nothing packed."""
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    inputs = batch([9, 4], seed=1)
    loss = model(**inputs).last_hidden_state[inputs["attention_mask"].bool()].square().mean()
    loss.backward()
    expected = reference(**inputs).last_hidden_state[inputs["attention_mask"].bool()].square().mean()
    assert abs(loss.item() - expected.item()) < 1e-6
    assert model.layers[0].ffn.up.weight.grad is not None and not any(packed(model))
    model.train()
    model(**inputs).last_hidden_state.sum().backward()
    assert not any(packed(model))


@pytest.mark.parametrize("lengths", [[9, 4], [9]], ids=["padded", "1x9"])
@pytest.mark.parametrize("update", ["parameter", "data", "load_state_dict"])
def test_a_changed_weight_is_packed_again(minilm_dir, update, lengths):
    """An optimizer-like in-place update, a `.data` update (PEFT's merge_adapter; the version counter does not move)
    and load_state_dict, after the packed path ran: outputs as the plain path's on the new weights."""
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    inputs = batch(lengths, seed=1)
    with torch.no_grad():
        before = model(**inputs).last_hidden_state  # packs
        weight = model.layers[2].ffn.up.weight
        delta = 0.01 * torch.randn(weight.shape[0], 2) @ torch.randn(2, weight.shape[1])  # a rank-2 (LoRA-like) delta
        if update == "parameter":
            weight.add_(delta)
        elif update == "data":
            weight.data += delta
        else:
            state = model.state_dict()
            state["layers.2.ffn.up.weight"] = weight + delta
            model.load_state_dict(state)
        got = model(**inputs).last_hidden_state
    expected = model(**inputs).last_hidden_state.detach()  # grad enabled: the plain path
    assert (got - expected).abs().max() < 1e-5 < (got - before).abs().max()


def test_state_dict_copies_pickles_and_dtypes(minilm_dir, reference):
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    keys = set(model.state_dict())
    inputs = batch([7, 3], seed=2)
    with torch.no_grad():
        expected = model(**inputs)
    assert set(model.state_dict()) == keys  # the packed copies are not state
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not any(packed(clone))
        with torch.no_grad():
            assert max_diff(clone(**inputs), expected, inputs) == 0
    double = copy.deepcopy(model).double()
    assert not any(packed(double))
    with torch.no_grad():
        got = double(**inputs)
        assert not any(packed(double))  # float64: the plain path
        assert max_diff(got, reference.double()(**inputs), inputs) < 1e-10
    reference.float()


def test_observed_layers_take_the_plain_path(minilm_dir):
    """A forward hook on a layer sees what it always saw (the product before the GELU): hooked layers are called."""
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    seen = []
    up = model.layers[1].ffn.up
    up.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        model(**batch([6], seed=3))
    (x, out), = seen
    assert (out - torch.nn.functional.linear(x, up.weight, up.bias)).abs().max() < 1e-5
    assert id(up.weight) not in _PACKED and id(model.layers[1].ffn.down.weight) in _PACKED


# ---------------------------------------------------------------------------------------------------------------------
# Fused layers (fused_layers.py)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def fused_calls(monkeypatch):
    """The input shape of each layer run through `fused_layer` (as the model and `fused_encoder` call it)."""
    calls = []
    real = fused_layers.fused_layer
    monkeypatch.setattr(fused_layers, "fused_layer", lambda *args: calls.append(args[1].shape) or real(*args))
    return calls


def no_op_hook(module, args):
    return None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stock_name,our_name,auto_name", HEADS, ids=[h[1] for h in HEADS])
def test_fused_layers_equal_the_layers_for_every_head(fused_calls, stock_name, our_name, auto_name, layout):
    """Every output tensor, every layer's hidden state included, as the layers called as modules give it (a no-op hook
    on one layer's dropout makes the model call them), on one sequence, a dense batch and a padded one (the unpadded
    layout)."""
    torch.manual_seed(0)
    config = bi.BertImplConfig(**{**SMALL, "num_labels": 2 if "Question" in our_name else 3})
    model = getattr(bi, our_name)(config).eval()
    inputs = layout_inputs(stock_name, config, layout, torch.Generator().manual_seed(1))
    with torch.inference_mode():
        fused = model(**inputs, output_hidden_states=True)
        assert len(fused_calls) == config.num_hidden_layers
        base = getattr(model, model.base_model_prefix, model)
        hook = base.layers[0].dropout.register_forward_pre_hook(no_op_hook)
        layers = model(**inputs, output_hidden_states=True)
        hook.remove()
    assert len(fused_calls) == config.num_hidden_layers  # the second call did not fuse
    expected = {**output_tensors(layers), **{f"hidden_states[{i}]": h for i, h in enumerate(layers.hidden_states)}}
    got = {**output_tensors(fused), **{f"hidden_states[{i}]": h for i, h in enumerate(fused.hidden_states)}}
    assert got.keys() == expected.keys()
    for name, e in expected.items():
        assert got[name].shape == e.shape, name
        assert (got[name] - e).abs().max().item() < 1e-5, name


def test_dense_batches_go_through_the_layers_in_groups(fused_calls, minilm_dir, reference, monkeypatch):
    """A dense batch of more than CHUNK_TOKENS tokens runs through all layers a group of sequences at a time (here 15
    tokens a group, sequences of 7: two a group), every output as one pass gives it and as transformers' does; with
    hidden states asked for, one pass."""
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    inputs = batch([7] * 5, seed=2)  # (5, 7)
    with torch.inference_mode():
        whole = model(**inputs)
        assert fused_calls == [(5, 7, 384)] * 6
        monkeypatch.setattr(fused_layers, "CHUNK_TOKENS", 15)  # two sequences a group: 2 + 2 + 1
        grouped = model(**inputs)
        hidden = model(**inputs, output_hidden_states=True)
        expected = reference(**inputs)
    assert fused_calls[6:18] == [(2, 7, 384)] * 12 and fused_calls[18:24] == [(1, 7, 384)] * 6
    assert fused_calls[24:] == [(5, 7, 384)] * 6
    for got in (grouped, hidden):
        assert (got.last_hidden_state - whole.last_hidden_state).abs().max() < 1e-6
        assert (got.pooler_output - whole.pooler_output).abs().max() < 1e-6
    assert max_diff(grouped, expected, inputs) < 1e-5
    assert (grouped.pooler_output - expected.pooler_output).abs().max() < 1e-5


def test_fused_layers_only_where_nothing_can_tell(fused_calls, minilm_dir):
    """Not fused: with autograd, in training mode, asking for attention maps, with a hook on a layer's module (the
    hook runs), with flex attention; fused again when the hook is gone. Replaced linear layers (PEFT) stay fused,
    called as the modules they are."""
    model = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    inputs = batch([9], seed=4)
    seen = []
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    assert len(fused_calls) == 6
    model(**inputs)  # autograd
    model.train()
    with torch.no_grad():
        model(**inputs)
    model.eval()
    with torch.no_grad():
        model(**inputs, output_attentions=True)
        hook = model.layers[3].attn_norm.register_forward_hook(lambda m, a, out: seen.append(out))
        hooked = model(**inputs).last_hidden_state
        hook.remove()
        model.set_attn_implementation("flex_attention")
        model(**inputs)
        model.set_attn_implementation("sdpa")
    assert len(fused_calls) == 6 and len(seen) == 1 and (hooked - expected).abs().max() < 1e-5
    lora = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    peft_model = peft.get_peft_model(lora, peft.LoraConfig(target_modules=["qkv", "up"], init_lora_weights=False))
    with torch.no_grad():
        unfused = peft_model(**inputs, output_attentions=True).last_hidden_state  # the module path
        got = peft_model(**inputs).last_hidden_state
    assert len(fused_calls) == 12 and (got - unfused).abs().max() < 1e-5 < (got - expected).abs().max()
