"""The auto cost curve is measured and cached per backend set: a model whose
layers live on an RPC server gets its own calibration entry, never the local CPU's; the entry's
key names the placement (servers, devices, offloaded layers, split)."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from clover_testkit.rpc import RpcServer as _RpcServer

pytestmark = pytest.mark.needs_libclover

REPO = Path(__file__).resolve().parents[2]
RPC_SERVER = Path(os.environ.get("CLOVER_RPC_SERVER_PATH", REPO / "build" / "bin" / "ggml-rpc-server"))

if not RPC_SERVER.exists():  # pragma: no cover - ./dev.sh setup builds it
    pytest.skip(f"{RPC_SERVER} is not built (GGML_RPC=OFF?)", allow_module_level=True)

RpcServer = functools.partial(_RpcServer, RPC_SERVER)


def test_cost_curve_cached_per_backend_set(tiny_artifacts, tmp_path, monkeypatch) -> None:
    from clover_cpp import Clover

    cache = tmp_path / "cache"
    monkeypatch.setenv("CLOVER_CACHE_DIR", str(cache))

    def calibration(**kw) -> str:
        with Clover(tiny_artifacts["f32"], n_ctx=256, n_threads=1, **kw) as m:
            return m.generate("hello", max_tokens=2).stats.calibration

    assert calibration() == "measured"
    assert calibration() == "cached"
    (local,) = cache.glob("calibration-*.txt")
    assert "placement n_gpu_layers 0 rpc [] devices split ot []" in local.read_text()
    server = RpcServer()
    try:
        rpc = dict(rpc_servers=server.endpoint, n_gpu_layers=99)
        # the CPU's curve is there, but an RPC split is another backend set: measured, stored apart
        assert calibration(**rpc) == "measured"
        entries = set(cache.glob("calibration-*.txt"))
        assert len(entries) == 2
        (remote,) = entries - {local}
        key = remote.read_text()
        assert f"rpc [{server.endpoint}] devices {server.endpoint}/" in key and "n_gpu_layers 99" in key
        assert calibration(**rpc) == "cached"
        # the same server with fewer offloaded layers is another placement again
        assert calibration(rpc_servers=server.endpoint, n_gpu_layers=2) == "measured"
        assert len(list(cache.glob("calibration-*.txt"))) == 3
    finally:
        server.stop()
    assert calibration() == "cached"  # the local entry is untouched
