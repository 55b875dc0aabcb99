"""Low-level ctypes declarations for libclover (native/libclover/clover.h).

This is a thin, 1:1 layer in the style of llama-cpp-python's ``llama_cpp.llama_cpp``: the
structs mirror clover.h field for field, and every function keeps its C signature. Errors are
returned as int status codes (``CLOVER_OK`` = 0); nothing here raises on a bad status.

The library is located, in order, via
  1. the environment variable ``CLOVER_LIB_PATH`` (the library file itself or a directory
     holding it),
  2. ``build/bin`` next to the repository root (a source checkout built with CMake),
  3. ``clover_cpp/lib`` inside the installed package.
``load_library()`` raises ``CloverLibraryNotFound`` with the places tried when it is missing.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_double, c_float, c_int,
                    c_int32, c_int64, c_size_t, c_uint64, c_void_p)
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

__all__ = [
    "CloverLibraryNotFound", "CloverLibraryMismatch", "abi_mismatches", "find_library", "lib_dirs", "load_library", "lib",
    "clover_model_params", "clover_context_params", "clover_generate_params", "clover_stats",
    "clover_step_callback", "clover_block_callback", "clover_draft_callback",
]

# ----------------------------------------------------------------------------- constants
CLOVER_API_VERSION = 10

CLOVER_OK = 0
CLOVER_ERR_INVALID_ARG = -1
CLOVER_ERR_LOAD = -2
CLOVER_ERR_DECODE = -3
CLOVER_ERR_CANCELLED = -4
CLOVER_ERR_CONTEXT_FULL = -5
CLOVER_ERR_BUFFER_TOO_SMALL = -6
CLOVER_ERR_INTERNAL = -7

# block_size values besides a B >= 1 (clover.h: one meaning each)
CLOVER_BLOCK_SIZE_TRAIN = 0
CLOVER_BLOCK_SIZE_AUTO = -1
CLOVER_BLOCK_SIZE_CONTEXT = -2
CLOVER_DEFAULT_MAX_TOKENS = 256
CLOVER_DRAFT_SELF_AUTO = -1
CLOVER_CORESET_MODEL = -1  # clover_context_params.coreset: the GGUF's clover.expert_coreset
CLOVER_CORESET_AUTO = -2   # clover_context_params.coreset: measured (spec/decoding.md, "The block expert coreset")
# clover_stats.mode
DECODE_MODES = {1: "autoregressive", 2: "diffusion", 3: "draft-self"}
CLOVER_MAX_TOP_LOGPROBS = 20

CLOVER_FINISH_NONE = 0
CLOVER_FINISH_EOS = 1
CLOVER_FINISH_MAX_TOKENS = 2
CLOVER_FINISH_CANCELLED = 3
CLOVER_FINISH_STOP_TOKEN = 4

FINISH_REASONS = {CLOVER_FINISH_NONE: "", CLOVER_FINISH_EOS: "eos",
                  CLOVER_FINISH_MAX_TOKENS: "max_tokens", CLOVER_FINISH_CANCELLED: "cancelled",
                  CLOVER_FINISH_STOP_TOKEN: "stop"}


# ----------------------------------------------------------------------------- structs
class clover_model_params(Structure):
    _fields_ = [
        ("n_gpu_layers", c_int32),
        ("use_mmap", c_int32),
        ("use_mlock", c_int32),
        ("rpc_servers", c_char_p),
        ("tensor_split", POINTER(c_float)),
        ("n_tensor_split", c_int32),
        ("tensor_overrides", c_char_p),
    ]


class clover_context_params(Structure):
    _fields_ = [
        ("n_ctx", c_int32),
        ("n_threads", c_int32),
        ("block_size", c_int32),
        ("flash_attn", c_int32),
        ("kv_f32", c_int32),
        ("calib_cache", c_int32),
        ("coreset", c_int32),
        ("expert_stats", c_int32),
    ]


# int (*)(int32_t block_start, const int32_t * canvas, int32_t block_size, int32_t n_masked, void * user_data)
clover_step_callback = CFUNCTYPE(c_int, c_int32, POINTER(c_int32), c_int32, c_int32, c_void_p)
# int (*)(int32_t block_start, const int32_t * tokens, int32_t n_tokens, void * user_data)
clover_block_callback = CFUNCTYPE(c_int, c_int32, POINTER(c_int32), c_int32, c_void_p)
clover_draft_callback = CFUNCTYPE(c_int, c_int32, POINTER(c_int32), c_int32, c_void_p)


class clover_generate_params(Structure):
    _fields_ = [
        ("block_size", c_int32),
        ("threshold", c_double),
        ("max_steps", c_int32),
        ("temperature", c_double),
        ("top_k", c_int32),
        ("top_p", c_double),
        ("seed", c_uint64),
        ("max_tokens", c_int32),
        ("stop_at_eos", c_int32),
        ("step_callback", clover_step_callback),
        ("block_callback", clover_block_callback),
        ("user_data", c_void_p),
        ("reuse_prefix", c_int32),
        ("draft_self", c_int32),
        ("grammar", c_char_p),
        ("grammar_root", c_char_p),
        ("logprobs", POINTER(c_float)),
        ("n_top_logprobs", c_int32),
        ("top_tokens", POINTER(c_int32)),
        ("top_logprobs", POINTER(c_float)),
        ("draft_steps", c_int32),
        ("stop_tokens", POINTER(c_int32)),
        ("n_stop_tokens", c_int32),
        ("min_p", c_double),
        ("typical_p", c_double),
        ("top_n_sigma", c_double),
        ("xtc_probability", c_double),
        ("xtc_threshold", c_double),
        ("repeat_last_n", c_int32),
        ("repeat_penalty", c_double),
        ("frequency_penalty", c_double),
        ("presence_penalty", c_double),
        ("dry_multiplier", c_double),
        ("dry_base", c_double),
        ("dry_allowed_length", c_int32),
        ("dry_penalty_last_n", c_int32),
        ("dry_sequence_breakers", POINTER(c_char_p)),
        ("n_dry_sequence_breakers", c_int32),
        ("mirostat", c_int32),
        ("mirostat_tau", c_double),
        ("mirostat_eta", c_double),
        ("logit_bias_tokens", POINTER(c_int32)),
        ("logit_bias", POINTER(c_float)),
        ("n_logit_bias", c_int32),
        ("samplers", c_char_p),
        ("dynatemp_range", c_double),
        ("dynatemp_exponent", c_double),
        ("min_keep", c_int32),
        ("draft_callback", clover_draft_callback),
    ]


class clover_stats(Structure):
    _fields_ = [
        ("n_prompt", c_int32),
        ("n_generated", c_int32),
        ("n_forward", c_int32),
        ("n_decode_passes", c_int32),
        ("n_steps", c_int32),
        ("n_commits", c_int32),
        ("n_blocks", c_int32),
        ("finish_reason", c_int32),
        ("tokens_per_forward", c_double),
        ("t_prefill_ms", c_double),
        ("t_decode_ms", c_double),
        ("tokens_per_second", c_double),
        ("block_size", c_int32),
        ("n_block_switches", c_int32),
        ("calibration", c_int32),
        ("n_reused", c_int32),
        ("n_verifications", c_int32),
        ("n_drafted", c_int32),
        ("n_accepted", c_int32),
        ("n_decode_forwards", c_int32),
        ("grammar_mode", c_int32),
        ("mode", c_int32),
        ("n_blocks_ar", c_int32),
        ("n_blocks_diffusion", c_int32),
        ("n_blocks_draft_self", c_int32),
        ("tokens_per_verification", c_double),
        ("n_graphs_reused", c_int32),
        ("n_expert_passes", c_int32),
        ("experts_per_pass", c_double),
        ("expert_bytes_per_pass", c_double),
        ("expert_bytes_b1", c_double),
    ]


clover_model_p = c_void_p     # opaque clover_model *
clover_context_p = c_void_p   # opaque clover_context *
c_int32_p = POINTER(c_int32)
c_float_p = POINTER(c_float)
c_double_p = POINTER(c_double)


# ----------------------------------------------------------------------------- loading
class CloverLibraryNotFound(OSError):
    """No usable libclover (missing, not loadable, or not the ABI of these declarations)."""


class CloverLibraryMismatch(CloverLibraryNotFound):
    """The libclover found was built from another clover.h than these declarations (an API
    version, a struct's size or a field's offset differs): one line naming the first difference."""


def _lib_names() -> list[str]:
    if sys.platform == "darwin":
        return ["libclover.dylib"]
    if sys.platform.startswith("win"):
        return ["clover.dll", "libclover.dll"]
    return ["libclover.so"]


def lib_dirs() -> list[Path]:
    """The folders that may hold the native libraries (libclover, libllama, ggml), in order: that
    of CLOVER_LIB_PATH (the library file or its folder), build/bin of a source checkout,
    clover_cpp/lib of an installed wheel. The one place the project looks for them."""
    here = Path(__file__).resolve().parent
    env = os.environ.get("CLOVER_LIB_PATH")
    dirs = [Path(env) if Path(env).is_dir() else Path(env).parent] if env else []
    return dirs + [here.parent / "build" / "bin", here / "lib"]


def _candidates() -> list[Path]:
    env = os.environ.get("CLOVER_LIB_PATH")
    if env and not Path(env).is_dir():  # the file itself, whatever its name, then the defaults
        return [Path(env)] + [d / n for d in lib_dirs()[1:] for n in _lib_names()]
    return [d / n for d in lib_dirs() for n in _lib_names()]


def find_library() -> Path:
    """Path of libclover, or CloverLibraryNotFound listing where it looked."""
    tried = _candidates()
    env = os.environ.get("CLOVER_LIB_PATH")
    if env:  # an explicit setting must not silently fall back to another build
        for p in tried[: (len(_lib_names()) if Path(env).is_dir() else 1)]:
            if p.is_file():
                return p
        raise CloverLibraryNotFound(f"CLOVER_LIB_PATH={env!r} does not name libclover "
                                    f"(tried: {', '.join(map(str, tried[:len(_lib_names())]))})")
    for p in tried:
        if p.is_file():
            return p
    checkout = Path(__file__).resolve().parent.parent
    in_checkout = (checkout / "native" / "libclover" / "clover.h").is_file()
    how = ("build it with `./dev.sh setup` (or `pip install -e .`)" if in_checkout
           else "reinstall clover-cpp (`pip install --force-reinstall clover-cpp`), whose wheel carries it")
    raise CloverLibraryNotFound(
        "libclover not found (tried: " + ", ".join(map(str, tried)) + f"): {how}, or set CLOVER_LIB_PATH "
        "to the library file or its directory.")


# ----------------------------------------------------------------------------- functions
# One typed stub per function of clover.h, in its order (as llama-cpp-python's llama_cpp.py):
# @_c(name, argtypes, restype) records the C signature, which load_library() sets on the
# library's function; calling the stub calls it (lib().name(...) is the same function).
_DECLS: dict[str, tuple[list[Any], Any]] = {}
_F = TypeVar("_F", bound=Callable[..., Any])
c_char_buf = c_char_p  # char * err / buf (a ctypes.create_string_buffer)


def _c(name: str, argtypes: list[Any], restype: Any) -> Callable[[_F], _F]:
    def deco(stub: _F) -> _F:
        _DECLS[name] = (argtypes, restype)

        @functools.wraps(stub)
        def call(*args: Any) -> Any:
            return getattr(lib(), name)(*args)

        return call  # type: ignore[return-value]

    return deco


@_c("clover_api_version", [], c_int32)
def clover_api_version() -> int: ...


@_c("clover_abi_query", [c_char_p], c_int64)
def clover_abi_query(what: bytes, /) -> int: ...


@_c("clover_status_str", [c_int], c_char_p)
def clover_status_str(status: int, /) -> bytes: ...


@_c("clover_set_verbosity", [c_int], None)
def clover_set_verbosity(level: int, /) -> None: ...


@_c("clover_set_notices", [c_int], None)
def clover_set_notices(on: int, /) -> None: ...


@_c("clover_model_default_params", [], clover_model_params)
def clover_model_default_params() -> clover_model_params: ...


@_c("clover_model_load", [c_char_p, POINTER(clover_model_params), c_char_buf, c_size_t], clover_model_p)
def clover_model_load(path: bytes, params: Any, err: Any, err_len: int, /) -> int | None: ...


@_c("clover_model_free", [clover_model_p], None)
def clover_model_free(model: int | None, /) -> None: ...


@_c("clover_n_vocab", [clover_model_p], c_int32)
def clover_n_vocab(model: int | None, /) -> int: ...


@_c("clover_mask_token", [clover_model_p], c_int32)
def clover_mask_token(model: int | None, /) -> int: ...


@_c("clover_eos_token", [clover_model_p], c_int32)
def clover_eos_token(model: int | None, /) -> int: ...


@_c("clover_bos_token", [clover_model_p], c_int32)
def clover_bos_token(model: int | None, /) -> int: ...


@_c("clover_train_block_size", [clover_model_p], c_int32)
def clover_train_block_size(model: int | None, /) -> int: ...


@_c("clover_n_ctx_train", [clover_model_p], c_int32)
def clover_n_ctx_train(model: int | None, /) -> int: ...


@_c("clover_model_meta", [clover_model_p, c_char_p, c_char_buf, c_size_t], c_int32)
def clover_model_meta(model: int | None, key: bytes, buf: Any, buf_size: int, /) -> int: ...


@_c("clover_tokenize", [clover_model_p, c_char_p, c_int32, c_int32_p, c_int32, c_int, c_int, c_int32_p], c_int)
def clover_tokenize(model: int | None, text: bytes, text_len: int, tokens: Any, n_max: int, add_special: int,
                    parse_special: int, n_out: Any, /) -> int: ...


@_c("clover_token_to_piece", [clover_model_p, c_int32, c_char_buf, c_int32, c_int, c_int32_p], c_int)
def clover_token_to_piece(model: int | None, token: int, buf: Any, buf_size: int, special: int, n_out: Any,
                          /) -> int: ...


@_c("clover_detokenize", [clover_model_p, c_int32_p, c_int32, c_char_buf, c_int32, c_int, c_int, c_int32_p], c_int)
def clover_detokenize(model: int | None, tokens: Any, n_tokens: int, buf: Any, buf_size: int, remove_special: int,
                      unparse_special: int, n_out: Any, /) -> int: ...


@_c("clover_context_default_params", [], clover_context_params)
def clover_context_default_params() -> clover_context_params: ...


@_c("clover_context_params_check", [POINTER(clover_context_params), c_char_buf, c_size_t], c_int)
def clover_context_params_check(params: Any, err: Any, err_len: int, /) -> int: ...


@_c("clover_context_new", [clover_model_p, POINTER(clover_context_params), c_char_buf, c_size_t], clover_context_p)
def clover_context_new(model: int | None, params: Any, err: Any, err_len: int, /) -> int | None: ...


@_c("clover_context_free", [clover_context_p], None)
def clover_context_free(ctx: int | None, /) -> None: ...


@_c("clover_block_size", [clover_context_p], c_int32)
def clover_block_size(ctx: int | None, /) -> int: ...


@_c("clover_n_ctx", [clover_context_p], c_int32)
def clover_n_ctx(ctx: int | None, /) -> int: ...


@_c("clover_set_block_size", [clover_context_p, c_int32, c_char_buf, c_size_t], c_int)
def clover_set_block_size(ctx: int | None, block_size: int, err: Any, err_len: int, /) -> int: ...


@_c("clover_set_n_threads", [clover_context_p, c_int32], c_int)
def clover_set_n_threads(ctx: int | None, n_threads: int, /) -> int: ...


@_c("clover_set_coreset", [clover_context_p, c_int32, c_char_buf, c_size_t], c_int)
def clover_set_coreset(ctx: int | None, coreset: int, err: Any, err_len: int, /) -> int: ...


@_c("clover_coreset", [clover_context_p], c_int32)
def clover_coreset(ctx: int | None, /) -> int: ...


@_c("clover_expert_stats", [clover_context_p, POINTER(clover_stats)], c_int)
def clover_expert_stats(ctx: int | None, stats: Any, /) -> int: ...


@_c("clover_block_pass", [clover_context_p, c_int32_p, c_int32, c_float_p, c_char_buf, c_size_t], c_int)
def clover_block_pass(ctx: int | None, tokens: Any, n: int, logits_out: Any, err: Any, err_len: int, /) -> int: ...


@_c("clover_commit_logits", [clover_context_p, c_int32_p, c_int32, c_float_p, c_char_buf, c_size_t], c_int)
def clover_commit_logits(ctx: int | None, tokens: Any, n: int, logits_out: Any, err: Any, err_len: int,
                         /) -> int: ...


@_c("clover_commit", [clover_context_p, c_int32_p, c_int32, c_char_buf, c_size_t], c_int)
def clover_commit(ctx: int | None, tokens: Any, n: int, err: Any, err_len: int, /) -> int: ...


@_c("clover_last_logits", [clover_context_p, c_float_p], c_int)
def clover_last_logits(ctx: int | None, logits_out: Any, /) -> int: ...


@_c("clover_reset", [clover_context_p], c_int)
def clover_reset(ctx: int | None, /) -> int: ...


@_c("clover_n_committed", [clover_context_p], c_int32)
def clover_n_committed(ctx: int | None, /) -> int: ...


@_c("clover_committed_tokens", [clover_context_p, c_int32_p, c_int32], c_int32)
def clover_committed_tokens(ctx: int | None, out: Any, n_max: int, /) -> int: ...


@_c("clover_state_size", [clover_context_p], c_size_t)
def clover_state_size(ctx: int | None, /) -> int: ...


@_c("clover_state_save", [clover_context_p, c_char_buf, c_size_t, POINTER(c_size_t), c_char_buf, c_size_t], c_int)
def clover_state_save(ctx: int | None, dst: Any, size: int, n_written: Any, err: Any, err_len: int, /) -> int: ...


@_c("clover_state_load", [clover_context_p, c_char_p, c_size_t, c_char_buf, c_size_t], c_int)
def clover_state_load(ctx: int | None, src: Any, size: int, err: Any, err_len: int, /) -> int: ...


@_c("clover_calibrate", [clover_context_p, c_int32_p, c_double_p, c_double_p, c_int32, c_int32_p, c_char_buf,
                         c_size_t], c_int)
def clover_calibrate(ctx: int | None, sizes_out: Any, ms_out: Any, ms_fused_out: Any, cap: int, n_out: Any, err: Any,
                     err_len: int, /) -> int: ...


@_c("clover_set_cost_curve", [clover_context_p, c_int32_p, c_double_p, c_double_p, c_int32, c_char_buf, c_size_t],
    c_int)
def clover_set_cost_curve(ctx: int | None, sizes: Any, ms: Any, ms_fused: Any, n: int, err: Any, err_len: int,
                          /) -> int: ...


@_c("clover_generate_default_params", [], clover_generate_params)
def clover_generate_default_params() -> clover_generate_params: ...


@_c("clover_generate_params_check", [POINTER(clover_generate_params), c_char_buf, c_size_t], c_int)
def clover_generate_params_check(params: Any, err: Any, err_len: int, /) -> int: ...


@_c("clover_stats_cut", [POINTER(clover_stats), c_int32], c_int)
def clover_stats_cut(stats: Any, n_generated: int, /) -> int: ...


@_c("clover_generate", [clover_context_p, c_int32_p, c_int32, POINTER(clover_generate_params), c_int32_p, c_int32,
                        c_int32_p, POINTER(clover_stats), c_char_buf, c_size_t], c_int)
def clover_generate(ctx: int | None, prompt: Any, n_prompt: int, params: Any, out: Any, out_cap: int, n_out: Any,
                    stats: Any, err: Any, err_len: int, /) -> int: ...


@_c("clover_generate_room", [clover_context_p, POINTER(clover_generate_params), c_int32], c_int32)
def clover_generate_room(ctx: int | None, params: Any, n_prompt: int, /) -> int: ...


clover_stop_matcher_p = c_void_p  # opaque clover_stop_matcher *


@_c("clover_stop_matcher_new", [POINTER(c_char_p), c_int32], clover_stop_matcher_p)
def clover_stop_matcher_new(stops: Any, n_stops: int, /) -> int | None: ...


@_c("clover_stop_matcher_free", [clover_stop_matcher_p], None)
def clover_stop_matcher_free(m: int | None, /) -> None: ...


@_c("clover_stop_matcher_feed", [clover_stop_matcher_p, c_char_p, c_int32, c_int32_p], POINTER(ctypes.c_char))
def clover_stop_matcher_feed(m: int | None, text: bytes, len: int, n_out: Any, /) -> Any: ...


@_c("clover_stop_matcher_flush", [clover_stop_matcher_p, c_int32_p], POINTER(ctypes.c_char))
def clover_stop_matcher_flush(m: int | None, n_out: Any, /) -> Any: ...


@_c("clover_stop_matcher_hit", [clover_stop_matcher_p], c_int32)
def clover_stop_matcher_hit(m: int | None, /) -> int: ...


@_c("clover_json_schema_to_grammar", [c_char_p, c_char_buf, c_int32, c_int32_p, c_char_buf, c_size_t], c_int)
def clover_json_schema_to_grammar(schema_json: bytes, buf: Any, buf_size: int, n_out: Any, err: Any, err_len: int,
                                  /) -> int: ...


# clover-testing.h: the decoding loop's pure pieces, exported for the tests (not the public API;
# declared here so that the library's functions get their types at load, as every other one)
@_c("clover_pick_candidate", [c_float_p, c_int32, c_int32, c_double, c_int32, c_double, c_uint64, c_int32_p,
                              c_double_p], c_int)
def clover_pick_candidate(logits: Any, n_vocab: int, mask_token: int, temperature: float, top_k: int, top_p: float,
                          seed: int, token_out: Any, confidence_out: Any, /) -> int: ...


@_c("clover_select_unmask", [c_double_p, c_int32, c_double, c_int32, c_int32, c_int32_p], c_int32)
def clover_select_unmask(conf: Any, n_masked: int, threshold: float, max_steps: int, step: int, order_out: Any,
                         /) -> int: ...


@_c("clover_set_coreset_probe", [clover_context_p, c_double, c_int32_p, c_double_p, c_double_p, c_int32], c_int)
def clover_set_coreset_probe(ctx: int | None, full_ms: float, C: Any, ms: Any, agree: Any, n: int, /) -> int: ...


# clover-chat.h: llama.cpp's chat formats (common/chat.cpp), JSON in and out (clover_cpp.chat_format)
@_c("clover_chat_params", [c_char_p, POINTER(c_char_p), c_char_buf, c_size_t], c_int)
def clover_chat_params(request_json: bytes, out: Any, err: Any, err_len: int, /) -> int: ...


@_c("clover_chat_parse", [c_char_p, POINTER(c_char_p), c_char_buf, c_size_t], c_int)
def clover_chat_parse(request_json: bytes, out: Any, err: Any, err_len: int, /) -> int: ...


@_c("clover_chat_parser_new", [c_char_p, POINTER(c_void_p), c_char_buf, c_size_t], c_int)
def clover_chat_parser_new(params_json: bytes, out: Any, err: Any, err_len: int, /) -> int: ...


@_c("clover_chat_parser_parse", [c_void_p, c_char_p, c_int, POINTER(c_char_p), c_char_buf, c_size_t], c_int)
def clover_chat_parser_parse(parser: Any, text: bytes, is_partial: int, out: Any, err: Any, err_len: int,
                             /) -> int: ...


@_c("clover_chat_parser_free", [c_void_p], None)
def clover_chat_parser_free(parser: Any, /) -> None: ...


def _declare(L: ctypes.CDLL) -> ctypes.CDLL:
    """Set every recorded signature on the library's functions (AttributeError: one is missing)."""
    for name, (argtypes, restype) in _DECLS.items():
        f = getattr(L, name)
        f.argtypes, f.restype = argtypes, restype
    return L


# ----------------------------------------------------------------------------- ABI check
# the structs and constants above, compared with the library's clover_abi_query at load
STRUCTS = (clover_model_params, clover_context_params, clover_generate_params, clover_stats)
CONSTANTS = ("CLOVER_API_VERSION", "CLOVER_OK", "CLOVER_ERR_INVALID_ARG", "CLOVER_ERR_LOAD", "CLOVER_ERR_DECODE",
             "CLOVER_ERR_CANCELLED", "CLOVER_ERR_CONTEXT_FULL", "CLOVER_ERR_BUFFER_TOO_SMALL", "CLOVER_ERR_INTERNAL",
             "CLOVER_FINISH_NONE", "CLOVER_FINISH_EOS", "CLOVER_FINISH_MAX_TOKENS", "CLOVER_FINISH_CANCELLED",
             "CLOVER_FINISH_STOP_TOKEN", "CLOVER_BLOCK_SIZE_TRAIN", "CLOVER_BLOCK_SIZE_AUTO", "CLOVER_BLOCK_SIZE_CONTEXT",
             "CLOVER_DRAFT_SELF_AUTO", "CLOVER_CORESET_MODEL", "CLOVER_CORESET_AUTO", "CLOVER_MAX_TOP_LOGPROBS", "CLOVER_DEFAULT_MAX_TOKENS")


def abi_mismatches(L: ctypes.CDLL, structs: Sequence[type] | None = None,
                   constants: Sequence[str] | None = None) -> list[str]:
    """How these declarations differ from the library's (clover_abi_query): the API version, each
    struct's size, alignment and field count, each field's offset, each constant's value; [] = none.
    structs / constants: default STRUCTS / CONSTANTS (read at the call)."""
    structs = STRUCTS if structs is None else structs
    constants = CONSTANTS if constants is None else constants
    out: list[str] = []
    if L.clover_api_version() != CLOVER_API_VERSION:
        out.append(f"API version {L.clover_api_version()}, these bindings are for {CLOVER_API_VERSION}")

    def q(what: str) -> int:
        return int(L.clover_abi_query(what.encode()))

    for S in structs:
        name = S.__name__
        for what, mine in ((f"sizeof {name}", ctypes.sizeof(S)), (f"alignof {name}", ctypes.alignment(S)),
                           (f"fields {name}", len(S._fields_))):
            if q(what) != mine:
                out.append(f"{what} = {q(what)} in the library, {mine} here")
        for f in S._fields_:
            what = f"offsetof {name}.{f[0]}"
            if q(what) != getattr(S, f[0]).offset:
                out.append(f"{what} = {q(what)} in the library, {getattr(S, f[0]).offset} here")
    g = globals()
    for c in constants:
        if q(f"known value {c}") != 1 or q(f"value {c}") != g[c]:
            out.append(f"{c} = {q(f'value {c}') if q(f'known value {c}') == 1 else 'unknown'} in the library, "
                       f"{g[c]} here")
    return out


def _check_abi(L: ctypes.CDLL, p: Path) -> None:
    how = "rebuild it (./dev.sh build) or reinstall clover-cpp"
    if not hasattr(L, "clover_abi_query"):
        raise CloverLibraryMismatch(f"libclover at {p} predates clover_abi_query (API version < 2): {how}")
    L.clover_api_version.restype, L.clover_api_version.argtypes = c_int32, []
    L.clover_abi_query.restype, L.clover_abi_query.argtypes = c_int64, [c_char_p]
    bad = abi_mismatches(L)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CloverLibraryMismatch(f"libclover at {p} does not match clover_cpp's declarations of clover.h: "
                                    f"{bad[0]}{more}; {how}")


_lib: ctypes.CDLL | None = None


def load_library(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Load (once) and declare libclover. `path` overrides the search."""
    global _lib
    if _lib is not None and path is None:
        return _lib
    p = Path(path) if path is not None else find_library()
    try:
        L = ctypes.CDLL(str(p))
    except OSError as e:
        raise CloverLibraryNotFound(f"cannot load {p}: {e}") from e
    _check_abi(L, p)
    _declare(L)
    if path is None:
        _lib = L
    return L


def lib() -> ctypes.CDLL:
    return load_library()


def err_buffer(size: int = 1024):
    """A buffer for the `err, err_len` arguments: (buffer, length)."""
    return ctypes.create_string_buffer(size), size


def generate_params_problem(gp: clover_generate_params) -> str | None:
    """libclover's rules for generate parameters (clover_generate_params_check, the one owner of
    the ranges): None when gp keeps all of them, else the one-line message of the first broken one."""
    err, n = err_buffer(256)
    if clover_generate_params_check(ctypes.byref(gp), err, n) == CLOVER_OK:
        return None
    return err.value.decode("utf-8", "replace")


def context_params_problem(cp: clover_context_params) -> str | None:
    """libclover's rules for context parameters (clover_context_params_check): None when cp keeps
    all of them, else the one-line message of the first broken one."""
    err, n = err_buffer(256)
    if clover_context_params_check(ctypes.byref(cp), err, n) == CLOVER_OK:
        return None
    return err.value.decode("utf-8", "replace")


def as_int32_array(tokens) -> "ctypes.Array[c_int32]":
    """An int32 array of the values (ValueError for one that does not fit: ctypes would wrap it)."""
    seq = [int(t) for t in tokens]
    for t in seq:
        if not -2**31 <= t < 2**31:
            raise ValueError(f"{t} does not fit a 32-bit integer")
    return (c_int32 * max(len(seq), 1))(*seq)
