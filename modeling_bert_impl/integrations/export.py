"""Export a bert-impl model, or a stock folder of BERT or its descendants, to ONNX with dynamic batch and sequence
axes, checked against PyTorch in onnxruntime.

Usage:

    python -m modeling_bert_impl.integrations.export MODEL OUTPUT_DIR [--task TASK] [--overwrite]
    bert-impl-export MODEL OUTPUT_DIR ...                  (the same, as a console script)

MODEL is a folder or a Hub id, of BERT or of one of its descendants (RoBERTa, XLM-RoBERTa, CamemBERT); TASK one of
the tasks of tasks.py's table (default: the folder's architecture). OUTPUT_DIR gets model.onnx (weights inside, or
beside it in model.onnx.data above 1 GiB), config.json (the stock family's, by `stock_format.write_stock_config`),
the tokenizer files when MODEL has some (none are made up where it has none), and export.json (what was exported and
the measured max |diff| against PyTorch on a padded sample batch of another shape than the one exported). The graph
is torch.export's of the padded path (`torch.onnx.export(dynamo=True)`); inputs input_ids, attention_mask,
token_type_ids, each (batch, sequence), or (batch, choices, sequence) for multiple choice.
"""

import argparse
import importlib.util
import json
import os
import sys
import warnings

import torch

from ..input_checks import require_tracing_torch
from .tasks import HEADS, TASKS, auto_class_of, head_class

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EXPORTERS = ("onnx", "onnxscript", "onnxruntime")  # torch.onnx's exporter needs the first two; the check the third
SAMPLE_TEXTS = ["The quick brown fox jumps over the lazy dog.", "Short.", "BERT reads text in both directions at once."]
# The files a tokenizer of the family loads from: fast, slow WordPiece (BERT), byte-level BPE (RoBERTa), SentencePiece
# (XLM-RoBERTa, CamemBERT).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "sentencepiece.bpe.model")


def load_tokenizer(model_id: str):
    """MODEL's tokenizer, or None where it has no tokenizer file: transformers would build a placeholder then (an
    XLM-RoBERTa folder gets a Unigram vocabulary of 5 entries), which must not reach the exported folder."""
    from transformers import AutoTokenizer
    from transformers.utils import cached_file

    if not any(cached_file(model_id, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False) for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError):
        return None


def default_task(config) -> str:
    """The task of the folder's architecture (ours or stock BERT's name), feature-extraction without one."""
    for architecture in getattr(config, "architectures", None) or []:
        auto = auto_class_of(architecture)
        if auto is not None:
            return HEADS[auto][0]
    return "feature-extraction"


def sample_batch(tokenizer, config, texts: list[str], choices: int | None) -> dict:
    """A padded batch of `texts` (real token ids through the tokenizer, else random ids of the texts' lengths in
    words); (B, C, T) for multiple choice, each text paired with C endings."""
    if choices:
        texts = [t for t in texts for _ in range(choices)]
    if tokenizer is not None:
        second = [f"ending {i % (choices or 1)}" for i in range(len(texts))]
        batch = tokenizer(texts, second, padding=True, return_tensors="pt")
        zeros = torch.zeros_like(batch["input_ids"])  # token types, where the tokenizer gives none (RoBERTa's)
        batch = {k: batch[k] if k in batch else zeros for k in INPUTS}
    else:
        g = torch.Generator().manual_seed(0)
        lengths = torch.tensor([len(t.split()) + 2 for t in texts])
        T = int(lengths.max())
        mask = (torch.arange(T) < lengths[:, None]).long()
        ids = torch.randint(1, config.vocab_size, mask.shape, generator=g) * mask
        batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return {k: v.view(-1, choices, v.shape[-1]) for k, v in batch.items()} if choices else batch


def max_abs_diff(outputs: list, expected: list, mask: torch.Tensor) -> float:
    """max |diff| over all outputs; outputs over (B, T) positions compared on the real tokens only."""
    worst = 0.0
    for got, want in zip(outputs, expected):
        got = torch.from_numpy(got)
        if tuple(want.shape[:mask.dim()]) == tuple(mask.shape):
            got, want = got[mask.bool()], want[mask.bool()]
        worst = max(worst, (got - want).abs().max().item())
    return worst


def export(model_id: str, output_dir: str, task: str | None = None, overwrite: bool = False, atol: float = 1e-4,
           opset: int | None = None) -> float:
    """Write `output_dir`/model.onnx and its companions; returns the measured max |diff| (raises above `atol`)."""
    missing = [package for package in EXPORTERS if importlib.util.find_spec(package) is None]
    if missing:
        raise SystemExit(f"ONNX export needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
                         "installed: pip install 'bert-impl[export]' (or pip install onnx onnxscript onnxruntime)")
    import onnxruntime
    import transformers
    from transformers import AutoConfig

    from ..stock_format import stock_name, write_stock_config

    require_tracing_torch("ONNX export", "or serve the model in PyTorch (optimize_for_inference traces nothing)")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise SystemExit(f"{output_dir} exists and is not empty; choose another folder, or pass --overwrite to replace "
                         "the files there")
    transformers.logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(model_id)
    task = task or default_task(config)
    model = head_class(task, config.model_type).from_pretrained(model_id).eval()
    tokenizer = load_tokenizer(model_id)
    choices = 2 if task == "multiple-choice" else None

    example = sample_batch(tokenizer, model.config, SAMPLE_TEXTS[:2], choices)
    with torch.no_grad():
        output_names = list(model(**example).keys())
    batch = torch.export.Dim("batch")
    sequence = torch.export.Dim("sequence", max=model.config.max_position_embeddings)
    axes = {0: batch, 2: sequence} if choices else {0: batch, 1: sequence}
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "model.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (), path, kwargs=example, input_names=list(INPUTS), output_names=output_names,
            dynamic_shapes={name: axes for name in INPUTS}, dynamo=True, opset_version=opset, verbose=False,
            external_data=sum(p.numel() * p.element_size() for p in model.parameters()) > 2**30,  # one file below 1 GiB
        )
    del program

    # Check: onnxruntime against PyTorch on a batch of another size and length than the exported example.
    check = sample_batch(tokenizer, model.config, SAMPLE_TEXTS, choices)
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    outputs = session.run(output_names, {name: check[name].numpy() for name in INPUTS})
    with torch.no_grad():
        expected = list(model(**check).values())
    diff = max_abs_diff(outputs, expected, check["attention_mask"])
    print(f"{model_id} ({task}, {type(model).__name__}) -> {path}")
    print(f"inputs {list(INPUTS)}, outputs {output_names}; onnxruntime vs PyTorch on a "
          f"{tuple(check['input_ids'].shape)} batch: max |diff| {diff:.2e} (tolerance {atol:g})")

    # The config as stock BERT's (what the graph computes), so that plain transformers reads it beside the ONNX model
    model.config.to_json_file(os.path.join(output_dir, "config.json"), use_diff=False)
    write_stock_config(output_dir, stock_name(type(model)))
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    with open(os.path.join(output_dir, "export.json"), "w") as f:
        json.dump({"model": model_id, "task": task, "class": type(model).__name__, "inputs": list(INPUTS),
                   "outputs": output_names, "max_abs_diff": diff, "tolerance": atol, "torch": torch.__version__,
                   "onnxruntime": onnxruntime.__version__}, f, indent=2)
    if not diff <= atol:
        raise SystemExit(f"FAILED: the ONNX model differs from PyTorch by {diff:.2e} > {atol:g}; do not use {path}")
    return diff


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bert-impl-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model folder or Hub id: bert-impl's, or stock BERT's, RoBERTa's, "
                                      "XLM-RoBERTa's or CamemBERT's")
    parser.add_argument("output_dir", help="where to write model.onnx (must be empty or new, unless --overwrite)")
    parser.add_argument("--task", choices=list(TASKS), default=None,
                        help="the head to export (default: the model's architecture)")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty output_dir")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest max |diff| against PyTorch accepted")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: torch.onnx's)")
    args = parser.parse_args(argv)
    export(args.model, args.output_dir, args.task, args.overwrite, args.atol, args.opset)


if __name__ == "__main__":
    sys.exit(main())
