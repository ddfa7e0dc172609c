"""PEFT on bert-impl as on stock BERT.

The module names are stock BERT's, so an adapter trained on either model loads on the other with peft's own
`PeftModel.from_pretrained`, for every peft method, with no conversion. What is left to do here:

- Default `target_modules`: peft picks them by model_type from its `TRANSFORMERS_MODELS_TO_*` tables; "bert_impl"
  gets the "bert" entry of each, so `LoraConfig(task_type="SEQ_CLS")` and the rest work without `target_modules`.
- Poly and Lily compute over the (B, T, H) layout (Poly mixes its LoRA modules per example, Lily averages its
  router over every position of the batch, padding included): they switch the model to padded batches.

Registered when this package is imported, if peft is installed.
"""

from transformers.utils import logging

from ..modeling_bert_impl import BertImplPreTrainedModel

logger = logging.get_logger(__name__)


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
    """Give "bert_impl" every "bert" default in peft's tables, and make the methods that need the (B, T, H) layout run
    our models on padded batches (`_padded_for`)."""
    for table in _tables_with_bert():
        table.setdefault("bert_impl", list(table["bert"]))
    for module, tuner, why in PADDED_LAYOUT_TUNERS:
        _padded_for(module, tuner, why)


# peft methods whose layers compute over the batch's (B, T, H) layout, so that the padding-free (P, H) rows of real
# tokens would change their answers: (module, tuner class, why)
PADDED_LAYOUT_TUNERS = [
    ("peft.tuners.poly", "PolyModel", "Poly routes each example through its own mix of LoRA modules"),
    ("peft.tuners.lily", "LilyModel", "Lily averages its router's probabilities over every position of the batch, "
                                      "padding included"),
]


def _padded_for(module: str, tuner: str, why: str) -> None:
    """When peft injects this method into one of our models, the model switches to the padded path
    (`config.unpad_inputs = False`: stock BERT's layout, so stock's answers), with a warning saying `why`. Nothing
    when the installed peft lacks the method."""
    import importlib

    try:
        tuner_class = getattr(importlib.import_module(module), tuner)
    except (ImportError, AttributeError):
        return
    original = tuner_class._pre_injection_hook
    if getattr(original, "_bert_impl", False):
        return

    def hook(self, model, config, adapter_name):
        if isinstance(model, BertImplPreTrainedModel) and model.config.unpad_inputs is not False:
            logger.warning(f"{why}: the model now runs on padded batches (config.unpad_inputs=False)")
            model.config.unpad_inputs = False
        return original(self, model, config, adapter_name)

    hook._bert_impl = True
    tuner_class._pre_injection_hook = hook
