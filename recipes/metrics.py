"""The fine-tuning recipes' metrics, computed offline with scikit-learn, scipy and seqeval.

Every function takes predictions and references (same length, any array-like) and returns a dict of Python floats,
named as the `evaluate` library's GLUE and seqeval metrics name them, so results compare with published runs. Scores are
fractions in [0, 1] (correlations in [-1, 1]). The SQuAD metric is in `qa_utils.py`.
"""

import numpy as np
from scipy.stats import pearsonr, spearmanr
from seqeval.metrics import accuracy_score as seqeval_accuracy
from seqeval.metrics import f1_score as seqeval_f1
from seqeval.metrics import precision_score as seqeval_precision
from seqeval.metrics import recall_score as seqeval_recall
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef


def accuracy(predictions, references) -> dict:
    """The fraction of predictions equal to their reference."""
    return {"accuracy": float(accuracy_score(references, predictions))}


def accuracy_and_f1(predictions, references) -> dict:
    """Accuracy and the binary F1 of class 1 (GLUE's MRPC and QQP: 1 = paraphrase / duplicate)."""
    return {**accuracy(predictions, references), "f1": float(f1_score(references, predictions))}


def matthews_correlation(predictions, references) -> dict:
    """Matthews correlation coefficient (GLUE's CoLA): (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)),
    0 when a factor of the denominator is 0."""
    return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}


def pearson_and_spearman(predictions, references) -> dict:
    """Pearson and Spearman rank correlation (GLUE's STS-B, and any regression)."""
    predictions, references = np.asarray(predictions, dtype=float), np.asarray(references, dtype=float)
    return {
        "pearson": float(pearsonr(predictions, references)[0]),
        "spearmanr": float(spearmanr(predictions, references)[0]),
    }


# GLUE task -> its metric, as in the GLUE benchmark (and `evaluate.load("glue", task)`).
GLUE_METRICS = {
    "cola": matthews_correlation,
    "sst2": accuracy,
    "mrpc": accuracy_and_f1,
    "stsb": pearson_and_spearman,
    "qqp": accuracy_and_f1,
    "mnli": accuracy,
    "qnli": accuracy,
    "rte": accuracy,
    "wnli": accuracy,
    "ax": matthews_correlation,
}


def glue_metrics(task_name: str, predictions, references) -> dict:
    """The metric GLUE reports for `task_name` (class ids, or scores for stsb)."""
    if task_name not in GLUE_METRICS:
        raise ValueError(f"unknown GLUE task {task_name!r}; choose one of {', '.join(GLUE_METRICS)}")
    return GLUE_METRICS[task_name](predictions, references)


def seqeval_metrics(predictions: list[list[str]], references: list[list[str]]) -> dict:
    """Entity-level precision, recall and F1 over whole entities (an entity counts only when its type and its exact
    span match; seqeval's default, CoNLL `conlleval`-compatible chunking of IOB tags), plus token-level accuracy.
    Arguments are one list of tag strings per sentence ("B-PER", "I-PER", "O", ...)."""
    return {
        "precision": float(seqeval_precision(references, predictions)),
        "recall": float(seqeval_recall(references, predictions)),
        "f1": float(seqeval_f1(references, predictions)),
        "accuracy": float(seqeval_accuracy(references, predictions)),
    }
