"""Model files that attack: each damaged GGUF is one line and exit 1 from every front end
that opens it (clover-cli, `clover run`, `clover inspect`, `clover quantize`, `Clover()`), within
a time and memory bound; never an abort, a hang or gigabytes of memory.

* one token string on two ids: llama-vocab.cpp GGML_ASSERTs (the process aborted, exit -6);
  libclover's load checks refuse it first (clover-model.cpp, check_vocab), and gguf_info too;
* ``tokenizer.ggml.tokens``'s sub-type byte set to ARRAY: gguf-py's GGUFReader (inspect,
  quantize) took 248k strings as nested arrays (5 GB, no answer in 90 s) while the loader
  refused the file at once; gguf_info now walks the file with the loader's rules first;
* files the loader refuses that inspect showed with exit 0: overlapping tensor offsets, a
  tensor type that changes its size (39, MXFP4), an unknown type; and the other structural lies:
  duplicate tensor names, a string length past the end, a tensor past the end, a vocabulary
  count of 2**31, no vocabulary at all.

Every file lives in tmp_path; every command runs in a child with a timeout and an address-space
limit (the runaway's own measure)."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("CLOVER_CLI_PATH", ROOT / "build" / "bin" / "clover-cli"))
BOUND = 30        # seconds
MEMORY = 3 << 30  # bytes of address space for inspect / quantize's first read (Python + numpy)


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _run(args: list, limit: bool = True) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run([str(a) for a in args], capture_output=True, text=True, errors="replace", timeout=BOUND,
                           stdin=subprocess.DEVNULL, preexec_fn=_limit if limit else None)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{args}: no answer within {BOUND} s") from None
    assert 0 <= p.returncode < 128, f"{args}: killed by a signal (exit {p.returncode}): {p.stderr[-800:]}"
    return p


def _clover(*args) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "clover_cpp.cli", *args])


def _one_line(p: subprocess.CompletedProcess, match: str) -> None:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("warning")]
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0] \
        and "Traceback" not in p.stderr, f"exit {p.returncode}, want {match!r}: {p.stderr[-1500:]}"


# ----------------------------------------------------------------------------- mutations

def _reader(path: Path):  # noqa: ANN202
    import gguf

    return gguf.GGUFReader(str(path), "r+")


def _dup_token(path: Path) -> None:
    """One token's bytes replaced by another's of the same length (the file stays well-formed)."""
    f = _reader(path).fields["tokenizer.ggml.tokens"]
    toks = [bytes(f.parts[i]) for i in f.data]
    by_len: dict[int, list[int]] = {}
    for i, t in enumerate(toks):
        by_len.setdefault(len(t), []).append(i)
    a, b = next(v[:2] for n, v in sorted(by_len.items()) if len(v) >= 2 and n >= 3)
    f.parts[f.data[b]][:] = f.parts[f.data[a]]


def _tokens_array_of_arrays(path: Path) -> None:
    _reader(path).fields["tokenizer.ggml.tokens"].parts[3][0] = 9  # the sub-type: ARRAY


def _overlap(path: Path) -> None:
    r = _reader(path)
    r.tensors[2].field.parts[-1][0] = r.tensors[1].field.parts[-1][0]  # tensor 2 at tensor 1's offset


def _tensor_type(t: int):  # noqa: ANN202
    def edit(path: Path) -> None:
        r = _reader(path)
        i = next(i for i, x in enumerate(r.tensors) if x.name == "output_norm.weight")
        r.tensors[i].field.parts[-2][0] = t
    return edit


def _dup_tensor_name(path: Path) -> None:
    r = _reader(path)
    a = next(t for t in r.tensors if t.name == "blk.0.attn_norm.weight")
    b = next(t for t in r.tensors if t.name == "blk.1.attn_norm.weight")
    b.field.parts[1][:] = a.field.parts[1]


def _string_length(path: Path) -> None:
    _reader(path).fields["general.architecture"].parts[3][0] = 2**40  # the value's length


def _tensor_past_the_end(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)


def _vocab_count(path: Path) -> None:
    _reader(path).fields["tokenizer.ggml.tokens"].parts[4][0] = 2**31


def _empty_vocab(path: Path) -> None:
    from clover_testkit.fuzz import rewrite_gguf

    tmp = path.with_suffix(".src")
    path.rename(tmp)
    rewrite_gguf(tmp, path, drop=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))  # gguf-py writes no []
    tmp.unlink()


#: name -> (mutation, what inspect's line says, what the loader's line says)
CASES = {
    "dup_token": (_dup_token, "is at ids", "is at ids"),
    "tokens_array_of_arrays": (_tokens_array_of_arrays, "array of arrays", "not a valid GGUF"),
    "overlap": (_overlap, "overlap", "not a valid GGUF"),
    "tensor_type_39": (_tensor_type(39), "expected", "not a valid GGUF"),
    "tensor_type_unknown": (_tensor_type(37), "unknown ggml type 37", "not a valid GGUF"),
    "dup_tensor_name": (_dup_tensor_name, "duplicate tensor name", "not a valid GGUF"),
    "string_length": (_string_length, "past the end", "not a valid GGUF"),
    "tensor_past_the_end": (_tensor_past_the_end, "past the end of the file", ""),
    "vocab_count_2_31": (_vocab_count, "cannot fit", "not a valid GGUF"),
    "empty_vocab": (_empty_vocab, None, ""),
}


@pytest.fixture(scope="module")
def damaged(tiny_artifacts, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("damaged")
    out = {}
    for name, (edit, _, _) in CASES.items():
        p = d / f"{name}.gguf"
        shutil.copy(tiny_artifacts["f32"], p)
        edit(p)
        out[name] = p
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_inspect_refuses_what_the_loader_refuses(damaged, case: str) -> None:
    match = CASES[case][1]
    p = _clover("inspect", damaged[case])
    if match is None:  # a well-formed file the loader may take: inspect answers (it shows a file)
        assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr
        return
    _one_line(p, match)


@pytest.mark.needs_libclover
@pytest.mark.parametrize("case", list(CASES))
def test_run_and_clover_cli_refuse_it(damaged, case: str) -> None:
    match = CASES[case][2]
    _one_line(_clover("run", "-m", damaged[case], "-p", "hi", "-n", "1"), match)
    _one_line(_run([CLI, "-m", damaged[case], "-p", "hi", "-n", "1"], limit=False), match)


@pytest.mark.needs_libclover
@pytest.mark.parametrize("case", ["dup_token", "tokens_array_of_arrays", "overlap", "tensor_type_39"])
def test_quantize_refuses_it(damaged, tmp_path, case: str) -> None:
    out = tmp_path / "q.gguf"
    _one_line(_clover("quantize", damaged[case], out, "Q8_0"), "")
    assert not out.exists()


@pytest.mark.needs_libclover
def test_clover_object_refuses_a_duplicated_token(damaged) -> None:
    from clover_cpp import Clover, CloverError

    with pytest.raises(CloverError, match="is at ids"):
        Clover(damaged["dup_token"], n_ctx=256, n_threads=1)


@pytest.mark.needs_libclover
def test_serve_refuses_a_duplicated_token(damaged) -> None:
    p = _run([sys.executable, "-m", "clover_cpp.cli", "serve", "-m", damaged["dup_token"], "--port", "0"], limit=False)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error")]
    assert p.returncode == 1 and len(errors) == 1 and "is at ids" in errors[0] and "Traceback" not in p.stderr


def test_a_big_vocabulary_as_nested_arrays_is_refused_fast(tmp_path) -> None:
    """The issue's measure: 248k tokens whose sub-type says ARRAY (GGUFReader ran away)."""
    import gguf
    import numpy as np

    path = tmp_path / "arr.gguf"
    w = gguf.GGUFWriter(str(path), "clover")
    w.add_block_count(1)
    w.add_token_list([f"t{i}" for i in range(248_320)])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _tokens_array_of_arrays(path)
    _one_line(_clover("inspect", path), "array of arrays")
    _one_line(_clover("quantize", path, tmp_path / "q.gguf", "Q8_0"), "array of arrays")


def test_a_big_vocabulary_is_walked_quickly(tmp_path) -> None:
    """The walk reads every token string (for duplicates): 248k of them well within the bound."""
    import time

    import gguf
    import numpy as np

    from clover_gguf.reader import _check_structure

    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "clover")
    w.add_token_list([f"t{i}" for i in range(248_320)])
    w.add_token_merges([f"t{i} t{i + 1}" for i in range(248_320)])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t0 = time.monotonic()
    _check_structure(path)
    assert time.monotonic() - t0 < 10
