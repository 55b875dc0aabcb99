"""Reading a GGUF's header with gguf.GGUFReader (no native library needed), after walking it with
the loader's rules: :func:`read_info`, and :func:`check_clover_gguf` (a Clover GGUF that
``clover inspect``, ``clover quantize`` and the one-pass quantizing convert can read)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserFacingError
from .files import require_regular
from .keys import ARCH, CAUSAL_ARCHS, BLOCK_OPERATOR_CLOVER, BLOCK_OPERATOR_RELEASE, KEY_BLOCK_OPERATOR, KEY_SEMANTICS, SEMANTICS

__all__ = ["GGUFInfoError", "GGUFInfo", "TensorSummary", "read_info", "check_clover_gguf"]


class GGUFInfoError(UserFacingError, ValueError):
    """A user-facing problem with a model file (one line)."""


@dataclass
class TensorSummary:
    name: str
    shape: tuple[int, ...]
    type: str
    n_elements: int
    n_bytes: int


@dataclass
class GGUFInfo:
    path: Path
    file_size: int
    version: int
    architecture: str
    metadata: dict[str, Any]
    tensors: list[TensorSummary] = field(default_factory=list)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def type_counts(self) -> Counter[str]:
        return Counter(t.type for t in self.tensors)

    def layout(self) -> tuple[str, str]:
        """(layout, block operator): which checkpoint layout the file was converted from, by its
        ``clover.block_operator`` (none: a file of ours made before the key existed)."""
        op = self.metadata.get(KEY_BLOCK_OPERATOR.format(arch=self.architecture)) or BLOCK_OPERATOR_CLOVER
        if op == BLOCK_OPERATOR_RELEASE:
            return "release (CloverMoeModelLM / clover_moe)", op
        if op == BLOCK_OPERATOR_CLOVER:
            return "clover (ours: CloverForBlockDiffusion)", op
        return "unknown", str(op)

    def capabilities(self) -> dict[str, str]:
        """What libclover runs on this file: causal (B = 1), draft-self, block diffusion; "yes" or
        "no: why" (the loader's and check_block_diffusion's rules)."""
        sem = self.metadata.get(KEY_SEMANTICS.format(arch=self.architecture))
        _, op = self.layout()
        if sem != SEMANTICS:
            no = "no: weights of the retired in-place semantics (no clover.semantics = causal-shift); reconvert"
            return {"causal (B = 1)": no, "draft-self": no, "block diffusion": no}
        if op == BLOCK_OPERATOR_RELEASE:
            diff = ("no: the release's block softmax (bd_softmax_*) is not public and Clover's (ssm_mix, "
                    "ssm_block_calib) is absent")
            caps = {"causal (B = 1)": "yes", "draft-self": "yes (drafts from the trunk, the block softmax left out)",
                    "block diffusion": diff}
        elif op != BLOCK_OPERATOR_CLOVER:
            no = f"no: unknown block operator {op!r}"
            return {"causal (B = 1)": no, "draft-self": no, "block diffusion": no}
        else:
            caps = {"causal (B = 1)": "yes", "draft-self": "yes", "block diffusion": "yes"}
        if "tokenizer.ggml.mask_token_id" not in self.metadata:  # (libclover: B > 1 needs a mask token)
            no_mask = ("no: no mask token (tokenizer.ggml.mask_token_id); add mask_token_id to config.json and "
                       "convert again")
            caps = {k: (no_mask if k != "causal (B = 1)" and v.startswith("yes") else v) for k, v in caps.items()}
        return caps

    def hparams(self) -> dict[str, Any]:
        pre = self.architecture + "."
        return {k[len(pre):]: v for k, v in self.metadata.items() if k.startswith(pre)}


def _value(field: Any) -> Any:
    from gguf import GGUFValueType  # noqa: PLC0415

    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        n = len(field.data)
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            if n > 16:
                return f"[{n} strings]"
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        if n > 16:
            return f"[{n} values]"
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    v = field.parts[field.data[0]].tolist()
    return v[0] if isinstance(v, list) and len(v) == 1 else v


#: ggml's rules that gguf.cpp (the loader's parser) checks and gguf-py's GGUFReader does not
GGML_MAX_NAME = 64
GGML_MAX_DIMS = 4
_GGUF_VERSION = 3
#: GGUF value type -> its size in bytes (STRING 8: the length before its bytes; ARRAY: nested)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _ALIGN_KEY = 8, 9, "general.alignment"


def _check_structure(p: Path) -> None:
    """Walk the header, the keys and the tensor infos with gguf.cpp's rules (the loader's), each
    count bounded by the bytes left in the file, before gguf-py reads it: GGUFReader takes a
    string array whose sub-type byte says ARRAY as 248k nested arrays (5 GB of RSS for one
    changed byte) and accepts tensors that overlap or whose type ggml does not know.
    Also the vocabulary's duplicate strings (llama-vocab.cpp aborts on them). Raises
    GGUFInfoError naming the first fault."""
    import mmap  # noqa: PLC0415
    import struct  # noqa: PLC0415

    from gguf.constants import GGML_QUANT_SIZES  # noqa: PLC0415

    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFInfoError(f"{p}: not a valid GGUF file (truncated header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 4

            def bad(why: str) -> GGUFInfoError:
                return GGUFInfoError(f"{p}: not a valid GGUF file ({why})")

            def take(fmt: str, what: str) -> Any:
                nonlocal pos
                n = struct.calcsize(fmt)
                if pos + n > size:
                    raise bad(f"truncated at {what}")
                v = struct.unpack_from(fmt, mm, pos)[0]
                pos += n
                return v

            def string(what: str) -> bytes:
                nonlocal pos
                n = take("<Q", what)
                if n > size - pos:
                    raise bad(f"{what}: a string of {n} bytes, past the end of the file")
                v = mm[pos:pos + n]
                pos += n
                return v

            version = take("<I", "the version")
            if version == 0 or version == 1 or version > _GGUF_VERSION or (version & 0xFFFF) == 0:
                raise bad(f"GGUF version {version} is not supported")
            n_tensors, n_kv = take("<q", "the tensor count"), take("<q", "the key count")
            if not 0 <= n_tensors <= size // 24 or not 0 <= n_kv <= size // 12:
                raise bad(f"{n_tensors} tensors and {n_kv} keys cannot fit in {size} bytes")
            keys: set[bytes] = set()
            alignment = 32
            for i in range(n_kv):
                key = string(f"key {i}")
                if not key:
                    raise bad(f"key {i} is empty")
                if key in keys:
                    raise bad(f"duplicate key {key.decode('utf-8', 'replace')!r}")
                keys.add(key)
                name = key.decode("utf-8", "replace")
                t = take("<I", f"key {name!r}")
                n, sub = 1, t
                if t == _ARRAY:
                    sub, n = take("<I", f"key {name!r}"), take("<Q", f"key {name!r}")
                if sub == _ARRAY or (sub != _STRING and sub not in _SCALAR):
                    raise bad(f"key {name!r} has invalid GGUF type {sub}" + (" (an array of arrays)" if t == _ARRAY else ""))
                width = 8 if sub == _STRING else _SCALAR[sub]
                if n > (size - pos) // width:
                    raise bad(f"key {name!r}: {n} values cannot fit in the {size - pos} bytes left")
                if sub != _STRING:
                    if name == _ALIGN_KEY:
                        if t != 4:
                            raise bad(f"key {_ALIGN_KEY!r} must be a u32")
                        alignment = struct.unpack_from("<I", mm, pos)[0]
                    pos += n * width
                    continue
                if name == "tokenizer.ggml.tokens" and t == _ARRAY:
                    seen: dict[bytes, int] = {}
                    for j in range(n):
                        tok = string(f"token {j}").split(b"\0", 1)[0]  # the loader reads a C string
                        if tok in seen:
                            shown = tok[:48].decode("utf-8", "replace")
                            raise GGUFInfoError(f"{p}: tokenizer.ggml.tokens: the token {shown!r} is at ids "
                                                f"{seen[tok]} and {j} (a vocabulary holds each string once; the "
                                                "file is damaged)")
                        seen[tok] = j
                    continue
                for j in range(n):
                    string(f"key {name!r}")
            if alignment == 0 or alignment & (alignment - 1):
                raise bad(f"alignment {alignment} is not a power of 2")
            infos = []
            names: set[bytes] = set()
            for i in range(n_tensors):
                tname = string(f"tensor name {i}")
                shown = tname.decode("utf-8", "replace")
                if len(tname) >= GGML_MAX_NAME:
                    raise bad(f"tensor name {i} is too long ({len(tname)} >= {GGML_MAX_NAME} bytes)")
                if tname in names:
                    raise bad(f"duplicate tensor name {shown!r}")
                names.add(tname)
                n_dims = take("<I", f"tensor {shown!r}")
                if n_dims > GGML_MAX_DIMS:
                    raise bad(f"tensor {shown!r} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
                ne = [take("<q", f"tensor {shown!r}") for _ in range(n_dims)]
                if any(d < 0 for d in ne):
                    raise bad(f"tensor {shown!r} has a negative dimension {ne}")
                n_el = 1
                for d in ne:
                    n_el *= d
                if n_el >= 2**63:
                    raise bad(f"tensor {shown!r}: {ne} elements overflow")
                ttype = take("<i", f"tensor {shown!r}")
                try:
                    blck, tsize = GGML_QUANT_SIZES[ttype]  # type: ignore[index]
                except KeyError:
                    raise bad(f"tensor {shown!r} has unknown ggml type {ttype}") from None
                if ne and ne[0] % blck:
                    raise bad(f"tensor {shown!r}: a row of {ne[0]} elements is not a whole number of "
                              f"blocks of {blck}")
                infos.append((shown, n_el // blck * tsize, take("<Q", f"tensor {shown!r}")))
            data = pos + (-pos % alignment) if n_tensors else pos
            expected = 0
            for shown, nbytes, offset in infos:  # gguf.cpp: in file order, each right after the last
                if offset != expected:
                    raise bad(f"tensor {shown!r} is at data offset {offset}, expected {expected} (tensors "
                              "overlap or leave gaps)")
                expected += nbytes + (-nbytes % alignment)
            if infos and data + expected - (-infos[-1][1] % alignment) > size:
                raise bad(f"the tensor data ends past the end of the file ({data + expected} > {size} bytes: "
                          "truncated?)")


def read_info(path: str | os.PathLike[str], require_clover: bool = True) -> GGUFInfo:
    """Header of a GGUF. Raises GGUFInfoError (missing file, not a GGUF, not Clover...)."""
    p = Path(path)
    if not p.exists():
        raise GGUFInfoError(f"{p}: no such file")
    if p.is_dir():
        raise GGUFInfoError(f"{p}: is a folder, not a GGUF file")
    require_regular(p, GGUFInfoError)  # a FIFO would block open() forever
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFInfoError(f"{p}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise GGUFInfoError(f"{p}: not a GGUF file (bad magic)")
    try:
        _check_structure(p)
    except OSError as e:
        raise GGUFInfoError(f"{p}: {e.strerror or e}") from None
    try:
        from gguf import GGUFReader  # noqa: PLC0415

        r = GGUFReader(p)
    except Exception as e:  # noqa: BLE001 - any parse failure is a broken file
        raise GGUFInfoError(f"{p}: not a valid GGUF file ({type(e).__name__}: {' '.join(str(e).split())})") from None
    meta: dict[str, Any] = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            meta[k] = _value(f)
        except Exception:  # noqa: BLE001
            meta[k] = "?"
    arch = str(meta.get("general.architecture", ""))
    if require_clover and arch != ARCH and arch not in CAUSAL_ARCHS:
        raise GGUFInfoError(f"{p}: not a Clover model (general.architecture = {arch or 'missing'!s}, "
                            f"expected {ARCH}, or {' or '.join(CAUSAL_ARCHS)} for causal decoding)")
    tensors = [TensorSummary(t.name, tuple(int(x) for x in reversed(list(t.shape))), t.tensor_type.name,
                             int(t.n_elements), int(t.n_bytes)) for t in r.tensors]
    version = r.fields["GGUF.version"].parts[-1].tolist()[0] if "GGUF.version" in r.fields else 0
    return GGUFInfo(path=p, file_size=p.stat().st_size, version=int(version), architecture=arch,
                    metadata=meta, tensors=tensors)


def check_clover_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    return read_info(path, require_clover=True)
