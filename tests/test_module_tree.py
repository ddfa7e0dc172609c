"""Code that reaches inside the model works as on stock BERT: the module tree and parameter names are transformers'
(`bert.encoder.layer[i].attention.self.query`, ...), so state dicts, freezing, layer-wise learning rates, forward hooks,
captum's layer attributions and FSDP2 see what they see on transformers' BertForX. References: transformers' own
BERT on the same weights (the real MiniLM checkpoint, or small random models saved by transformers), in this process.

Also the issue's silent wrong answers, each with the input that gave it: one row with no attention mask and
position_ids all zeros (captum's baseline call), and packs marked only by `seq_idx` or `cu_seq_lens_q`; and the folders
saved under bert-impl's old parameter names (tests/fixtures/legacy_names), which load with their stored outputs.

The layout rule (the model file's docstring): code that looks inside the encoder (a hook of the user's on one of its
modules, a submodule of the user's class) sees stock's (B, T, H) tensors and stock's numbers on every batch: the call
then runs the padded layout, unless `config.unpad_inputs=True` (hooks then see the padding-free (P, H) rows). Where
nothing looks inside, a padded batch runs padding-free; the frameworks' own hooks (FSDP2's here) keep it so. The
embeddings return (B, T, H) always. Which layout ran is seen through `helpers.layouts_built`, which, unlike a hook,
changes nothing."""

import contextlib
import functools
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig

import modeling_bert_impl as bi
from helpers import layouts_built, max_diff
from modeling_bert_impl.modeling_bert_impl import stock_name

captum_attr = pytest.importorskip("captum.attr")

TOL = 1e-5
SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Short.",
    "BERT reads text in both directions at once, which is what makes it a good encoder for retrieval.",
    "A fourth sentence of middling length.",
]
LEGACY = Path(__file__).parent / "fixtures" / "legacy_names"


def stock_class(ours: type) -> type:
    """transformers' class of the same head: BertImplForMaskedLM -> transformers.BertForMaskedLM."""
    return getattr(transformers, stock_name(ours))


# ---------------------------------------------------------------------------------------------------------------------
# Models: MiniLM with a seeded classifier (stock folder), ours loaded from our own folder, and ours through the patch
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stock_dir(minilm_dir, tmp_path_factory):
    """MiniLM (L=6, H=384) with a seeded classification head (std 0.1, logits of order 1), saved by transformers."""
    folder = tmp_path_factory.mktemp("minilm-classifier")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(minilm_dir, num_labels=2)
    torch.nn.init.normal_(model.classifier.weight, std=0.1)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def our_dir(stock_dir, tmp_path_factory):
    """The same model saved by bert-impl (config model_type "bert_impl", code files, stock parameter names)."""
    folder = tmp_path_factory.mktemp("ours")
    bi.BertImplForSequenceClassification.from_pretrained(stock_dir).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(stock_dir):
    return AutoTokenizer.from_pretrained(stock_dir)


def load(kind: str, stock_dir: str, our_dir: str):
    """A fresh model in eval mode: "stock" (transformers'), "ours" (our class on our folder), "patched"
    (AutoModelForSequenceClassification on the stock folder after apply_bert_impl()) or "remote" (our folder through
    `trust_remote_code`: the folder's own copy of the code)."""
    if kind == "stock":
        return transformers.BertForSequenceClassification.from_pretrained(stock_dir).eval()
    if kind == "ours":
        return bi.BertImplForSequenceClassification.from_pretrained(our_dir).eval()
    if kind == "remote":  # what trust_remote_code=True loads where the package is absent (here it is installed)
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        auto_map = transformers.AutoConfig.from_pretrained(our_dir).auto_map
        remote = get_class_from_dynamic_module(auto_map["AutoModelForSequenceClassification"], our_dir)
        assert remote.__module__.startswith("transformers_modules.")
        return remote.from_pretrained(our_dir).eval()
    bi.apply_bert_impl()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(stock_dir).eval()
    finally:
        bi.revert_bert_impl()
    assert isinstance(model, bi.BertImplForSequenceClassification)
    return model


OURS = ["ours", "patched"]


@pytest.fixture(scope="module")
def padded(tokenizer):
    """The four sentences as one right-padded batch (lengths 6 to 22 tokens)."""
    return dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))


@pytest.fixture(scope="module")
def one(tokenizer):
    """The first sentence alone: no padding."""
    return dict(tokenizer(SENTENCES[0], return_tensors="pt"))


# ---------------------------------------------------------------------------------------------------------------------
# Names: state dicts, named modules, folders both ways, for all 8 heads
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ours", list(bi.AUTO_CLASSES.values()), ids=lambda cls: cls.__name__)
def test_state_dict_and_module_names_are_stock_and_folders_load_both_ways(ours, tmp_path):
    torch.manual_seed(0)
    stock = stock_class(ours)(BertConfig(**SMALL))
    model = ours(bi.BertImplConfig(**SMALL))
    assert list(model.state_dict()) == list(stock.state_dict())
    assert [name for name, _ in model.named_modules()] == [name for name, _ in stock.named_modules()]
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in stock.named_parameters()]

    stock.save_pretrained(tmp_path / "stock")
    model.save_pretrained(tmp_path / "ours")
    assert load_file(tmp_path / "ours" / "model.safetensors").keys() == load_file(
        tmp_path / "stock" / "model.safetensors").keys()
    stock_on_ours, info = stock_class(ours).from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info.values()), info  # missing, unexpected, mismatched keys, errors: none
    ours_on_stock, info = ours.from_pretrained(tmp_path / "stock", output_loading_info=True)
    assert not any(info.values()), info
    for loaded, source in ((stock_on_ours, model), (ours_on_stock, stock)):
        expected = source.state_dict()
        assert all(torch.equal(tensor, expected[name]) for name, tensor in loaded.state_dict().items())


# ---------------------------------------------------------------------------------------------------------------------
# Training code written against stock names
# ---------------------------------------------------------------------------------------------------------------------
def small_pair(tmp_path):
    """transformers' BertForSequenceClassification (random, seeded) and ours on its folder."""
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(BertConfig(**SMALL)).save_pretrained(tmp_path / "small")
    return (transformers.BertForSequenceClassification.from_pretrained(tmp_path / "small"),
            bi.BertImplForSequenceClassification.from_pretrained(tmp_path / "small"))


def small_batch():
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(9) < torch.tensor([9, 5, 7, 3])[:, None]).long()
    return {"input_ids": torch.randint(1, 99, (4, 9), generator=g) * mask, "attention_mask": mask,
            "labels": torch.tensor([0, 1, 1, 0])}


@pytest.mark.parametrize("kind", [*OURS, "remote"])
def test_stock_buffers_of_default_ids_exist_unsaved(kind, stock_dir, our_dir, one):
    """`bert.embeddings.position_ids` and `.token_type_ids`: stock's names, shapes, dtypes and values, not in the
    state dict (non-persistent, as stock's); a model built from a config has them too; code that slices them, as
    attribution tutorials do, gets stock's inputs and stock's logits."""
    stock, ours = load("stock", stock_dir, our_dir), load(kind, stock_dir, our_dir)
    assert dict(ours.named_buffers()).keys() == dict(stock.named_buffers()).keys() == {
        "bert.embeddings.position_ids", "bert.embeddings.token_type_ids"}
    for name, expected in stock.named_buffers():
        got = ours.get_buffer(name)
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    assert not any(key.endswith(("position_ids", "token_type_ids")) for key in ours.state_dict())
    built = type(ours)(ours.config).bert.embeddings
    assert torch.equal(built.position_ids, stock.bert.embeddings.position_ids)
    assert torch.equal(built.token_type_ids, stock.bert.embeddings.token_type_ids)
    T = one["input_ids"].shape[1]
    with torch.no_grad():
        logits = {name: model(input_ids=one["input_ids"], position_ids=model.bert.embeddings.position_ids[:, :T],
                              token_type_ids=model.bert.embeddings.token_type_ids[:, :T]).logits
                  for name, model in (("stock", stock), (kind, ours))}
    assert max_diff(logits[kind], logits["stock"]) < TOL


def test_freezing_lower_layers_trains_the_same_parameters(tmp_path):
    """`model.bert.encoder.layer[:k].requires_grad_(False)` then one AdamW step: the same parameter names change."""
    changed = {}
    for model in small_pair(tmp_path):
        model.bert.encoder.layer[:2].requires_grad_(False)
        model.train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model(**small_batch()).loss.backward()
        optimizer.step()
        changed[type(model).__name__] = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    stock, ours = changed.values()
    assert ours == stock
    assert any(n.startswith("bert.encoder.layer.2.") for n in ours) and "classifier.weight" in ours
    assert not any(n.startswith(("bert.encoder.layer.0.", "bert.encoder.layer.1.")) for n in ours)


def llrd_groups(model, lr: float = 1e-3, decay: float = 0.8) -> list[tuple[float, list[str]]]:
    """Layer-wise learning-rate decay as public recipes build it from stock BERT's names: layer i at
    lr * decay ** (L - i), the embeddings one step lower, the pooler and head at lr."""
    layers = model.config.num_hidden_layers
    groups = {}
    for name, _ in model.named_parameters():
        if ".embeddings." in name:
            scale = decay ** (layers + 1)
        elif ".encoder.layer." in name:
            scale = decay ** (layers - int(name.split(".encoder.layer.")[1].split(".")[0]))
        else:
            scale = 1.0
        groups.setdefault(lr * scale, []).append(name)
    return sorted(groups.items())


def test_layerwise_lr_decay_groups_from_stock_names(tmp_path):
    stock, ours = small_pair(tmp_path)
    groups = llrd_groups(ours)
    assert groups == llrd_groups(stock)
    assert len(groups) == SMALL["num_hidden_layers"] + 2  # every layer, the embeddings and the rest
    params = dict(ours.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [params[n] for n in names], "lr": lr} for lr, names in groups])
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(params)


@pytest.mark.parametrize("kind", OURS)
def test_hooks_on_layer_outputs_and_the_embeddings_see_stock_tensors(kind, stock_dir, our_dir, one):
    """A forward hook on `bert.encoder.layer[i].output` sees stock's (1, T, H) tensor on one sentence (every i), and
    `bert.embeddings(input_ids)` alone gives stock's."""
    models = {"stock": load("stock", stock_dir, our_dir), kind: load(kind, stock_dir, our_dir)}
    seen = {}
    for name, model in models.items():
        for i, layer in enumerate(model.bert.encoder.layer):
            layer.output.register_forward_hook(lambda m, args, out, key=(name, i): seen.__setitem__(key, out))
        with torch.no_grad():
            model(**one)
            seen[name, "embeddings"] = model.bert.embeddings(one["input_ids"])
    layers = len(models["stock"].bert.encoder.layer)
    for key in [*range(layers), "embeddings"]:
        assert seen[kind, key].shape == seen["stock", key].shape == (1, one["input_ids"].shape[1], 384), key
        assert max_diff(seen[kind, key], seen["stock", key]) < TOL, key


# ---------------------------------------------------------------------------------------------------------------------
# captum
# ---------------------------------------------------------------------------------------------------------------------
def positive_logit(model):
    """captum's forward function: the class-1 logit of each row."""
    return lambda input_ids, attention_mask=None: model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 1]


def positive_logit_of_embeddings(model):
    """The same from word embeddings (LayerConductance interpolates the inputs themselves: they must be floats)."""
    return lambda embeds, attention_mask=None: model(inputs_embeds=embeds, attention_mask=attention_mask).logits[:, 1]


def reference_ids(input_ids, tokenizer):
    """captum's usual baseline: [CLS], then [PAD] everywhere else."""
    ref = torch.full_like(input_ids, tokenizer.pad_token_id)
    ref[:, 0] = tokenizer.cls_token_id
    return ref


@pytest.mark.parametrize("kind", OURS)
def test_captum_integrated_gradients_on_the_embeddings_of_a_padded_batch(kind, stock_dir, our_dir, padded, tokenizer):
    """LayerIntegratedGradients on `bert.embeddings`, a padded batch of 4 sentences, default config: the embeddings
    return (B, T, H), so the attributions are stock's; captum's hook is outside the encoder, which stays padding-free
    meanwhile."""
    attributions = {}
    for name in ("stock", kind):
        model = load(name, stock_dir, our_dir)
        lig = captum_attr.LayerIntegratedGradients(positive_logit(model), model.bert.embeddings)
        with contextlib.ExitStack() as stack:
            built = stack.enter_context(layouts_built(model)) if name != "stock" else None
            attributions[name] = lig.attribute(padded["input_ids"], reference_ids(padded["input_ids"], tokenizer),
                                               additional_forward_args=(padded["attention_mask"],), n_steps=16)
    assert built  # ours: the padding-free rows
    assert attributions[kind].shape == (4, padded["input_ids"].shape[1], 384)
    assert attributions[kind].abs().max() > 1e-3
    assert max_diff(attributions[kind], attributions["stock"]) < TOL


@contextlib.contextmanager
def unpadded(model, value: bool):
    """`config.unpad_inputs` set to `value` for the block (a no-op on stock BERT)."""
    previous = getattr(model.config, "unpad_inputs", None)
    model.config.unpad_inputs = value
    try:
        yield
    finally:
        model.config.unpad_inputs = previous


def conductance(model, inputs):
    """LayerConductance of the class-1 logit through `bert.encoder.layer[2]`, word embeddings against zeros."""
    embeds = model.bert.embeddings.word_embeddings(inputs["input_ids"]).detach()
    lc = captum_attr.LayerConductance(positive_logit_of_embeddings(model), model.bert.encoder.layer[2])
    return lc.attribute(embeds, torch.zeros_like(embeds), additional_forward_args=(inputs.get("attention_mask"),),
                        n_steps=8)


@pytest.mark.parametrize("kind", OURS)
def test_captum_layer_conductance(kind, stock_dir, our_dir, one, padded):
    """LayerConductance on `bert.encoder.layer[2]`, default config: one sentence and the padded batch (its hooks on
    the layer make the call run the padded layout, so it folds the layer's (B, T, H) output as on stock)."""
    stock, ours = load("stock", stock_dir, our_dir), load(kind, stock_dir, our_dir)
    for inputs in (one, padded):
        expected = conductance(stock, inputs)
        got = conductance(ours, inputs)
        assert got.shape == (*inputs["input_ids"].shape, 384) and got.abs().max() > 1e-4
        assert max_diff(got, expected) < TOL


def test_hooks_inside_the_encoder_see_the_padded_layout_unless_unpad_inputs_is_true(stock_dir, our_dir, padded, one):
    """The documented rule, with the warning that says it once: a hook on `encoder.layer[2]` sees stock's (B, T, H)
    on a padded batch by default, and with `unpad_inputs=False`; with `unpad_inputs=True` the (P, H) rows (P at least
    the real tokens: the CPU's bucketed layout has a few more); one sentence (no padding) is (1, T, H) always. Without
    the hook the padded batch runs padding-free."""
    from transformers.testing_utils import CaptureLogger

    model = load("ours", stock_dir, our_dir)
    with torch.no_grad(), layouts_built(model) as built:
        model(**padded)
    assert built  # nothing looks inside: padding-free
    shapes = {}
    hook = lambda m, args, out: shapes.setdefault(key, []).append((tuple(args[0].shape), tuple(out.shape)))  # noqa
    model.bert.encoder.layer[2].register_forward_hook(hook)
    logger = transformers.logging.get_logger(bi.layouts.__name__)
    logger.warning_once.cache_clear()
    for key, inputs, unpad in (("padded", padded, None), ("padded, again", padded, None),
                               ("padded, unpad_inputs=False", padded, False),
                               ("padded, unpad_inputs=True", padded, True), ("one", one, None)):
        with unpadded(model, unpad), torch.no_grad(), CaptureLogger(logger) as captured:
            model(**inputs)
        shapes[key, "log"] = captured.out
    real, (B, T) = int(padded["attention_mask"].sum()), padded["input_ids"].shape
    H = 384
    assert shapes["padded"] == shapes["padded, again"] == shapes["padded, unpad_inputs=False"] == [((B, T, H),) * 2]
    (rows, _), out = shapes["padded, unpad_inputs=True"][0]
    assert rows >= real and out == (rows, H)
    assert shapes["one"] == [((1, one["input_ids"].shape[1], H),) * 2]
    assert "`encoder.layer.2` has a forward hook from 'test_module_tree'" in shapes["padded", "log"]
    assert "config.unpad_inputs=True" in shapes["padded", "log"]
    assert shapes["padded, again", "log"] == ""  # once


def grad_cam(model, inputs, **options):
    """LayerGradCam of the class-1 logit on `bert.encoder.layer[-1].attention.self`."""
    return captum_attr.LayerGradCam(positive_logit(model), model.bert.encoder.layer[-1].attention.self).attribute(
        inputs["input_ids"], additional_forward_args=(inputs.get("attention_mask"),), **options)


@pytest.mark.parametrize("kind", OURS)
def test_captum_grad_cam_on_self_attention(kind, stock_dir, our_dir, one, padded):
    """LayerGradCam on `bert.encoder.layer[-1].attention.self`, whose output is stock's (context, attention weights)
    pair. captum needs every element to be a tensor: stock BERT (transformers 5.24) gives the weights with the eager
    attention only (with SDPA they are None, and captum refuses stock's own module: "Given input is not a
    torch.Tensor"), so both models run eager here."""
    stock, ours = load("stock", stock_dir, our_dir), load(kind, stock_dir, our_dir)
    for model in (stock, ours):
        model.set_attn_implementation("eager")
    for inputs in (one, padded):
        expected = grad_cam(stock, inputs)
        got = grad_cam(ours, inputs)
        assert type(got) is type(expected)
        got, expected = (r if isinstance(r, tuple) else (r,) for r in (got, expected))
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.abs().max() > 0 and max_diff(g, e) < TOL


def test_captum_grad_cam_on_the_input_of_self_attention(stock_dir, our_dir, one):
    """LayerGradCam on the input of `attention.self` (SDPA, default config, one sentence): stock's module is given
    the hidden states only as its positional input."""
    stock, ours = load("stock", stock_dir, our_dir), load("ours", stock_dir, our_dir)
    expected = grad_cam(stock, one, attribute_to_layer_input=True)
    got = grad_cam(ours, one, attribute_to_layer_input=True)
    assert max_diff(got, expected) < TOL


def baseline_inputs(one):
    """captum's BERT tutorial baseline: [CLS] [PAD]... [SEP], token types 0, position_ids all zeros; one row, no
    mask."""
    ids = one["input_ids"]
    ref = torch.zeros_like(ids)
    ref[0, 0], ref[0, -1] = ids[0, 0], ids[0, -1]
    return ref, torch.zeros_like(ids), torch.zeros_like(ids)


def stock_packs_by_positions() -> bool:
    """Whether this transformers' BERT reads position_ids without a mask as packing markers (5.25 on): its mask
    function takes them."""
    import inspect

    from transformers.masking_utils import create_bidirectional_mask
    return "position_ids" in inspect.signature(create_bidirectional_mask).parameters


@pytest.mark.parametrize("kind", OURS)
def test_captum_baseline_call_and_tutorial_attributions(kind, stock_dir, our_dir, one):
    """Silent wrong answer (2): one row, no attention mask, position_ids all zeros (captum's baseline call) gave
    logits (T, 2), the row taken as T packed one-token sequences. It gives stock's (1, 2), the row read as one
    sequence whose positions are all 0: stock's reading with an attention mask in every transformers release (and
    without one up to 5.24; from 5.25 stock without a mask reads a step that is not +1 as a new sequence, so each token
    attends to itself alone: the difference docs/model.md states). The tutorial's LayerIntegratedGradients over the
    three embedding tables (whose baseline pass is that call) gives stock's attributions."""
    ref_ids, ref_types, ref_positions = baseline_inputs(one)
    ids, types = one["input_ids"], one["token_type_ids"]
    positions = torch.arange(ids.shape[1])[None]
    ones = torch.ones_like(ref_ids)
    results = {}
    for name in ("stock", kind):
        model = load(name, stock_dir, our_dir)
        with torch.no_grad():
            mask = ones if name == "stock" else None  # ours as the user calls it, stock reading positions only
            results[name, "baseline"] = model(ref_ids, mask, ref_types, ref_positions).logits
            results[name, "unmasked"] = model(ref_ids, token_type_ids=ref_types, position_ids=ref_positions).logits
        embeddings = model.bert.embeddings
        lig = captum_attr.LayerIntegratedGradients(
            lambda i, t, p: model(i, token_type_ids=t, position_ids=p).logits[:, 1],
            [embeddings.word_embeddings, embeddings.token_type_embeddings, embeddings.position_embeddings])
        results[name, "attributions"] = lig.attribute((ids, types, positions), (ref_ids, ref_types, ref_positions),
                                                      n_steps=16)
    assert results[kind, "baseline"].shape == results["stock", "baseline"].shape == (1, 2)
    assert max_diff(results[kind, "baseline"], results["stock", "baseline"]) < TOL
    stock_moved = max_diff(results["stock", "unmasked"], results["stock", "baseline"])
    assert (stock_moved > TOL) == stock_packs_by_positions(), stock_moved  # the difference the docs state, and when
    words, types, positions = results[kind, "attributions"]  # token types equal the baseline's: no attribution
    assert words.abs().max() > 1e-4 and positions.abs().max() > 1e-4
    for got, expected in zip(results[kind, "attributions"], results["stock", "attributions"]):
        assert max_diff(got, expected) < TOL


@pytest.mark.parametrize("kind", OURS)
def test_rows_packed_by_restarting_positions(kind, stock_dir, our_dir, tokenizer):
    """Two rows of sequences packed back to back (two, and three), marked by position_ids restarting at 0, no mask
    (what transformers' BERT reads as packing from 5.25 on): no token attends across its sequence, so the last hidden
    state is each sentence's own run (stock's, every transformers release), and where stock packs too, stock's on
    the same rows. Before, a batch of several rows attended across the whole row (6.6 off stock 5.25)."""
    short, brief, fourth = (tokenizer(SENTENCES[i], return_tensors="pt")["input_ids"][0] for i in (0, 1, 3))
    ids = torch.stack([torch.cat([short, brief]), torch.cat([fourth, brief, brief[:2]])])  # (2, 16): 12 + 4, 10 + 4 + 2
    positions = torch.stack([torch.cat([torch.arange(12), torch.arange(4)]),
                             torch.cat([torch.arange(10), torch.arange(4), torch.arange(2)])])
    model, stock = load(kind, stock_dir, our_dir), load("stock", stock_dir, our_dir)
    with torch.no_grad():
        got = model.bert(ids, position_ids=positions).last_hidden_state
        alone = [stock.bert(ids[i:i + 1, j:k]) for i, j, k in ((0, 0, 12), (0, 12, 16), (1, 0, 10), (1, 10, 14),
                                                               (1, 14, 16))]
        pooled = model.bert(ids, position_ids=positions).pooler_output
        expected = torch.cat([torch.cat([a.last_hidden_state for a in alone[:2]], 1),
                              torch.cat([a.last_hidden_state for a in alone[2:]], 1)])
        assert max_diff(got, expected) < TOL
        assert max_diff(pooled, torch.cat([a.pooler_output for a in alone])) < TOL  # (S, H): one row a sequence
        if stock_packs_by_positions():
            assert max_diff(got, stock.bert(ids, position_ids=positions).last_hidden_state) < TOL


# ---------------------------------------------------------------------------------------------------------------------
# Code that looks inside the encoder on a padded batch, default config: stock's tensors and stock's numbers
# ---------------------------------------------------------------------------------------------------------------------
def output_of(out):
    return out if torch.is_tensor(out) else out[0]  # a layer's output, or the first of a module's tuple


def probe(model, attention_mask, records: dict) -> list:
    """Hooks on stock's module paths that record and change tensors by position, as user code does: [CLS], the last
    real token of each row, one example, a slice of positions; a forward pre-hook; `records` gets what they saw.
    Returns their handles."""
    layers = model.bert.encoder.layer
    rows, last = torch.arange(attention_mask.shape[0]), attention_mask.sum(1) - 1  # (B,) each row's [SEP]

    def hook(key, change=None):
        def run(module, args, out):
            y = output_of(out).clone()
            if change is not None:
                change(y)
            records[key] = y
            return y if torch.is_tensor(out) else (y, *out[1:])
        return run

    def shift_cls(y):
        y[:, 0] += 3.0

    def steer_first_example(y):
        y[0] = y[0] + 0.5

    def damp_a_slice(y):
        y[:, 1:4] *= 0.5

    def nudge_last_real_token(y):
        y[rows, last] += 0.1

    def scale_second_token(module, args):
        x = args[0].clone()
        x[:, 1] *= 1.5
        records["layer 5 input"] = x
        return (x, *args[1:])

    return [
        layers[0].register_forward_hook(hook("layer 0")),
        layers[1].register_forward_hook(hook("layer 1, [CLS] shifted", shift_cls)),
        layers[2].output.register_forward_hook(hook("layer 2 .output, first example steered", steer_first_example)),
        layers[3].attention.self.query.register_forward_hook(hook("layer 3 query, a slice damped", damp_a_slice)),
        layers[4].intermediate.register_forward_hook(hook("layer 4 .intermediate, last token nudged",
                                                          nudge_last_real_token)),
        layers[5].register_forward_pre_hook(scale_second_token),
        layers[5].register_forward_hook(lambda module, args, out: records.__setitem__("layer 5 [CLS]", out[:, 0])),
    ]


class ReadsThreeDims(torch.nn.Module):
    """A user's replacement of a submodule, written for stock's (B, T, H) layout."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        b, t, h = x.shape
        return self.inner(x) * torch.linspace(0.5, 1.5, t)[:, None]  # weighs positions


@pytest.mark.parametrize("kind", [*OURS, "remote"])
def test_hooks_and_replaced_modules_see_stock_tensors_on_a_padded_batch(kind, stock_dir, our_dir, padded, one):
    """Forward hooks that record and change `encoder.layer[i]`, `.output`, `.attention.self.query`, `.intermediate`
    by position, a pre-hook, and a replaced submodule that reads the 3-D shape: on the padded batch (4 sentences of
    different lengths) and on one sentence, every recorded tensor and the logits are stock's (shape, and within 1e-5).
    These are the calls that shifted every token's dimension 0 (logits 0.098 off), steered one token instead of one
    example (0.037 off), recorded a vector of rows instead of (B, H), or failed unpacking the shape."""
    batches = {"padded": padded, "one": one}
    results = {}
    for name in ("stock", kind):
        model = load(name, stock_dir, our_dir)
        for batch, inputs in batches.items():
            records = {}
            handles = probe(model, inputs["attention_mask"], records)
            with torch.no_grad():
                results[name, batch] = model(**inputs).logits, records
            for handle in handles:
                handle.remove()
        model.bert.encoder.layer[2].intermediate = ReadsThreeDims(model.bert.encoder.layer[2].intermediate)
        for batch, inputs in batches.items():
            with torch.no_grad():
                results[name, batch, "replaced"] = model(**inputs).logits, {}
    for key in [*batches, *((batch, "replaced") for batch in batches)]:
        key = key if isinstance(key, tuple) else (key,)
        (expected, stock_records), (got, our_records) = results[("stock", *key)], results[(kind, *key)]
        assert max_diff(got, expected) < TOL, key
        assert our_records.keys() == stock_records.keys()
        for record, value in our_records.items():
            assert max_diff(value, stock_records[record]) < TOL, (key, record)
    assert len(results["stock", "padded"][1]) == 7
    assert max_diff(results["stock", "padded"][0], results["stock", "padded", "replaced"][0]) > 1e-3  # both changed


@pytest.mark.parametrize("kind", OURS)
def test_captum_grad_cam_on_a_layer_of_a_padded_batch(kind, stock_dir, our_dir, padded):
    """LayerGradCam on `bert.encoder.layer[-1]` (SDPA, default config), the padded batch: stock's attribution, one
    per example, where it returned one per row of the padding-free layout silently."""
    stock, ours = load("stock", stock_dir, our_dir), load(kind, stock_dir, our_dir)
    expected, got = (captum_attr.LayerGradCam(positive_logit(model), model.bert.encoder.layer[-1]).attribute(
        padded["input_ids"], additional_forward_args=(padded["attention_mask"],)) for model in (stock, ours))
    assert got.shape == expected.shape and got.shape[0] == padded["input_ids"].shape[0]
    assert got.abs().max() > 0 and max_diff(got, expected) < TOL


# ---------------------------------------------------------------------------------------------------------------------
# Other ways of changing what runs inside: a forward replaced on a module or on a class, accelerate's hooks
# ---------------------------------------------------------------------------------------------------------------------
def layouts_of(model):
    """The layouts module of the model's own code (bert-impl's, or a remote copy's)."""
    model_file = sys.modules[type(model.base_model).forward.__module__]
    return sys.modules[model_file.choose_layout.__module__] if hasattr(model_file, "choose_layout") else model_file


def shift_first_feature(y, seen: list):
    """What the edits below do to a (B, T, H) output: record its shape, add 1 at position 0 of every row ([CLS]).
    On the padding-free (P, H) rows the same line would shift every token's first feature instead."""
    seen.append(tuple(y.shape))
    y = y.clone()
    y[:, 0] += 1.0
    return y


def replace_instance_forward(model, seen):
    """Steering without hooks: `layer.output.forward = types.MethodType(f, layer.output)`, f calling the original."""
    output = model.bert.encoder.layer[2].output
    original = output.forward
    output.forward = types.MethodType(lambda self, h, x: shift_first_feature(original(h, x), seen), output)
    return lambda: None


def patch_class_forward(model, seen):
    """`BertSelfOutput.forward = f` on the model's own class of `attention.output` (stock's, ours, or a remote
    copy's), f calling the original; undone by the returned function."""
    cls = type(model.bert.encoder.layer[0].attention.output)
    original = cls.forward
    cls.forward = lambda self, h, x: shift_first_feature(original(self, h, x), seen)
    return lambda: setattr(cls, "forward", original)


def add_accelerate_hook(model, seen):
    """accelerate's `add_hook_to_module(layer, MyHook())`, a user's ModelHook subclass changing the layer's output."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class ShiftFirstFeature(ModelHook):
        def post_forward(self, module, output):
            return shift_first_feature(output, seen)

    add_hook_to_module(model.bert.encoder.layer[3], ShiftFirstFeature())
    return lambda: None


EDITS = {"instance forward": replace_instance_forward, "class forward": patch_class_forward,
         "accelerate hook": add_accelerate_hook}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("kind", [*OURS, "remote"])
def test_a_replaced_forward_or_an_accelerate_hook_sees_stock_tensors_on_a_padded_batch(kind, edit, stock_dir,
                                                                                       our_dir, padded):
    """Each way of changing a module's computation without a torch hook, done the same way on stock and on ours, on
    the padded batch with the default config: it sees stock's (B, T, H) tensors as often as on stock, the logits are
    stock's with the same edit (and differ from the unedited ones), and the once-said log line names what it saw.
    These edits met the padding-free (P, H) rows silently (logits 1.2e-2 to 2.9e-2 off)."""
    from transformers.testing_utils import CaptureLogger

    results = {}
    for name in ("stock", kind):
        model, seen = load(name, stock_dir, our_dir), []
        with torch.no_grad():
            plain = model(**padded).logits
            undo = EDITS[edit](model, seen)
            logger = transformers.logging.get_logger(layouts_of(model).__name__)
            logger.warning_once.cache_clear()
            try:
                with CaptureLogger(logger) as captured:
                    logits = model(**padded).logits
            finally:
                undo()
        results[name] = logits, seen, captured.out
    (expected, stock_seen, _), (got, our_seen, log) = results["stock"], results[kind]
    assert our_seen == stock_seen and stock_seen[0] == (*padded["input_ids"].shape, 384)
    assert max_diff(got, expected) < TOL
    assert max_diff(expected, plain) > 1e-3  # the edit changed the answer
    assert "calls with padding run the padded layout" in log
    assert {"instance forward": "`encoder.layer.2.output` has a forward set on the module",
            "class forward": "SelfOutput.forward was replaced",
            "accelerate hook": "an accelerate hook ShiftFirstFeature"}[edit] in log


def counting(forward, counts: list):
    """`forward` wrapped to count its calls, as a user's class patch wraps it (functools.wraps keeps its names)."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        counts.append(type(self).__name__)
        return forward(self, *args, **kwargs)
    return wrapper


@pytest.mark.parametrize("kind", [*OURS, "remote"])
def test_a_patch_of_each_stock_named_class_runs_as_often_as_in_stock(kind, stock_dir, our_dir, padded):
    """Each class of stock's module tree (BertEmbeddings, BertLayer, BertSelfOutput, BertOutput, ...) patched with a
    counting wrapper, one at a time, and its counterpart on ours (the class at the same path): the patch runs as many
    times per forward on the padded batch as on stock (BertOutput and BertSelfOutput are separate classes: a patch of
    one does not reach the other), and the logits are stock's."""
    stock, ours = load("stock", stock_dir, our_dir), load(kind, stock_dir, our_dir)
    classes = {}  # stock's class -> ours, by path
    for path, module in stock.named_modules():
        if type(module).__module__ == transformers.models.bert.modeling_bert.__name__ and path:
            classes.setdefault(type(module), type(ours.get_submodule(path)))
    assert {cls.__name__ for cls in classes} >= {"BertSelfOutput", "BertOutput", "BertLayer", "BertEmbeddings"}
    for stock_class, our_class in classes.items():
        calls, logits = {}, {}
        for name, model, cls in (("stock", stock, stock_class), (kind, ours, our_class)):
            original, calls[name] = cls.forward, []
            cls.forward = counting(original, calls[name])
            try:
                with torch.no_grad():
                    logits[name] = model(**padded).logits
            finally:
                cls.forward = original
        assert len(calls[kind]) == len(calls["stock"]) > 0, (stock_class.__name__, calls)
        assert max_diff(logits[kind], logits["stock"]) < TOL, stock_class.__name__


def test_accelerate_offload_hooks_keep_the_padding_free_layout(stock_dir, our_dir, padded):
    """accelerate's own hooks (`cpu_offload`: an AlignDevicesHook on every module, its weights brought in for each
    call) are framework code: the padded batch stays padding-free, with stock's logits."""
    import accelerate

    stock, model = load("stock", stock_dir, our_dir), load("ours", stock_dir, our_dir)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert isinstance(vars(model.bert.encoder.layer[0].output.dense).get("_hf_hook"), accelerate.hooks.AlignDevicesHook)
    with torch.no_grad(), layouts_built(model) as built:
        got = model(**padded).logits
        expected = stock(**padded).logits
    assert built == [tuple(padded["input_ids"].shape)]
    assert max_diff(got, expected) < TOL


# ---------------------------------------------------------------------------------------------------------------------
# Silent wrong answer (3): packs marked by seq_idx or cu_seq_lens_q alone
# ---------------------------------------------------------------------------------------------------------------------
def test_packs_marked_by_seq_idx_or_cu_seq_lens_alone_restart_positions(stock_dir, our_dir, tokenizer, padded):
    """The four sentences packed into one row, marked only by `seq_idx`, or only by `cu_seq_lens_q` (no position_ids):
    positions restart per sequence, so the logits are the padded batch's (and stock's) within 1e-5. They were 8.7e-3
    off when positions ran on across the pack."""
    rows = [tokenizer(s, return_tensors="pt")["input_ids"][0] for s in SENTENCES]
    lengths = torch.tensor([len(r) for r in rows])
    packed = torch.cat(rows)[None]  # (1, total)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    seq_idx = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32), lengths)[None]
    model, stock = load("ours", stock_dir, our_dir), load("stock", stock_dir, our_dir)
    with torch.no_grad():
        expected = model(**padded).logits
        stock_logits = stock(**padded).logits
        by_seq_idx = model(input_ids=packed, seq_idx=seq_idx).logits
        by_cu = model(input_ids=packed, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(lengths.max()),
                      max_length_k=int(lengths.max())).logits
    assert max_diff(expected, stock_logits) < TOL
    assert max_diff(by_seq_idx, expected) < TOL
    assert max_diff(by_cu, expected) < TOL


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2 on CPU (gloo): the padding-free path under fully_shard's hooks, equal to one process
# ---------------------------------------------------------------------------------------------------------------------
WORLD = 2


def fsdp_model():
    torch.manual_seed(0)
    return bi.BertImplForSequenceClassification(bi.BertImplConfig(**SMALL))


def fsdp_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    """One FSDP2 rank: every layer and the model `fully_shard`ed, its half of the padded batch, one forward and
    backward; rank 0 saves the mean loss, the full gradients and the layouts its forward built."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from modeling_bert_impl import layouts

    layouts.BREAK_EVEN_FLOPS = {}  # skipping always pays (conftest's skipping_always_pays, in this spawned process)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = fsdp_model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.bert.encoder.layer:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        batch = {k: v.chunk(world)[rank] for k, v in small_batch().items()}
        with layouts_built(model) as seen:
            loss = model(**batch).loss
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        if rank == 0:
            torch.save({"loss": loss / world, "grads": grads, "seen": seen}, out_file)
        # Both ranks leave together: a rank that tore its gloo group down while the other was still writing aborted
        # ("terminate called without an active exception") in a CI run.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13),
                    reason=f"FSDP2 on CPU (gloo) is torch's: torch 2.6 fails ('Stream' has no 'record_event'), torch "
                           f"2.7's gradients differ from one process's; run from torch 2.13 (installed: "
                           f"{torch.__version__})")
@pytest.mark.slow
def test_fsdp2_on_cpu_takes_the_padding_free_path_and_equals_one_process(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(fsdp_worker, args=(WORLD, str(tmp_path / "init"), str(tmp_path / "out.pt")), nprocs=WORLD)
    sharded = torch.load(tmp_path / "out.pt")

    model = fsdp_model()
    loss = model(**small_batch()).loss
    loss.backward()
    assert abs(sharded["loss"].item() - loss.item()) < TOL
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert sharded["grads"].keys() == grads.keys()
    diffs = {n: max_diff(sharded["grads"][n], g) for n, g in grads.items()}
    assert max(diffs.values()) < TOL, diffs
    # Rank 0's half of the batch is padded, and fully_shard's hooks on every layer kept the padding-free layout.
    assert [tuple(shape) for shape in sharded["seen"]] == [(2, 9)]


# ---------------------------------------------------------------------------------------------------------------------
# Folders saved under the old names
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(p.name for p in LEGACY.iterdir() if p.is_dir()))
def test_folder_saved_with_the_old_names_loads_with_its_outputs(name):
    """tests/fixtures/legacy_names: folders written by bert-impl before it took stock names (`bert.layers.N.attn.qkv`,
    `mlm_head`, ...), with the outputs that code gave. Each loads into its class with every weight and gives them."""
    stored = load_file(LEGACY / "expected_outputs.safetensors")
    inputs = {k: stored[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    model, info = getattr(bi, name).from_pretrained(LEGACY / name, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        out = model.eval()(**inputs)
    fields = {key.split(".", 1)[1]: value for key, value in stored.items() if key.startswith(f"{name}.")}
    assert fields
    for field, expected in fields.items():
        assert max_diff(getattr(out, field), expected) < TOL, field
