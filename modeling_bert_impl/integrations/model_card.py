"""Model cards (`README.md`) for bert-impl checkpoints: Hub metadata, the architecture, a usage snippet that runs as
written, and, after a recipe, its metrics and the command that produced them.

- `model_card(...)` builds a `huggingface_hub.ModelCard`; `write_model_card(folder, ...)` saves it as `folder/README.md`.
- `push_to_hub` on our models uploads this card in place of transformers' generic one (see
  `BertImplPreTrainedModel._upload_modified_files`); a card that is already ours on the Hub is kept as it is.
- After a recipe, Trainer's `push_to_hub` uploads its own card; upload ours after it (the last commit wins):

      trainer.push_to_hub()
      readme = write_model_card(args.output_dir, trainer.model, metrics=metrics, command=["python", *sys.argv],
                                datasets=["nyu-mll/glue"], dataset_config="sst2", repo_id=trainer.hub_model_id)
      HfApi().upload_file(path_or_fileobj=readme, path_in_repo="README.md", repo_id=trainer.hub_model_id)

This module is not one of the code files copied next to a checkpoint: it is used only where bert-impl is installed.
"""

import json
import os
import shlex
from collections.abc import Mapping, Sequence

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from transformers import PreTrainedConfig, PreTrainedModel

from ..modeling_bert_impl import AUTO_CLASSES
from ..stock_format import family, stock_name
from .tasks import PIPELINE_TAGS, auto_class_of, classes_of

FAMILY_NAMES = {"Bert": "BERT", "Roberta": "RoBERTa", "XLMRoberta": "XLM-RoBERTa", "Camembert": "CamemBERT"}
TAGS = ["bert", "bert_impl"]

# Auto class -> the lines of the usage snippet after loading `tokenizer` and `model`.
_MASKED_LM = """\
inputs = tokenizer(f"Paris is the {{tokenizer.mask_token}} of France.", return_tensors="pt")
logits = model(**inputs).{logits}
masked = inputs["input_ids"][0] == tokenizer.mask_token_id
print(tokenizer.decode(logits[0, masked].argmax(-1)))"""
USAGE = {
    "AutoModel": """\
inputs = tokenizer(["A sentence to embed.", "And another one."], padding=True, return_tensors="pt")
outputs = model(**inputs)
print(outputs.last_hidden_state.shape)  # (batch, tokens, hidden); outputs.pooler_output: (batch, hidden)""",
    "AutoModelForPreTraining": _MASKED_LM.format(logits="prediction_logits"),
    "AutoModelForMaskedLM": _MASKED_LM.format(logits="logits"),
    "AutoModelForNextSentencePrediction": """\
inputs = tokenizer("The sky is clear today.", "We could go for a walk.", return_tensors="pt")
print(model(**inputs).logits.softmax(-1))  # [P(B follows A), P(B is random)]""",
    "AutoModelForSequenceClassification": """\
inputs = tokenizer("A sentence to classify.", return_tensors="pt")
logits = model(**inputs).logits
{readout}""",
    "AutoModelForTokenClassification": """\
inputs = tokenizer("Hugging Face is based in New York City.", return_tensors="pt")
predictions = model(**inputs).logits.argmax(-1)[0]
print([(token, model.config.id2label[p]) for token, p in zip(inputs.tokens(), predictions.tolist())])""",
    "AutoModelForQuestionAnswering": """\
question, context = "Where is Hugging Face based?", "Hugging Face is based in New York City."
inputs = tokenizer(question, context, return_tensors="pt")
outputs = model(**inputs)
start = outputs.start_logits[0].argmax().item()
end = start + outputs.end_logits[0, start:].argmax().item()  # the answer ends where it starts, or after
print(tokenizer.decode(inputs["input_ids"][0, start : end + 1]))""",
    "AutoModelForMultipleChoice": """\
prompt, choices = "The glass fell off the table.", ["It broke.", "It sang a song."]
inputs = tokenizer([prompt] * len(choices), choices, padding=True, return_tensors="pt")
logits = model(**{k: v.unsqueeze(0) for k, v in inputs.items()}).logits  # inputs (1, choices, tokens)
print(choices[logits.argmax(-1).item()])""",
}
_CLASSIFICATION_READOUT = {
    "regression": "print(logits.item())",
    "multi_label_classification": (
        "print([model.config.id2label[i] for i, p in enumerate(logits.sigmoid()[0].tolist()) if p > 0.5])"
    ),
    "single_label_classification": "print(model.config.id2label[logits.argmax(-1).item()])",
}

# Evaluation figures that measure the run, not the model (Trainer's speeds, the example scripts' sample counts):
# kept out of the model-index.
_NOT_QUALITY = ("runtime", "samples_per_second", "steps_per_second", "samples")
_SPLITS = {"eval": "validation", "test": "test", "predict": "test"}


def head_of(model_or_config: PreTrainedModel | PreTrainedConfig) -> str:
    """The Auto class that loads this model's head: from the model's class, or the config's `architectures` (our
    class names or stock BERT's)."""
    if isinstance(model_or_config, PreTrainedModel):
        name = type(model_or_config).__name__
    else:
        name = (getattr(model_or_config, "architectures", None) or ["BertImplModel"])[0]
    auto = auto_class_of(name)
    if auto is None:
        names = ", ".join(cls.__name__ for cls in AUTO_CLASSES.values())
        raise ValueError(f"{name} is not a bert-impl head; expected one of {names}")
    return auto


def usage_snippet(model_or_config: PreTrainedModel | PreTrainedConfig, repo_id: str, installed: bool = False) -> str:
    """Python that loads the tokenizer and the model from `repo_id` and runs the head once.

    `installed=False`: only transformers is needed (the repository's code runs with `trust_remote_code=True`).
    `installed=True`: bert-impl is installed; importing it registers our classes with the Auto classes."""
    config = getattr(model_or_config, "config", model_or_config)
    auto = head_of(model_or_config)
    body = USAGE[auto]
    if auto == "AutoModelForSequenceClassification":
        problem = config.problem_type or ("regression" if config.num_labels == 1 else "single_label_classification")
        body = body.format(readout=_CLASSIFICATION_READOUT[problem])
    if installed:
        header = "import modeling_bert_impl  # registers bert_impl (model and tokenizer) with the Auto classes\n"
        remote = ""
    else:
        header, remote = "", ", trust_remote_code=True"
    return (
        f"{header}from transformers import {auto}, AutoTokenizer\n\n"
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(repo_id)}{remote})\n"
        f"model = {auto}.from_pretrained({json.dumps(repo_id)}{remote})\n\n"
        f"{body}\n"
    )


def _table(header, rows) -> str:
    """A Markdown table."""
    lines = [list(header), ["---"] * len(list(header))] + [list(row) for row in rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def eval_results(metrics: Mapping[str, float], task: str | None, dataset: str, dataset_config: str | None = None):
    """Trainer-style evaluation metrics (`eval_accuracy`, `test_f1`, ...) as model-index entries, the prefix giving
    the split. Anything else (`train_loss`, `epoch`) and figures of the run (`eval_runtime`, `eval_samples`, ...)
    are left out."""
    results = []
    for name, value in metrics.items():
        prefix, _, metric = name.partition("_")
        if prefix not in _SPLITS or metric in _NOT_QUALITY or not _is_number(value):
            continue
        results.append(EvalResult(
            task_type=task or "other", dataset_type=dataset, dataset_name=dataset, dataset_config=dataset_config,
            dataset_split=_SPLITS[prefix], metric_type=metric, metric_name=metric,
            metric_value=float(value) if isinstance(value, float) else int(value),
        ))
    return results


def model_card(
    model_or_config: PreTrainedModel | PreTrainedConfig,
    repo_id: str,
    metrics: Mapping[str, float] | None = None,
    command: str | Sequence[str] | None = None,
    base_model: str | None = None,
    datasets: Sequence[str] | None = None,
    dataset_config: str | None = None,
    license: str | None = None,
    tags: Sequence[str] = (),
) -> ModelCard:
    """The card of a bert-impl model (or of its config), to be published as `repo_id`.

    Args:
        model_or_config: the model, or its config (the head is then read from `config.architectures`).
        repo_id: what the usage snippet loads: the Hub repository ("org/name"), or a local folder.
        metrics: name -> value, as `Trainer.evaluate()` returns them. All numbers are listed in the card; the
            evaluation ones (see `eval_results`) also go to the `model-index` metadata when `datasets` is given (its
            first entry is the evaluation dataset; `dataset_config` its configuration, e.g. "sst2").
        command: the command line that produced the model and the metrics: a string, or its arguments (such as
            `["python", *sys.argv]`).
        base_model: the Hub id of the checkpoint this model was fine-tuned from.
        datasets: Hub ids of the training datasets.
        license: a Hub license identifier, e.g. "apache-2.0".
        tags: more Hub tags, after "bert" and "bert_impl".
    """
    config = getattr(model_or_config, "config", model_or_config)
    auto = head_of(model_or_config)
    task = PIPELINE_TAGS[auto]
    name = repo_id.rstrip("/").split("/")[-1]
    datasets = list(datasets or [])
    results = eval_results(metrics, task, datasets[0], dataset_config) if metrics and datasets else None
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=task,
        tags=TAGS + [t for t in tags if t not in TAGS],
        base_model=base_model,
        datasets=datasets or None,
        license=license,
        model_name=name if results else None,
        eval_results=results or None,
    )

    ours = classes_of(config.model_type)[auto]
    head, stock = ours.__name__, stock_name(ours)
    family_name = FAMILY_NAMES[family(stock)]
    about = f"{'An' if family_name[0] in 'AEIOUX' else 'A'} {family_name} encoder with the `{head}` head"
    if base_model:
        about += f", fine-tuned from [`{base_model}`](https://huggingface.co/{base_model})"
    if datasets:
        about += " on " + ", ".join(f"[`{d}`](https://huggingface.co/datasets/{d})" for d in datasets)
    sizes = {
        "layers": config.num_hidden_layers, "hidden size": config.hidden_size,
        "attention heads": config.num_attention_heads, "intermediate size": config.intermediate_size,
        "vocabulary": config.vocab_size, "max positions": config.max_position_embeddings,
    }
    if isinstance(model_or_config, PreTrainedModel):
        sizes["parameters"] = f"{model_or_config.num_parameters():,}"
    sections = [
        f"# {name}",
        about + ". It runs on bert-impl, a from-scratch PyTorch BERT that loads with 🤗 transformers' Auto classes. "
        f"The weights carry stock BERT's parameter names, so transformers' own `{stock}` loads them as they are "
        "(`from_pretrained` on this repository); `model.save_stock_pretrained(folder)` writes a copy whose config is "
        "stock BERT's too.",
        "## Model\n\n" + _table(sizes.keys(), [sizes.values()]),
    ]
    if auto in ("AutoModelForSequenceClassification", "AutoModelForTokenClassification") and config.id2label:
        labels = ", ".join(f"{i}: `{label}`" for i, label in sorted(config.id2label.items()))
        sections.append(f"Labels: {labels}.")
    sections.append(
        "## Usage\n\n"
        "With only `transformers` installed (the code files of this repository run; read them first):\n\n"
        f"```python\n{usage_snippet(model_or_config, repo_id)}```\n\n"
        "With bert-impl installed, its own classes load the same files, without `trust_remote_code`:\n\n"
        f"```python\n{usage_snippet(model_or_config, repo_id, installed=True)}```"
    )
    numbers = {k: v for k, v in (metrics or {}).items() if _is_number(v)}
    if numbers:
        rows = [(k, f"{v:.4g}" if isinstance(v, float) else v) for k, v in numbers.items()]
        sections.append("## Evaluation\n\n" + _table(["metric", "value"], rows))
    if command:
        line = command if isinstance(command, str) else shlex.join(command)
        sections.append(f"## Reproduce\n\n```bash\n{line}\n```")
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def write_model_card(
    save_directory: str | os.PathLike,
    model_or_config: PreTrainedModel | PreTrainedConfig,
    metrics: Mapping[str, float] | None = None,
    command: str | Sequence[str] | None = None,
    base_model: str | None = None,
    datasets: Sequence[str] | None = None,
    repo_id: str | None = None,
    **kwargs,
) -> str:
    """Write `model_card(...)` to `save_directory/README.md` and return that path.

    `repo_id` is what the card's usage snippet loads: pass the Hub repository the folder goes to ("org/name");
    without it, the snippet loads the folder itself. Other keyword arguments go to `model_card`."""
    os.makedirs(save_directory, exist_ok=True)
    path = os.path.join(save_directory, "README.md")
    card = model_card(model_or_config, repo_id or os.fspath(save_directory), metrics=metrics, command=command,
                      base_model=base_model, datasets=datasets, **kwargs)
    card.save(path)
    return path


def replace_generic_card(folder: str | os.PathLike, model: PreTrainedModel, repo_id: str) -> None:
    """Make `folder/README.md` ours before `push_to_hub` uploads the folder.

    transformers has just written there the repository's current card, or a generic one for a new repository. A
    card that is already ours (tagged "bert_impl", say with a recipe's metrics) is kept; any other is replaced by
    `model_card(model, repo_id)`, keeping its extra tags (those given to `push_to_hub(tags=...)`)."""
    path = os.path.join(folder, "README.md")
    tags = (ModelCard.load(path).data.tags or []) if os.path.isfile(path) else []
    if "bert_impl" in tags:
        return
    model_card(model, repo_id, tags=tags).save(path)
