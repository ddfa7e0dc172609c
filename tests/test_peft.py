"""PEFT on bert-impl as on stock BERT. The module names are stock BERT's, so adapters need no conversion: an adapter
trained on either model loads on the other with peft's own `PeftModel.from_pretrained`, with equal logits, for every
peft method that works on stock BERT (each method of the installed peft is tried; one that stock BERT itself cannot
run is skipped, saying why). Also: peft's default target modules are stock's, Trainer + LoRA save / reload / merge,
AdaLoRA's pruned ranks, AutoPeftModel, and Poly and Lily switching the model to padded batches.

Small random BERTs written by transformers' BertForSequenceClassification (the mechanics do not depend on size);
references are transformers' BERT with the same adapter, or our model before saving."""

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import BertConfig, Trainer, TrainingArguments

import modeling_bert_impl as bi
from helpers import layouts_built

peft = pytest.importorskip("peft")
from peft import AutoPeftModelForSequenceClassification, LoraConfig, PeftModel, get_peft_model  # noqa: E402

TOL = 1e-5
SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=64, num_labels=2)
# Methods whose layers need stock's (B, T, H) layout: peft_support switches our model to padded batches for them.
PADDED_LAYOUT = {"POLY", "LILY"}


@pytest.fixture(scope="module")
def stock_dir(tmp_path_factory):
    """A stock BertForSequenceClassification folder (random, seeded)."""
    folder = tmp_path_factory.mktemp("stock-bert")
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(BertConfig(**SMALL)).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def wide_stock_dir(tmp_path_factory):
    """A stock BertForSequenceClassification folder wide enough for every method's default sizes (C3A and VB-LoRA
    blocks of 256, MiSS rank 64, RoAd groups of 64)."""
    folder = tmp_path_factory.mktemp("wide-stock-bert")
    torch.manual_seed(0)
    config = BertConfig(**{**SMALL, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 1})
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return str(folder)


def batch(seed: int = 1, size: int = 6, T: int = 12) -> dict:
    """Token ids with right padding of varied lengths; label 1 when token 7 occurs (something LoRA can learn)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(8, 99, (size, T), generator=g)
    lengths = torch.randint(3, T + 1, (size,), generator=g)
    attention_mask = (torch.arange(T) < lengths[:, None]).long()
    input_ids[::2, 1] = 7
    return {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask,
            "labels": (input_ids == 7).any(-1).long()}


def logits(model, inputs, **extra) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **extra).logits


def ours(folder):
    return bi.BertImplForSequenceClassification.from_pretrained(folder)


def stock(folder):
    return transformers.BertForSequenceClassification.from_pretrained(folder)


def methods_with_a_bert_default() -> list[str]:
    """The PEFT methods (PeftType names) for which the installed peft has a default target_modules for "bert": those
    of its `TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING` tables that have a "bert" key."""
    names = [m[1] for name, table in vars(peft.utils.constants).items()
             if (m := re.fullmatch(r"TRANSFORMERS_MODELS_TO_(\w+)_TARGET_MODULES_MAPPING", name))
             and isinstance(table, dict) and "bert" in table]
    return sorted(names)


BERT_DEFAULT_METHODS = methods_with_a_bert_default()
ALL_METHODS = sorted(method.name for method in peft.PeftType)
# Settings that a method needs regardless of the model (AdaLoRA's schedule length, the tokens to train).
REQUIRED = {"ADALORA": dict(total_step=10), "TRAINABLE_TOKENS": dict(token_indices=[7, 8, 9])}


def method_config(method: str):
    """The method's config for sequence classification: peft's defaults, with target_modules ["query", "value"] where
    peft has no "bert" default and the method takes target modules, and 4 virtual tokens for prompt methods."""
    config_class = peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING[peft.PeftType[method]]
    fields = getattr(config_class, "__dataclass_fields__", {})
    settings = dict(REQUIRED.get(method, {}))
    if method not in BERT_DEFAULT_METHODS and "target_modules" in fields:
        settings["target_modules"] = ["query", "value"]
    if "num_virtual_tokens" in fields:
        settings["num_virtual_tokens"] = 4
    return config_class(task_type="SEQ_CLS", **settings)


def forward_extra(method: str, inputs: dict) -> dict:
    """What the method's forward needs beyond the batch: the task of each example (Poly, multitask prompt tuning)."""
    if method in ("POLY", "MULTITASK_PROMPT_TUNING"):
        return {"task_ids": torch.zeros(len(inputs["input_ids"]), dtype=torch.long)}
    return {}


def adapted(base, method: str):
    """`base` with a new adapter of the method, initialised from seed 0 (so the same adapter on either model)."""
    config = method_config(method)
    torch.manual_seed(0)
    return get_peft_model(base, config)


def perturbed(model):
    """The adapter's trainable tensors moved off their (often identity) initial values, as training would."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "classifier" not in name and p.is_floating_point():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def test_every_method_of_peft_is_tried():
    assert {"LORA", "LOHA", "LOKR", "IA3", "ADALORA", "VERA", "BOFT", "OFT", "HRA", "FOURIERFT"} <= set(
        BERT_DEFAULT_METHODS), BERT_DEFAULT_METHODS
    assert set(BERT_DEFAULT_METHODS) <= set(ALL_METHODS) and "PROMPT_TUNING" in ALL_METHODS
    for method in ALL_METHODS:
        assert peft.PeftType[method] in peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING, method


@pytest.mark.parametrize("method", ALL_METHODS)
def test_adapter_trained_on_either_model_loads_on_the_other(wide_stock_dir, tmp_path, method):
    """An adapter trained (here: moved off its initial values) on transformers' BERT loads on ours with peft's own
    PeftModel.from_pretrained and gives its logits within 1e-5; one trained on ours loads on transformers' BERT
    likewise. Skipped only where stock BERT cannot run the method itself."""
    inputs = batch(T=10)
    extra = forward_extra(method, inputs)
    try:
        on_stock = perturbed(adapted(stock(wide_stock_dir), method))
        from_stock = logits(on_stock, inputs, **extra)
    except Exception as error:  # noqa: BLE001 - whatever stock BERT raises: the method does not work on it
        pytest.skip(f"{method} does not run on transformers' BertForSequenceClassification: "
                    f"{type(error).__name__}: {error}")
    effect = (from_stock - logits(stock(wide_stock_dir), inputs)).abs().max().item()
    assert effect > 10 * TOL, f"the {method} adapter must change the outputs"
    on_stock.save_pretrained(tmp_path / "from-stock")

    on_ours = perturbed(adapted(ours(wide_stock_dir), method))
    from_ours = logits(on_ours, inputs, **extra)
    on_ours.save_pretrained(tmp_path / "from-ours")
    assert on_ours.get_base_model().config.unpad_inputs is None  # Poly and Lily: padded by the layout rule

    diffs = {
        "stock adapter on ours": logits(PeftModel.from_pretrained(ours(wide_stock_dir), tmp_path / "from-stock"),
                                        inputs, **extra) - from_stock,
        "our adapter on stock": logits(PeftModel.from_pretrained(stock(wide_stock_dir), tmp_path / "from-ours"),
                                       inputs, **extra) - from_ours,
        "same start, ours vs stock": from_ours - from_stock,  # same seed, same names: the same adapter
    }
    diffs = {way: diff.abs().max().item() for way, diff in diffs.items()}
    print(f"{method}: adapter's effect {effect:.1e}, " + ", ".join(f"{way} {d:.1e}" for way, d in diffs.items()))
    assert max(diffs.values()) < TOL, diffs


def test_prefix_tuning_trains_and_reloads_on_ours_with_any_transformers(stock_dir, tmp_path):
    """Prefix tuning on bert-impl with whatever transformers is installed (from 5.24 peft no longer runs it on
    transformers' BERT, which renamed the argument peft passes, so the test above has no stock reference there; the
    encoder's arithmetic with cached keys is checked in test_modeling): a training step moves the prefix and lowers the
    loss, the saved adapter reloads with peft's PeftModel.from_pretrained to the same logits, and the adapter changes
    the logits; every layer's cached keys and values get a gradient. Loading it onto optimize_for_inference's copy is
    refused: the adapter holds the classifier it trained, which the copy's packed classifier would not take."""
    inputs = batch(T=10)
    model = adapted(ours(stock_dir), "PREFIX_TUNING")
    before = logits(model, inputs)
    prefix = model.prompt_encoder["default"].embedding.weight  # (virtual tokens, layers x 2 x H): keys, values
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for _ in range(3):
        loss = model(**inputs).loss
        loss.backward()
        grads = prefix.grad.abs().view(len(prefix), -1, SMALL["hidden_size"]).amax((0, 2))  # per layer's keys, values
        assert len(grads) == 2 * SMALL["num_hidden_layers"] and (grads > 0).all(), grads
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    trained = logits(model, inputs)
    assert (trained - before).abs().max() > 10 * TOL
    without = logits(ours(stock_dir), inputs)
    assert (trained - without).abs().max() > 10 * TOL, "the prefix must change the logits"
    model.save_pretrained(tmp_path / "prefix")
    reloaded = logits(PeftModel.from_pretrained(ours(stock_dir), tmp_path / "prefix"), inputs)
    assert (reloaded - trained).abs().max() < TOL
    optimized = bi.optimize_for_inference(ours(stock_dir))
    with pytest.raises(ValueError, match=r"loading base_model\.classifier\.modules_to_save\.default\.weight: this "
                                         r"is an inference model made by optimize_for_inference"):
        PeftModel.from_pretrained(optimized, tmp_path / "prefix")  # its classifier, packed at the call, stays as it was


def test_adapters_on_an_inference_model_load_unless_they_change_its_weights(stock_dir, tmp_path):
    """A LoRA adapter loads onto optimize_for_inference's copy and gives the plain model's logits with it (LoRA's
    layers are new modules beside the packed ones); one that also trained the classifier (sequence classification's
    modules_to_save) is refused, naming the weight: the copy's classifier was packed at the call."""
    inputs = batch(T=10)
    for name, modules_to_save in (("lora", None), ("lora-classifier", ["classifier"])):
        config = LoraConfig(target_modules=["query", "value"], modules_to_save=modules_to_save)
        torch.manual_seed(0)
        perturbed(get_peft_model(ours(stock_dir), config)).save_pretrained(tmp_path / name)
    plain = logits(PeftModel.from_pretrained(ours(stock_dir), tmp_path / "lora"), inputs)
    optimized = logits(PeftModel.from_pretrained(bi.optimize_for_inference(ours(stock_dir)), tmp_path / "lora"), inputs)
    assert (optimized - plain).abs().max() < TOL and (plain - logits(ours(stock_dir), inputs)).abs().max() > 10 * TOL
    with pytest.raises(ValueError, match=r"loading \S*classifier\S*weight: this is an inference model"):
        PeftModel.from_pretrained(bi.optimize_for_inference(ours(stock_dir)), tmp_path / "lora-classifier")


@pytest.mark.parametrize("method", BERT_DEFAULT_METHODS)
def test_default_target_modules_are_stock_ones(wide_stock_dir, method):
    """peft's defaults for "bert" on transformers' BERT and for "bert_impl" on ours target the same modules, by the
    same names (IA3's feedforward modules too). Poly and Lily switch our model to padded batches."""
    config_class = peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING[peft.PeftType[method]]
    make = lambda: config_class(task_type="SEQ_CLS", **REQUIRED.get(method, {}))  # noqa: E731
    assert make().target_modules is None  # the default is peft's table's
    on_stock = get_peft_model(stock(wide_stock_dir), make())
    model = get_peft_model(ours(wide_stock_dir), make())
    assert on_stock.base_model.targeted_module_names, "peft's stock default targets nothing"
    assert model.base_model.targeted_module_names == on_stock.base_model.targeted_module_names
    if method == "IA3":
        feedforward = lambda m: {n for n, mod in m.named_modules() if getattr(mod, "is_feedforward", False)}  # noqa
        assert feedforward(model) == feedforward(on_stock) and feedforward(model)


FRESH_PROCESS_LORA = """
import sys, torch, transformers
{first}
{second}
from peft import LoraConfig, PeftModel, get_peft_model
SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=66, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ids = torch.randint(3, 99, (4, 9), generator=torch.Generator().manual_seed(0))
labels = torch.tensor([0, 1, 1, 0])
for prefix in ("Bert", "Roberta", "XLMRoberta", "Camembert"):
    folder, stock_class = f"{{sys.argv[1]}}/{{prefix}}", getattr(transformers, f"{{prefix}}ForSequenceClassification")
    torch.manual_seed(0)
    stock_class(getattr(transformers, f"{{prefix}}Config")(**SMALL)).save_pretrained(folder)
    ours = getattr(bi, f"{{prefix}}ImplForSequenceClassification").from_pretrained(folder)
    model = get_peft_model(ours, LoraConfig(task_type="SEQ_CLS", init_lora_weights=False))  # no target_modules
    assert {{n.split(".")[-1] for n in model.base_model.targeted_module_names}} == {{"query", "value"}}, prefix
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward(); optimizer.step(); optimizer.zero_grad(); losses.append(loss.item())
    assert losses[-1] < losses[0], (prefix, losses)
    model.save_pretrained(f"{{folder}}-ours-adapter")
    on_stock = PeftModel.from_pretrained(stock_class.from_pretrained(folder), f"{{folder}}-ours-adapter").eval()
    stock_lora = get_peft_model(stock_class.from_pretrained(folder), LoraConfig(  # peft has no camembert defaults
        task_type="SEQ_CLS", target_modules=["query", "value"], init_lora_weights=False))
    stock_lora.save_pretrained(f"{{folder}}-stock-adapter")
    on_ours = PeftModel.from_pretrained(getattr(bi, f"{{prefix}}ImplForSequenceClassification").from_pretrained(
        folder), f"{{folder}}-stock-adapter").eval()
    with torch.no_grad():
        assert (on_stock(input_ids=ids).logits - model.eval()(input_ids=ids).logits).abs().max() < 1e-5, prefix
        assert (on_ours(input_ids=ids).logits - stock_lora.eval()(input_ids=ids).logits).abs().max() < 1e-5, prefix
    print(prefix, "ok")
"""


@pytest.mark.parametrize("order", ["bert-impl first", pytest.param("peft first", marks=pytest.mark.slow)])
def test_peft_defaults_need_no_call_in_a_fresh_process(order, tmp_path):
    """A stock user's LoRA code on our models, in a Python that imports bert-impl (before peft or after it) and calls
    nothing else: `LoraConfig(task_type="SEQ_CLS")` without `target_modules` targets query and value on BERT and on
    each family, trains (the loss falls over five steps), and the adapter loads on transformers' class of the same
    weights with the same logits, as a stock adapter does on ours (stock CamemBERT has no defaults in peft: ours takes
    RoBERTa's)."""
    imports = ["import modeling_bert_impl as bi", "import peft"]
    first, second = imports if order == "bert-impl first" else imports[::-1]
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS_LORA.format(first=first, second=second), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["Bert", "ok", "Roberta", "ok", "XLMRoberta", "ok", "Camembert", "ok"]


def test_peft_tables_keep_their_entries():
    """The fill is additive: peft's own entries are untouched, ours equal their stock family's, and filling again
    (`register_peft_defaults()`, kept for older code) changes nothing."""
    from peft.utils import constants

    lora = constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    before = {k: list(v) for k, v in lora.items()}
    bi.register_peft_defaults()
    assert {k: list(v) for k, v in lora.items()} == before
    assert lora["bert_impl"] == lora["bert"] and lora["xlm_roberta_impl"] == lora["xlm-roberta"]
    assert lora["camembert_impl"] == lora["roberta"] and "camembert" not in lora  # peft lists none for camembert


def test_defaults_on_stock_folders_loaded_through_the_patch(stock_dir):
    bi.apply_bert_impl()
    try:
        patched = get_peft_model(transformers.AutoModelForSequenceClassification.from_pretrained(stock_dir),
                                 LoraConfig(task_type="SEQ_CLS"))
    finally:
        bi.revert_bert_impl()
    on_stock = get_peft_model(stock(stock_dir), LoraConfig(task_type="SEQ_CLS"))
    assert isinstance(patched.get_base_model(), bi.BertImplForSequenceClassification)
    assert patched.base_model.targeted_module_names == on_stock.base_model.targeted_module_names
    assert {n.split(".")[-1] for n in patched.base_model.targeted_module_names} == {"query", "value"}


def test_poly_and_lily_run_padded_batches_with_stock_answers(stock_dir, skipping_always_pays):
    """Poly mixes LoRA modules per example and Lily averages its router over every position of the batch, padding
    included: on the padding-free rows their answers would differ from stock's (Lily's by ~4e-4 here), so our model
    runs them on padded batches (their layers are in BATCH_LAYOUT_LAYERS), where they are stock's; LoRA's stay
    padding-free."""
    inputs = batch()
    for method in sorted(PADDED_LAYOUT & set(peft.PeftType.__members__)):  # Lily is newer than peft 0.18
        extra = forward_extra(method, inputs)
        expected = logits(perturbed(adapted(stock(stock_dir), method)), inputs, **extra)
        model = perturbed(adapted(ours(stock_dir), method))
        with layouts_built(model.get_base_model()) as built:
            got = logits(model, inputs, **extra)
        assert built == [] and (got - expected).abs().max() < TOL, method
    lora = adapted(ours(stock_dir), "LORA")
    with layouts_built(lora.get_base_model()) as built:
        logits(lora, inputs)
    assert built, "LoRA's layers keep the padding-free layout"


def test_trainer_lora_save_reload_merge(stock_dir, tmp_path, skipping_always_pays):
    from datasets import Dataset

    model = get_peft_model(ours(stock_dir), LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8))
    train = batch(seed=2, size=16)
    args = TrainingArguments(tmp_path / "run", max_steps=4, per_device_train_batch_size=8, learning_rate=5e-3,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with layouts_built(model.get_base_model()) as built:
        Trainer(model=model, args=args, train_dataset=Dataset.from_dict({k: v.tolist() for k, v in train.items()})
                ).train()
    assert len(built) == 4  # LoRA's layers keep the padding-free layout: every step ran it
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in changed) and any("classifier" in n for n in changed)

    inputs = batch(seed=3)
    trained = logits(model, inputs)
    assert (trained - logits(ours(stock_dir), inputs)).abs().max() > 1e-3, "training must change the outputs"
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == stock_dir and set(saved["target_modules"]) == {"query", "value"}
    reloaded = PeftModel.from_pretrained(ours(stock_dir), tmp_path / "adapter")
    assert (logits(reloaded, inputs) - trained).abs().max() < TOL
    merged = reloaded.merge_and_unload()
    assert isinstance(merged, bi.BertImplForSequenceClassification)
    assert (logits(merged, inputs) - trained).abs().max() < TOL
    on_stock = PeftModel.from_pretrained(stock(stock_dir), tmp_path / "adapter")
    assert (logits(on_stock, inputs) - trained).abs().max() < TOL
    assert (logits(on_stock.merge_and_unload(), inputs) - trained).abs().max() < TOL

    # The adapter's base is the stock folder: AutoPeftModel builds transformers' class, or ours once patched.
    assert type(AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "adapter").get_base_model()) is (
        transformers.BertForSequenceClassification)
    bi.apply_bert_impl()
    try:
        auto = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "adapter")
    finally:
        bi.revert_bert_impl()
    assert isinstance(auto.get_base_model(), bi.BertImplForSequenceClassification)
    assert (logits(auto, inputs) - trained).abs().max() < TOL


def test_adalora_ranks_allocated_in_training_load_on_stock_bert(stock_dir, tmp_path):
    """AdaLoRA prunes each module's rank as it trains and records what it keeps in `rank_pattern` (by module path):
    the same paths on transformers' BERT, so the same ranks and logits."""
    from peft import AdaLoraConfig

    torch.manual_seed(0)
    model = get_peft_model(ours(stock_dir), AdaLoraConfig(task_type="SEQ_CLS", total_step=8, tinit=1, tfinal=2,
                                                          deltaT=1, init_r=6, target_r=2))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    train = batch(seed=2)
    for step in range(8):
        model(**train).loss.backward()
        optimizer.step()
        model.base_model.update_and_allocate(step)
        optimizer.zero_grad()
    inputs = batch()
    expected = logits(model, inputs)
    with model.disable_adapter():
        assert (expected - logits(model, inputs)).abs().max() > 10 * TOL, "the adapter must change the outputs"
    model.save_pretrained(tmp_path / "adapter")
    kept = {key: sum(mask) for key, mask in model.peft_config["default"].rank_pattern.items()}
    assert sorted(set(kept.values())) != [6], "training must have pruned ranks"
    on_stock = PeftModel.from_pretrained(stock(stock_dir), tmp_path / "adapter")
    assert {key: sum(mask) for key, mask in on_stock.peft_config["default"].rank_pattern.items()} == kept
    assert (logits(on_stock, inputs) - expected).abs().max() < TOL


def test_adapter_without_task_type_on_the_encoder(stock_dir, tmp_path):
    """Without a task type, an adapter on our BertImplModel loads on transformers' BertModel with PeftModel (the same
    last hidden states on real tokens); AutoPeftModel builds the class the adapter names, ours, where peft is allowed
    to import it (peft's `import_allowlist`)."""
    torch.manual_seed(0)
    model = perturbed(get_peft_model(bi.BertImplModel.from_pretrained(stock_dir), LoraConfig(r=4)))
    inputs = batch()
    mask = inputs["attention_mask"].bool()  # padding positions are not compared (they differ by design)

    def hidden(m):
        with torch.no_grad():
            return m.eval()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state

    expected = hidden(model)
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["auto_mapping"]["base_model_class"] == "BertImplModel"
    on_stock = PeftModel.from_pretrained(transformers.BertModel.from_pretrained(stock_dir), tmp_path / "adapter")
    assert (hidden(on_stock)[mask] - expected[mask]).abs().max() < TOL
    # peft 0.18 imports the class the adapter names as it is; newer releases ask for an allowlist
    allow = "import_allowlist" in inspect.signature(peft.AutoPeftModel.from_pretrained).parameters
    auto = peft.AutoPeftModel.from_pretrained(
        tmp_path / "adapter", **({"import_allowlist": [saved["auto_mapping"]["parent_library"]]} if allow else {}))
    assert type(auto.get_base_model()) is bi.BertImplModel
    assert (hidden(auto)[mask] - expected[mask]).abs().max() < TOL


def test_saved_adapter_loads_without_bert_impl(stock_dir, tmp_path, run_without_package):
    """What a user with only transformers and peft gets from the saved folder: AutoPeftModel on transformers' BERT,
    our model's logits."""
    torch.manual_seed(0)
    model = perturbed(get_peft_model(ours(stock_dir), LoraConfig(task_type="SEQ_CLS",
                                                                  target_modules=["query", "output.dense"])))
    inputs = batch()
    expected = logits(model, inputs)
    model.save_pretrained(tmp_path / "adapter")
    result = run_without_package(f"""
        import json, torch
        from peft import AutoPeftModelForSequenceClassification

        model = AutoPeftModelForSequenceClassification.from_pretrained({str(tmp_path / "adapter")!r}).eval()
        with torch.no_grad():
            out = model(input_ids=torch.tensor({inputs["input_ids"].tolist()}),
                        attention_mask=torch.tensor({inputs["attention_mask"].tolist()})).logits
        print(json.dumps({{"class": type(model.get_base_model()).__name__, "logits": out.tolist()}}))
        """)
    assert result["class"] == "BertForSequenceClassification"
    assert (torch.tensor(result["logits"]) - expected).abs().max() < TOL
