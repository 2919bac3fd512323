"""Data Docs as a person sees them: headless Chromium (Debian) through Playwright, no internet.

The site is served from a loopback HTTP server on a free port; every request the pages make must
stay on it (the vendored assets), the index table must list the validation (filled by JS), and
Bootstrap's styles must be applied. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pandas as pd
import pytest
from millpond.config import PROJECT_ROOT, Settings
from millpond.quality import suites as qs
from millpond.quality.datadocs import build_data_docs
from millpond.quality.validation import validate_batch

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = PROJECT_ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        pytest.fail("chromium missing: run `make browser` (apt-get install -y chromium)")
    from playwright import sync_api
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def site(settings: Settings, pipeline_name: str) -> Iterator[tuple[str, Path, str]]:
    raw = pd.DataFrame({"id": ["e1", "e2", "e2"], "key": ["alice", None, "bob"], "value": [1, 2, 3],
                        "event_time": ["2026-01-01T12:00:00Z"] * 3})
    report = validate_batch(settings, pipeline_name, 1, raw=raw, panes=None, state=None)
    assert not report.ok
    index = build_data_docs(settings)
    handler = functools.partial(_QuietHandler, directory=str(index.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        page = Path(report.result_urls[0]).relative_to(index.parent).as_posix()
        yield f"http://127.0.0.1:{server.server_address[1]}", index.parent, page
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass


def _open(browser, url: str, wait_for: str):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    outside: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: outside.append(r.url) if urlparse(r.url).hostname != "127.0.0.1" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url, wait_until="load")
    page.wait_for_selector(wait_for, timeout=15_000)
    return page, outside, errors


def test_index_lists_validation_and_is_styled(browser, site, pipeline_name: str) -> None:
    base, _, _ = site
    page, outside, errors = _open(browser, f"{base}/index.html", f"text={pipeline_name}-1")
    try:
        table = page.locator("table.ge-index-page-validation-results-table")
        assert table.locator("tbody tr").count() >= 1
        assert f"{pipeline_name}-1" in table.inner_text()
        assert qs.RAW in page.content()
        # Bootstrap applied: utility class pl-5 is 3rem, the navbar is a flex box, body margin reset.
        assert page.eval_on_selector(".container-fluid", "e => getComputedStyle(e).paddingLeft") == "48px"
        assert page.eval_on_selector("nav.navbar", "e => getComputedStyle(e).display") == "flex"
        assert page.evaluate("getComputedStyle(document.body).marginTop") == "0px"
        # bootstrap-table's JS ran (it wraps the table).
        assert page.locator(".bootstrap-table").count() >= 1
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "datadocs-index.png"), full_page=True)
        assert outside == [], outside
        assert errors == [], errors
    finally:
        page.close()


def test_validation_page_renders_offline(browser, site, pipeline_name: str) -> None:
    base, _, rel = site
    page, outside, errors = _open(browser, f"{base}/{rel}", "text=Expectation Validation Result")
    try:
        text = page.inner_text("body")
        assert qs.RAW in text and f"{pipeline_name}-1" in text
        assert "must never be null" in text and "key" in text
        assert page.eval_on_selector("nav.navbar", "e => getComputedStyle(e).display") == "flex"
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "datadocs-validation.png"), full_page=False)
        assert outside == [], outside
        assert errors == [], errors
    finally:
        page.close()
