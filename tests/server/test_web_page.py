"""`clover serve`'s chat page (GET /, clover_cpp/server/static/) and the canvas events it draws
(stream_options.include_canvas: `event: clover.canvas` in the SSE stream, docs/server.md).

Without a browser: the page and its files are served (past the API key: they hold no secret),
and the canvas events come only when asked, with their fields, and agree with the reply.
In a real browser: headless Chromium (Debian's `chromium`, driven by Playwright from PyPI with
executable_path: never `playwright install`) loads the page from a live `clover serve` on the
default model, sends a message, sees the reply streamed and the canvas drawn, and saves
screenshots (CLOVER_WEB_SCREENSHOTS=DIR keeps them there; docs/img/web-page.png is one)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_libclover

httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

from clover_testkit.server_harness import InProcessServer, Server  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "page-test-key"


@pytest.fixture(scope="module")
def tiny_server(tiny_artifacts):
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=512, n_threads=1) as m:
        s = InProcessServer(m, api_key=KEY)
        yield s, m
        s.stop()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _events(url: str, body: dict) -> list[tuple[str, str]]:
    """The SSE stream of a chat request as (event name, data) pairs."""
    out, name, data = [], "message", []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=_auth(), timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                if data:
                    out.append((name, "\n".join(data)))
                name, data = "message", []
            elif line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
    return out


def test_the_page_is_served_without_the_key(tiny_server) -> None:
    s, _ = tiny_server
    r = httpx.get(s.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert httpx.head(s.url + "/").status_code == 200
    assert "<title>Clover</title>" in r.text and "/static/app.js" in r.text and "/static/style.css" in r.text
    for f, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{s.url}/static/{f}")
        assert r.status_code == 200 and kind in r.headers["content-type"], f
        assert KEY not in r.text
    # nothing fetched from elsewhere: the page works offline
    for f in ("index.html", "app.js", "style.css"):
        text = (REPO / "clover_cpp" / "server" / "static" / f).read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, f
    # the rest wants the key; a path out of static/ is a 404, not a file
    assert httpx.get(s.url + "/props").status_code == 401
    assert httpx.post(s.url + "/", json={}).status_code == 401
    assert httpx.get(s.url + "/props", headers=_auth()).status_code == 200
    # (the client makes "/static/../app.py" "/app.py": behind the key; "%2e%2e" reaches static/ as "..")
    assert httpx.get(s.url + "/static/../app.py").status_code == 401
    for bad in ("/static/%2e%2e/app.py", "/static/%2e%2e/%2e%2e/server/app.py", "/static/nothing.js"):
        r = httpx.get(s.url + bad)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", bad


def test_canvas_events_only_when_asked(tiny_server) -> None:
    s, m = tiny_server
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    base = {"messages": msgs, "max_tokens": 20, "temperature": 0, "block_size": 4, "ignore_eos": True,
            "stream": True}
    plain = _events(s.url, {**base, "stream_options": {"include_usage": True}})
    assert {name for name, _ in plain} == {"message"}
    assert all(d == "[DONE]" or "clover.canvas" not in d for _, d in plain)

    evs = _events(s.url, {**base, "stream_options": {"include_usage": True, "include_canvas": True}})
    assert {name for name, _ in evs} == {"message", "clover.canvas"}
    canvas = [json.loads(d) for name, d in evs if name == "clover.canvas"]
    chunks = [json.loads(d) for name, d in evs if name == "message" and d != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    usage = chunks[-1]["usage"]
    # the same reply as without the events
    assert text == "".join(c["choices"][0]["delta"].get("content") or ""
                           for c in (json.loads(d) for _, d in plain if d != "[DONE]") if c.get("choices"))
    n_prompt = usage["prompt_tokens"]
    for e in canvas:
        assert set(e) == {"object", "index", "offset", "block_start", "block_size", "step", "n_masked", "tokens",
                          "steps", "verified"}
        assert e["object"] == "clover.canvas" and e["block_size"] == 4 and e["verified"] is False and e["index"] == 0
        assert e["offset"] == e["block_start"] + e["block_size"] - len(e["tokens"]) - n_prompt >= 0
        assert len(e["steps"]) == len(e["tokens"]) and e["step"] >= 1
        assert e["n_masked"] == sum(t is None for t in e["tokens"])
        for t, st in zip(e["tokens"], e["steps"]):
            assert (t is None) == (st is None) and (st is None or 1 <= st <= e["step"])
    # per block: steps count from 1, a position keeps the step that fixed it, and the blocks'
    # last states spell the reply
    blocks: dict[int, list[dict]] = {}
    for e in canvas:
        blocks.setdefault(e["block_start"], []).append(e)
    assert len(blocks) == 20 // 4
    spelled = []
    for start, seq in blocks.items():
        assert [e["step"] for e in seq] == list(range(1, len(seq) + 1))
        for a, b in zip(seq, seq[1:]):
            assert all(x is None or x == y for x, y in zip(a["steps"], b["steps"]))
        assert seq[-1]["n_masked"] == 0
        spelled += seq[-1]["tokens"]
    assert "".join(spelled) == text and len(spelled) == usage["completion_tokens"]
    assert min(e["offset"] for e in canvas) == 0

    # draft-self: one event per verification, the kept tokens and the draft it checked (libclover's
    # draft callback): the kept ones are the draft's accepted prefix, then the model's own token
    # where it rejected one; over the reply they add up to the totals of clover.draft_self
    ds = _events(s.url, {**base, "draft_self": True, "block_size": 8,
                         "stream_options": {"include_canvas": True}})
    ds_canvas = [json.loads(d) for name, d in ds if name == "clover.canvas"]
    assert ds_canvas and all(e["verified"] is True for e in ds_canvas)
    final = json.loads([d for _, d in ds if d != "[DONE]"][-1])
    totals = final["clover"]["draft_self"]
    # (a last block of one position is no draft: the autoregressive token itself, no "drafted")
    ds_canvas = [e for e in ds_canvas if "drafted" in e]
    assert all(len(e["drafted"]) == len(e["tokens"]) for e in ds_canvas)
    assert totals["verifications"] == len(ds_canvas) >= 1
    accepted = drafted = 0
    for e in ds_canvas:
        kept = [t for t in e["tokens"] if t is not None]
        n = sum(d is not None for d in e["drafted"])
        k = next((i for i, (t, d) in enumerate(zip(e["tokens"], e["drafted"][:n])) if t != d), n)
        assert len(kept) == (k if k == n else k + 1) and kept[:k] == e["drafted"][:k], e
        accepted, drafted = accepted + k, drafted + n
    assert (accepted, drafted) == (totals["accepted"], totals["drafted"]), (accepted, drafted, totals)

    # completions too
    with httpx.stream("POST", s.url + "/v1/completions", headers=_auth(), timeout=60,
                      json={"prompt": "def add(a, b):", "max_tokens": 8, "block_size": 4, "stream": True,
                            "ignore_eos": True, "stream_options": {"include_canvas": True}}) as r:
        assert sum(line == "event: clover.canvas" for line in r.iter_lines()) >= 2

    # asked without streaming: a 400 naming the field
    r = httpx.post(s.url + "/v1/chat/completions", headers=_auth(),
                   json={**base, "stream": False, "stream_options": {"include_canvas": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = httpx.post(s.url + "/v1/chat/completions", headers=_auth(),
                   json={**base, "stream_options": {"include_canvas": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_canvas"


def test_a_canvas_stream_left_early_is_cancelled(tiny_server) -> None:
    """A client that goes away mid-stream (the page's Stop) cancels the generation on the canvas
    path too (its text is read by a pump thread), and that thread ends."""
    import threading
    import time

    s, _ = tiny_server

    def cancelled() -> float:
        text = httpx.get(s.url + "/metrics", headers=_auth()).text
        return float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("clover_cancelled_total ")))

    before = cancelled()
    # threshold 1.0 at B = 64: one token per 64-token pass, 384 of them: seconds of work
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 384, "block_size": 64, "threshold": 1.0,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_canvas": True}}
    n = 0
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, headers=_auth(), timeout=60) as r:
        for line in r.iter_lines():
            n += line == "event: clover.canvas"
            if n == 3:
                break
    deadline = time.monotonic() + 20
    while (cancelled() == before or any(t.name == "clover-serve-canvas" for t in threading.enumerate())) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 1
    assert not [t for t in threading.enumerate() if t.name == "clover-serve-canvas"]
    r = httpx.post(s.url + "/v1/chat/completions", headers=_auth(), timeout=30,
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4})
    assert r.status_code == 200


# ----------------------------------------------------------------------------- a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# as root in a container, offline: no sandbox, no GPU, nothing fetched in the background
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def default_gguf(tmp_path_factory) -> Path:
    from clover_convert import convert

    out = tmp_path_factory.mktemp("default") / "clover-default-f16.gguf"
    convert(REPO / "models" / "clover-default", out, outtype="f16", progress=False)
    return out


# Test instrument (not part of the page): wrap the page's SSE reader so that it holds the
# stream after the N-th canvas event that still has masked positions (window.__pauseAt = N),
# until the test resumes it. A screenshot then shows a reply being written: the block with its
# placeholders and the tokens the steps so far have fixed.
PAUSE_JS = """
(() => {
  const orig = window.readEvents;
  window.__pauseAt = 0;
  window.__paused = false;
  let release = null;
  window.__resume = () => { window.__paused = false; if (release) release(); };
  window.readEvents = async function* (response) {
    let seen = 0;
    for await (const ev of orig(response)) {
      yield ev;
      if (ev.event === "clover.canvas" && JSON.parse(ev.data).n_masked > 0 && ++seen === window.__pauseAt) {
        window.__paused = true;
        await new Promise((r) => { release = r; });
      }
    }
  };
})();
"""
PAUSED_OR_DONE = "window.__paused === true || document.querySelectorAll('.msg.assistant.done').length > %d"


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install chromium chromium-driver (.ci/run does)")
def test_the_page_in_chromium(default_gguf, tmp_path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="the test extra installs playwright")
    shots = Path(os.environ.get("CLOVER_WEB_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    server = Server(default_gguf, "-t", "1", "--api-key", KEY)
    try:
        with sync_api.sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
                viewport={"width": 1280, "height": 800})
            try:
                page = ctx.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                sent: list[dict] = []  # the chat requests' bodies, as the page sent them
                page.on("request", lambda r: sent.append(r.post_data_json)
                        if r.url.endswith("/v1/chat/completions") else None)
                page.goto(server.url + "/")
                # the server has a key: the page says so, then works once it is typed in
                sync_api.expect(page.locator("#status")).to_have_text("API key needed", timeout=20_000)
                page.fill("#api-key", KEY)
                page.dispatch_event("#api-key", "change")
                sync_api.expect(page.locator("#status")).to_have_text("ready", timeout=20_000)
                assert "clover" in page.inner_text("#model-name").lower()
                page.fill("#block-size", "8")
                page.fill("#temperature", "0")
                page.fill("#max-tokens", "96")
                page.fill("#coreset", "4")  # the default model is a MoE of 8 experts
                page.evaluate(PAUSE_JS)
                page.evaluate("window.__pauseAt = 12")
                page.fill("#input", "def fibonacci(n):")
                page.press("#input", "Enter")
                # mid-reply: the block with placeholders and unmasked tokens, the text streaming
                page.wait_for_function(PAUSED_OR_DONE % 0, timeout=120_000)
                assert page.evaluate("window.__paused") is True, "the reply had < 12 steps with masked positions"
                assert page.locator(".msg.assistant .block.current .tok.masked").count() > 0
                assert page.locator(".msg.assistant .block .tok[data-step]").count() > 0
                assert page.locator("#stop").is_enabled()
                page.screenshot(path=str(shots / "web-page-writing.png"))
                page.evaluate("window.__resume()")
                page.wait_for_selector(".msg.assistant.done", timeout=120_000)
                reply = page.inner_text(".msg.assistant .text")
                stats = page.inner_text(".msg.assistant .stats")
                assert not page.locator(".msg.assistant.error").count(), stats
                assert reply.strip() and reply != "(no text)", reply
                assert "tok/forward" in stats and "tok/s" in stats and "B 8" in stats, stats
                assert sent[0]["coreset"] == 4 and sent[0]["block_size"] == 8, sent[0]
                assert "coreset 4" in stats, stats
                cells = page.locator(".msg.assistant .blocks .tok[data-step]")
                assert cells.count() >= 8
                assert "step" in (cells.first.get_attribute("title") or "")
                page.screenshot(path=str(shots / "web-page-done.png"))
                # stop: a second reply, held at its first step, is aborted; the page is usable again
                page.evaluate("window.__pauseAt = 1")
                page.fill("#input", "class Stack:")
                page.press("#input", "Enter")
                page.wait_for_function(PAUSED_OR_DONE % 1, timeout=120_000)
                assert page.evaluate("window.__paused") is True
                page.click("#stop")
                page.evaluate("window.__resume()")
                page.wait_for_selector(".msg.assistant.done >> nth=1", timeout=30_000)
                assert "stopped" in page.locator(".msg.assistant .stats").nth(1).inner_text()
                assert page.locator("#send").is_enabled()
                # draft-self: the totals in the statistics, each verification's accepted / drafted
                # tokens on its block and in the canvas's head; no coreset field when empty
                page.evaluate("window.__pauseAt = 0")  # (never held again)
                page.fill("#coreset", "")
                page.select_option("#draft-self", "true")
                page.fill("#input", "def is_prime(n):")
                page.press("#input", "Enter")
                page.wait_for_selector(".msg.assistant.done >> nth=2", timeout=120_000)
                reply = page.locator(".msg.assistant").nth(2)
                stats = reply.locator(".stats").inner_text()
                assert sent[-1]["draft_self"] is True and "coreset" not in sent[-1], sent[-1]
                assert "drafted tokens accepted" in stats and "verifications" in stats, stats
                assert "coreset" not in stats, stats
                assert "drafted tokens accepted per verification: " in reply.locator(".canvas-head").inner_text()
                assert "drafted tokens accepted" in (reply.locator(".block").first.get_attribute("title") or "")
                # each verification's accepted draft tokens, and where one was rejected the model's own
                # token with the rejected draft token beside it
                assert reply.locator(".tok.accepted").count() + reply.locator(".tok.own").count() >= 1
                assert reply.locator(".tok.own").count() == reply.locator("s.rejected").count()
                page.screenshot(path=str(shots / "web-page-draft-self.png"))
                # a coreset the server refuses: its 400, naming the field, on the page
                page.fill("#coreset", "many")
                page.fill("#input", "x")
                page.press("#input", "Enter")
                page.wait_for_selector(".msg.assistant.error", timeout=30_000)
                assert sent[-1]["coreset"] == "many"
                assert "coreset" in page.locator(".msg.assistant.error .stats").inner_text()
                assert not errors, errors
            finally:
                ctx.close()
    finally:
        server.stop()
    assert (shots / "web-page-writing.png").stat().st_size > 10_000
