#!/usr/bin/env bash
# One-command set-up and jobs for clover-cpp.
#
#   ./dev.sh demo    set up everything, then convert + generate on the embedded default model
#   ./dev.sh test    set up everything, then run the whole test suite
#   ./dev.sh setup   only the set-up (venv, pip install -e .: pinned llama.cpp + our patches, native build,
#                    llama.cpp's tools: llama-cli, llama-server, llama-perplexity, ... in build/bin)
#   ./dev.sh bench   set up, build the benchmark tools, run the benchmarks
#   ./dev.sh asan    build libllama + libclover with AddressSanitizer, run the decoding tests on it
#   ./dev.sh upstream-tests  build llama.cpp's own tests on the patched tree, run them with ctest
#   ./dev.sh vulkan  build libllama + libclover + clover-cli with ggml's Vulkan backend in
#                    build-vulkan/, run tests/vulkan and test-backend-ops on it (Mesa's llvmpipe)
#   ./dev.sh cuda-compile [SECONDS]  configure build-cuda/ (-DGGML_CUDA=ON) and compile it
#                    (every target, or what fits in SECONDS), printing the time
#
# Needs only python3 (>= 3.11), gcc/g++, cmake and the package registries. Re-running
# reuses the venv, the patched tree and the build. Environment knobs:
#   CLOVER_CMAKE_ARGS  extra CMake arguments, e.g. "-DGGML_CUDA=ON" (CMAKE_ARGS too); a change
#                      configures build/ afresh
#   CLOVER_JOBS        parallel build jobs (default: number of cores)
#   CLOVER_WITH_TRAIN  1 = also install the training extra (torch) so tests/project/test_train.py runs
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
# pinned sdist is the one native/scripts/setup_llama.py fetched for the build
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
    case " $args " in *" -DGGML_VULKAN=ON "*|*" -DGGML_VULKAN=1 "*) vulkan_deps ;; esac
    fresh_cache "$BUILD" "$args"
    log "building and installing clover-cpp (pip install -e .: llama.cpp + libclover + tools in build/)"
    CMAKE_ARGS="$args" "$PY" -m pip install -q --no-build-isolation -e ".[test]"
    printf '%s' "$args" > "$BUILD/.clover-cmake-args"
    if [ $# -gt 0 ]; then
        cmake --build "$BUILD" -j "$JOBS" --target "$@"
    fi
}

# llama.cpp's own tools, from the same patched tree: they run clover GGUFs causally (B = 1;
# tests/native/test_llama_tools.py, tests/native/test_causal_path.py). The package build makes only
# what the wheel ships; on two cores they add ~16 min to a first set-up (ccache: seconds after that).
LLAMA_TOOLS=(llama-cli llama-server llama-completion llama-perplexity llama-bench llama-tokenize llama-quantize
             llama-imatrix llama-gguf-split)
setup() { setup_python; build_native "${LLAMA_TOOLS[@]}" "$@"; setup_llama_cpp_python; }

# the other llama.cpp programs the tests run (tests/reference/test_semantics.py)
TEST_TOOLS=(llama-simple)

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
    "$PY" -m clover_testkit.fuzz gguf "$corpus/tiny.gguf" "$corpus/cases" "${CLOVER_FUZZ_CASES:-300}" >/dev/null
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        "$asan_build/bin/clover-fuzz-load" "$corpus/cases"
    rm -rf "$corpus"
    log "decoding, fuzz and hardening tests under AddressSanitizer + UBSan"
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    CLOVER_LIB_PATH="$asan_build/bin/libclover.so" CLOVER_CLI_PATH="$asan_build/bin/clover-cli" \
        "$PY" -m pytest -q tests/native/test_native_{parity,decoding,arguments,sampling_and_callbacks,model}.py \
            tests/native/test_block_auto.py tests/hostile/test_{fuzz,hardening}.py tests/runtime/test_{prefix_reuse,threads}.py \
            -k "block_pass or generate or errors or bad_clover or cost_curve or switches or calibrate or prefill or budget or disk_cache or fuzz or llama_cpp_asserts or fifo or reentrant or values or prefill or reuse or new_context or threads or close or stream or subnormal or impossible or training_block"
    log "RPC tests (client and servers) under AddressSanitizer + UBSan"
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    CLOVER_LIB_PATH="$asan_build/bin/libclover.so" CLOVER_CLI_PATH="$asan_build/bin/clover-cli" \
    CLOVER_RPC_SERVER_PATH="$asan_build/bin/ggml-rpc-server" "$PY" -m pytest -q tests/native/test_rpc.py
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

# Debian's packages for ggml's Vulkan backend (the loader and vulkan.hpp, glslc and the SPIR-V
# headers for the shaders, Mesa's drivers: llvmpipe is a Vulkan 1.3 device that runs on the
# CPU), installed when missing
VULKAN_PACKAGES=(libvulkan-dev glslc spirv-headers mesa-vulkan-drivers)
vulkan_deps() {
    if [ -f /usr/include/vulkan/vulkan.hpp ] && command -v glslc >/dev/null \
            && [ -d /usr/include/spirv ] && compgen -G "/usr/share/vulkan/icd.d/*.json" >/dev/null; then
        return 0
    fi
    if ! command -v apt-get >/dev/null; then
        echo "error: the Vulkan build needs the Vulkan headers and loader, glslc and a Vulkan driver" \
             "(Debian/Ubuntu: ${VULKAN_PACKAGES[*]})" >&2
        exit 1
    fi
    local sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    log "installing Debian's Vulkan packages (${VULKAN_PACKAGES[*]})"
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${VULKAN_PACKAGES[@]}" >/dev/null
}

# llama.cpp's CI settings for Mesa's llvmpipe (.github/workflows/build-vulkan.yml, ubuntu-llvmpipe):
# the first device only, no f16 arithmetic and no cooperative matrices (llvmpipe's are slow or absent)
VULKAN_ENV=(GGML_VK_VISIBLE_DEVICES=0 GGML_VK_DISABLE_F16=1 GGML_VK_DISABLE_COOPMAT=1)
# tests/vulkan with ggml-vulkan's defaults, fused shaders on. Debian 12's llvmpipe (Mesa 22.3) read
# descriptor bindings a dispatch does not use and died on a destroyed buffer left in one (patch 0014
# fixes it; docs/install.md); the tests that met it run Clover in child processes, so that a driver
# crash fails one test and does not end the run.
VULKAN_TEST_ENV=("${VULKAN_ENV[@]}")
VULKAN_BUILD=$ROOT/build-vulkan

# libllama + libclover + clover-cli + ggml-rpc-server with the Vulkan backend beside the CPU one,
# in build-vulkan/ (never build/), plus clover-ops and llama.cpp's test-backend-ops
vulkan_build() {
    vulkan_deps
    configure "$VULKAN_BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DGGML_VULKAN=ON -DCLOVER_UPSTREAM_TESTS=ON
    log "building libllama + libclover + clover-cli with ggml's Vulkan backend in $VULKAN_BUILD"
    local t0=$SECONDS
    cmake --build "$VULKAN_BUILD" -j "$JOBS" --target llama clover clover-cli ggml-rpc-server clover-ops
    log "Vulkan build of libllama + libclover + clover-cli: $((SECONDS - t0)) s"
    cmake --build "$VULKAN_BUILD" -j "$JOBS" --target test-backend-ops  # (+ llama.cpp's common library)
    log "Vulkan build with test-backend-ops: $((SECONDS - t0)) s"
}

# llama.cpp's test-backend-ops on the Vulkan device against the CPU. Debian 12's llvmpipe (Mesa
# 22.3) now and then crashes inside the driver once every case has printed OK (a segfault in
# libvulkan_lvp.so, glibc's "corrupted double-linked list" after FLASH_ATTN_EXT): a death by
# signal with no FAIL printed is reported loudly and not counted; a FAIL, or no case run, fails.
backend_ops() {
    local out rc
    out=$(mktemp)
    set +e
    env "${VULKAN_ENV[@]}" "$VULKAN_BUILD/bin/test-backend-ops" test -b Vulkan0 "$@" > "$out" 2>&1
    rc=$?
    set -e
    cat "$out"
    if [ "$rc" -gt 128 ] && ! grep -q FAIL "$out" && grep -q OK "$out"; then
        echo "WARNING: test-backend-ops $* died of signal $((rc - 128)) after $(grep -c OK "$out") cases, none failed" \
             "(a crash inside llvmpipe, not a wrong result)" >&2
        rc=0
    fi
    rm -f "$out"
    return "$rc"
}

# test-backend-ops for the ops of the clover graph, the Vulkan device against the CPU backend.
# The op list comes from clover-ops on the tiny preset (a causal commit and a commit fused with a
# block pass); every op's own sweep runs, except MUL_MAT, MUL_MAT_ID and FLASH_ATTN_EXT, whose
# sweeps are thousands of cases (FLASH_ATTN_EXT alone ran past an hour on llvmpipe): those run as
# the clover graph has them, every distinct node of its graphs (`clover-ops --export`, the format
# of llama.cpp's test-export-graph-ops) for the tiny preset in f32 and Q8_0 and the small preset in
# Q4_K_M (the K-quant matrix products users' GGUFs run), through `test-backend-ops --test-file`.
vulkan_backend_ops() {
    local dir; dir=$(mktemp -d)
    "$PY" -c "import sys; from clover_testkit.checkpoints import write_checkpoint; \
from clover_convert import convert; from clover_convert.quantize_stream import convert_quantized; \
write_checkpoint(sys.argv[1] + '/tiny', preset='tiny', dtype='f32'); \
write_checkpoint(sys.argv[1] + '/small', preset='small', dtype='f32'); \
convert(sys.argv[1] + '/tiny', sys.argv[1] + '/tiny-f32.gguf', outtype='f32', progress=False); \
convert(sys.argv[1] + '/tiny', sys.argv[1] + '/tiny-q8_0.gguf', outtype='q8_0', progress=False); \
convert_quantized(sys.argv[1] + '/small', sys.argv[1] + '/small-q4_k_m.gguf', 'Q4_K_M', progress=False)" "$dir"
    local ops op plain=() sort_rows=0 gguf
    # the op list (printed) and the cases (--export) from one run per model
    ops=$(env "${VULKAN_ENV[@]}" "$VULKAN_BUILD/bin/clover-ops" "$dir/tiny-f32.gguf" 8 --export "$dir/tiny-f32.cases")
    for gguf in tiny-q8_0 small-q4_k_m; do
        env "${VULKAN_ENV[@]}" "$VULKAN_BUILD/bin/clover-ops" "$dir/$gguf.gguf" 8 --export "$dir/$gguf.cases" >/dev/null
    done
    cat "$dir"/*.cases > "$dir/graph.cases"
    for op in $ops; do
        case $op in
            NONE|VIEW|RESHAPE|PERMUTE|TRANSPOSE|MUL_MAT|MUL_MAT_ID|FLASH_ATTN_EXT) ;;
            ARGSORT) sort_rows=1 ;;
            *) plain+=("$op") ;;
        esac
    done
    log "test-backend-ops, Vulkan0 against CPU: ${plain[*]}"
    local IFS=,
    backend_ops -o "${plain[*]}"
    unset IFS
    # ARGSORT only over rows of up to 1,024 (the clover graph sorts n_expert router scores: 256 in
    # the release): longer rows take ggml-vulkan's multi-pass argsort_large shader, which crashes
    # Debian 12's llvmpipe (Mesa 22.3, a segfault inside libvulkan_lvp.so) once earlier ops ran
    if [ "$sort_rows" = 1 ]; then
        log "test-backend-ops, Vulkan0 against CPU: ARGSORT (rows up to 1,024)"
        backend_ops -o ARGSORT -p 'ne=\[([0-9]{1,3}|10[01][0-9]|102[0-4]),'
    fi
    log "test-backend-ops, Vulkan0 against CPU: the clover graph's own nodes ($(wc -l < "$dir/graph.cases") cases: tiny f32, tiny Q8_0, small Q4_K_M)"
    backend_ops --test-file "$dir/graph.cases"
    rm -rf "$dir"
}

# The Vulkan variant end to end: the CPU set-up (venv, build/), build-vulkan/, then tests/vulkan
# (layers offloaded to the Vulkan device, against the CPU build and the numpy reference) and
# test-backend-ops, both on the first Vulkan device with llama.cpp's llvmpipe settings.
# Arguments go to pytest.
vulkan() {
    setup
    vulkan_build
    # the device's name as ggml-vulkan prints it (vulkaninfo is in vulkan-tools, not installed)
    log "tests/vulkan on $(env "${VULKAN_ENV[@]}" "$VULKAN_BUILD/bin/test-backend-ops" support -o NONE 2>&1 \
        | sed -n 's/^ggml_vulkan: 0 = //p' | head -1)"
    env "${VULKAN_TEST_ENV[@]}" CLOVER_LIB_PATH="$VULKAN_BUILD/bin/libclover.so" CLOVER_CLI_PATH="$VULKAN_BUILD/bin/clover-cli" \
        CLOVER_RPC_SERVER_PATH="$VULKAN_BUILD/bin/ggml-rpc-server" CLOVER_VULKAN_BUILD="$VULKAN_BUILD" \
        "$PY" -m pytest -q tests/vulkan "$@"
    vulkan_backend_ops
}

# CUDA: build-cuda/ configured with -DGGML_CUDA=ON (CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH, default
# 90: H100/H200) and compiled: every target the package builds, or, with SECONDS, what fits in
# that many seconds (the ggml-cuda kernels take over an hour on two cores). Prints the time and
# how many of ggml-cuda's CUDA objects exist. No GPU is needed to compile.
# cuBLAS, which ggml-cuda links, when the toolkit lacks it (an nvcc-only install, as here): NVIDIA's
# wheel of the toolkit's CUDA version from PyPI, unpacked in DIR/cublas; its paths go to CMake's
# FindCUDAToolkit through the cache variables it reads (CUDA_cublas_LIBRARY, ...) and the include flag.
cuda_cublas() {
    local dir=$1 root
    local -n out=$2
    root=$(dirname "$(dirname "$(command -v nvcc)")")
    [ -f "$root/include/cublas_v2.h" ] && return 0
    local ver major wheel
    ver=$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
    major=${ver%%.*}
    wheel=$([ "$major" -ge 13 ] && echo "nvidia-cublas==$ver.*" || echo "nvidia-cublas-cu$major==$ver.*")
    if [ ! -f "$dir/cublas/STAMP" ] || [ "$(cat "$dir/cublas/STAMP")" != "$wheel" ]; then
        log "the CUDA toolkit has no cuBLAS: fetching $wheel"
        rm -rf "$dir/cublas" && mkdir -p "$dir/cublas"
        "$PY" -m pip download -q --no-deps -d "$dir/cublas" "$wheel"
        "$PY" -m zipfile -e "$dir"/cublas/*.whl "$dir/cublas"
        echo "$wheel" > "$dir/cublas/STAMP"
    fi
    local inc lib lt
    inc=$(dirname "$(find "$dir/cublas" -name cublas_v2.h | head -1)")
    lib=$(find "$dir/cublas" -name 'libcublas.so.*' | head -1)
    lt=$(find "$dir/cublas" -name 'libcublasLt.so.*' | head -1)
    out=("-DCUDA_cublas_LIBRARY=$lib" "-DCUDA_cublasLt_LIBRARY=$lt" "-DCMAKE_CUDA_FLAGS=-I$inc" "-DCMAKE_CXX_FLAGS=-I$inc")
    # no driver either (libcuda comes with the GPU's driver): ggml-cuda's VMM pool links it, so the
    # compile check goes without it (the kernels compiled are the same)
    find "$root" -name 'libcuda.so*' | grep -q . || out+=(-DGGML_CUDA_NO_VMM=ON)
}

cuda_compile() {
    local dir=$ROOT/build-cuda budget=${1:-0} rc=0
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH=/usr/local/cuda/bin:$PATH
    fi
    command -v nvcc >/dev/null || { echo "error: nvcc not found (the CUDA toolkit)" >&2; exit 1; }
    local cublas_args=()
    cuda_cublas "$dir" cublas_args
    configure "$dir" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DGGML_CUDA=ON \
        "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}" -DCMAKE_CUDA_COMPILER_LAUNCHER="$(command -v ccache || true)" \
        "${cublas_args[@]}"
    log "compiling $dir with $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/CUDA \1/p')${budget:+ (at most $budget s)}"
    local t0=$SECONDS targets=(clover clover-cli ggml-rpc-server)
    if [ "$budget" -gt 0 ]; then
        timeout "$budget" cmake --build "$dir" -j "$JOBS" --target "${targets[@]}" || rc=$?
    else
        cmake --build "$dir" -j "$JOBS" --target "${targets[@]}" || rc=$?
    fi
    local total built
    total=$(cd "$dir" && ninja -t commands ggml-cuda 2>/dev/null | grep -c 'nvcc.* -c ' || true)
    built=$(find "$dir" -name '*.cu.o' | wc -l)
    if [ "$rc" = 124 ]; then
        log "CUDA build stopped at its budget after $((SECONDS - t0)) s: ggml-cuda objects compiled: $built of $total (re-run to go on)"
        return 0
    fi
    log "CUDA build: $((SECONDS - t0)) s, rc $rc; ggml-cuda objects compiled: $built of $total"
    return "$rc"
}

case "${1:-}" in
    setup) setup ;;
    demo)  setup; "$VENV/bin/clover" demo ;;
    test)  setup "${TEST_TOOLS[@]}"; shift; run_tests "$@" ;;
    asan)  setup; asan ;;
    upstream-tests) shift; upstream_tests "$@" ;;
    bench) setup llama-diffusion-cli; shift; "$PY" benchmarks/run_all.py "$@" ;;
    vulkan) shift; vulkan "$@" ;;
    cuda-compile) shift; cuda_compile "$@" ;;
    *)     sed -n '2,20p' "$0"; exit 2 ;;
esac
