"""The package's import graph, read from the source (every import, those inside functions included): no circle, and
the checkpoint files (the top-level modules that saved folders carry) import nothing from `inference/` or
`integrations/`, so that a folder's copy of the code needs only itself and transformers."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "modeling_bert_impl"
NAME = PACKAGE.name


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, source: str | None = None) -> set[str]:
    """The package's modules that `path` (or `source` as if it were at `path`) imports (a `from X import name` of a
    submodule counts as that module)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) if (
                node.level) else node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules and name != module_name(path)}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


CHECKPOINT_FILES = sorted(module_name(p) for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


ROBERTA_FILES = [f"{NAME}.configuration_roberta_impl", f"{NAME}.modeling_roberta_impl"]


def test_the_checkpoint_files_are_the_ones_saved_folders_carry(tmp_path):
    """A BERT folder carries every checkpoint file but the RoBERTa family's two; a folder of the family carries all."""
    import modeling_bert_impl as bi

    tiny = dict(vocab_size=99, hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=37)
    bi.BertImplModel(bi.BertImplConfig(**tiny)).save_pretrained(tmp_path / "bert")
    bi.CamembertImplModel(bi.CamembertImplConfig(**tiny)).save_pretrained(tmp_path / "camembert")
    carried = {folder: sorted(f"{NAME}.{p.stem}" for p in (tmp_path / folder).glob("*.py")) for folder in
               ("bert", "camembert")}
    assert carried["bert"] == sorted(set(CHECKPOINT_FILES) - set(ROBERTA_FILES))
    assert carried["camembert"] == CHECKPOINT_FILES


def test_checkpoint_files_import_only_each_other():
    edges = graph()
    for module in CHECKPOINT_FILES:
        assert edges[module] <= set(CHECKPOINT_FILES), (module, edges[module] - set(CHECKPOINT_FILES))


def circle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (a package's own __init__ importing its children does not count), or None."""
    state = {}  # module -> "open" while on the path, "done" after

    def visit(module, path):
        state[module] = "open"
        for target in sorted(edges[module]):
            if target.startswith(f"{module}."):
                continue
            if state.get(target) == "open":
                return [*path, module, target]
            if target not in state and (found := visit(target, [*path, module])):
                return found
        state[module] = "done"
        return None

    return next((found for module in sorted(edges) if module not in state and (found := visit(module, []))), None)


def test_no_import_circle():
    assert circle(graph()) is None
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the finder finds one


def test_the_graph_reader_sees_imports_inside_functions():
    """The upward import that was removed (the model file's, inside a method, to integrations.model_card) is
    found."""
    model_file = PACKAGE / "modeling_bert_impl.py"
    assert {f"{NAME}.input_checks", f"{NAME}.stock_format"} <= imports(model_file)
    upward = "def f():\n    from .integrations.model_card import replace_generic_card\n"
    assert f"{NAME}.integrations.model_card" in imports(model_file, upward)


def test_no_test_file_imports_another():
    """What test files share lives in conftest.py, helpers.py and recipe_data.py (docs/development.md): a test file
    imported by another would run its module-level code twice and tie the two files' fixtures together."""
    tests = Path(__file__).resolve().parent
    names = {p.stem for p in tests.glob("test_*.py")}
    found = {}
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found.update({(path.name, name): node.lineno for name in imported if name in names})
    assert not found, found


def test_a_layers_linears_are_named_in_one_inference_module():
    """inference/anatomy.py names a layer's linears (LAYER_PRODUCTS) and joins query, key and value; the engines take
    them from it."""
    stock_names = re.compile(r"intermediate\.dense|output\.dense|attention\.(self\.)?(query|key|value)\b")
    naming = sorted(p.name for p in (PACKAGE / "inference").glob("*.py") if stock_names.search(p.read_text()))
    assert naming == ["anatomy.py"]
