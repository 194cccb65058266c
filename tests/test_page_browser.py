"""The live page in a real browser: `streamllm serve` on the tiny model with the synthetic
feed, Debian's headless Chromium driven by Playwright. The page must show each session's
price chart and standing answers, follow them live, and answer through its ask box, opened
the way `serve` says: the URL it prints, with its generated local token (`?token=`), which
the page keeps for the tab and takes out of the address bar. Without the token it asks for one.
What a user sees (#47): an answer made before its question can be answered says "warming up" (with
why), a `push = false` free-text question says "ask to decode" rather than its first token, each row
says which threshold is in force and whose it is, and a session whose lines carry no date is drawn
by bar number, not on 1970-01-01. Each labelled question's learning curve (#45) is plotted from its
calibration's history, shaded where the gate was open, with what live learning has fitted; that test
serves the page and a scripted websocket from Playwright's routes, no server or model.

Skips (saying why) when Playwright or a Chromium binary is missing; CI installs both
(.ci/run installs Debian's `chromium`; Playwright comes with the dev extra).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

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


@contextlib.contextmanager
def chromium_page():
    """Headless Chromium and a 1280x800 page; a script or console error there fails the test at the end."""
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
            yield browser, page
        finally:
            browser.close()
    assert not errors, errors


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
    with chromium_page() as (browser, page):
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


def _standing(question_id: str, calibration: dict | None, version: int = 40) -> dict:
    return {"session": "btc", "question_id": question_id, "text": "up", "path": "fast", "confidence": 1.2,
            "data_version": version, "updated_at": time.time(), "warming_up": False, "threshold": 0.5,
            "threshold_source": "auto", **({"calibration": calibration} if calibration is not None else {})}


def _curve(points: int, open_from: int, learning: dict | None = None) -> dict:
    """A calibration object whose history has `points` points, the gate open from point `open_from` on."""
    history = [[10 * (i + 1), 0.5 + 0.04 * i, 0.55 if i else None, i >= open_from] for i in range(points)]
    return {"samples": 10 * points, "scored": 10 * points, "precision": 0.7, "coverage": 0.4, "accuracy": 0.6,
            "threshold": 0.5, "target": 0.7, "confidence": 0.5, "base_rate": 0.55, "history": history,
            **({"learning": learning} if learning else {})}


def test_page_plots_each_labelled_questions_learning_curve():
    static = ROOT / "streamllm" / "service" / "static"
    snapshot = [_standing("learns", _curve(4, 2, {"fits": 2, "samples": 36, "trained_upto": 30, "fit_s": 0.01})),
                _standing("fixed", _curve(2, 9)),  # labelled, learns nothing: a curve, no caption
                _standing("early", {**_curve(0, 0), "samples": 5}),  # under 10 scored: no point yet, no plot
                _standing("calm", None)]  # unlabelled
    replies = {"hello": {"type": "welcome", "auth": False, "model": "tiny", "tenant": "local", "read_only": False},
               "stats": {"type": "stats", "tenant": "local", "sessions": [{"name": "btc"}]},
               "subscribe": {"type": "ok", "data_version": 40, "standing": snapshot}}
    sockets = []

    def serve_file(route):
        path = urlparse(route.request.url).path
        if path.endswith("/bars"):
            route.fulfill(json={"session": "btc", "data_version": 40, "bars_seen": 0, "t": [], "close": []})
        else:
            route.fulfill(path=str(static / "index.html" if path == "/" else static / path.removeprefix("/static/")))

    def serve_socket(ws):
        sockets.append(ws)
        ws.on_message(lambda text: ws.send(json.dumps({**replies[json.loads(text)["type"]],
                                                        "id": json.loads(text)["id"]})))

    curve = 'section.card[data-session="btc"] figure.curve[data-question="{}"]'.format
    with chromium_page() as (_, page):
        page.route("http://streamllm.test/**", serve_file)
        page.route_web_socket("ws://streamllm.test/", serve_socket)
        page.goto("http://streamllm.test/")
        page.wait_for_selector('tr[data-question="calm"]', timeout=10_000)
        learns = page.locator(curve("learns"))
        assert (learns.get_attribute("data-points"), learns.get_attribute("data-open")) == ("4", "2")
        assert learns.locator("canvas").count() >= 1  # drawn by uPlot
        assert learns.locator(".learned").inner_text() == "learning: 2 heads fitted on 36 samples"
        fixed = page.locator(curve("fixed"))
        assert (fixed.get_attribute("data-points"), fixed.get_attribute("data-open")) == ("2", "0")
        assert fixed.locator(".learned").inner_text() == ""
        assert page.locator(curve("early")).count() == page.locator(curve("calm")).count() == 0
        # new calibration objects move the curve on; one whose history is gone takes its plot away
        sockets[0].send(json.dumps({"type": "standing", **_standing(
            "learns", _curve(5, 2, {"fits": 3, "samples": 46, "trained_upto": 40, "fit_s": 0.01, "compared": 12,
                                    "answer_accuracy": 0.75, "control_accuracy": 0.9167}), 50)}))
        sockets[0].send(json.dumps({"type": "standing", **_standing("fixed", _curve(0, 0), 50)}))
        page.wait_for_selector(curve("learns") + '[data-points="5"]', timeout=5_000)
        assert learns.get_attribute("data-open") == "3"
        assert learns.locator(".learned").inner_text() == ("learning: 3 heads fitted on 46 samples; right 75% vs "
                                                           "raw-number control 92% (last 12)")
        page.wait_for_selector(curve("fixed"), state="detached", timeout=5_000)
