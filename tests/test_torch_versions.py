"""The features that need a newer torch than pyproject.toml's lowest, behind the one gate
(`input_checks.require_tracing_torch`): each refuses on an older torch with a ValueError naming the feature, the
installed torch and the one it needs. On such a torch these tests check the real refusal; on a newer one, the same
with the gate set shut (the features themselves are tested by their own files, which skip on an older torch)."""

import re
import sys
from pathlib import Path

import pytest
import torch

import modeling_bert_impl as bi
from modeling_bert_impl import input_checks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import NEEDED, SMALL, TRACING, small_model  # noqa: E402

FLEX = "attn_implementation='flex_attention'"


@pytest.fixture
def old_torch(monkeypatch):
    """The gate as an older torch than it needs sees it (the installed torch, where it is older)."""
    monkeypatch.setattr(input_checks, "TRACING_SUPPORTED", False)


def refusal(feature: str) -> str:
    return re.escape(f"{feature} needs torch >= {NEEDED} (installed: {torch.__version__}); upgrade torch, or ")


def test_the_gate_is_above_the_lowest_torch_and_reads_the_installed_one():
    lowest = re.search(r'"torch>=([\d.]+),', (Path(__file__).parents[1] / "pyproject.toml").read_text()).group(1)
    assert tuple(map(int, lowest.split(".")[:2])) < input_checks.TRACING_TORCH
    installed = tuple(int(part) for part in torch.__version__.split(".")[:2])
    assert input_checks.TRACING_SUPPORTED is (installed >= input_checks.TRACING_TORCH)


def test_compile_for_inference_refuses(old_torch):
    with pytest.raises(ValueError, match=refusal("compile_for_inference")):
        bi.compile_for_inference(small_model())


def test_onnx_export_refuses(old_torch, tmp_path):
    from modeling_bert_impl.integrations import export

    with pytest.raises(ValueError, match=refusal("ONNX export")):
        export.export("unused", str(tmp_path / "onnx"))


def test_a_traced_forward_refuses(old_torch):
    """torch.export (non-strict: the forward runs in Python) meets the check in the encoder's input checks."""
    ids = torch.randint(1, SMALL["vocab_size"], (2, 7))
    with pytest.raises(ValueError, match=refusal(TRACING)):
        torch.export.export(small_model(), (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                            strict=False)


def test_flex_attention_refuses(old_torch):
    """Where the implementation is chosen: at load and at set_attn_implementation; the model stays on its own."""
    with pytest.raises(ValueError, match=refusal(FLEX)):
        bi.BertImplModel(bi.BertImplConfig(**SMALL, attn_implementation="flex_attention"))
    model = small_model()
    with pytest.raises(ValueError, match=refusal(FLEX)):
        model.set_attn_implementation("flex_attention")
    assert model.config._attn_implementation != "flex_attention"
