"""`streamllm serve`: engine, feeds and the service (websocket, HTTP, page) from one config file.

    streamllm serve --config queries/crypto.toml [--feed synthetic|binance|okx|...|replay:FILE[,FILE]]
                    [--host 127.0.0.1] [--port 8765] [--model smollm2-135m] [--tokens tokens.toml]
                    [--no-auth] [--allow-origin ORIGIN] [--allow-host NAME]

Without --tokens (or $STREAMLLM_TOKENS) the server makes one local token at start, as Jupyter
does: tenant `local`, an admin, written to $STREAMLLM_HOME/serve-PORT.token (mode 0600, removed
at stop) where `streamllm ask` / `watch` and the Python client find it, and printed once in
the page's URL (`/?token=...`). `--no-auth` serves without any token (loopback only), as before.
Browsers from other sites are refused whatever the tokens (service/edge.py: Origin and Host).

Each config session is opened in the engine under the owner tenant (`--owner`, default
the first tenant of the token file, or `local` without tokens), its standing questions
are registered, and its feed is attached (sessions sharing a feed share one source).
SIGINT/SIGTERM stop the feeds, close connections and shut the engine down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from feeds.sources import read_options
from streamllm.cli.common import add_read_args
from streamllm.client.local_token import new_token, prune_stale_tokens, remove_token, write_token
from streamllm.config import (
    LIVE_VENUES,
    ConfigError,
    FeedSpec,
    QueryConfig,
    load_config,
)
from streamllm.config.choices import check_choices
from streamllm.durability.ingest_log import IngestLog
from streamllm.durability.recovery import recover
from streamllm.durability.resident import ResidentEngine
from streamllm.engine import Engine, EngineConfig, decode_note
from streamllm.feeding.owners import feed_owners
from streamllm.feeding.supervise import FeedRunner
from streamllm.feeding.wiring import (
    FeedGroup,
    build_attachments,
    feed_events,
    feed_file_problems,
    group_feeds,
    open_sessions,
    parse_feed_override,
    venue_credentials,
    venue_shards,
    venue_symbols,
)
from streamllm.model.adapter import AdapterError, pick_adapter
from streamllm.model.loader import ensure_cached, load_model, load_tokenizer
from streamllm.service.bars import TapSink
from streamllm.service.edge import EdgeRules
from streamllm.service.server import ServerConfig, StreamServer, is_loopback
from streamllm.service.tenants import LOCAL, Tenant, Tenants, TokenConfigError

log = logging.getLogger("streamllm.cli.serve")


def feed_runner(server: StreamServer, owner: Tenant, group: FeedGroup, speed: float | None, seed: int,
                log: IngestLog | None = None) -> FeedRunner:
    """The group's feed, supervised: in its own thread, restarted with backoff, shown in /health.
    A restarted synthetic feed gets the next seed (a replay of the same prices would go back in time)."""
    attachments = build_attachments(TapSink(server.engine, server.bars), owner, group, log)
    name = group.feed.kind if group.feed.kind in ("synthetic", "binance") else str(group.feed)
    sessions = [owner.engine_name(spec.name) for spec in group.sessions]
    live = group.feed.kind in (*LIVE_VENUES, "cryptofeed")
    # A live feed that fails is restarted with backoff (a recorded one that failed would replay from its start).
    return FeedRunner(name, sessions, lambda attempt: feed_events(group, speed, seed + attempt), attachments,
                      restart=live or group.feed.kind == "synthetic", live=live)


def summary(server: StreamServer, tenants: Tenants, owner: Tenant, config: QueryConfig | None,
            groups: list[FeedGroup], registered: int, token_file: Path | None = None,
            local_token: str | None = None) -> str:
    http = server.url.replace("ws://", "http://", 1)
    stats = server.engine.stats()
    lines = [f"streamllm serving {server.engine.model_name} on {stats['device']} at {server.url}",
             f"  dtype: {stats['dtype']}" + (f", {note}" if (note := decode_note(stats)) else "")]
    page = f"{http}/"
    if local_token is not None:
        page += f"?token={local_token}"  # printed this once; the page then keeps it per tab
        lines.append(f"  auth: a local token (tenant 'local', admin) in {token_file}, read by streamllm ask / "
                     "watch and the client on this machine; --no-auth serves without one")
    elif tenants.auth:
        lines.append(f"  auth: {len(tenants.tokens)} tokens, tenants {', '.join(tenants.names)}; "
                     f"config sessions belong to {owner.name!r}")
    else:
        lines.append("  auth: none (--no-auth): listening on loopback only")
    if config is not None:
        for group in groups:
            templates: dict[str, list[Any]] = {}
            for spec in group.sessions:
                if spec.template:  # hundreds of sessions: one line per template
                    templates.setdefault(spec.template, []).append(spec)
                    continue
                lines.append(f"  session {spec.name:<12} {spec.instrument:<10} feed {group.feed}  "
                             f"{len(spec.questions)} standing questions, max_context {spec.max_context_tokens}")
            for template, specs in templates.items():
                names = ", ".join(s.name for s in specs[:3]) + (f", ... {specs[-1].name}" if len(specs) > 3 else "")
                lines.append(f"  {template}: {len(specs)} sessions ({names}) feed {group.feed}  "
                             f"{len(specs[0].questions)} standing questions each, "
                             f"max_context {specs[0].max_context_tokens}")
            if group.feed.kind in LIVE_VENUES:
                count = len(venue_shards(group))
                lines.append(f"  feed {group.feed}: {len(venue_symbols(group))} symbols on {count} "
                             f"connection{'s' if count != 1 else ''}")
        lines.append(f"  {registered} standing questions registered")
    else:
        lines.append("  no --config: clients open their own sessions")
    lines.append(f"  page {page}   health {http}/health   metrics {http}/metrics   OpenAI API {http}/v1")
    if config is not None and config.sessions:
        lines.append(f"  try: streamllm watch {config.sessions[0].name} --url {server.url}")
    return "\n".join(lines)


async def serve_forever(args: argparse.Namespace, tenants: Tenants, config: QueryConfig | None,
                        groups: list[FeedGroup]) -> int:
    owner = tenants.tenant(args.owner) if args.owner else (
        next((t for t in tenants.tokens.values() if not t.read_only), LOCAL) if tenants.auth else LOCAL)
    loaded = load_model(args.model, progress=True)
    try:
        adapter = pick_adapter(args.adapter, config.adapter if config is not None else None, loaded.name,
                               warn=lambda m: print(f"streamllm serve: {m}", file=sys.stderr), config=config)
    except AdapterError as exc:
        print(f"streamllm serve: {exc}", file=sys.stderr)
        return 2
    recovered = ingest_log = None
    if args.ray:  # N engine replicas as Ray actors; each recovers its own sessions from its own log
        engine = await asyncio.to_thread(build_cluster, args, loaded.name, adapter, config, groups, owner)
        del loaded
    else:
        engine = Engine(loaded, engine_config(args), device=args.device, dtype=args.dtype, progress=True,
                        adapter=adapter)
        if args.spill_dir:  # memory pressure: idle sessions to disk, restored on use (before any recovery)
            engine = ResidentEngine(engine, args.spill_dir, auto_evict=True)
    if args.log_dir and not args.ray:  # rebuild sessions from the ingest log before anyone can connect
        ingest_log = IngestLog(args.log_dir, flush=args.log_flush, checkpoint_versions=args.checkpoint_versions,
                               checkpoint_s=args.checkpoint_s)
        recovered = await asyncio.to_thread(recover, engine, ingest_log, progress=True, repair=args.repair)
    feed_tasks: list[asyncio.Task] = []
    server = StreamServer(engine, tenants, ServerConfig(
        host=args.host, port=args.port, max_message_bytes=args.max_message_bytes, max_queue=args.max_queue,
        allowed_origins=tuple(args.allow_origin), allowed_hosts=tuple(args.allow_host)),
        replicas=engine if args.ray else None)
    if config is not None:  # a feed's sessions take client pushes only where the config allows them
        server.feed_owners.update(feed_owners(config, groups, owner))
    local_token = next(iter(tenants.tokens)) if tenants.local_token else None  # Tenants.local's one token
    token_file = None
    try:
        registered = await asyncio.to_thread(open_sessions, engine, owner, config) if config is not None else 0
        try:
            await server.start()
        except OSError as exc:
            print(f"streamllm serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 2
        prune_stale_tokens(keep=server.port)  # files of killed servers: clutter, and stale tokens
        if local_token is not None:  # the port is known now (--port 0 picks one)
            token_file = write_token(server.port, local_token)
        else:  # a file for this port is a killed server's: clients would send its stale token
            remove_token(server.port)
        if args.ray and groups:  # feeds run inside the replicas, beside their sessions
            await asyncio.to_thread(engine.start_feeds)
        for group in groups if not args.ray else []:
            runner = feed_runner(server, owner, group, args.speed, args.seed, ingest_log)
            server.feeds.append(runner)
            feed_tasks.append(asyncio.create_task(runner.run()))
        print(summary(server, tenants, owner, config, groups, registered, token_file, local_token), flush=True)
        if recovered is not None:
            print(f"  ingest log {args.log_dir} ({args.log_flush}): {recovered.summary()}", flush=True)
        if args.ray:
            for r in engine.replica_health():
                print(f"  replica {r['replica']}: {r['sessions']} sessions, node {r['node'][:12]}, pid {r['pid']}; "
                      f"{r['recovery']}", flush=True)
            print(f"  ingest logs and placement under {engine.log_dir}; "
                  f"move a session: streamllm sessions move NAME --to REPLICA --url {server.url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("streamllm serve: stopping (signal received)", file=sys.stderr, flush=True)
    finally:
        if token_file is not None:
            remove_token(server.port, local_token)
        for task in feed_tasks:
            task.cancel()
        for task in feed_tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.gather(*(runner.aclose() for runner in server.feeds), return_exceptions=True)
        await server.close()
        await asyncio.to_thread(engine.shutdown)
        if engine.ingest_log is not None:
            engine.ingest_log.close()
    return 0


def preflight(args: argparse.Namespace, config: QueryConfig | None, groups: list[FeedGroup],
              override: FeedSpec | None) -> list[str]:
    """What would fail after the model loads, found before: every feed file readable, the port free.
    The config's choices are checked with the model's tokenizer alone (ConfigError naming the key)."""
    if config is not None and any(q.choices for s in config.sessions for q in s.questions):
        try:
            ensure_cached(args.model)  # the default model is fetched once, with its progress, as load_model would
            tokenizer = load_tokenizer(args.model)
        except (OSError, ValueError, RuntimeError):  # a model that cannot load: load_model says so, as before
            tokenizer = None
        if tokenizer is not None:
            check_choices(config, tokenizer)
    problems = feed_file_problems(groups, config, override) if config is not None else []
    port = port_problem(args.host, args.port)
    return problems + ([port] if port else [])


def port_problem(host: str, port: int) -> str | None:
    """Bind the address as the server will (SO_REUSEADDR) and let it go: a port in use, or a host this
    machine does not have, is a one-line error now rather than after the model has loaded."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        why = "the port is in use (another streamllm serve? pick one with --port, 0 for any free one)" \
            if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        return f"cannot listen on {host}:{port}: {why}"
    return None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from serve's flags (every replica of `--ray` gets the same)."""
    return EngineConfig(max_cells=args.max_cells)


def build_cluster(args: argparse.Namespace, model_name: str, adapter: Any, config: QueryConfig | None,
                  groups: list[FeedGroup], owner: Tenant) -> Any:
    """`serve --ray`: the ClusterEngine (streamllm.scale; imports Ray) in place of an Engine."""
    from streamllm.scale.cluster import ClusterEngine
    from streamllm.scale.replica import FeedPlan

    adapter_path = args.adapter or (str(config.adapter) if adapter is not None and config is not None else None)
    return ClusterEngine(
        args.model, engine_config(args), device=args.device, dtype=args.dtype, replicas=args.replicas,
        address=args.address, log_dir=args.log_dir,
        cpus_per_replica=args.replica_cpus, adapter=adapter_path, log_flush=args.log_flush,
        checkpoint_versions=args.checkpoint_versions, checkpoint_s=args.checkpoint_s,
        feeds=FeedPlan(groups, owner, args.speed, args.seed) if groups else None, spill_dir=args.spill_dir)


def main(argv: list[str]) -> int:
    """`streamllm serve ARGS`: the composition root (engine, ingest log, feeds, server); returns the exit code."""
    parser = argparse.ArgumentParser(prog="streamllm serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="queries/*.toml: sessions, feeds and standing questions")
    parser.add_argument("--feed", help="override every session's feed: synthetic | binance | bybit | coinbase | kraken | kraken-futures | okx | "
                        "alpaca (VENUE:wss://... another endpoint) | replay:FILE[,FILE] | csv:FILE | cryptofeed:EXCHANGE")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, HF dir or .gguf")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="auto: bf16 where the CPU runs bf16 products fast (AMX/AVX512-BF16) and on CUDA")
    parser.add_argument("--adapter", help="choice heads from `streamllm tune` (default: the config's [model] adapter)")
    parser.add_argument("--max-cells", type=int, default=65536, help="KV cells in the shared pool")
    parser.add_argument("--tokens", help="TOML token file ([tokens] \"token\" = \"tenant\"); also $STREAMLLM_TOKENS; "
                        "without either, a local token is generated (see --no-auth)")
    parser.add_argument("--no-auth", action="store_true",
                        help="no tokens at all: every local client is tenant `local` (loopback only)")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a browser origin besides the server's own that may use it, e.g. "
                             "http://localhost:3000 ('*': any; repeatable)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="a Host name besides localhost/127.0.0.1/[::1] (or the bound address) that "
                             "clients may use, e.g. myhost.lan ('*.example.com', '*': any; repeatable)")
    parser.add_argument("--owner", help="tenant owning the config's sessions (default: first tenant)")
    parser.add_argument("--speed", type=float, default=1.0, help="replay/synthetic pace, x real time (0: max)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic feed seed")
    parser.add_argument("--max-message-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-queue", type=int, default=1024, help="outgoing messages per connection")
    parser.add_argument("--log-dir", help="durable ingest log: acked batches survive a crash; recovered at start")
    parser.add_argument("--log-flush", default="batch", choices=("batch", "interval"),
                        help="batch: fsync before each ack; interval: flush before each ack, fsync every 50 ms")
    parser.add_argument("--checkpoint-versions", type=int, default=0,
                        help="with --log-dir: snapshot each session every N data versions and truncate its log")
    parser.add_argument("--checkpoint-s", type=float, default=0.0, help="with --log-dir: ... or every T seconds")
    parser.add_argument("--repair", action="store_true",
                        help="open sessions whose log has a hole up to the hole (default: refuse them)")
    parser.add_argument("--spill-dir", help="evict idle sessions here when cells run out (restored on use); "
                        "with --ray, each replica under SPILL_DIR/replica-N")
    parser.add_argument("--ray", action="store_true",
                        help="serve from N engine replicas on Ray (pip install 'streamllm[ray]'; docs/scale.md)")
    parser.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas (Ray actors)")
    parser.add_argument("--address", default=None,
                        help="with --ray: Ray cluster to join (auto, ray://host:10001); default: start one here")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs reserved per replica")
    parser.add_argument("--log-level", default="INFO")
    add_read_args(parser)
    args = parser.parse_args(argv)
    if not args.ray and (args.address or args.replicas != 2 or args.replica_cpus != 1.0):
        print("streamllm serve: --replicas, --address and --replica-cpus need --ray", file=sys.stderr)
        return 2
    if args.ray and args.replicas < 1:
        print(f"streamllm serve: --replicas must be at least 1, got {args.replicas}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        tenants = Tenants.load(args.tokens)
        if not tenants.auth and not is_loopback(args.host):
            print(f"streamllm serve: refusing --host {args.host} without tokens: anyone reaching it could read "
                  "and write every session. Pass --tokens FILE or set STREAMLLM_TOKENS=token=tenant, or "
                  "bind 127.0.0.1.", file=sys.stderr)
            return 2
        if args.no_auth and tenants.auth:
            print("streamllm serve: --no-auth, but tokens are configured (--tokens or $STREAMLLM_TOKENS): "
                  "drop one or the other", file=sys.stderr)
            return 2
        if not tenants.auth and not args.no_auth:
            tenants = Tenants.local(new_token())
        EdgeRules.for_bind(args.host, args.allow_host, args.allow_origin)  # a malformed one: exit 2, now
        if args.owner:
            tenants.tenant(args.owner)
        config = load_config(args.config) if args.config else None
        override = parse_feed_override(args.feed) if args.feed else None
        groups = group_feeds(config, override) if config is not None else []
        for group in groups:
            group.read = read_options(args)
            venue_credentials(group.feed.kind)  # missing keys are a start-up error, not a reconnect loop
        problems = preflight(args, config, groups, override)
    except (TokenConfigError, ConfigError, ValueError) as exc:
        print(f"streamllm serve: {exc}", file=sys.stderr)
        return 2
    if problems:  # seconds before the model would have loaded: one line each
        for problem in problems:
            print(f"streamllm serve: {problem}", file=sys.stderr)
        return 2
    return asyncio.run(serve_forever(args, tenants, config, groups))
