"""Reading a user's data files, checked first, so that a bad file gets an error naming the file, the line and what to
change (instead of what the `datasets` loaders report): text corpora (`text_chunks`, `read_text`), tables (CSV, TSV,
JSON, JSON lines: `read_table`), and where rows are for an error message (`locate`, `refuse_rows`)."""

import codecs
import csv
import json
import os

import datasets

TABLE_EXTENSIONS = ("csv", "tsv", "json", "jsonl")
CHUNK_BYTES = 1 << 20  # what `text_chunks` reads at a time


def text_chunks(path: str, chunk_bytes: int = CHUNK_BYTES):
    """The text of a UTF-8 file, decoded a chunk at a time (memory: one chunk, whatever the file's size); a ValueError
    naming the file (and, for bytes that are not UTF-8, the line and the column) when it is missing, empty (nothing but
    whitespace) or not UTF-8. The errors come as the reading reaches them: read to the end before trusting the file."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    decoder = codecs.getincrementaldecoder("utf-8")()
    start, lines, line_start, has_text = 0, 0, 0, False  # offset of the chunk; newlines and last line's start before it
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                # error.object: the bytes of an unfinished character held back from the last chunk, then this chunk
                bad = start - (len(error.object) - len(chunk)) + error.start
                before = chunk[:max(bad - start, 0)]  # a held-back byte is never a newline
                if b"\n" in before:
                    lines, line_start = lines + before.count(b"\n"), start + before.rfind(b"\n") + 1
                raise ValueError(f"{path}, line {lines + 1}, column {bad - line_start + 1}: byte "
                                 f"{error.object[error.start]:#04x} is not UTF-8; save the file as UTF-8 (e.g. "
                                 "`iconv -f latin1 -t utf-8 old > new`)") from None
            if not chunk:
                break
            lines += chunk.count(b"\n")
            if b"\n" in chunk:
                line_start = start + chunk.rfind(b"\n") + 1
            start += len(chunk)
            has_text = has_text or bool(text.strip())
            yield text
    if not has_text:
        raise ValueError(f"{path}: the file is empty")


def check_text_file(path: str) -> None:
    """`text_chunks`' checks, by reading the file through once without keeping it (for corpora of any size)."""
    for _ in text_chunks(path):
        pass


def read_text(path: str) -> str:
    """The text of a UTF-8 file; a ValueError naming the file (and the line) when it is missing, empty or not UTF-8
    (`text_chunks`)."""
    return "".join(text_chunks(path))


def csv_rows(path: str, text: str):
    """(line number, fields) of each row of a CSV (or, .tsv, GLUE's tab-separated unquoted) file, header first; blank
    lines skipped, as the loader skips them."""
    dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if path.lower().endswith(".tsv") else {}
    reader = csv.reader(text.splitlines(keepends=True), **dialect)
    end = 0
    for fields in reader:
        start, end = end + 1, reader.line_num
        if fields:
            yield start, fields


def json_records(path: str, text: str):
    """(line number or None, record) of a JSON file holding a list of objects, or of a JSON-lines file (one object per
    line); a ValueError naming the line when one is not a JSON object."""
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {error.lineno}, column {error.colno}: not valid JSON ({error.msg})") from None
        lines = [None] * len(records)
    else:
        numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        records, lines = [], []
        for n, line in numbered:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                cut = " (the file looks cut off)" if n == numbered[-1][0] else ""
                raise ValueError(f"{path}, line {n}, column {error.colno}: not a complete JSON object ({error.msg}){cut}; "
                                 "a JSON-lines file holds one JSON object per line") from None
            lines.append(n)
    for n, (line, record) in enumerate(zip(lines, records)):
        if not isinstance(record, dict):
            where = f"line {line}" if line else f"record {n + 1}"
            raise ValueError(f"{path}, {where}: expected a JSON object of named fields, got {type(record).__name__}")
    return zip(lines, records)


def check_table(path: str) -> None:
    """A ValueError naming the file and the line for what the `datasets` loaders would only report as "An error
    occurred while generating the dataset": a missing, empty or non-UTF-8 file, a CSV row whose number of fields is
    not the header's, a line of a JSON-lines file that is not one complete JSON object."""
    text = read_text(path)
    if path.rsplit(".", 1)[-1].lower() in ("csv", "tsv"):
        rows = csv_rows(path, text)
        _, header = next(rows)
        count = 0
        for line, fields in rows:
            count += 1
            if len(fields) != len(header):
                hint = "quote the fields that contain a comma" if path.lower().endswith(".csv") else \
                    "a text field must not contain a tab"
                raise ValueError(f"{path}, line {line}: {len(fields)} fields, but the header line has {len(header)} "
                                 f"({', '.join(header)}); {hint}, or fill in the missing fields")
        if not count:
            raise ValueError(f"{path}: a header line but no rows")
    else:
        if not any(True for _ in json_records(path, text)):
            raise ValueError(f"{path}: no records")


def read_table(path: str) -> datasets.Dataset:
    """A CSV, TSV (tab-separated, unquoted: GLUE's original files), JSON (a list of objects) or JSON-lines file as a
    Dataset, checked first (`check_table`)."""
    extension = path.rsplit(".", 1)[-1].lower()
    if extension not in TABLE_EXTENSIONS:
        raise ValueError(f"{path}: expected a .csv, .tsv, .json or .jsonl file")
    check_table(path)
    try:
        if extension == "tsv":
            return datasets.load_dataset("csv", data_files=path, delimiter="\t", quoting=csv.QUOTE_NONE,
                                         split="train")
        if extension == "csv":
            return datasets.load_dataset("csv", data_files=path, split="train")
        return datasets.load_dataset("json", data_files=path, split="train")
    except datasets.exceptions.DatasetGenerationError as error:  # what check_table does not foresee
        raise ValueError(f"{path}: could not be read: {error.__cause__ or error}") from error


def locate(path: str, indices: list[int]) -> list[str]:
    """Where rows `indices` (0-based, in file order) of a data file are: "FILE, line N" (CSV, TSV, JSON lines) or
    "FILE, record N" (a JSON list). Re-reads the file: for error messages only."""
    if path.rsplit(".", 1)[-1].lower() in ("csv", "tsv"):
        rows = csv_rows(path, read_text(path))
        next(rows)  # the header
    else:
        rows = json_records(path, read_text(path))
    lines = dict(enumerate(line for line, _ in rows))
    return [f"{path}, line {lines[i]}" if lines.get(i) else f"{path}, record {i + 1}" for i in indices]


def refuse_rows(path: str, rows: list[int], problem: str, advice: str) -> None:
    """A ValueError for the rows (indices) of file `path` that have `problem`: how many, where the first few are."""
    if rows:
        where = "; ".join(locate(path, rows[:5])) + ("; ..." if len(rows) > 5 else "")
        raise ValueError(f"{len(rows)} row(s) {problem}: {where}. {advice}")
