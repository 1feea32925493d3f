"""`proto-server serve`: run the server with its embedded defaults, or with flags;
`proto-server bench-local`: warm against cold prefill on the local model.

Why one module of this length: `main` is the one place a `Refused` or an `InvalidSetting` becomes a
line on stderr and exit status 2, and every command's set-up (the store, the secret, the engines,
the local model) raises one for it. bench-local and bench-vllm build their generators with serve's
own `_load_local` and `_connect_vllm`, so they measure the generator serve would run.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import re
import shutil
import signal
import socket
import sqlite3
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import trio

from proto_server.bench import cli as bench_cli
from proto_server.core import settings
from proto_server.core.ranges import InvalidSetting
from proto_server.core.settings import add_flags, from_flags
from proto_server.engine import families
from proto_server.engine.base import TokenGenerator
from proto_server.engine.default_model import DefaultModel
from proto_server.engine.model_files import INSTALL_HINT, ModelError
from proto_server.engine.model_renderer import TemplateError
from proto_server.engine.prefix_cache import PrefixCache
from proto_server.engine.script import Planner, ScriptError, load_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.launch import Launch, LocalModel
from proto_server.server.app import BoundAddress, ProtoServer
from proto_server.server.config import MiB, ServerConfig
from proto_server.server.logs import configure
from proto_server.server.secret import load_or_create_secret, secret_path_for_store
from proto_server.server.store import (
    ResponseStore,
    SQLiteStore,
    StoreError,
    StoreRetention,
    is_postgres_url,
    redact,
)

E = TypeVar("E", bound=BaseException)
N = TypeVar("N", int, float)

if TYPE_CHECKING:
    from proto_server.engine.local import LocalGenerator
    from proto_server.engine.vllm import ServedModel, VllmGenerator
    from proto_server.server.store.postgres import PostgresStore

API_KEYS_ENV = "PROTO_SERVER_API_KEYS"
LOCAL_BENCH_TURNS = 8


class Refused(Exception):
    """`proto-server` cannot do what it was asked: the message says what to run or pass
    instead. Raised anywhere below `main`, printed there, exit status 2."""


def _checked(kind: type[N], ok: Callable[[N], bool], rule: str) -> Callable[[str], N]:
    """For the benchmarks' flags, which no settings class holds."""

    def parse(text: str) -> N:
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def _positive(kind: type[N]) -> Callable[[str], N]:
    rule = "must be positive" if kind is int else "must be positive and finite"
    return _checked(kind, lambda value: 0 < value < math.inf, rule)


def api_keys(flags: Sequence[str] | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys from --api-key, else from PROTO_SERVER_API_KEYS; a blank one, or a list that
    holds none, is refused (ValueError) rather than turning auth off or letting `Bearer` in."""
    if flags:
        if any(not key.strip() for key in flags):
            raise ValueError("--api-key must not be empty or blank; pass the key itself")
        return tuple(key.strip() for key in flags)
    if API_KEYS_ENV not in environ:
        return ()
    keys = [key.strip() for key in environ[API_KEYS_ENV].split(",")]
    if not any(keys):
        raise ValueError(
            f"{API_KEYS_ENV} holds no key; set it to k1,k2,... or unset it to run without auth"
        )
    if not all(keys):
        raise ValueError(
            f"{API_KEYS_ENV} holds an empty key (a stray comma?); set it to k1,k2,... "
            "with no blank entries"
        )
    return tuple(keys)


def key_weights(flags: Sequence[str] | None) -> tuple[tuple[str, float], ...]:
    """`--key-weight KEY_ID=W` flags as (owner id, weight) pairs; a malformed one is refused
    (ValueError): a typo would silently leave a tenant at weight 1."""
    weights: dict[str, float] = {}
    for flag in flags or ():
        owner, equals, weight = flag.rpartition("=")
        if not equals or not re.fullmatch(r"key:[0-9a-f]{32}", owner.strip()):
            raise ValueError(
                f"--key-weight: expected KEY_ID=WEIGHT with KEY_ID as key:<32 hex digits> (the "
                f"first 32 of the key's SHA-256), got {flag!r}"
            )
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"--key-weight: {weight!r} is not a number") from None
        if not 0 < value < math.inf:
            raise ValueError(f"--key-weight: the weight must be positive, got {weight}")
        weights[owner.strip()] = value
    return tuple(weights.items())


#: The classes whose fields are `serve` flags, in the order `--help` lists them.
SETTINGS = (Launch, LocalModel, ServerConfig, TimingModel, StoreRetention)


def flag_of(field: str) -> str:
    """The `serve` flag that sets a field of one of the SETTINGS classes."""
    return settings.flag_of(SETTINGS, field)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="proto-server",
        description="An OpenAI Responses API server for agent loops: one Response per rollout.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve the Responses API over WebSocket on one port.",
    )
    # every setting a class holds is its flag, declared with the field (core/settings.py)
    for settings_class in SETTINGS:
        add_flags(serve, settings_class)
    bench = bench_cli.add_parser(commands)
    bench.add_argument(
        "--generator",
        choices=["simulated", "local"],
        default="simulated",
        help="local: measure warm (append) against cold (re-prefill) prefill on the local "
        "model instead, as bench-local does (its flags below apply)",
    )
    _local_bench_arguments(bench, turns=False)
    bench_local = commands.add_parser(
        "bench-local",
        help="measure warm (append) against cold (re-prefill) prefill on the local model",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Simulate an agent loop on the local model and print, per turn, the "
        "prefill tokens and time of the warm path (the kept KV cache) and of a cold full "
        "re-prefill of the history, as a Markdown table. Same as bench --generator local.",
    )
    _local_bench_arguments(bench_local, turns=True)
    bench_vllm = commands.add_parser(
        "bench-vllm",
        help="measure proto-server in front of vLLM against vLLM's own /v1/responses",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run one agent loop (forced tool calls, a tool output appended each turn, "
        "a final answer) on a running vLLM through five paths: proto-server's prototype and "
        "launched WebSocket and its stateless HTTP (a proto-server process this command "
        "starts, --generator vllm), and vLLM's own /v1/responses with the whole history and "
        "chained by previous_response_id (start the engine with "
        "VLLM_ENABLE_RESPONSES_API_STORE=1). Per turn: TTFT, turn time, prompt and cached "
        "tokens, the client's bytes and the CPU of proto-server's process and of vLLM's API "
        "server process (--engine-pid; its engine core is a child and is not counted), "
        "measured. Prints a Markdown table, the ratios and the goals; writes JSON and PNG "
        "plots into --out.",
    )
    bench_vllm.add_argument(
        "--engine-url", required=True, metavar="URL", help="the engine's base, ending in /v1"
    )
    bench_vllm.add_argument(
        "--engine-pid", required=True, type=_positive(int), metavar="PID",
        help="the process id of vLLM's API server (python -m vllm.entrypoints.openai.api_server)",
    )  # fmt: skip
    bench_vllm.add_argument("--model", metavar="NAME", help="the served model, if several")
    bench_vllm.add_argument("--tokenizer", metavar="PATH", help="as for serve")
    bench_vllm.add_argument("--turns", type=_positive(int), default=8, help="turns of the loop")
    bench_vllm.add_argument(
        "--tool-output-tokens", type=_positive(int), default=400, metavar="N",
        help="mean size of each turn's tool output, in the model's tokens (0.75x to 1.25x)",
    )  # fmt: skip
    bench_vllm.add_argument(
        "--answer-tokens", type=_positive(int), default=32, metavar="N",
        help="most tokens the model decodes each turn (proto-server's --max-tokens, vLLM's "
        "max_output_tokens)",
    )  # fmt: skip
    bench_vllm.add_argument(
        "--out", type=Path, default=Path("bench-results/vllm"), metavar="DIR",
        help="where bench-vllm.json and the plots go",
    )  # fmt: skip
    return parser


def _local_bench_arguments(parser: argparse.ArgumentParser, *, turns: bool) -> None:
    """The local-model benchmark's flags (bench shares --turns with its own meaning)."""
    add_flags(parser, LocalModel)
    if turns:
        parser.add_argument(
            "--turns", type=int, default=LOCAL_BENCH_TURNS, help="turns of the agent loop"
        )
    parser.add_argument(
        "--tool-output-tokens",
        type=int,
        default=500,
        metavar="N",
        help="local: size of the tool output appended each turn, in the model's tokens",
    )
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=8,
        metavar="N",
        help="local: tokens the model decodes each turn (warm and cold must say the same)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="local: run the loop N times and keep each turn's fastest times (busy machines)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; a setting out of range or a request it cannot serve is one line on
    stderr (what to pass or run instead) and exit status 2, said here and nowhere else."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args, list(sys.argv[1:] if argv is None else argv))
    except InvalidSetting as exc:
        print(f"proto-server: {flag_of(exc.field)}: {exc.why}", file=sys.stderr)
    except Refused as exc:
        print(f"proto-server: {exc}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "bench-local" or (args.command == "bench" and args.generator == "local"):
        if args.turns is None:
            args.turns = LOCAL_BENCH_TURNS
        return _bench_local(args)
    if args.command == "bench":
        return bench_cli.run(args)
    if args.command == "bench-vllm":
        return _bench_vllm(args)
    launch = from_flags(Launch, args)
    configure(launch.log_level)
    timing = from_flags(TimingModel, args)
    try:
        planner: Planner = load_script(launch.script) if launch.script else DefaultModel()
        keys = api_keys(launch.api_key, os.environ)
        weights = key_weights(launch.key_weight)
    except (ValueError, ScriptError) as exc:
        raise Refused(str(exc)) from None
    config = from_flags(ServerConfig, args, api_keys=keys, key_weights=weights)
    retention = from_flags(StoreRetention, args)
    if launch.workers > 1 and launch.listen_fd is None:
        return _supervise(args, argv)
    store, shared = _open_store(launch.store, retention)
    secret = _secret(launch, shared)
    generator: TokenGenerator
    if launch.generator == "vllm":
        generator, config, what = _connect_engines(launch, from_flags(LocalModel, args), config)
    elif launch.generator == "local":
        local = _load_local(
            from_flags(LocalModel, args),
            max_tokens=launch.max_tokens,
            render_cache_bytes=launch.render_cache_mb * MiB,
            tool_syntax=config.tool_syntax,
        )
        generator, what = local, f"local model {local.name} on {local.device}"
        config = attrs.evolve(config, default_model=local.name)
    else:
        model = f"script {launch.script}" if launch.script else "the built-in default model"
        cache = PrefixCache(capacity_tokens=launch.prefix_cache_tokens)
        generator = SimulatedGenerator(
            planner, timing, prefix_cache=cache if launch.prefix_cache else None
        )
        what = f"simulated GPU with {model}"
    config = _admission_between_processes(config, launch)
    try:  # a socket the supervisor of --workers bound and passed down
        listener = None if launch.listen_fd is None else socket.socket(fileno=launch.listen_fd)
    except OSError as exc:
        raise Refused(f"--listen-fd {launch.listen_fd} is no socket ({exc.strerror}); it is "
                      "set by --workers, not by hand") from None  # fmt: skip
    server = ProtoServer(
        generator, config, store=store, compaction_secret=secret, listener=listener
    )
    # What start-up loaded (a tokenizer, transformers, torch: millions of objects) lives as long
    # as the process; frozen, the cyclic collector stops re-scanning it at every full collection,
    # which was 40% of the server's CPU per turn in front of vLLM.
    gc.freeze()
    try:
        closers = [getattr(generator, "aclose", None), store.aclose]
        trio.run(partial(_serve, server, what, [close for close in closers if close is not None]))
    except OSError as exc:
        print(
            f"proto-server: cannot listen on {config.host}:{config.port}: {exc.strerror}; "
            "pick another --port (0 picks a free one)",
            file=sys.stderr,
        )
        return 1
    return 0


def _open_store(
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


def _secret(launch: Launch, shared: PostgresStore | None) -> bytes | None:
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


def _engine_capacities(urls: list[str], down: Mapping[int, str]) -> list[int] | None:
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


def _admission_between_processes(config: ServerConfig, launch: Launch) -> ServerConfig:
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


def _supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """`--workers N`: bind the port here, run N workers on it (workers.py)."""
    from proto_server.server.workers import Supervisor, WorkerFailed, bind

    try:
        listener = bind(args.host, args.port)
    except OSError as exc:
        print(f"proto-server: cannot listen on {args.host}:{args.port}: {exc.strerror}; pick "
              "another --port (0 picks a free one)", file=sys.stderr)  # fmt: skip
        return 1

    def command(fd: int) -> list[str]:  # the same serve, one worker on the inherited socket
        return [sys.executable, "-m", "proto_server", *argv, "--workers", "1", "--listen-fd",
                str(fd), "--worker-of", str(args.workers)]  # fmt: skip

    metrics_dir = tempfile.mkdtemp(prefix="proto-server-metrics-")
    supervisor = Supervisor(command, args.workers, listener, metrics_dir)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(supervisor.run)
            print(f"proto-server listening on {address.http_url} (WebSocket {address.ws_url}; "
                  f"{args.workers} workers of {args.generator})", flush=True)  # fmt: skip

    failed: list[WorkerFailed] = []
    try:
        trio.run(run)
    except* WorkerFailed as group:
        failed += _leaves(group, WorkerFailed)
    finally:
        listener.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if failed:
        print(f"proto-server: a worker could not start (exit {failed[0].status}); see what it "
              "said above", file=sys.stderr)  # fmt: skip
        return failed[0].status or 1
    return supervisor.status


def _leaves(group: BaseExceptionGroup[BaseException], kind: type[E]) -> list[E]:
    """The exceptions of `kind` in a (nested) exception group."""
    found: list[E] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found += _leaves(exc, kind)
        elif isinstance(exc, kind):
            found.append(exc)
    return found


def _load_local(wanted: LocalModel, **options: Any) -> LocalGenerator:
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


def _connect_engines(
    launch: Launch, wanted: LocalModel, config: ServerConfig
) -> tuple[TokenGenerator, ServerConfig, str]:
    """`serve --generator vllm`: the engine, or its replicas (one `--engine-url` each), with
    the settings they imply and what to call them; Refused says what to run or pass."""
    from proto_server.engine.replicas import Replica, ReplicatedGenerator
    from proto_server.engine.vllm import EngineSetupError, discover_replicas
    from proto_server.server import metrics

    urls = list(launch.engine_url)
    try:
        model, down = trio.run(discover_replicas, urls, wanted.model)
    except EngineSetupError as exc:
        raise Refused(str(exc)) from None
    for index, problem in down.items():
        print(f"proto-server: the engine at {urls[index]} does not answer ({problem}); it "
              "gets work once it does", file=sys.stderr)  # fmt: skip
    engines = [_connect_vllm(launch, url, model, tool_syntax=config.tool_syntax) for url in urls]
    config = attrs.evolve(config, default_model=model.name)
    capacities = None
    if config.kv_capacity_from_engine and not config.kv_capacity_tokens:
        capacities = _engine_capacities(urls, down)
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


def _connect_vllm(
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


def _bench_vllm(args: argparse.Namespace) -> int:
    # the served model's name and tokenizer
    launch = Launch(generator="vllm", engine_url=(args.engine_url,), tokenizer=args.tokenizer)
    generator = _connect_vllm(launch, args.engine_url, args.model)
    from proto_server.bench.vllm import measure, render, summarize, write_files

    print(
        f"{generator.name} on vLLM at {generator.url} (API server pid {args.engine_pid}); "
        f"{args.turns} turns, tool outputs of {args.tool_output_tokens} tokens on average, "
        f"at most {args.answer_tokens} tokens decoded a turn; wall-clock times and CPU "
        "measured on this machine",
        flush=True,
    )
    results = trio.run(
        partial(
            measure,
            engine_url=generator.url,
            engine_pid=args.engine_pid,
            model=generator.name,
            tokenizer=generator.tokenizer,
            turns=args.turns,
            tool_output_tokens=args.tool_output_tokens,
            answer_tokens=args.answer_tokens,
            nonce=str(os.getpid()),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    )
    summary = summarize(results)
    print(render(results, summary))
    plots = write_files(results, summary, args.out)
    print(f"\nJSON: {args.out / 'bench-vllm.json'}")
    print(plots if isinstance(plots, str) else "Plots: " + ", ".join(map(str, plots)))
    return 0 if not summary["failed"] else 1


def _bench_local(args: argparse.Namespace) -> int:
    generator = _load_local(from_flags(LocalModel, args), max_tokens=args.answer_tokens)
    from proto_server.bench.local import Turn, measure, table

    print(
        f"{generator.name} on {generator.device}, {generator.threads} thread(s); "
        f"{args.turns} turns, {args.tool_output_tokens}-token tool outputs, "
        f"{args.answer_tokens}-token answers; prefill wall-clock time, measured"
        + (f", fastest of {args.repeat} runs" if args.repeat > 1 else ""),
        flush=True,
    )

    def progress(run: int, turn: Turn) -> None:
        print(
            f"run {run + 1}/{args.repeat}, turn {turn.turn}/{args.turns}: "
            f"warm {turn.warm_seconds * 1e3:.0f} ms, cold {turn.cold_seconds * 1e3:.0f} ms",
            file=sys.stderr,
            flush=True,
        )

    results = trio.run(
        partial(
            measure,
            generator,
            turns=args.turns,
            tool_output_tokens=args.tool_output_tokens,
            repeat=args.repeat,
            progress=progress,
        )
    )
    print(table(results))
    return 0


async def _serve(
    server: ProtoServer, what: str, closers: Sequence[Callable[[], Awaitable[None]]] = ()
) -> None:
    try:
        await _listen(server, what)
    finally:
        # the generator's own resources (an engine's connections), then the store's (its
        # connection processes, a database pool)
        with trio.CancelScope(shield=True):
            for close in closers:
                await close()


async def _listen(server: ProtoServer, what: str) -> None:
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(server.serve)
        print(
            f"proto-server listening on {address.http_url} (WebSocket {address.ws_url}; {what})",
            flush=True,
        )
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if server.draining:
                    print(f"proto-server: {name} again, stopping now", file=sys.stderr)
                    nursery.cancel_scope.cancel()
                    break
                await nursery.start(_stop, server, nursery.cancel_scope)  # not ready now
                grace, delay = server.config.shutdown_grace_s, server.config.drain_delay_s
                after = f" after {delay:g} s, not ready meanwhile" if delay else ""
                print(
                    f"proto-server: {name}, stopping: no new connections{after}; streaming "
                    f"segments have {grace:g} s to finish (send it again to stop at once)",
                    file=sys.stderr,
                    flush=True,
                )


async def _stop(
    server: ProtoServer,
    everything: trio.CancelScope,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    await server.shutdown(task_status=task_status)
    everything.cancel()  # the signal listener; serve() has returned already
