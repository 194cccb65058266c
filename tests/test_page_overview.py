"""The live page's overview at many sessions (#46), in Debian's headless Chromium via Playwright: one
row per session with a sparkline of its closes and each standing question's answer, sorted by any
column, filtered by a question's answer; past 24 sessions the cards stay hidden until a row is clicked.
The page and a scripted websocket are served from Playwright's routes (no server or model)."""

from __future__ import annotations

import json
import time
from urllib.parse import unquote, urlparse

import pytest

from tests.test_page_browser import CHROMIUM, ROOT, chromium_page

pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary: apt-get install -y chromium")

SESSIONS = [f"s{i:02d}" for i in range(30)]


def answer(session: str, question: str, text: str) -> dict:
    return {"session": session, "question_id": question, "text": text, "path": "fast", "confidence": 1.0,
            "data_version": 5, "updated_at": time.time(), "warming_up": False}


def trend(i: int) -> str:
    return "up" if i % 3 == 0 else "down"


def test_overview_sorts_filters_and_opens_cards_at_many_sessions():
    static = ROOT / "streamllm" / "service" / "static"

    def serve_file(route):
        path = urlparse(route.request.url).path
        if path.endswith("/bars"):
            i = SESSIONS.index(unquote(path.split("/")[-2]))
            step = 1 + (0.001 if i % 2 else -0.001) * (i + 1)  # odd sessions rise, the later the steeper
            closes = [100.0 * step**k for k in range(20)]
            route.fulfill(json={"session": SESSIONS[i], "data_version": 5, "bars_seen": 20,
                                "t": [1_700_000_000 + 60 * k for k in range(20)], "close": closes})
        else:
            route.fulfill(path=str(static / "index.html" if path == "/" else static / path.removeprefix("/static/")))

    def reply(ws, text):
        msg = json.loads(text)
        if msg["type"] == "hello":
            out = {"type": "welcome", "auth": False, "model": "tiny", "tenant": "local", "read_only": False}
        elif msg["type"] == "stats":
            out = {"type": "stats", "tenant": "local", "sessions": [{"name": n} for n in SESSIONS]}
        else:
            i = SESSIONS.index(msg["session"])
            out = {"type": "ok", "data_version": 5,
                   "standing": [answer(msg["session"], "trend", trend(i)), answer(msg["session"], "calm", "calm")]}
        ws.send(json.dumps({**out, "id": msg["id"]}))

    with chromium_page() as (_, page):
        page.route("http://streamllm.test/**", serve_file)
        page.route_web_socket("ws://streamllm.test/", lambda ws: ws.on_message(lambda text: reply(ws, text)))
        page.goto("http://streamllm.test/")
        page.wait_for_function("document.querySelectorAll('#overview svg.spark').length === 30", timeout=20_000)
        assert page.locator("#overview").is_visible()
        assert page.locator("section.card:visible").count() == 0  # 30 > 24: cards wait for a click
        assert page.locator('tr[data-session="s01"] svg.spark').get_attribute("class") == "spark up"
        assert page.locator('tr[data-session="s02"] svg.spark').get_attribute("class") == "spark down"
        assert page.locator('tr[data-session="s05"] td.answer[data-question="trend"]').inner_text() == "down"

        def order() -> list[str]:
            return page.eval_on_selector_all("#overview-table tbody tr:not([hidden])",
                                             "rs => rs.map(r => r.dataset.session)")

        assert order() == SESSIONS
        page.click('th[data-sort="session"]')  # again: descending
        page.wait_for_function("document.querySelector('#overview-table tbody tr').dataset.session === 's29'")
        assert order() == SESSIONS[::-1]
        page.click('th[data-sort="change"]')
        page.wait_for_function("document.querySelector('#overview-table tbody tr').dataset.session === 's28'")
        first = order()
        assert first[-1] == "s29"  # the steepest fall (s28) first, the steepest rise last
        page.click('th[data-sort="q:trend"]')
        page.wait_for_timeout(100)
        ups = [n for i, n in enumerate(SESSIONS) if trend(i) == "up"]
        assert order()[-len(ups):] == ups  # "down" < "up", ties by name

        page.select_option("#filter-question", "trend")
        page.fill("#filter-answer", "up")
        page.wait_for_function(f"document.querySelector('#overview-count').textContent === '{len(ups)} of 30 sessions'")
        assert sorted(order()) == ups
        page.fill("#filter-answer", "calm")  # trend's answers: none says calm
        page.wait_for_function("document.querySelector('#overview-count').textContent === '0 of 30 sessions'")
        page.select_option("#filter-question", "")  # any question: every session's calm says calm
        page.wait_for_function("document.querySelector('#overview-count').textContent === '30 of 30 sessions'")

        page.click('tr[data-session="s07"] td.session')
        card = page.locator('section.card[data-session="s07"]')
        card.wait_for(state="visible", timeout=5_000)
        page.wait_for_selector('section.card[data-session="s07"] .chart canvas', timeout=10_000)  # its chart drawn
        assert page.locator("section.card:visible").count() == 1
