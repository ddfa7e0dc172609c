"""The one task-to-head table of bert-impl's integrations: for each head (by its Auto class, the keys of the model
file's `AUTO_CLASSES`), the task name `bert-impl-export --task` takes and the Hub's pipeline tag its model card
carries. export.py and model_card.py read it; the classes themselves come from `AUTO_CLASSES`."""

from ..modeling_bert_impl import AUTO_CLASSES
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


def head_class(task: str) -> type:
    """Our class for a task: "text-classification" -> BertImplForSequenceClassification."""
    return AUTO_CLASSES[TASKS[task]]


def auto_class_of(architecture: str) -> str | None:
    """The Auto class of a head named as ours or as stock BERT's ("BertImplForMaskedLM" or "BertForMaskedLM" ->
    "AutoModelForMaskedLM"); None for a name that is neither."""
    for auto, cls in AUTO_CLASSES.items():
        if architecture in (cls.__name__, stock_name(cls)):
            return auto
    return None
