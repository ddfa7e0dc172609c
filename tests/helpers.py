"""Helpers more than one test file uses: small configurations and inputs for every head, the tracing gate's skip
mark, spies and comparisons."""

import contextlib
import sys

import numpy as np
import pytest
import torch

import modeling_bert_impl as bi
from modeling_bert_impl import input_checks

# (transformers class, our class, Auto class): every head.
HEADS = [
    ("BertModel", "BertImplModel", "AutoModel"),
    ("BertForPreTraining", "BertImplForPreTraining", "AutoModelForPreTraining"),
    ("BertForMaskedLM", "BertImplForMaskedLM", "AutoModelForMaskedLM"),
    ("BertForNextSentencePrediction", "BertImplForNextSentencePrediction", "AutoModelForNextSentencePrediction"),
    ("BertForSequenceClassification", "BertImplForSequenceClassification", "AutoModelForSequenceClassification"),
    ("BertForTokenClassification", "BertImplForTokenClassification", "AutoModelForTokenClassification"),
    ("BertForQuestionAnswering", "BertImplForQuestionAnswering", "AutoModelForQuestionAnswering"),
    ("BertForMultipleChoice", "BertImplForMultipleChoice", "AutoModelForMultipleChoice"),
]

# the accuracy docs/cpu-inference.md states for dtype=torch.bfloat16 on MiniLM, against its float32 inference model
BF16_TOKEN_COSINE = {"min": 0.999, "mean": 0.9999}
BF16_SENTENCE_COSINE = 0.9999

SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=64, type_vocab_size=2, num_labels=3)

# the padding-free path's tests: a 2-layer model without dropout
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

TRACING = "tracing a bert-impl model (torch.compile, torch.export)"
NEEDED = ".".join(map(str, input_checks.TRACING_TORCH))
needs_tracing = pytest.mark.skipif(not input_checks.TRACING_SUPPORTED,
                                   reason=f"{TRACING} needs torch >= {NEEDED} (installed: {torch.__version__})")


def small_model(seed: int = 0) -> bi.BertImplModel:
    """A BertImplModel of the SMALL configuration, in eval mode, its weights drawn from `seed`."""
    torch.manual_seed(seed)
    return bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()


NAN_TOKEN = SMALL["vocab_size"] - 1  # a token no random batch of `small_ids` holds (conftest's `small_int8_package`)


def small_ids(B: int, seed: int) -> torch.Tensor:  # (B, 9) token ids of the SMALL vocabulary, NAN_TOKEN left out
    return torch.randint(1, NAN_TOKEN, (B, 9), generator=torch.Generator().manual_seed(seed))


def small_int8_model(state: dict, seed: int) -> bi.BertImplModel:
    """The SMALL encoder of weights `state` quantized by `quantize_for_inference`, calibrated on 8 rows of
    `small_ids` (the seed picks them)."""
    model = bi.BertImplModel(bi.BertImplConfig(**SMALL))
    model.load_state_dict(state)
    return bi.quantize_for_inference(model, [{"input_ids": small_ids(8, seed)}])


def small_lora(model: bi.BertImplModel):
    """peft's LoRA on the query, value and dense layers of `model`, its weights random (seed 2), so that it changes
    the outputs."""
    import peft

    torch.manual_seed(2)
    return peft.get_peft_model(model, peft.LoraConfig(target_modules=["query", "value", "dense"],
                                                       init_lora_weights=False))


def make_inputs(head: str, config, generator):
    B, T, C = 3, 9, 2
    shape = (B, C, T) if head == "BertForMultipleChoice" else (B, T)
    inputs = {
        "input_ids": torch.randint(1, config.vocab_size, shape, generator=generator),
        "token_type_ids": torch.randint(0, 2, shape, generator=generator),
        "attention_mask": torch.ones(shape, dtype=torch.long),
    }
    rows = inputs["attention_mask"].view(-1, T)
    rows[1, 6:] = 0  # padded rows
    rows[-1, 4:] = 0
    labels = {}
    if head in ("BertForPreTraining", "BertForMaskedLM"):
        mlm = torch.full((B, T), -100)
        mlm[:, 1:3] = torch.randint(0, config.vocab_size, (B, 2), generator=generator)
        labels["labels"] = mlm
    if head == "BertForPreTraining":
        labels["next_sentence_label"] = torch.randint(0, 2, (B,), generator=generator)
    if head == "BertForNextSentencePrediction":
        labels["labels"] = torch.randint(0, 2, (B,), generator=generator)
    if head == "BertForSequenceClassification":
        labels["labels"] = torch.randint(0, config.num_labels, (B,), generator=generator)
    if head == "BertForTokenClassification":
        tags = torch.randint(0, config.num_labels, (B, T), generator=generator)
        labels["labels"] = tags.masked_fill(inputs["attention_mask"] == 0, -100)
    if head == "BertForQuestionAnswering":
        labels["start_positions"] = torch.tensor([1, 2, 40])  # 40: outside the sequence, ignored
        labels["end_positions"] = torch.tensor([3, 4, 40])
    if head == "BertForMultipleChoice":
        labels["labels"] = torch.randint(0, C, (B,), generator=generator)
    return inputs, labels


# rows and real lengths of a layout the CPU inference paths treat apart: one sequence, a dense batch, a padded batch
LAYOUTS = {"1x9": (1, [9]), "dense 3x9": (3, [9, 9, 9]), "padded": (3, [9, 6, 4])}


def layout_inputs(head: str, config, layout: str, generator) -> dict:
    """`make_inputs`' inputs (no labels) cut to the layout's rows, with its real lengths in the attention mask."""
    inputs, _ = make_inputs(head, config, generator)
    B, lengths = LAYOUTS[layout]
    T = inputs["input_ids"].shape[-1]
    inputs = {k: v[:B].clone() for k, v in inputs.items()}
    inputs["attention_mask"][..., :] = (torch.arange(T) < torch.tensor(lengths)[:, None]).long().view(
        (B,) + (1,) * (inputs["attention_mask"].dim() - 2) + (T,))
    return inputs


def output_tensors(out):
    """The logits-like tensors of an output, by name (hidden states for the base model)."""
    names = ("logits", "prediction_logits", "seq_relationship_logits", "start_logits", "end_logits",
             "last_hidden_state", "pooler_output")
    return {name: getattr(out, name) for name in names if getattr(out, name, None) is not None}


def model_state(model) -> tuple:
    """What a model is: its modules' classes and modes, its parameters' values and whether they need gradients."""
    modules = [(name, type(m), m.training) for name, m in model.named_modules()]
    parameters = [(name, p.detach().clone(), p.requires_grad) for name, p in model.named_parameters()]
    return modules, parameters


def assert_same_state(model, state):
    modules, parameters = model_state(model)
    assert modules == state[0]
    assert [(n, r) for n, _, r in parameters] == [(n, r) for n, _, r in state[1]]
    assert all(torch.equal(p, q) for (_, p, _), (_, q, _) in zip(parameters, state[1]))


@contextlib.contextmanager
def layouts_built(model):
    """A list that gets one entry, the batch's (B, T), per forward of `model` in the block that ran a padding-free
    layout (a call on the padded layout adds none): a spy on `choose_layout` of the model's own code (a
    `trust_remote_code` copy has its own), which changes nothing the model computes, unlike a hook."""
    model_file = sys.modules[type(model.base_model).forward.__module__]  # the module of its forward
    original = model_file.choose_layout
    padded = sys.modules[original.__module__].PaddedLayout
    built = []

    def choose_layout(config, batch, *args, **kwargs):
        layout = original(config, batch, *args, **kwargs)
        if not isinstance(layout, padded):
            built.append(batch.shape)
        return layout

    model_file.choose_layout = choose_layout
    try:
        yield built
    finally:
        model_file.choose_layout = original


def max_diff(a, b) -> float:
    """max |a - b| of two tensors (or what torch.as_tensor takes) of the same shape."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


NUMPY_WRITES = {  # writes through NumPy, which no version counter sees
    "+= through detach().numpy()": lambda t: t.detach().numpy().__iadd__(0.5),
    "np.copyto into numpy()": lambda t: np.copyto(t.numpy(), 0),
    "np.copyto into np.asarray": lambda t: np.copyto(np.asarray(t), 0),
    "a row of a view": lambda t: np.copyto(t.detach().view(-1)[:4].numpy(), 0),
    "the transpose of .data": lambda t: np.copyto(t.data.T.numpy(), 0),
    "the state dict's tensor": lambda t: np.copyto(t.detach().contiguous().numpy(), 0),
}


def numpy_writes_are_refused(inference, model, write) -> None:
    """`write` on four of the inference model's tensors (a norm's weight, the embeddings, a product's weight, the
    position ids buffer) raises NumPy's ValueError; reading through NumPy works and a copy is writable; and the
    answers after it, one sentence and a batch, are the model's (one set of weights)."""
    weights = [inference.encoder.layer[0].output.LayerNorm.weight, inference.embeddings.word_embeddings.weight,
               inference.encoder.layer[1].intermediate.dense.weight, inference.embeddings.position_ids]
    for weight in weights:
        with pytest.raises(ValueError, match="read-only"):
            NUMPY_WRITES[write](weight)
        assert np.array_equal(np.asarray(weight), weight.detach().clone().numpy())
        copied = weight.detach().clone().numpy()
        copied[...] = 0  # a copy is the user's
    with torch.no_grad():
        for shape in ((1, 9), (3, 9)):
            ids = torch.randint(1, SMALL["vocab_size"], shape, generator=torch.Generator().manual_seed(5))
            assert (inference(input_ids=ids).last_hidden_state - model(input_ids=ids).last_hidden_state).abs().max() < 1e-5


def attention_per_sequence(q, k, v, lengths, scaling, keeps=None):
    """softmax(q k^T * scaling) v on each sequence alone: q, k, v (nnz, N, D) split by `lengths` -> (nnz, N, D);
    `keeps`, a dropout mask (N, L, L) per sequence (already scaled by 1 / (1 - p)), multiplies the probabilities."""
    out = []
    for s, (qi, ki, vi) in enumerate(zip(q.split(lengths), k.split(lengths), v.split(lengths))):
        p = torch.softmax(qi.transpose(0, 1) @ ki.permute(1, 2, 0) * scaling, -1)  # (N, L, L)
        out.append(((p if keeps is None else p * keeps[s]) @ vi.transpose(0, 1)).transpose(0, 1))
    return torch.cat(out)  # (nnz, N, D)


def mixed_batch(vocab: int, lengths: list[int], left: set[int] = frozenset(), seed: int = 0) -> dict:
    """Rows of random ids of the given lengths ([CLS] ... [SEP] with a real vocabulary), right-padded except the rows
    in `left`."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(vocab // 30, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        span = slice(T - n, T) if b in left else slice(0, n)
        mask[b, span] = 1
        if n and vocab > 102:
            ids[b, span.start], ids[b, span.stop - 1] = 101, 102
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def program_calls(model) -> list:
    """The inputs of each run of the compiled program of `model` (a `compile_for_inference` model, or its base model)
    from now on, as the program gets them: [ids, mask, token types, positions]."""
    encoder, calls = model.base_model.compiled_encoder, []
    run = encoder.run
    encoder.run = lambda args: calls.append(list(args)) or run(args)
    return calls


# ---------------------------------------------------------------------------------------------------------------------
# Releases beyond the tested ones: named in the summary of a failing run (conftest.py's pytest_terminal_summary)
# ---------------------------------------------------------------------------------------------------------------------
def tested_versions(page: str) -> dict[str, tuple[str, str]]:
    """docs/development.md's "Tested versions" table, read from the page's text: package -> (lowest, newest) release
    that passed."""
    table = page.split("\n## Tested versions\n", 1)[1].strip().split("\n\n")[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    return {name.split(" (")[0]: (lowest.split()[0], newest.split()[0]) for name, lowest, newest in rows}


def untested_releases(tested: dict[str, tuple[str, str]], installed) -> list[str]:
    """A line for each package whose installed release (`installed(name)`: its version, or None where it is not
    installed) lies outside the tested range `tested` (`tested_versions`)."""
    from packaging.version import Version

    lines = []
    for name, (lowest, newest) in tested.items():
        version = installed(name)
        if version is None:
            continue
        release = Version(version).release
        if release > Version(newest).release:
            lines.append(f"{name} {version} is newer than the newest release tested ({newest})")
        elif release < Version(lowest).release:
            lines.append(f"{name} {version} is older than the lowest release tested ({lowest})")
    return lines
