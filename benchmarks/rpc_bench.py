"""Clover over llama.cpp's RPC backend: local vs split over two localhost ggml-rpc-servers.

    .venv/bin/python benchmarks/rpc_bench.py [--model models/clover-default] [--rounds 3] [-n 128]

Prints, side by side in one run:
* tokens/s of the local run and of two split runs (every layer on the two servers, half each;
  the output head on the last server as llama.cpp places it, or kept on the client with
  `-ot ^output\\.weight=CPU`) for B = 1 and B = 32, paired and repeated (median of per-round ratios);
* the bytes that cross the network per forward (the kernel's counters of the servers'
  TCP connections, ss -ti) and per block pass of n = 1 and n = 32 tokens, split into a fixed part
  (graph, control) and a per-token part (logits + hidden states at device boundaries);
* from those, the network time per step of Clover-35B-A3B on a 1 Gb/s and a 10 Gb/s link for
  both placements, and the tokens/s that bounds if a pass unmasked the whole block.

On this 2-core box client and servers share the cores, so the split tokens/s measures the
protocol's overhead, not a cluster's speed.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from clover_cpp import Clover  # noqa: E402
from clover_cpp.demo import paired_runs  # noqa: E402
from clover_testkit.rpc import RpcServer  # noqa: E402

RPC_SERVER = REPO / "build" / "bin" / "ggml-rpc-server"
# Clover-35B-A3B (spec/model.md): hidden size, vocabulary
BIG = {"hidden": 2048, "vocab": 248320}
RTT_S = 100e-6  # one request/response on a LAN (assumed, not measured here)


def io_of(endpoints: list[str]) -> tuple[int, int]:
    """(bytes both ways, data segments the servers sent) on the servers' connections so far,
    from the kernel's TCP counters (ss -ti)."""
    b = n = 0
    for ep in endpoints:
        port = ep.rsplit(":", 1)[1]
        out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=True).stdout
        for key, val in re.findall(r"\b(bytes_sent|bytes_received|data_segs_out):(\d+)", out):
            if key == "data_segs_out":
                n += int(val)
            else:
                b += int(val)
    return b, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "clover-default"), help="HF folder or GGUF")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not RPC_SERVER.exists():
        raise SystemExit(f"{RPC_SERVER} is not built: ./dev.sh setup")
    tmp = Path(tempfile.mkdtemp(prefix="clover-rpc-bench-"))
    gguf = Path(args.model)
    if gguf.is_dir():
        from clover_convert import convert

        convert(gguf, tmp / "model-f16.gguf", outtype="f16", progress=False)
        gguf = tmp / "model-f16.gguf"
    servers = [RpcServer(RPC_SERVER), RpcServer(RPC_SERVER)]
    eps = [s.endpoint for s in servers]
    try:
        local = Clover(gguf, n_threads=args.threads)
        remote = dict(n_threads=args.threads, n_gpu_layers=-1, tensor_split=[1.0, 1.0], rpc_servers=eps)
        # the output head on the last server (llama.cpp's placement), or kept here (-ot)
        split = {"head on server": Clover(gguf, **remote),
                 "head on client": Clover(gguf, **remote, override_tensor=r"^output\.weight=CPU")}
        H, V = int(local.metadata.get("clover.embedding_length")), local.n_vocab()
        prompt = "def fibonacci(n):\n    "
        rows = []
        for B in (1, 32):
            models = [local, *split.values()]
            runs = paired_runs(lambda m: m.generate(prompt, max_tokens=args.n_predict, block_size=B,
                                                    stop_at_eos=False).stats, models, args.rounds)
            row = dict(B=B, local=statistics.median(r.tokens_per_second for r in runs[local]))
            for name, m in split.items():
                b0, n0 = io_of(eps)
                st = m.generate(prompt, max_tokens=args.n_predict, block_size=B, stop_at_eos=False).stats
                b1, n1 = io_of(eps)
                row[name] = dict(tps=statistics.median(r.tokens_per_second for r in runs[m]),
                                 ratio=statistics.median(s.tokens_per_second / lo.tokens_per_second
                                                         for lo, s in zip(runs[local], runs[m])),
                                 tpf=st.tokens_per_forward, bytes_step=(b1 - b0) / st.n_forward,
                                 calls_step=(n1 - n0) / st.n_forward)
            rows.append(row)
        local.close()
        for m in split.values():
            m.close()
    finally:
        for srv in servers:
            srv.stop()

    print(f"model {gguf.name} (hidden {H}, vocabulary {V}), -n {args.n_predict}, {args.rounds} paired rounds, "
          f"{args.threads} client threads, 2 servers of 1 thread each, all on this machine; every layer on the servers")
    print(f"{'B':>3} {'local tok/s':>12} | {'split, output head on':<22} {'tok/s':>8} {'x local':>8} "
          f"{'tok/fwd':>8} {'KB/step':>9} {'replies/step':>13}")
    for r in rows:
        for k, name in enumerate(split):
            d = r[name]
            lead = f"{r['B']:>3} {r['local']:>12.1f}" if k == 0 else " " * 16
            print(f"{lead} | {name:<22} {d['tps']:>8.1f} {d['ratio']:>7.2f}x {d['tpf']:>8.2f} "
                  f"{d['bytes_step'] / 1024:>9.1f} {d['calls_step']:>13.1f}")
    # Per step, with the head on the server the client receives the logits of the block's rows
    # (B x 4 bytes x vocabulary); the rest (hidden states at the device boundaries, positions,
    # masks) is what the head-on-client run measures. For Clover-35B-A3B the logits scale with
    # the vocabulary and the rest with the hidden size (an estimate: masks scale with the context).
    print(f"projection for Clover-35B-A3B (hidden {BIG['hidden']}, vocabulary {BIG['vocab']}), network time "
          f"per step only, {RTT_S * 1e6:.0f} us per reply assumed:")
    for r in rows:
        rest = r["head on client"]["bytes_step"]
        r["big"] = {"head on server": r["B"] * 4 * BIG["vocab"] + rest * BIG["hidden"] / H,
                    "head on client": rest * BIG["hidden"] / H}
        print(f"  B={r['B']}: {r['big']['head on server'] / 2**20:.2f} MB/step with the head on the last server, "
              f"{r['big']['head on client'] / 2**20:.3f} MB/step with it on the client")
    for name in split:
        for gbps in (1, 10):
            bw = gbps * 1e9 / 8
            cells = []
            for r in rows:
                t = r["big"][name] / bw + r[name]["calls_step"] * RTT_S
                cells.append(f"B={r['B']}: {t * 1e3:6.2f} ms/step, <= {r['B'] / t:6.0f} tok/s if a pass "
                             f"unmasked the whole block")
            print(f"  {name:<15} {gbps:>2} Gb/s: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
