"""The demo's model and its speed comparison, for `clover demo` and the benchmarks.

* :func:`demo_model`: the default model as a GGUF, converted from the checkpoint that ships with
  clover-cpp (``models/clover-default`` of the repository, ``clover_cpp/models/clover-default``
  of an installed wheel) on first use and cached; ``CLOVER_DEMO_MODEL`` chooses another
  checkpoint folder or GGUF.
* :func:`paired_runs`: run settings in paired, repeated rounds (the order rotated per round), as
  `clover demo` and `clover bench` compare block sizes; :func:`speed_verdict` says what the
  paired ratios support, :func:`machine_load` whether the machine was busy while they ran.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DemoModelError", "bundled_model_dir", "default_cache_dir", "default_model_locations", "demo_model",
           "paired_runs", "speed_verdict", "machine_load"]


class DemoModelError(ValueError):
    """No demo model: CLOVER_DEMO_MODEL names none, or this installation has no default model."""


def default_cache_dir() -> Path:
    """Where the demo GGUF is cached: $CLOVER_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache, then
    clover-cpp/demo."""
    env = os.environ.get("CLOVER_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "clover-cpp" / "demo"


def _is_model(d: Path) -> bool:
    return (d.is_file() and d.suffix == ".gguf") or (d / "config.json").is_file()


def default_model_locations() -> list[Path]:
    """Where the default checkpoint ships: models/clover-default of a source checkout (the folder
    that holds clover_cpp/), clover_cpp/models/clover-default of an installed wheel."""
    package = Path(__file__).resolve().parent
    return [package.parent / "models" / "clover-default", package / "models" / "clover-default"]


def bundled_model_dir() -> Path | None:
    """The default model: CLOVER_DEMO_MODEL (a checkpoint folder or a .gguf) when set, else the
    trained default checkpoint shipped with clover-cpp, if any."""
    env = os.environ.get("CLOVER_DEMO_MODEL")
    if env:  # an explicit choice must not silently fall back to another model
        if _is_model(Path(env)):
            return Path(env)
        raise DemoModelError(f"CLOVER_DEMO_MODEL={env}: not a .gguf file or a checkpoint folder with config.json")
    return next((d for d in default_model_locations() if _is_model(d)), None)


def _folder_fingerprint(d: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(d.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def demo_model(cache_dir: Path, log: Callable[[str], Any] | None = None) -> tuple[Path, str]:
    """The demo GGUF (converted to f16 and cached in cache_dir on first use) and a description of
    its source: ``CLOVER_DEMO_MODEL`` (a checkpoint folder or a .gguf), else the default
    checkpoint shipped with clover-cpp. Without either, DemoModelError says how to get one."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    src = bundled_model_dir()
    if src is None:
        raise DemoModelError("this installation has no default model (models/clover-default): set CLOVER_DEMO_MODEL "
                             "to a Clover checkpoint folder or .gguf, e.g. the repository's models/clover-default")
    if src.suffix == ".gguf":
        return src, f"{src}"
    from clover_convert import convert  # (the converter: only when a checkpoint needs converting)

    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"clover-default-{_folder_fingerprint(src)}-f16.gguf"
    if not out.is_file():
        say(f"converting {src} -> {out} ...")
        convert(str(src), str(out), outtype="f16", force=True, progress=sys.stderr.isatty())
    return out, f"{src} (converted to f16)"


def paired_runs(run: Callable[[Any], Any], settings: Sequence[Any], rounds: int) -> dict[Any, list[Any]]:
    """run(setting) for every setting in each of `rounds` rounds, the order rotated per round
    (so slow drifts of the machine hit every setting alike); {setting: [result per round]}."""
    out: dict[Any, list[Any]] = {s: [] for s in settings}
    for r in range(rounds):
        k = r % len(settings)
        for s in list(settings[k:]) + list(settings[:k]):
            out[s].append(run(s))
    return out


def machine_load() -> float | None:
    """The 1-minute load average per core (None where the OS has none): above ~0.5 something else
    is running, and a timing then measures the neighbours more than the code."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return None


def speed_verdict(ratios: Sequence[float]) -> str:
    """What paired ratios (ours / baseline, one per round) support: a speed-up or slow-down only
    when every round agrees on the side of 1.0; a range that straddles 1.0 is no measurable
    difference, and a single round is never a verdict."""
    if len(ratios) < 2:
        return "no verdict (fewer than 2 paired rounds)"
    med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
    spread = f"{med:.2f}x ({lo:.2f}-{hi:.2f}), median of {len(ratios)} paired rounds, min-max"
    if lo <= 1.0 <= hi:
        return f"no measurable speed-up: {spread}"
    return f"{'speed-up' if lo > 1.0 else 'slow-down'} {spread}"
