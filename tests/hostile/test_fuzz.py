"""Fuzz suite: damaged GGUFs through the native loader (clover-cli, one process per case, so a
crash or a hang is seen as one), damaged checkpoints through the converter, and the damaged
inputs a hostile-input run found. Every case must end in a one-line error or a correct result:
no signal, no hang, no traceback, no file changed outside the output.

CLOVER_FUZZ_CASES=N runs N cases per corpus (default 48 in CI); CLOVER_FUZZ_SEED picks them.
The last test checks the totals of every corpus and prints them (pytest -s) for the README.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from clover_testkit import fuzz

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("CLOVER_CLI_PATH", ROOT / "build" / "bin" / "clover-cli"))
N_CASES = int(os.environ.get("CLOVER_FUZZ_CASES", "48"))
SEED = int(os.environ.get("CLOVER_FUZZ_SEED", "1"))

# the totals test reads what the corpus tests counted: they run in one process (one pytest-xdist
# worker under --dist loadgroup), in file order
pytestmark = pytest.mark.xdist_group("fuzz")


@dataclass
class Tally:
    """What the cases of one corpus ended in."""

    cases: int = 0
    clean_errors: int = 0
    correct_results: int = 0
    crashes: int = 0
    hangs: int = 0


TOTALS: dict[str, Tally] = {}


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _tally(corpus: str, outcome: str) -> None:
    """outcome: a field of Tally ("clean_errors", "correct_results", "crashes", "hangs")."""
    t = TOTALS.setdefault(corpus, Tally())
    t.cases += 1
    setattr(t, outcome, getattr(t, outcome) + 1)


def _run_cli(model: Path, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), "-m", str(model), "-p", "hello", "-n", "4", "-t", "1", "-c", "256",
                           "--block-size", "4"], capture_output=True, text=True, errors="replace", timeout=timeout)


def _one_line_error(p: subprocess.CompletedProcess, what: str) -> None:
    if p.returncode not in (0, 1):
        _tally("gguf", "crashes")
    assert p.returncode in (0, 1), f"{what}: exit {p.returncode} (signal?) stderr={p.stderr[-500:]}"
    if p.returncode == 1:
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{what}: {p.stderr[-500:]}"


@pytest.mark.needs_libclover
def test_gguf_fuzz(tiny_artifacts, tmp_path: Path) -> None:
    if not CLI.exists():
        pytest.skip("clover-cli is not built")
    rng = random.Random(SEED)
    src = tiny_artifacts["f16"]
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    for i in range(N_CASES):
        case = tmp_path / f"case-{i}.gguf"
        desc = fuzz.write_gguf(src, case, rng) if rng.random() < 0.8 else fuzz.flip_bytes(src, case, rng)
        try:
            p = _run_cli(case)
        except subprocess.TimeoutExpired:
            _tally("gguf", "hangs")
            pytest.fail(f"hang on case {i} ({desc})")
        _one_line_error(p, f"case {i} ({desc})")
        _tally("gguf", "clean_errors" if p.returncode else "correct_results")
        case.unlink()
    assert hashlib.sha256(src.read_bytes()).hexdigest() == before


ABORTING_METADATA = [  # llama.cpp asserted (abort) or spun forever on each of these
    ({"clover.attention.layer_norm_rms_epsilon": float("nan")}, None, "epsilon"),
    ({"clover.rope.dimension_count": 4096}, None, "rope.dimension_count"),
    ({"clover.rope.dimension_count": 0}, None, "rope.dimension_count"),
    ({"clover.rope.freq_base": float("inf")}, None, "freq_base"),
    (None, "ssm_conv1d.weight", "must be F32"),
    (None, "ssm_a", "must be F32"),
    (None, "ssm_dt.bias", "must be F32"),
    (None, "ssm_block_calib", "must be F32"),
    (None, "attn_norm.weight", "must be F32"),
]


@pytest.mark.needs_libclover
@pytest.mark.parametrize("kv,f16,msg", ABORTING_METADATA)
def test_metadata_llama_cpp_asserts_on_is_refused(tiny_artifacts, tmp_path: Path, kv, f16, msg) -> None:
    bad = fuzz.rewrite_gguf(tiny_artifacts["f32"], tmp_path / "bad.gguf", kv, f16=f16)
    code = ("import sys\nfrom clover_cpp import Clover, CloverError\n"
            "try:\n    Clover(sys.argv[1], n_ctx=64, n_threads=1).generate('hi', max_tokens=2)\n"
            "except CloverError as e:\n    print('ERR', e)\n")
    p = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("ERR") and msg in p.stdout, (p.returncode, p.stdout, p.stderr)


@pytest.mark.needs_libclover
def test_fifo_model_path_fails_fast(tmp_path: Path) -> None:
    from clover_cpp import Clover, CloverError

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(CloverError, match="not a regular file"):
        Clover(fifo)


# ----------------------------------------------------------------------------- checkpoints

def _convert(src: Path, out: Path) -> tuple[int, str]:
    from click.testing import CliRunner

    from clover_cpp.cli import cli

    res = CliRunner().invoke(cli, ["convert", str(src), str(out), "--outtype", "f16", "--no-progress"])
    return res.exit_code, res.output


def _check_convert(src: Path, out: Path, what: str, corpus: str) -> int:
    before = _digest(src)
    code, output = _convert(src, out)
    # CloverGroup turns an exception nobody anticipated into "unexpected TypeError: ..."
    crashed = code not in (0, 1) or bool(re.search(r"unexpected \w+(Error|Exception)\b", output)) \
        or "Traceback" in output
    if crashed:
        _tally(corpus, "crashes")
    assert code in (0, 1), f"{what}: exit {code}: {output[-500:]}"
    assert not re.search(r"unexpected \w+(Error|Exception)\b", output) and "Traceback" not in output, \
        f"{what}: {output[-800:]}"
    if code:
        assert len(output.strip().splitlines()) == 1 and output.startswith("error: "), f"{what}: {output}"
        assert not out.exists(), f"{what}: a failed conversion left {out}"
    assert _digest(src) == before, f"{what}: the source changed"
    assert sorted(p.name for p in out.parent.iterdir()) in ([], [out.name]), f"{what}: stray files"
    _tally(corpus, "clean_errors" if code else "correct_results")
    return code


@pytest.mark.parametrize("corpus", ["safetensors", "config", "tokenizer"])
def test_checkpoint_fuzz(tiny_artifacts, tmp_path: Path, corpus: str) -> None:
    rng = random.Random(SEED * 1000 + ["safetensors", "config", "tokenizer"].index(corpus))
    for i in range(N_CASES):
        src = tmp_path / f"ck{i}"
        shutil.copytree(tiny_artifacts["ckpt"], src)
        if corpus == "safetensors":
            desc = fuzz.mutate_safetensors_header(src / "model.safetensors", rng)
        elif corpus == "config":
            desc = fuzz.mutate_config(src / "config.json", rng)
        else:
            desc = fuzz.mutate_tokenizer(src, rng)
        (tmp_path / f"out{i}").mkdir()
        _check_convert(src, tmp_path / f"out{i}" / "m.gguf", f"case {i} ({desc})", corpus)
        shutil.rmtree(src)
        shutil.rmtree(tmp_path / f"out{i}")


def _edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


CONVERT_CASES = {  # each of these printed a Python traceback or was accepted
    "u32 overflow": ("config.json", lambda d: d.update(hidden_size=2**32 + 64)),
    "float 1e300": ("config.json", lambda d: d.update(rms_norm_eps=1e300)),
    "add_bos_token string": ("tokenizer_config.json", lambda d: d.update(add_bos_token="false")),
    "added_tokens not a list": ("tokenizer.json", lambda d: d.update(added_tokens=5)),
    "merges not a list": ("tokenizer.json", lambda d: d["model"].update(merges={"a": 1})),
}


@pytest.mark.parametrize("case", sorted(CONVERT_CASES))
def test_convert_refuses_malformed_values(tiny_artifacts, tmp_path: Path, case: str) -> None:
    src = tmp_path / "ck"
    shutil.copytree(tiny_artifacts["ckpt"], src)
    name, fn = CONVERT_CASES[case]
    _edit_json(src / name, fn)
    (tmp_path / "out").mkdir()
    assert _check_convert(src, tmp_path / "out" / "m.gguf", case, "explicit") == 1


def _rewrite_header(path: Path, fn) -> None:
    import struct

    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    fn(h)
    text = json.dumps(h).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


MALFORMED_SAFETENSORS = ["overlap", "dtype list", "weight_map values"]


@pytest.mark.parametrize("case", MALFORMED_SAFETENSORS)
def test_convert_refuses_malformed_safetensors(tiny_artifacts, tmp_path: Path, case: str) -> None:
    src = tmp_path / "ck"
    shutil.copytree(tiny_artifacts["ckpt"], src)
    st = src / "model.safetensors"
    if case == "overlap":
        def overlap(h):
            a, b = [k for k in h if k != "__metadata__"][:2]
            h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + (
                h[b]["data_offsets"][1] - h[b]["data_offsets"][0])]
        _rewrite_header(st, overlap)
    elif case == "dtype list":
        _rewrite_header(st, lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype=["F32"]))
    else:
        names = [k for k in json.loads(st.read_bytes()[8:8 + int.from_bytes(st.read_bytes()[:8], "little")])
                 if k != "__metadata__"]
        (src / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: 5 for n in names}}))
    (tmp_path / "out").mkdir()
    assert _check_convert(src, tmp_path / "out" / "m.gguf", case, "explicit") == 1


def _libclover_built() -> bool:
    from clover_cpp import _native

    try:
        _native.find_library()
        return True
    except _native.CloverLibraryNotFound:
        return False


def test_fuzz_totals_reported() -> None:
    """Every corpus that this run can build ran all its cases, each one a clean one-line error
    or a correct result: no crash, no hang. Prints the totals (pytest -s) for the README's
    reliability section."""
    want = {"safetensors": N_CASES, "config": N_CASES, "tokenizer": N_CASES,
            "explicit": len(CONVERT_CASES) + len(MALFORMED_SAFETENSORS)}
    if CLI.exists() and _libclover_built():   # else test_gguf_fuzz was skipped
        want["gguf"] = N_CASES
    missing = sorted(set(want) - set(TOTALS))
    assert not missing, f"corpora {missing} did not run in this process: run the whole module"
    for corpus, t in sorted(TOTALS.items()):
        print(f"fuzz {corpus}: {t.cases} cases, {t.clean_errors} clean errors, "
              f"{t.correct_results} correct results, {t.crashes} crashes, {t.hangs} hangs")
    for corpus, n in want.items():
        t = TOTALS[corpus]
        assert (t.crashes, t.hangs) == (0, 0), (corpus, t)
        assert t.cases == n == t.clean_errors + t.correct_results, (corpus, t)
    assert TOTALS["explicit"].correct_results == 0   # each of those cases must be refused
