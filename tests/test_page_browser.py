"""The live page in a real browser: `streamllm serve` on the tiny model with the synthetic
feed, Debian's headless Chromium driven by Playwright. The page must show each session's
price chart and standing answers, follow them live, and answer through its ask box, opened
the way `serve` says: the URL it prints, with its generated local token (`?token=`), which
the page keeps for the tab and takes out of the address bar. Without the token it asks for one.
What a user sees (#47): an answer made before its question can be answered says "warming up" (with
why), a `push = false` free-text question says "ask to decode" rather than its first token, each row
says which threshold is in force and whose it is, and a session whose lines carry no date is drawn
by bar number, not on 1970-01-01.

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


def plain_session(base: str, token: str) -> None:
    """A session opened and fed by a client with bar lines that carry a time of day but no date."""
    from streamllm.client.client import Client

    with Client("ws" + base[4:], token=token) as client:
        client.open("plain")
        client.register("plain", {"id": "slow", "text": "Up or down?", "choices": ["up", "down"], "threshold": 0.0,
                                  "label": "trend_up(n=50)"})
        client.register("plain", {"id": "note", "text": "What happened?", "push": False, "max_tokens": 4})
        ack = client.push("plain", [f"12:00:{i:02d} 6400{i}.5 +1.5 v{i}.2" for i in range(5)])
        client.ask("plain", "slow", min_version=ack["data_version"])  # ingested, its entry ready


def test_page_shows_live_standing_answers_and_answers_the_ask_box(served, tmp_path):
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
            base, printed = served
            token = printed.split("?token=", 1)[1]
            plain_session(base, token)
            page.goto(printed)
            page.wait_for_selector("#status.live", timeout=30_000)
            assert page.url == base + "/"  # the token left the address bar...
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
            assert row.locator("td.threshold").inner_text() == "0.00 config"  # the threshold in force, and whose
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
            assert card.get_attribute("data-axis") == "time"
            # a session pushed lines without dates: drawn by bar number; its labelled question's history is
            # not in (a guess, said so); its push = false free-text question has no pushed answer to show
            plain = page.locator('section.card[data-session="plain"]')
            page.wait_for_function("""() => document.querySelector('section.card[data-session="plain"]')
                                       ?.dataset.axis === "bar" """, timeout=30_000)
            assert plain.get_attribute("data-bars") == "5"
            slow = plain.locator('tr[data-question="slow"]')
            slow.wait_for(timeout=30_000)
            assert slow.locator("td.answer").inner_text() == "warming up"
            assert "trend_up(n=50) looks back 50 bars; the session has 5 so far" in slow.locator("td.answer").get_attribute("title")
            assert slow.locator("td.confidence").inner_text() == "-"
            note = plain.locator('tr[data-question="note"]')
            note.wait_for(timeout=30_000)
            assert (note.locator("td.answer").inner_text(), note.locator("td.path").inner_text()) == ("ask to decode", "not pushed")
            assert plain.locator("td.dv.behind").count() == 0  # every answer is at the session's data_version
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
