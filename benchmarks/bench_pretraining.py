"""Pre-training throughput: bert-impl's `BertImplForPreTraining` against transformers' `BertForPreTraining`.

Both models get the same config (a preset), the same batches (built by the recipe's pipeline: [CLS] A [SEP] B [SEP]
examples with short_seq_prob 0.1, hence some padding, dynamically masked) and the same training step: forward with MLM
and NSP labels, backward, AdamW step. They run in turns in one process (ours first in odd rounds, stock first in even
ones), so that load on the machine hits both alike; each figure is the median over rounds.

    python benchmarks/bench_pretraining.py                      # tiny preset, CPU
    python benchmarks/bench_pretraining.py --preset mini --batch_size 32 --seq_len 128 --rounds 5
    python benchmarks/bench_pretraining.py --preset base --device cuda --bf16 --batch_size 64

Tokens/s counts the real (non-padding) tokens of the batches.
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import modeling_bert_impl  # noqa: F401
from modeling_bert_impl import PRESETS, BertImplConfig, BertImplForPreTraining

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
from pretraining_data import DataCollatorForPreTraining, create_examples_from_document, document_rng  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128, help="max_seq_length of the examples")
    parser.add_argument("--steps", type=int, default=4, help="timed training steps per model per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model before the first round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab_size", type=int, default=30522)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="autocast the forward pass to bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dense_prediction_too", action="store_true",
                        help="also time ours with the MLM decoder on every position (config.sparse_prediction=False)")
    return parser.parse_args(argv)


class VocabularyOnly:
    """What the collator needs of a tokenizer, for a vocabulary of `size` ids where 0-4 play [PAD] [UNK] [CLS] [SEP]
    [MASK] and there are no ## pieces."""

    pad_token_id, cls_token_id, sep_token_id, mask_token_id = 0, 2, 3, 4
    all_special_ids = [0, 1, 2, 3, 4]

    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def get_vocab(self):
        return {}


def make_batches(args, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` batches from synthetic documents (random word-piece ids, sentences of 5-30 tokens) through the
    recipe's example builder and collator."""
    rng = random.Random(args.seed)
    tokenizer = VocabularyOnly(args.vocab_size)
    collator = DataCollatorForPreTraining(tokenizer, seed=args.seed)
    examples = []
    while len(examples) < count * args.batch_size:
        docs = [[[rng.randrange(1000, args.vocab_size) for _ in range(rng.randint(5, 30))] for _ in range(rng.randint(5, 40))]
                for _ in range(32)]
        for i in range(len(docs)):
            examples += create_examples_from_document(
                docs, i, document_rng(args.seed, len(examples) + i), max_seq_length=args.seq_len,
                cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id,
            )
    rng.shuffle(examples)
    return [collator(examples[i * args.batch_size:(i + 1) * args.batch_size]) for i in range(count)]


def make_models(args) -> dict[str, torch.nn.Module]:
    # As the pre-training recipe runs it: the MLM decoder on the masked rows only (the model's default is off).
    ours = BertImplConfig.from_preset(args.preset, vocab_size=args.vocab_size, sparse_prediction=True)
    stock = transformers.BertConfig(**{k: getattr(ours, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
        "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
        "initializer_range", "layer_norm_eps", "pad_token_id",
    )})
    torch.manual_seed(args.seed)
    models = {"bert-impl BertImplForPreTraining, sparse_prediction=True": BertImplForPreTraining(ours)}
    if args.dense_prediction_too and hasattr(ours, "sparse_prediction"):
        dense = BertImplConfig.from_preset(args.preset, vocab_size=args.vocab_size, sparse_prediction=False)
        models["bert-impl, sparse_prediction=False"] = BertImplForPreTraining(dense)
    models["transformers BertForPreTraining"] = transformers.BertForPreTraining(stock)
    return models


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Trainee:
    """A model with its AdamW optimizer, doing full training steps."""

    def __init__(self, model: torch.nn.Module, device: str, bf16: bool):
        self.model = model.to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.device, self.bf16 = device, bf16

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.model(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def timed(self, batches) -> float:
        """Tokens/s over `batches` (real tokens; the clock stops once the device is done)."""
        synchronize(self.device)
        start = time.perf_counter()
        for batch in batches:
            self.step(batch)
        synchronize(self.device)
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        return tokens / (time.perf_counter() - start)


def main(argv=None) -> dict[str, float]:
    args = parse_args(argv)
    batches = [{k: v.to(args.device) for k, v in b.items()} for b in make_batches(args, args.steps)]
    padding = 1 - sum(int(b["attention_mask"].sum()) for b in batches) / sum(b["attention_mask"].numel() for b in batches)
    trainees = {name: Trainee(model, args.device, args.bf16) for name, model in make_models(args).items()}
    for trainee in trainees.values():
        for batch in batches[:args.warmup]:
            trainee.step(batch)

    rates = {name: [] for name in trainees}
    names = list(trainees)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            rates[name].append(trainees[name].timed(batches))
    ours_name, stock_name = names[0], names[-1]
    medians = {name: statistics.median(values) for name, values in rates.items()}

    print(f"preset {args.preset}, batch {args.batch_size} x {args.seq_len} tokens ({padding:.1%} padding), "
          f"vocab {args.vocab_size}, device {args.device}{' bf16' if args.bf16 else ''}, torch threads "
          f"{torch.get_num_threads()}, {args.steps} steps x {args.rounds} rounds")
    for name, values in rates.items():
        print(f"{name:36s} {medians[name]:10.0f} tokens/s  (rounds: {', '.join(f'{v:.0f}' for v in values)})")
    ours, stock = medians[ours_name], medians[stock_name]
    print(f"ratio bert-impl / transformers: {ours / stock:.2f}x")
    return {"ours_tokens_per_s": ours, "transformers_tokens_per_s": stock, "ratio": ours / stock}


if __name__ == "__main__":
    main()
