"""serve --ray end to end: two engine replicas (Ray actors, tiny model) behind one real StreamServer.

One local Ray cluster (2 CPUs) and one ClusterEngine for the module; the tests run in file
order on it: placement and routing, fan-in of subscriptions, moving a session, and last
killing a replica in the middle of pushes. Clients speak the websocket protocol (raw JSON).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'streamllm[ray]' (make test installs it)")

from websockets.asyncio.client import connect  # noqa: E402

from streamllm.cli import sessions as sessions_cli  # noqa: E402
from streamllm.config import load_config  # noqa: E402
from streamllm.engine import EngineConfig, SchedulerConfig  # noqa: E402
from streamllm.feeding.wiring import group_feeds, open_sessions  # noqa: E402
from streamllm.scale.cluster import ClusterEngine  # noqa: E402
from streamllm.scale.replica import FeedPlan  # noqa: E402
from streamllm.service.server import ServerConfig, StreamServer  # noqa: E402
from streamllm.service.tenants import LOCAL  # noqa: E402

CONFIG = EngineConfig(max_cells=65536, block_size=8, max_context=8192, scheduler=SchedulerConfig(chunk_tokens=64))
QUESTION = {"id": "up", "text": "Is the price going up?", "choices": ["yes", "no"]}
TIMEOUT = 60


def lines(batch: int, n: int = 2) -> list[str]:
    return [f"12:{batch // 60:02d}:{batch % 60:02d} 640{i}{batch % 10}.5 +1.{i} v{batch}" for i in range(n)]


FED_CONFIG = """
[[sessions]]
name = "fed"
instrument = "BTCUSDT"
feed = "synthetic"
max_context_tokens = 2048
[sessions.render]
mode = "bars"
bar_seconds = 1
"""


@pytest.fixture(scope="module")
def fed_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "fed.toml"
    path.write_text(FED_CONFIG)
    return load_config(path)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, fed_config):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    feeds = FeedPlan(group_feeds(fed_config, None), LOCAL, speed=20.0, seed=1)  # runs in the replicas
    engine = ClusterEngine("tiny", CONFIG, dtype="float32", replicas=2, log_dir=tmp_path_factory.mktemp("cluster"),
                           call_timeout_s=20, poll_s=0.5, feeds=feeds)
    yield engine
    engine.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def server(cluster, serve_in_thread):
    with serve_in_thread(StreamServer(cluster, None, ServerConfig(port=0), replicas=cluster)) as srv:
        yield srv


class Wire:
    """A raw JSON websocket peer: replies by id, events kept aside."""

    def __init__(self, ws) -> None:
        self.ws, self.events, self.next_id = ws, [], 0

    @classmethod
    async def open(cls, url: str) -> Wire:
        wire = cls(await connect(url))
        await wire.ok("hello")
        return wire

    async def req(self, type: str, **fields) -> dict:
        self.next_id += 1
        await self.ws.send(json.dumps({"type": type, "id": self.next_id, **fields}))
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("id") == self.next_id:
                return message
            self.events.append(message)

    async def ok(self, type: str, **fields) -> dict:
        reply = await self.req(type, **fields)
        assert reply["type"] != "error", reply
        return reply

    async def drain(self, seconds: float, until=None) -> None:
        """Collect events for `seconds`, or until `until(event)` is true of one."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                self.events.append(json.loads(await asyncio.wait_for(self.ws.recv(), left)))
            except TimeoutError:
                return
            if until is not None and until(self.events[-1]):
                return


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), TIMEOUT * 2))


def replica_of(cluster: ClusterEngine, session: str) -> int:
    index = cluster.placement.get(LOCAL.engine_name(session))
    assert index is not None, session
    return index


def test_placement_by_free_cells_and_questions_run_only_on_their_replica(cluster, server):
    async def scenario():
        w = await Wire.open(server.url)
        # One big session, then three small ones: the most free cells wins, so the small ones all go to
        # the other replica (a round robin would put one of them beside the big one). A session holds its
        # working set (prefix + working_set_tokens, at most its max_context): the small ones hold 512.
        for name, max_context in (("big", 8192), ("s1", 512), ("s2", 512), ("s3", 512)):
            free = {h.index: cluster.call_replica(h, "free_cells") for h in cluster.replicas}
            await w.ok("open", session=name, max_context=max_context)
            best = max(free.values())
            assert free[replica_of(cluster, name)] == best, (name, free)
        assert replica_of(cluster, "s1") == replica_of(cluster, "s2") == replica_of(cluster, "s3") \
            != replica_of(cluster, "big")
        assert sorted(cluster.placement.counts()) == [1, 3]
        for name in ("big", "s1", "s2", "s3"):
            await w.ok("register", session=name, question=QUESTION)
            for batch in range(3):
                pushed = await w.ok("push", session=name, lines=lines(batch), truths={"up": "yes"})
                assert pushed["data_version"] == batch + 1
        for name in ("big", "s1", "s2", "s3"):
            answer = await w.ok("ask", session=name, question="up", min_version=3)
            assert answer["type"] == "answer" and answer["text"] in ("yes", "no") and answer["data_version"] == 3
            cold = await w.ok("ask", session=name, question="What happened last?", max_tokens=2, min_version=3)
            assert cold["path"] == "cold" and cold["session"] == name
        stats = await w.ok("stats")
        assert {s["name"] for s in stats["sessions"]} == {"big", "s1", "s2", "s3"}
        # truths sent through the front door reach the replica: its answers are scored (live calibration)
        assert all(s["calibration"]["up"]["scored"] >= 1 for s in stats["sessions"]), stats["sessions"]
        assert stats["engine"]["replicas_up"] == 2
        await w.ws.close()

    run(scenario)
    # The OpenAI-compatible face routes the same way: a standing question by id, and a stateless
    # request (a temporary session placed on a replica, closed after the answer).
    for body in ({"session": "s3", "question_id": "up"}, {"messages": [{"role": "user", "content": "Hi?"}]}):
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "up"}], **body}
        req = urllib.request.Request(server.http_url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=TIMEOUT).read())
        assert reply["choices"][0]["message"]["content"], reply
    assert sorted(cluster.placement.names()) == [LOCAL.engine_name(n) for n in ("big", "s1", "s2", "s3")]
    executed = cluster.asks_executed()
    for name in ("big", "s1", "s2", "s3"):
        home = replica_of(cluster, name)
        assert executed[home].get(LOCAL.engine_name(name), 0) >= 1, executed
        assert LOCAL.engine_name(name) not in executed[1 - home], executed  # never ran on the other replica


def test_streamed_answers_arrive_token_by_token_through_the_front_door(cluster, server):
    async def scenario():
        w = await Wire.open(server.url)
        whole = await w.ok("ask", session="s3", question="Describe it.", max_tokens=6, min_version=3)
        tokens = [await w.ok("ask", session="s3", question="Describe it.", max_tokens=6, min_version=3, stream=True)]
        while tokens[-1]["type"] == "token":  # token messages carry the ask's id, then the answer does
            tokens.append(json.loads(await w.ws.recv()))
        await w.ws.close()
        return whole, tokens.pop(), tokens

    whole, streamed, tokens = asyncio.run(scenario())
    assert streamed["text"] == whole["text"] and streamed["path"] == "cold"
    assert "".join(t["text"] for t in tokens) == whole["text"]
    assert len(tokens) >= 2  # piece by piece, across Ray, not one blob at the end


def test_subscriptions_fan_in_one_ordered_stream_per_session(cluster, server):
    names = ("big", "s1")  # one on each replica
    assert replica_of(cluster, names[0]) != replica_of(cluster, names[1])

    async def scenario():
        w = await Wire.open(server.url)
        start = {}
        for name in names:
            start[name] = (await w.ok("subscribe", session=name))["data_version"]
        for batch in range(3, 8):
            for name in names:
                await w.ok("push", session=name, lines=lines(batch))
        await asyncio.to_thread(cluster.wait_idle, 30)
        await w.drain(1.5)
        await w.ws.close()
        return w.events, start

    events, start = asyncio.run(scenario())
    for name in names:
        got = [e["data_version"] for e in events if e["type"] == "data" and e["session"] == name]
        assert got == sorted(set(got)) and got[-1] == start[name] + 5, (name, got)
        # Every data event the replica published after the subscription reached the client, in order.
        h = cluster.replicas[replica_of(cluster, name)]
        published = [args[1] for kind, args in cluster.call_replica(h, "journal_of", LOCAL.engine_name(name))
                     if kind == "data" and args[1] > start[name]]
        assert got == published


def test_move_session_keeps_its_logits(cluster, server):
    name = LOCAL.engine_name("s2")
    src = cluster.placement.get(name)
    probe = "Summarize the last line."
    cluster.wait_idle(30)
    before = cluster.ask(name, probe, max_tokens=1, return_logits=True)
    standing_before = {a.question_id: a for a in cluster.standing(name)}
    info_before = cluster.session_info(name)
    # The operator's command, against the running front door's admin route.
    assert sessions_cli.main(["move", "s2", "--to", str(1 - src), "--url", server.url]) == 0
    assert cluster.placement.get(name) == 1 - src
    assert name not in {i.name for i in cluster.call_replica(cluster.replicas[src], "list_sessions")}
    cluster.wait_idle(30)
    after = cluster.ask(name, probe, max_tokens=1, return_logits=True)
    info_after = cluster.session_info(name)
    assert (info_after.data_version, info_after.num_tokens) == (info_before.data_version, info_before.num_tokens)
    assert float((before.logits - after.logits).abs().max()) <= 1e-4
    assert after.text == before.text
    for qid, answer in standing_before.items():
        moved = {a.question_id: a for a in cluster.standing(name)}[qid]
        assert moved.text == answer.text
        for choice, prob in answer.choices.items():
            assert abs(moved.choices[choice] - prob) <= 1e-4
    executed = cluster.asks_executed()
    assert executed[1 - src].get(name) == 1  # the question after the move ran on the target
    with urllib.request.urlopen(server.http_url + "/v1/admin/replicas") as resp:
        assert [r["sessions"] for r in json.loads(resp.read())["data"]] == cluster.placement.counts()
    assert sessions_cli.main(["move", "nope", "--to", "0", "--url", server.url]) == 1  # unknown: an error


def wait_for(predicate, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out waiting")


def test_feeds_run_beside_their_sessions_and_follow_a_move(cluster, server, fed_config):
    name = LOCAL.engine_name("fed")
    open_sessions(cluster, LOCAL, fed_config)  # what `serve --ray --config` does, then start_feeds
    pushed_at_front_door = server.metrics.lines_pushed._value.get()
    assert cluster.start_feeds() == ["synthetic"]
    home = replica_of(cluster, "fed")
    wait_for(lambda: cluster.session_info(name).data_version >= 3)
    feeds = cluster.feed_health()
    assert [(f["replica"], f["sessions"]) for f in feeds] == [(home, [name])] and feeds[0]["events"] > 0
    assert server.metrics.lines_pushed._value.get() == pushed_at_front_door  # no market data through the door
    assert cluster.move_session(name, 1 - home)["to"] == 1 - home
    moved_at = cluster.session_info(name).data_version
    wait_for(lambda: cluster.session_info(name).data_version >= moved_at + 3)  # the feed followed it
    assert [(f["replica"], f["sessions"]) for f in cluster.feed_health()] == [(1 - home, [name])]


def test_killed_replica_recovers_every_acked_batch_and_the_other_never_notices(cluster, server):
    victim_session, other_session = "s1", "big"
    victim = cluster.replicas[replica_of(cluster, victim_session)]
    assert replica_of(cluster, other_session) != victim.index
    killed = threading.Event()

    async def pusher(session: str, stop: asyncio.Event, kill_after: int | None):
        w = await Wire.open(server.url)
        acks, errors, slowest, batch = [], [], 0.0, 100
        while not stop.is_set():
            t0 = time.perf_counter()
            reply = await w.req("push", session=session, lines=lines(batch))
            slowest = max(slowest, time.perf_counter() - t0)
            batch += 1
            if reply["type"] == "error":
                errors.append(reply["code"])
                await asyncio.sleep(0.05)
            else:
                acks.append(reply["data_version"])
            if kill_after is not None and len(acks) == kill_after and not killed.is_set():
                killed.set()
                ray.kill(victim.actor, no_restart=False)
            if kill_after is not None and errors and len(acks) >= kill_after + 10:
                stop.set()  # came back and took 10 more batches
            await asyncio.sleep(0.01)
        await w.ws.close()
        return acks, errors, slowest

    async def scenario():
        watcher = await Wire.open(server.url)
        start = (await watcher.ok("subscribe", session=other_session))["data_version"]
        await watcher.ok("subscribe", session=victim_session)
        stop = asyncio.Event()
        results = await asyncio.gather(pusher(victim_session, stop, 10), pusher(other_session, stop, None))
        last = {other_session: results[1][0][-1], victim_session: results[0][0][-1]}
        seen: set[str] = set()

        def both_at_last(e: dict) -> bool:
            if e.get("type") == "data" and e.get("data_version") == last.get(e.get("session")):
                seen.add(e["session"])
            return len(seen) == 2

        await watcher.drain(30, both_at_last)
        await watcher.ws.close()
        return results, watcher.events, start

    (victim_run, other_run), events, start = asyncio.run(scenario())
    acks, errors, slowest = victim_run
    assert killed.is_set() and errors, "the kill was never seen"
    assert set(errors) == {"unavailable"}, errors
    assert slowest < 15, f"a push waited {slowest:.1f} s: callers must fail fast, not hang"
    assert acks == sorted(set(acks))
    info = cluster.session_info(LOCAL.engine_name(victim_session))
    assert info.data_version == acks[-1]  # every acked batch is back, and pushes went on after it
    # The other replica's session: no error, and every event it published reached its subscriber.
    other_acks, other_errors, _ = other_run
    assert other_errors == [] and other_acks
    got = [e["data_version"] for e in events if e["type"] == "data" and e["session"] == other_session]
    h = cluster.replicas[replica_of(cluster, other_session)]
    published = [args[1] for kind, args in cluster.call_replica(h, "journal_of", LOCAL.engine_name(other_session))
                 if kind == "data" and args[1] > start]
    assert got[-1] == other_acks[-1], (len(got), len(published), got[-5:], published[-5:])
    assert got == published
    # The front door saw it go and come back: /health and /metrics say so per replica.
    health = json.loads(urllib.request.urlopen(server.http_url + "/health").read())
    entry = health["replicas"][victim.index]
    assert entry["state"] == "up" and entry["restarts"] == 1 and entry["last_recovery_s"] > 0
    assert health["replicas"][1 - victim.index]["restarts"] == 0
    metrics = urllib.request.urlopen(server.http_url + "/metrics").read().decode()
    assert f'streamllm_replica_restarts{{replica="{victim.index}"}} 1.0' in metrics
    assert f'streamllm_replica_up{{replica="{victim.index}"}} 1.0' in metrics
    # Its subscriber was carried across the restart: events resumed up to the last acked batch.
    victim_events = [e["data_version"] for e in events if e["type"] == "data" and e["session"] == victim_session]
    assert victim_events[-1] == acks[-1] and victim_events == sorted(victim_events)
    # Its other sessions came back too, standing questions and all.
    for name in ("s3",):
        assert [q.id for q in cluster.standing_questions(LOCAL.engine_name(name))] == ["up"]


def test_a_restarted_front_door_finds_its_sessions_where_the_placement_table_says(cluster, server):
    """The front door goes away (its replicas die with it); a new one on the same log directory
    recovers every session on the replica placement.json names, at the same data version."""
    assert cluster.wait_idle(timeout=120)  # what earlier tests pushed is ingested: versions read now are final
    before = {n: (cluster.placement.get(n), cluster.session_info(n).data_version) for n in cluster.placement.names()}
    log_dir = cluster.log_dir
    cluster.shutdown()  # the module's server keeps pointing at it; nothing uses it after this test
    again = ClusterEngine("tiny", CONFIG, dtype="float32", replicas=2, log_dir=log_dir, call_timeout_s=20,
                          poll_s=0.5)
    try:
        after = {n: (again.placement.get(n), again.session_info(n).data_version) for n in again.placement.names()}
        fed = LOCAL.engine_name("fed")  # its feed pushed until the end: at least what was seen, and on
        assert after.pop(fed)[1] >= before.pop(fed)[1]  # it now runs again on its replica
        assert after == before
        assert {i.name for i in again.list_sessions()} == set(before) | {fed}
        name = LOCAL.engine_name("s3")
        assert again.push(name, lines(900)).data_version == before[name][1] + 1
    finally:
        again.shutdown()
