"""A compiled model's checks and run in C++ (csrc/quick_call.cpp, built by native.py): `Snapshot` against each write to
what it watches, and `SingleQuery` taking only calls that the model's own checks (`program_inputs`) take, with the same
program inputs and answers; anything touched sends single queries through `forward` again, whose checks see it;
`Program` answering as AOTInductor's loader does, letting other Python threads run while it computes."""

import copy
import gc
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

import modeling_bert_impl as bi
from modeling_bert_impl.inference import compiled_encoder, native

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import SMALL, needs_tracing, output_tensors, program_calls, small_ids  # noqa: E402

pytestmark = needs_tracing


@pytest.fixture(scope="module")
def quick_call():
    """The built module: compile_for_inference's tests need the C++ compiler that builds it, so not building is a
    failure here, not a skip."""
    module = native.quick_call()
    assert module is not None, "csrc/quick_call.cpp did not build (see the INFO log of modeling_bert_impl)"
    return module


class Watched(nn.Module):
    forward_of_class = None

    def forward(self, x):
        return self.child(x * self.weight)


WRITES = {
    "a tensor in place": lambda o: o["tensor"].add_(1),
    "a tensor's .data": lambda o: setattr(o["tensor"], "data", torch.zeros(4)),
    "a parameter in place": lambda o: o["module"].weight.mul_(2),
    "a dict's item set": lambda o: o["dict"].__setitem__("a", 2),
    "a dict's item added": lambda o: o["dict"].__setitem__("b", 1),
    "a dict's item deleted": lambda o: o["dict"].__delitem__("a"),
    "a module set to training": lambda o: o["module"].train(),
    "a module's forward patched": lambda o: setattr(o["module"], "forward", lambda x: x),
    "a module's child replaced": lambda o: setattr(o["module"], "child", nn.ReLU()),
    "a hook registered": lambda o: o["module"].register_forward_hook(lambda *a: None),
    "a class's forward patched": lambda o: setattr(Watched, "forward_of_class", lambda self: None),
}


@pytest.mark.parametrize("write", WRITES)
def test_a_snapshot_sees_each_write_and_takes_the_state_again(quick_call, write):
    module = Watched().eval()
    module.weight, module.child = nn.Parameter(torch.ones(2)), nn.Identity()
    with torch.inference_mode():
        unversioned = torch.ones(3)  # an inference tensor: no version counter, its pointer watched
    objects = {"tensor": torch.ones(4), "dict": {"a": 1}, "module": module}
    snapshot = quick_call.Snapshot([objects["tensor"], module.weight, unversioned],
                                   [objects["dict"], vars(module), module._modules, module._parameters,
                                    module._forward_hooks, Watched])
    module(torch.ones(2)) if write != "a module's forward patched" else None  # reading and calling write nothing
    assert snapshot.same() and snapshot.same()
    with torch.no_grad():
        WRITES[write](objects)
    assert not snapshot.same()
    snapshot.take()
    assert snapshot.same()
    Watched.forward_of_class = None


def test_a_snapshot_is_collected_with_what_it_watches(quick_call):
    """A snapshot held by the module it watches (a cycle through its dicts) is freed by the garbage collector."""
    module = nn.Linear(2, 2)
    module.snapshot = quick_call.Snapshot([module.weight], [vars(module), module._modules])
    gone = weakref.ref(module)
    del module
    gc.collect()
    assert gone() is None


def reference_and_quick(packages, encoder_state):
    """The SMALL encoder compiled twice from conftest's package: once as it is (its single queries in C++), once with
    its single-query check left out (every call through `forward`)."""
    models = []
    for _ in range(2):
        model = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
        model.load_state_dict(encoder_state)
        models.append(bi.compile_for_inference(model, packages[True]))
    models[0].__dict__["single_query"] = None
    return models


ONES = torch.ones(1, 9, dtype=torch.long)
IDS = small_ids(1, seed=21)
TAKEN = {
    "ids": dict(input_ids=IDS),
    "a mask of ones": dict(input_ids=IDS, attention_mask=ONES),
    "a bool mask": dict(input_ids=IDS, attention_mask=ONES.bool()),
    "an int32 mask": dict(input_ids=IDS, attention_mask=ONES.int()),
    "a float mask": dict(input_ids=IDS, attention_mask=ONES.float()),
    "token types": dict(input_ids=IDS, token_type_ids=torch.tensor([[0] * 4 + [1] * 5])),
    "as a head calls it": dict(input_ids=IDS, attention_mask=ONES, token_type_ids=None, position_ids=None,
                               inputs_embeds=None, return_dict=True, output_attentions=None,
                               output_hidden_states=False, label_checks=None),
    "a tuple asked for": dict(input_ids=IDS, return_dict=False),
    "padded on the right": dict(input_ids=IDS, attention_mask=torch.tensor([[1] * 6 + [0] * 3])),
    "padded on the left, a bool mask": dict(input_ids=IDS, attention_mask=torch.tensor([[0] * 4 + [1] * 5]).bool()),
    "padded, with token types": dict(input_ids=IDS, attention_mask=torch.tensor([[1] * 7 + [0] * 2]),
                                     token_type_ids=torch.tensor([[0] * 4 + [1] * 5])),
}
NOT_TAKEN = {
    "a gap among the real tokens": dict(input_ids=IDS, attention_mask=torch.tensor([[1] * 3 + [0] + [1] * 5])),
    "one real token": dict(input_ids=IDS, attention_mask=torch.tensor([[1] + [0] * 8])),
    "padding only": dict(input_ids=IDS, attention_mask=torch.zeros(1, 9, dtype=torch.long)),
    "two rows": dict(input_ids=small_ids(2, seed=22)),
    "one token": dict(input_ids=IDS[:, :1]),
    "more tokens than positions": dict(input_ids=torch.ones(1, 65, dtype=torch.long)),
    "an id past the vocabulary": dict(input_ids=IDS.clone().index_fill_(1, torch.tensor([3]), 99)),
    "a negative id": dict(input_ids=IDS.clone().index_fill_(1, torch.tensor([3]), -1)),
    "a token type past its table": dict(input_ids=IDS, token_type_ids=torch.full((1, 9), 2)),
    "positions": dict(input_ids=IDS, position_ids=torch.arange(9)[None]),
    "embeddings": dict(inputs_embeds=torch.randn(1, 9, 32)),
    "hidden states asked for": dict(input_ids=IDS, output_hidden_states=True),
    "attention maps asked for": dict(input_ids=IDS, output_attentions=True),
    "int32 ids": dict(input_ids=IDS.int()),
    "ids not contiguous": dict(input_ids=torch.cat([IDS, IDS], 1)[:, ::2]),
    "a mask of twos": dict(input_ids=IDS, attention_mask=ONES * 2),
    "a mask of another shape": dict(input_ids=IDS, attention_mask=torch.ones(1, 1, 9, 9)),
}


def answer(model, inputs):
    """The model's outputs as tensors, or the error it raised (its type and message)."""
    try:
        with torch.no_grad():
            out = model(**inputs)
    except (ValueError, RuntimeError, IndexError) as error:
        return type(error), str(error)
    return output_tensors(out) if not isinstance(out, tuple) else {str(i): t for i, t in enumerate(out) if
                                                                   isinstance(t, torch.Tensor)}


def same_answers(got, expected, tolerance: float = 0.0):
    """The same outputs (within `tolerance`: 1e-5 between the program and the eager path), or the same error."""
    if isinstance(expected, tuple):
        return got == expected
    return got.keys() == expected.keys() and all(
        got[k].shape == expected[k].shape and (got[k] - expected[k]).abs().max() <= tolerance for k in expected)


@pytest.mark.parametrize("case", [*TAKEN, *NOT_TAKEN])
def test_a_single_query_is_taken_only_where_forward_runs_the_program_on_the_same_inputs(small_packages,
                                                                                       encoder_state, quick_call, case):
    reference, model = reference_and_quick(small_packages, encoder_state)
    inputs = {**TAKEN, **NOT_TAKEN}[case]
    for m in (reference, model):
        answer(m, dict(input_ids=IDS))  # the shape's constants made, as a first call makes them
    taken = model.single_query((), inputs)  # ([ids, mask, token types, positions], padding) or None
    expected_runs, runs = program_calls(reference), program_calls(model)
    got, expected = answer(model, inputs), answer(reference, inputs)
    assert same_answers(got, expected), (got, expected)
    assert (taken is not None) == (case in TAKEN)
    if taken is not None:  # what forward gives the program, and what the call gave it
        assert len(expected_runs) == len(runs) == 1
        for given in (runs[0], taken[0]):
            assert len(given) == 4 and all(torch.equal(a, b) for a, b in zip(given, expected_runs[0]))


def touch_hook(model):
    seen = []
    handle = model.encoder.layer[1].output.register_forward_hook(lambda m, a, out: seen.append(1))
    return lambda out: seen == [1] and (handle.remove() or True)


def touch_training(model):
    nn.Module.train(model.encoder.layer[0].output.dropout)  # past the inference model's refusal
    return lambda out: True


def touch_config(model):
    model.config.output_hidden_states = True
    return lambda out: out.hidden_states is not None and len(out.hidden_states) == SMALL["num_hidden_layers"] + 1


def touch_set_aside(model):
    model.compiled_encoder = None
    return lambda out: True


def touch_patch(model):
    model.embeddings.LayerNorm.forward = lambda x: torch.ones_like(x)
    return lambda out: bool((out.last_hidden_state[0, 0] == out.last_hidden_state[0, 1]).all())  # the ids left out


TOUCHES = {"a hook": touch_hook, "a module in training mode": touch_training, "a config flag": touch_config,
           "the program set aside": touch_set_aside, "a patched forward": touch_patch}


@pytest.mark.parametrize("touch", TOUCHES)
def test_anything_touched_sends_single_queries_through_forward(small_packages, encoder_state, quick_call, touch):
    """After a hook (which runs), a module in training mode, a config flag, the program set aside or a patched forward,
    the single-query check takes no call, and the call answers as forward does; a hook removed again leaves forward's
    checks running the program."""
    reference, model = reference_and_quick(small_packages, encoder_state)
    inputs = dict(input_ids=IDS, attention_mask=ONES)
    answer(model, inputs)
    assert model.single_query((IDS, ONES), {}) is not None
    checks = [TOUCHES[touch](m) for m in (reference, model)]
    with torch.no_grad():
        torch.manual_seed(5)  # the same dropout for both where a module trains
        got = model(**inputs)
        torch.manual_seed(5)
        expected = reference(**inputs)
    assert model.single_query((IDS, ONES), {}) is None
    assert same_answers(output_tensors(got), output_tensors(expected))
    assert checks[1](got) and checks[0](expected)
    if touch == "a hook":  # removed by its check: forward runs the program again
        runs = program_calls(model)
        with torch.no_grad():
            model(**inputs)
        assert len(runs) == 1 and model.single_query((IDS, ONES), {}) is None


def test_a_weight_changed_in_place_is_refused_at_the_next_single_query(small_packages, encoder_state, quick_call):
    _, model = reference_and_quick(small_packages, encoder_state)
    inputs = dict(input_ids=IDS)
    answer(model, inputs)
    with torch.no_grad():
        model.encoder.layer[0].attention.self.value.weight.mul_(1.1)
        with pytest.raises(ValueError, match="encoder.layer.0.attention.self.value.weight` was changed in place"):
            model(**inputs)


def test_a_copy_takes_its_own_snapshots(small_packages, encoder_state, quick_call):
    """A deep copy of the compiled model answers as the model does, its module tree watched anew (a hook on the copy
    runs), its single queries through forward."""
    _, model = reference_and_quick(small_packages, encoder_state)
    inputs = dict(input_ids=IDS)
    copied = copy.deepcopy(model)
    assert copied.single_query is None and copied.program_tree.snapshot is not None
    with torch.no_grad():
        expected = model(**inputs)
        runs = program_calls(copied)  # the program, which the copy shares
        got = copied(**inputs)
        seen = []
        copied.encoder.layer[0].register_forward_hook(lambda *a: seen.append(1))
        hooked = copied(**inputs)
    assert len(runs) == 1 and seen == [1]
    assert same_answers(output_tensors(got), output_tensors(expected))
    assert same_answers(output_tensors(hooked), output_tensors(expected), 1e-5)  # the eager path


def test_without_the_module_the_checks_stay_in_python(small_packages, encoder_state, monkeypatch):
    """Where quick_call.cpp cannot be built, the compiled model has no snapshots and no single-query check, and its
    calls run the program through forward's checks in Python."""
    monkeypatch.setattr(native, "quick_call", lambda: None)
    reference, model = reference_and_quick(small_packages, encoder_state)
    assert model.single_query is None and model.program_tree.snapshot is None and model.weights_fixed.snapshot is None
    runs = program_calls(model)
    got = answer(model, dict(input_ids=IDS))
    monkeypatch.undo()
    assert len(runs) == 1 and same_answers(got, answer(reference, dict(input_ids=IDS)))


def test_the_compiled_model_calls_the_module_it_builds(small_packages, encoder_state, quick_call):
    """compile_for_inference's model has its single-query check and snapshots, and a single query runs the program
    without forward."""
    _, model = reference_and_quick(small_packages, encoder_state)
    assert isinstance(model.single_query, quick_call.SingleQuery)
    assert isinstance(model.program_tree.snapshot, quick_call.Snapshot)
    assert isinstance(model.weights_fixed.snapshot, quick_call.Snapshot)
    answer(model, dict(input_ids=IDS))
    forward = compiled_encoder.CompiledBertImplModel.forward
    calls = []
    try:
        compiled_encoder.CompiledBertImplModel.forward = lambda self, *a, **k: calls.append(1) or forward(self, *a, **k)
        got = answer(model, dict(input_ids=IDS))
    finally:
        compiled_encoder.CompiledBertImplModel.forward = forward
    assert calls == [] and got["last_hidden_state"].shape == (1, 9, 32)


def test_positional_inputs_and_hooks_see_the_call_as_given(small_packages, encoder_state, quick_call):
    """Inputs given positionally (forward's order) are taken as by keyword; an input given twice, or a sixth positional
    argument, goes to Module's call, which names the error; a hook on the model sees the call's arguments as given."""
    reference, model = reference_and_quick(small_packages, encoder_state)
    answer(model, dict(input_ids=IDS))
    assert model.single_query((IDS, ONES), {}) is not None
    assert model.single_query((IDS,), {"attention_mask": ONES}) is not None
    assert model.single_query((IDS,), {"input_ids": IDS}) is None
    assert model.single_query((IDS, ONES, None, None, None, None), {}) is None
    with torch.no_grad():
        got, expected = model(IDS, ONES), reference(IDS, ONES)
        assert same_answers(output_tensors(got), output_tensors(expected))
        for m in (model, reference):
            with pytest.raises(TypeError, match="multiple values for argument 'input_ids'"):
                m(IDS, input_ids=IDS)
        seen = []
        model.register_forward_pre_hook(lambda m, args, kwargs: seen.append((args, sorted(kwargs))), with_kwargs=True)
        model(input_ids=IDS, attention_mask=ONES)
    assert seen == [((), ["attention_mask", "input_ids"])]


def program_inputs_of(B: int, T: int) -> list[torch.Tensor]:
    """A compiled program's inputs [ids, mask, token types, positions], each (B, T) int64 and contiguous."""
    ids = torch.randint(1, 99, (B, T), generator=torch.Generator().manual_seed(B * T))
    return [ids, torch.ones_like(ids), torch.zeros_like(ids), torch.arange(T).repeat(B, 1)]


def test_the_program_gives_aotinductors_outputs_and_names_what_does_not_fit(small_packages, quick_call):
    """`Program` (the compiled model's run: native.program) answers as AOTInductor's own loader does, leaving its
    inputs' list as given; inputs the program was not compiled for are a RuntimeError with AOTInductor's message, and
    a list of other things a TypeError naming the item."""
    path = small_packages[True]
    program, loader = native.program(path), torch._inductor.aoti_load_package(path).loader
    assert type(program) is quick_call.Program
    for B, T in ((1, 2), (3, 9), (8, 64)):
        inputs = program_inputs_of(B, T)
        got, expected = program(inputs), loader.boxed_run(list(inputs))
        assert len(inputs) == 4 and len(got) == len(expected) == 2
        for a, b in zip(got, expected):
            assert a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(RuntimeError):
        program(program_inputs_of(1, 65))  # past the 64 positions
    with pytest.raises(TypeError, match=r"inputs\[1\] is not a tensor"):
        program([torch.ones(1, 2, dtype=torch.long), 1, 2, 3])


def test_the_program_lets_other_python_threads_run_while_it_computes(small_packages, quick_call):
    """With a switch interval far longer than the test, a thread waiting for the GIL runs only where the thread holding
    it lets it go: it counts while the program runs (torch's own loader holds the GIL for the whole run, and a server's
    event loop stood still while a batch ran)."""
    program, inputs = native.program(small_packages[True]), program_inputs_of(8, 64)
    count, done = [0], [False]

    def other():
        while not done[0]:
            count[0] += 1
            time.sleep(0)  # lets the GIL go

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    thread = threading.Thread(target=other)
    try:
        thread.start()
        time.sleep(0.05)  # the other thread runs, then waits for the GIL
        before = count[0]
        for _ in range(20):
            program(inputs)
        during = count[0] - before
    finally:
        done[0] = True
        sys.setswitchinterval(interval)
        thread.join()
    assert during > 0


def test_the_program_runs_calls_from_several_threads_each_its_own(small_packages, quick_call):
    """`Program(path, runners)` holds that many instances of the model (a server's streams call it at once; with one,
    AOTInductor's container ran their calls in turn): calls of several shapes from four threads at once, through two
    runners, each give the outputs of the same call alone. A count below 1 is refused, naming it."""
    path = small_packages[True]
    program = quick_call.Program(path, 2)
    shapes = [(1, 2), (3, 9), (8, 64), (2, 33)] * 5
    expected = [program(program_inputs_of(B, T)) for B, T in shapes]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda shape: program(program_inputs_of(*shape)), shapes))
    for outputs, want in zip(got, expected):
        assert all(torch.equal(a, b) for a, b in zip(outputs, want))
    with pytest.raises(ValueError, match="runners: 0, at least 1"):
        quick_call.Program(path, 0)
