"""The playground on a real server: the page and its files (open, same-origin only), the stats stream
(needs the key; the engine's live state), and the page itself in a real headless Chromium (Debian's
`chromium` driven by playwright): it loads, a message streams into it token by token while the batch
panel shows the running request, Stop ends it and the panel shows 0 again. On a tiny vision-language
model the page offers to attach an image (file, paste or drop), shows it as a thumbnail, sends it as an
`image_url` data URL and refuses one over the server's `max_image_bytes`; a text model hides the control.

The server runs the tiny model with a 2**20-token context and an end-of-sequence token it can never
sample (`model_dir`), so a chat asking for a million tokens streams for many minutes, whatever the
CPU's rounding makes of the page's seeded sampling: the page is looked at while it streams, never after.
The screenshot in docs/getting-started.md ("The playground") is taken on the bundled model: tests/e2e/test_playground_bundled.py.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from helpers.browser import headless_chromium, open_page
from helpers.server import REPO_ROOT, free_port, run_server
from helpers.tiny_model import ENDLESS_CONTEXT, with_context
from helpers.tiny_vlm import tiny_image
from helpers.waiting import wait_until

KEY = "playground-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = 1_000_000  # max_tokens of a chat that streams until it is stopped


@pytest.fixture(scope="module")
def model_dir(unreachable_eos_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model that cannot end a reply (its EOS lies past the vocabulary; the page cannot send
    ignore_eos) with an ENDLESS_CONTEXT context."""
    return with_context(unreachable_eos_model_dir, tmp_path_factory.mktemp("endless") / "tiny-endless", ENDLESS_CONTEXT)


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    args = ["--model-id", str(model_dir), "--api-key", KEY]
    # the pool's budget is set, not a share of the host's available memory, so that its capacity (2 rows at
    # full context, far under the budget) holds on a loaded machine too
    options = (
        "max_rolling_batch_size=2",
        f"max_new_tokens_limit={ENDLESS_CONTEXT}",
        f"kv_cache_memory_bytes={4 << 30}",
    )
    for option in options:
        args += ["-o", option]
    with run_server(args) as base:
        yield base


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
        yield c


def stats_events(client: httpx.Client, count: int) -> list[dict]:
    """The first `count` events of one stats stream (the stream is then closed)."""
    out: list[dict] = []
    with client.stream("GET", "/playground/stats", headers=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[len("data: ") :]))
                if len(out) == count:
                    break
    return out


# --- the routes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,content_type",
    [
        ("/playground", "text/html; charset=utf-8"),
        ("/playground/playground.js", "text/javascript; charset=utf-8"),
        ("/playground/playground.css", "text/css; charset=utf-8"),
    ],
)
def test_the_page_and_its_files_are_open_and_same_origin_only(client, path, content_type):
    r = client.get(path)  # no key: they do no work
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == content_type
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    text = r.text.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace, never fetched
    assert "http://" not in text and "https://" not in text  # nothing fetched from elsewhere


def test_serve_prints_the_playground_url_and_the_page_is_there(tiny_model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "lmiserve", "serve", "--model-id", str(tiny_model_dir)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)], cwd=REPO_ROOT, env=env, stdout=out, stderr=out
        )
        try:
            wait_until(lambda: "playground: http" in log.read_text(errors="replace"), "the URL is printed")
            printed = re.search(r"playground: (\S+)", log.read_text(errors="replace")).group(1)
            assert printed == f"http://127.0.0.1:{port}/playground"

            def page_answers() -> bool:
                try:
                    return httpx.get(printed, timeout=5, trust_env=False).status_code == 200
                except httpx.TransportError:
                    return False  # not listening yet

            wait_until(page_answers, "the page answers at the printed URL", timeout=120)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def test_tgi_keeps_its_root_routes(client):
    assert client.get("/").status_code == 200  # the health probe
    r = client.post("/", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, headers=AUTH)
    assert r.status_code == 200 and "generated_text" in r.json()[0], r.text


def test_the_stats_stream_needs_the_key(client):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = client.get("/playground/stats", headers=headers)
        assert r.status_code == 401
        assert r.json() == {"error": {"message": "missing or wrong API key", "type": "Unauthorized"}}


def test_the_stats_stream_shows_the_engine(client, model_dir):
    first, second = stats_events(client, 2)
    (model,) = first["models"]
    assert model["name"] == model_dir.name and model["status"] == "ready"
    assert (model["running"], model["waiting"], model["batch_slots"], model["kv_tokens"]) == (0, 0, 2, 0)
    assert model["kv_capacity"] == 2 * ENDLESS_CONTEXT and model["kv_usage"] == 0
    assert second["models"][0]["generated_tokens"] >= model["generated_tokens"]

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it runs
        for _ in range(20):  # tokens keep coming while the stats are read
            next(lines)

        def live() -> dict:
            return stats_events(client, 2)[1]["models"][0]

        wait_until(lambda: live()["running"] == 1, "the stream is running")
        busy = live()
        assert busy["kv_tokens"] > 0 and busy["kv_usage"] > 0 and busy["waiting"] == 0
        assert busy["generated_tokens"] > model["generated_tokens"]
        wait_until(lambda: live()["tokens_per_second"] > 0, "tokens/s shows the stream")
    wait_until(lambda: stats_events(client, 1)[0]["models"][0]["running"] == 0, "the stream's slot is free")


# --- the page in a real browser -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with headless_chromium() as browser:
        yield browser


@pytest.fixture
def page(browser, url: str) -> Iterator[object]:
    with open_page(browser, f"{url}/playground") as page:
        yield page


def stat(page, name: str) -> str:
    return page.locator(f'#models [data-stat="{name}"]').first.inner_text()


def reply(page) -> str:
    return page.locator(".msg.assistant").last.inner_text()


def set_key(page, key: str) -> None:
    page.fill("#api_key", key)
    page.press("#api_key", "Tab")  # `change`: kept in sessionStorage, the stats stream reconnects


@pytest.mark.e2e  # a real browser
def test_the_page_streams_a_chat_and_shows_the_batch_running_it(page, url):
    assert page.title() == "lmiserve playground"
    page.locator("#connection", has_text="set the server's API key").wait_for()  # the stats need the key

    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    page.locator(".msg.error", has_text="401").wait_for()  # the chat too: the server's answer is shown
    page.locator("#send:enabled").wait_for()  # locators, not wait_for_function: the page's CSP forbids eval

    page.click("#clear")
    assert page.locator(".msg").count() == 0
    set_key(page, KEY)
    page.locator('#connection[data-state="live"]').wait_for()
    assert page.evaluate("sessionStorage.getItem('lmiserve.apiKey')") == KEY
    wait_until(lambda: stat(page, "running") == "0", "the panel shows the idle engine")
    assert stat(page, "status") == "ready" and stat(page, "batch") == "0 / 2 slots"

    page.fill("#system", "You are a test.")
    page.fill("#max_tokens", str(LONG))
    page.fill("#seed", "7")
    page.fill("#prompt", "Tell me a very long story.")
    page.click("#send")
    page.locator(".msg.assistant.streaming").wait_for()
    assert page.locator("#stop").is_enabled() and page.locator("#send").is_disabled()

    wait_until(lambda: len(reply(page)) > 0, "text streams into the page")
    seen = len(reply(page))
    wait_until(lambda: len(reply(page)) > seen, "more text arrives: it streams, token by token")
    wait_until(lambda: stat(page, "running") == "1", "the panel shows the running request")
    wait_until(lambda: float(stat(page, "tokens_per_second")) > 0, "the panel shows tokens/s")
    assert stat(page, "batch") == "1 / 2 slots" and stat(page, "waiting") == "0"
    kv_tokens = int(stat(page, "kv").split("·")[1].split("/")[0])
    assert kv_tokens > 0  # the running sequence holds KV cache positions
    assert page.locator(".msg.assistant.streaming").count() == 1  # still streaming while it was looked at
    # a long, fast stream: the page takes it in and still answers (a layout and a scroll a token froze it
    # within seconds: its stream loop never yielded; benchmarks/playground_stream.py). The timeout only
    # stops a hang: a loaded machine streams slower
    wait_until(lambda: len(reply(page)) > 8_000, "the page keeps up with a long stream", timeout=120)
    assert stat(page, "running") == "1"

    page.click("#stop")
    page.locator(".msg.assistant .note", has_text="(stopped)").wait_for()
    assert page.locator(".msg.assistant.streaming").count() == 0 and page.locator("#send").is_enabled()
    wait_until(lambda: stat(page, "running") == "0", "the panel shows the slot freed")
    assert page.locator("#usage").inner_text().endswith(")") or "tokens" in page.locator("#usage").inner_text()


@pytest.mark.e2e  # a real browser
def test_json_output_sends_response_format_and_shows_what_the_server_answers(page, client):
    """With structured output the reply is the model's; without it the server's error is shown."""
    body = {
        "messages": [{"role": "user", "content": "Give me JSON."}],
        "max_tokens": 8,
        "seed": 1,
        "response_format": {"type": "json_object"},
    }
    direct = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert direct.status_code < 500, direct.text

    set_key(page, KEY)
    page.check("#json")
    page.fill("#max_tokens", "8")
    page.fill("#seed", "1")
    requests: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and requests.append(r.post_data_json))
    page.fill("#prompt", "Give me JSON.")
    page.press("#prompt", "Enter")
    page.locator("#send:enabled").wait_for(timeout=120_000)
    page.locator(".streaming").wait_for(state="detached", timeout=120_000)
    (sent,) = requests
    assert sent["response_format"] == {"type": "json_object"} and sent["stream"] is True
    if direct.status_code == 200:
        assert page.locator(".msg.error").count() == 0
    else:
        error_body = direct.json()["error"]  # TGI's shape ("error": text) or OpenAI's ("error": {"message"})
        message = error_body if isinstance(error_body, str) else error_body["message"]
        error = page.locator(".msg.error").inner_text()
        assert error.startswith(str(direct.status_code)) and message in error


# --- an image, on a vision-language model --------------------------------------------------------------

VLM_MAX_IMAGE_BYTES = 64 * 1024  # the VLM server's max_image_bytes: the page's cap follows it


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vlm_url(tiny_vlm_dir) -> Iterator[str]:
    args = ["--model-id", str(tiny_vlm_dir("qwen2_vl")), "-o", f"max_image_bytes={VLM_MAX_IMAGE_BYTES}"]
    with run_server(args, timeout=300) as base:
        yield base


@pytest.fixture
def vlm_page(browser, vlm_url: str) -> Iterator[object]:
    with open_page(browser, f"{vlm_url}/playground") as page:
        yield page


@pytest.mark.e2e  # a real browser
def test_a_text_model_offers_no_image(page):
    set_key(page, KEY)
    page.locator('#connection[data-state="live"]').wait_for()
    wait_until(lambda: stat(page, "status") == "ready", "the panel shows the model")
    assert page.locator("#attach").is_hidden() and page.locator("#attachment").is_hidden()


@pytest.mark.e2e  # a real browser
def test_an_attached_image_is_shown_removable_and_sent_as_an_image_url_part(vlm_page):
    page = vlm_page
    page.locator("#attach").wait_for()  # shown once the stats say the model takes images
    image = png(tiny_image(7, (48, 40)))
    file = {"name": "shapes.png", "mimeType": "image/png", "buffer": image}

    page.set_input_files("#image", files=[file])
    page.locator("#attachment img").wait_for()
    assert "shapes.png" in page.locator("#attachment-name").inner_text()
    page.click("#detach")  # removable before sending
    assert page.locator("#attachment").is_hidden()

    page.set_input_files("#image", files=[file])
    page.locator("#attachment img").wait_for()
    requests: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and requests.append(r.post_data_json))
    page.fill("#max_tokens", "8")
    page.fill("#prompt", "What is in this picture?")
    page.press("#prompt", "Enter")
    page.locator(".msg.user img.thumb").wait_for()  # the transcript shows the image sent
    assert page.locator("#attachment").is_hidden()  # sent: the next message has no image
    page.locator(".streaming").wait_for(state="detached", timeout=120_000)
    page.locator("#send:enabled").wait_for()
    assert page.locator(".msg.error").count() == 0  # the server took the image and answered

    (sent,) = requests
    user = sent["messages"][-1]
    part, text = user["content"]
    assert user["role"] == "user" and text == {"type": "text", "text": "What is in this picture?"}
    assert part["type"] == "image_url"
    assert part["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(image).decode()
    thumb = page.locator(".msg.user img.thumb").get_attribute("src")
    assert thumb == part["image_url"]["url"]


@pytest.mark.e2e  # a real browser
def test_an_image_over_the_servers_limit_is_refused_in_the_page(vlm_page):
    page = vlm_page
    page.locator("#attach").wait_for()
    large = png(tiny_image(3, (400, 300)))  # noise: far over 64 KB
    assert len(large) > VLM_MAX_IMAGE_BYTES
    page.set_input_files("#image", files=[{"name": "big.png", "mimeType": "image/png", "buffer": large}])
    error = page.locator(".msg.error").inner_text()
    assert error.startswith("big.png is ") and "the server takes images up to 64 KB (max_image_bytes)" in error
    assert page.locator("#attachment").is_hidden()
    page.set_input_files("#image", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hello"}])
    page.locator(".msg.error", has_text="notes.txt is not a PNG, JPEG, WebP or GIF image.").wait_for()
    assert page.locator("#attachment").is_hidden()


DATA_TRANSFER = """(b64) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const transfer = new DataTransfer();
  transfer.items.add(new File([bytes], "clipboard.png", { type: "image/png" }));
  return transfer;
}"""


@pytest.mark.e2e  # a real browser
def test_an_image_can_be_pasted_or_dropped(vlm_page):
    page = vlm_page
    page.locator("#attach").wait_for()
    b64 = base64.b64encode(png(tiny_image(5, (48, 40)))).decode()
    page.dispatch_event("#composer", "drop", {"dataTransfer": page.evaluate_handle(DATA_TRANSFER, b64)})
    page.locator("#attachment img").wait_for()
    assert page.locator("#attachment-thumb").get_attribute("src") == f"data:image/png;base64,{b64}"
    page.click("#detach")

    page.evaluate(
        f"(b64) => document.getElementById('prompt').dispatchEvent(new ClipboardEvent('paste', "
        f"{{ clipboardData: ({DATA_TRANSFER})(b64), bubbles: true, cancelable: true }}))",
        b64,
    )
    page.locator("#attachment img").wait_for()
    assert page.locator("#attachment-thumb").get_attribute("src") == f"data:image/png;base64,{b64}"
    assert page.input_value("#prompt") == ""  # the image is attached, not pasted as text
