"""The paper's feature-based approach to named entities (BERT, section 5.3 and Table 7): the encoder stays frozen, its
hidden states are extracted once, and a small task model learns from them, a two-layer bidirectional LSTM and a linear
classifier over the tags, for each choice of features:

| `--features` | input to the BiLSTM | the paper's dev F1 (BERT-base, CoNLL-2003) |
| --- | --- | --- |
| `embeddings` | the embedding layer's output | 91.0 |
| `second_to_last` | the second-to-last layer | 95.6 |
| `last` | the last layer | 94.9 |
| `sum_last_four` | a learned weighted sum of the last four layers | 95.9 |
| `concat_last_four` | the last four layers side by side (4 x H) | 96.1 |
| `sum_all` | a learned weighted sum of every hidden state (embeddings and each layer) | 95.5 |

(fine-tuning the whole model with `run_ner.py`: 96.4)

    python recipes/run_ner_features.py --model_name_or_path bert-base-cased --train_file train.txt \\
        --validation_file valid.txt --max_seq_length 128 --learning_rate 1e-3 --num_train_epochs 5 \\
        --per_device_train_batch_size 32 --fine_tune --output_dir outputs/conll2003_features

With --fine_tune the same command also fine-tunes the whole model with `run_ner.py`'s training (its `run`, on the same
model, data and training flags, but --fine_tune_learning_rate and --fine_tune_epochs) into --output_dir/fine_tuning,
and its validation F1 is the table's fine-tuning row; or give an earlier `run_ner.py` --output_dir as --fine_tuned_dir.

Data, tags and scoring are `run_ner.py`'s (its readers, `run_ner.align_labels`, seqeval entity F1 per word, words cut
off by --max_seq_length not scored). The BiLSTM reads every token's features (sub-tokens and [CLS]/[SEP] included);
each word is tagged at its first sub-token. The weighted sums learn softmax-normalised layer weights and a scale with
the BiLSTM. The paper fed the encoder each word's whole document as context; this script feeds it the sentence.

Features are cached in --feature_cache_dir, one float16 file per split named by a hash of the encoder's weights and the
split's token ids (so of the model, the data, the tokenizer and --max_seq_length): a second run, with other heads or
other training flags, reads them instead of running the encoder. Every hidden state of every token is stored:
(L + 1) x H x 2 bytes per token, 20 KB for BERT-base, so several GB for CoNLL-2003's 200k training words.

Writes into --output_dir, per feature choice, a folder with the head (`model.safetensors`, `head_config.json`,
`eval_predictions.txt`: the validation tags, one line per sentence), then `feature_based_results.json` and
`feature_based_table.md`: one row per choice with your F1 beside the paper's, and fine-tuning's (`eval_f1` of the
--fine_tune run in --output_dir/fine_tuning, or of a `run_ner.py` --output_dir given as --fine_tuned_dir).
`predict(head_dir, sentences)` tags new sentences with a saved head and its encoder.
"""

import needs_extra  # noqa: F401  (first: says what to install where the recipes extra is missing)
import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from huggingface_hub import constants
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Trainer, set_seed

import checkpoints
import common
import run_ner
from metrics import seqeval_metrics
from modeling_bert_impl import BertImplModel

logger = logging.getLogger(__name__)

# name -> (the table's row, hidden-state indices given L layers (0 = embeddings, L = last), how they are combined)
FEATURES = {
    "embeddings": ("Embeddings", lambda L: [0], "concat"),
    "second_to_last": ("Second-to-last hidden", lambda L: [L - 1], "concat"),
    "last": ("Last hidden", lambda L: [L], "concat"),
    "sum_last_four": ("Weighted sum last four hidden", lambda L: list(range(L - 3, L + 1)), "sum"),
    "concat_last_four": ("Concat last four hidden", lambda L: list(range(L - 3, L + 1)), "concat"),
    "sum_all": ("Weighted sum all layers", lambda L: list(range(L + 1)), "sum"),
}
PAPER_F1 = {"embeddings": 91.0, "second_to_last": 95.6, "last": 94.9, "sum_last_four": 95.9,
            "concat_last_four": 96.1, "sum_all": 95.5, "fine_tuning": 96.4}  # Table 7, BERT-base, CoNLL-2003 dev


@dataclass
class DataArguments(run_ner.DataArguments):
    features: str = field(default="all", metadata={"help": f"Comma-separated, or all: {', '.join(FEATURES)}."})
    lstm_hidden_size: int = field(default=768, metadata={"help": "The BiLSTM's size per direction (the paper: 768)."})
    lstm_layers: int = field(default=2, metadata={"help": "The BiLSTM's layers (the paper: 2)."})
    feature_cache_dir: str | None = field(
        default=None, metadata={"help": "Where extracted features are kept (default: $HF_HOME/bert_impl_features)."}
    )
    fine_tuned_dir: str | None = field(
        default=None, metadata={"help": "A run_ner.py --output_dir on the same data: its eval_f1 is the table's "
                                        "fine-tuning row."}
    )
    fine_tune: bool = field(
        default=False,
        metadata={"help": "Also fine-tune the whole model with run_ner.py's training (same model, data and training "
                          "flags, but --fine_tune_learning_rate and --fine_tune_epochs) into --output_dir/fine_tuning; "
                          "its eval_f1 is the table's fine-tuning row."},
    )
    fine_tune_learning_rate: float = field(default=5e-5, metadata={"help": "--fine_tune's learning rate."})
    fine_tune_epochs: float = field(default=3.0, metadata={"help": "--fine_tune's number of epochs."})

    def __post_init__(self):
        super().__post_init__()
        names = list(FEATURES) if self.features == "all" else [n.strip() for n in self.features.split(",")]
        unknown = [n for n in names if n not in FEATURES]
        if unknown or not names:
            raise ValueError(f"--features {self.features!r}: unknown {unknown}; choose all or from "
                             f"{', '.join(FEATURES)}")
        self.feature_names = names
        if self.fine_tune and self.fine_tuned_dir:
            raise ValueError("give --fine_tune (fine-tune here) or --fine_tuned_dir (an earlier run_ner.py run), not "
                             "both")
        for name in ("lstm_hidden_size", "lstm_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")


# ---------------------------------------------------------------------------------------------------------------------
# Features: extracted once, cached
# ---------------------------------------------------------------------------------------------------------------------
def extract(encoder, tokenizer, encoded: dict, batch_size: int) -> dict:
    """Every hidden state of every token of the tokenized sentences `encoded` (input_ids, token_type_ids,
    attention_mask lists): {"hidden": (N tokens, L + 1, H) float16, sentences one after the other, "lengths": (S,)}."""
    hidden, lengths = [], []
    inputs = [k for k in ("input_ids", "token_type_ids", "attention_mask") if k in encoded]
    with torch.no_grad():
        for first in range(0, len(encoded["input_ids"]), batch_size):
            rows = {k: encoded[k][first:first + batch_size] for k in inputs}
            batch = tokenizer.pad(rows, return_tensors="pt").to(encoder.device)
            states = encoder(**batch, output_hidden_states=True).hidden_states  # L + 1 of (B, T, H)
            states = torch.stack(states, dim=2)  # (B, T, L + 1, H)
            mask = batch["attention_mask"].bool()
            hidden.append(states[mask].to("cpu", torch.float16))  # (tokens, L + 1, H)
            lengths += mask.sum(-1).tolist()
    return {"hidden": torch.cat(hidden), "lengths": torch.tensor(lengths)}


def fingerprint(encoder) -> str:
    """A hash of the encoder's weights (names, dtypes, shapes and values)."""
    digest = hashlib.sha256()
    for name, tensor in encoder.state_dict().items():
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def cached_features(encoder, model_hash: str, tokenizer, encoded: dict, batch_size: int, cache_dir: str):
    """`extract`'s result, read from `cache_dir` when a file for these weights and token ids is there, else extracted
    and written there (whole or not at all). Returns (features, path, reused)."""
    digest = hashlib.sha256(model_hash.encode())
    for name in ("input_ids", "token_type_ids", "attention_mask"):
        digest.update(json.dumps(encoded.get(name)).encode())
    path = os.path.join(cache_dir, f"{digest.hexdigest()[:40]}.safetensors")
    if os.path.isfile(path):
        logger.info(f"Reusing the features in {path}")
        return load_file(path), path, True
    features = extract(encoder, tokenizer, encoded, batch_size)
    os.makedirs(cache_dir, exist_ok=True)
    save_file(features, path + ".tmp")
    os.replace(path + ".tmp", path)
    logger.info(f"Features written to {path}")
    return features, path, False


# ---------------------------------------------------------------------------------------------------------------------
# The head: BiLSTM + linear classifier
# ---------------------------------------------------------------------------------------------------------------------
class FeatureTagger(nn.Module):
    """A BiLSTM tagger over K hidden states of H per token, combined by a learned weighted sum (softmax weights, a
    scale) or side by side."""

    def __init__(self, num_states: int, hidden_size: int, combine: str, lstm_hidden_size: int, lstm_layers: int,
                 num_labels: int):
        super().__init__()
        self.combine = combine
        if combine == "sum":
            self.layer_weights = nn.Parameter(torch.zeros(num_states))
            self.scale = nn.Parameter(torch.ones(()))
        input_size = hidden_size if combine == "sum" else hidden_size * num_states
        self.lstm = nn.LSTM(input_size, lstm_hidden_size, num_layers=lstm_layers, bidirectional=True,
                            batch_first=True)
        self.classifier = nn.Linear(2 * lstm_hidden_size, num_labels)

    def forward(self, features, attention_mask, labels=None):
        # features: (B, T, K, H); attention_mask, labels: (B, T)
        features = features.float()
        if self.combine == "sum":
            inputs = self.scale * torch.einsum("btkh,k->bth", features, self.layer_weights.softmax(0))  # (B, T, H)
        else:
            inputs = features.flatten(2)  # (B, T, K * H)
        lengths = attention_mask.sum(-1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(inputs, lengths, batch_first=True, enforce_sorted=False)
        outputs, _ = self.lstm(packed)
        outputs, _ = nn.utils.rnn.pad_packed_sequence(outputs, batch_first=True, total_length=inputs.shape[1])
        logits = self.classifier(outputs)  # (B, T, C)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


class FeatureDataset(torch.utils.data.Dataset):
    """Sentence i: its tokens' hidden states `layers` (T, K, H) and, given, their labels."""

    def __init__(self, features: dict, layers: list[int], labels: list[list[int]] | None = None):
        self.hidden, self.layers, self.labels = features["hidden"], layers, labels
        self.starts = [0, *torch.cumsum(features["lengths"], 0).tolist()]

    def __len__(self):
        return len(self.starts) - 1

    def __getitem__(self, i):
        item = {"features": self.hidden[self.starts[i]:self.starts[i + 1], self.layers]}
        if self.labels is not None:
            item["labels"] = torch.tensor(self.labels[i])
        return item


def collate(items: list[dict]) -> dict:
    """Pad a batch: features with zeros, labels with -100, and the attention mask."""
    features = nn.utils.rnn.pad_sequence([x["features"] for x in items], batch_first=True)  # (B, T, K, H)
    lengths = torch.tensor([len(x["features"]) for x in items])
    batch = {"features": features, "attention_mask": (torch.arange(features.shape[1]) < lengths[:, None]).long()}
    if "labels" in items[0]:
        batch["labels"] = nn.utils.rnn.pad_sequence([x["labels"] for x in items], batch_first=True, padding_value=-100)
    return batch


def first_subtoken_tags(logits, label_ids, label_list) -> tuple[list[list[str]], list[list[str]]]:
    """Predicted and gold tag names at the labelled sub-tokens (each word's first), per sentence."""
    predictions = np.argmax(logits, axis=-1)
    pairs = [[(label_list[p], label_list[g]) for p, g in zip(row_p, row_g) if g != -100]
             for row_p, row_g in zip(predictions, label_ids)]
    return [[p for p, _ in row] for row in pairs], [[g for _, g in row] for row in pairs]


# ---------------------------------------------------------------------------------------------------------------------
# Reload and tag
# ---------------------------------------------------------------------------------------------------------------------
def load_head(head_dir: str) -> tuple[FeatureTagger, dict]:
    """A saved head and its config (`head_config.json`)."""
    with open(os.path.join(head_dir, "head_config.json")) as f:
        config = json.load(f)
    head = FeatureTagger(len(config["layers"]), config["hidden_size"], config["combine"], config["lstm_hidden_size"],
                         config["lstm_layers"], len(config["labels"]))
    head.load_state_dict(load_file(os.path.join(head_dir, "model.safetensors")))
    return head.eval(), config


def predict(head_dir: str, sentences: list[list[str]], batch_size: int = 32, encoder=None, tokenizer=None):
    """Tag `sentences` (lists of words) with the head saved in `head_dir` on its encoder's features (the encoder and
    tokenizer it was trained on, loaded unless given). One list of tags per sentence; words past the head's
    max_seq_length get none, as in training."""
    sentences = [list(s) for s in sentences]
    for i, sentence in enumerate(sentences):
        if not sentence or not all(isinstance(w, str) and w.strip() for w in sentence):
            raise ValueError(f"sentences[{i}] must be a non-empty list of non-empty words, got {sentence!r}")
    head, config = load_head(head_dir)
    model_args = common.ModelArguments(model_name_or_path=config["model_name_or_path"],
                                       tokenizer_name=config["tokenizer_name"])
    tokenizer = tokenizer or common.load_tokenizer(model_args)
    encoder = encoder or BertImplModel.from_pretrained(config["model_name_or_path"], add_pooling_layer=False).eval()
    encoded = tokenizer(sentences, is_split_into_words=True, truncation=True, max_length=config["max_seq_length"])
    features = extract(encoder, tokenizer, encoded, batch_size)
    labels = [run_ner.align_labels(encoded.word_ids(i), [0] * len(s)) for i, s in enumerate(sentences)]
    dataset = FeatureDataset(features, config["layers"], labels)
    tags = []
    with torch.no_grad():
        for first in range(0, len(dataset), batch_size):
            batch = collate([dataset[i] for i in range(first, min(first + batch_size, len(dataset)))])
            logits = head(batch["features"], batch["attention_mask"])["logits"]
            tags += first_subtoken_tags(logits.numpy(), batch["labels"].numpy(), config["labels"])[0]
    return tags


# ---------------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    """Run the recipe with `argv` (default: the command line); returns what feature_based_results.json holds."""
    model_args, data_args, training_args = common.parse_args(DataArguments, argv)
    common.setup_logging(training_args)
    set_seed(training_args.seed)
    results_path = os.path.join(training_args.output_dir, "feature_based_results.json")
    if os.path.exists(results_path):
        raise ValueError(f"--output_dir {training_args.output_dir} already holds a run ({results_path}); choose "
                         f"another")
    if training_args.do_predict:
        raise ValueError("--do_predict: this recipe scores --validation_file; tag new text with predict(head_dir, ...)")
    fine_tuning = read_fine_tuned_f1(data_args.fine_tuned_dir) if data_args.fine_tuned_dir else None

    raw = common.load_data(data_args, model_args.cache_dir, run_ner.read_file)
    words, tags = data_args.text_column_name, data_args.label_column_name
    for split in ("train", "validation"):
        if split not in raw or tags not in raw[split].column_names:
            raise ValueError(f"the table needs tagged train and validation data: give --train_file and "
                             f"--validation_file with the {tags!r} column")
    raw = {"train": common.take(raw["train"], data_args.max_train_samples),
           "validation": common.take(raw["validation"], data_args.max_eval_samples)}
    by_id = hasattr(getattr(raw["train"].features[tags], "feature", None), "names")
    label_list = list(raw["train"].features[tags].feature.names) if by_id else sorted(
        {str(t) for split in raw.values() for sentence in split[tags] for t in sentence})
    tag_to_id = {label: i for i, label in enumerate(label_list)}

    tokenizer = common.load_tokenizer(model_args)
    max_length = common.sequence_length(data_args, tokenizer)
    encoder = BertImplModel.from_pretrained(model_args.model_name_or_path, cache_dir=model_args.cache_dir,
                                            add_pooling_layer=False).to(training_args.device).eval()
    num_layers, hidden_size = encoder.config.num_hidden_layers, encoder.config.hidden_size
    layers = {name: FEATURES[name][1](num_layers) for name in data_args.feature_names}
    for name, indices in layers.items():  # the hidden-layer choices must not reach the embeddings (0)
        if name not in ("embeddings", "sum_all") and min(indices) < 1:
            raise ValueError(f"--features {name} needs at least {num_layers - min(indices) + 1} layers; the model has "
                             f"{num_layers}")
    model_hash = fingerprint(encoder)
    cache_dir = data_args.feature_cache_dir or os.path.join(constants.HF_HOME, "bert_impl_features")

    splits, caches = {}, {}
    for split, dataset in raw.items():
        encoded = tokenizer(list(dataset[words]), is_split_into_words=True, truncation=True, max_length=max_length,
                            padding="max_length" if data_args.pad_to_max_length else False)
        continuation = None
        if data_args.label_all_tokens and split == "train":  # B-X -> I-X on continuation sub-tokens, as run_ner.py
            continuation = [tag_to_id.get("I-" + l[2:], i) if l.startswith("B-") else i
                            for i, l in enumerate(label_list)]
        labels = [run_ner.align_labels(encoded.word_ids(i), [t if by_id else tag_to_id[str(t)] for t in sentence],
                                       continuation) for i, sentence in enumerate(list(dataset[tags]))]
        if data_args.pad_to_max_length:  # features are kept for real tokens only
            labels = [row[:sum(mask)] for row, mask in zip(labels, encoded["attention_mask"])]
        features, path, reused = cached_features(encoder, model_hash, tokenizer, encoded,
                                                 training_args.per_device_eval_batch_size, cache_dir)
        splits[split] = (features, labels)
        caches[split] = {"path": path, "reused": reused}
    del encoder

    rows = {}
    for name in data_args.feature_names:
        title, _, combine = FEATURES[name]
        set_seed(training_args.seed)
        head = FeatureTagger(len(layers[name]), hidden_size, combine, data_args.lstm_hidden_size, data_args.lstm_layers,
                             len(label_list))
        head_dir = os.path.join(training_args.output_dir, name)
        trainer = Trainer(
            model=head,
            args=dataclasses.replace(training_args, output_dir=head_dir),
            train_dataset=FeatureDataset(splits["train"][0], layers[name], splits["train"][1]),
            eval_dataset=FeatureDataset(splits["validation"][0], layers[name], splits["validation"][1]),
            data_collator=collate,
            compute_metrics=lambda p: seqeval_metrics(*first_subtoken_tags(p.predictions, p.label_ids, label_list)),
        )
        trainer.train()
        output = trainer.predict(trainer.eval_dataset, metric_key_prefix="eval")
        trainer.save_model(head_dir)  # model.safetensors
        config = {"features": name, "layers": layers[name], "combine": combine, "hidden_size": hidden_size,
                  "lstm_hidden_size": data_args.lstm_hidden_size, "lstm_layers": data_args.lstm_layers,
                  "labels": label_list, "model_name_or_path": located(model_args.model_name_or_path),
                  "tokenizer_name": located(model_args.tokenizer_name), "max_seq_length": max_length}
        with open(os.path.join(head_dir, "head_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        predicted, _ = first_subtoken_tags(output.predictions, output.label_ids, label_list)
        with open(os.path.join(head_dir, "eval_predictions.txt"), "w") as f:
            f.writelines(" ".join(row) + "\n" for row in predicted)
        rows[name] = {"title": title, "layers": layers[name], **{k[5:]: v for k, v in output.metrics.items()
                                                          if k in ("eval_f1", "eval_precision", "eval_recall")}}

    if data_args.fine_tune:
        fine_tuning = fine_tune(model_args, data_args, training_args, argv)
    table = format_table(rows, fine_tuning, num_layers)
    results = {"features": rows, "fine_tuning_f1": fine_tuning, "feature_cache": caches, "table": table}
    with open(os.path.join(training_args.output_dir, "feature_based_table.md"), "w") as f:
        f.write(table)
    with open(results_path, "w") as f:
        json.dump(results, f, indent=2)
    print(table)
    return results


def located(name: str | None) -> str | None:
    """A local folder as an absolute path (so a saved head finds its encoder from anywhere), a Hub id as it is."""
    return os.path.abspath(name) if name and os.path.isdir(name) else name


def fine_tune(model_args: common.ModelArguments, data_args: DataArguments,
              training_args: common.RecipeTrainingArguments, argv: list[str] | None) -> float:
    """--fine_tune: `run_ner.run` (train and evaluate) on the same model, data and training flags, with
    --fine_tune_learning_rate and --fine_tune_epochs, into --output_dir/fine_tuning; returns its eval_f1."""
    args = dataclasses.replace(
        training_args, output_dir=os.path.join(training_args.output_dir, "fine_tuning"),
        learning_rate=data_args.fine_tune_learning_rate, num_train_epochs=data_args.fine_tune_epochs,
        do_train=True, do_eval=True, do_predict=False, resume_from_checkpoint=None,
    )
    checkpoints.prepare_run(args)  # refuses a fine_tuning folder holding an earlier run, as run_ner.py does
    run_ner.run(model_args, data_args, args, argv, script=__file__)
    return read_fine_tuned_f1(args.output_dir)


def read_fine_tuned_f1(run_dir: str) -> float:
    """eval_f1 of a run_ner.py --output_dir (its all_results.json)."""
    path = os.path.join(run_dir, "all_results.json")
    if not os.path.isfile(path):
        raise ValueError(f"--fine_tuned_dir {run_dir}: no all_results.json; give a run_ner.py --output_dir that ran "
                         f"--do_eval")
    with open(path) as f:
        metrics = json.load(f)
    if "eval_f1" not in metrics:
        raise ValueError(f"{path}: no eval_f1; give a run_ner.py --output_dir that ran --do_eval")
    return metrics["eval_f1"]


def format_table(rows: dict, fine_tuning: float | None, num_layers: int) -> str:
    """The paper's Table 7 for this run: entity F1 on the validation data in percent, beside the paper's."""
    lines = ["| system | hidden states (0 = embeddings) | your dev F1 | paper's dev F1 (BERT-base) |",
             "| --- | --- | --- | --- |"]
    tuned = "-" if fine_tuning is None else f"{100 * fine_tuning:.1f}"
    lines.append(f"| Fine-tuning (run_ner.py) | all, fine-tuned | {tuned} | {PAPER_F1['fine_tuning']:.1f} |")
    for name, row in rows.items():
        layers = row["layers"]
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
        lines.append(f"| {row['title']} | {span} of 0-{num_layers} | {100 * row['f1']:.1f} | {PAPER_F1[name]:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
    common.leave_process_group()
