"""Device tests: every attention implementation, layout and precision on one device, against a float64 reference.

The device comes from the environment variable BERT_IMPL_TEST_DEVICE: `cpu` or `cuda`; unset, `cuda` when one is
available, otherwise `cpu`. The README's test command and CI run it on the CPU, so the logic is proven every day; on a
GPU the same file runs unchanged (`python benchmarks/gpu_check.py` runs it there). What the model picks by capability
differs per device, and this module runs whatever it picks: on CUDA the unpadded path attends with flash-attention's
varlen kernel (fp16/bf16, when `flash_attn` is installed), else torch's own flash kernel (fp16/bf16 on the GPUs it
takes), else SDPA on the re-padded sequences; on CPU with the bucketed layout (tests/test_torch_flash.py runs torch's
flash path on the CPU through a stand-in for the op).

The reference is transformers' own `BertModel` in float64 on the CPU, on the MiniLM checkpoint (6 layers, H=384), on
one right-padded batch of mixed lengths; a packed batch holds the same sequences, so the same reference serves every
layout. Outputs are compared on real tokens only.

On CPU: `flex_attention` is skipped (transformers compiles it with inductor, a C++ build per mask, shape and dtype:
25-45 s each on 2 cores; test_modeling.py checks it on CPU against float64); `torch.compile` uses the `aot_eager`
backend (the same full-graph capture and autograd graph, without inductor's C++ build). On CUDA both run for real (every
dtype; inductor)."""

import contextlib
import csv
import importlib.util
import math
import os

import pytest
import torch
import transformers

import modeling_bert_impl as bi
from helpers import needs_tracing

_REQUESTED = os.environ.get("BERT_IMPL_TEST_DEVICE", "")
if _REQUESTED not in ("", "cpu", "cuda"):
    raise ValueError(f"BERT_IMPL_TEST_DEVICE={_REQUESTED!r}; expected 'cpu', 'cuda' or unset")
if _REQUESTED == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("BERT_IMPL_TEST_DEVICE=cuda but torch.cuda.is_available() is False (no GPU, or a CPU build "
                       f"of torch: {torch.__version__})")
DEVICE = _REQUESTED or ("cuda" if torch.cuda.is_available() else "cpu")  # unset: CUDA where there is one
CUDA = DEVICE == "cuda"

# Max |diff| on real tokens of the last hidden state (and the pooler output) against the float64 reference, per
# dtype. MiniLM's last hidden states on this batch reach |h| = 6.3 (printed by the forward test).
# - fp32 (24-bit significand, unit roundoff 6e-8): measured 2.0-2.5e-6 on CPU (transformers: 2.0e-6); 1e-4 leaves
#   room for other kernels' summation orders on CUDA (no TF32: torch's default for matmul is full fp32).
# - bf16 (8-bit significand, unit roundoff 2^-9 = 2e-3): one rounding of |h| ~ 6 is up to 0.012; six layers of
#   matmuls and LayerNorms in bf16 compound it: measured 0.038-0.045 for every implementation and layout, and
#   transformers' own BertModel in bf16 is as far off (0.045, printed by the test). 0.15 is about 3x that.
# - fp16 (11-bit significand, unit roundoff 2^-12 = 2.4e-4, 8x finer than bf16): measured 0.0051-0.0068
#   (transformers: 0.0051); 0.025.
FORWARD_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.15, torch.float16: 0.025}
# Gradients of one training step (autocast for bf16/fp16, fp32 weights and gradients as Trainer keeps them): the
# largest |diff| over a parameter's gradient relative to that gradient's largest entry, worst parameter. fp32 is
# bounded by the same roundoff as the forward; under autocast every matmul's inputs are rounded to 8 (bf16) or 11
# (fp16) bits, so the relative error of a gradient is a few times the unit roundoff times the depth. Measured on CPU:
# fp32 2.3e-6, bf16 2.4-3.2e-2, fp16 2.7-3.0e-3 (the worst parameter is a LayerNorm weight; fp16 measured once, then
# left to CUDA: see the skip).
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.02}


def _dtypes() -> list:
    """fp32 everywhere; bf16 where the device has it; fp16 on CUDA and CPU (torch runs fp16 on CPU, slowly)."""
    supported = [torch.float32, torch.float16]
    if not CUDA or torch.cuda.is_bf16_supported():
        supported.insert(1, torch.bfloat16)
    return supported


DTYPES = _dtypes()
IMPLEMENTATIONS = ["eager", "sdpa", "flex_attention"]
if CUDA and importlib.util.find_spec("flash_attn") is not None:
    IMPLEMENTATIONS.append("flash_attention_2")
# padded: the padded path (config.unpad_inputs=False) with a mask from the implementation's mask interface;
# unpadded: the same batch on the padding-free path (the default); packed_*: the same sequences concatenated in one
# row (B = 1) as DataCollatorWithFlattening makes them, marked by restarting position_ids or by cu_seq_lens, on the
# padding-free path; packed_block_mask: a packed row on the padded path (block-diagonal mask). The eager
# implementation always runs the padded path (attention maps exist only there), so its unpadded/packed cases test that
# the model falls back to it correctly.
LAYOUTS = ["padded", "unpadded", "packed_position_ids", "packed_cu_seq_lens", "packed_block_mask"]
LENGTHS = [5, 17, 32, 9, 2, 24]  # the shortest sequence a tokenizer makes ([CLS] [SEP]) included: position_ids
# mark a packed sequence of at least two tokens (bert_padding.sequence_starts)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


# ---------------------------------------------------------------------------------------------------------------------
# Batches and the reference
# ---------------------------------------------------------------------------------------------------------------------
def padded_batch(lengths: list[int], seed: int = 0, vocab: int = 30522) -> dict:
    """Right-padded (B, T) batch of random word pieces: [CLS] ... with segment B on the second half of each row."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    lens = torch.tensor(lengths)[:, None]
    pos = torch.arange(T)
    mask = (pos < lens).long()
    ids = torch.randint(1000, vocab, mask.shape, generator=g)
    ids[:, 0] = 101  # [CLS]
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": ((pos >= lens // 2) & (pos < lens)).long()}


def packed(batch: dict, marker: str) -> dict:
    """The padded batch's sequences in one (1, nnz) row, as DataCollatorWithFlattening makes it: `position_ids`
    restarting at 0 (which mark the sequences), and with marker "cu_seq_lens" also `cu_seq_lens_*` (which then do)."""
    real = batch["attention_mask"].bool()
    lengths = real.sum(-1)
    out = {k: batch[k][real][None] for k in ("input_ids", "token_type_ids")}
    out["position_ids"] = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    if marker == "cu_seq_lens":
        cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(lengths.max()), max_length_k=int(lengths.max()))
    return out


def layout_inputs(batch: dict, layout: str) -> dict:
    if layout in ("padded", "unpadded"):
        return batch
    return packed(batch, "cu_seq_lens" if layout == "packed_cu_seq_lens" else "position_ids")


def real_rows(t: torch.Tensor, batch: dict, layout: str) -> torch.Tensor:
    """(B, T, ...) padded or (1, nnz, ...) packed -> (nnz, ...) the real tokens, in row-major order either way."""
    return t[batch["attention_mask"].bool()] if layout in ("padded", "unpadded") else t[0]


def on(inputs: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@pytest.fixture(scope="module")
def batch():
    return padded_batch(LENGTHS)


@pytest.fixture(scope="module")
def reference(minilm_dir, batch):
    """transformers' BertModel in float64 on the CPU (eager attention), dropout off: the last hidden state's real
    rows (nnz, H), the pooler output (B, H), and the gradients of `probe_loss` keyed by our parameter names."""
    model = transformers.BertModel.from_pretrained(minilm_dir, dtype=torch.float64, attn_implementation="eager",
                                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model.train()
    out = model(**batch)
    probe_loss(out.last_hidden_state, out.pooler_output, batch, "padded").backward()
    grads = stock_gradients(model)
    return {"hidden": real_rows(out.last_hidden_state, batch, "padded").detach(),
            "pooler": out.pooler_output.detach(), "grads": grads}


def stock_gradients(model: torch.nn.Module) -> dict:
    """The gradients of a stock BertModel by parameter name (our names are stock's)."""
    return {name: p.grad for name, p in model.named_parameters()}


def gradient_scale(grads: dict, name: str) -> torch.Tensor:
    """The largest |gradient| a parameter's error is measured against: its own, or for a self-attention projection the
    largest of query's, key's and value's of the same kind (the key bias's gradient is zero in exact arithmetic, as
    softmax ignores a shift that is the same for every key: only rounding is left of it)."""
    projections = ("query", "key", "value")
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in projections and ".attention.self." in name:
        siblings = [".".join([*parts[:-2], projection, parts[-1]]) for projection in projections]
        return max(grads[sibling].abs().max() for sibling in siblings)
    return grads[name].abs().max()


def probe_loss(hidden: torch.Tensor, pooled: torch.Tensor, batch: dict, layout: str) -> torch.Tensor:
    """A scalar that every output row feeds, with fixed random weights: sum over real tokens of h . w, plus pooled . u.
    (A plain sum would have a zero gradient through the last LayerNorm, whose outputs sum to its bias.)"""
    H = hidden.shape[-1]
    g = torch.Generator().manual_seed(1)
    w, u = (torch.randn(H, generator=g, dtype=torch.float64).to(hidden.device) for _ in range(2))
    rows = real_rows(hidden, batch, layout).double()
    return rows @ w @ torch.ones(rows.shape[0], dtype=torch.float64, device=hidden.device) + (pooled.double() @ u).sum()


@pytest.fixture(scope="module")
def stock_error(minilm_dir, batch, reference):
    """transformers' BertModel (sdpa) in each dtype on the device: its own max |diff| from the float64 reference,
    the yardstick the forward tolerances were set against (recorded, not asserted)."""
    errors = {}
    for dtype in DTYPES:
        model = transformers.BertModel.from_pretrained(minilm_dir, dtype=dtype, attn_implementation="sdpa").to(DEVICE)
        with torch.no_grad():
            out = model(**on(batch, DEVICE))
        errors[dtype] = (real_rows(out.last_hidden_state, batch, "padded").cpu().double() - reference["hidden"]).abs().max().item()
    return errors


_models: dict = {}


def ours(minilm_dir: str, dtype: torch.dtype) -> bi.BertImplModel:
    """Our BertModel in `dtype` on the device, loaded once per dtype (each test sets its implementation and layout)."""
    if dtype not in _models:
        _models[dtype] = bi.BertImplModel.from_pretrained(minilm_dir, dtype=dtype).to(DEVICE).eval()
    return _models[dtype]


def trainable(minilm_dir: str) -> bi.BertImplModel:
    """Our BertModel in fp32 on the device in train mode with dropout off, loaded once (no test updates weights)."""
    if "train" not in _models:
        _models["train"] = bi.BertImplModel.from_pretrained(
            minilm_dir, dtype=torch.float32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).to(DEVICE)
    return _models["train"].train()


def configure(model, implementation: str, layout: str):
    model.set_attn_implementation(implementation)
    model.config.unpad_inputs = layout not in ("padded", "packed_block_mask")
    return model


# ---------------------------------------------------------------------------------------------------------------------
# Forward: implementation x layout x dtype
# ---------------------------------------------------------------------------------------------------------------------
def skip_reason(implementation: str, dtype: torch.dtype) -> str | None:
    if implementation == "flash_attention_2" and dtype == torch.float32:
        return "flash-attention has no fp32 kernel"
    if implementation == "flex_attention" and not bi.input_checks.TRACING_SUPPORTED:
        return f"flex_attention needs torch >= 2.13 (installed: {torch.__version__}); its refusal: test_torch_versions.py"
    if implementation == "flex_attention" and not CUDA:
        return ("flex_attention on CPU compiles an inductor C++ kernel per mask, shape and dtype (25-45 s each on 2 "
                "cores): tests/test_modeling.py::test_flex_attention_matches_sdpa_and_eager_on_the_padded_path checks "
                "it on CPU against float64, eager and sdpa; here on CUDA")
    return None


@pytest.mark.parametrize("dtype", DTYPES, ids=name)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_matches_float64_reference(minilm_dir, batch, reference, stock_error, implementation, layout, dtype,
                                           record_property):
    if reason := skip_reason(implementation, dtype):
        pytest.skip(reason)
    model = configure(ours(minilm_dir, dtype), implementation, layout)
    inputs = on(layout_inputs(batch, layout), DEVICE)
    if implementation == "flash_attention_2" and layout == "packed_block_mask":
        with pytest.raises(ValueError, match="unpad_inputs=True"):  # documented: flash takes packing unpadded only
            model(**inputs)
        return
    with torch.no_grad():
        out = model(**inputs)
    hidden = real_rows(out.last_hidden_state, batch, layout).cpu().double()
    assert hidden.shape == reference["hidden"].shape
    assert out.last_hidden_state.dtype == dtype
    diff = (hidden - reference["hidden"]).abs().max().item()
    pooler_diff = (out.pooler_output.cpu().double() - reference["pooler"]).abs().max().item()
    record_property("max_abs_diff", diff)
    record_property("stock_max_abs_diff", stock_error[dtype])
    print(f"{implementation} {layout} {name(dtype)}: max |diff| {diff:.2e} (pooler {pooler_diff:.2e}); transformers "
          f"in {name(dtype)}: {stock_error[dtype]:.2e}; largest |h| {reference['hidden'].abs().max():.1f}")
    assert diff < FORWARD_TOL[dtype], (diff, stock_error[dtype])
    assert pooler_diff < FORWARD_TOL[dtype]
    if layout in ("padded", "unpadded") and config_unpads(model, implementation, layout):
        padding = ~batch["attention_mask"].bool()
        assert out.last_hidden_state[padding.to(DEVICE)].abs().max() == 0  # documented: zeros at padding


def config_unpads(model, implementation: str, layout: str) -> bool:
    return model.config.unpad_inputs is not False and implementation != "eager"


# ---------------------------------------------------------------------------------------------------------------------
# Forward + backward: gradients of one training step
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
@pytest.mark.parametrize("layout", ["padded", "unpadded", "packed_position_ids"])
def test_gradients_match_float64_reference(minilm_dir, batch, reference, layout, dtype, record_property):
    """One training step (train mode, dropout off) in fp32 or under autocast, as Trainer's bf16/fp16 runs it."""
    if dtype == torch.float16 and not CUDA:
        pytest.skip("fp16 autocast's backward on CPU runs 3x slower than bf16's here (no fp16 training on CPU in "
                    "practice); the forward tests cover fp16 on CPU, CUDA runs this")
    model = configure(trainable(minilm_dir), "sdpa", layout)
    model.zero_grad(set_to_none=True)
    inputs = on(layout_inputs(batch, layout), DEVICE)
    with torch.autocast(DEVICE, dtype=dtype, enabled=dtype != torch.float32):
        out = model(**inputs)
    probe_loss(out.last_hidden_state, out.pooler_output, batch, layout).backward()
    worst, where = 0.0, None
    for param_name, p in model.named_parameters():
        expected = reference["grads"][param_name]
        relative = ((p.grad.cpu().double() - expected).abs().max() / gradient_scale(reference["grads"], param_name)).item()
        if relative > worst:
            worst, where = relative, param_name
    record_property("max_relative_grad_diff", worst)
    print(f"{layout} {name(dtype)}: worst relative gradient diff {worst:.2e} ({where})")
    assert worst < GRAD_TOL[dtype], (worst, where)


# ---------------------------------------------------------------------------------------------------------------------
# Code that looks inside the encoder, on the device: stock's tensors on a padded batch; padding-free without it
# ---------------------------------------------------------------------------------------------------------------------
def test_hooks_on_the_device_see_stock_tensors(minilm_dir, batch):
    """fp32, SDPA, default config, the padded batch on the device: a forward hook that shifts [CLS] after layer 1 and
    one that records layer 3's output give transformers' BertModel's recorded (B, T, H) tensor and last hidden state
    (real tokens); without hooks the same batch runs the padding-free layout."""
    from helpers import layouts_built

    inputs, results = on(batch, DEVICE), {}
    for name in ("stock", "ours"):
        cls = transformers.BertModel if name == "stock" else bi.BertImplModel
        model = cls.from_pretrained(minilm_dir, attn_implementation="sdpa").to(DEVICE).eval()
        if name == "ours":
            with torch.no_grad(), layouts_built(model) as built:
                model(**inputs)
            assert built  # nothing looks inside: padding-free
        recorded = {}

        def shift_cls(module, args, out):
            out = out.clone()
            out[:, 0] += 3.0
            return out

        model.encoder.layer[1].register_forward_hook(shift_cls)
        model.encoder.layer[3].register_forward_hook(lambda module, args, out: recorded.setdefault("layer 3", out))
        with torch.no_grad():
            results[name] = real_rows(model(**inputs).last_hidden_state, batch, "padded"), recorded["layer 3"]
    (stock_last, stock_layer), (our_last, our_layer) = results["stock"], results["ours"]
    assert our_layer.shape == stock_layer.shape == (*batch["input_ids"].shape, 384)
    assert (our_layer - stock_layer).abs().max() < FORWARD_TOL[torch.float32]
    assert (our_last - stock_last).abs().max() < FORWARD_TOL[torch.float32]


# ---------------------------------------------------------------------------------------------------------------------
# Trainer: a few mixed-precision steps on the device, a checkpoint, and a resume from it
# ---------------------------------------------------------------------------------------------------------------------
def sentiment_examples(tokenizer, count: int) -> list[dict]:
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "data", "sentiment_train.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[:count]
    return [{**tokenizer(r["sentence"], truncation=True, max_length=64), "labels": int(r["label"] == "positive")}
            for r in rows]


def train(output_dir: str, examples: list, tokenizer, resume: str | None = None):
    """Trainer on a freshly initialised tiny BERT (2 layers, H=128; seed 0), 8 steps of 8 examples, a checkpoint
    every 4 steps. Tiny, so that its checkpoints (weights and AdamW state) are quick to write."""
    precision = "bf16" if not CUDA or torch.cuda.is_bf16_supported() else "fp16"
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=8, per_device_train_batch_size=8, learning_rate=3e-3,
        lr_scheduler_type="constant", logging_steps=1, save_steps=4, report_to=[], seed=0, use_cpu=not CUDA,
        disable_tqdm=True, **{precision: True},
    )
    torch.manual_seed(0)
    config = bi.BertImplConfig.from_preset("tiny", vocab_size=len(tokenizer), num_labels=2)
    model = bi.BertImplForSequenceClassification(config)
    initial = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=examples,
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    trainer.before = trainer.evaluate(examples)["eval_loss"]
    trainer.train(resume_from_checkpoint=resume)
    trainer.after = trainer.evaluate(examples)["eval_loss"]
    return trainer, initial


def logged_losses(trainer, after_step: int = 0) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log and log["step"] > after_step]


def test_trainer_mixed_precision_loss_falls_and_resumes(minilm_dir, tmp_path, record_property):
    """8 steps (4 epochs of the same 16 sentences, MiniLM's tokenizer) with bf16 (fp16 where the GPU has no bf16):
    every loss finite, the loss on those sentences lower after training than before, and the last steps' logged loss
    below the first steps'; a checkpoint at step 4 resumed in a fresh Trainer ends where the uninterrupted run
    ended."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    examples = sentiment_examples(tokenizer, 16)
    full, initial = train(str(tmp_path / "full"), examples, tokenizer)
    assert full.model.device.type == DEVICE
    assert full.args.bf16 or full.args.fp16
    losses = logged_losses(full)
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses), losses
    record_property("losses", losses)
    assert full.after < full.before and sum(losses[6:]) < sum(losses[:2]), (full.before, full.after, losses)
    assert sorted(os.listdir(tmp_path / "full")) == ["checkpoint-4", "checkpoint-8"]

    resumed, _ = train(str(tmp_path / "resumed"), examples, tokenizer, resume=str(tmp_path / "full" / "checkpoint-4"))
    resumed_losses = logged_losses(resumed, after_step=4)
    assert resumed.state.global_step == 8 and len(resumed_losses) == 4
    moved = drift = 0.0
    for key, value in full.model.state_dict().items():
        value = value.float().cpu()
        moved = max(moved, (value - initial[key]).abs().max().item())
        drift = max(drift, (resumed.model.state_dict()[key].float().cpu() - value).abs().max().item())
    print(f"loss on the training sentences {full.before:.4f} -> {full.after:.4f}; logged {[round(x, 4) for x in losses]}; resumed {[round(x, 4) for x in resumed_losses]}; weights moved "
          f"up to {moved:.2e}, resumed vs uninterrupted {drift:.2e}")
    # A resume that lost the optimizer's state, the data order or the RNG would end about as far from the
    # uninterrupted run as the training moved the weights; a correct one within mixed precision's noise.
    assert drift < 0.05 * moved, (drift, moved)
    assert resumed_losses == pytest.approx(losses[4:], rel=0.02, abs=1e-3)


# ---------------------------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) on the device
# ---------------------------------------------------------------------------------------------------------------------
COMPILE_BACKEND = "inductor" if CUDA else "aot_eager"  # see the module docstring


@pytest.mark.parametrize("layout", ["padded", pytest.param("packed_position_ids", marks=pytest.mark.slow)])
@needs_tracing
def test_compiled_fullgraph_forward_and_backward_match_eager(minilm_dir, batch, layout):
    """fp32, a training step (the exact unpadded layout under compile): the compiled model's outputs and gradients
    against eager's."""
    model = configure(trainable(minilm_dir), "sdpa", layout)
    inputs = on(layout_inputs(batch, layout), DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=COMPILE_BACKEND)
    results = {}
    for label, run in (("compiled", compiled), ("eager", model)):
        model.zero_grad(set_to_none=True)
        out = run(**inputs)
        probe_loss(out.last_hidden_state, out.pooler_output, batch, layout).backward()
        hidden = real_rows(out.last_hidden_state, batch, layout).detach().cpu().double()
        results[label] = hidden, {n: p.grad.cpu().double() for n, p in model.named_parameters()}
    (hidden, grads), (expected, expected_grads) = results["compiled"], results["eager"]
    assert (hidden - expected).abs().max() < FORWARD_TOL[torch.float32]
    for param_name, grad in grads.items():
        scale = gradient_scale(expected_grads, param_name)
        assert (grad - expected_grads[param_name]).abs().max() <= GRAD_TOL[torch.float32] * scale, param_name


# ---------------------------------------------------------------------------------------------------------------------
# Peak memory of a mixed-length forward + backward against transformers' BERT
# ---------------------------------------------------------------------------------------------------------------------
def peak_memory_bytes(step) -> int:
    """Peak bytes of tensors allocated by step() above what was live before it. CUDA: the caching allocator's own
    statistics. CPU: torch's MemTracker, which follows every tensor storage that torch ops create and free (the
    process's RSS would count the allocator's cached and fragmented pages too, and the other tests' leftovers)."""
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    tracker = mem_tracker.MemTracker()
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return peak["Total"] - peak[mem_tracker._MemRefType.PARAM] - peak[mem_tracker._MemRefType.BUFFER]


def test_peak_memory_of_a_training_step_is_not_above_transformers(minilm_dir, record_property):
    """A mixed-length batch (lengths 8..128 on CUDA, 8..64 on CPU; about half real tokens), forward + backward, fp32
    on CPU, bf16 autocast on CUDA: ours against transformers' BertModel (sdpa) loaded from the same folder. Recorded; asserted only as
    "not higher"."""
    g = torch.Generator().manual_seed(2)
    longest = 128 if CUDA else 64
    lengths = (torch.randn(64 if CUDA else 16, generator=g) * 0.5).exp().mul(longest * 0.45).round().clamp(8, longest)
    lengths = lengths.long().tolist()
    mixed = padded_batch(lengths, seed=3)
    inputs = on(mixed, DEVICE)
    autocast = torch.autocast(DEVICE, dtype=torch.bfloat16) if CUDA else contextlib.nullcontext()
    peaks = {}
    for label, cls in (("transformers", transformers.BertModel), ("bert-impl", bi.BertImplModel)):
        model = cls.from_pretrained(minilm_dir, dtype=torch.float32, attn_implementation="sdpa").to(DEVICE).train()

        def step():
            with autocast:
                out = model(**inputs)
            probe_loss(out.last_hidden_state, out.pooler_output, mixed, "padded").backward()
            model.zero_grad(set_to_none=True)

        step()  # warm-up: lazy initialisations out of the measurement
        peaks[label] = peak_memory_bytes(step)
        del model
    fill = sum(lengths) / (len(lengths) * max(lengths))
    ratio = peaks["bert-impl"] / peaks["transformers"]
    record_property("peak_memory_bytes", peaks)
    print(f"peak memory, forward + backward, {len(lengths)} sequences ({fill:.0%} real tokens), {DEVICE}: "
          f"transformers {peaks['transformers'] / 2**20:.1f} MiB, bert-impl {peaks['bert-impl'] / 2**20:.1f} MiB "
          f"({ratio:.2f}x)")
    assert peaks["bert-impl"] <= peaks["transformers"], peaks
