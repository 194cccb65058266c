"""The live page in a real browser: `streamllm serve` on the tiny model with the synthetic
feed, Debian's headless Chromium driven by Playwright. The page must show each session's
price chart and standing answers, follow them live, and answer through its ask box, opened
the way `serve` says: the URL it prints, with its generated local token (`?token=`), which
the page keeps for the tab and takes out of the address bar. Without the token it asks for one.

Skips (saying why) when Playwright or a Chromium binary is missing; CI installs both
(.ci/run installs Debian's `chromium`; Playwright comes with the dev extra).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = next((p for p in (os.environ.get("STREAMLLM_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary: apt-get install -y chromium "
                                                         "(or set STREAMLLM_CHROMIUM=/path/to/chrome)")

CONFIG = """
[[sessions]]
name = "btc"
instrument = "BTCUSDT"
feed = "synthetic"
[sessions.render]
bar_seconds = 1
[[sessions.questions]]
id = "trend"
text = "Up or down?"
choices = ["up", "down"]
threshold = 0.0
label = "trend_up(n=3)"
[[sessions.questions]]
id = "calm"
text = "Calm or wild?"
choices = ["calm", "wild"]
threshold = 0.0
"""


@pytest.fixture
def served(tmp_path):
    """(the server's http URL, the page URL serve printed: with its local token)"""
    config = tmp_path / "page.toml"
    config.write_text(CONFIG)
    env = {**os.environ, "STREAMLLM_TOKENS": "", "PYTHONPATH": str(ROOT), "STREAMLLM_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "streamllm.cli", "serve", "--config", str(config), "--model",
                             "tiny", "--port", "0", "--speed", "5", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert proc.stdout is not None
        head = proc.stdout.readline()
        assert head.startswith("streamllm serving tiny"), head + (proc.stderr.read() if proc.poll() else "")
        page = next(line for line in proc.stdout if line.startswith("  page ")).split()[1]
        assert "?token=" in page, page
        yield "http" + head.rsplit(" at ", 1)[1].strip()[2:], page
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_page_shows_live_standing_answers_and_answers_the_ask_box(served, tmp_path):
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
            base, printed = served
            page.goto(printed)
            page.wait_for_selector("#status.live", timeout=30_000)
            assert page.url == base + "/"  # the token left the address bar...
            token = printed.split("?token=", 1)[1]
            assert page.evaluate("sessionStorage.getItem('streamllm_token')") == token  # ...for this tab's storage
            assert "tenant local" in page.inner_text("#model")
            card = page.locator('section.card[data-session="btc"]')
            row = card.locator('tr[data-question="trend"]')
            row.wait_for(timeout=30_000)
            first = int(row.get_attribute("data-version"))
            # a standing answer changes: the feed moves on and the row follows (a newer data_version)
            page.wait_for_function(
                f"""() => Number(document.querySelector('section.card[data-session="btc"] '
                     + 'tr[data-question="trend"]').dataset.version) > {first}""", timeout=60_000)
            assert row.locator("td.answer").inner_text() in ("up", "down")
            assert row.locator("td.path").inner_text() in ("fast", "entry")
            assert card.locator('tr[data-question="calm"] td.answer').inner_text() in ("calm", "wild")
            # a labelled question shows its answers scored live; an unlabelled one has nothing to show
            page.wait_for_function("""() => /^\\d+% of \\d+, base \\d+%$/.test(document.querySelector('section.card[data-session="btc"] '
                                       + 'tr[data-question="trend"] td.right').textContent)""", timeout=60_000)
            assert re.fullmatch(r"\d+% at (\d+%|-)", row.locator("td.gate").inner_text())
            assert "fixed threshold" in row.locator("td.gate").get_attribute("title")
            assert card.locator('tr[data-question="calm"] td.right').inner_text() == "-"
            # the chart is drawn from the bars the session ingested
            page.wait_for_function("""() => Number(document.querySelector('section.card[data-session="btc"]')
                                       .dataset.bars || 0) > 3""", timeout=30_000)
            assert card.locator("canvas").count() >= 1
            # ask through the box: streamed, then the final answer with its path
            page.fill("#ask-question", "trend")
            page.click("#ask-button")
            page.wait_for_selector('#ask-output[data-state="answered"]', timeout=30_000)
            assert page.inner_text("#ask-output .text") in ("up", "down")
            assert "fast path" in page.inner_text("#ask-output .meta")
            page.fill("#ask-question", "What happened in the last bar?")
            page.click("#ask-button")
            page.wait_for_selector('#ask-output[data-state="answered"]:has(.meta:text("cold path"))',
                                   timeout=60_000)
            time.sleep(0.3)  # let the chart settle for the picture
            shot = tmp_path / "page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            page.reload()  # the tab keeps its token: a reload needs no ?token=
            page.wait_for_selector("#status.live", timeout=30_000)
            stranger = browser.new_page()  # another tab (its own sessionStorage), no token: asked for one
            stranger.goto(base + "/")
            stranger.wait_for_selector("#token-form:not([hidden])", timeout=30_000)
            assert "needs a token" in stranger.inner_text("#status")
        finally:
            browser.close()
    assert not errors, errors
