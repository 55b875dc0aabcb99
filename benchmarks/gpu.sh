#!/usr/bin/env bash
# The CUDA run: build with CUDA for one architecture, the native parity and greedy tests with
# every layer on the GPU, then the cost curve and block-size sweep of the `small` preset and
# the default model against upstream qwen35moe of the same dims. Writes
# benchmarks/results-cuda.txt (about 6 minutes on 16 cores and one H200).
#
#   benchmarks/gpu.sh                 CUDA (CUDA_ARCH=90: H100/H200)
#   CLOVER_GPU=0 benchmarks/gpu.sh    the same on the CPU: the script's own check
#
# Needs the patched tree third_party/llama.cpp (./dev.sh setup makes it; on a bare GPU machine
# carry it) and a Python with the project's dependencies (.venv when present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=${CLOVER_GPU:-1}
JOBS=${JOBS:-$(nproc)}
PY=${PY:-$([ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3)}
OUTFILE=${CLOVER_GPU_RESULTS:-benchmarks/results-cuda.txt}
[ "$GPU" = 1 ] || OUTFILE=${CLOVER_GPU_RESULTS:-/tmp/results-cuda-cpu-check.txt}
# the CPU check reuses ./dev.sh's build folder
BUILD=${CLOVER_GPU_BUILD:-$PWD/$([ "$GPU" = 1 ] && echo build-cuda || echo build)}
[ -d third_party/llama.cpp ] || "$PY" native/setup_llama.py
log() { printf '==> %s\n' "$*" >&2; }

cuda=()
[ "$GPU" = 1 ] && cuda=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}")
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
command -v ccache >/dev/null && gen+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
log "configure + build ($BUILD)"
[ -f "$BUILD/CMakeCache.txt" ] || cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${cuda[@]}" >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target llama clover clover-cli llama-bench >/dev/null

export CLOVER_LIB_PATH=$BUILD/bin/libclover.so CLOVER_BIN_DIR=$BUILD/bin PYTHONPATH=$PWD
if [ "$GPU" = 1 ]; then
    export CLOVER_TEST_NGL=-1 CLOVER_NGL=-1 CLOVER_NGL_UPSTREAM=99
fi
log "parity and greedy tests (n_gpu_layers ${CLOVER_TEST_NGL:-0})"
"$PY" -m pytest -q -p no:cacheprovider tests/test_native_api.py \
    -k "block_pass_parity_f32 or greedy_generate or commit_in_one_call or block_size_1_is_autoregressive or block_decode_memory or budget" 2>&1 | tail -3 | tee /tmp/gpu-tests.txt

log "models"
"$PY" benchmarks/make_baselines.py --types f16 >/dev/null 2>&1
SMALL=${CLOVER_BENCH_CACHE:-$HOME/.cache/clover-cpp/bench}/clover-small-f16.gguf
DEFAULT=$("$PY" -c "from clover_cpp.demo import demo_model, default_cache_dir; print(demo_model(default_cache_dir(), log=lambda s: None)[0])")

log "sweeps"
export CLOVER_CACHE_DIR=${CLOVER_CACHE_DIR:-$(mktemp -d)}
{
    echo "benchmarks/gpu.sh: $( [ "$GPU" = 1 ] && nvidia-smi --query-gpu=name --format=csv,noheader | head -1 || echo CPU check ), $(nproc) cores"
    echo "tests: $(tail -1 /tmp/gpu-tests.txt)"
    echo
} > "$OUTFILE.tmp"
"$PY" benchmarks/gpu_sweep.py --model "small=$SMALL" --model "default=$DEFAULT" --out /tmp/gpu-sweep.txt
cat /tmp/gpu-sweep.txt >> "$OUTFILE.tmp"
mv "$OUTFILE.tmp" "$OUTFILE"
log "wrote $OUTFILE"
cat "$OUTFILE"
