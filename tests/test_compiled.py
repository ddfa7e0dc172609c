"""compile_for_inference (modeling_bert_impl/inference/compiled_encoder.py): an inference model whose encoder runs as a
program compiled ahead of time by AOTInductor. Every head gives the outputs of its eager path; the program runs where
it may (batch 1, dense batches, an int8 model's padded batches by groups of similar length) and nowhere else (float32's
padded batches, hidden states or attention maps asked for, inputs that need gradients, hooks, replaced modules,
another dtype, packed batches, rows of padding only); the model given is left as it was, and changing it afterwards
never changes the compiled model's answers; training or saving the compiled model is refused; packages are reused,
never written over, and refused for other weights; damaged, cut off, empty and foreign files are refused by name before
any of their code runs; bad ids are named as eagerly; in int8, a NaN in one row stays in that row.

Each compile takes 20-45 s on 2 cores: of a 2-layer model, two packages (with a pooler and without: conftest's
`small_packages`) that most tests load, an int8 one and one with a LoRA adapter merged in, all four conftest's and
shared with test_avx2_gemm.py; and one of all-MiniLM-L6-v2."""

import copy
import inspect
import os
import pickle
import random
import re
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_outputs import BaseModelOutputWithPooling

import modeling_bert_impl as bi
from modeling_bert_impl.inference import avx2_gemm, compiled_encoder, fused_layers
from modeling_bert_impl.inference.anatomy import encoder_linears

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import (  # noqa: E402
    BF16_SENTENCE_COSINE, BF16_TOKEN_COSINE, HEADS, LAYOUTS, NAN_TOKEN, SMALL, layout_inputs, needs_tracing,
    numpy_writes_are_refused, output_tensors, program_calls, small_ids, small_int8_model, small_lora, small_model,
)

pytestmark = needs_tracing

WITHOUT_POOLER = ("BertImplForMaskedLM", "BertImplForTokenClassification", "BertImplForQuestionAnswering")


@pytest.fixture(scope="module")
def packages(small_packages):
    """Packages compiled from the SMALL encoder's weights (`encoder_state`), with and without its pooler: conftest's
    `small_packages`, which test_avx2_gemm.py loads too."""
    return small_packages


def compiled(our_name: str, packages, encoder_state, **config):
    """A head on the SMALL encoder's weights (its own layers seeded), compiled from the packages."""
    torch.manual_seed(1)
    model = getattr(bi, our_name)(bi.BertImplConfig(**{**SMALL, **config}))
    model.base_model.load_state_dict(encoder_state, strict=False)
    return bi.compile_for_inference(model, packages[our_name not in WITHOUT_POOLER])


def program_runs(attention_mask: torch.Tensor) -> int:
    """How many times the program runs for a batch: once without padding, else once per group of the eager layout."""
    lengths = attention_mask.flatten(0, -2).sum(-1)
    if (lengths == attention_mask.shape[-1]).all():
        return 1
    return len(bi.bert_padding.length_groups(lengths.tolist(), bi.bert_padding.BUCKET_GROUP_COST))


@contextmanager
def uncompiled(model):
    """The compiled program set aside: calls take the eager path."""
    base = model.base_model
    encoder, base.compiled_encoder = base.compiled_encoder, None
    try:
        yield
    finally:
        base.compiled_encoder = encoder


def eager(model, **inputs):
    with uncompiled(model):
        return model(**inputs)


def assert_same_outputs(got, expected):
    got, expected = output_tensors(got), output_tensors(expected)
    assert got.keys() == expected.keys() and got
    for name, e in expected.items():
        assert got[name].shape == e.shape, name
        assert (got[name] - e).abs().max().item() < 1e-5, name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stock_name,our_name,auto_name", HEADS, ids=[h[1] for h in HEADS])
def test_every_head_runs_the_program_where_nothing_is_padded(packages, encoder_state, stock_name, our_name, auto_name,
                                                             layout):
    num_labels = 2 if "Question" in our_name else 3
    model = compiled(our_name, packages, encoder_state, num_labels=num_labels)
    calls = program_calls(model)
    inputs = layout_inputs(stock_name, model.config, layout, torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got, expected = model(**inputs), eager(model, **inputs)
        tuples = model(**{**inputs, "attention_mask": inputs["attention_mask"].bool()}, return_dict=False)
    assert len(calls) == (0 if layout == "padded" else 2)  # float32: padded batches keep the eager path
    assert_same_outputs(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(tuples, got.to_tuple()))


@pytest.mark.parametrize("pooled", [torch.randn(2, 4), None], ids=["pooled", "not pooled"])
def test_the_output_object_is_the_constructors(pooled):
    """The compiled path builds its BaseModelOutputWithPooling without the dataclass's bookkeeping: the same object."""
    hidden = torch.randn(2, 3, 4)
    got, expected = compiled_encoder.model_output(hidden, pooled), BaseModelOutputWithPooling(hidden, pooled)
    assert type(got) is type(expected)
    assert list(got.items()) == list(expected.items()) and vars(got) == vars(expected)
    assert got.to_tuple() == expected.to_tuple() and got[0] is hidden and got.pooler_output is pooled
    assert torch.utils._pytree.tree_flatten(got) == torch.utils._pytree.tree_flatten(expected)
    again = pickle.loads(pickle.dumps(got))
    assert list(again.keys()) == list(expected.keys()) and torch.equal(again.last_hidden_state, hidden)
    got.hidden_states = (hidden,)  # assigning a field later makes it an item, as with the constructor's object
    assert list(got.keys()) == ["last_hidden_state", *(["pooler_output"] if pooled is not None else []),
                                "hidden_states"]


def padded_batch(seed: int) -> dict:
    """A padded batch of the SMALL vocabulary with right and left padding and a hole, each row its own positions and
    token types, whose lengths make several groups of the eager layout."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([2, 3, 3, 9, 14, 16, 16, 30])
    B, T = len(lengths), 32
    mask = (torch.arange(T) < lengths[:, None]).long()
    mask[1] = mask[1].flip(0)  # left padding
    mask[4, 5:8] = 0  # a hole
    ids = torch.randint(1, NAN_TOKEN, (B, T), generator=g) * mask
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.randint(0, 2, (B, T), generator=g),
                position_ids=torch.arange(T) + torch.randint(0, 30, (B, 1), generator=g))


def test_rows_keep_their_own_positions(packages, encoder_state):
    """A dense batch whose rows have their own positions gives the eager path's outputs (AOTInductor compiles for its
    example's strides: an example expanded over the batch made the program read every row's positions from row 0);
    the same batch padded takes the eager path in float32."""
    model = compiled("BertImplModel", packages, encoder_state)
    calls = program_calls(model)
    padded = padded_batch(seed=4)
    dense = {k: v[:3, :20] for k, v in padded.items() if k != "attention_mask"}  # 60 tokens: within `token_limit`
    with torch.no_grad():
        got, expected = model(**dense), eager(model, **dense)
        got_padded, expected_padded = model(**padded), eager(model, **padded)
    assert len(calls) == 1
    assert_same_outputs(got, expected)
    assert_same_outputs(got_padded, expected_padded)


STEP_ASIDE = {
    "hidden states": lambda model, inputs: model(**inputs, output_hidden_states=True),
    "attention maps": lambda model, inputs: model(**inputs, output_attentions=True),
    "inputs_embeds": lambda model, inputs: model(inputs_embeds=model.embeddings.word_embeddings(inputs["input_ids"])),
    "one token": lambda model, inputs: model(input_ids=inputs["input_ids"][:, :1]),
    "padding in float32": lambda model, inputs: model(input_ids=inputs["input_ids"], attention_mask=torch.tensor(
        [[1] * 9, [1] * 9, [1] * 5 + [0] * 4])),
    "positions of a packed row": lambda model, inputs: model(
        input_ids=inputs["input_ids"][:1], position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])),
    "cu_seq_lens": lambda model, inputs: model(
        input_ids=inputs["input_ids"][:1], cu_seq_lens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
        cu_seq_lens_k=torch.tensor([0, 4, 9], dtype=torch.int32), max_length_q=5, max_length_k=5),
}


@pytest.mark.parametrize("case", STEP_ASIDE)
def test_the_program_steps_aside(packages, encoder_state, case):
    model = compiled("BertImplModel", packages, encoder_state)
    calls = program_calls(model)
    inputs = {"input_ids": small_ids(3, seed=3)}
    with torch.no_grad():
        got = STEP_ASIDE[case](model, inputs)
        with uncompiled(model):
            expected = STEP_ASIDE[case](model, inputs)
    assert calls == []
    assert_same_outputs(got, expected)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_a_query_padded_to_a_fixed_length_runs_the_program(packages, encoder_state, padding):
    """One query padded to a fixed length (6 real tokens of 9, as servers that pad send it) runs the program once, on
    its real tokens (their positions kept), with the eager path's outputs: zeros at padding, the pooled first real
    token. (Several padded rows in float32 take the eager path: `test_the_program_steps_aside`.)"""
    model = compiled("BertImplForSequenceClassification", packages, encoder_state)
    calls = program_calls(model)
    mask = torch.tensor([[1] * 6 + [0] * 3])
    mask = mask.flip(-1) if padding == "left" else mask
    inputs = {"input_ids": small_ids(1, seed=4) * mask, "attention_mask": mask}
    with torch.no_grad():
        got = model(**inputs, output_hidden_states=False)
        base = model.base_model(**inputs)
        with uncompiled(model):
            expected, expected_base = model(**inputs), model.base_model(**inputs)
    assert len(calls) == 2
    assert_same_outputs(got, expected)
    assert_same_outputs(base, expected_base)
    assert (base.last_hidden_state[mask == 0] == 0).all()


def test_gradients_modes_and_hooks_take_the_eager_path(packages, encoder_state):
    """Inputs that need gradients (the gradients reach them), a module set to training mode, a hook on a module (it
    runs), a patched forward (it runs), the model in float64: the eager path; the program again once nothing observes
    the model. Training the compiled model is refused."""
    model = compiled("BertImplForSequenceClassification", packages, encoder_state)
    calls = program_calls(model)
    inputs = {"input_ids": small_ids(2, seed=4)}
    embeds = model.bert.embeddings.word_embeddings(inputs["input_ids"]).requires_grad_()
    model(inputs_embeds=embeds).logits.sum().backward()
    assert embeds.grad is not None and calls == []
    refused = "train(): this is an inference model made by compile_for_inference"
    with pytest.raises(ValueError, match=re.escape(refused)):
        model.train()
    with torch.no_grad():
        dropout = model.bert.encoder.layer[1].output.dropout
        nn_train = torch.nn.Module.train  # one module in training mode, set past the refusal
        nn_train(dropout)
        model(**inputs)
        nn_train(dropout, False)
        assert calls == []
        expected = model(**inputs).logits
        assert len(calls) == 1
        seen = []
        hook = model.bert.encoder.layer[1].attention.output.LayerNorm.register_forward_hook(
            lambda m, a, out: seen.append(out))
        hooked = model(**inputs).logits
        hook.remove()
        model.bert.embeddings.LayerNorm.forward = lambda x: torch.zeros_like(x)  # a patched forward
        patched = model(**inputs).logits
        del model.bert.embeddings.LayerNorm.forward
        double = copy.deepcopy(model).double()
        double_calls = program_calls(double)
        got_double = double(**inputs).logits
        assert len(calls) == 1 and len(seen) == 1 and torch.allclose(hooked, expected, atol=1e-5)
        assert (patched - expected).abs().max() > 1e-3  # the patch ran
        assert double_calls == [] and got_double.dtype == torch.float64
        assert (got_double - expected).abs().max() < 1e-5
        model(**inputs)
    assert len(calls) == 2  # the program again once nothing observes the model


UPDATES = {
    "through the parameter": lambda model: model.base_model.encoder.layer[0].attention.self.value.weight.mul_(1.1),
    "through .data": lambda model: model.base_model.encoder.layer[1].output.dense.weight.data[3:5].mul_(1.5),
    "a LayerNorm's bias": lambda model: model.base_model.encoder.layer[1].output.LayerNorm.bias.add_(0.1),
    "load_state_dict": lambda model: model.load_state_dict(
        {k: v + 0.01 for k, v in model.state_dict().items()}),
    "a new parameter": lambda model: setattr(model.base_model.encoder.layer[0].intermediate.dense, "weight",
                                             torch.nn.Parameter(
                                                 model.base_model.encoder.layer[0].intermediate.dense.weight * 0.9)),
    "a new module": lambda model: model.base_model.encoder.layer[0].attention.output.__setattr__(
        "dense", torch.nn.Linear(32, 32)),
    "the model in float64": lambda model: model.double(),
}


@pytest.mark.parametrize("update", UPDATES)
def test_changing_the_model_never_changes_the_compiled_model(packages, encoder_state, update):
    """After the compiled model answered, the model it was compiled from changes (an optimizer's update, an update
    through `.data` of two rows, a norm's bias, load_state_dict, a new parameter or module, float64): the model
    answers with the change, the compiled model runs its program with the answers it gave."""
    torch.manual_seed(1)
    model = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
    model.load_state_dict(encoder_state)
    compiled_model = bi.compile_for_inference(model, packages[True])
    calls = program_calls(compiled_model)
    inputs = {"input_ids": small_ids(1, seed=5)}
    with torch.no_grad():
        before = compiled_model(**inputs).last_hidden_state
        UPDATES[update](model)
        got, changed = compiled_model(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    assert len(calls) == 2
    assert torch.equal(got, before)
    if update == "the model in float64":
        assert changed.dtype == torch.float64 and got.dtype == torch.float32
    else:
        assert (changed - before).abs().max() > 1e-4


@pytest.mark.parametrize("name, change", [
    ("bert.encoder.layer.0.attention.output.LayerNorm.bias", lambda t: t.add_(0.1)),
    ("bert.encoder.layer.1.output.dense.weight", lambda t: t.data[3:5].mul_(1.5)),
], ids=["a norm's bias", "a product's weight, through .data"])
def test_a_weight_of_the_compiled_model_changed_in_place_is_refused_at_the_next_call(packages, encoder_state, name,
                                                                                     change):
    """The compiled model's own weight changed in place after its first answer (through the tensor, or its `.data`):
    its next call is refused, naming the weight (test_serving.py has each kind of change, on the other engines)."""
    model = compiled("BertImplForSequenceClassification", packages, encoder_state)
    inputs = {"input_ids": small_ids(2, seed=6)}
    with torch.no_grad():
        model(**inputs)
        change(model.get_parameter(name))
        refusal = f"`{name}` was changed in place after compile_for_inference made this inference model"
        with pytest.raises(ValueError, match=re.escape(refusal)):
            model(**inputs)


@pytest.mark.parametrize("write", ["np.copyto into numpy()", "a row of a view"])
def test_a_write_through_numpy_into_the_compiled_model_is_refused(packages, encoder_state, write):
    """The compiled model's weights are read-only to NumPy, as the other engines' are (test_serving.py): a write
    through NumPy used to leave the program on the old weights while its eager path read the new ones, so that one
    sentence and a batch disagreed."""
    model = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
    model.load_state_dict(encoder_state)
    numpy_writes_are_refused(bi.compile_for_inference(model, packages[True]), model, write)


REPLACEMENTS = {  # changes made to the compiled model itself: the eager path, with them
    "a new parameter": UPDATES["a new parameter"],
    "a new module": UPDATES["a new module"],
}


@pytest.mark.parametrize("replacement", REPLACEMENTS)
def test_replaced_modules_and_parameters_take_the_eager_path(packages, encoder_state, replacement):
    model = compiled("BertImplModel", packages, encoder_state)
    calls = program_calls(model)
    inputs = {"input_ids": small_ids(1, seed=5)}
    with torch.no_grad():
        before = model(**inputs).last_hidden_state
        REPLACEMENTS[replacement](model)
        got = model(**inputs).last_hidden_state
        expected = eager(model, **inputs).last_hidden_state
    assert len(calls) == 1
    assert torch.equal(got, expected) and (got - before).abs().max() > 1e-4


def test_peft_adapters_take_the_eager_path_and_merged_models_compile(packages, encoder_state,
                                                                     small_lora_merged_package):
    """Adapters put on the compiled model: the eager path, with them (as on the plain model). Merged into the model it
    was compiled from and compiled again (conftest's `small_lora_merged_package`): the program, with the adapted
    outputs."""
    torch.manual_seed(1)
    plain = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
    plain.load_state_dict(encoder_state)
    model = bi.compile_for_inference(plain, packages[True])
    calls = program_calls(model)
    merged, _ = small_lora_merged_package
    merged_calls = program_calls(merged)
    inputs = {"input_ids": small_ids(2, seed=6)}
    with torch.no_grad():
        before = model(**inputs).last_hidden_state
        adapted = small_lora(model)(**inputs).last_hidden_state
        expected = small_lora(plain)(**inputs).last_hidden_state
        got = merged(**inputs).last_hidden_state
    assert len(calls) == 1 and len(merged_calls) == 1
    assert (adapted - before).abs().max() > 1e-3
    assert (adapted - expected).abs().max() < 1e-5 and (got - expected).abs().max() < 1e-5


def test_compiling_without_a_path_leaves_no_file_behind(small_lora_merged_package):
    """`compile_for_inference(model)` compiles into a temporary folder (conftest's `small_lora_merged_package`): gone
    once the program is loaded, which still runs."""
    model, folders = small_lora_merged_package
    ours = [folder for folder in folders if os.path.basename(folder).startswith("bert_impl_")]
    assert len(ours) == 1 and not os.path.exists(ours[0])
    calls = program_calls(model)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=small_ids(2, seed=3)).last_hidden_state).all()
    assert len(calls) == 1


def test_bad_ids_are_named_and_the_program_still_serves(packages, encoder_state):
    model = compiled("BertImplModel", packages, encoder_state)
    calls = program_calls(model)
    ids = small_ids(2, seed=7)
    bad = ids.clone()
    bad[1, 4] = SMALL["vocab_size"] + 5
    with torch.no_grad():
        with pytest.raises(ValueError, match=f"token id {SMALL['vocab_size'] + 5} is outside the vocabulary"):
            model(input_ids=bad)
        with pytest.raises(ValueError, match="token type id 2 is outside"):
            model(input_ids=ids, token_type_ids=torch.full_like(ids, 2))
        with pytest.raises(ValueError, match="attention_mask"):  # not all ones: the eager path, which refuses a 2
            model(input_ids=ids, attention_mask=torch.full_like(ids, 2))
        got = model(input_ids=ids)
        expected = eager(model, input_ids=ids)
    assert len(calls) == 1  # the good one: the program never sees an id out of range (the eager path names it)
    assert_same_outputs(got, expected)


def test_a_failure_of_the_program_reaches_the_caller(packages, encoder_state):
    """The program is run only where it answers (`program_inputs`), so an error from it is the caller's to see, never
    taken as a reason to run the eager path instead."""
    model = compiled("BertImplModel", packages, encoder_state)
    encoder = model.base_model.compiled_encoder

    def failing(args):
        raise RuntimeError("the program failed")

    encoder.run, run = failing, encoder.run
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match="the program failed"):
            model(input_ids=small_ids(2, seed=7))
    finally:
        encoder.run = run


def test_packages_are_reused_and_never_written_over(packages, encoder_state, tmp_path):
    path = packages[True]
    stat = os.stat(path)
    model = compiled("BertImplModel", packages, encoder_state)  # loaded, not compiled
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns
    other = bi.BertImplModel(bi.BertImplConfig(**SMALL))  # other weights
    with pytest.raises(ValueError, match=re.escape(f"package_path: {path} was compiled from another model or weights")):
        bi.compile_for_inference(other, path)
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns and type(other) is bi.BertImplModel
    longer = bi.BertImplModel(bi.BertImplConfig(**{**SMALL, "max_position_embeddings": 128}))
    with pytest.raises(ValueError, match="another model or weights"):
        bi.compile_for_inference(longer, path)
    # saving is refused (the model it was made from saves the same weights); a copy shares the program (both run it)
    with pytest.raises(ValueError, match="save the model you passed to compile_for_inference"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    ids = small_ids(1, seed=8)
    duplicate = copy.deepcopy(model)
    calls = program_calls(duplicate)
    with torch.no_grad():
        assert_same_outputs(duplicate(input_ids=ids), model(input_ids=ids))
    assert len(calls) == 2


def test_loaded_compiled_and_called_under_inference_mode(packages, encoder_state):
    """A serving function decorated with torch.inference_mode() that loads the model, compiles it (here: loads the
    package) and calls it: the program runs, with the eager path's outputs."""
    with torch.inference_mode():
        torch.manual_seed(1)
        model = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
        model.load_state_dict(encoder_state)
        compiled_model = bi.compile_for_inference(model, packages[True])
        calls = program_calls(compiled_model)
        ids = small_ids(2, seed=9)
        got, expected = compiled_model(input_ids=ids), model(input_ids=ids)
    assert len(calls) == 1
    assert_same_outputs(got, expected)


def test_a_package_of_another_format_is_refused(packages, encoder_state, monkeypatch):
    monkeypatch.setattr(compiled_encoder, "FORMAT", "bert-impl compiled model 5")
    with pytest.raises(ValueError, match=re.escape("compiled from another package format (format 'bert-impl compiled "
                                                   "model 7', here 'bert-impl compiled model 5')")):
        compiled("BertImplModel", packages, encoder_state)


def test_a_package_for_other_cpu_instructions_is_refused(packages, encoder_state, monkeypatch):
    """The package's code uses the vector instructions of the CPU that compiled it (AVX-512 code stops an AVX2 CPU
    with an illegal instruction): elsewhere it is refused, by name."""
    here = compiled_encoder.cpu_instructions()
    assert here.split()[0] == torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(compiled_encoder, "cpu_instructions", lambda: "AVX512 VNNI" if here == "AVX2" else "AVX2")
    with pytest.raises(ValueError, match=re.escape(f"compiled from another CPU instruction set (cpu {here!r}, here")):
        compiled("BertImplModel", packages, encoder_state)


def rewritten(package: str, path: Path, change) -> None:
    """A copy of `package` at `path`, each entry's bytes replaced by `change(name, data)` (zip CRCs recomputed)."""
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(path, "w") as copy:
        for info in source.infolist():
            copy.writestr(info, change(info.filename, source.read(info)))


@pytest.fixture
def refuses_loading(monkeypatch):
    """No package is loaded (AOTInductor's loader fails the test)."""
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda *a: pytest.fail("the package was loaded"))


DAMAGE = {  # a file at the package's path -> what the refusal says about it
    "empty": (lambda data: b"", r"is empty \(0 bytes\)"),
    "random bytes": (lambda data: random.Random(0).randbytes(4096), r"is not a zip archive \(it begins with b'"),
    "cut off": (lambda data: data[:len(data) // 2], "is cut off at byte {half}: it begins as a zip archive"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_files_are_named_before_loading(packages, encoder_state, tmp_path, refuses_loading, damage):
    """An empty file, random bytes, a package cut off halfway: a ValueError with the path, what is wrong and what to
    do; nothing loaded."""
    change, message = DAMAGE[damage]
    data = Path(packages[True]).read_bytes()
    path = tmp_path / "damaged.pt2"
    path.write_bytes(change(data))
    message = message.format(half=len(data) // 2)
    with pytest.raises(ValueError, match=rf"package_path: {re.escape(str(path))} {message}.*compile the model there"):
        bi.compile_for_inference(bi.BertImplModel(bi.BertImplConfig(**SMALL)), path)


@pytest.mark.parametrize("crc", ["recomputed", "stale"])
def test_flipped_weight_bytes_are_refused(packages, encoder_state, tmp_path, refuses_loading, monkeypatch, crc):
    """The word embeddings' bytes inside the package's shared object negated, the zip CRCs recomputed (refused by the
    SHA-256 written at compile time) or left as they were (refused by the CRC). Loaded without the checks, the package
    would answer with the changed weights: what they guard against."""
    weights = encoder_state["embeddings.word_embeddings.weight"]
    before, after = weights.numpy().tobytes(), (-weights).numpy().tobytes()
    data = Path(packages[True]).read_bytes()
    assert data.count(before) == 1  # the weights, as they are, in the program
    path = tmp_path / "flipped.pt2"
    if crc == "recomputed":
        rewritten(packages[True], path, lambda name, data: data.replace(before, after))
        message = r"is damaged: its content's SHA-256 is \w+, not the \w+ written when it was compiled"
    else:
        path.write_bytes(data.replace(before, after))
        message = r"is damaged: Bad CRC-32 for file '\S+\.so'"
    torch.manual_seed(1)
    model = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
    model.load_state_dict(encoder_state)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} {message}"):
        bi.compile_for_inference(model, path)
    monkeypatch.undo()
    ids = small_ids(1, seed=40)
    program = compiled_encoder.load_package(str(path), kernels=False)
    with torch.no_grad():
        flipped = program([ids, torch.ones_like(ids), torch.zeros_like(ids), torch.arange(9)[None]])[0]
        assert (flipped - model(input_ids=ids).last_hidden_state).abs().max() > 0.1


CONSTRUCTOR = """#include <stdio.h>
__attribute__((constructor)) static void mark(void) { FILE* f = fopen("MARKER", "w"); if (f) fclose(f); }
"""


def test_a_shared_object_that_does_not_match_its_digest_never_runs(packages, encoder_state, tmp_path):
    """A package whose shared object was replaced by one with a constructor (code that runs as it is loaded), its
    manifest as it was: refused by its digest, the constructor never ran (its marker file stays absent). AOTInductor's
    loader, in another process, runs it."""
    from modeling_bert_impl.inference.compiled_encoder import missing_compiler

    if missing_compiler() is not None:
        pytest.skip("no C++ compiler to build the shared object")
    from torch._inductor.cpp_builder import get_cpp_compiler

    marker, source = tmp_path / "constructor_ran", tmp_path / "constructor.c"
    source.write_text(CONSTRUCTOR.replace("MARKER", str(marker)))
    built = subprocess.run([get_cpp_compiler(), "-x", "c", "-shared", "-fPIC", str(source), "-o",
                            str(tmp_path / "constructor.so")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    code = (tmp_path / "constructor.so").read_bytes()
    path = tmp_path / "constructor.pt2"
    rewritten(packages[True], path, lambda name, data: code if name.endswith(".so") else data)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is damaged: its content's SHA-256"):
        compiled("BertImplModel", {True: str(path)}, encoder_state)
    assert not marker.exists()
    subprocess.run([sys.executable, "-c", f"import torch; torch._inductor.aoti_load_package({str(path)!r})"],
                   capture_output=True)
    assert marker.exists()  # the check is what kept it from running


@pytest.mark.parametrize("kernel", [True, False], ids=["AVX2 kernel", "oneDNN"])
def test_calls_over_the_token_limit_take_the_eager_path(packages, encoder_state, monkeypatch, kernel):
    """On an AVX2 CPU the float32 program serves calls of at most 512 tokens with our kernel's products, 64 with
    oneDNN's (beyond them the eager path is as fast or faster there); int8 and AVX-512 have no limit. A call over the
    limit runs eagerly, with the same outputs."""
    float32 = bi.BertImplModel(bi.BertImplConfig(**SMALL))
    monkeypatch.setattr(avx2_gemm, "chosen", lambda base: kernel and bool(encoder_linears(base.encoder)))
    for capability, limit in (("AVX2", 512 if kernel else 64), ("AVX512", None)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        assert compiled_encoder.token_limit(float32) == limit
        assert compiled_encoder.token_limit(small_int8_model(encoder_state, seed=10)) is None
    monkeypatch.undo()
    model = compiled("BertImplModel", packages, encoder_state)
    model.base_model.compiled_encoder.max_tokens = 18
    calls = program_calls(model)
    for B, runs in ((2, 1), (3, 1), (1, 2)):  # 18 tokens: the program; 27: the eager path; 9: the program
        ids = small_ids(B, seed=20 + B)
        with torch.no_grad():
            got, expected = model(input_ids=ids), eager(model, input_ids=ids)
        assert len(calls) == runs
        assert_same_outputs(got, expected)


def test_dense_batches_run_the_program_in_groups(packages, encoder_state, monkeypatch):
    """A batch without padding of more than CHUNK_TOKENS tokens runs the program once per group of CHUNK_TOKENS // T
    sequences (as the eager path runs its layers), with the outputs of one run and of the eager path."""
    model = compiled("BertImplModel", packages, encoder_state)
    calls = program_calls(model)
    ids = small_ids(5, seed=30)  # (5, 9)
    with torch.no_grad():
        whole = model(input_ids=ids)
        monkeypatch.setattr(fused_layers, "CHUNK_TOKENS", 18)  # two sequences a group: 2 + 2 + 1
        grouped = model(input_ids=ids)
        expected = eager(model, input_ids=ids)
    assert len(calls) == 1 + 3
    assert_same_outputs(grouped, whole)
    assert_same_outputs(grouped, expected)


@pytest.mark.parametrize("vnni", [True, False], ids=["VNNI", "no VNNI"])
def test_int8_products_follow_the_cpu(encoder_state, monkeypatch, vnni):
    """inductor's C++ int8 GEMM template has VNNI micro-kernels and otherwise a scalar one (25x slower than oneDNN's
    qlinear on an AVX2 CPU): the template where the CPU has VNNI, oneDNN elsewhere; float32 on oneDNN everywhere."""
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: vnni)
    configs = compiled_encoder.gemm_configs(small_int8_model(encoder_state, seed=10))
    backends = configs.get("max_autotune_gemm_backends")
    assert (backends is not None and "CPP" in backends.split(",")) if vnni else backends is None, backends
    float32 = bi.BertImplModel(bi.BertImplConfig(**SMALL))
    assert compiled_encoder.gemm_configs(float32) == {}


def test_models_it_cannot_compile_are_refused():
    with pytest.raises(ValueError, match="CPU in float32"):
        bi.compile_for_inference(bi.BertImplModel(bi.BertImplConfig(**SMALL)).double())
    flex = bi.BertImplModel(bi.BertImplConfig(**SMALL, attn_implementation="flex_attention"))
    with pytest.raises(ValueError, match="flex_attention"):
        bi.compile_for_inference(flex)
    with pytest.raises(ValueError, match="not a bert-impl model"):
        bi.compile_for_inference(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"compile_for_inference: dtype=torch.float16 is not supported"):
        bi.compile_for_inference(small_model(0), dtype=torch.float16)


def test_bfloat16_is_refused_without_bfloat16_units_and_for_an_int8_model(encoder_state, monkeypatch):
    monkeypatch.setattr(bi.inference.serving, "cpu_bf16_units", lambda: None)
    with pytest.raises(ValueError, match=r"compile_for_inference: dtype=torch.bfloat16 needs a CPU with AMX or "
                                         r"AVX512-BF16.*use dtype=torch.float32"):
        bi.compile_for_inference(small_model(0), dtype=torch.bfloat16)
    monkeypatch.setattr(bi.inference.serving, "cpu_bf16_units", lambda: "AMX")
    with pytest.raises(ValueError, match=r"dtype: an int8 model \(quantize_for_inference\) compiles with its int8"):
        bi.compile_for_inference(small_int8_model(encoder_state, 10), dtype=torch.bfloat16)


@pytest.mark.skipif(bi.inference.packed_linear.cpu_bf16_units() is None, reason="needs a CPU with AMX or AVX512-BF16 "
                    "(the refusal elsewhere: test_bfloat16_is_refused_without_bfloat16_units_and_for_an_int8_model)")
def test_a_bfloat16_program_stays_within_the_bfloat16_bound_of_float32(encoder_state, tmp_path):
    """compile_for_inference(dtype=torch.bfloat16): the program runs one query, a dense batch and a query padded to a
    fixed length; its products are bfloat16 ones (an output that is not float32's) within the bound stated for
    bfloat16 of the float32 inference model (per-token and mean-pooled cosine); its package says bfloat16, and a
    float32 compile pointed at it is refused naming the precision."""
    model = small_model(0)
    path = tmp_path / "bf16.pt2"
    half, full = bi.compile_for_inference(model, path, dtype=torch.bfloat16), bi.optimize_for_inference(model)
    calls = program_calls(half)
    padded = F.pad(small_ids(1, 2), (0, 3))  # (1, 12): 9 real tokens
    cases = [{"input_ids": small_ids(1, 1)}, {"input_ids": small_ids(4, 3)},
             {"input_ids": padded, "attention_mask": (padded != 0).long()}]
    tokens, sentences = [], []
    with torch.inference_mode():
        for inputs in cases:
            got, expected = half(**inputs).last_hidden_state, full(**inputs).last_hidden_state
            assert got.dtype == torch.float32 and not torch.equal(got, expected)
            real = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
            tokens.append(torch.cosine_similarity(got[real], expected[real], dim=-1))
            pool = lambda h: (h * real[..., None]).sum(1) / real.sum(1, keepdim=True)  # noqa: E731 (mean pooling)
            sentences.append(torch.cosine_similarity(pool(got), pool(expected), dim=-1))
    assert len(calls) == len(cases)
    tokens, sentences = torch.cat(tokens), torch.cat(sentences)
    assert tokens.min() >= BF16_TOKEN_COSINE["min"] and tokens.mean() >= BF16_TOKEN_COSINE["mean"]
    assert sentences.min() >= BF16_SENTENCE_COSINE
    assert compiled_encoder.read_manifest(str(path), compiled_encoder.FORMAT)["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=re.escape("another precision (dtype 'bfloat16', here 'float32')")):
        bi.compile_for_inference(model, path)


SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Short one.",
             "BERT reads text in both directions, which is what makes it a good encoder for retrieval."]


def set_auto_model(transformer, model):
    """Give a sentence-transformers Transformer module another model (`auto_model`: an attribute before 5.0, a
    property of `model` since)."""
    if isinstance(inspect.getattr_static(type(transformer), "auto_model", None), property):
        transformer.model = model
    else:
        transformer.auto_model = model


@pytest.mark.slow
def test_sentence_transformers_and_pipelines_run_the_program_on_minilm(minilm_dir, tmp_path):
    """The real checkpoint through `apply_bert_impl()`: sentence-transformers embedding one query at a time and a
    feature-extraction pipeline run the program with no change to their code, and give stock transformers' results.
    A second model from the same checkpoint loads the package instead of compiling."""
    from sentence_transformers import SentenceTransformer

    stock_encoder = SentenceTransformer(minilm_dir, device="cpu")
    stock_extractor = transformers.pipeline("feature-extraction", model=minilm_dir, device="cpu")
    bi.apply_bert_impl()
    try:
        encoder = SentenceTransformer(minilm_dir, device="cpu")
        extractor = transformers.pipeline("feature-extraction", model=minilm_dir, device="cpu")
    finally:
        bi.revert_bert_impl()
    path = tmp_path / "minilm.pt2"
    set_auto_model(encoder[0], bi.compile_for_inference(encoder[0].auto_model, path))
    stat = os.stat(path)
    extractor.model = bi.compile_for_inference(extractor.model, path)
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns
    calls = program_calls(encoder[0].auto_model)
    extractor_calls = program_calls(extractor.model)
    embeddings = torch.stack([encoder.encode(s, convert_to_tensor=True) for s in SENTENCES])
    features = [torch.tensor(f[0]) for f in extractor(SENTENCES)]
    assert len(calls) == len(extractor_calls) == len(SENTENCES)
    expected = torch.stack([stock_encoder.encode(s, convert_to_tensor=True) for s in SENTENCES])
    assert (embeddings - expected).abs().max().item() < 1e-5
    for got, want in zip(features, stock_extractor(SENTENCES)):
        assert got.shape == torch.tensor(want[0]).shape
        assert (got - torch.tensor(want[0])).abs().max().item() < 1e-5


def test_an_int8_model_compiles(small_int8_package, encoder_state):
    """quantize_for_inference, then compile_for_inference: the program runs the int8 products as the traced
    formulation of `Int8Linear` does (`quantized_decomposed`; the eager path takes it where gradients are on), on
    dense batches and on padded ones once per group of the eager layout (zeros at padding, each row pooled from its
    first token), and another calibration's int8 weights are refused the package."""
    model, path = small_int8_package  # conftest's, which test_avx2_gemm.py runs too
    calls = program_calls(model)
    ids = small_ids(3, seed=11)
    padded = padded_batch(seed=12)
    empty_row = torch.ones_like(ids).index_fill(0, torch.tensor([1]), 0)  # the eager path pools its zero row
    with torch.no_grad():
        got, got_padded = model(input_ids=ids), model(**padded)
        with torch.enable_grad():  # the traced formulation, eagerly
            expected, expected_padded = eager(model, input_ids=ids), eager(model, **padded)
        kernel = eager(model, input_ids=ids)  # oneDNN's dynamic kernel
        runs = len(calls)
        assert_same_outputs(model(input_ids=ids, attention_mask=empty_row), eager(model, input_ids=ids,
                                                                                   attention_mask=empty_row))
    groups = program_runs(padded["attention_mask"])
    assert runs == len(calls) == 1 + groups and groups > 2
    # the program's products are the traced formulation's; the kernel's rounding and float32 are 1e-4 away
    for g, e in ((got, expected), (got_padded, expected_padded)):
        assert_same_int8_outputs(g, type(e)(**{k: v.detach() for k, v in e.items()}))
    assert (got_padded.last_hidden_state[padded["attention_mask"] == 0] == 0).all()
    assert F.cosine_similarity(got.last_hidden_state, kernel.last_hidden_state, dim=-1).min() > 0.99
    with pytest.raises(ValueError, match="another model or weights"):
        bi.compile_for_inference(small_int8_model(encoder_state, seed=13), path)


def test_an_int8_program_traces_the_exact_gelu_as_a_rational(small_int8_package, encoder_state):
    """Each int8 layer's exact GELU is traced as `RationalGELU` (a float32 model's stays torch's, which oneDNN fuses
    into the product): within 2.7e-7 max(1, |x|) of float64's GELU over all the range where float32's GELU is neither
    x nor 0, a NaN kept; the int8 package's kernels call no erf."""
    with zipfile.ZipFile(small_int8_package[1]) as package:
        kernels = [package.read(n).decode() for n in package.namelist() if n.endswith(".kernel.cpp")]
    assert kernels and not any(re.search(r"\berf\(", source) for source in kernels)
    x = torch.linspace(-30, 30, 600_001, dtype=torch.float64)
    got = compiled_encoder.RationalGELU()(x.float()).double()
    assert ((got - F.gelu(x)).abs() / x.abs().clamp_min(1)).max().item() < 2.7e-7
    assert compiled_encoder.RationalGELU()(torch.tensor([float("nan")])).isnan().all()
    base = small_int8_model(encoder_state, seed=10).base_model
    swaps = compiled_encoder.rational_gelus(base)
    assert [(parent, name) for parent, name, _ in swaps] == [(layer.intermediate, "intermediate_act_fn")
                                                             for layer in base.encoder.layer]
    assert compiled_encoder.rational_gelus(small_model()) == []


# One uint8 level of an activation: 1/127 of its row's largest |x|. Where an activation lies within a float32 rounding
# of the edge between two levels, the program (whose kernels scale by a reciprocal where the traced formulation divides,
# and accumulate the int8 products in int32 where it sums float32 ones) and the traced formulation can round it to
# neighbouring levels: that token's product moves by one level times its weights. In the last layer this moves one
# token of the SMALL model by up to 4e-5 (3.8e-5 measured on the AVX-512 and AMX kernels with one thread); in an earlier
# layer, attention spreads it over the token's sequence. Elsewhere the two agree to float32 rounding (5e-7 measured).
LEVEL_FLIP_BOUND = 1e-4
FLIPPED_ROWS = 2  # rows (tokens, pooled sequences) over float32 rounding of the traced formulation, at most


def assert_same_int8_outputs(got, expected):
    """The int8 program's outputs against the traced formulation's: each row within float32 rounding (1e-5) but at
    most FLIPPED_ROWS of them, which are within LEVEL_FLIP_BOUND."""
    got, expected = output_tensors(got), output_tensors(expected)
    assert got.keys() == expected.keys() and got
    for name, e in expected.items():
        assert got[name].shape == e.shape, name
        rows = (got[name] - e).abs().reshape(-1, e.shape[-1]).amax(-1)  # per token (or per pooled sequence)
        assert rows.max().item() < LEVEL_FLIP_BOUND and (rows >= 1e-5).sum().item() <= FLIPPED_ROWS, (name, rows)


def test_a_nan_in_one_row_of_an_int8_batch_stays_in_that_row(small_int8_package, encoder_state):
    """A dense batch whose first sequence holds the token with the NaN embedding: that row's outputs are NaN, the
    others' within cosine 0.99 of the float32 model's, through the program, the eager int8 kernel and the traced
    formulation alike."""
    model, _ = small_int8_package
    float32 = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
    float32.load_state_dict(encoder_state)
    float32.embeddings.word_embeddings.weight.data[NAN_TOKEN] = float("nan")
    calls = program_calls(model)
    ids = small_ids(4, seed=41)
    ids[0, 3] = NAN_TOKEN
    with torch.no_grad():
        expected = float32(input_ids=ids)
        outputs = [model(input_ids=ids), eager(model, input_ids=ids)]
        with torch.enable_grad():
            outputs.append(eager(model, input_ids=ids))
    assert len(calls) == 1
    for got in outputs:
        for name in ("last_hidden_state", "pooler_output"):
            g, e = got[name].detach(), expected[name]
            assert g[0].isnan().all() and e[0].isnan().all() and g[1:].isfinite().all(), name
            assert F.cosine_similarity(g[1:], e[1:], dim=-1).min() >= 0.99, name
