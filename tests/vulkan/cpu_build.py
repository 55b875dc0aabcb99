"""The CPU build's side of tests/vulkan: run in a subprocess with CLOVER_LIB_PATH naming the CPU
build's libclover (build/bin), so that the Vulkan tests compare against the build users get
without a GPU, not against the Vulkan build with no layers offloaded (whose big batches ggml
may still hand to the device).

    python tests/vulkan/cpu_build.py JOBS.json OUT.npz

JOBS.json: {"model": path, "context": {Clover's keyword arguments}, "jobs": [job, ...]}; a job is
{"kind": "commit", "tokens": [...], "split": k} (the logits of two commits, k then the rest),
{"kind": "block", "tokens": [...], "before": [...], "block_size": B} (a block pass after
committing `before`) or {"kind": "generate", "prompt": [...], **generate's keyword arguments}.
OUT.npz holds job{i} = the logits, or the generated tokens.
"""
from __future__ import annotations

import json
import sys

import numpy as np


def main(jobs_path: str, out_path: str) -> int:
    from clover_cpp import Clover

    spec = json.loads(open(jobs_path).read())
    out: dict[str, np.ndarray] = {}
    with Clover(spec["model"], **spec["context"]) as m:
        for i, job in enumerate(spec["jobs"]):
            kind = job.pop("kind")
            if kind == "commit":
                toks, k = job["tokens"], job["split"]
                m.reset()
                out[f"job{i}"] = np.concatenate([m.commit(toks[:k], logits=True), m.commit(toks[k:], logits=True)])
                m.reset()
            elif kind == "block":
                with m.new_context(block_size=job["block_size"]) as c:
                    out[f"job{i}"] = c.block_logits(job["tokens"], commit_before=job["before"])
            elif kind == "generate":
                prompt = job.pop("prompt")
                out[f"job{i}"] = np.asarray(m.generate(prompt, **job).tokens, dtype=np.int64)
            else:
                raise SystemExit(f"error: unknown job kind {kind!r}")
    np.savez(out_path, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
