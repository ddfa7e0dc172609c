"""Sharing on the Hub, without a network.

`FakeHub` stands in for the Hub's write API (`HfApi.create_repo`, `create_commit`, `create_branch`, `upload_folder`):
each commit becomes a snapshot in the local Hub cache layout (`models--org--name/snapshots/<commit>/`, `refs/main`),
which is exactly where `from_pretrained("org/name")` looks with `HF_HUB_OFFLINE=1`. So what `push_to_hub` uploads is
what a second user pulls by repo id: here in a Python that cannot import bert-impl (transformers' remote code), and in
one that can (our registered classes). With olah installed (`pip install olah`; `olah-cli` on PATH or named by
$OLAH_CLI) and git, a last test pulls the same commits over HTTP.
"""

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers
from transformers.utils import hub as transformers_hub
from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard, RepoUrl
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects
from safetensors import safe_open

import modeling_bert_impl as bi
from modeling_bert_impl import AUTO_CLASSES, BertImplConfig
from modeling_bert_impl.integrations.model_card import PIPELINE_TAGS, model_card, write_model_card
from modeling_bert_impl.modeling_bert_impl import stock_name
from tokenization import BertImplTokenizer, tokenization_bert_impl

TOL = 1e-5
PACKAGE_DIR = Path(bi.__file__).parent
# A saved folder carries the checkpoint's code only: no file of the CPU inference engine (inference/).
CODE_FILES = [
    "modeling_bert_impl.py", "configuration_bert_impl.py", "bert_padding.py", "input_checks.py", "dropout.py",
    "layouts.py", "stock_format.py",
]
MODEL_FILES = {"model.safetensors", "config.json", "README.md", *CODE_FILES}
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenization_bert_impl.py", "README.md"}
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64)
OUTPUT_NAMES = ("logits", "prediction_logits", "seq_relationship_logits", "start_logits", "end_logits",
                "last_hidden_state", "pooler_output")
PAIRS = [("The quick brown fox jumps over the lazy dog.", "A dog sleeps."), ("Short one.", "BERT reads both ways.")]


class FakeHub:
    """The Hub's write API on the local Hub cache. Commits add files on top of their branch's last commit (as on
    the Hub); `log` records every commit's repo, branch, commit id, message and uploaded paths."""

    def __init__(self, cache: Path):
        self.cache = cache
        self.log = []

    def repo_dir(self, repo_id: str) -> Path:
        return self.cache / f"models--{repo_id.replace('/', '--')}"

    def head(self, repo_id: str, branch: str = "main") -> str | None:
        ref = self.repo_dir(repo_id) / "refs" / branch
        return ref.read_text() if ref.exists() else None

    def snapshot(self, repo_id: str, revision: str = "main") -> Path:
        commit = revision if re.fullmatch(r"[0-9a-f]{40}", revision) else self.head(repo_id, revision)
        return self.repo_dir(repo_id) / "snapshots" / commit

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        root = self.snapshot(repo_id, revision)
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    def commits(self, repo_id: str) -> list[dict]:
        return [c for c in self.log if c["repo_id"] == repo_id]

    # HfApi methods -------------------------------------------------------------------------------------------------
    def create_repo(self, repo_id, **kwargs):
        return RepoUrl(f"{huggingface_hub.constants.ENDPOINT}/{repo_id}")

    def create_branch(self, repo_id, *, branch, revision=None, exist_ok=False, **kwargs):
        ref = self.repo_dir(repo_id) / "refs" / branch
        if not ref.exists():
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(self.head(repo_id, revision or "main") or "")

    def create_commit(self, repo_id, operations, *, commit_message, revision=None, **kwargs):
        branch = revision or "main"
        parent = self.head(repo_id, branch)
        files = self.files(repo_id, parent) if parent else {}
        for op in operations:
            assert isinstance(op, CommitOperationAdd), f"unexpected operation {op!r}"
            with op.as_file() as f:
                files[op.path_in_repo] = f.read()
        digest = hashlib.sha1((parent or "").encode())
        for path in sorted(files):
            digest.update(path.encode() + hashlib.sha1(files[path]).digest())
        commit = digest.hexdigest()
        root = self.repo_dir(repo_id) / "snapshots" / commit
        for path, data in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data)
        (self.repo_dir(repo_id) / "refs").mkdir(parents=True, exist_ok=True)
        (self.repo_dir(repo_id) / "refs" / branch).write_text(commit)
        self.log.append(dict(repo_id=repo_id, branch=branch, commit=commit, message=commit_message,
                             paths=sorted(op.path_in_repo for op in operations)))
        url = f"{huggingface_hub.constants.ENDPOINT}/{repo_id}/commit/{commit}"
        return CommitInfo(commit_url=url, commit_message=commit_message, commit_description="", oid=commit)

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, revision=None, allow_patterns=None,
                      ignore_patterns=None, **kwargs):
        """One commit of the folder's files (the real one may take the Xet path, past `create_commit`)."""
        folder = Path(folder_path)
        paths = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
        ignore = list(ignore_patterns or []) + DEFAULT_IGNORE_PATTERNS
        paths = filter_repo_objects(paths, allow_patterns=allow_patterns, ignore_patterns=ignore)
        ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(folder / p)) for p in paths]
        return self.create_commit(repo_id, ops, commit_message=commit_message or "Upload folder", revision=revision)


def install_fake_hub(monkeypatch, cache: Path) -> FakeHub:
    """Route HfApi's writes to a FakeHub on `cache`, and make `cache` the offline Hub cache of this process."""
    hub = FakeHub(cache)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # and any request fails fast
    for name in ("create_repo", "create_branch", "create_commit", "upload_folder"):
        method = getattr(hub, name)
        monkeypatch.setattr(HfApi, name, lambda api, *args, _method=method, **kwargs: _method(*args, **kwargs))
        # transformers before 5.10 calls huggingface_hub's module-level functions, imported as names (methods bound
        # to one HfApi before any patch): route those names too.
        if hasattr(transformers_hub, name):
            monkeypatch.setattr(transformers_hub, name, method)
    return hub


@pytest.fixture
def hub(monkeypatch, tmp_path):
    return install_fake_hub(monkeypatch, tmp_path / "hub-cache")


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return BertImplTokenizer.from_pretrained(minilm_dir)


def make_model(auto_name: str, tokenizer, seed: int = 0, **config):
    torch.manual_seed(seed)
    num_labels = 2 if auto_name == "AutoModelForQuestionAnswering" else 3
    config = BertImplConfig(**{**SMALL, "vocab_size": len(tokenizer), "num_labels": num_labels, **config})
    return AUTO_CLASSES[auto_name](config).eval()


def make_inputs(auto_name: str, tokenizer) -> dict:
    if auto_name == "AutoModelForMultipleChoice":  # (batch 1, 2 choices, T)
        enc = tokenizer([PAIRS[0][0]] * 2, [PAIRS[0][1], PAIRS[1][1]], padding=True, return_tensors="pt")
        return {k: v.unsqueeze(0) for k, v in enc.items()}
    return dict(tokenizer([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt"))


def outputs(model, inputs) -> dict:
    with torch.no_grad():
        out = model(**inputs)
    return {n: getattr(out, n).tolist() for n in OUTPUT_NAMES if getattr(out, n, None) is not None}


def assert_close(expected: dict, got: dict, what):
    assert expected.keys() == got.keys(), what
    for name in expected:
        diff = (torch.tensor(expected[name]) - torch.tensor(got[name])).abs().max().item()
        assert diff < TOL, (what, name, diff)


def usage_snippets(readme: str) -> tuple[str, str]:
    """The card's two Python blocks: with only transformers (remote code), and with bert-impl installed."""
    remote, installed = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    return remote, installed


# ---------------------------------------------------------------------------------------------------------------------
# One Hub for the module: every head pushed with the tokenizer to org/<head>, and org/versions pushed twice.
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pushed(tmp_path_factory, tokenizer):
    """Push every head (with the tokenizer; half the repos get the tokenizer first) and two versions of a classifier.
    Returns the hub, per repo its expected outputs, and the folder holding the inputs."""
    root = tmp_path_factory.mktemp("pushed")
    with pytest.MonkeyPatch.context() as monkeypatch:
        hub = install_fake_hub(monkeypatch, root / "hub-cache")
        expected = {}
        for i, auto_name in enumerate(AUTO_CLASSES):
            repo_id = f"org/{AUTO_CLASSES[auto_name].__name__}"
            model = make_model(auto_name, tokenizer, seed=i)
            pushes = [model.push_to_hub, tokenizer.push_to_hub]
            for push in pushes if i % 2 else pushes[::-1]:
                push(repo_id)
            inputs = make_inputs(auto_name, tokenizer)
            torch.save(inputs, root / f"{auto_name}.pt")
            expected[repo_id] = dict(auto=auto_name, outputs=outputs(model, inputs))

        versions = {}
        for version in (1, 2):
            model = make_model("AutoModelForSequenceClassification", tokenizer, seed=100 + version)
            model.push_to_hub("org/versions", commit_message=f"version {version}")
            tokenizer.push_to_hub("org/versions")
            versions[version] = dict(commit=hub.head("org/versions"), outputs=outputs(model, make_inputs(
                "AutoModelForSequenceClassification", tokenizer)))
    return dict(hub=hub, root=root, expected=expected, versions=versions)


def test_model_and_tokenizer_pushes_upload_what_a_stranger_needs(pushed):
    """Per repo: the model commit holds weights (stock BERT's key names), config with every head in auto_map, the
    checkpoint's code files as in the package, and our card; the tokenizer commit its files with its auto_map and
    code file."""
    hub = pushed["hub"]
    auto_map = {"AutoConfig": "configuration_bert_impl.BertImplConfig",
                **{auto: f"modeling_bert_impl.{cls.__name__}" for auto, cls in AUTO_CLASSES.items()}}
    for repo_id, info in pushed["expected"].items():
        uploaded = sorted((set(c["paths"]) for c in hub.commits(repo_id)), key=lambda paths: "config.json" in paths)
        assert uploaded == [TOKENIZER_FILES, MODEL_FILES], repo_id

        files = hub.files(repo_id)
        config = json.loads(files["config.json"])
        assert config["auto_map"] == auto_map
        assert config["model_type"] == "bert_impl"
        assert config["architectures"] == [AUTO_CLASSES[info["auto"]].__name__]
        for name in CODE_FILES:
            assert files[name] == (PACKAGE_DIR / name).read_bytes(), name
        with safe_open(hub.snapshot(repo_id) / "model.safetensors", "pt") as weights:
            keys = set(weights.keys())
        stock = getattr(transformers, stock_name(AUTO_CLASSES[info["auto"]]))(transformers.BertConfig(**config))
        assert keys <= set(stock.state_dict()) and any(".attention.self.query.weight" in k for k in keys), keys

        tokenizer_config = json.loads(files["tokenizer_config.json"])
        assert tokenizer_config["auto_map"]["AutoTokenizer"][0] == "tokenization_bert_impl.BertImplTokenizer"
        assert files["tokenization_bert_impl.py"] == Path(tokenization_bert_impl.__file__).read_bytes()

        card = ModelCard(files["README.md"].decode())  # ours, whichever of model and tokenizer was pushed first
        assert card.data.library_name == "transformers"
        assert {"bert", "bert_impl"} <= set(card.data.tags)
        assert card.data.pipeline_tag == PIPELINE_TAGS[info["auto"]]
        assert f'{info["auto"]}.from_pretrained("{repo_id}", trust_remote_code=True)' in card.text


@pytest.mark.slow
def test_pull_by_repo_id_in_a_python_without_the_package(pushed, tokenizer, run_without_package, tmp_path):
    """A stranger with only transformers: every head and the tokenizer by repo id with trust_remote_code, same
    tokens and outputs as the pushed model; `revision=` pins a commit; the card's snippet runs as written."""
    hub, root = pushed["hub"], pushed["root"]
    jobs = [dict(repo_id=repo_id, auto=info["auto"], inputs=str(root / f"{info['auto']}.pt"),
                 snippet=usage_snippets(hub.files(repo_id)["README.md"].decode())[0])
            for repo_id, info in pushed["expected"].items()]
    classifier_inputs = str(root / "AutoModelForSequenceClassification.pt")
    jobs += [dict(name="main", repo_id="org/versions", auto="AutoModelForSequenceClassification",
                  inputs=classifier_inputs),
             dict(name="v1", repo_id="org/versions", auto="AutoModelForSequenceClassification",
                  inputs=classifier_inputs, revision=pushed["versions"][1]["commit"])]
    (tmp_path / "jobs.json").write_text(json.dumps(dict(jobs=jobs, pairs=PAIRS, output_names=OUTPUT_NAMES)))

    got = run_without_package("""
        import contextlib, io, json, torch, transformers
        spec = json.load(open("jobs.json"))
        texts = [a for a, _ in spec["pairs"]], [b for _, b in spec["pairs"]]
        result = {}
        for job in spec["jobs"]:
            kw = {"revision": job["revision"]} if "revision" in job else {}
            model = getattr(transformers, job["auto"]).from_pretrained(job["repo_id"], trust_remote_code=True, **kw)
            tokenizer = transformers.AutoTokenizer.from_pretrained(job["repo_id"], trust_remote_code=True, **kw)
            with torch.no_grad():
                out = model(**torch.load(job["inputs"]))
            got = result[job.get("name", job["repo_id"])] = dict(
                classes=[type(model).__module__, type(tokenizer).__module__, type(tokenizer).__name__],
                ids=tokenizer(*texts)["input_ids"],
                outputs={n: getattr(out, n).tolist() for n in spec["output_names"] if getattr(out, n, None) is not None},
            )
            if "snippet" in job:
                with contextlib.redirect_stdout(io.StringIO()) as printed:
                    exec(compile(job["snippet"], "README.md of " + job["repo_id"], "exec"), {})
                got["snippet_printed"] = printed.getvalue()

        # ... and shares it again from the repository's code: same files, though transformers' card (ours needs
        # bert-impl installed).
        from huggingface_hub import CommitInfo, HfApi, RepoUrl
        uploads = {}
        def create_commit(api, repo_id, operations, **kwargs):
            for op in operations:
                with op.as_file() as f:
                    uploads[op.path_in_repo] = f.read()
            return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/{'0' * 40}", commit_message="",
                              commit_description="", oid="0" * 40)
        HfApi.create_repo = lambda api, repo_id, **kwargs: RepoUrl(f"https://huggingface.co/{repo_id}")
        import transformers.utils.hub
        if hasattr(transformers.utils.hub, "create_repo"):  # transformers before 5.10 (see install_fake_hub)
            transformers.utils.hub.create_repo = lambda repo_id, **kwargs: RepoUrl(f"https://huggingface.co/{repo_id}")
        HfApi.create_commit = create_commit
        model.push_to_hub("stranger/reshared")
        result["reshared"] = dict(files=sorted(uploads), auto_map=json.loads(uploads["config.json"])["auto_map"],
                                  readme=uploads["README.md"].decode())
        print(json.dumps(result))
    """, env={"HF_HUB_CACHE": str(hub.cache), "HF_MODULES_CACHE": str(tmp_path / "modules"),
              "HF_HOME": str(tmp_path / "hf-home")})

    reference_ids = tokenizer([a for a, _ in PAIRS], [b for _, b in PAIRS])["input_ids"]
    for repo_id, info in pushed["expected"].items():
        model_module, tokenizer_module, tokenizer_class = got[repo_id]["classes"]
        assert model_module.startswith("transformers_modules."), model_module  # the repo's code, not ours
        assert tokenizer_module.startswith("transformers_modules.") and tokenizer_class == "BertImplTokenizer"
        assert got[repo_id]["ids"] == reference_ids
        assert_close(info["outputs"], got[repo_id]["outputs"], repo_id)
        assert got[repo_id]["snippet_printed"].strip(), repo_id
    assert_close(pushed["versions"][2]["outputs"], got["main"]["outputs"], "org/versions main")
    assert_close(pushed["versions"][1]["outputs"], got["v1"]["outputs"], "org/versions v1")
    assert set(got["reshared"]["files"]) == MODEL_FILES
    assert got["reshared"]["auto_map"] == json.loads(hub.files("org/versions")["config.json"])["auto_map"]
    assert "bert_impl" not in got["reshared"]["readme"]


def test_pull_by_repo_id_with_the_package_installed(pushed, monkeypatch):
    """With bert-impl imported, the same repos load into our registered classes without trust_remote_code."""
    hub, root = pushed["hub"], pushed["root"]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for repo_id, info in pushed["expected"].items():
        model = getattr(transformers, info["auto"]).from_pretrained(repo_id)
        assert type(model) is AUTO_CLASSES[info["auto"]]
        assert type(transformers.AutoTokenizer.from_pretrained(repo_id)) is BertImplTokenizer
        assert_close(info["outputs"], outputs(model, torch.load(root / f"{info['auto']}.pt")), repo_id)
    inputs = torch.load(root / "AutoModelForSequenceClassification.pt")
    for version, revision in ((2, None), (1, pushed["versions"][1]["commit"])):
        model = transformers.AutoModelForSequenceClassification.from_pretrained("org/versions", revision=revision)
        assert_close(pushed["versions"][version]["outputs"], outputs(model, inputs), f"version {version}")


@pytest.mark.slow
def test_card_snippet_for_installed_package_runs_as_written(pushed, tmp_path):
    """The card's second snippet, in a fresh Python where bert-impl is importable, for every head."""
    hub = pushed["hub"]
    script = "\n".join(
        f"exec(compile({usage_snippets(hub.files(repo_id)['README.md'].decode())[1]!r}, {repo_id!r}, 'exec'), {{}})"
        for repo_id in pushed["expected"]
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub.cache)})
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == len(pushed["expected"])


# ---------------------------------------------------------------------------------------------------------------------
# Which README ends up on the Hub
# ---------------------------------------------------------------------------------------------------------------------
def test_save_pretrained_push_to_hub_uploads_our_card_too(hub, tokenizer, tmp_path):
    model = make_model("AutoModelForTokenClassification", tokenizer)
    model.save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="org/saved")
    (commit,) = hub.commits("org/saved")
    assert set(commit["paths"]) == MODEL_FILES
    assert ModelCard(hub.files("org/saved")["README.md"].decode()).data.pipeline_tag == "token-classification"


def test_push_keeps_a_card_of_ours_and_replaces_any_other(hub, tokenizer, tmp_path):
    """A card of ours already on the Hub (say with a recipe's metrics) survives a later push; a foreign card (say
    Trainer's) is replaced; tags given to push_to_hub are kept."""
    model = make_model("AutoModelForSequenceClassification", tokenizer)
    readme = write_model_card(tmp_path / "card", model, metrics={"eval_accuracy": 0.75}, repo_id="org/keep")
    HfApi().upload_file(path_or_fileobj=readme, path_in_repo="README.md", repo_id="org/keep")
    model.push_to_hub("org/keep", tags=["glue"])
    card, ours = ModelCard(hub.files("org/keep")["README.md"].decode()), ModelCard.load(readme)
    assert (card.text, card.data.eval_results) == (ours.text, ours.data.eval_results)
    assert card.data.tags == ["bert", "bert_impl", "glue"]

    foreign = tmp_path / "foreign.md"
    foreign.write_text("---\nlibrary_name: transformers\ntags:\n- generated_from_trainer\n---\n\n# Some card\n")
    HfApi().upload_file(path_or_fileobj=str(foreign), path_in_repo="README.md", repo_id="org/other")
    model.push_to_hub("org/other", tags=["glue"])
    card = ModelCard(hub.files("org/other")["README.md"].decode())
    assert card.data.tags == ["bert", "bert_impl", "generated_from_trainer", "glue"]
    assert "# other" in card.text


def test_recipe_order_trainer_push_then_our_card(hub, tokenizer, tmp_path):
    """The recipes' `--push_to_hub`: Trainer.push_to_hub uploads the folder with Trainer's own card, then ours is
    uploaded over it, with the metrics and the command; the repo holds everything a stranger needs."""
    model = make_model("AutoModelForSequenceClassification", tokenizer)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), push_to_hub=True,
                                          hub_model_id="org/recipe", report_to="none", use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, processing_class=tokenizer)
    trainer.push_to_hub()
    assert "generated_from_trainer" in hub.files("org/recipe")["README.md"].decode()

    metrics = {"eval_accuracy": 0.875, "eval_loss": 0.41, "eval_runtime": 1.5, "epoch": 3.0}
    command = ["python", "recipes/glue.py", "--task", "sst2", "--push_to_hub"]
    readme = write_model_card(args.output_dir, trainer.model, metrics=metrics, command=command,
                              datasets=["nyu-mll/glue"], dataset_config="sst2", repo_id=trainer.hub_model_id)
    HfApi().upload_file(path_or_fileobj=readme, path_in_repo="README.md", repo_id=trainer.hub_model_id)

    files = hub.files("org/recipe")
    assert MODEL_FILES | TOKENIZER_FILES <= set(files)
    card = ModelCard(files["README.md"].decode())
    assert "bert_impl" in card.data.tags
    assert {(r.metric_type, r.metric_value, r.dataset_split) for r in card.data.eval_results} == {
        ("accuracy", 0.875, "validation"), ("loss", 0.41, "validation")}
    assert "python recipes/glue.py --task sst2 --push_to_hub" in card.text


# ---------------------------------------------------------------------------------------------------------------------
# The card itself
# ---------------------------------------------------------------------------------------------------------------------
def test_model_card_metadata_and_text(tokenizer):
    model = make_model("AutoModelForSequenceClassification", tokenizer, num_labels=1)  # regression
    card = model_card(model, "org/stsb", metrics={"eval_pearson": 0.88, "eval_samples_per_second": 99.0,
                                                  "test_spearmanr": 0.86, "train_loss": 0.2, "epoch": 2.0,
                                                  "eval_samples": 1500},
                      command="python recipes/glue.py --task stsb", base_model="google-bert/bert-base-uncased",
                      datasets=["nyu-mll/glue"], dataset_config="stsb", license="apache-2.0")
    card = ModelCard(str(card))  # what a reader of README.md parses
    data = card.data
    assert (data.library_name, data.pipeline_tag, data.license) == ("transformers", "text-classification", "apache-2.0")
    assert (data.base_model, data.datasets, data.model_name) == ("google-bert/bert-base-uncased", ["nyu-mll/glue"], "stsb")
    assert {(r.task_type, r.dataset_type, r.dataset_config, r.dataset_split, r.metric_type, r.metric_value)
            for r in data.eval_results} == {
        ("text-classification", "nyu-mll/glue", "stsb", "validation", "pearson", 0.88),
        ("text-classification", "nyu-mll/glue", "stsb", "test", "spearmanr", 0.86),
    }
    assert "print(logits.item())" in card.text  # the regression read-out
    assert "| eval_samples_per_second | 99 |" in card.text  # every number is listed in the text
    assert "```bash\npython recipes/glue.py --task stsb\n```" in card.text
    # The weights are in stock names: the card says transformers' own class loads them, not that they need converting.
    assert "stock BERT's parameter names" in card.text and "`BertForSequenceClassification` loads them" in card.text
    assert "own parameter names" not in card.text

    bare = ModelCard(str(model_card(model.config, "org/bare", metrics={"eval_loss": 0.1})))
    assert bare.data.eval_results is None  # no dataset given: metrics in the text only
    assert "| eval_loss | 0.1 |" in bare.text
    assert ModelCard(str(model_card(make_model("AutoModelForNextSentencePrediction", tokenizer), "o/n"))).data.pipeline_tag is None


# ---------------------------------------------------------------------------------------------------------------------
# Over HTTP: olah (a Hub mirror from PyPI) serving the pushed commits as a local git repository
# ---------------------------------------------------------------------------------------------------------------------
def _olah_cli() -> str | None:
    return os.environ.get("OLAH_CLI") or shutil.which("olah-cli")


@pytest.mark.skipif(_olah_cli() is None or shutil.which("git") is None, reason="needs olah (pip install olah) and git")
@pytest.mark.slow
def test_pull_over_http_from_a_hub_mirror(pushed, run_without_package, tmp_path):
    """The pushed commits of org/versions replayed into a git repository that olah serves offline on loopback; a
    Python without bert-impl pulls the model by repo id over HTTP (HF_ENDPOINT), main and a pinned revision.

    Model only: for a file missing from a local repository olah answers 401 where the Hub answers 404, and
    AutoTokenizer asks for optional files (added_tokens.json, ...) that a 401 turns into an error. For the same
    reason the user has no peft either (it is in our dev extra): with peft importable, from_pretrained also asks for
    adapter_config.json."""
    hub = pushed["hub"]
    mirror = tmp_path / "mirrors" / "models" / "org" / "versions"
    git = lambda *args: subprocess.run(["git", "-C", str(mirror), *args], check=True, capture_output=True, text=True)
    mirror.mkdir(parents=True)
    git("init", "-q", "-b", "main")
    git_commits = {}
    for commit in hub.commits("org/versions"):
        for path, data in hub.files("org/versions", commit["commit"]).items():
            (mirror / path).write_bytes(data)
        git("add", "-A")
        git("-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-q", "--allow-empty", "-m", commit["message"])
        git_commits[commit["commit"]] = git("rev-parse", "HEAD").stdout.strip()
    v1 = git_commits[pushed["versions"][1]["commit"]]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "olah.toml").write_text(textwrap.dedent(f"""
        [basic]
        host = "127.0.0.1"
        port = {port}
        repos-path = "{tmp_path / 'olah-repos'}"
        mirrors-path = ["{tmp_path / 'mirrors'}"]
        [accessibility]
        offline = true
    """))
    server = subprocess.Popen([_olah_cli(), "-c", "olah.toml", "--log-path", str(tmp_path / "olah-logs")],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "olah did not start"
                time.sleep(0.2)
        got = run_without_package(f"""
            import sys
            sys.modules["peft"] = None  # not installed, as far as transformers' import checks can tell
            import json, torch, transformers
            assert not transformers.utils.is_peft_available()
            result = {{}}
            for name, revision in (("main", None), ("v1", {v1!r})):
                kw = {{"revision": revision}} if revision else {{}}
                model = transformers.AutoModelForSequenceClassification.from_pretrained(
                    "org/versions", trust_remote_code=True, **kw)
                with torch.no_grad():
                    out = model(**torch.load({str(pushed["root"] / "AutoModelForSequenceClassification.pt")!r}))
                result[name] = {{"logits": out.logits.tolist(), "module": type(model).__module__}}
            print(json.dumps(result))
        """, env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{port}", "NO_PROXY": "127.0.0.1",
                  "HF_HUB_CACHE": str(tmp_path / "download-cache"), "HF_MODULES_CACHE": str(tmp_path / "modules"),
                  "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"})
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert got["main"]["module"].startswith("transformers_modules.")
    assert (tmp_path / "download-cache" / "models--org--versions").is_dir()  # downloaded over HTTP
    assert_close({"logits": pushed["versions"][2]["outputs"]["logits"]}, {"logits": got["main"]["logits"]}, "main")
    assert_close({"logits": pushed["versions"][1]["outputs"]["logits"]}, {"logits": got["v1"]["logits"]}, "v1")
