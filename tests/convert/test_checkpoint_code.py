"""A checkpoint or a request that carries code or bulk: the converter never unpickles
a ``pytorch_model.bin`` nor imports the modules of ``auto_map`` (remote code), and the server refuses a
10 MB prompt (413: over --max-body) and a 6 MB one (400: it cannot fit the context) and serves on. Each planted payload writes a marker file if it ever runs."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest

from clover_testkit.converted_gguf import conversion_error, copy_checkpoint, leftovers

MARKER = "RAN.txt"


class _Payload:
    """Unpickling this runs code: it writes MARKER next to the checkpoint."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def __reduce__(self):
        return (Path.write_text, (self.where / MARKER, "unpickled"))


def _plant_pickle(folder: Path) -> None:
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(folder)))


def test_a_pickle_alone_is_refused_and_never_loaded(fx, tmp_path) -> None:
    src = copy_checkpoint(fx, tmp_path)
    for f in src.glob("*.safetensors*"):
        f.unlink()
    _plant_pickle(src)
    line = conversion_error(src, tmp_path)
    assert "safetensors" in line, line
    assert not (src / MARKER).exists()


def test_a_pickle_beside_safetensors_is_never_loaded(fx, tmp_path) -> None:
    from clover_convert import convert

    src = copy_checkpoint(fx, tmp_path)
    _plant_pickle(src)
    convert(src, tmp_path / "m.gguf", outtype="f16", progress=False)
    assert (tmp_path / "m.gguf").is_file() and not (src / MARKER).exists()


def test_remote_code_is_never_imported(fx, tmp_path) -> None:
    from clover_convert import convert

    src = copy_checkpoint(fx, tmp_path)
    (src / "evil_model.py").write_text(f"from pathlib import Path\nPath({str(src / MARKER)!r}).write_text('imported')\n")
    cfg = json.loads((src / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil_model.Config", "AutoModelForCausalLM": "evil_model.Model"}
    (src / "config.json").write_text(json.dumps(cfg))
    convert(src, tmp_path / "m.gguf", outtype="f16", progress=False)
    assert (tmp_path / "m.gguf").is_file() and not (src / MARKER).exists()
    assert leftovers(tmp_path) == ["m.gguf"]


@pytest.mark.needs_libclover
def test_prompts_of_megabytes_are_refused(tiny_artifacts) -> None:
    import httpx

    from clover_testkit.server_harness import Server

    s = Server(tiny_artifacts["f32"], "-t", "1")
    try:
        t = time.time()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "ab " * 3_500_000, "max_tokens": 4}, timeout=120)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text[:300]
        # under --max-body (8 MiB): refused before tokenizing, by its size against the context
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "ab " * 2_000_000, "max_tokens": 4}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        assert time.time() - t < 60
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text[:300]
    finally:
        s.stop()
