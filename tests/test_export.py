"""Deployment: every class through torch.export (dynamic batch and sequence) and torch.onnx.export(dynamo=True), run as
an ExportedProgram and in onnxruntime on a batch of another shape than the export example, against eager;
torch.compile(fullgraph=True) on padded and packed batches; the export command end to end on MiniLM.

Small random configs, fp32, eval mode. As transformers' own export tests (`ExportTesterMixin`) do, every class runs on
random attention masks with holes (zeros anywhere in a row) and every output element is compared, padding positions
included: hidden states are zero there on every path (eager unpadded in both layouts, eager padded, compiled,
exported, ONNX)."""

import functools
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoTokenizer, DataCollatorWithFlattening

import modeling_bert_impl as bi
from modeling_bert_impl import BertImplConfig
from helpers import needs_tracing

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

TOL = 1e-4
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64, num_labels=3)
CLASSES = ["BertImplModel", "BertImplForPreTraining", "BertImplForMaskedLM", "BertImplForNextSentencePrediction",
           "BertImplForSequenceClassification", "BertImplForTokenClassification", "BertImplForQuestionAnswering",
           "BertImplForMultipleChoice"]
PER_POSITION = ["BertImplModel", "BertImplForPreTraining", "BertImplForMaskedLM", "BertImplForTokenClassification",
                "BertImplForQuestionAnswering"]  # the classes with outputs at every position


@pytest.fixture(scope="module", autouse=True)
def onnx_op_table_built_once():
    """torch.onnx rebuilds its table of ONNX functions from onnxscript on every export (most of an export's time for
    a model this small); the table does not change within a process, so the tests build it once."""
    from torch.onnx._internal.exporter import _registration

    # A private function of torch's: where a torch version has no such function, the tests run without the cache.
    module = getattr(_registration, "_torchlib_registry", None)
    original = getattr(module, "get_torchlib_ops", None)
    if original is None:
        yield
        return
    module.get_torchlib_ops = functools.cache(original)
    yield
    module.get_torchlib_ops = original


def padded_batch(lengths: list[int], seed: int, choices: int | None = None) -> dict:
    """Random ids right-padded to the longest of `lengths`, (B, T); (B // choices, choices, T) for multiple choice."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, TINY["vocab_size"], mask.shape, generator=g) * mask
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": (torch.arange(T) >= T // 2).long() * mask}
    return {k: v.view(-1, choices, T) for k, v in batch.items()} if choices else batch


def holed_batch(B: int, T: int, seed: int, choices: int | None = None) -> dict:
    """transformers' model-tester inputs: random ids and token types, a random attention mask (zeros anywhere, the
    last position a token, as `random_attention_mask` makes it); (B, choices, T) for multiple choice."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, choices, T) if choices else (B, T)
    mask = torch.randint(0, 2, shape, generator=g)
    mask[..., -1] = 1
    return {"input_ids": torch.randint(0, TINY["vocab_size"], shape, generator=g), "attention_mask": mask,
            "token_type_ids": torch.randint(0, 2, shape, generator=g)}


def every_element(got, expected) -> tuple[int, float]:
    """All outputs (nested tuples of tensors or arrays), every element: asserts each within atol = rtol = TOL of
    eager (transformers' export tests allow 5% of elements outside) and returns (elements compared, max |diff|)."""
    got, expected = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)
    assert len(got) == len(expected)
    count, worst = 0, 0.0
    for g, e in zip(got, expected):
        g = torch.as_tensor(g)
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, atol=TOL, rtol=TOL)
        count, worst = count + e.numel(), max(worst, (g - e).abs().max().item())
    return count, worst


def max_diff(got, expected, mask) -> float:
    """max |diff|, over the real tokens where the tensors are (B, T, ...) like the mask."""
    got, expected = torch.as_tensor(got), torch.as_tensor(expected)
    if got.shape[:mask.dim()] == mask.shape:
        got, expected = got[mask.bool()], expected[mask.bool()]
    return (got - expected).abs().max().item()


def build_class(name: str, **config):
    """A tiny model of the class, eval mode, every layer's hidden states in its outputs."""
    torch.manual_seed(0)
    num_labels = 2 if name == "BertImplForQuestionAnswering" else 3
    config = BertImplConfig(**{**TINY, "num_labels": num_labels, "output_hidden_states": True, **config})
    return getattr(bi, name)(config).eval()


def export_class(name: str):
    """The model, its exported program with dynamic batch and sequence dims, and the same as an ONNX program."""
    model = build_class(name)
    config = model.config
    choices = 2 if name == "BertImplForMultipleChoice" else None
    example = holed_batch(4, 9, seed=0, choices=choices)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=config.max_position_embeddings)
    dims = {0: batch, 2: seq} if choices else {0: batch, 1: seq}
    with torch.no_grad():
        program = torch.export.export(model, (), example, dynamic_shapes={k: dims for k in example})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(program, dynamo=True, verbose=False)
    return model, program, onnx_program, choices


@pytest.mark.parametrize("name", [name if name in ("BertImplModel", "BertImplForSequenceClassification") else
                                  pytest.param(name, marks=pytest.mark.slow) for name in CLASSES])  # 5-7 s each
@needs_tracing
def test_every_class_exports_with_dynamic_shapes_and_runs_in_onnxruntime(name, tmp_path):
    """Every output element, hidden states included, on another B and T than the example, against eager (unpadded)."""
    model, program, onnx_program, choices = export_class(name)
    batch = holed_batch(6, 13, seed=1, choices=choices)
    with torch.no_grad():
        expected = model(**batch).to_tuple()
        every_element(program.module()(**batch).to_tuple(), expected)

    path = tmp_path / "model.onnx"
    onnx_program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(batch)
    every_element(session.run(None, {k: v.numpy() for k, v in batch.items()}), expected)


def exact_layout(monkeypatch):
    """Make the padding-free encoder take the exact layout (P = nnz, the varlen kernel) on CPU too."""
    from modeling_bert_impl import layouts

    monkeypatch.setattr(layouts, "bucketed", lambda x: False)


@pytest.mark.parametrize("name", CLASSES)
@needs_tracing
def test_every_path_gives_eager_answer_at_every_position(name, monkeypatch):
    """One behaviour at padding on every path: each path's outputs, every element, against eager's (unpadded,
    bucketed layout on CPU) on a batch with holes in its masks."""
    model = build_class(name)
    choices = 2 if name == "BertImplForMultipleChoice" else None
    batch = holed_batch(5, 7, seed=2, choices=choices)
    with torch.no_grad():
        expected = model(**batch).to_tuple()
        padded = build_class(name, unpad_inputs=False)
        every_element(padded(**batch).to_tuple(), expected)  # padded sdpa
        padded.set_attn_implementation("eager")
        every_element(padded(**batch).to_tuple(), expected)  # padded eager attention
        every_element(padded(**batch, output_attentions=True).to_tuple()[:len(expected)], expected)
        every_element(torch.export.export(model, (), batch).module()(**batch).to_tuple(), expected)  # static shapes
        if name in PER_POSITION:  # (the pooled heads' compiled graphs are the encoder's, then one linear layer)
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            every_element(compiled(**batch).to_tuple(), expected)  # bucketed layout, its host steps as custom ops
        exact_layout(monkeypatch)  # (the layout torch.compile takes for training)
        every_element(model(**batch).to_tuple(), expected)


@needs_tracing
def test_static_export_also_with_the_padded_path():
    """Static shapes, and `unpad_inputs=False` (which the issue found failing too)."""
    torch.manual_seed(0)
    model = bi.BertImplModel(BertImplConfig(**TINY, unpad_inputs=False)).eval()
    batch = padded_batch([6, 3, 6], seed=2)
    with torch.no_grad():
        program = torch.export.export(model, (), batch)
        got, expected = program.module()(**batch), model(**batch)
    assert max_diff(got.last_hidden_state, expected.last_hidden_state, batch["attention_mask"]) <= TOL
    assert max_diff(got.pooler_output, expected.pooler_output, batch["attention_mask"]) <= TOL


@needs_tracing
def test_a_row_of_padding_only_is_zeros_on_every_path(monkeypatch):
    """Hidden states of a row without a token are zeros, and it pools a zero vector, on every path."""
    model = build_class("BertImplModel")
    batch = padded_batch([6, 0, 3, 6], seed=3)
    zeros = torch.zeros(4, 6, TINY["hidden_size"])
    expected = (zeros, torch.tanh(model.pooler.dense.bias).expand(4, -1))  # where the mask is 0
    padded = build_class("BertImplModel", unpad_inputs=False)
    with torch.no_grad():
        outputs = {"unpadded": model(**batch), "padded": padded(**batch),
                   "exported": torch.export.export(model, (), batch).module()(**batch)}
        exact_layout(monkeypatch)
        outputs["exact layout"] = model(**batch)
    padding, empty = batch["attention_mask"] == 0, batch["attention_mask"].sum(-1) == 0
    for path, out in outputs.items():
        assert torch.equal(out.last_hidden_state[padding], expected[0][padding]), path
        assert all(torch.equal(h[padding], expected[0][padding]) for h in out.hidden_states), path
        torch.testing.assert_close(out.pooler_output[empty], expected[1][empty], atol=0, rtol=0, msg=path)
        every_element(out.to_tuple(), outputs["unpadded"].to_tuple())


@pytest.mark.parametrize("backend", ["dynamo", "onnx"])
@needs_tracing
def test_transformers_exporters(backend, tmp_path):
    """transformers' own exporters (`transformers.exporters`, new in v5: `torch.export` and ONNX run in onnxruntime),
    which the issue found failing for our classes: dynamic shapes, an export and a reloaded export against eager on
    another batch and sequence length than the example."""
    exporters = pytest.importorskip("transformers.exporters",
                                    reason=f"transformers {transformers.__version__} has no transformers.exporters")
    if not hasattr(exporters, "ExportedModel"):  # the exporters' save/load API this test uses
        pytest.skip(f"transformers {transformers.__version__} has no transformers.exporters.ExportedModel (5.23 on)")

    exporter, config = {"dynamo": (exporters.DynamoExporter, exporters.DynamoConfig),
                        "onnx": (exporters.OnnxExporter, exporters.OnnxConfig)}[backend]
    torch.manual_seed(0)
    model = bi.BertImplModel(BertImplConfig(**TINY)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = exporter().export(model, padded_batch([7, 5, 3], seed=0), config(dynamic=True))
    exported.save_pretrained(tmp_path)
    # A saved dynamo program is a pickle, which runs code when it is loaded: from transformers 5.24 on, loading one
    # takes trust_remote_code=True (exporters that need it say so). Load only programs you saved yourself, as here.
    trust = {"trust_remote_code": True} if getattr(exporter, "requires_trust_remote_code", False) else {}
    reloaded = exporters.ExportedModel.from_pretrained(tmp_path, **trust)
    batch = padded_batch([11, 4, 9, 2, 6], seed=1)
    with torch.no_grad():
        expected = model(**batch)
    for outputs in (exported(**batch), reloaded(**batch)):
        assert type(outputs) is type(expected) and list(outputs.keys()) == list(expected.keys())
        for key in expected.keys():
            got = torch.as_tensor(outputs[key])
            assert got.shape == expected[key].shape and max_diff(got, expected[key], batch["attention_mask"]) <= TOL


# ---------------------------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): padded and packed batches, no recompilation per batch
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return bi.BertImplModel(BertImplConfig(**TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()


@needs_tracing
def test_compiled_fullgraph_padded_batches_match_eager_without_recompiling(tiny_model):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # process-wide: other tests' compilations count there too
    compiled = torch.compile(tiny_model, fullgraph=True, backend="aot_eager", dynamic=True)
    for seed, lengths in enumerate([[9, 3, 14, 6], [5, 20, 7], [11, 2, 30, 8, 8]]):
        batch = padded_batch(lengths, seed)
        with torch.no_grad():
            got, expected = compiled(**batch), tiny_model(**batch)
        assert max_diff(got.last_hidden_state, expected.last_hidden_state, batch["attention_mask"]) <= 1e-5
        assert max_diff(got.pooler_output, expected.pooler_output, batch["attention_mask"]) <= 1e-5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # three shapes, one graph

    # training under compile (the exact layout): same outputs and gradients as eager
    batch = padded_batch([9, 3, 14, 6], 0)
    grads = []
    for model in (compiled, tiny_model):
        tiny_model.zero_grad()
        out = model(**batch)
        (out.last_hidden_state.sum() + out.pooler_output.sum()).backward()
        grads.append([p.grad.clone() for p in tiny_model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    assert all((a - b).abs().max() <= 1e-5 * max(1, b.abs().max()) for a, b in zip(*grads))


@pytest.mark.parametrize("marker", ["position_ids", "cu_seq_lens_q", "seq_idx"])
@needs_tracing
def test_compiled_fullgraph_packed_batches_match_eager(tiny_model, marker):
    options = {"position_ids": {}, "cu_seq_lens_q": {"return_flash_attn_kwargs": True},
               "seq_idx": {"return_seq_idx": True}}[marker]
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(1, 99, (n,), generator=g).tolist() for n in (7, 19, 3, 11)]
    packed = DataCollatorWithFlattening(**options)([{"input_ids": s} for s in sequences])
    packed.pop("labels")
    torch._dynamo.reset()
    compiled = torch.compile(tiny_model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got, expected = compiled(**packed), tiny_model(**packed)
    assert got.pooler_output.shape == (4, 32)  # one row per packed sequence
    assert (got.last_hidden_state - expected.last_hidden_state).abs().max() <= 1e-5
    assert (got.pooler_output - expected.pooler_output).abs().max() <= 1e-5


@needs_tracing
def test_compiled_model_refuses_bad_values_with_a_traced_assert(tiny_model):
    torch._dynamo.reset()
    compiled = torch.compile(tiny_model, fullgraph=True, backend="aot_eager")
    batch = padded_batch([4, 6], seed=4)
    batch["input_ids"][0, 1] = 99  # outside the vocabulary of 99
    with pytest.raises(RuntimeError, match="out of range"), torch.no_grad():
        compiled(**batch)


# ---------------------------------------------------------------------------------------------------------------------
# The export command, end to end on a folder made from MiniLM
# ---------------------------------------------------------------------------------------------------------------------
@needs_tracing
@pytest.mark.slow
def test_export_command_on_minilm(minilm_dir, tmp_path):
    model_dir, out = tmp_path / "classifier", tmp_path / "onnx"
    torch.manual_seed(0)
    bi.BertImplForSequenceClassification.from_pretrained(minilm_dir, num_labels=2).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(model_dir)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "modeling_bert_impl.integrations.export", str(model_dir), str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max |diff|" in proc.stdout
    assert (out / "model.onnx").exists() and (out / "tokenizer.json").exists()

    # The written model in onnxruntime, on text the command never saw, against PyTorch.
    tokenizer = AutoTokenizer.from_pretrained(out)
    texts = ["Export to ONNX, then serve.", "A much longer sentence, so that the batch is padded on the other row."]
    batch = tokenizer(texts, padding=True, return_tensors="np")
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {i.name: batch[i.name] for i in session.get_inputs()})[0]
    model = bi.BertImplForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in batch.items()}).logits.numpy()
    assert np.abs(logits - expected).max() <= TOL
    assert json.loads((out / "export.json").read_text())["max_abs_diff"] <= TOL

    # A second run into the same folder is refused unless told
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode != 0 and "--overwrite" in again.stderr


def test_torchscript_exporter_under_no_grad_gives_plain_operators(tmp_path):
    """`torch.onnx.export(dynamo=False)` (TorchScript's tracer, as optimum's exporters run it) under `torch.no_grad()`:
    CPU inference's packed and fused paths stay out of the traced graph (oneDNN's own ops have no ONNX form), and the
    graph gives the model's outputs in onnxruntime."""
    torch.manual_seed(0)
    model = bi.BertImplModel(BertImplConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=37)).eval()
    ids = torch.randint(1, 99, (1, 9))

    class LastHiddenState(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).last_hidden_state

    path = str(tmp_path / "model.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings on the host reads of the input checks
        expected = model(input_ids=ids).last_hidden_state  # the fused path, eagerly
        torch.onnx.export(LastHiddenState().eval(), (ids,), path, dynamo=False, opset_version=17,
                          input_names=["input_ids"])
    got = ort.InferenceSession(path).run(None, {"input_ids": ids.numpy()})[0]
    assert np.abs(got - expected.numpy()).max() < 1e-5


def test_console_script_entry_point_resolves(capsys):
    """pyproject's `bert-impl-export` names a function that exists (modeling_bert_impl.integrations.export:main) and
    that parses the command line as documented. (Read from pyproject.toml, not from the installed script, which is
    only rewritten when the package is installed again.)"""
    import importlib
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["bert-impl-export"].partition(":")
    main = getattr(importlib.import_module(module), function)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: bert-impl-export") and "--task" in usage and "text-classification" in usage
    description = " ".join(usage.split("\n\n")[1].split())
    assert description.endswith("checked against PyTorch in onnxruntime.")  # a whole sentence
    assert "RoBERTa" in " ".join(usage.split())  # MODEL's help names the families it exports


def test_the_export_command_without_onnx_says_what_to_install(tmp_path, monkeypatch):
    """Without onnx (or onnxscript, or onnxruntime) the command stops with what to install, the `export` extra that
    pyproject.toml declares with all three, instead of a ModuleNotFoundError from inside torch.onnx."""
    import importlib.util
    import tomllib
    from pathlib import Path

    from modeling_bert_impl.integrations import export

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"ONNX export needs onnx, which is not installed: pip install "
                                         r"'bert-impl\[export\]'"):
        export.main(["some-model", str(tmp_path / "out")])
    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {requirement.split(">")[0] for requirement in extras["export"]} == set(export.EXPORTERS)
