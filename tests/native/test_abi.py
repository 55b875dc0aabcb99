"""The ctypes layer (clover_cpp._native) against clover.h (and clover-chat.h, libclover's other
public header, and clover-testing.h, the functions it exports for tests) and the library built from it.

* the library's ABI (clover_abi_query: API version, struct sizes / alignments / field counts,
  field offsets, named constants) equals the ctypes declarations;
* the field names of every struct in clover.h, in order, are those of the ctypes struct, and
  the library's table lists every one of them (so a field added to clover.h but not to the
  table, or to the table but not to Python, fails here);
* the named constants Python mirrors have clover.h's values;
* the load-time check fires, with one line, when a ctypes struct gains a field or has two
  fields swapped, or when a constant or the API version differs;
* every function clover.h, clover-chat.h and clover-testing.h declare has a ctypes declaration
  (argtypes and restype).
"""
from __future__ import annotations

import ctypes
import re
from ctypes import Structure, c_int32
from pathlib import Path

import pytest

from clover_cpp import _native as N

HEADER = Path(__file__).resolve().parents[2] / "native" / "libclover" / "clover.h"
CHAT_HEADER = HEADER.with_name("clover-chat.h")  # (its functions only: no structs or constants of its own)
TESTING_HEADER = HEADER.with_name("clover-testing.h")  # (the same)

try:
    N.find_library()
except N.CloverLibraryNotFound as e:  # pragma: no cover - CI always builds it
    pytest.skip(f"libclover is not built ({e})", allow_module_level=True)

L = N.load_library()


def _header(path: Path = HEADER) -> str:
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_structs() -> dict[str, list[str]]:
    """{struct name: its field names in order}, parsed from clover.h."""
    out = {}
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", _header(), flags=re.S):
        out[m.group(1)] = [re.findall(r"\w+", decl)[-1] for decl in m.group(2).split(";") if decl.strip()]
    return out


def header_constants() -> dict[str, int]:
    """Integer constants of clover.h: enum entries and #defines."""
    text = _header()
    out = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*#define\s+(CLOVER_\w+)\s+\(?(-?\d+)\)?\s*$",
                                                             text, flags=re.M)}
    for body in re.findall(r"enum\s+\w+\s*\{(.*?)\}", text, flags=re.S):
        out.update({m.group(1): int(m.group(2)) for m in re.finditer(r"(CLOVER_\w+)\s*=\s*(-?\d+)", body)})
    return out


def header_functions() -> list[str]:
    return [name for h in (HEADER, CHAT_HEADER, TESTING_HEADER)
            for name in re.findall(r"CLOVER_API\s+[^;]*?\b(clover_\w+)\s*\(", _header(h))]


def test_library_matches_the_declarations():
    assert L.clover_api_version() == N.CLOVER_API_VERSION
    assert N.abi_mismatches(L) == []


def test_structs_match_the_header():
    structs = header_structs()
    assert set(structs) == {S.__name__ for S in N.STRUCTS}, "a struct of clover.h has no ctypes mirror (N.STRUCTS)"
    for S in N.STRUCTS:
        names = structs[S.__name__]
        assert [f[0] for f in S._fields_] == names, S.__name__
        assert L.clover_abi_query(f"fields {S.__name__}".encode()) == len(names)
        for f in names:
            assert L.clover_abi_query(f"offsetof {S.__name__}.{f}".encode()) == getattr(S, f).offset


def test_constants_match_the_header():
    consts = header_constants()
    for c in N.CONSTANTS:
        assert consts[c] == getattr(N, c), c
        assert L.clover_abi_query(f"known value {c}".encode()) == 1, c
        assert L.clover_abi_query(f"value {c}".encode()) == consts[c], c
    assert L.clover_abi_query(b"value CLOVER_NO_SUCH_THING") == -1
    assert L.clover_abi_query(b"known value CLOVER_NO_SUCH_THING") == 0
    assert L.clover_abi_query(b"sizeof no_such_struct") == -1
    assert L.clover_abi_query(b"fields no_such_struct") == -1
    assert L.clover_abi_query(None) == -1


def test_every_header_function_is_declared():
    """One typed stub per function of clover.h, clover-chat.h and clover-testing.h (argtypes and
    restype set on the library), none extra."""
    names = header_functions()
    assert "clover_chat_parser_parse" in names and "clover_select_unmask" in names
    assert len(names) == len(set(names))
    assert set(N._DECLS) == set(names)
    for name in names:
        argtypes, restype = N._DECLS[name]
        f = getattr(L, name)
        assert f.argtypes == argtypes and f.restype is restype, name
        assert callable(getattr(N, name)) and getattr(N, name).__name__ == name
    assert N.clover_api_version() == N.CLOVER_API_VERSION
    assert N.clover_abi_query(b"sizeof clover_stats") == ctypes.sizeof(N.clover_stats)


def _struct_like(S: type, fields: list) -> type:
    return type(S.__name__, (Structure,), {"_fields_": fields})


@pytest.mark.parametrize("change", ["added", "swapped", "dropped_last"])
def test_check_fires_when_a_struct_differs(monkeypatch, change):
    fields = list(N.clover_generate_params._fields_)
    if change == "added":  # a field one side has (the last one fits the struct's tail padding)
        fields.append(("extra", c_int32))
    elif change == "swapped":  # two fields reordered (same types: the size stays)
        i = [f[0] for f in fields].index("max_tokens")
        fields[i], fields[i + 1] = fields[i + 1], fields[i]
    else:
        fields.pop()
    fake = _struct_like(N.clover_generate_params, fields)
    bad = N.abi_mismatches(L, structs=[fake])
    assert bad and all("clover_generate_params" in b for b in bad)
    monkeypatch.setattr(N, "STRUCTS", (N.clover_model_params, N.clover_context_params, fake, N.clover_stats))
    with pytest.raises(N.CloverLibraryMismatch) as ei:
        N.load_library(N.find_library())
    msg = str(ei.value)
    assert "\n" not in msg and "clover_generate_params" in msg and "rebuild" in msg


def test_check_fires_on_a_constant_or_the_api_version(monkeypatch):
    monkeypatch.setattr(N, "CLOVER_FINISH_STOP_TOKEN", 5)
    assert N.abi_mismatches(L) == ["CLOVER_FINISH_STOP_TOKEN = 4 in the library, 5 here"]
    monkeypatch.undo()
    monkeypatch.setattr(N, "CLOVER_API_VERSION", N.CLOVER_API_VERSION + 1)
    with pytest.raises(N.CloverLibraryMismatch, match="API version"):
        N.load_library(N.find_library())


def test_a_mismatch_is_one_clover_error_line(monkeypatch):
    """Through the runtime (errors.lib): a CloverError, one line."""
    from clover_cpp import errors

    monkeypatch.setattr(N, "_lib", None)
    monkeypatch.setattr(N, "CLOVER_API_VERSION", N.CLOVER_API_VERSION + 1)
    with pytest.raises(errors.CloverError) as ei:
        errors.lib()
    assert "\n" not in str(ei.value) and "API version" in str(ei.value)


def test_python_generate_defaults_are_libclovers():
    """clover_generate_default_params is the one place the defaults live: Clover.generate's
    keyword defaults equal them (None = read from libclover). The seed is the one documented
    difference (Python draws a fresh one per call; C's default is 0)."""
    import inspect

    from clover_cpp import Clover

    gp = L.clover_generate_default_params()
    params = inspect.signature(Clover.generate).parameters
    for name in ("max_tokens", "threshold", "max_steps", "temperature", "top_k", "top_p", "stop_at_eos",
                 "reuse_prefix", "draft_self", "draft_steps"):
        d = params[name].default
        assert d is None or d == getattr(gp, name), (name, d, getattr(gp, name))
    assert gp.max_tokens == N.CLOVER_DEFAULT_MAX_TOKENS
