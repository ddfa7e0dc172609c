"""PEFT on bert-impl as on stock BERT: default target modules, Trainer + LoRA with save / reload / merge, stock-BERT
adapters converted onto our fused qkv, and AutoPeftModel over a stock base. Small random BERTs written by
transformers' BertForSequenceClassification (the mechanics do not depend on size); references are transformers' BERT
with the same adapter, or our model before saving."""

import json
import re

import pytest
import torch
import transformers
from transformers import BertConfig, Trainer, TrainingArguments

import modeling_bert_impl as bi

peft = pytest.importorskip("peft")
from peft import AutoPeftModelForSequenceClassification, IA3Config, LoraConfig, PeftModel, get_peft_model  # noqa: E402

from modeling_bert_impl.peft_support import _our_module_path as our_module_path  # noqa: E402
from modeling_bert_impl.peft_support import _stock_module_paths as stock_module_paths  # noqa: E402

TOL = 1e-5
SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=64, num_labels=2)


@pytest.fixture(scope="module")
def stock_dir(tmp_path_factory):
    """A stock BertForSequenceClassification folder (random, seeded)."""
    folder = tmp_path_factory.mktemp("stock-bert")
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(BertConfig(**SMALL)).save_pretrained(folder)
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


def logits(model, inputs) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits


def ours(stock_dir):
    return bi.BertImplForSequenceClassification.from_pretrained(stock_dir)


def methods_with_a_bert_default() -> list[str]:
    """The PEFT methods (PeftType names) for which the installed peft has a default target_modules for "bert": those
    of its `TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING` tables that have a "bert" key."""
    names = [m[1] for name, table in vars(peft.utils.constants).items()
             if (m := re.fullmatch(r"TRANSFORMERS_MODELS_TO_(\w+)_TARGET_MODULES_MAPPING", name))
             and isinstance(table, dict) and "bert" in table]
    return sorted(names)


BERT_DEFAULT_METHODS = methods_with_a_bert_default()
# Settings that peft's defaults need regardless of the model (AdaLoRA's schedule length).
REQUIRED = {"ADALORA": dict(total_step=10)}


@pytest.fixture(scope="module")
def wide_stock_dir(tmp_path_factory):
    """A stock BertForSequenceClassification folder wide enough for every method's default sizes (C3A and VB-LoRA
    blocks of 256, MiSS rank 64, RoAd groups of 64)."""
    folder = tmp_path_factory.mktemp("wide-stock-bert")
    torch.manual_seed(0)
    config = BertConfig(**{**SMALL, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 1})
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return str(folder)


def test_every_method_with_a_bert_default_is_covered():
    assert {"LORA", "LOHA", "IA3", "ADALORA", "VERA", "BOFT"} <= set(BERT_DEFAULT_METHODS), BERT_DEFAULT_METHODS
    for method in BERT_DEFAULT_METHODS:
        assert peft.PeftType[method] in peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING, method


@pytest.mark.parametrize("method", BERT_DEFAULT_METHODS)
def test_default_target_modules_are_the_stock_ones_under_our_names(wide_stock_dir, method):
    """peft's defaults for "bert" on transformers' BERT and ours for "bert_impl" on ours target the same modules (query
    and value -> our fused qkv, attention.output.dense -> attn.out, output.dense -> ffn.down); IA3's feedforward
    modules too. The adapted model runs."""
    config_class = peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING[peft.PeftType[method]]
    make = lambda: config_class(task_type="SEQ_CLS", **REQUIRED.get(method, {}))
    assert make().target_modules is None  # the default is peft's table's
    stock = get_peft_model(transformers.BertForSequenceClassification.from_pretrained(wide_stock_dir), make())
    model = get_peft_model(ours(wide_stock_dir), make())
    stock_targets = stock.base_model.targeted_module_names
    assert stock_targets, "peft's stock default targets nothing"
    assert set(model.base_model.targeted_module_names) == {our_module_path(n)[0] for n in stock_targets}
    if method == "IA3":
        feedforward = lambda m: {n for n, mod in m.named_modules() if getattr(mod, "is_feedforward", False)}
        assert feedforward(model) == {our_module_path(n)[0] for n in feedforward(stock)}
        assert {n.split(".")[-1] for n in feedforward(model)} == {"out", "down"}
    inputs = batch()
    extra = {}
    if method == "POLY":  # routes per example: needs (B, T, H) inputs, so the padded path (peft_support)
        assert model.config.unpad_inputs is False
        extra = {"task_ids": torch.zeros(len(inputs["labels"]), dtype=torch.long)}
    model.eval()
    with torch.no_grad():
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **extra).logits
    assert out.shape == (len(inputs["labels"]), 2) and torch.isfinite(out).all()


def test_defaults_on_stock_folders_loaded_through_the_patch(stock_dir):
    bi.apply_bert_impl()
    try:
        patched = get_peft_model(transformers.AutoModelForSequenceClassification.from_pretrained(stock_dir),
                                 LoraConfig(task_type="SEQ_CLS"))
        stock = get_peft_model(transformers.BertForSequenceClassification.from_pretrained(stock_dir),
                               LoraConfig(task_type="SEQ_CLS"))
    finally:
        bi.revert_bert_impl()
    assert {n.split(".")[-1] for n in patched.base_model.targeted_module_names} == {"qkv"}
    assert {n.split(".")[-1] for n in stock.base_model.targeted_module_names} == {"query", "value"}
    assert peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["bert"] == ["query", "value"]


def test_trainer_lora_save_reload_merge(stock_dir, tmp_path):
    from datasets import Dataset

    model = get_peft_model(ours(stock_dir), LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8))
    train = batch(seed=2, size=16)
    args = TrainingArguments(tmp_path / "run", max_steps=4, per_device_train_batch_size=8, learning_rate=5e-3,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    Trainer(model=model, args=args, train_dataset=Dataset.from_dict({k: v.tolist() for k, v in train.items()})).train()
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in changed) and any("classifier" in n for n in changed)

    inputs = batch(seed=3)
    trained = logits(model, inputs)
    assert (trained - logits(ours(stock_dir), inputs)).abs().max() > 1e-3, "training must change the outputs"
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(ours(stock_dir), tmp_path / "adapter")
    assert (logits(reloaded, inputs) - trained).abs().max() < TOL
    merged = reloaded.merge_and_unload()
    assert isinstance(merged, bi.BertImplForSequenceClassification)
    assert (logits(merged, inputs) - trained).abs().max() < TOL

    # The adapter's base is the stock folder: AutoPeftModel builds it through AutoModelForSequenceClassification,
    # which gives our class (and the fused qkv the adapter targets) once apply_bert_impl() is in effect.
    bi.apply_bert_impl()
    try:
        auto = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "adapter")
    finally:
        bi.revert_bert_impl()
    assert isinstance(auto.get_base_model(), bi.BertImplForSequenceClassification)
    assert (logits(auto, inputs) - trained).abs().max() < TOL


@pytest.mark.parametrize("config, targets", [
    (dict(target_modules=["query", "value"], r=4, lora_alpha=8), {"qkv"}),
    (dict(target_modules=["query", "key", "value", "intermediate.dense"], r=4, lora_alpha=16, use_rslora=True,
          rank_pattern={"value": 2}, alpha_pattern={"query": 3}), {"qkv", "up"}),
    # A regular expression (peft matches it against whole module paths), as many Hub adapters have
    (dict(target_modules=r".*\.(query|value)", r=4, lora_alpha=8), {"qkv"}),
], ids=["query-value", "qkv-ffn-rslora-patterns", "regex"])
def test_stock_adapter_converted_onto_our_qkv_gives_the_same_logits(stock_dir, tmp_path, config, targets):
    torch.manual_seed(0)
    # init_lora_weights=False: B is random too, so the adapter changes the outputs.
    stock = get_peft_model(transformers.BertForSequenceClassification.from_pretrained(stock_dir),
                           LoraConfig(task_type="SEQ_CLS", init_lora_weights=False, **config))
    stock.save_pretrained(tmp_path / "stock-adapter")
    inputs = batch()
    expected = logits(stock, inputs)
    with stock.disable_adapter():
        assert (expected - logits(stock, inputs)).abs().max() > 1e-3, "the adapter must change the outputs"

    bi.convert_stock_adapter(tmp_path / "stock-adapter", tmp_path / "converted")
    converted = PeftModel.from_pretrained(ours(stock_dir), tmp_path / "converted")
    got = logits(converted, inputs)
    print(f"stock LoRA vs converted on ours: max |diff| {(got - expected).abs().max():.1e}")
    assert (got - expected).abs().max() < TOL
    assert {n.split(".")[-1] for n in converted.base_model.targeted_module_names} == targets
    assert (logits(converted.merge_and_unload(), inputs) - expected).abs().max() < TOL

    # Loading converts by itself (PeftModel.from_pretrained on our model), and so does AutoPeftModel once patched (it
    # then builds our class for the stock base folder).
    loaded = PeftModel.from_pretrained(ours(stock_dir), tmp_path / "stock-adapter")
    assert (logits(loaded, inputs) - expected).abs().max() < TOL
    bi.apply_bert_impl()
    try:
        auto = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "stock-adapter")
    finally:
        bi.revert_bert_impl()
    assert isinstance(auto.get_base_model(), bi.BertImplForSequenceClassification)
    assert (logits(auto, inputs) - expected).abs().max() < TOL


def test_conversion_refuses_what_is_not_one_adapter_on_qkv(stock_dir, tmp_path):
    """peft's IA3 default on stock BERT scales key and value, not query: no IA3 on our fused qkv does that."""
    get_peft_model(transformers.BertForSequenceClassification.from_pretrained(stock_dir),
                   IA3Config(task_type="SEQ_CLS")).save_pretrained(tmp_path / "ia3")
    with pytest.raises(ValueError, match=r"ia3: its IA3 modules on key, value of bert.layers.0 are not one IA3 adapter "
                                         r"on bert-impl's fused qkv"):
        bi.convert_stock_adapter(tmp_path / "ia3", tmp_path / "out")


def test_regex_targets_on_load(stock_dir, tmp_path):
    """target_modules as a regular expression: an adapter trained on our model over one of our folders stays in our
    names and loads as it is (not taken for a stock one), onto transformers' BERT too; a stock one whose weights cannot
    be read without loading them (adapter_model.bin) is refused, naming it."""
    ours(stock_dir).save_pretrained(tmp_path / "bert-impl-base")
    torch.manual_seed(0)
    config = LoraConfig(task_type="SEQ_CLS", target_modules=r".*\.attn\.qkv", r=4, init_lora_weights=False)
    mine = get_peft_model(bi.BertImplForSequenceClassification.from_pretrained(tmp_path / "bert-impl-base"), config)
    mine.save_pretrained(tmp_path / "ours")
    inputs = batch()
    expected = logits(mine, inputs)
    get_peft_model(transformers.BertForSequenceClassification.from_pretrained(stock_dir),
                   LoraConfig(task_type="SEQ_CLS", target_modules=r".*\.(query|value)")).save_pretrained(
        tmp_path / "stock-bin", safe_serialization=False)
    reloaded = PeftModel.from_pretrained(ours(stock_dir), tmp_path / "ours")
    with pytest.raises(ValueError, match=r"stock-bin: its target_modules is the regular expression .* no "
                                         r"adapter_model\.safetensors"):
        PeftModel.from_pretrained(ours(stock_dir), tmp_path / "stock-bin")
    assert reloaded.peft_config["default"].target_modules == r".*\.attn\.qkv"  # not rewritten by a conversion
    assert (logits(reloaded, inputs) - expected).abs().max() < TOL

    # Onto transformers' BERT (the same weights) it is converted as it loads, as convert_adapter_to_stock does.
    stock = PeftModel.from_pretrained(transformers.BertForSequenceClassification.from_pretrained(stock_dir),
                                      tmp_path / "ours")
    assert (logits(stock, inputs) - expected).abs().max() < TOL
    bi.convert_adapter_to_stock(tmp_path / "ours", tmp_path / "as-stock")
    as_stock = json.loads((tmp_path / "as-stock" / "adapter_config.json").read_text())
    assert as_stock["target_modules"] == [f"bert.encoder.layer.{i}.attention.self.{name}"
                                          for i in range(2) for name in ("key", "query", "value")]


# ---------------------------------------------------------------------------------------------------------------------
# The other direction: adapters trained on bert-impl over a stock checkpoint (real MiniLM) load where that checkpoint
# loads, transformers' BERT.


@pytest.fixture(scope="module")
def minilm_classifier_dir(minilm_dir, tmp_path_factory):
    """MiniLM with a seeded classification head, saved by transformers: a stock folder whose every weight is fixed.
    The head's weights are larger than BERT's initialisation (std 0.1, not 0.02), for logits of order 1."""
    folder = tmp_path_factory.mktemp("minilm-classifier")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(minilm_dir, num_labels=2)
    torch.nn.init.normal_(model.classifier.weight, std=0.1)
    model.save_pretrained(folder)
    return str(folder)


def method_config(method: str):
    """peft's defaults for the method (target_modules from its "bert" table), sized for MiniLM (H = 384) where a
    default block does not divide it."""
    sized = {"C3A": dict(block_size=128), "VBLORA": dict(vector_length=128)}
    config_class = peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING[peft.PeftType[method]]
    return config_class(task_type="SEQ_CLS", **REQUIRED.get(method, {}), **sized.get(method, {}))


def perturbed(model):
    """The adapter's trainable tensors moved off their (often identity) initial values, as training would."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "classifier" not in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("method", BERT_DEFAULT_METHODS)
def test_adapter_trained_on_ours_loads_on_stock_bert(minilm_classifier_dir, tmp_path, method, caplog):
    """Saved from our model over a stock folder, the adapter is a stock one (query/key/value, attention.output.dense,
    ...): AutoPeftModel, PeftModel.from_pretrained on transformers' BERT and its merge_and_unload give our model's
    logits within 1e-5, and it loads back onto ours. A method whose adapter on qkv is not three adapters on
    query/key/value is refused, saying which and why, and stays loadable on ours."""
    from modeling_bert_impl.peft_support import QKV_SPLIT

    torch.manual_seed(0)  # peft's initialisation
    base = bi.BertImplForSequenceClassification.from_pretrained(minilm_classifier_dir)
    inputs = batch(T=16)
    extra = {"task_ids": torch.zeros(len(inputs["labels"]), dtype=torch.long)} if method == "POLY" else {}
    run = lambda m: logits_with(m, inputs, extra)  # noqa: E731
    model = perturbed(get_peft_model(base, method_config(method)))
    expected = run(model)
    with model.disable_adapter():
        without = run(model)
    effect = (expected - without).abs().max().item()
    assert effect > 10 * TOL, "the adapter must change the outputs"
    with caplog.at_level("WARNING"):
        model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == minilm_classifier_dir

    back = PeftModel.from_pretrained(bi.BertImplForSequenceClassification.from_pretrained(minilm_classifier_dir),
                                     tmp_path / "adapter")
    diffs = {"adapter's effect": effect, "back on ours": (run(back) - expected).abs().max().item()}
    refusal = f"A {method} adapter on bert-impl's fused qkv cannot be converted exactly"
    if method not in QKV_SPLIT:
        assert refusal in caplog.text and "stays in bert-impl's module names" in caplog.text
        with pytest.raises(ValueError, match=refusal):
            AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "adapter")
        why = caplog.text.split("query, key and value (or back): ")[1].split(". The adapter")[0]
        print(f"{method}: adapter's effect {effect:.1e}, back on ours {diffs['back on ours']:.1e}, refused: {why}")
        assert diffs["back on ours"] < TOL
        return

    assert not any(our in target for target in saved["target_modules"] for our in ("qkv", "attn.", "ffn.", "layers."))
    assert {target.split(".")[-1] for target in saved["target_modules"]} >= {"query", "key", "value"}
    auto = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "adapter")
    assert type(auto.get_base_model()) is transformers.BertForSequenceClassification
    stock = PeftModel.from_pretrained(transformers.BertForSequenceClassification.from_pretrained(minilm_classifier_dir),
                                      tmp_path / "adapter")
    diffs.update({"AutoPeftModel": (run(auto) - expected).abs().max().item(),
                  "PeftModel on BertFor...": (run(stock) - expected).abs().max().item()})
    diffs["merged"] = (run(stock.merge_and_unload()) - expected).abs().max().item()
    back.load_adapter(tmp_path / "adapter", "again")  # as Trainer's resume and best-model steps load it
    back.set_adapter("again")
    diffs["load_adapter on ours"] = (run(back) - expected).abs().max().item()
    print(f"{method}: " + ", ".join(f"{way} {diff:.1e}" for way, diff in diffs.items()))
    assert max(diff for way, diff in diffs.items() if way != "adapter's effect") < TOL, diffs
    assert diffs["back on ours"] == diffs["load_adapter on ours"] == 0  # the split, concatenated: the same tensors


def logits_with(model, inputs, extra) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **extra).logits


@pytest.mark.parametrize("config", [
    LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, use_dora=True, init_lora_weights=False),
    LoraConfig(task_type="SEQ_CLS", target_modules=["qkv", "up"], r=4, lora_alpha=16, use_rslora=True,
               rank_pattern={"up": 2}, alpha_pattern={"qkv": 3}, lora_bias=True, init_lora_weights=False),
    LoraConfig(task_type="SEQ_CLS", target_modules=r".*\.layers\.1\.attn\.qkv", r=2, init_lora_weights=False),
    IA3Config(task_type="SEQ_CLS", target_modules=["qkv", "down"], feedforward_modules=["qkv", "down"],
              init_ia3_weights=False),
], ids=["dora", "rslora-patterns-bias", "regex-one-layer", "ia3-feedforward-qkv"])
def test_variants_saved_in_stock_names_load_on_stock_bert(stock_dir, tmp_path, config):
    """DoRA's magnitudes and LoRA's bias follow the output features; rank/alpha patterns, rsLoRA, a regular expression
    and IA3's feedforward modules (whose scale is on the input side) keep their meaning under stock names."""
    torch.manual_seed(0)
    model = perturbed(get_peft_model(ours(stock_dir), config))
    inputs = batch()
    expected = logits(model, inputs)
    with model.disable_adapter():
        assert (expected - logits(model, inputs)).abs().max() > 10 * TOL, "the adapter must change the outputs"
    model.save_pretrained(tmp_path / "adapter")
    stock = PeftModel.from_pretrained(transformers.BertForSequenceClassification.from_pretrained(stock_dir),
                                      tmp_path / "adapter")
    print(f"stock BERT with the saved adapter vs ours: max |diff| {(logits(stock, inputs) - expected).abs().max():.1e}")
    assert (logits(stock, inputs) - expected).abs().max() < TOL
    back = PeftModel.from_pretrained(ours(stock_dir), tmp_path / "adapter")
    assert (logits(back, inputs) - expected).abs().max() == 0
    assert set(stock.base_model.targeted_module_names) == {
        stock_path for name in model.base_model.targeted_module_names for stock_path in stock_module_paths(name)}


def test_adalora_ranks_allocated_in_training_keep_under_stock_names(stock_dir, tmp_path):
    """AdaLoRA prunes each module's rank as it trains and records what it keeps in `rank_pattern` (by module path);
    query, key and value keep qkv's."""
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
    model.save_pretrained(tmp_path / "adapter")
    kept = {key: sum(mask) for key, mask in model.peft_config["default"].rank_pattern.items()}
    assert sorted(set(kept.values())) != [6], "training must have pruned ranks"
    stock = PeftModel.from_pretrained(transformers.BertForSequenceClassification.from_pretrained(stock_dir),
                                      tmp_path / "adapter")
    stock_kept = {key: sum(mask) for key, mask in stock.peft_config["default"].rank_pattern.items()}
    assert stock_kept == {f"{path}.lora_E": rank
                          for key, rank in kept.items() for path in stock_module_paths(key.removesuffix(".lora_E"))}
    assert (logits(stock, inputs) - expected).abs().max() < TOL
    with model.disable_adapter():
        assert (expected - logits(model, inputs)).abs().max() > 10 * TOL, "the adapter must change the outputs"


def test_adapter_without_task_type_names_transformers_class(stock_dir, tmp_path):
    """Without a task type, AutoPeftModel builds the class the adapter config names: transformers' BertModel once the
    adapter is in stock names (a class of ours would need bert-impl and peft's import_allowlist)."""
    torch.manual_seed(0)
    model = perturbed(get_peft_model(bi.BertImplModel.from_pretrained(stock_dir), LoraConfig(r=4)))
    inputs = batch()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["auto_mapping"] == {"base_model_class": "BertModel", "parent_library": "transformers"}
    auto = peft.AutoPeftModel.from_pretrained(tmp_path / "adapter").eval()
    assert type(auto.get_base_model()) is transformers.BertModel
    with torch.no_grad():
        got = auto(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    mask = inputs["attention_mask"].bool()  # padding positions are not compared (they differ by design)
    assert (got[mask] - expected[mask]).abs().max() < TOL


def test_saved_adapter_loads_without_bert_impl(stock_dir, tmp_path, run_without_package):
    """What a user with only transformers and peft gets from the saved folder: AutoPeftModel on transformers' BERT,
    our model's logits."""
    torch.manual_seed(0)
    model = perturbed(get_peft_model(ours(stock_dir), LoraConfig(task_type="SEQ_CLS", target_modules=["qkv", "down"])))
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
