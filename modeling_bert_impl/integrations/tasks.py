"""The one task-to-head table of bert-impl's integrations: for each head (by its Auto class, the keys of the model
file's `AUTO_CLASSES`), the task name `bert-impl-export --task` takes and the Hub's pipeline tag its model card
carries. export.py and model_card.py read it; the classes themselves come from `AUTO_CLASSES` for BERT, and from
each family's table for BERT's descendants (`classes_of`)."""

from ..modeling_bert_impl import AUTO_CLASSES
from ..modeling_roberta_impl import FAMILIES
from ..stock_format import stock_name

# Auto class -> (task, the Hub's pipeline tag for that head; None where the Hub has no task for it)
HEADS = {
    "AutoModel": ("feature-extraction", "feature-extraction"),
    "AutoModelForPreTraining": ("pretraining", "fill-mask"),
    "AutoModelForMaskedLM": ("fill-mask", "fill-mask"),
    "AutoModelForNextSentencePrediction": ("next-sentence-prediction", None),
    "AutoModelForSequenceClassification": ("text-classification", "text-classification"),
    "AutoModelForTokenClassification": ("token-classification", "token-classification"),
    "AutoModelForQuestionAnswering": ("question-answering", "question-answering"),
    "AutoModelForMultipleChoice": ("multiple-choice", "multiple-choice"),
}
if HEADS.keys() != AUTO_CLASSES.keys():  # a head added to the model file must get its task here
    raise ImportError(f"integrations/tasks.py: HEADS covers {sorted(HEADS)}, AUTO_CLASSES {sorted(AUTO_CLASSES)}")

TASKS = {task: auto for auto, (task, _) in HEADS.items()}  # task -> Auto class
PIPELINE_TAGS = {auto: tag for auto, (_, tag) in HEADS.items()}  # Auto class -> the Hub's pipeline tag


# model type, ours or its stock family's -> our classes by Auto class
CLASSES_OF = {"bert": AUTO_CLASSES, "bert_impl": AUTO_CLASSES}
for _stock_type, _classes in FAMILIES.items():
    CLASSES_OF[_stock_type] = CLASSES_OF[_classes["AutoModel"].config_class.model_type] = _classes


def classes_of(model_type: str) -> dict[str, type]:
    """Our classes by Auto class for a model type ("bert" or "bert_impl": BERT's; "xlm-roberta" or
    "xlm_roberta_impl": XLM-RoBERTa's, ...); a ValueError naming those there are for any other."""
    if model_type not in CLASSES_OF:
        raise ValueError(f"model_type {model_type!r} is not a model bert-impl runs; it runs {', '.join(CLASSES_OF)}")
    return CLASSES_OF[model_type]


def head_class(task: str, model_type: str = "bert_impl") -> type:
    """Our class for a task of a model type: "text-classification" -> BertImplForSequenceClassification (for
    "roberta": RobertaImplForSequenceClassification); a ValueError where the family has no such head."""
    classes = classes_of(model_type)
    if TASKS[task] not in classes:
        raise ValueError(f"{model_type} models have no {task} head; they have "
                         f"{', '.join(HEADS[auto][0] for auto in classes)}")
    return classes[TASKS[task]]


def auto_class_of(architecture: str) -> str | None:
    """The Auto class of a head named as ours or as stock's, of any family ("BertImplForMaskedLM" or
    "XLMRobertaForMaskedLM" -> "AutoModelForMaskedLM"); None for a name that is neither."""
    for classes in CLASSES_OF.values():
        for auto, cls in classes.items():
            if architecture in (cls.__name__, stock_name(cls)):
                return auto
    return None
