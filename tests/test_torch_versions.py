"""The features that need a newer torch than pyproject.toml's lowest (modeling_bert_impl/torch_support.py): each one
refuses on an older torch with a ValueError naming the feature, the installed torch and the one it needs. On such a
torch these tests check the real refusal; on a newer one, the message with the installed version set lower (the
features themselves are tested by their own files, which skip on an older torch with `needs_tracing`)."""

import re
import sys
from pathlib import Path

import pytest
import torch

import modeling_bert_impl as bi
from modeling_bert_impl import input_checks, torch_support

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_modeling import SMALL  # noqa: E402

OLD_TORCH = not input_checks.TRACING_SUPPORTED
TRACING = "tracing a bert-impl model (torch.compile, torch.export)"
FLEX = "attn_implementation='flex_attention'"
needs_tracing = pytest.mark.skipif(
    OLD_TORCH, reason=f"{TRACING} needs torch >= {torch_support.NEEDS[TRACING]} (installed: {torch.__version__})")


@pytest.fixture
def old_torch(monkeypatch):
    """The torch installed, or on a newer one a version below every feature's need, as the checks read it."""
    if not OLD_TORCH:
        monkeypatch.setattr(torch_support, "INSTALLED", "2.6.0")
        monkeypatch.setattr(input_checks, "TRACING_SUPPORTED", False)
    return torch_support.INSTALLED


def refusal(feature: str, installed: str) -> str:
    return re.escape(f"{feature} needs torch >= {torch_support.NEEDS[feature]} (installed: {installed})")


def small_model():
    torch.manual_seed(0)
    return bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()


def test_the_features_and_their_versions_are_listed_once():
    """Every gated feature in NEEDS, each with a release above pyproject.toml's lowest torch."""
    lowest = re.search(r'"torch>=([\d.]+),', (Path(__file__).parents[1] / "pyproject.toml").read_text()).group(1)
    assert set(torch_support.NEEDS) == {"compile_for_inference", "ONNX export", TRACING, FLEX}
    for feature, needed in torch_support.NEEDS.items():
        assert torch_support.Version(needed) > torch_support.Version(lowest), feature
    assert torch_support.NEEDS[TRACING] == ".".join(map(str, input_checks.TRACING_TORCH))


def test_compile_for_inference_refuses(old_torch):
    with pytest.raises(ValueError, match=refusal("compile_for_inference", old_torch)):
        bi.compile_for_inference(small_model())


def test_onnx_export_refuses(old_torch, tmp_path):
    from modeling_bert_impl.integrations import export

    with pytest.raises(ValueError, match=refusal("ONNX export", old_torch)):
        export.export("unused", str(tmp_path / "onnx"))


def test_a_traced_forward_refuses(old_torch):
    """torch.export (non-strict: the forward runs in Python) meets the check in the encoder's input checks."""
    ids = torch.randint(1, SMALL["vocab_size"], (2, 7))
    with pytest.raises(ValueError, match=refusal(TRACING, torch.__version__)):  # the check reads torch itself
        torch.export.export(small_model(), (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                            strict=False)


def test_flex_attention_refuses(old_torch):
    """Where the implementation is chosen: at load and at set_attn_implementation; the model stays on its own."""
    with pytest.raises(ValueError, match=refusal(FLEX, torch.__version__)):  # the model reads torch itself
        bi.BertImplModel(bi.BertImplConfig(**SMALL, attn_implementation="flex_attention"))
    model = small_model()
    with pytest.raises(ValueError, match=refusal(FLEX, torch.__version__)):
        model.set_attn_implementation("flex_attention")
    assert model.config._attn_implementation != "flex_attention"
