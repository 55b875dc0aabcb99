"""A checkpoint is untrusted input: every file the converter reads from it
(config.json, tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja,
special_tokens_map.json, README.md, model.safetensors, the index and its shards) must be a
regular file inside the folder once links are resolved. A ``chat_template.jinja`` linked to a file
elsewhere was embedded in the GGUF as its chat template (and ``clover serve`` hands that to any
client in ``GET /props``). Links inside the folder, and a hub cache snapshot's links into its
repo's blobs, are the checkpoint's own files and convert.

Everything happens in tmp_path: the "outside" files are in a sibling folder of the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SECRET = "SECRET-TOKEN-hf_0123456789 must never reach a GGUF"


def _clover(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_cpp.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _one_line_error(p: subprocess.CompletedProcess, match: str) -> None:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("warning")]
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0] \
        and "Traceback" not in p.stderr, f"exit {p.returncode}: {p.stderr[-1500:]}"


def _link_out(ck: Path, name: str, outside: Path, content: bytes | None = None) -> Path:
    """ck/name becomes a link to outside/name (holding the file's own bytes, or content)."""
    outside.mkdir(exist_ok=True)
    target = outside / name
    src = ck / name
    target.write_bytes(content if content is not None else src.read_bytes())
    if src.exists() or src.is_symlink():
        src.unlink()
    src.symlink_to(target)
    return target


@pytest.fixture()
def ck(tiny_artifacts, tmp_path) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(tiny_artifacts["ckpt"], d)
    return d


@pytest.fixture()
def sharded(tmp_path) -> Path:
    from clover_testkit.checkpoints import write_checkpoint

    d = tmp_path / "sharded"
    write_checkpoint(d, preset="tiny", dtype="f32", shards=2)
    return d


def test_chat_template_link_is_refused_not_embedded(ck, tmp_path) -> None:
    """The issue's case: no template in tokenizer_config.json, chat_template.jinja a link."""
    tc = ck / "tokenizer_config.json"
    cfg = json.loads(tc.read_text()) if tc.exists() else {}
    cfg.pop("chat_template", None)
    tc.write_text(json.dumps(cfg))
    _link_out(ck, "chat_template.jinja", tmp_path / "outside", SECRET.encode())
    out = tmp_path / "out.gguf"
    p = _clover("convert", ck, out)
    _one_line_error(p, "outside the checkpoint folder")
    assert not out.exists() and not list(tmp_path.glob(".out.gguf*"))
    assert SECRET not in p.stdout + p.stderr


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                  "special_tokens_map.json", "README.md", "model.safetensors"])
def test_a_link_out_of_the_checkpoint_is_refused(ck, tmp_path, name: str) -> None:
    from clover_convert import ConversionError, convert

    if name == "README.md":
        content = b"---\nlicense: " + SECRET.encode() + b"\n---\n"
    elif name in ("generation_config.json", "special_tokens_map.json") and not (ck / name).exists():
        content = json.dumps({"note": SECRET}).encode()
    else:
        content = None
    _link_out(ck, name, tmp_path / "outside", content)
    out = tmp_path / "out.gguf"
    for dry_run in (True, False):
        with pytest.raises(ConversionError, match="outside the checkpoint folder"):
            convert(ck, out, outtype="f32", progress=False, dry_run=dry_run)
    assert not out.exists()


def test_cli_link_out_of_the_checkpoint_one_line(ck, tmp_path) -> None:
    _link_out(ck, "config.json", tmp_path / "outside")
    out = tmp_path / "out.gguf"
    _one_line_error(_clover("convert", ck, out), "outside the checkpoint folder")
    assert not out.exists()


@pytest.mark.parametrize("which", ["index", "shard"])
def test_sharded_links_out_are_refused(sharded, tmp_path, which: str) -> None:
    from clover_convert import ConversionError, convert
    from clover_convert.safetensors_io import INDEX_NAME, CheckpointError, CheckpointReader

    shard = sorted(json.loads((sharded / INDEX_NAME).read_text())["weight_map"].values())[-1]
    _link_out(sharded, INDEX_NAME if which == "index" else shard, tmp_path / "outside")
    out = tmp_path / "out.gguf"
    for dry_run in (True, False):
        with pytest.raises(ConversionError, match="outside the checkpoint folder"):
            convert(sharded, out, outtype="f32", progress=False, dry_run=dry_run)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        CheckpointReader(sharded)  # the reader checks again by itself
    assert not out.exists()


def test_a_shard_named_by_a_link_in_a_dry_run_without_weights(sharded, tmp_path) -> None:
    """A dry run falls back to the headers when the reader refuses: not for a link out."""
    from clover_convert import ConversionError, convert
    from clover_convert.safetensors_io import INDEX_NAME

    shards = sorted(set(json.loads((sharded / INDEX_NAME).read_text())["weight_map"].values()))
    (sharded / shards[0]).unlink()  # a dry run on a partial download
    _link_out(sharded, shards[1], tmp_path / "outside")
    with pytest.raises(ConversionError, match="outside the checkpoint folder"):
        convert(sharded, tmp_path / "o.gguf", outtype="f32", progress=False, dry_run=True)


def test_a_dangling_link_out_is_refused(ck, tmp_path) -> None:
    from clover_convert import ConversionError, convert

    (ck / "chat_template.jinja").symlink_to(tmp_path / "nowhere" / "t.jinja")
    with pytest.raises(ConversionError, match="outside the checkpoint folder"):
        convert(ck, tmp_path / "o.gguf", outtype="f32", progress=False, dry_run=True)


def test_links_inside_the_folder_convert(ck, tmp_path) -> None:
    """A link to another file of the folder (or a sub-folder of it) is the checkpoint's own."""
    from clover_convert import convert

    sub = ck / "real"
    sub.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.move(ck / name, sub / name)
        (ck / name).symlink_to(Path("real") / name)
    out = tmp_path / "out.gguf"
    convert(ck, out, outtype="f32", progress=False)
    assert out.is_file()


def test_a_linked_checkpoint_folder_converts(ck, tmp_path) -> None:
    from clover_convert import convert

    link = tmp_path / "link-to-ck"
    link.symlink_to(ck)
    convert(link, tmp_path / "o.gguf", outtype="f32", progress=False, dry_run=True)


def test_hub_cache_snapshot_links_into_its_blobs_convert(ck, tmp_path) -> None:
    """huggingface_hub's cache: models--org--name/snapshots/REV/FILE -> ../../blobs/HASH."""
    from clover_convert import ConversionError, convert

    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(ck.iterdir())):
        blob = blobs / f"{i:040x}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    out = tmp_path / "o.gguf"
    convert(snap, out, outtype="f32", progress=False)
    assert out.is_file()
    # a snapshot link that leaves the repo is still refused
    _link_out(snap, "config.json", tmp_path / "outside", (ck / "config.json").read_bytes())
    with pytest.raises(ConversionError, match="outside the checkpoint folder"):
        convert(snap, tmp_path / "o2.gguf", outtype="f32", progress=False, dry_run=True)
