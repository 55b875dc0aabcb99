"""clover_cpp._ggml's mirror of struct ggml_tensor against the ggml libclover links (ggml has
no ABI query: tensors ggml builds are read through the mirror and through ggml's accessors):

* our build passes, and ggml_tensor_overhead() is sizeof(ggml_object) + sizeof(ggml_tensor);
* a mirror with a field moved or a size changed fails at first use with one line that names
  the field.
"""
from __future__ import annotations

import ctypes
from ctypes import Structure, c_char, c_int64

import pytest

from clover_cpp import _ggml as G
from clover_cpp import _native as N

try:
    N.find_library()
except N.CloverLibraryNotFound as e:  # pragma: no cover - CI always builds it
    pytest.skip(f"libclover is not built ({e})", allow_module_level=True)


def test_the_mirror_matches_our_build() -> None:
    L = G.lib()
    assert G.mirror_mismatches(L) == []
    assert L.ggml_tensor_overhead() == ctypes.sizeof(G.ggml_object) + ctypes.sizeof(G.ggml_tensor)


def _wrong_mirror(change: str) -> type:
    fields = list(G.ggml_tensor._fields_)
    names = [f[0] for f in fields]
    if change == "swapped":  # ne and nb: same size, so only reading the values tells
        i = names.index("ne")
        fields[i], fields[i + 1] = fields[i + 1], fields[i]
    elif change == "shifted":  # a field the library does not have, before src
        fields.insert(names.index("src"), ("extra_field", c_int64))
    else:  # a shorter tail: every field reads right, the size does not
        fields[names.index("padding")] = ("padding", c_char * 0)
    return type("ggml_tensor", (Structure,), {"_fields_": fields})


@pytest.mark.parametrize("change, first", [("swapped", "ggml_tensor.ne ="), ("shifted", "ggml_tensor.src ="),
                                           ("shorter", "ggml_tensor_overhead() =")])
def test_a_wrong_mirror_fails_at_first_use_with_one_line(monkeypatch, change: str, first: str) -> None:
    wrong = _wrong_mirror(change)
    assert G.mirror_mismatches(G.lib(), wrong)[0].startswith(first)
    monkeypatch.setattr(G, "ggml_tensor", wrong)
    monkeypatch.setattr(G, "_lib", None)
    with pytest.raises(N.CloverLibraryMismatch) as ei:
        G.lib()
    msg = str(ei.value)
    assert "\n" not in msg and f"struct ggml_tensor: {first}" in msg and "rebuild" in msg
