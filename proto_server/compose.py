"""The composition root: a server assembled from its settings.

What a `proto-server serve` is made of (the store, the compaction secret, the generator: the
simulated GPU, the local model, or vLLM engines with their capacities) is decided here, once,
for every front that builds one: the command line (cli.py), which only parses and turns a
`Refused` into a line and an exit status, and the benchmarks, which build their generators
with `connect_vllm` and `load_local` so that they measure what serve would run. Whatever cannot
be had raises `Refused`, saying what to run or pass instead.
"""

from __future__ import annotations

import socket
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from proto_server.engine import families
from proto_server.engine.base import TokenGenerator
from proto_server.engine.model_files import INSTALL_HINT, ModelError
from proto_server.engine.model_renderer import TemplateError
from proto_server.engine.prefix_cache import PrefixCache
from proto_server.engine.script import Planner
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.launch import Launch, LocalModel
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import MiB, ServerConfig
from proto_server.server.process.secret import load_or_create_secret, secret_path_for_store
from proto_server.server.store import (
    ResponseStore,
    SQLiteStore,
    StoreError,
    StoreRetention,
    is_postgres_url,
    redact,
)

if TYPE_CHECKING:
    from proto_server.engine.local import LocalGenerator
    from proto_server.engine.vllm import ServedModel, VllmGenerator
    from proto_server.server.store.postgres import PostgresStore


class Refused(Exception):
    """`proto-server` cannot do what it was asked: the message says what to run or pass
    instead. Raised anywhere below `main`, printed there, exit status 2."""


def simulated(planner: Planner, timing: TimingModel, launch: Launch) -> SimulatedGenerator:
    """The simulated GPU running `planner` (a script, or the built-in default model)."""
    cache = PrefixCache(capacity_tokens=launch.prefix_cache_tokens)
    return SimulatedGenerator(planner, timing, prefix_cache=cache if launch.prefix_cache else None)


def open_store(
    location: str, retention: StoreRetention
) -> tuple[ResponseStore, PostgresStore | None]:
    """The store `--store` names, and the same store again if it is shared (PostgreSQL)."""
    try:
        if is_postgres_url(location):
            try:
                from proto_server.server.store.postgres import PostgresStore
            except ImportError as exc:
                raise Refused(f"a postgresql:// store needs psycopg ({exc}); "
                              "pip install 'proto-server[postgresql]'") from None  # fmt: skip
            shared = PostgresStore(location, retention=retention)
            return shared, shared
        if location != ":memory:":
            Path(location).parent.mkdir(parents=True, exist_ok=True)
        return SQLiteStore(location, retention=retention), None
    except (OSError, sqlite3.Error, StoreError) as exc:
        raise Refused(f"cannot open the store {redact(location)}: {exc}; start it or pass "
                      "another --store") from None  # fmt: skip


def compaction_secret(launch: Launch, shared: PostgresStore | None) -> bytes | None:
    """The compaction secret: `--compaction-secret-file`, else the file beside the SQLite
    store, else a shared store's own (None: a new one for this process)."""
    secret_file = launch.compaction_secret_file or (
        None if launch.store == ":memory:" or shared else secret_path_for_store(launch.store)
    )
    try:
        if secret_file is None:
            return shared.secret if shared else None
        return load_or_create_secret(Path(secret_file))
    except (OSError, ValueError) as exc:
        raise Refused(f"cannot use the compaction secret: {exc}; pass another "
                      "--compaction-secret-file") from None  # fmt: skip


def engine_capacities(urls: list[str], down: Mapping[int, str]) -> list[int] | None:
    """Each engine's KV cache in tokens, as its /metrics says at start-up; None, with the
    reason on stderr, where one does not answer or does not say: admission stays off (the
    default is a best effort; --kv-capacity-tokens sets the capacity by hand)."""
    from proto_server.engine.vllm import engine_kv_capacity

    why = None
    capacities = []
    if down:
        why = "not every engine answered at start-up"
    for url in urls if not down else ():
        capacity = trio.run(engine_kv_capacity, url)
        if capacity is None:
            why = f"the engine at {url} does not report vllm:cache_config_info on its /metrics"
            break
        capacities.append(capacity)
    if why is None:
        return capacities
    print(f"proto-server: admission by the engines' KV cache is off: {why}; pass "
          "--kv-capacity-tokens to set it", file=sys.stderr)  # fmt: skip
    return None


def admission_between_processes(config: ServerConfig, launch: Launch) -> ServerConfig:
    """Processes admitting against the same engines share the room through the store they
    share (--admission-shared; --workers N turns it on); workers that share no store
    (:memory:) each admit against a static 1/N of it."""
    memory = launch.store == ":memory:"
    if config.admission_shared:
        if memory:
            raise Refused("--admission-shared needs a store the processes share: a --store "
                          "file or a postgresql:// URL, not :memory:")  # fmt: skip
        if not config.kv_capacity_tokens:
            raise Refused("--admission-shared admits by the engines' KV cache: pass "
                          "--kv-capacity-tokens or --kv-capacity-from-engine")  # fmt: skip
    if launch.worker_of <= 1 or not config.kv_capacity_tokens:
        return config
    if memory:
        return attrs.evolve(
            config, kv_capacity_tokens=max(1, config.kv_capacity_tokens // launch.worker_of)
        )
    return attrs.evolve(config, admission_shared=True)


def load_local(wanted: LocalModel, **options: Any) -> LocalGenerator:
    """The local model, or Refused saying why it cannot be had."""
    try:
        from proto_server.engine.local import LocalGenerator
    except ImportError as exc:
        raise Refused(f"the local model needs torch ({exc}); {INSTALL_HINT}") from None
    print(
        "proto-server: loading the local model (a GGUF file is converted once, which takes "
        "a minute; later loads take seconds)...",
        file=sys.stderr,
        flush=True,
    )
    try:
        return LocalGenerator.load(wanted.model, threads=wanted.threads, **options)
    except (ModelError, TemplateError) as exc:
        raise Refused(str(exc)) from None


def connect_engines(
    launch: Launch, wanted: LocalModel, config: ServerConfig
) -> tuple[TokenGenerator, ServerConfig, str]:
    """`serve --generator vllm`: the engine, or its replicas (one `--engine-url` each), with
    the settings they imply and what to call them; Refused says what to run or pass."""
    from proto_server.engine.replicas import Replica, ReplicatedGenerator
    from proto_server.engine.vllm import EngineSetupError, discover_replicas
    from proto_server.server.process import metrics

    urls = list(launch.engine_url)
    try:
        model, down = trio.run(discover_replicas, urls, wanted.model)
    except EngineSetupError as exc:
        raise Refused(str(exc)) from None
    for index, problem in down.items():
        print(f"proto-server: the engine at {urls[index]} does not answer ({problem}); it "
              "gets work once it does", file=sys.stderr)  # fmt: skip
    engines = [connect_vllm(launch, url, model, tool_syntax=config.tool_syntax) for url in urls]
    config = attrs.evolve(config, default_model=model.name)
    capacities = None
    if config.kv_capacity_from_engine and not config.kv_capacity_tokens:
        capacities = engine_capacities(urls, down)
        config = attrs.evolve(config, kv_capacity_tokens=sum(capacities or ()))
    if len(urls) == 1:
        (engine,) = engines
        return engine, config, f"vLLM model {model.name} at {engine.url}"
    replicated = ReplicatedGenerator(
        [Replica(url, engine) for url, engine in zip(urls, engines, strict=True)],
        capacities=capacities,
        down=list(down),
        probe_interval_s=launch.engine_probe_interval_s,
        observer=metrics.ReplicaMetrics(),
    )
    return replicated, config, f"vLLM model {model.name} on {len(urls)} engines"


def connect_vllm(
    launch: Launch, url: str, model: ServedModel | str | None, *, tool_syntax: str = families.AUTO
) -> VllmGenerator:
    """The engine at `url`: its model (`model` if known, else the one of that name, or the
    engine's only one) and tokenizer, or Refused saying what to run or pass."""
    from proto_server.engine.model_files import load_tokenizer
    from proto_server.engine.vllm import (
        EngineSetupError,
        ServedModel,
        VllmGenerator,
        discover,
        tokenizer_source,
    )

    try:
        if not isinstance(model, ServedModel):
            model = trio.run(discover, url, model)
        tokenizer = load_tokenizer(tokenizer_source(model, launch.tokenizer))
        return VllmGenerator(
            url,
            model,
            tokenizer,
            max_tokens=launch.max_tokens,
            connections=launch.engine_connections,
            timeout_s=launch.engine_timeout_s,
            render_cache_bytes=launch.render_cache_mb * MiB,
            tool_syntax=tool_syntax,
        )
    except (EngineSetupError, ModelError, TemplateError) as exc:
        raise Refused(str(exc)) from None


@attrs.frozen
class Composed:
    """A server ready to serve, what it serves (for the line that says it listens), and what
    to close once it stops: the generator's own resources, then the store's."""

    server: ProtoServer
    what: str
    closers: tuple[Callable[[], Awaitable[None]], ...]


def compose(
    launch: Launch,
    config: ServerConfig,
    *,
    local: LocalModel,
    timing: TimingModel,
    retention: StoreRetention,
    planner: Planner,
) -> Composed:
    """The server `serve` runs with these settings; `Refused` says what stands in the way."""
    store, shared = open_store(launch.store, retention)
    secret = compaction_secret(launch, shared)
    generator: TokenGenerator
    if launch.generator == "vllm":
        generator, config, what = connect_engines(launch, local, config)
    elif launch.generator == "local":
        model = load_local(
            local,
            max_tokens=launch.max_tokens,
            render_cache_bytes=launch.render_cache_mb * MiB,
            tool_syntax=config.tool_syntax,
        )
        generator, what = model, f"local model {model.name} on {model.device}"
        config = attrs.evolve(config, default_model=model.name)
    else:
        scripted = f"script {launch.script}" if launch.script else "the built-in default model"
        generator = simulated(planner, timing, launch)
        what = f"simulated GPU with {scripted}"
    config = admission_between_processes(config, launch)
    try:  # a socket the supervisor of --workers bound and passed down
        listener = None if launch.listen_fd is None else socket.socket(fileno=launch.listen_fd)
    except OSError as exc:
        raise Refused(f"--listen-fd {launch.listen_fd} is no socket ({exc.strerror}); it is "
                      "set by --workers, not by hand") from None  # fmt: skip
    server = ProtoServer(
        generator, config, store=store, compaction_secret=secret, listener=listener
    )
    closers = [getattr(generator, "aclose", None), store.aclose]
    return Composed(server, what, tuple(close for close in closers if close is not None))
