"""The serving switch (`optimize_for_inference`): outputs as transformers' BERT, its packed path really taken, and the
layers still correct with autograd and after a weight update."""

import pytest
import torch
import transformers

import modeling_bert_impl as bi
from modeling_bert_impl.serving import PackedLinear, optimize_for_inference

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def models(minilm_dir):
    reference = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="sdpa").eval()
    served = optimize_for_inference(bi.BertImplModel.from_pretrained(minilm_dir))
    return reference, served


def batch(lengths: list[int], seed: int = 0) -> dict:
    """Random ids, [CLS] first, right padding to the longest length."""
    generator = torch.Generator().manual_seed(seed)
    T = max(lengths)
    real = torch.arange(T) < torch.tensor(lengths)[:, None]  # (B, T)
    ids = torch.randint(1000, 30000, (len(lengths), T), generator=generator).masked_fill(~real, 0)
    ids[:, 0] = 101
    return dict(input_ids=ids, attention_mask=real.long(), token_type_ids=torch.zeros_like(ids))


@pytest.mark.parametrize("lengths", [[16], [128], [5, 37, 12, 64, 1, 30]], ids=["1x16", "1x128", "mixed"])
def test_serving_matches_transformers(models, lengths):
    reference, served = models
    inputs = batch(lengths)
    with torch.inference_mode():
        expected, got = reference(**inputs), served(**inputs)
    real = inputs["attention_mask"].bool()
    assert (got.last_hidden_state[real] - expected.last_hidden_state[real]).abs().max() < 1e-5
    assert (got.pooler_output - expected.pooler_output).abs().max() < 1e-5
    linears = [m for m in served.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, PackedLinear) and m._packed is not None for m in linears)  # packed path ran
    assert served.layers[0].ffn.up.activation == "gelu"  # and the GELU was fused


def test_serving_layers_with_autograd_and_after_an_update(minilm_dir):
    """With gradients the layers are plain nn.Linear (same loss and gradients as an unswitched model); a weight updated
    in place is packed again."""
    plain = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    served = optimize_for_inference(bi.BertImplModel.from_pretrained(minilm_dir))
    inputs = batch([9, 4], seed=1)
    losses = [m(**inputs).last_hidden_state.square().mean() for m in (plain, served)]
    for loss in losses:
        loss.backward()
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    assert (plain.layers[0].ffn.up.weight.grad - served.layers[0].ffn.up.weight.grad).abs().max() < 1e-6

    with torch.no_grad():
        served(**inputs)  # packs
        for m in (plain, served):
            m.layers[2].ffn.up.weight.mul_(0.5)
        expected, got = plain(**inputs).last_hidden_state, served(**inputs).last_hidden_state
    assert (got - expected).abs().max() < 1e-5
