"""The web console in real headless Chromium against a real `tokenmill serve`.

One server (the bundled model, an API key, a small KV pool so the block bar
moves) and one browser page: the page is behind the key, so the browser
first gets the login form (a wrong key is refused, the right one sets an
HttpOnly session cookie and lands on the console), then chats with the model
and shows the answer streaming in with its TTFT / tokens/s / cached-token
figures, then shows the running count and token rate rise while a few
concurrent streams run from httpx, and fall back when they end, and finally
logs out. The screenshot taken under load goes to a temporary file (see SCREENSHOT).

Chromium is Debian's package, driven by Playwright for Python with its own
browser download never used (``executable_path``). A fresh machine gets the
package from apt when we are root; otherwise the test skips and says why.
"""
from __future__ import annotations

import os
import threading
import time
import tempfile
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from test_server_support import real_server

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Written under a temporary folder (tests write nowhere else); set TOKENMILL_CONSOLE_SCREENSHOT
# to a path to refresh docs/console.png (shown in docs/serving.md) from a run.
SCREENSHOT = Path(os.environ.get("TOKENMILL_CONSOLE_SCREENSHOT")
                  or Path(tempfile.gettempdir()) / f"tokenmill-console-{os.getpid()}.png")
API_KEY = "console-test-key"


def ensure_chromium() -> str:
    """Path of Debian's chromium; the test skips, saying how to install it, when it is missing
    (tests install nothing)."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    pytest.skip(f"{CHROMIUM} is missing: install it (`apt-get install -y chromium fonts-dejavu-core`) "
                "to enable the console browser test")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="Playwright for Python is missing (pip install playwright)")
    path = ensure_chromium()
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def _number(page: Any, selector: str) -> float:
    text = page.inner_text(selector).replace(",", "").strip()
    return float(text) if text not in ("", "–") else float("nan")


def _stream_load(url: str, n: int, max_tokens: int) -> list[threading.Thread]:
    """n concurrent streaming chats, read to the end."""
    def one(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Tell me a long story about lighthouse number {i}."}],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=180) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_console_chats_and_shows_the_engine_working(browser):
    # the float32 reference: its 4 x 48-token load runs long enough for the once-a-second view
    # to see it (the faster default can finish it between two polls)
    with real_server("--max-output-tokens", "48", "--kv-cache-memory", "48MiB", "--api-key", API_KEY,
                     "--dtype", "float32", "--quantization", "none") as server:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        first = page.goto(server.url + "/")

        # the server wants a key: the console is behind a login form that says nothing about the engine
        assert first is not None and first.status == 401
        assert "API key" in page.inner_text("#login-form") and page.query_selector("#running") is None
        page.fill("#key", "not-the-key")
        with page.expect_navigation():
            page.press("#key", "Enter")
        assert "not right" in page.inner_text("#login-form")
        page.fill("#key", API_KEY)
        with page.expect_navigation(url=server.url + "/"):
            page.press("#key", "Enter")
        page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=10_000)
        # the session is an HttpOnly, SameSite=Strict cookie: page scripts see neither it nor the key
        (cookie,) = [c for c in page.context.cookies() if c["name"].startswith("tokenmill_session")]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and API_KEY not in cookie["value"]
        assert "tokenmill_session" not in page.evaluate("document.cookie")
        assert page.evaluate("localStorage.getItem('tokenmill.apiKey')") is None
        assert page.is_visible("#logout")
        assert page.inner_text("#model-name").startswith("SmolLM2")
        facts = page.inner_text("#facts")
        assert "float32" in facts and "Weight memory" in facts and "KV pool" in facts
        assert _number(page, "#running") == 0

        # chat: watch the answer's text grow chunk by chunk, then its figures
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "32")
        page.evaluate("""() => {
            window.__lengths = [];
            new MutationObserver(() => {
                const el = document.querySelector('.msg.assistant:last-of-type .text');
                if (el) window.__lengths.push(el.textContent.length);
            }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
        }""")
        page.fill("#prompt", "What is the capital of France?")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant .meta", timeout=90_000)
        answer = page.inner_text(".msg.assistant .text")
        lengths = page.evaluate("window.__lengths")
        assert answer.strip(), "no answer text"
        growing = sorted({n for n in lengths if n > 0})
        assert len(growing) >= 3, f"the answer did not stream in pieces: {lengths}"
        meta = page.inner_text(".msg.assistant .meta")
        assert "TTFT" in meta and "tokens/s" in meta and "prompt tokens" in meta, meta

        # a second turn repeats the first turn's prompt: its cached prompt tokens come from the prefix cache
        page.fill("#prompt", "And of Italy?")
        page.press("#prompt", "Enter")
        page.wait_for_function("document.querySelectorAll('.msg.assistant .meta').length === 2", timeout=90_000)
        cached = page.inner_text(".msg.assistant:last-of-type .meta .cached b")
        assert int(cached.split("/")[0].strip()) >= 16, cached

        # load: the running count and the token rate rise, the screenshot shows it, then they fall back
        page.wait_for_function("document.getElementById('running').textContent === '0'", timeout=10_000)
        threads = _stream_load(server.url, n=4, max_tokens=48)
        page.wait_for_function("Number(document.getElementById('running').textContent) >= 2", timeout=60_000)
        page.wait_for_function("parseFloat(document.getElementById('tok-out').textContent) > 0", timeout=30_000)
        page.wait_for_function("document.getElementById('kv-used-n').textContent !== '0'", timeout=30_000)
        time.sleep(1.5)  # one more refresh so the charts show the load
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))
        for t in threads:
            t.join(180)
        page.wait_for_function("document.getElementById('running').textContent === '0'", timeout=30_000)
        page.wait_for_function("parseFloat(document.getElementById('tok-out').textContent) === 0", timeout=30_000)
        assert "p50" in page.inner_text("#ttft-pct") and "n=" in page.inner_text("#tpot-pct")
        assert not errors, errors

        # logging out ends the session: back to the form, and the page's API calls are refused
        with page.expect_navigation(url=server.url + "/"):
            page.click("#logout")
        assert page.is_visible("#login-form")
        assert not [c for c in page.context.cookies() if c["name"].startswith("tokenmill_session")]
        assert page.request.get(server.url + "/v1/engine/stats").status == 401
        page.close()
    assert 10_000 < SCREENSHOT.stat().st_size < 300_000
