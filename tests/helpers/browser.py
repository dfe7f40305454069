"""A real headless Chromium for the playground's tests: Debian's `chromium` driven by playwright.

playwright's own browser builds are never downloaded (`playwright install` is never run): the
browser is the system's `chromium` (`make install-test` installs it with apt-get when missing). Where
playwright or chromium is missing, the tests that need a browser skip and say why.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"


def chromium_path() -> str | None:
    return CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")


@contextlib.contextmanager
def headless_chromium() -> Iterator[Any]:
    """A launched playwright `Browser` (skips the test when it cannot be had)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    executable = chromium_path()
    if executable is None:
        pytest.skip("Debian's chromium is not installed: `make install-test` installs it (apt-get install chromium)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def open_page(browser: Any, url: str, *, width: int = 1180, height: int = 720) -> Iterator[Any]:
    """A new page at `url`. At the end, fails if the page's script threw or if the page requested
    anything outside `url`'s origin (data: URLs aside)."""
    origin = "/".join(url.split("/")[:3]) + "/"
    context = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(30_000)
    requested: list[str] = []
    errors: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    try:
        yield page
    finally:
        context.close()
    assert errors == [], "the page's script failed"
    assert all(u.startswith(origin) or u.startswith("data:") for u in requested), requested
