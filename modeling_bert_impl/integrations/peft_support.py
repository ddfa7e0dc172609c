"""PEFT on bert-impl as on stock BERT.

The module names are stock BERT's, so an adapter trained on either model loads on the other with peft's own
`PeftModel.from_pretrained`, for every peft method, with no conversion. What is left to do here:

- Default `target_modules`: peft picks them by model_type from its `TRANSFORMERS_MODELS_TO_*` tables; "bert_impl"
  gets the "bert" entry of each, so `LoraConfig(task_type="SEQ_CLS")` and the rest work without `target_modules`.

Registered by calling `register_peft_defaults()` (peft has no API for a model type's defaults: its tables are module
dicts, so registering changes them for the process, which an import should not do behind the user's back). Without
it, peft asks for `target_modules`. (Poly and Lily, whose layers compute over the whole (B, T, H) batch, need nothing
here: a call with their layers in the encoder runs the padded layout.)
"""


def _tables_with_bert() -> list[dict]:
    """peft's model_type -> default modules tables that have a "bert" entry (none when peft is not installed)."""
    try:
        from peft.utils import constants
    except ImportError:
        return []
    return [
        table for name, table in vars(constants).items()
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and isinstance(table.get("bert"), list)
    ]


def register_peft_defaults() -> None:
    """Give "bert_impl" every "bert" default in peft's tables (nothing without peft; calling it again changes nothing),
    so that a peft config without `target_modules` targets stock BERT's modules on bert-impl too."""
    for table in _tables_with_bert():
        table.setdefault("bert_impl", list(table["bert"]))
