"""clover_gguf.quant's table of quantization types (gguf-py's LlamaFileType, plus what the pinned
llama.h has that gguf-py does not list yet) against the pinned llama.h."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from clover_gguf.quant import QUANT_TYPES, QuantizeError, parse_quant_type

LLAMA_H = Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "include" / "llama.h"


@pytest.mark.skipif(not LLAMA_H.is_file(), reason="the pinned llama.cpp is not set up (./dev.sh setup)")
def test_the_table_is_llama_h_s_file_types() -> None:
    found = re.findall(r"^\s*LLAMA_FTYPE_(?:MOSTLY_|ALL_)(\w+)\s*=\s*(\d+),", LLAMA_H.read_text(), re.MULTILINE)
    assert QUANT_TYPES == {name: int(v) for name, v in found}


def test_names_aliases_and_values() -> None:
    assert parse_quant_type("q4-k") == ("Q4_K_M", QUANT_TYPES["Q4_K_M"])
    assert parse_quant_type(QUANT_TYPES["IQ4_XS"]) == ("IQ4_XS", QUANT_TYPES["IQ4_XS"])
    with pytest.raises(QuantizeError, match="unknown quantization type 'Q9'"):
        parse_quant_type("Q9")
