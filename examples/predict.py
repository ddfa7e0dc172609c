"""Classify sentences with a fine-tuned bert-impl folder, loaded back through transformers' Auto classes.

    python examples/predict.py outputs/quickstart "What a lovely day." "The service was painfully slow."

Without sentences it classifies a few built-in ones. Prints each sentence's label and its probability.
"""

import argparse

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import modeling_bert_impl  # noqa: F401  (registers bert_impl, model and tokenizer, with the Auto classes)

SENTENCES = [
    "I loved every minute of this trip, the people were so kind.",
    "The battery died after an hour and support never replied.",
    "What a beautiful, funny and touching film.",
    "The room was noisy, the bed was hard and breakfast was cold.",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="a folder written by recipes/run_glue.py")
    parser.add_argument("sentences", nargs="*", default=SENTENCES, help="sentences to classify")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_dir).eval()
    print(f"{type(model).__name__} and {type(tokenizer).__name__} from {args.model_dir}")
    inputs = tokenizer(args.sentences, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        probabilities = model(**inputs).logits.softmax(-1)
    for sentence, p in zip(args.sentences, probabilities):
        label = model.config.id2label[int(p.argmax())]
        print(f"{label:>10} {p.max().item():.2f}  {sentence}")


if __name__ == "__main__":
    main()
