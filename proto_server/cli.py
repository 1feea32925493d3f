"""`proto-server serve`: run the server with its embedded defaults, or with flags;
`proto-server bench <section>`: the benchmarks, a distribution of their own (benchmarks/).

The command line parses, runs and stops: what a server is made of is compose.py's. `main` is
the one place a `Refused` or an `InvalidSetting` becomes a line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import TypeVar

import trio

from proto_server.compose import Refused, compose
from proto_server.core import settings
from proto_server.core.ranges import InvalidSetting
from proto_server.core.settings import add_flags, from_flags
from proto_server.engine.default_model import DefaultModel
from proto_server.engine.script import Planner, ScriptError, load_script
from proto_server.engine.simulated import TimingModel
from proto_server.launch import Launch, LocalModel
from proto_server.server.listener.app import BoundAddress, ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.process.logs import configure
from proto_server.server.store import StoreRetention

E = TypeVar("E", bound=BaseException)

API_KEYS_ENV = "PROTO_SERVER_API_KEYS"
ADMIN_KEY_ENV = "PROTO_SERVER_ADMIN_KEY"


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


def admin_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The key from --admin-key, else from PROTO_SERVER_ADMIN_KEY; a blank one is refused
    (ValueError) rather than letting `Bearer` in."""
    key = flag if flag is not None else environ.get(ADMIN_KEY_ENV)
    if key is not None and not key.strip():
        where = "--admin-key" if flag is not None else ADMIN_KEY_ENV
        raise ValueError(f"{where} must not be empty or blank; pass the key itself")
    return None if key is None else key.strip()


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
    # listed for --help; `main` hands what follows `bench` to the benchmarks' own parser
    commands.add_parser("bench", help="run a benchmark (installed apart: benchmarks/)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; a setting out of range or a request it cannot serve is one line on
    stderr (what to pass or run instead) and exit status 2, said here and nowhere else."""
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        if given[:1] == ["bench"]:  # the benchmarks parse their own flags
            return _bench(given[1:])
        return _run(build_parser().parse_args(given), given)
    except InvalidSetting as exc:
        print(f"proto-server: {flag_of(exc.field)}: {exc.why}", file=sys.stderr)
    except Refused as exc:
        print(f"proto-server: {exc}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    launch = from_flags(Launch, args)
    configure(launch.log_level)
    timing = from_flags(TimingModel, args)
    try:
        planner: Planner = load_script(launch.script) if launch.script else DefaultModel()
        keys = api_keys(launch.api_key, os.environ)
        weights = key_weights(launch.key_weight)
        admin = admin_key(launch.admin_key, os.environ)
        if admin is not None and launch.workers > 1:
            raise ValueError(
                "--admin-key: a pause would reach only the worker that took its connection; "
                "run one worker per port (drop --workers) to pause for a weight update"
            )
    except (ValueError, ScriptError) as exc:
        raise Refused(str(exc)) from None
    config = from_flags(ServerConfig, args, api_keys=keys, key_weights=weights, admin_key=admin)
    retention = from_flags(StoreRetention, args)
    if launch.workers > 1 and launch.listen_fd is None:
        return _supervise(args, argv)
    composed = compose(
        launch,
        config,
        local=from_flags(LocalModel, args),
        timing=timing,
        retention=retention,
        planner=planner,
    )
    # What start-up loaded (a tokenizer, transformers, torch: millions of objects) lives as long
    # as the process; frozen, the cyclic collector stops re-scanning it at every full collection,
    # which was 40% of the server's CPU per turn in front of vLLM.
    gc.freeze()
    try:
        trio.run(partial(_serve, composed.server, composed.what, composed.closers))
    except OSError as exc:
        print(
            f"proto-server: cannot listen on {config.host}:{config.port}: {exc.strerror}; "
            "pick another --port (0 picks a free one)",
            file=sys.stderr,
        )
        return 1
    return 0


def _supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """`--workers N`: bind the port here, run N workers on it (workers.py)."""
    from proto_server.server.listener.workers import Supervisor, WorkerFailed, bind

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


def _bench(argv: list[str]) -> int:
    """The benchmarks' own command line; they are not part of this package, so say what to
    install when they are missing."""
    try:
        # by name: the product type-checks and installs without them
        bench = importlib.import_module("proto_server_bench.cli")
    except ModuleNotFoundError as exc:
        if exc.name != "proto_server_bench":
            raise
        print("proto-server bench: the benchmarks are not installed; from a checkout: "
              "pip install -e ./benchmarks", file=sys.stderr)  # fmt: skip
        return 2
    main: Callable[[list[str]], int] = bench.main
    return main(argv)


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
