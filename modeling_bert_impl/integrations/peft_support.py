"""PEFT on bert-impl as on stock BERT and its descendants.

The module names are stock's, so an adapter trained on either model loads on the other with peft's own
`PeftModel.from_pretrained`, for every peft method, with no conversion. What is left to do here: default
`target_modules`. peft picks them by model_type from its `TRANSFORMERS_MODELS_TO_*` tables, which know "bert",
"roberta" and "xlm-roberta" but not ours; so each of our model types gets its stock family's entry of each table
(`DEFAULTS_FROM`), and `LoraConfig(task_type="SEQ_CLS")` works without `target_modules` on bert-impl as on stock.

peft has no API for a model type's defaults (its tables are module dicts), and a stock user's code never called one:
importing this package fills the tables itself, additively (an entry peft has is never changed), at once if peft is
imported already, else right after peft imports them (`fill_when_imported`: a one-shot import hook, gone after it
fired), so that importing bert-impl costs nothing where peft is not used. (Poly and Lily, whose layers compute over
the whole (B, T, H) batch, need nothing here: a call with their layers in the encoder runs the padded layout.)
"""

import importlib.abc
import importlib.util
import sys

TABLES = "peft.utils.constants"  # the module of peft's tables
# our model type -> the stock model types whose entry it takes, the first peft has (CamemBERT is RoBERTa's
# architecture: peft lists no "camembert", and some tables no "xlm-roberta")
DEFAULTS_FROM = {"bert_impl": ("bert",), "roberta_impl": ("roberta",), "xlm_roberta_impl": ("xlm-roberta", "roberta"),
                 "camembert_impl": ("camembert", "roberta")}


def fill_tables(constants) -> None:
    """Give each of our model types its stock family's entry in every one of peft's tables that has one; entries
    already there (peft's, or an earlier fill's) stay as they are."""
    for name, table in vars(constants).items():
        if not (name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict)):
            continue
        for ours, stock in DEFAULTS_FROM.items():
            entry = next((table[s] for s in stock if isinstance(table.get(s), list)), None)
            if entry is not None:
                table.setdefault(ours, list(entry))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds peft's tables module once, through the finders after it, and fills the tables when it has run."""

    def find_spec(self, name, path, target=None):
        if name != TABLES:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module
            spec.loader.exec_module = lambda module: (run(module), fill_tables(module))
        return spec


def fill_when_imported() -> None:
    """Fill peft's tables now if peft imported them, else once it does; nothing where peft is not installed."""
    if TABLES in sys.modules:
        fill_tables(sys.modules[TABLES])
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def register_peft_defaults() -> None:
    """Fill peft's tables now (what importing the package does anyway, kept for code written when this was a call of
    its own; nothing without peft; calling it again changes nothing)."""
    try:
        from peft.utils import constants
    except ImportError:
        return
    fill_tables(constants)
