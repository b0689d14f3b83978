"""The package's layers (specbench/README.md): each subpackage imports only itself and those below it, drafters/ only
the decoding core, and the package root holds nothing but the commands and specbench.errors."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("decode", "core", "data", "deploy", "train", "bench", "tools")  # bottom to top


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every specbench import in `path`, module level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "specbench":
            mods = [node.module] if node.module != "specbench" else [f"specbench.{a.name}" for a in node.names]
            out += [(node.lineno, m) for m in mods]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "specbench"]
    return out


def upward(path: Path, allowed: set[str]) -> list[str]:
    bad = []
    for line, mod in imported(path):
        parts = mod.split(".")
        if len(parts) < 2 or parts[1] == "errors":
            continue
        if parts[1] not in allowed:
            bad.append(f"{path.name}:{line} imports {mod}")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_imports_a_layer_above_its_own(layer):
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    bad = [b for p in sorted((ROOT / "specbench" / layer).rglob("*.py")) for b in upward(p, allowed)]
    assert not bad, "\n".join(bad)


def test_drafters_import_only_the_decoding_core():
    bad = [b for p in sorted((ROOT / "drafters").glob("*.py")) for b in upward(p, {"decode"})]
    assert not bad, "\n".join(bad)


def test_the_package_root_holds_only_commands():
    """A root module is a command: it imports one `main` (or the trainable list) from a layer and runs it."""
    for p in sorted((ROOT / "specbench").glob("*.py")):
        if p.name in ("__init__.py", "errors.py"):
            continue
        mods = imported(p)
        assert len(mods) == 1 and mods[0][1].split(".")[1] in LAYERS, p.name
        assert 'if __name__ == "__main__":' in p.read_text(), p.name


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from specbench.bench.run import main\n")
    assert upward(bad, {"decode"}) == ["m.py:2 imports specbench.bench.run"]  # a local import counts too
    assert upward(bad, {"decode", "bench"}) == []
