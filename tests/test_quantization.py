"""int8 inference (`quantize_for_inference`): embeddings within cosine 0.99 of float32's on real text, every head runs
on the int8 encoder, query, key and value quantized as one product, the float32 model given left as it was, and bad
calibration refused."""

import random
import re
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

import modeling_bert_impl as bi
import modeling_bert_impl.inference.fused_layers as fused_layers
import modeling_bert_impl.inference.quantization as quantization
from modeling_bert_impl.inference.quantization import Int8Linear, quantize_for_inference
from modeling_bert_impl.modeling_bert_impl import AUTO_CLASSES
sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import assert_same_state, model_state  # noqa: E402

pytestmark = pytest.mark.skipif("onednn" not in torch.backends.quantized.supported_engines,
                                reason="torch built without oneDNN's quantized engine")
# Two of MiniLM's six layers (real weights, a third of the work), for the tests whose property does not depend on depth:
# the cosine bound to float32 is checked on all six (`int8_minilm`).
TWO_LAYERS = dict(num_hidden_layers=2)


@pytest.fixture(scope="module")
def text(minilm_dir):
    """Calibration and evaluation batches of real English (pydoc_data.topics, in every Python), 64 paragraphs each."""
    import pydoc_data.topics

    paragraphs = [re.sub(r"\s+", " ", p).strip() for t in pydoc_data.topics.topics.values() for p in t.split("\n\n")]
    paragraphs = [p for p in paragraphs if len(p.split()) >= 4]
    random.Random(0).shuffle(paragraphs)
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    encode = lambda texts: [dict(tokenizer(texts[i:i + 32], padding=True, truncation=True, max_length=128,  # noqa
                                           return_tensors="pt")) for i in range(0, len(texts), 32)]
    return encode(paragraphs[64:128]), encode(paragraphs[:64])


@pytest.fixture(scope="module")
def int8_minilm(minilm_dir, text):
    """MiniLM in float32, its state before quantizing, its int8 copy (calibrated on real text), and the float32 last
    hidden states of the evaluation batches' real tokens: quantized once for both formulations."""
    calibration, evaluation = text
    fp32 = bi.BertImplModel.from_pretrained(minilm_dir).eval()
    state = model_state(fp32)
    int8 = quantize_for_inference(fp32, calibration)
    with torch.no_grad():
        expected = [fp32(**batch).last_hidden_state[batch["attention_mask"].bool()] for batch in evaluation]
    return fp32, state, int8, expected


@pytest.mark.parametrize("formulation", ["kernel", "traced"])
def test_int8_embeddings_within_cosine_099_of_float32(int8_minilm, text, formulation):
    """Both of Int8Linear's formulations: the dynamic kernel (eager inference; `quantization.engine`'s) and the one
    traced programs run (`quantized_decomposed` operations, compile_for_inference's), which the eager path takes where
    gradients are on."""
    fp32, state, int8, expected = int8_minilm
    assert_same_state(fp32, state)  # the float32 model given is not changed
    # query, key, value, the attention output's, the feed-forward's two: each an Int8Linear under its own name
    assert sum(isinstance(m, Int8Linear) for m in int8.modules()) == 6 * fp32.config.num_hidden_layers
    assert isinstance(int8.encoder.layer[0].attention.self.query, Int8Linear)
    cosines = []
    for batch, reference in zip(text[1], expected):
        with torch.no_grad(), torch.enable_grad() if formulation == "traced" else nullcontext():
            got = int8(**batch).last_hidden_state[batch["attention_mask"].bool()].detach()
        cosines.append(F.cosine_similarity(got, reference, dim=-1))
    cosines = torch.cat(cosines)
    # per token, on real text, weights rounded by GPTQ: 0.9939 (kernel) and 0.9931 (traced) with the 7-bit weights of
    # an AVX2 Zen 3 (`weight_levels`), where rounding to the nearest level gave 0.986
    assert cosines.min() >= 0.99, cosines.min()
    assert cosines.mean() >= 0.997, cosines.mean()


def test_gptq_keeps_the_product_closer_than_rounding_to_nearest():
    """GPTQ's rounding, on inputs with correlated channels and one large one (as BERT's are), moves the product on
    held-out inputs of the same kind less than rounding each weight to its nearest level; on uncorrelated inputs of
    equal scale (moments proportional to the identity) it has no error to spread and is that rounding."""
    torch.manual_seed(0)
    out, inp, levels = 48, 64, 63
    mixing = torch.randn(inp, inp) / inp ** 0.5 + torch.eye(inp)
    mixing[:, 3] *= 20  # an outlier channel
    calibration, held_out = torch.randn(4096, inp) @ mixing, torch.randn(1024, inp) @ mixing
    w = torch.randn(out, inp)
    scale = (w.abs().amax(1) / levels).double()
    nearest = (w / scale[:, None]).round().clamp(-levels, levels)
    gptq = quantization.gptq_round(w, scale, calibration.T @ calibration, levels)
    assert gptq.dtype == torch.int8 and gptq.abs().max() <= levels
    assert (gptq.float() != nearest).any()
    error = lambda q: (held_out @ (w - q.float() * scale[:, None].float()).T).norm()  # noqa: E731
    assert error(gptq) < 0.8 * error(nearest), (error(gptq), error(nearest))
    assert torch.equal(quantization.gptq_round(w, scale, 5 * torch.eye(inp), levels).float(), nearest)


@pytest.mark.parametrize("head", [head if head in ("BertImplForSequenceClassification", "BertImplForMaskedLM") else
                                  pytest.param(head, marks=pytest.mark.slow)  # 4-5 s each
                                  for head in sorted({cls.__name__ for cls in AUTO_CLASSES.values()} - {"BertImplModel"})])
def test_every_head_runs_int8(minilm_dir, text, head):
    calibration, evaluation = text
    torch.manual_seed(0)
    fp32 = getattr(bi, head).from_pretrained(minilm_dir, **TWO_LAYERS).eval()
    choices = (lambda b: {k: v.unsqueeze(1).expand(-1, 2, -1) for k, v in b.items()}) if head.endswith("Choice") else (
        lambda b: b)  # multiple choice: (B, C, T), two choices
    int8 = quantize_for_inference(fp32, [choices(calibration[0])])
    batch = {k: v[:4, :24] for k, v in evaluation[0].items()}
    batch["attention_mask"] = torch.ones_like(batch["attention_mask"])  # no padding: heads mask it with -inf or 0
    batch = choices(batch)
    with torch.inference_mode():
        expected, got = fp32(**batch)[0], int8(**batch)[0]
    assert got.shape == expected.shape and torch.isfinite(got).all()
    assert (got - expected).abs().max() < 0.1 * expected.abs().max() + 0.05


@pytest.mark.parametrize("vnni", [True, False], ids=["VNNI", "no VNNI"])
def test_weights_take_7_bits_without_vnni(minilm_dir, text, monkeypatch, vnni):
    """Without VNNI oneDNN adds pairs of uint8 x int8 products in int16 (saturating at 32767): there no weight exceeds
    63 in magnitude, so that no pair sum can (255 x 63 x 2 = 32130); with VNNI the full int8 range."""
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: vnni)
    int8 = quantize_for_inference(bi.BertImplModel.from_pretrained(minilm_dir, **TWO_LAYERS).eval(), text[0][:1])
    largest = max(m.weight_int8.abs().max().item() for m in int8.modules() if isinstance(m, Int8Linear))
    assert largest == (127 if vnni else 63)


@pytest.mark.parametrize("vnni", [True, False], ids=["VNNI", "no VNNI"])
def test_the_eager_kernels_follow_the_cpu(monkeypatch, vnni):
    """oneDNN's int8 kernels with VNNI, FBGEMM's without (faster there)."""
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: vnni)
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    assert quantization.engine() == ("fbgemm" if fbgemm and not vnni else "onednn")


@pytest.mark.parametrize("engine", ["onednn", "fbgemm"])
def test_each_eager_kernel_computes_the_int8_product(monkeypatch, engine):
    """Either engine's kernel, on this CPU's int8 weights: the traced formulation's product (the same int8 weight),
    within the rounding of the activations, which the kernel quantizes over the call's range."""
    if engine not in torch.backends.quantized.supported_engines:
        pytest.skip(f"torch built without {engine}")
    monkeypatch.setattr(quantization, "engine", lambda: engine)
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(96, 64), torch.randn(5, 7, 96)
    layer = Int8Linear.quantize(linear.weight, linear.bias, x.abs().flatten(0, 1).amax(0))
    with torch.no_grad():
        kernel = layer(x)  # (5, 7, 64)
        with torch.enable_grad():
            traced = layer(x).detach()
        expected = linear(x)
    step = (traced - expected).abs().max()  # what rounding the activations and weights to int8 moves
    assert 0 < step < 0.05 * expected.abs().max()
    assert kernel.shape == expected.shape and (kernel - traced).abs().max() < step


@pytest.mark.parametrize("engine", ["onednn", "fbgemm"])
def test_a_nan_in_one_sequence_stays_in_that_sequence(minilm_dir, text, monkeypatch, engine):
    """A NaN in the first sequence of a dense batch (the first value the eager kernel's one range over the call
    reads): that sequence's outputs are NaN, the others' within cosine 0.99 of float32's, through either eager kernel
    and the traced formulation."""
    if engine not in torch.backends.quantized.supported_engines:
        pytest.skip(f"torch built without {engine}")
    # The kernel alone is chosen here: the weights keep this CPU's levels (forcing VNNI's 127 on a CPU without VNNI
    # saturates its int16 pair sums, a different test: test_weights_take_7_bits_without_vnni).
    monkeypatch.setattr(quantization, "engine", lambda: engine)
    calibration, evaluation = text
    fp32 = bi.BertImplModel.from_pretrained(minilm_dir, **TWO_LAYERS).eval()
    int8 = quantize_for_inference(fp32, calibration[:1])
    with torch.no_grad():
        embeds = fp32.embeddings.word_embeddings(evaluation[0]["input_ids"][:4, :24])  # (4, 24, H), no padding
        embeds[0, 0, 0] = float("nan")
        expected = fp32(inputs_embeds=embeds).last_hidden_state
        kernel = int8(inputs_embeds=embeds).last_hidden_state
        with torch.enable_grad():
            traced = int8(inputs_embeds=embeds).last_hidden_state.detach()
    assert expected[0].isnan().all() and expected[1:].isfinite().all()
    for got in (kernel, traced):
        assert got[0].isnan().all() and got[1:].isfinite().all()
        assert F.cosine_similarity(got[1:], expected[1:], dim=-1).min() >= 0.99


def test_bad_calibration_is_refused(minilm_dir):
    model = bi.BertImplModel.from_pretrained(minilm_dir)
    with pytest.raises(ValueError, match="calibration"):
        quantize_for_inference(model, [])
    with pytest.raises(ValueError, match="CPU in float32"):
        quantize_for_inference(bi.BertImplModel.from_pretrained(minilm_dir).double(), [])


def test_query_key_and_value_are_one_product(minilm_dir, text, monkeypatch):
    """Query, key and value share their input: they are smoothed and rounded as one weight, and the fused layers run
    them as one product (`Int8Linear.concat` of the three, the same integers) with the outputs of the layers called as
    modules (hidden states asked for). Changing the float32 model afterwards does not change the int8 model."""
    fp32 = bi.BertImplModel.from_pretrained(minilm_dir, **TWO_LAYERS).eval()
    int8 = quantize_for_inference(fp32, text[0][:1])
    attention = int8.encoder.layer[0].attention.self
    parts = (attention.query, attention.key, attention.value)
    joint = Int8Linear.concat(parts)
    assert all(torch.equal(p.inv_smooth, attention.query.inv_smooth) for p in parts)
    x = torch.randn(3, 5, fp32.config.hidden_size)
    with torch.no_grad():
        assert (joint(x) - torch.cat([p(x) for p in parts], -1)).abs().max() < 1e-5
    calls = []
    real = fused_layers.fused_layer
    monkeypatch.setattr(fused_layers, "fused_layer", lambda *args: calls.append(1) or real(*args))
    batch = {k: v[:4] for k, v in text[1][0].items()}
    real_tokens = batch["attention_mask"].bool()
    with torch.inference_mode():
        fused = int8(**batch).last_hidden_state
        assert len(calls) == fp32.config.num_hidden_layers
        modules = int8(**batch, output_hidden_states=True).last_hidden_state
        assert len(calls) == fp32.config.num_hidden_layers
        fp32.encoder.layer[0].attention.self.query.weight.data.mul_(2)  # the float32 model changes
        again = int8(**batch).last_hidden_state
    assert (fused - modules)[real_tokens].abs().max() < 1e-4
    assert torch.equal(again, fused)


def test_loaded_quantized_and_called_under_inference_mode(minilm_dir, text):
    """A serving function decorated with torch.inference_mode() that loads the model, quantizes it and calls it."""
    calibration, evaluation = text
    batch = evaluation[0]
    real = batch["attention_mask"].bool()
    with torch.inference_mode():
        fp32 = bi.BertImplModel.from_pretrained(minilm_dir, **TWO_LAYERS).eval()
        int8 = quantize_for_inference(fp32, calibration[:1])
        got, expected = int8(**batch).last_hidden_state[real], fp32(**batch).last_hidden_state[real]
    assert F.cosine_similarity(got, expected, dim=-1).min() > 0.98
