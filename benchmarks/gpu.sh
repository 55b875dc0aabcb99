#!/usr/bin/env bash
# The GPU figures in one command, for a lent machine that starts bare (CUDA 13 nvcc, CMake,
# ninja, Python 3 with numpy; no package registry, no gguf package): what it needs travels in
# build-gpu-pack/ (made here by `pack`, ~30 MB: the patched llama.cpp tree without its tests,
# docs, models and unused backends as one archive, and the default model as an f16 GGUF).
#
#   benchmarks/gpu.sh pack                 here, after ./dev.sh setup: writes build-gpu-pack/
#   benchmarks/gpu.sh run                  on the GPU machine (carry build-gpu-pack): builds
#                                          libclover + clover-cli + llama-simple with CUDA
#                                          (CUDA_ARCH, default 90: H100/H200) and measures
#   benchmarks/gpu.sh run --cpu            the same on the CPU (the script's own check here)
#   benchmarks/gpu.sh run --dry-run        unpack and configure with CUDA, list the build's
#                                          commands (how many nvcc compiles), measure nothing
#   benchmarks/gpu.sh run --cpu --prebuilt DIR   measure an existing build (no unpack, no build)
#
# Measured, all on the default model's f16 GGUF with every layer on the device (-ngl -1):
#   1. B = 1 (clover's autoregressive mode) vs upstream llama.cpp's autoregressive decode of the
#      same file: llama-bench -p 0 -n 128 (tg128, the figure llama.cpp publishes) and llama-simple
#      (examples/simple: llama_decode one token at a time, greedy, its own clock)
#   2. the cost of a block pass of n = 1..64 tokens and of a causal commit of n tokens
#   3. the k-tokens-per-step table: threshold 1.0 with a step cap B/k unmasks exactly k tokens
#      per step whatever the weights: tok/s and tokens per forward for B x k
#   4. block diffusion (threshold 0.9; B = 4, 8, 16, auto) and draft-self (B = 4, 8, 16): tok/s,
#      tokens per forward, tokens per verification, forwards that ran llama.cpp's previous graph
#      again (stats.n_graphs_reused: what CUDA replays without a capture)
# CLOVER_GPU_CMAKE_ARGS: extra CMake arguments. Results: benchmarks/results-gpu.txt (--cpu: /tmp/results-gpu-cpu-check.txt; CLOVER_GPU_RESULTS
# overrides). Budget: <= 8 minutes wall on 16 cores including the build (the CUDA build leaves
# out the flash-attention kernels, -DGGML_CUDA_FA=OFF, unless CLOVER_GPU_FA=1: they are most of
# ggml-cuda's compile time and the default model's contexts are short).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PACK=${CLOVER_GPU_PACK:-$ROOT/build-gpu-pack}
WORK=${CLOVER_GPU_WORK:-/tmp/clover-gpu}
JOBS=${JOBS:-$(nproc)}
T0=$SECONDS
log() { printf '==> [%4ds] %s\n' "$((SECONDS - T0))" "$*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

# the parts of the patched tree a build of libllama + tools never reads
EXCLUDES=(models docs tests benches media gguf-py conversion .github .devops tools/ui tools/server
          ggml/src/ggml-sycl ggml/src/ggml-cann ggml/src/ggml-opencl ggml/src/ggml-hexagon
          ggml/src/ggml-webgpu ggml/src/ggml-openvino ggml/src/ggml-et ggml/src/ggml-virtgpu
          ggml/src/ggml-musa ggml/src/ggml-zdnn ggml/src/ggml-zendnn ggml/src/ggml-vulkan ggml/src/ggml-metal)

pack() {
    local py=$ROOT/.venv/bin/python tree=$ROOT/third_party/llama.cpp
    [ -x "$py" ] && [ -f "$tree/CMakeLists.txt" ] || die "run ./dev.sh setup first (the venv and the patched tree)"
    "$py" native/scripts/setup_llama.py >/dev/null  # the tree matches the patch series
    mkdir -p "$PACK"
    local ex=() e
    for e in "${EXCLUDES[@]}"; do ex+=(--exclude "./$e"); done
    log "archiving the patched tree (without ${EXCLUDES[*]:0:6} ...)"
    tar -C "$tree" "${ex[@]}" -cf - . | xz -T2 -6 > "$PACK/llama.cpp.tar.xz.tmp"
    mv "$PACK/llama.cpp.tar.xz.tmp" "$PACK/llama.cpp.tar.xz"
    log "the default model as an f16 GGUF"
    "$py" -c "import sys; from clover_convert import convert; \
convert('models/clover-default', sys.argv[1], outtype='f16', progress=False)" "$PACK/clover-default-f16.gguf.tmp"
    mv "$PACK/clover-default-f16.gguf.tmp" "$PACK/clover-default-f16.gguf"
    cat "$ROOT/third_party/llama.cpp/.clover-stamp" > "$PACK/STAMP"
    du -b "$PACK"/* | awk '{s += $1; print} END {printf "total %.1f MiB (a device call carries at most 64 MiB with the working tree)\n", s / 1048576}'
}

run() {
    local mode=cuda dry=0 prebuilt=""
    while [ $# -gt 0 ]; do
        case $1 in
            --cpu) mode=cpu ;;
            --dry-run) dry=1 ;;
            --prebuilt) prebuilt=${2:?--prebuilt needs a build folder}; shift ;;
            *) die "unknown option $1 (--cpu, --dry-run, --prebuilt DIR)" ;;
        esac
        shift
    done
    [ -f "$PACK/llama.cpp.tar.xz" ] && [ -f "$PACK/clover-default-f16.gguf" ] \
        || die "$PACK is incomplete: run 'benchmarks/gpu.sh pack' where ./dev.sh setup ran, and carry build-gpu-pack"
    local py
    py=${PY:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || command -v python3)}
    "$py" -c "import numpy" 2>/dev/null || die "$py has no numpy"
    if [ "$mode" = cuda ] && ! command -v nvcc >/dev/null; then
        [ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH || die "nvcc not found (--cpu builds for the CPU)"
    fi
    local build_s=0 build
    if [ -n "$prebuilt" ]; then
        # measure an existing build (its bin/ has libclover and llama-simple): no unpacking, no build
        build=$(cd "$prebuilt" && pwd)
        [ -f "$build/bin/libclover.so" ] && [ -x "$build/bin/llama-simple" ] && [ -x "$build/bin/llama-bench" ] \
            || die "$build/bin lacks libclover.so, llama-simple or llama-bench (cmake --build $build --target clover llama-simple llama-bench)"
    else
    # the tree: unpacked once per pack (the same layout as the checkout: WORK/third_party/llama.cpp,
    # WORK/build-*, so that ccache, where present, reuses the checkout's objects)
    local tree=$WORK/third_party/llama.cpp
    build=$WORK/build-gpu-$mode
    if [ "$(cat "$tree/.clover-pack" 2>/dev/null)" != "$(cat "$PACK/STAMP")" ]; then
        log "unpacking the patched llama.cpp into $tree"
        rm -rf "$tree" && mkdir -p "$tree"
        xz -dc "$PACK/llama.cpp.tar.xz" | tar -C "$tree" -xf -
        cp "$PACK/STAMP" "$tree/.clover-pack"
    fi
    local args=(-DCMAKE_BUILD_TYPE=Release -DCLOVER_SETUP_LLAMA=OFF "-DCLOVER_LLAMA_DIR=$tree" -DGGML_RPC=OFF
                -DCLOVER_LLAMA_SERVER=OFF)
    [ "$mode" = cuda ] && args+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}"
                                 "-DGGML_CUDA_FA=$([ "${CLOVER_GPU_FA:-0}" = 1 ] && echo ON || echo OFF)")
    command -v ninja >/dev/null && args+=(-G Ninja)
    # (extra CMake arguments, e.g. where cuBLAS lives when the toolkit lacks it)
    # shellcheck disable=SC2206
    args+=(${CLOVER_GPU_CMAKE_ARGS:-})
    if command -v ccache >/dev/null; then
        args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
        [ "$mode" = cuda ] && args+=(-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
        export CCACHE_BASEDIR=$WORK
    fi
    log "configuring $build ($mode)"
    rm -f "$build/CMakeCache.txt"
    cmake -S "$ROOT" -B "$build" "${args[@]}" > "$WORK/configure-$mode.log" 2>&1 \
        || { tail -30 "$WORK/configure-$mode.log" >&2; die "configure failed ($WORK/configure-$mode.log)"; }
    local targets=(llama clover clover-cli llama-simple llama-bench)
    if [ "$dry" = 1 ]; then
        local n_all n_cu
        n_all=$(cmake --build "$build" --target "${targets[@]}" -- -n 2>/dev/null | grep -c '^\[' || true)
        n_cu=$(cd "$build" && ninja -t commands "${targets[@]}" 2>/dev/null | grep -c 'nvcc.* -c ' || true)
        log "dry run: configure ok; the build would run $n_all steps, $n_cu of them nvcc compiles"
        echo "cmake -S $ROOT -B $build ${args[*]}"
        echo "cmake --build $build -j $JOBS --target ${targets[*]}"
        return 0
    fi
    log "building ${targets[*]} with $JOBS jobs"
    local tb=$SECONDS
    cmake --build "$build" -j "$JOBS" --target "${targets[@]}" > "$WORK/build-$mode.log" 2>&1 \
        || { tail -30 "$WORK/build-$mode.log" >&2; die "build failed ($WORK/build-$mode.log)"; }
    build_s=$((SECONDS - tb))
    log "built in ${build_s} s"
    fi

    local out=${CLOVER_GPU_RESULTS:-$([ "$mode" = cuda ] && echo "$ROOT/benchmarks/results-gpu.txt" || echo /tmp/results-gpu-cpu-check.txt)}
    local ngl=$([ "$mode" = cuda ] && echo -1 || echo 0)
    local device
    device=$([ "$mode" = cuda ] && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
    device=${device:-$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)}
    log "measuring (n_gpu_layers $ngl)"
    CLOVER_LIB_PATH=$build/bin/libclover.so PYTHONPATH=$ROOT CLOVER_CACHE_DIR=$WORK/cache \
        "$py" - "$PACK/clover-default-f16.gguf" "$build/bin/llama-simple" "$ngl" "$out.tmp" \
        "$mode" "$device" "$build_s" "$JOBS" <<'EOF'
import ctypes, json, os, re, subprocess, sys, time
# libclover (and its llama-common) loaded before numpy: on the lent H200's Python, numpy 2.5's
# bundled OpenBLAS loaded first made llama-common's initialisers crash (SIGSEGV in dlopen)
ctypes.CDLL(os.environ["CLOVER_LIB_PATH"])
import numpy as np
from clover_cpp import Clover

model, simple, ngl, out, mode, device, build_s, jobs = sys.argv[1:]
ngl, threads = int(ngl), int(jobs)
lines = [f"benchmarks/gpu.sh ({mode}): {device}; {jobs} cores; build {build_s} s; "
         f"default model f16, n_gpu_layers {ngl}", ""]
NEW = 128
PROMPT = "def parse(self, text):\n    "


def best(f, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return min(ts)


with Clover(model, n_ctx=2048, n_threads=threads, n_gpu_layers=ngl) as m:
    # 1. B = 1 vs upstream autoregressive decode of the same file
    m.generate(PROMPT, max_tokens=16, block_size=1, stop_at_eos=False)
    ar = max((m.generate(PROMPT, max_tokens=NEW, block_size=1, stop_at_eos=False) for _ in range(3)),
             key=lambda r: r.stats.tokens_per_second)
    bench = subprocess.run([os.path.join(os.path.dirname(simple), "llama-bench"), "-m", model, "-p", "0", "-n", str(NEW),
                            "-ngl", str(99 if ngl else 0), "-t", str(threads), "-r", "3", "-o", "json"],
                           capture_output=True, text=True, timeout=300)
    try:
        tg = json.loads(bench.stdout)[0]["avg_ts"]
    except (ValueError, IndexError, KeyError):
        raise SystemExit(f"error: llama-bench printed no result: {(bench.stderr + bench.stdout)[-800:]}")
    ups = []
    for _ in range(3):
        res = subprocess.run([simple, "-m", model, "-n", str(NEW), "-ngl", str(99 if ngl else 0), PROMPT],
                             capture_output=True, text=True, timeout=300)
        mt = re.search(r"decoded (\d+) tokens in ([0-9.]+) s, speed: ([0-9.]+) t/s", res.stderr + res.stdout)
        if not mt:
            raise SystemExit(f"error: llama-simple printed no speed line: {(res.stderr + res.stdout)[-800:]}")
        ups.append(float(mt.group(3)))
    lines += ["1. autoregressive decode, 128 new tokens (best of 3)",
              f"   clover B = 1:                       {ar.stats.tokens_per_second:9.1f} tok/s",
              f"   upstream llama-bench tg{NEW}, same file: {tg:9.1f} tok/s   (ratio {ar.stats.tokens_per_second / tg:.2f})",
              f"   upstream llama-simple, same file:   {max(ups):9.1f} tok/s   (ratio {ar.stats.tokens_per_second / max(ups):.2f}; "
              "its clock includes the prompt's decode and printing each token)", ""]

    # 2. cost of a block pass / a causal commit of n tokens
    lines += ["2. cost of one forward of n tokens (ms; a block pass: best of 10, empty memory; a commit: best of 5, after 64 committed)",
              f"   {'n':>3} {'block pass':>11} {'commit':>9} {'pass/pass(1)':>13}"]
    rng = np.random.default_rng(0)
    base = None
    for n in (1, 2, 4, 8, 16, 32, 64):
        toks = rng.integers(10, 200, n).tolist()
        before = rng.integers(10, 200, 64).tolist()
        with m.new_context(block_size=n, n_ctx=512) as c:
            c.block_logits(toks, commit_before=before)
            pms = best(lambda: c.block_logits(toks), 10) * 1e3
            # the commit of n tokens after 64, timed alone (a difference of two timings could read 0)
            commits = []
            for _ in range(5):
                c.reset(); c.commit(before)
                t = time.perf_counter(); c.commit(toks); commits.append(time.perf_counter() - t)
            cms = min(commits) * 1e3
        base = base or pms
        lines.append(f"   {n:>3} {pms:>11.3f} {cms:>9.3f} {pms / base:>13.2f}")
    lines.append("")

    # 3. k tokens per step: threshold 1.0 never fires; the cap B/k unmasks exactly k per step
    ks = (1, 2, 4, 8)
    lines += ["3. tok/s (tokens per forward) when every step unmasks exactly k tokens (threshold 1.0, step cap B/k)",
              "   " + f"{'B':>3} " + " ".join(f"{'k=' + str(k):>16}" for k in ks) + f" {'k=B':>16}"]
    for B in (4, 8, 16, 32, 64):
        cells = []
        for k in ks + (B,):
            if k > B or (k == B and B in ks):
                cells.append(f"{'-':>16}"); continue
            r = max((m.generate(PROMPT, max_tokens=NEW, block_size=B, threshold=1.0, max_steps=B // k,
                                stop_at_eos=False) for _ in range(2)), key=lambda x: x.stats.tokens_per_second)
            cells.append(f"{r.stats.tokens_per_second:>9.1f} ({r.stats.tokens_per_forward:4.2f})")
        lines.append(f"   {B:>3} " + " ".join(cells))
    lines.append("")

    # 4. the default model's own confidences: block diffusion and draft-self
    lines += ["4. the default model, greedy, 128 new tokens: block diffusion (threshold 0.9) and draft-self",
              f"   {'mode':<22} {'tok/s':>9} {'tok/fwd':>8} {'tok/verif':>9} {'graphs reused':>14}  text = B=1's"]
    cases = [("B=1", dict(block_size=1))] + [(f"diffusion B={B}", dict(block_size=B)) for B in (4, 8, 16)] + \
            [("diffusion auto", dict(block_size="auto"))] + \
            [(f"draft-self B={B}", dict(block_size=B, draft_self=True)) for B in (4, 8, 16)]
    for name, kw in cases:
        m.generate(PROMPT, max_tokens=16, stop_at_eos=False, **kw)
        r = max((m.generate(PROMPT, max_tokens=NEW, stop_at_eos=False, **kw) for _ in range(3)),
                key=lambda x: x.stats.tokens_per_second)
        tv = f"{r.stats.tokens_per_verification:9.2f}" if r.stats.n_verifications else f"{'-':>9}"
        reused = f"{r.stats.n_graphs_reused}/{r.stats.n_decode_forwards}"
        lines.append(f"   {name:<22} {r.stats.tokens_per_second:>9.1f} {r.stats.tokens_per_forward:>8.2f} {tv} {reused:>14}  "
                     f"{'yes' if r.tokens == ar.tokens else 'no'}")
open(out, "w").write("\n".join(lines) + "\n")
EOF
    echo "   total wall time of this run: $((SECONDS - T0)) s" >> "$out.tmp"
    mv "$out.tmp" "$out"
    log "wrote $out"
    cat "$out"
}

# The release's real widths (after `run`, on its build): the 35b-a3b-slice checkpoint (4 of the 40
# layers, random weights, ~8.8 GB bf16) written and converted to f16 on the machine, then
# benchmarks/gpu_slice.py. Needs Python with numpy, tokenizers, click, ml_dtypes and gguf (gguf
# travels as a wheel where the machine lacks it). Results: benchmarks/results-gpu-slice.txt.
slice() {
    local mode=cuda build
    [ "${1:-}" = --cpu ] && mode=cpu
    build=${CLOVER_GPU_BUILD:-$WORK/build-gpu-$mode}
    [ -f "$build/bin/libclover.so" ] && [ -x "$build/bin/llama-bench" ] || die "no build at $build: run 'gpu.sh run' first"
    local py
    py=${PY:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || command -v python3)}
    local ckpt=$WORK/slice-bf16 gguf=$WORK/slice-f16.gguf
    if [ ! -f "$gguf" ]; then
        log "writing the 35b-a3b-slice checkpoint (bf16, random weights)"
        rm -rf "$ckpt"
        (cd "$ROOT" && "$py" -m clover_testkit.checkpoints 35b-a3b-slice "$ckpt" --dtype bf16) >&2
        log "converting it to f16"
        (cd "$ROOT" && "$py" -m clover_convert "$ckpt" "$gguf" --outtype f16 --no-progress) >&2
        rm -rf "$ckpt"
    fi
    log "measuring"
    CLOVER_LIB_PATH=$build/bin/libclover.so CLOVER_CACHE_DIR=$WORK/cache "$py" "$ROOT/benchmarks/gpu_slice.py" \
        "$gguf" "$build/bin" "$([ "$mode" = cuda ] && echo -1 || echo 0)" \
        "${CLOVER_GPU_SLICE_RESULTS:-$([ "$mode" = cuda ] && echo "$ROOT/benchmarks/results-gpu-slice.txt" || echo /tmp/results-gpu-slice-cpu.txt)}"
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    run) shift; run "$@" ;;
    slice) shift; slice "$@" ;;
    *) sed -n '2,27p' "$0"; exit 2 ;;
esac
