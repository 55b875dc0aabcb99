"""The packages' layering, read from the imports of every module (ast; function-level and
TYPE_CHECKING imports included, and imports inside code strings run with ``python -c``):

* clover_gguf (the GGUF names, file rules, quant types, reader check, error base) imports no
  other package of ours;
* clover_convert (the converter) and clover_cpp (the runtime) never import each other, except
  the front ends, which use the other side's public names only;
* clover_testkit (what checks the product) is imported by neither;
* no import cycle among the project's modules;
* no test module imports another (shared harnesses are in clover_testkit or tests/conftest.py);
* no clover_cpp module but model.py reads a private attribute of a Clover object: its helpers
  take a handle, a state object and its public calls.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("clover_gguf", "clover_convert", "clover_cpp", "clover_testkit")
#: modules that drive both the converter and the runtime: the `clover` command, the demo (converts
#: the default model), kld and imatrix (their commands), and the one-pass quantizing convert
#: (the converter's filler feeding libllama's quantizer, clover_cpp.quant.StreamQuantizer)
FRONT_ENDS = ("clover_cpp.cli", "clover_cpp.demo", "clover_cpp.kld", "clover_cpp.imatrix",
              "clover_convert.quantize_stream")


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _target(module: str, name: str | None) -> str:
    """The project module an import of name from module loads (module itself when name is not a
    submodule)."""
    return f"{module}.{name}" if name and f"{module}.{name}" in MODULES else module


def _code(text: str) -> ast.Module | None:
    """A string constant that is Python code with an import (``python -c`` in a child), else None."""
    if "import" not in text:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    return tree if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)) else None


def imports_of(mod: str) -> list[tuple[str, str | None]]:
    """(project module, name imported from it or None) for each import of mod, those of its code
    strings included (a module's child running itself is no cycle: left out)."""
    path = MODULES[mod]
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    trees = [ast.parse(path.read_text(encoding="utf-8"))]
    while trees:
        for node in ast.walk(trees.pop()):
            if isinstance(node, ast.Import):
                out += [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                out += [(_target(base, a.name), a.name) for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (code := _code(node.value)):
                trees.append(code)
    return [(t, n) for t, n in out if t.split(".")[0] in PACKAGES and t != mod]


def _package(mod: str) -> str:
    return mod.split(".")[0]


def _is_front_end(mod: str) -> bool:
    return any(mod == f or mod.startswith(f + ".") for f in FRONT_ENDS)


def _private(target: str, name: str | None) -> bool:
    return any(p.startswith("_") for p in target.split(".")[1:]) or bool(name and name.startswith("_"))


def test_the_bottom_package_imports_no_other_package() -> None:
    bad = [f"{m} -> {t}" for m in MODULES if _package(m) == "clover_gguf"
           for t, _ in imports_of(m) if _package(t) != "clover_gguf"]
    assert bad == []


def test_converter_and_runtime_never_import_each_other() -> None:
    """Only the front ends import the other side, and only its public names."""
    sides = {"clover_convert": "clover_cpp", "clover_cpp": "clover_convert"}
    bad = []
    for m in MODULES:
        other = sides.get(_package(m))
        for t, name in imports_of(m):
            if _package(t) != other:
                continue
            if not _is_front_end(m):
                bad.append(f"{m} -> {t}")
            elif _private(t, name):
                bad.append(f"{m} -> {t} {name or ''} (a private name)")
    assert bad == []


def test_product_never_imports_the_testkit() -> None:
    bad = [f"{m} -> {t}" for m in MODULES if _package(m) != "clover_testkit"
           for t, _ in imports_of(m) if _package(t) == "clover_testkit"]
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph = {m: {t for t, _ in imports_of(m) if t in MODULES} for m in MODULES}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


TEST_MODULES = {p.stem for p in (REPO / "tests").rglob("test_*.py")}


def imported_test_modules(source: str) -> list[str]:
    """The test modules (tests/**/test_*.py, by name) that source imports, function-level imports
    included: shared harnesses belong in clover_testkit or conftest.py."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if n.rpartition(".")[2] in TEST_MODULES]
    return found


def test_no_test_module_imports_another() -> None:
    bad = [f"{path.relative_to(REPO)} -> {name}" for path in sorted((REPO / "tests").rglob("*.py"))
           for name in imported_test_modules(path.read_text(encoding="utf-8"))]
    assert bad == []


def test_the_test_import_finder_finds_them() -> None:
    assert imported_test_modules("from test_server import Server\nimport test_reference") == \
        ["test_server", "test_reference"]
    assert imported_test_modules("def f():\n    from tests.test_native_parity import Model") == \
        ["tests.test_native_parity"]
    assert imported_test_modules("from tests import test_reference\nfrom clover_testkit import reference") == \
        ["tests.test_reference"]


def clover_private_names(source: str) -> set[str]:
    """The private attributes of model.py's Clover: its ``_x`` methods and properties and the
    ``self._x`` it assigns."""
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Clover")
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _owned(cls: ast.ClassDef) -> set[str]:
    """What a class defines itself: its methods, class attributes with a value and what its
    __init__ assigns (a mixin's bare annotations and writes into its host's state are not)."""
    owned = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    for n in cls.body:
        if isinstance(n, ast.Assign):
            owned |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and n.value is not None and isinstance(n.target, ast.Name):
            owned.add(n.target.id)
        elif isinstance(n, ast.FunctionDef) and n.name in ("__init__", "__post_init__"):
            owned |= {a.attr for a in ast.walk(n) if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store)
                      and isinstance(a.value, ast.Name) and a.value.id == "self"}
    return owned


def clover_private_reads(source: str, private: set[str]) -> list[str]:
    """Where source touches one of Clover's private attributes: ``obj._x`` on anything but
    ``self`` / ``cls`` (a Clover object's, as far as a reader can tell), ``getattr(obj, "_x")``,
    and ``self._x`` in a class that does not define ``_x`` itself (a mixin reaching into Clover)."""
    tree = ast.parse(source)
    found = []
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        owned = _owned(cls)
        found += [f"{n.lineno}: self.{n.attr} in {cls.name}" for n in ast.walk(cls)
                  if isinstance(n, ast.Attribute) and n.attr in private and n.attr not in owned
                  and isinstance(n.value, ast.Name) and n.value.id == "self"]
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr in private and \
                not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
            found.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and \
                n.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(n.args) >= 2 and \
                isinstance(n.args[1], ast.Constant) and n.args[1].value in private:
            found.append(f"{n.lineno}: {ast.unparse(n)}")
    return sorted(set(found))


def test_only_model_py_reads_clovers_private_state() -> None:
    private = clover_private_names(MODULES["clover_cpp.model"].read_text(encoding="utf-8"))
    assert {"_op", "_model", "_tokens"} <= private  # (the finder sees Clover's state)
    bad = {m: reads for m in MODULES if _package(m) == "clover_cpp" and m != "clover_cpp.model"
           if (reads := clover_private_reads(MODULES[m].read_text(encoding="utf-8"), private))}
    assert bad == {}


def test_the_private_read_finder_finds_them() -> None:
    private = {"_op", "_last", "_model"}
    mixin = "class Calls:\n    _op: object\n    def f(self):\n        self._last = None\n        return self._op()\n"
    assert clover_private_reads(mixin, private) == ["4: self._last in Calls", "5: self._op in Calls"]
    assert clover_private_reads("def f(llm):\n    return llm._model, getattr(llm, '_last', None)\n", private) == \
        ["2: getattr(llm, '_last', None)", "2: llm._model"]
    owner = "class Tokenizer:\n    def __init__(self, model):\n        self._model = model\n" \
            "    def f(self):\n        return self._model\n"
    assert clover_private_reads(owner, private) == []
