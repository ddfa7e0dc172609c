"""PEFT on bert-impl as on stock BERT.

The module names are stock BERT's, so an adapter trained on either model loads on the other with peft's own
`PeftModel.from_pretrained`, for every peft method, with no conversion. What is left to do here:

- Default `target_modules`: peft picks them by model_type from its `TRANSFORMERS_MODELS_TO_*` tables; "bert_impl"
  gets the "bert" entry of each, so `LoraConfig(task_type="SEQ_CLS")` and the rest work without `target_modules`.
- Poly mixes its LoRA modules per example, which needs the (B, T, H) layout: it switches the model to padded batches.

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
    """Give "bert_impl" every "bert" default in peft's tables, and make Poly adapters run our models on padded
    batches (`_padded_for_poly`)."""
    for table in _tables_with_bert():
        table.setdefault("bert_impl", list(table["bert"]))
    _padded_for_poly()


def _padded_for_poly() -> None:
    """Poly mixes its LoRA modules per example (by `task_ids`), so its layers need (B, T, H) inputs, which the
    padding-free path (the tokens of all examples in one (P, H) matrix) does not give. When peft injects Poly into one
    of our models, the model switches to the padded path (`config.unpad_inputs = False`, same outputs), with a
    warning."""
    try:
        from peft.tuners.poly import PolyModel
    except ImportError:
        return
    original = PolyModel._pre_injection_hook
    if getattr(original, "_bert_impl", False):
        return

    def hook(self, model, config, adapter_name):
        if isinstance(model, BertImplPreTrainedModel) and model.config.unpad_inputs:
            logger.warning("Poly routes each example through its own mix of LoRA modules: the model now runs on "
                           "padded batches (config.unpad_inputs=False)")
            model.config.unpad_inputs = False
        return original(self, model, config, adapter_name)

    hook._bert_impl = True
    PolyModel._pre_injection_hook = hook
