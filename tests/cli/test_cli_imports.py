"""The ``clover`` command's code: the wheel's packages import no test kit, the front end reaches
the runtime through its public names only."""

from __future__ import annotations

from pathlib import Path

from clover_testkit.cli_runs import REPO


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py"))


def test_the_product_does_not_import_the_test_kit() -> None:
    """The wheel's packages (clover_cpp, clover_convert) import neither clover_testkit nor
    tokenizers (its fixture tokenizers' trainer): both stay out of the runtime install
    (pyproject: the test extra; the wheel's packages)."""
    import ast

    found = []
    for p in _python_files("clover_cpp", "clover_convert"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{p.relative_to(REPO)}:{node.lineno} {n}" for n in names
                      if n.split(".")[0] in ("clover_testkit", "tokenizers")]
    assert not found, found
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert not [d for d in project["project"]["dependencies"] if d.startswith("tokenizers")]
    assert "clover_testkit" not in project["tool"]["scikit-build"]["wheel"]["packages"]


def test_the_cli_uses_public_names_only() -> None:
    """The front end (clover_cpp/cli/, clover_cpp/demo.py) reaches the runtime through its public
    names: no `obj._name` on another object, no private keyword argument (`_chat_text=`) and no
    private name imported from another module."""
    import ast

    found = []
    for p in _python_files("clover_cpp/cli") + [REPO / "clover_cpp" / "demo.py"]:
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{p.relative_to(REPO)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.keyword) and node.arg and node.arg.startswith("_"):
                found.append(f"{p.relative_to(REPO)}:{node.lineno} {node.arg}=")
            if isinstance(node, ast.ImportFrom) and node.module not in ("group", "options", "live") \
                    and any(a.name.startswith("_") and a.name != "__future__" for a in node.names):
                found.append(f"{p.relative_to(REPO)}:{node.lineno} from {node.module} import _...")
    assert not found, found
