"""transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`, `TrainingTesterMixin`) run against all
eight bert-impl classes, and against the six of each of BERT's descendants (RoBERTa, XLM-RoBERTa, CamemBERT: marked
slow, CI's first pass runs them): the contract every transformers model is held to, checked by transformers' code.

The tests ship in the transformers sdist (not the wheel): `python tests/fetch_transformers_tests.py`, a step of the
README's test command, fetches those of the INSTALLED version once; this module imports them from there, and is
skipped, saying so, where they were not fetched. `parameterized`, which they import, is a `dev` extra.

`BertImplModelTester` follows transformers' `BertModelTester` (tests/models/bert/test_modeling_bert.py), at small
sizes to keep the module fast, and its RoBERTa counterpart (`RobertaModelTester`: the same sizes and inputs, RoBERTa's
padding id). Deselected tests are listed in `DESELECTED`, each with its reason. BERT and each family skip the same
tests. One of the mixin's own skips is ours to answer: test_can_capture_specific_layers_hidden_states runs only where
hooks record the hidden states (`_can_record_outputs`), and our encoder collects them itself (re-padded from the
padding-free rows); tests/test_stock_contract.py checks the same selection by index against stock's classes.
"""

import sys
import unittest
from unittest import mock

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

import modeling_bert_impl as bi
from modeling_bert_impl import AUTO_CLASSES, BertImplConfig, FAMILIES

import fetch_transformers_tests  # noqa: E402

if not fetch_transformers_tests.fetched():
    pytest.skip(f"transformers' common tests for {transformers.__version__} are not fetched: run `python tests/fetch_transformers_tests.py`"
                " (the README's test command does)", allow_module_level=True)
sys.path.insert(0, str(fetch_transformers_tests.tests_folder()))

from hf_common_tests.test_configuration_common import ConfigTester  # noqa: E402
from hf_common_tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask  # noqa: E402
from hf_common_tests.test_training_mixin import TrainingTesterMixin  # noqa: E402

ALL_MODEL_CLASSES = tuple(AUTO_CLASSES.values())
# The mixin tells heads apart by transformers' tables of class names per task (model_type -> class name); an
# in-library model is listed there, so ours are listed too while a test runs.
NAME_TABLES = {
    "AutoModel": modeling_auto.MODEL_MAPPING_NAMES,
    "AutoModelForPreTraining": modeling_auto.MODEL_FOR_PRETRAINING_MAPPING_NAMES,
    "AutoModelForMaskedLM": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "AutoModelForNextSentencePrediction": modeling_auto.MODEL_FOR_NEXT_SENTENCE_PREDICTION_MAPPING_NAMES,
    "AutoModelForSequenceClassification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForTokenClassification": modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForQuestionAnswering": modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    "AutoModelForMultipleChoice": modeling_auto.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES,
}


class BertImplModelTester:
    """transformers' BertModelTester for our classes: a random small config and a randomly padded batch. The same for
    a family of BERT's descendants with its `config_class` and masked LM (transformers' RobertaModelTester has the
    same sizes and inputs)."""

    def __init__(self, parent, batch_size=5, seq_length=7, is_training=True, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64,
                 type_vocab_size=16, num_choices=4, config_class=BertImplConfig, masked_lm=bi.BertImplForMaskedLM,
                 first_id=0):
        self.parent, self.config_class, self.first_id = parent, config_class, first_id
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.intermediate_size, self.max_position_embeddings = intermediate_size, max_position_embeddings
        self.type_vocab_size, self.num_choices = type_vocab_size, num_choices
        # The head TrainingTesterMixin overfits with labels = input_ids (its hook is named for causal LMs): our MLM,
        # every position a target.
        self.causal_lm_class = masked_lm

    def get_config(self):
        return self.config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
            max_position_embeddings=self.max_position_embeddings, type_vocab_size=self.type_vocab_size,
            initializer_range=0.02,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - self.first_id) + self.first_id
        input_mask = random_attention_mask([self.batch_size, self.seq_length])
        token_type_ids = ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size)
        return self.get_config(), input_ids, token_type_ids, input_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": input_mask}


# test name -> why it does not run here.
DESELECTED = {
    "test_reverse_loading_mapping": "our folders store our own parameter names (Trainer's resume loads a checkpoint's "
    "state dict as it is); stock names are written by save_stock_pretrained, tested in test_modeling.py",
}


class BertImplModelTest(ModelTesterMixin, TrainingTesterMixin, unittest.TestCase):
    all_model_classes = ALL_MODEL_CLASSES
    model_split_percents = [0.5, 0.8, 0.9]
    # test_can_init_all_missing_weights (every weight initialised by _init_weights, as in __init__) skips models whose
    # config file has no "# Copyright <year>" of 2023 or later ("Not a prioritized model") unless this is set.
    test_can_init_all_missing_weights_before_2023 = True
    config_class, auto_classes = BertImplConfig, AUTO_CLASSES
    tester: dict = {}  # BertImplModelTester's arguments beyond BERT's

    def setUp(self):
        if self._testMethodName in DESELECTED:
            self.skipTest(DESELECTED[self._testMethodName])
        # Tiny models: one thread computes them as fast, and far faster when the cores are shared.
        self.addCleanup(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(1)
        # Some tests read transformers' warnings: its default verbosity, whatever an earlier test module set.
        self.addCleanup(transformers.logging.set_verbosity, transformers.logging.get_verbosity())
        transformers.logging.set_verbosity_warning()
        for auto, table in NAME_TABLES.items():
            if auto in self.auto_classes:
                patcher = mock.patch.dict(table, {self.config_class.model_type: self.auto_classes[auto].__name__})
                patcher.start()
                self.addCleanup(patcher.stop)
        self.model_tester = BertImplModelTester(self, config_class=self.config_class,
                                                masked_lm=self.auto_classes["AutoModelForMaskedLM"], **self.tester)
        # hidden_size: any value away from the default (transformers' BERT test takes 37, which our config refuses
        # with 12 heads: the heads must divide it).
        self.config_tester = ConfigTester(self, config_class=self.config_class, hidden_size=48)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        """As transformers' BertModelTest: the pre-training head gets both its labels."""
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class is bi.BertImplForPreTraining:
            B, T = self.model_tester.batch_size, self.model_tester.seq_length
            inputs["labels"] = torch.zeros((B, T), dtype=torch.long)
            inputs["next_sentence_label"] = torch.zeros(B, dtype=torch.long)
        return inputs

    def test_config(self):
        self.config_tester.run_common_tests()


def family_test(classes: dict) -> type:
    """The test case above for a family of BERT's descendants (its classes by Auto class), marked slow: they run
    BERT's encoder, heads and code again under other names, and CI's first pass runs them. Their positions run from
    padding_idx + 1 (so 66 of them for the 64 tokens of test_training_overfit, as the checkpoints' 514 for 512), and
    are counted over the ids that are not the padding id, so the random ids leave it out (a tokenizer pads with it; on
    ids holding it test_inputs_embeds_matches_input_ids would compare two sets of positions, as on stock RoBERTa)."""
    name = f"{classes['AutoModel'].__name__}Test"
    config_class = classes["AutoModel"].config_class
    first = config_class().pad_token_id + 1  # the first position, and the first id the random ids take
    tester = {"max_position_embeddings": 64 + first, "first_id": first}
    attributes = {"all_model_classes": tuple(classes.values()), "auto_classes": classes, "config_class": config_class,
                  "tester": tester, "__module__": __name__, "__qualname__": name}
    return pytest.mark.slow(type(name, (BertImplModelTest,), attributes))


RobertaImplModelTest, XLMRobertaImplModelTest, CamembertImplModelTest = map(family_test, FAMILIES.values())
