#!/usr/bin/env bash
# One-command set-up and jobs for clover-cpp.
#
#   ./dev.sh demo    set up everything, then convert + generate on the embedded default model
#   ./dev.sh test    set up everything, then run the whole test suite
#   ./dev.sh setup   only the set-up (venv, pip install -e .: pinned llama.cpp + our patches, native build)
#   ./dev.sh bench   set up, build the benchmark tools, run the benchmarks
#   ./dev.sh asan    build libllama + libclover with AddressSanitizer, run the decoding tests on it
#   ./dev.sh upstream-tests  build llama.cpp's own tests on the patched tree, run them with ctest
#
# Needs only python3 (>= 3.11), gcc/g++, cmake and the package registries. Re-running
# reuses the venv, the patched tree and the build. Environment knobs:
#   CLOVER_CMAKE_ARGS  extra CMake arguments, e.g. "-DGGML_CUDA=ON" (CMAKE_ARGS too); a change
#                      configures build/ afresh
#   CLOVER_JOBS        parallel build jobs (default: number of cores)
#   CLOVER_WITH_TRAIN  1 = also install the training extra (torch) so tests/test_train.py runs
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=$ROOT/.venv
PY=$VENV/bin/python
BUILD=$ROOT/build
SDIST=${CLOVER_CACHE:-$HOME/.cache/clover-cpp}/llama_cpp_python-0.3.36.tar.gz
JOBS=${CLOVER_JOBS:-$(nproc 2>/dev/null || echo 2)}
export CCACHE_BASEDIR=$ROOT  # lets ccache reuse objects across checkouts

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

setup_python() {
    if [ ! -x "$PY" ]; then
        log "creating virtual environment in .venv"
        python3 -m venv "$VENV"
    fi
    if ! "$PY" -c "import scikit_build_core" 2>/dev/null; then
        log "installing the build backend (scikit-build-core)"
        "$PY" -m pip install -q --upgrade pip
        "$PY" -m pip install -q "scikit-build-core>=0.10"
    fi
    # the training code's tests need torch (CI sets CLOVER_WITH_TRAIN=1); the product never does.
    # torch 2.13.0 is the CPU build this machine kind keeps on local disk.
    if [ "${CLOVER_WITH_TRAIN:-0}" = 1 ] && ! "$PY" -c "import torch, matplotlib" 2>/dev/null; then
        log "installing the training extra (torch, CPU build)"
        "$PY" -m pip install -q "torch==2.13.0" "matplotlib>=3.7"
    fi
}

# llama-cpp-python's Python layer (clover quantize uses its llama_model_quantize binding); the
# pinned sdist is the one native/setup_llama.py fetched for the build
setup_llama_cpp_python() {
    # (importing llama_cpp would try to load a native lib: only look for the package)
    if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llama_cpp') is None)"; then
        # the Python low-level layer only: it loads OUR libllama (LLAMA_CPP_LIB_PATH)
        log "installing llama-cpp-python (no native build; it uses ours)"
        CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$PY" -m pip install -q "$SDIST"
    fi
}

# the ccache compiler launcher, when ccache is installed
ccache_args() {
    if command -v ccache >/dev/null; then
        echo "-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
    fi
}

# fresh_cache DIR ARGS: drop DIR's CMake cache when ARGS differ from the ones it was configured
# with (DIR/.clover-cmake-args, written after a successful configure), so that no entry of the
# old ones survives: removing -DGGML_CUDA=ON must go back to the CPU build
fresh_cache() {
    local dir=$1 args=$2
    if [ -f "$dir/CMakeCache.txt" ] && [ "$(cat "$dir/.clover-cmake-args" 2>/dev/null)" != "$args" ]; then
        log "CMake arguments changed: configuring $dir afresh"
        rm -f "$dir/CMakeCache.txt"
    fi
}

# configure DIR [cmake args...]: a plain CMake build folder (Ninja and ccache when present),
# configured again whenever its arguments (CLOVER_CMAKE_ARGS included) change
configure() {
    local dir=$1; shift
    local gen=() extra
    command -v ninja >/dev/null && gen=(-G Ninja)
    extra="$(ccache_args) ${CLOVER_CMAKE_ARGS:-}"
    fresh_cache "$dir" "$* $extra"
    [ -f "$dir/CMakeCache.txt" ] && return 0
    log "configuring $dir"
    # shellcheck disable=SC2086
    cmake -S . -B "$dir" "${gen[@]}" "$@" $extra >/dev/null
    printf '%s' "$* $extra" > "$dir/.clover-cmake-args"
}

# The package build (pyproject.toml, scikit-build-core) compiles the patched llama.cpp, libclover,
# clover-cli and ggml-rpc-server in build/ (incremental) and installs clover-cpp with its test
# dependencies in editable mode: the path `pip install .` takes. Extra targets: built after it.
build_native() {
    local args
    args="-DGGML_RPC=ON $(ccache_args) ${CLOVER_CMAKE_ARGS:-} ${CMAKE_ARGS:-}"
    fresh_cache "$BUILD" "$args"
    log "building and installing clover-cpp (pip install -e .: llama.cpp + libclover + tools in build/)"
    CMAKE_ARGS="$args" "$PY" -m pip install -q --no-build-isolation -e ".[test]"
    printf '%s' "$args" > "$BUILD/.clover-cmake-args"
    if [ $# -gt 0 ]; then
        cmake --build "$BUILD" -j "$JOBS" --target "$@"
    fi
}

setup() { setup_python; build_native "$@"; setup_llama_cpp_python; }

# llama.cpp's own tools that the tests run on clover GGUFs (the causal path: tests/test_causal_path.py,
# tests/test_semantics.py); the package build makes only what the wheel ships
TEST_TOOLS=(llama-perplexity llama-bench llama-simple llama-quantize)

# The native decoding tests, the fuzz corpus and the hardening tests once more, on an
# AddressSanitizer + UndefinedBehaviorSanitizer build of libllama + libclover + clover-cli.
# Python itself is not instrumented, so the ASan runtime (and libstdc++, for its __cxa_throw
# interceptor) is preloaded. Any sanitizer report fails the run.
asan() {
    local asan_build=$ROOT/build-asan flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
    configure "$asan_build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGGML_RPC=ON -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags"
    log "building libllama + libclover + clover-cli with AddressSanitizer + UBSan"
    cmake --build "$asan_build" -j "$JOBS" --target llama clover clover-cli clover-fuzz-load ggml-rpc-server
    log "replaying a fuzz corpus of damaged GGUFs through the loader under the sanitizers"
    local corpus; corpus=$(mktemp -d)
    "$PY" -c "import sys; from clover_testkit.checkpoints import write_checkpoint; from clover_convert import convert; \
write_checkpoint(sys.argv[1] + '/ck', preset='tiny', dtype='f32'); \
convert(sys.argv[1] + '/ck', sys.argv[1] + '/tiny.gguf', outtype='f16', progress=False)" "$corpus"
    "$PY" tests/fuzz.py gguf "$corpus/tiny.gguf" "$corpus/cases" "${CLOVER_FUZZ_CASES:-300}" >/dev/null
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        "$asan_build/bin/clover-fuzz-load" "$corpus/cases"
    rm -rf "$corpus"
    log "decoding, fuzz and hardening tests under AddressSanitizer + UBSan"
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    CLOVER_LIB_PATH="$asan_build/bin/libclover.so" CLOVER_CLI_PATH="$asan_build/bin/clover-cli" \
        "$PY" -m pytest -q tests/test_native_api.py tests/test_block_auto.py tests/test_fuzz.py \
            tests/test_hardening.py tests/test_prefix_reuse.py tests/test_threads.py \
            -k "block_pass or generate or errors or bad_clover or cost_curve or switches or calibrate or prefill or budget or disk_cache or fuzz or llama_cpp_asserts or fifo or reentrant or values or prefill or reuse or new_context or threads or close or stream or subnormal or impossible or training_block"
    log "RPC tests (client and servers) under AddressSanitizer + UBSan"
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    CLOVER_LIB_PATH="$asan_build/bin/libclover.so" CLOVER_CLI_PATH="$asan_build/bin/clover-cli" \
    CLOVER_RPC_SERVER_PATH="$asan_build/bin/ggml-rpc-server" "$PY" -m pytest -q tests/test_rpc.py
}

# llama.cpp's own tests on the patched tree (native/upstream-tests/CMakeLists.txt says which run,
# with which arguments, and why the others do not): the product's CMake configuration plus
# CLOVER_UPSTREAM_TESTS in build-upstream-tests/, where only the tests and what they link are
# built (no venv needed). Arguments go to ctest (-R REGEX, -V, ...).
upstream_tests() {
    local dir=$ROOT/build-upstream-tests
    configure "$dir" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DCLOVER_UPSTREAM_TESTS=ON
    log "building llama.cpp's own tests on the patched tree in $dir"
    cmake --build "$dir" -j "$JOBS" --target clover-upstream-tests
    log "running them (ctest -L clover-upstream)"
    (cd "$dir" && OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} \
        ctest -L clover-upstream --output-on-failure --timeout 900 -j "$JOBS" "$@")
}

# The suite on one pytest-xdist worker per core (the wheel tests and the reference cases that share
# work stay on one worker: --dist loadgroup), unless the arguments choose (-n / -p no:xdist).
# With several workers, OpenMP threads sleep when idle: spinning ones of two workers would fight
# for the cores (in one process, spinning is what keeps the 2-thread decoding tests fast).
run_tests() {
    case " $* " in
        *" -n"*|*" -p no:xdist "*|*"--numprocesses"*) "$PY" -m pytest -q "$@" ;;
        *) OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} "$PY" -m pytest -q -n "$JOBS" --dist loadgroup "$@" ;;
    esac
}

case "${1:-}" in
    setup) setup ;;
    demo)  setup; "$VENV/bin/clover" demo ;;
    test)  setup "${TEST_TOOLS[@]}"; shift; run_tests "$@" ;;
    asan)  setup; asan ;;
    upstream-tests) shift; upstream_tests "$@" ;;
    bench) setup llama-bench llama-diffusion-cli llama-quantize; shift; "$PY" benchmarks/run_all.py "$@" ;;
    *)     sed -n '2,16p' "$0"; exit 2 ;;
esac
