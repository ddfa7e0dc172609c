"""One call that makes existing BERT code run bert-impl: `apply_bert_impl()` (and `revert_bert_impl()` to undo).

The way Liger Kernel's `apply_liger_kernel_to_*` patches transformers, but at the Auto classes: after the call,
`AutoModel`, `AutoModelForSequenceClassification` and every other Auto class with a bert-impl head (so also
`pipeline(...)`, sentence-transformers and PEFT, which load through them) build our classes for stock checkpoints of
BERT and of its descendants (`FAMILIES`: model types "bert", "roberta", "xlm-roberta", "camembert").
`AutoModelForCausalLM` (as a decoder) keeps transformers' class.

What such a model is:
- our class (`isinstance(model, BertImplForSequenceClassification)`), carrying the stock config it was given
  (a `BertConfig`, model_type "bert"; a `RobertaConfig`, ...), to which two fields of ours are added when absent:
  `unpad_inputs=None` (the padding-free encoder, unless code of the user's looks inside it) and
  `sparse_prediction=False` (stock BERT's output contract: full (B, T, V) MLM logits with labels);
- saved in the stock format: `save_pretrained` / `push_to_hub` write the (stock) parameter names, `architectures`
  naming the stock class, no fields, code files or `auto_map` of ours, so the folder still loads in plain
  transformers;
- a stock config that bert-impl does not implement (`is_decoder`, cross-attention, relative position embeddings)
  still gets transformers' class;
- its modules are bert-impl's classes (`BertImplSelfOutput` where stock has `BertSelfOutput` or `RobertaSelfOutput`),
  so a patch of transformers' own class does not reach it: said once when such a model is loaded
  (`patched_stock_classes`).

Our own `bert_impl` folders are untouched by the call (they load into our classes either way).
"""

import os

import importlib

from torch import nn
import transformers
from transformers import BertConfig, CamembertConfig, PreTrainedModel, RobertaConfig, XLMRobertaConfig
from transformers.models.auto import modeling_auto
from transformers.models.auto.auto_factory import _BaseAutoModelClass
from transformers.utils import logging

from ..configuration_bert_impl import check_supported
from ..modeling_bert_impl import AUTO_CLASSES
from ..modeling_roberta_impl import FAMILIES
from ..stock_format import OUR_FIELDS, stock_name, write_stock_config
from ..stock_format import STOCK_FAMILIES as CLASS_PREFIXES

logger = logging.get_logger(__name__)
TRANSFORMERS_FOLDER = os.path.dirname(transformers.__file__) + os.sep


# transformers' model type -> its config class and bert-impl's classes for it, by Auto class
STOCK_FAMILIES = {"bert": (BertConfig, AUTO_CLASSES), **{
    model_type: (config, FAMILIES[model_type]) for model_type, config in
    (("roberta", RobertaConfig), ("xlm-roberta", XLMRobertaConfig), ("camembert", CamembertConfig))}}


def implements(config) -> bool:
    """Whether bert-impl computes what this stock config describes (a bidirectional encoder, absolute positions)."""
    try:
        check_supported(config)
    except ValueError:
        return False
    return True


def patched_stock_classes() -> list[str]:
    """transformers' module classes of the four families whose `forward` is no longer one transformers wrote (a patch
    of the user's), by name. Told by the file the function's code is in, under transformers' folder (its decorators'
    wrappers included) or not: a wrapper made with functools.wraps keeps the names, not the code."""
    code_file = lambda f: getattr(getattr(f, "__code__", None), "co_filename", "")  # noqa: E731
    patched = []
    for config, _ in STOCK_FAMILIES.values():
        module = importlib.import_module(config.__module__.replace(".configuration_", ".modeling_"))
        patched += [name for name, cls in vars(module).items() if isinstance(cls, type) and issubclass(cls, nn.Module)
                    and cls.__module__ == module.__name__ and "forward" in cls.__dict__
                    and not code_file(cls.__dict__["forward"]).startswith(TRANSFORMERS_FOLDER)]
    return patched


def our_class_name(stock: str) -> str:
    """The bert-impl class a model built for `stock`'s place holds: the family's models (XLMRobertaModel ->
    XLMRobertaImplModel), RoBERTa's embeddings and heads for its descendants (XLMRobertaLMHead -> RobertaImplLMHead),
    BERT's layers for every family (RobertaSelfOutput -> BertImplSelfOutput)."""
    prefix = max((p for p in CLASS_PREFIXES if stock.startswith(p)), key=len, default="Bert")
    rest = stock[len(prefix):]
    if rest.startswith(("Model", "For")):
        return f"{prefix}Impl{rest}"
    roberta_own = prefix != "Bert" and rest.startswith(("Embeddings", "LMHead", "ClassificationHead"))
    return f"{'Roberta' if roberta_own else 'Bert'}Impl{rest}"


def say_stock_patches() -> None:
    """Once: which patched stock classes a model built by the patched Auto classes does not run."""
    patched = patched_stock_classes()
    if patched:
        ours = ", ".join(our_class_name(name) for name in patched)
        logger.warning_once(
            f"transformers' {', '.join(patched)} had its forward replaced, and apply_bert_impl() builds bert-impl's "
            f"classes, which that patch does not reach: patch bert-impl's {ours} (modeling_bert_impl) for the same "
            "change, or call revert_bert_impl() before loading to run transformers' classes")


class _OnStockConfig:
    """Mixed into each of our heads: the class Auto classes build for a stock config of its family once patched."""

    config_class: type  # the family's stock config (BertConfig, RobertaConfig, ...)
    _auto_class = None  # no code files, no auto_map in saved folders
    stock_name: str  # transformers' class of the same head, e.g. "BertForSequenceClassification"

    def __init__(self, config, *args, **kwargs):
        for field, default in OUR_FIELDS.items():
            if not hasattr(config, field):
                setattr(config, field, default)
        super().__init__(config, *args, **kwargs)

    @classmethod
    def _stock_class(cls):
        import transformers

        return getattr(transformers, cls.stock_name)

    @classmethod
    def from_pretrained(cls, *args, config=None, **kwargs):
        # Our config fields as keywords (`unpad_inputs=False`): BertConfig has no such fields, so they are set on the
        # loaded model's config (read at each forward) rather than passed on to its constructor.
        ours = {field: kwargs.pop(field) for field in OUR_FIELDS if field in kwargs}
        if config is not None and not implements(config):
            logger.info(f"bert-impl does not implement this config; loading transformers' {cls.stock_name}")
            return cls._stock_class().from_pretrained(*args, config=config, **kwargs)
        say_stock_patches()
        model = super().from_pretrained(*args, config=config, **kwargs)
        for field, value in ours.items():
            setattr(model.config, field, value)
        return model

    @classmethod
    def _from_config(cls, config, **kwargs):
        if not implements(config):
            return cls._stock_class()._from_config(config, **kwargs)
        say_stock_patches()
        return super()._from_config(config, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """The stock format, always: a stock config (see the module docstring); the weights' names are stock's."""
        PreTrainedModel.save_pretrained(self, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_stock_config(str(save_directory), self.stock_name)

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        # push_to_hub uploads from inside save_pretrained: fix the config first; transformers' card, not ours.
        write_stock_config(str(working_dir), self.stock_name)
        return PreTrainedModel._upload_modified_files(self, working_dir, *args, **kwargs)


def _on_stock_config(ours: type, config: type) -> type:
    name = f"{ours.__name__}On{config.__name__}"  # BertImplModelOnBertConfig, XLMRobertaImplModelOnXLMRobertaConfig
    return type(name, (_OnStockConfig, ours), {"config_class": config, "stock_name": stock_name(ours),
                                               "__module__": __name__, "__qualname__": name})


# stock class name -> the class patched Auto classes build for it
ON_STOCK_CONFIG = {}
for _config, _classes in STOCK_FAMILIES.values():
    for _ours in _classes.values():
        _cls = _on_stock_config(_ours, _config)
        globals()[_cls.__name__] = _cls  # importable by name, so that models pickle
        ON_STOCK_CONFIG[_cls.stock_name] = _cls

_saved: dict = {}  # (Auto class, stock config class) -> what its mapping held before the call (None: nothing)


def _auto_classes_with_our_heads():
    """(Auto class, stock config class, our class) for every transformers Auto class whose entry for a family's model
    type has a bert-impl equivalent."""
    for auto in vars(modeling_auto).values():
        if isinstance(auto, type) and issubclass(auto, _BaseAutoModelClass) and auto._model_mapping is not None:
            for model_type, (config, _) in STOCK_FAMILIES.items():
                stock = auto._model_mapping._model_mapping.get(model_type)
                if stock in ON_STOCK_CONFIG:
                    yield auto, config, ON_STOCK_CONFIG[stock]


def apply_bert_impl() -> None:
    """Make transformers' Auto classes (and so pipelines, sentence-transformers, PEFT) build bert-impl for stock
    checkpoints of BERT, RoBERTa, XLM-RoBERTa and CamemBERT, with the same outputs. Idempotent; `revert_bert_impl()`
    undoes it. Models saved afterwards are in the stock format."""
    for auto, config, cls in _auto_classes_with_our_heads():
        if (auto, config) not in _saved:
            _saved[auto, config] = auto._model_mapping._extra_content.get(config)
        auto.register(config, cls, exist_ok=True)


def revert_bert_impl() -> None:
    """Undo `apply_bert_impl()`: Auto classes build transformers' classes again. Models loaded meanwhile stay ours."""
    for (auto, config), previous in _saved.items():
        if previous is None:
            auto._model_mapping._extra_content.pop(config, None)
        else:
            auto._model_mapping._extra_content[config] = previous
    _saved.clear()
