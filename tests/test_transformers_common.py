"""transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`, `TrainingTesterMixin`) run against all
eight bert-impl classes: the contract every transformers model is held to, checked by transformers' code.

The tests ship in the transformers sdist (not the wheel): `python tests/fetch_transformers_tests.py`, a step of the
README's test command, fetches those of the INSTALLED version once; this module imports them from there, and is
skipped, saying so, where they were not fetched. `parameterized`, which they import, is a `dev` extra.

`BertImplModelTester` follows transformers' `BertModelTester` (tests/models/bert/test_modeling_bert.py), at small
sizes to keep the module fast. Deselected tests are listed in `DESELECTED`, each with its reason.
"""

import sys
import unittest
from unittest import mock

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

import modeling_bert_impl as bi
from modeling_bert_impl import AUTO_CLASSES, BertImplConfig

from fetch_transformers_tests import VERSION, fetched, tests_folder  # noqa: E402

if not fetched():
    pytest.skip(f"transformers' common tests for {VERSION} are not fetched: run `python tests/fetch_transformers_tests.py`"
                " (the README's test command does)", allow_module_level=True)
sys.path.insert(0, str(tests_folder()))

