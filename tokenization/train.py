"""Train a BERT WordPiece vocabulary and save it as a `BertImplTokenizer` folder.

    python -m tokenization.train --files a.txt b.txt --vocab_size 30522 --output_dir DIR
    python -m tokenization.train --dataset_name wikitext --dataset_config_name wikitext-103-raw-v1 \
        --text_column text --vocab_size 30522 --output_dir DIR

Texts are the lines of local files, or one column of a data set read with `datasets.load_dataset` (a Hub name or a
local folder). Training runs `tokenizers`' WordPiece trainer through `train_new_from_iterator`, so the result has
BERT's pipeline, the special tokens `[PAD] [UNK] [CLS] [SEP] [MASK]` as ids 0-4, and the `[CLS] A [SEP] B [SEP]`
template. DIR gets `tokenizer.json`, `vocab.txt`, `tokenizer_config.json` and the tokenizer code, and loads with
`BertImplTokenizer.from_pretrained(DIR)`, or `AutoTokenizer.from_pretrained(DIR)` after `import modeling_bert_impl`.
"""

import argparse
from collections.abc import Iterable, Iterator
from itertools import islice

from tqdm.auto import tqdm

from . import BertImplTokenizer

BATCH_SIZE = 1000  # texts handed to the trainer at a time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tokenization.train", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--files", nargs="+", help="text files, one text per line")
    source.add_argument("--dataset_name", help="data set for datasets.load_dataset: a Hub name or a local folder")
    parser.add_argument("--dataset_config_name", default=None, help="the data set's configuration, if it has several")
    parser.add_argument("--dataset_split", default="train", help="split to read (default: train)")
    parser.add_argument("--text_column", default="text", help="column holding the texts (default: text)")
    parser.add_argument("--vocab_size", type=int, default=30522, help="vocabulary size (default: 30522, BERT's)")
    parser.add_argument(
        "--lowercase",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lower-case and strip accents (an uncased vocabulary, the default); --no-lowercase for a cased one",
    )
    parser.add_argument("--output_dir", required=True, help="folder to save the tokenizer in")
    return parser.parse_args(argv)


def file_texts(paths: list[str]) -> tuple[Iterator[list[str]], int]:
    """Batches of the files' lines (newlines removed), and how many lines there are."""
    total = 0
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            total += sum(1 for _ in handle)

    def lines() -> Iterator[str]:
        for path in paths:
            with open(path, encoding="utf-8") as handle:
                yield from (line.rstrip("\n") for line in handle)

    return batched(lines()), total


def dataset_texts(name: str, config_name: str | None, split: str, column: str) -> tuple[Iterator[list[str]], int]:
    """Batches of one column of a data set, and how many rows it has."""
    from datasets import load_dataset  # only this source needs `datasets`

    dataset = load_dataset(name, config_name, split=split)
    if column not in dataset.column_names:
        raise ValueError(f"--text_column {column!r} is not a column of {name}; its columns: {dataset.column_names}")
    return (batch[column] for batch in dataset.iter(batch_size=BATCH_SIZE)), len(dataset)


def batched(texts: Iterable[str]) -> Iterator[list[str]]:
    """Lists of `BATCH_SIZE` texts (the last one shorter)."""
    texts = iter(texts)
    while batch := list(islice(texts, BATCH_SIZE)):
        yield batch


def with_progress(batches: Iterator[list[str]], total: int) -> Iterator[list[str]]:
    """The same batches, advancing a progress bar over the `total` texts as the trainer reads them."""
    with tqdm(total=total, unit=" texts", desc="Reading texts") as progress:
        for batch in batches:
            yield batch
            progress.update(len(batch))


def train_tokenizer(batches: Iterable[list[str]], vocab_size: int, lowercase: bool = True) -> BertImplTokenizer:
    """A `BertImplTokenizer` with a WordPiece vocabulary of at most `vocab_size` tokens learned from `batches`."""
    return BertImplTokenizer(do_lower_case=lowercase).train_new_from_iterator(batches, vocab_size=vocab_size)


def main(argv: list[str] | None = None) -> BertImplTokenizer:
    """Run the command line; returns the trained tokenizer (also saved in `--output_dir`)."""
    args = parse_args(argv)
    if args.files:
        batches, total = file_texts(args.files)
    else:
        batches, total = dataset_texts(args.dataset_name, args.dataset_config_name, args.dataset_split, args.text_column)
    tokenizer = train_tokenizer(with_progress(batches, total), args.vocab_size, args.lowercase)
    tokenizer.save_pretrained(args.output_dir)
    print(f"Saved a {len(tokenizer)}-token {'uncased' if args.lowercase else 'cased'} vocabulary to {args.output_dir}")
    return tokenizer


if __name__ == "__main__":
    main()
