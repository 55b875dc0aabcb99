"""Chat and server benchmarks on the default model (issue: `clover serve`).

    .venv/bin/python benchmarks/serve_bench.py [--threads 2] [--turns 10] [--out benchmarks/results-serve.txt]

1. A 10-turn chat through Clover.chat (the path of `clover chat` and the server's chat
   endpoint): per turn, the prompt tokens prefilled and the time to the first streamed token,
   with prefix reuse and without (reuse_prefix=False), the two runs interleaved turn by turn.
   Target: turn 10 prefills only its new tokens and its time to first token is <= 1.5x turn 1's.
2. `clover serve` (a subprocess on a free port): requests per second and p50/p95 latency of
   64-token completions (greedy, ignore_eos) at 1, 2 and 8 concurrent clients, for
   --parallel 1 and 2.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

USER_TURNS = [
    "Write a function that adds two numbers.", "Now make it add three.", "Add a docstring.",
    "Write a test for it.", "Rename it to total.", "Make it accept a list.", "Handle an empty list.",
    "Add type hints.", "Write a second test.", "Put it all in a class.",
]


def chat_turns(model_path: Path, threads: int, turns: int, max_tokens: int) -> list[str]:
    from clover_cpp import Clover

    lines = ["## 1. chat: prompt tokens prefilled and time to first token per turn "
             f"({max_tokens} new tokens per turn, block size auto, {threads} threads)", "",
             "| turn | prompt tok | prefilled (reuse) | TTFT reuse ms | prefilled (no reuse) | TTFT no reuse ms |",
             "|---:|---:|---:|---:|---:|---:|"]
    with Clover(model_path, n_ctx=4096, n_threads=threads) as reuse, \
            Clover(model_path, n_ctx=4096, n_threads=threads) as fresh:
        reuse.generate("warm up", max_tokens=8)  # cost curve (disk cache) + buffers
        fresh.generate("warm up", max_tokens=8)
        hist: dict[str, list[dict[str, str]]] = {"reuse": [], "fresh": []}
        ttft: dict[str, list[float]] = {"reuse": [], "fresh": []}
        for t in range(turns):
            row = [str(t + 1)]
            for name, m in (("reuse", reuse), ("fresh", fresh)):
                msgs = hist[name] + [{"role": "user", "content": USER_TURNS[t % len(USER_TURNS)]}]
                t0 = time.perf_counter()
                first = None
                s = m.chat(msgs, max_tokens=max_tokens, stream=True, reuse_prefix=name == "reuse")
                for _ in s:
                    if first is None:
                        first = time.perf_counter() - t0
                r = s.result
                first = first if first is not None else time.perf_counter() - t0
                ttft[name].append(first * 1000)
                hist[name] = msgs + [{"role": "assistant", "content": r.text}]
                if name == "reuse":
                    row.append(str(r.stats.n_prompt))
                row += [str(r.stats.n_prompt - r.stats.n_reused), f"{first * 1000:.1f}"]
            lines.append("| " + " | ".join(row) + " |")
        ratio = ttft["reuse"][-1] / ttft["reuse"][0]
        lines += ["", f"turn {turns} / turn 1 time to first token: with reuse {ratio:.2f}x (target <= 1.5), "
                  f"without {ttft['fresh'][-1] / ttft['fresh'][0]:.2f}x"]
    return lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_load(model_path: Path, threads: int, requests: int) -> list[str]:
    import httpx

    lines = ["", f"## 2. clover serve: 64-token completions (greedy, ignore_eos), {requests} requests per cell, "
             "server threads by default (cores - 1, shared by the contexts)",
             "", "| --parallel | clients | req/s | p50 ms | p95 ms | tok/s |", "|---:|---:|---:|---:|---:|---:|"]
    for parallel in (1, 2):
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-c", "from clover_cpp.cli import main; main()", "serve", "-m",
                                 str(model_path), "--port", str(port), "--parallel", str(parallel), "-c", "2048"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            body = {"prompt": "def add(a, b):\n", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
            for _ in range(2 * parallel):
                httpx.post(url + "/v1/completions", json=body, timeout=120)
            for clients in (1, 2, 8):
                lat: list[float] = []
                todo = list(range(requests))
                lock = threading.Lock()

                def client() -> None:
                    with httpx.Client(timeout=300) as c:
                        while True:
                            with lock:
                                if not todo:
                                    return
                                i = todo.pop()
                            t0 = time.perf_counter()
                            r = c.post(url + "/v1/completions", json={**body, "prompt": f"def f{i}(x):\n"})
                            r.raise_for_status()
                            with lock:
                                lat.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ths = [threading.Thread(target=client) for _ in range(clients)]
                for th in ths:
                    th.start()
                for th in ths:
                    th.join()
                wall = time.perf_counter() - t0
                lat.sort()
                p95 = lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))]
                lines.append(f"| {parallel} | {clients} | {len(lat) / wall:.2f} | {statistics.median(lat) * 1000:.0f} | "
                             f"{p95 * 1000:.0f} | {64 * len(lat) / wall:.0f} |")
        finally:
            proc.terminate()
            proc.wait(20)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--model", default=None, help="a Clover GGUF (default: the demo model)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from clover_cpp.demo import default_cache_dir, demo_model

    model = Path(a.model) if a.model else demo_model(default_cache_dir())[0]
    lines = [f"# serve_bench.py on {model.name}, {a.threads} threads, {time.strftime('%Y-%m-%d %H:%M')}", ""]
    lines += chat_turns(model, a.threads, a.turns, a.max_tokens)
    lines += server_load(model, a.threads, a.requests)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
