"""The playground on `lmiserve serve` with the bundled SmolLM2-135M-Instruct (no model configured, as
`make serve` starts it), in a real headless Chromium: a real reply streams into the page while two
other clients' streams run, and the batch panel counts them all.

`UPDATE_SCREENSHOT=1` writes the page, mid-stream, to docs/playground.png (the picture in docs/getting-started.md, "The playground").
"""

from __future__ import annotations

import os
import re
import threading

import httpx
import pytest

from helpers.browser import headless_chromium, open_page
from helpers.server import REPO_ROOT
from helpers.waiting import wait_until

pytestmark = pytest.mark.e2e

SCREENSHOT = REPO_ROOT / "docs" / "playground.png"


@pytest.fixture(scope="module")
def url(server_pool, smollm_dir) -> str:  # converts the bundled GGUF into the user cache once
    return server_pool.url([], timeout=300)  # `make serve`'s server, shared with the other e2e modules


class Background:
    """A client streaming a long completion on a thread until `stop`."""

    def __init__(self, url: str, prompt: str) -> None:
        self.tokens = 0
        self._stop = threading.Event()
        body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    self.tokens += line.startswith("data: {")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def stat(page, name: str) -> str:
    return page.locator(f'#models [data-stat="{name}"]').first.inner_text()


def test_a_real_reply_streams_beside_the_live_batch(url):
    others = [Background(url, "Count from 1 to 1000: 1, 2, 3,"), Background(url, "List every month of the year:")]
    try:
        with headless_chromium() as browser, open_page(browser, f"{url}/playground") as page:
            page.locator('#connection[data-state="live"]').wait_for()
            assert stat(page, "status") == "ready"
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "300")
            page.fill("#prompt", "Write a short story about a robot who learns to paint.")
            page.press("#prompt", "Enter")
            reply = page.locator(".msg.assistant").last
            wait_until(lambda: len(reply.inner_text()) > 200, "a few lines of the reply streamed", timeout=300)
            assert page.locator(".msg.assistant.streaming").count() == 1, "the reply is still streaming"
            words = re.findall(r"[A-Za-z]{2,}", reply.inner_text())
            assert len(words) >= 20, reply.inner_text()  # words, from the real model (which ones varies by CPU)
            wait_until(lambda: int(stat(page, "running")) >= 1, "the panel shows the running requests")
            wait_until(lambda: float(stat(page, "tokens_per_second")) > 0, "the panel shows tokens/s")
            if os.environ.get("UPDATE_SCREENSHOT"):
                SCREENSHOT.write_bytes(page.screenshot(type="png"))
            page.click("#stop")
            page.locator(".msg.assistant .note", has_text="(stopped)").wait_for()
    finally:
        for other in others:
            other.stop()
    assert all(other.tokens > 0 for other in others)
