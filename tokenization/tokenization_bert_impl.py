"""`BertImplTokenizer`: BERT's WordPiece tokenizer, assembled from `tokenizers` components as a transformers tokenizer.

The pipeline is the original BERT one, each step a `tokenizers` component:

1. `normalizers.BertNormalizer`: drop control characters and map whitespace to spaces, put spaces around CJK
   ideographs, and for uncased vocabularies lower-case and strip accents.
2. `pre_tokenizers.BertPreTokenizer`: split on whitespace and on every punctuation character.
3. `models.WordPiece`: greedy longest-match-first sub-words, continuations prefixed with `##`; a word longer than
   100 characters, or one that cannot be spelled with the vocabulary, becomes `[UNK]`.
4. `processors.TemplateProcessing`: `[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]`, token type ids 0 for the first
   segment and 1 for the second.
5. `decoders.WordPiece`: joins `##` continuations back onto their word.

Batching, padding, truncation, offsets, overflowing windows, `word_ids()`, decoding, saving and vocabulary training
come from transformers' `TokenizersBackend`.

This file must stay self-contained: it imports only the standard library, `tokenizers` and `transformers`.
`save_pretrained` copies it into the saved folder (the package registers the class for `AutoTokenizer`), so that
`AutoTokenizer.from_pretrained(folder, trust_remote_code=True)` works where bert-impl is not installed.
"""

import json
import os

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece
from transformers import TokenizersBackend

VOCAB_FILES_NAMES = {"vocab_file": "vocab.txt", "tokenizer_file": "tokenizer.json"}

# Words longer than this become the unknown token, as in the original BERT.
MAX_INPUT_CHARS_PER_WORD = 100

# `BertNormalizer` option in a tokenizer.json -> the `BertImplTokenizer` argument it corresponds to.
_NORMALIZER_OPTIONS = {
    "lowercase": "do_lower_case",
    "strip_accents": "strip_accents",
    "handle_chinese_chars": "tokenize_chinese_chars",
}


class BertImplTokenizer(TokenizersBackend):
    r"""
    BERT's WordPiece tokenizer (uncased or cased), running on the `tokenizers` library.

    Load one with `BertImplTokenizer.from_pretrained(folder)` from any BERT tokenizer folder (a `vocab.txt`, a
    `tokenizer.json`, or both, usually with a `tokenizer_config.json`), or build one from a vocabulary.

    Args:
        vocab (`str`, `os.PathLike` or `dict[str, int]`, *optional*):
            The vocabulary: the path of a `vocab.txt` (one token per line, the line number is the id) or a
            token -> id mapping. Without it (nor `vocab_file`) the vocabulary holds the five special tokens only,
            which is the starting point for [`~TokenizersBackend.train_new_from_iterator`].
        do_lower_case (`bool`, *optional*, defaults to `True`):
            Lower-case the input (uncased vocabularies). Set to `False` for cased vocabularies.
        unk_token, sep_token, pad_token, cls_token, mask_token (`str`, *optional*):
            The special tokens, by default `[UNK]`, `[SEP]`, `[PAD]`, `[CLS]` and `[MASK]`.
        tokenize_chinese_chars (`bool`, *optional*, defaults to `True`):
            Split CJK ideographs into one word each.
        strip_accents (`bool`, *optional*):
            Strip accents. By default accents are stripped exactly when `do_lower_case` is set, as in the original BERT.
        vocab_file (`str`, *optional*):
            The path of a `vocab.txt`, used when `vocab` is not given.
    """

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    model = WordPiece

    def __init__(
        self,
        vocab: str | os.PathLike | dict[str, int] | None = None,
        do_lower_case: bool = True,
        unk_token: str = "[UNK]",
        sep_token: str = "[SEP]",
        pad_token: str = "[PAD]",
        cls_token: str = "[CLS]",
        mask_token: str = "[MASK]",
        tokenize_chinese_chars: bool = True,
        strip_accents: bool | None = None,
        vocab_file: str | None = None,
        **kwargs,
    ):
        self.do_lower_case = do_lower_case
        self.tokenize_chinese_chars = tokenize_chinese_chars
        self.strip_accents = strip_accents
        special_tokens = [str(token) for token in (pad_token, unk_token, cls_token, sep_token, mask_token)]
        self._tokenizer = Tokenizer(
            _wordpiece_model(vocab if vocab is not None else vocab_file, str(unk_token), special_tokens)
        )
        self._tokenizer.normalizer = normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=tokenize_chinese_chars,
            strip_accents=strip_accents,
            lowercase=do_lower_case,
        )
        self._tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tokenizer.decoder = decoders.WordPiece(prefix="##")
        # The base class may swap in a complete backend (`tokenizer_object`/`tokenizer_file`, e.g. after training) and
        # registers the special tokens, so the template is set afterwards, with the ids the final backend gives them.
        super().__init__(
            vocab_file=vocab_file,
            do_lower_case=do_lower_case,
            unk_token=unk_token,
            sep_token=sep_token,
            pad_token=pad_token,
            cls_token=cls_token,
            mask_token=mask_token,
            tokenize_chinese_chars=tokenize_chinese_chars,
            strip_accents=strip_accents,
            **kwargs,
        )
        self._tokenizer.post_processor = self._bert_template()

    def _bert_template(self) -> processors.TemplateProcessing:
        """`[CLS] A [SEP]` for one sequence, `[CLS] A [SEP] B [SEP]` for a pair; type ids 0 for A, 1 for B."""
        cls, sep = str(self.cls_token), str(self.sep_token)
        return processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0",
            pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, self.cls_token_id), (sep, self.sep_token_id)],
        )

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        """Write `vocab.txt` (one token per line, the line number is the id) from the WordPiece model in use."""
        return tuple(self._tokenizer.model.save(str(save_directory), prefix=filename_prefix))

    def _save_pretrained(self, save_directory, file_names, legacy_format=None, filename_prefix=None):
        """Save `tokenizer.json` (base class) and, unless `legacy_format=False`, BERT's `vocab.txt` beside it."""
        file_names = super()._save_pretrained(save_directory, file_names, legacy_format, filename_prefix)
        if legacy_format is False:
            return file_names
        return file_names + self.save_vocabulary(save_directory, filename_prefix)

    @classmethod
    def convert_to_native_format(cls, trust_remote_code=False, **kwargs):
        """
        `from_pretrained` hook: turn the files found in the folder into `__init__` arguments.

        The base class reads the vocabulary (from `tokenizer.json` when there is one, else the `vocab.txt` path).
        On top of it: the lower-casing, accent and CJK settings of a `tokenizer.json`'s `BertNormalizer` are used
        where `tokenizer_config.json` (or the caller) does not set them, so that a folder with only a cased
        `tokenizer.json` stays cased; and a folder with no vocabulary at all is an error, not a tokenizer that knows
        five tokens.
        """
        tokenizer_file = kwargs.get("tokenizer_file")
        if tokenizer_file is not None and os.path.isfile(tokenizer_file):
            for name, value in _bert_normalizer_options(tokenizer_file).items():
                kwargs.setdefault(name, value)
        kwargs = super().convert_to_native_format(trust_remote_code=trust_remote_code, **kwargs)
        if kwargs.get("vocab") is None and kwargs.get("tokenizer_file") is None:
            raise ValueError(
                f"No BERT vocabulary in {kwargs.get('name_or_path')!r}: expected a vocab.txt or a tokenizer.json there."
            )
        return kwargs


def _wordpiece_model(vocab: str | os.PathLike | dict[str, int] | None, unk_token: str, special_tokens: list[str]):
    """A WordPiece model over `vocab` (a vocab.txt path or a token -> id dict; `None`: the special tokens only)."""
    if vocab is None:
        vocab = {token: index for index, token in enumerate(special_tokens)}
    if isinstance(vocab, dict):
        return WordPiece(vocab, unk_token=unk_token, max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD)
    path = os.fspath(vocab)
    if not os.path.isfile(path):
        raise ValueError(f"BERT vocabulary file not found: {path!r} (expected a vocab.txt, one token per line)")
    return WordPiece.from_file(path, unk_token=unk_token, max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD)


def _bert_normalizer_options(tokenizer_file: str) -> dict:
    """The `BertImplTokenizer` arguments set by the `BertNormalizer` of a tokenizer.json (empty if it has none)."""
    with open(tokenizer_file, encoding="utf-8") as handle:
        normalizer = json.load(handle).get("normalizer") or {}
    if normalizer.get("type") != "BertNormalizer":
        return {}
    return {argument: normalizer[option] for option, argument in _NORMALIZER_OPTIONS.items() if option in normalizer}


__all__ = ["BertImplTokenizer"]
