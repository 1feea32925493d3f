"""`bench agents`: the engines a run starts (a vLLM CPU engine each, or none on the simulated
GPU), the servers in front of them, the paths run one after the other (`run_agents`), and the
command (`main`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import trio

from proto_server_bench.agents import (
    ADMITTED,
    BLOCK_SIZE,
    ENGINE_READY_S,
    MAX_MODEL_LEN,
    SPREAD,
    AgentsSettings,
    Progress,
    make_agents,
)
from proto_server_bench.agents_paths import Target, run_path
from proto_server_bench.agents_report import render, report, write_files
from proto_server_bench.chat import CHAT, PROGRAMS
from proto_server_bench.paths import LAUNCHED, PROTOTYPE, STATELESS, start_proto_server, start_serve

# -- engines -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def engine_python(settings: AgentsSettings) -> str:
    """The engine's interpreter: $PROTO_SERVER_VLLM_PYTHON (as the engine tests), else the flag."""
    return os.environ.get("PROTO_SERVER_VLLM_PYTHON") or settings.vllm_python


def engine_command(python: str, model_dir: Path, port: int, gpu_blocks: int | None) -> list[str]:
    """vLLM's OpenAI server as the engine tests start it (SmolLM2, block size 32, prefix caching,
    the hermes parser for its own endpoint's calls), its cache bounded by `gpu_blocks`; it
    schedules by priority, which a request without one (every path but an admitting
    proto-server's) leaves in arrival order."""
    # the engine refuses a cache that cannot hold one request of its longest (it found one
    # block less than the override usable)
    longest = MAX_MODEL_LEN
    if gpu_blocks is not None:
        longest = min(longest, (gpu_blocks - 1) * BLOCK_SIZE)
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "smollm2",
        "--dtype", "float32", "--max-model-len", str(longest), "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--scheduling-policy", "priority",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if gpu_blocks is not None:
        command += ["--num-gpu-blocks-override", str(gpu_blocks)]
    return command


@contextlib.asynccontextmanager
async def started_engine(
    settings: AgentsSettings, progress: Progress, number: int = 1
) -> AsyncIterator[str]:
    """A vLLM CPU engine of this run's own (its log in the output folder), stopped after."""
    from proto_server.engine.model_files import (
        default_cache_dir,
        default_model_path,
        model_directory,
    )

    python = engine_python(settings)
    model_dir = model_directory(default_model_path(), default_cache_dir())
    port = _free_port()
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    log_path = settings.out_dir / ("agents-engine" + (f"-{number}" if number > 1 else "") + ".log")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    url = f"http://127.0.0.1:{port}/v1"
    progress(f"starting vLLM on port {port} (log: {log_path})")
    with log_path.open("ab") as log:
        process = await trio.lowlevel.open_process(
            engine_command(python, model_dir, port, settings.gpu_blocks),
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            with trio.fail_after(ENGINE_READY_S):
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"vLLM exited ({process.returncode}); see {log_path}")
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(f"{url}/models")).status_code == 200:
                            break
                    await trio.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with trio.move_on_after(30):
            await process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


async def run_agents(settings: AgentsSettings, progress: Progress) -> dict[str, Any]:
    """Every path in turn on one engine (and, with several, the launched path on all of them);
    the run's JSON (settings, workload, paths, summary)."""
    nonce = f"{os.getpid()}-{time.time_ns() % 10**9}"
    spread = spread_url = ""
    async with contextlib.AsyncExitStack() as stack:
        if settings.engine == "vllm":
            from proto_server.engine.model_files import load_tokenizer
            from proto_server.engine.vllm import discover, tokenizer_source

            urls = list(settings.engine_urls)
            for number in range(1, settings.engines + 1) if not urls else ():
                started = started_engine(settings, progress, number)
                urls.append(await stack.enter_async_context(started))
            url = urls[0]
            model = await discover(url, None)
            tokenizer = load_tokenizer(tokenizer_source(model, None)).tokenizer

            def count(text: str) -> int:
                return len(tokenizer.encode(text, add_special_tokens=False))

            paths: tuple[str, ...] = (PROTOTYPE, LAUNCHED, STATELESS, CHAT)
            if settings.thunderagent_url:
                paths += (PROGRAMS,)
            name = model.name
            # proto-server's paths without admission (on by default in front of vLLM)
            process, proto_url = await start_proto_server(
                url, settings.answer_tokens, ["--no-kv-capacity-from-engine"]
            )
            stack.push_async_callback(_stop, process)
            # the engine this run started schedules by priority (none given: arrival order)
            admitting = ["--kv-capacity-from-engine"]
            if not settings.engine_urls:
                admitting.append("--engine-priority")
            engines = [
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=each.removesuffix("/v1"), timeout=30)
                )
                for each in urls
            ]
            if len(urls) > 1:  # the launched path again, through one server in front of all
                others = [flag for each in urls[1:] for flag in ("--engine-url", each)]
                front, spread_url = await start_proto_server(url, settings.answer_tokens, others)
                stack.push_async_callback(_stop, front)
                spread = LAUNCHED + SPREAD.format(len(urls))
        else:
            from proto_server.core.tokenizer import o200k_base

            encoding = o200k_base()

            def count(text: str) -> int:
                return len(encoding.encode_ordinary(text))

            paths, name, url, engines = (PROTOTYPE, LAUNCHED), "proto-sim", "", []
            flags = ["--prefill-rate", str(settings.prefill_rate)]
            admitting = []
            if settings.gpu_blocks is not None:  # the simulated GPU's cache, as bounded
                tokens = str(settings.gpu_blocks * BLOCK_SIZE)
                flags += ["--prefix-cache-tokens", tokens]
                admitting = ["--kv-capacity-tokens", tokens]
            process, proto_url = await start_serve(flags)
            stack.push_async_callback(_stop, process)
        admitted_url = ""
        if settings.admission_ttl_s is not None:
            admitting += ["--admission-ttl", f"{settings.admission_ttl_s:g}"]
        if settings.admission_ttl_median is not None:
            admitting += ["--admission-ttl-median", f"{settings.admission_ttl_median:g}"]
        if settings.kv_target_fill is not None:
            admitting += ["--kv-target-fill", f"{settings.kv_target_fill:g}"]
        if settings.admission_growth is not None:
            admitting += ["--admission-growth", f"{settings.admission_growth:g}"]
        if settings.admission_overflow is not None:
            admitting.append(("--" if settings.admission_overflow else "--no-") +
                             "admission-overflow")  # fmt: skip
        if settings.admission_workers > 1:  # they share the engine's room through the file
            shared = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "store.sqlite3"
            admitting += ["--workers", str(settings.admission_workers), "--store", str(shared)]
        if settings.admits != "off":
            if settings.engine == "vllm":
                admitter, admitted_url = await start_proto_server(
                    url, settings.answer_tokens, admitting
                )
            else:
                admitter, admitted_url = await start_serve([*flags, *admitting])
            stack.push_async_callback(_stop, admitter)
            ours = tuple(p for p in paths if p in (PROTOTYPE, LAUNCHED))
            admitted = tuple(p + ADMITTED for p in ours)
            if settings.admits == "on":
                paths = (*admitted, *paths[len(ours) :])
            else:  # side by side: each of ours, then the same with admission
                paths = (*(p for pair in zip(ours, admitted, strict=True) for p in pair),
                         *paths[len(ours) :])  # fmt: skip
        if spread:  # after the launched paths on one engine, for the side-by-side
            last = max(i for i, p in enumerate(paths) if p.startswith(LAUNCHED))
            paths = (*paths[: last + 1], spread, *paths[last + 1 :])
        agents = make_agents(settings, count, nonce)
        programs = settings.thunderagent_url.rstrip("/").removesuffix("/v1")
        target = Target(proto_url, url, name, settings.answer_tokens, admitted_url,
                        spread_url, spread, programs and programs + "/v1")  # fmt: skip
        runs = []
        for index, path in enumerate(paths, 1):
            progress(f"[{index}/{len(paths)}] {path}: {settings.traffic.describe(len(agents))}")
            counted = engines if path == spread else engines[:1]
            runs.append(await run_path(path, target, agents, nonce, counted, progress))
    return report(settings, agents, runs, count)


async def _stop(process: trio.Process) -> None:
    process.terminate()
    with trio.move_on_after(30):
        await process.wait()


def main(settings: AgentsSettings) -> int:
    """The command: the run, its table on stdout, its files; 1 when a path failed."""
    problems = settings.problems()
    needs_engine = settings.engine == "vllm" and not settings.engine_urls
    if needs_engine and not Path(engine_python(settings)).exists():
        problems.append(f"no vLLM environment at {engine_python(settings)}; pass --vllm-python "
                        "(or set PROTO_SERVER_VLLM_PYTHON), or --engine-url")  # fmt: skip
    if problems:
        for problem in problems:
            print(f"proto-server bench agents: {problem}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    data = trio.run(run_agents, settings, progress)
    print(render(data))
    plots = write_files(data, settings.out_dir)
    print(f"\nSaved {settings.out_dir / 'agents.json'}")
    print(plots if isinstance(plots, str) else "Plots: " + ", ".join(map(str, plots)))
    return 1 if any(p["failed"] for p in data["paths"]) else 0
