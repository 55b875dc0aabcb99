"""``clover serve``: the decoding contexts (slots), their queue and watchdog, and the metrics.

A slot is one decoding context over the shared model. A request takes a free slot (the one
whose memory holds the longest part of its prompt: read from the model, its committed tokens
and, for a chat, the conversation of its last exchange; the pool keeps no copy of either),
waits in a bounded queue when all are busy, and gets 503 with ``Retry-After`` when the queue
is full. While a slot generates, every denoising step that unmasks something is progress; a
generation with no progress for ``stuck_after`` seconds is cancelled by the watchdog, and
``/health`` answers 503 while any slot has been without progress that long (a generation that
does not stop when cancelled keeps it so).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import Clover, GenerationResult
from .asgi import CLIENT_GONE
from .types import APIError


@dataclass
class Slot:
    model: Clover
    index: int
    # while busy
    busy_since: float = 0.0
    last_progress: float = 0.0
    progress_key: tuple[int, int] = (-1, -1)
    cancel: threading.Event | None = None
    watchdog_fired: bool = False

    def reuse(self, prompt: Sequence[int]) -> int:
        """How many of ``prompt``'s tokens this context's memory holds: all of its committed
        tokens when the prompt starts with them (libclover keeps them then), else none."""
        mem = self.model.committed_tokens
        n = len(mem)
        return n if n and len(prompt) >= n and list(prompt[:n]) == mem else 0

    def chat_reuse(self, text: str) -> int:
        """The same for a rendered chat prompt: the memory of the conversation it continues (the
        model's last exchange, whose prompt and reply tokens the next turn reads again)."""
        ex = self.model.last_exchange
        if ex is None or not ex.continued_by(text):
            return 0
        return self.reuse(ex.prompt_tokens + ex.reply_tokens)

    def start(self, cancel: threading.Event) -> None:
        self.busy_since = self.last_progress = time.monotonic()
        self.progress_key = (-1, -1)
        self.cancel, self.watchdog_fired = cancel, False

    def step(self, n_masked: int, block_start: int) -> bool:
        """From the decode thread, after every denoising step: True = cancel."""
        key = (block_start, n_masked)
        if key != self.progress_key:
            self.progress_key, self.last_progress = key, time.monotonic()
        return self.cancel is not None and self.cancel.is_set()

    def block(self) -> bool:
        """From the decode thread, after every committed block: True = cancel."""
        self.last_progress = time.monotonic()
        return self.cancel is not None and self.cancel.is_set()

    def stalled_for(self, now: float) -> float:
        return now - self.last_progress if self.cancel is not None else 0.0


class Pool:
    """N slots over one model; ``acquire`` waits for a free one in a bounded queue."""

    def __init__(self, base: Clover, n: int, max_queue: int) -> None:
        self.slots = [Slot(base, 0)] + [Slot(base.new_context(), i) for i in range(1, n)]
        self.free = list(self.slots)
        self.max_queue = max_queue
        self.waiting = 0
        self._cond = asyncio.Condition()

    @property
    def busy(self) -> list[Slot]:
        return [s for s in self.slots if s not in self.free]

    async def acquire(self, score: Callable[[Slot], int]) -> Slot:
        """A free slot, the one with the highest ``score`` (the prompt's part it holds)."""
        gone = CLIENT_GONE.get()  # the request's client has left (asgi.Guard watches it)
        async with self._cond:
            if not self.free and self.waiting >= self.max_queue:
                raise APIError(503, "the server is busy: every context is in use and the queue is full",
                               "server_error", "queue_full", headers={"Retry-After": "1"})
            self.waiting += 1
            wake = asyncio.create_task(self._wake_when(gone)) if gone is not None and not self.free else None
            try:
                await self._cond.wait_for(lambda: bool(self.free) or (gone is not None and gone.is_set()))
            finally:
                self.waiting -= 1
                if wake is not None:
                    wake.cancel()
            if not self.free:  # its place in the queue is given back (it used to be kept)
                raise APIError(499, "the client closed the connection while its request waited for a context",
                               code="client_closed")
            best = self.free[0] if len(self.free) == 1 else max(self.free, key=score)
            self.free.remove(best)
            return best

    async def _wake_when(self, gone: asyncio.Event) -> None:
        await gone.wait()
        async with self._cond:
            self._cond.notify_all()

    async def release(self, slot: Slot) -> None:
        slot.cancel = None
        async with self._cond:
            self.free.append(slot)
            self._cond.notify()

    def cancel_all(self) -> None:
        for s in self.slots:
            if s.cancel is not None:
                s.cancel.set()

    def stuck(self, stuck_after: float) -> list[Slot]:
        now = time.monotonic()
        return [s for s in self.busy if s.stalled_for(now) > stuck_after]

    def close(self) -> None:
        for s in self.slots[1:]:
            s.model.close()


# ----------------------------------------------------------------------------- metrics

@dataclass
class Metrics:
    requests: int = 0
    errors: int = 0
    cancelled: int = 0
    stuck: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    completion_tokens: int = 0
    decode_passes: int = 0
    decode_forwards: int = 0    # passes + commits that rode on no pass (B = 1: one per token)
    decode_seconds: float = 0.0

    def add(self, r: GenerationResult, n_prompt: int) -> None:
        s = r.stats
        self.prompt_tokens += n_prompt
        self.reused_tokens += s.n_reused
        self.completion_tokens += len(r.tokens)
        self.decode_passes += s.n_decode_passes
        self.decode_forwards += s.n_decode_forwards
        self.decode_seconds += s.t_decode_ms / 1000.0

    def prometheus(self, pool: Pool) -> str:
        """The Prometheus text format: ``# HELP`` and ``# TYPE`` before every sample."""
        tpf = self.completion_tokens / self.decode_forwards if self.decode_forwards else 0.0
        rows = [
            ("requests_total", "counter", "Generation requests received.", self.requests),
            ("errors_total", "counter", "Requests answered with an error.", self.errors),
            ("cancelled_total", "counter", "Generations cancelled (the client left, or shutdown).", self.cancelled),
            ("stuck_total", "counter", "Generations the watchdog stopped (no progress).", self.stuck),
            ("prompt_tokens_total", "counter", "Prompt tokens of finished generations.", self.prompt_tokens),
            ("prompt_tokens_reused_total", "counter", "Prompt tokens found in a context's memory (not prefilled).",
             self.reused_tokens),
            ("completion_tokens_total", "counter", "Tokens generated.", self.completion_tokens),
            ("decode_passes_total", "counter", "Block passes run while decoding.", self.decode_passes),
            ("decode_forwards_total", "counter", "Forwards run while decoding (passes and lone commits).",
             self.decode_forwards),
            ("tokens_per_forward", "gauge", "Generated tokens per decode forward, over all requests.", round(tpf, 4)),
            ("decode_seconds_total", "counter", "Seconds spent decoding.", round(self.decode_seconds, 4)),
            ("contexts", "gauge", "Decoding contexts (--parallel).", len(pool.slots)),
            ("contexts_busy", "gauge", "Contexts generating now.", len(pool.slots) - len(pool.free)),
            ("queue_depth", "gauge", "Requests waiting for a context.", pool.waiting),
        ]
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP clover_{name} {help_}", f"# TYPE clover_{name} {kind}", f"clover_{name} {value}"]
        return "\n".join(out) + "\n"


@dataclass
class ServerState:
    """What the app's routes share (``app.state.clover``)."""

    pool: Pool | None = None
    max_piece: int = 1 << 20          # bytes of the longest token's text (set at startup)
    shutting_down: bool = False
    watchdog: "asyncio.Task[Any] | None" = None
    metrics: Metrics = field(default_factory=Metrics)


async def watchdog(st: ServerState, stuck_after: float) -> None:
    """Cancels a generation that made no progress for ``stuck_after`` seconds (runs until cancelled)."""
    period = max(0.05, min(1.0, stuck_after / 4))
    while True:
        await asyncio.sleep(period)
        for s in st.pool.stuck(stuck_after) if st.pool else ():
            if not s.watchdog_fired and s.cancel is not None:
                s.watchdog_fired = True
                s.cancel.set()
                st.metrics.stuck += 1
