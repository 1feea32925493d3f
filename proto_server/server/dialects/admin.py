"""The admin routes: a pause for a weight update, for a trainer, behind a key of its own.

    POST /admin/pause?mode=wait|keep   hold new segments; answers once everything is held
    POST /admin/resume                 let them go; body {"weight_version": "..."} (optional)
    GET  /admin/paused                 where the pause stands

Modelled on vLLM's own (`/pause`, `/resume`, `/is_paused`), which a pause reaches on every
engine replica (server/rollouts/pausing.py). Each answers the pause's status as JSON
(`core/pause.PauseStatus`). The key is `--admin-key` (or PROTO_SERVER_ADMIN_KEY), never a
client's: without it set, these paths answer 404 saying which flag turns them on.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import attrs
import h11
import orjson
import trio

from proto_server.core.pause import PauseMode, PauseRefused
from proto_server.engine.limits import GeneratorError
from proto_server.server.process.logs import log
from proto_server.server.rollouts.responses import Responses
from proto_server.server.transport.http import send_json
from proto_server.wire.errors import ProtocolError, quoted

ADMIN = "/admin"
#: The longest weight-version label: every output item sampled after it carries it.
MAX_WEIGHT_VERSION_CHARS = 256


@attrs.frozen(kw_only=True)
class AdminRequest:
    """An HTTP request to an admin path, as the exchange read its head."""

    method: str
    path: str
    query: str
    authorization: str | None
    #: Reads the body (bounded as every request's is).
    body: Callable[[], Awaitable[bytes]]


def is_admin(path: str) -> bool:
    return path == ADMIN or path.startswith(ADMIN + "/")


async def serve_admin(
    responses: Responses, stream: trio.abc.Stream, conn: h11.Connection, request: AdminRequest
) -> None:
    """Answer one admin request, or raise the `ProtocolError` that refuses it."""
    _authorize(responses.config.admin_key, request.authorization)
    gate = responses.pause
    route = (request.method, request.path)
    try:
        if route == ("GET", "/admin/paused"):
            status = gate.state.status()
        elif route == ("POST", "/admin/pause"):
            mode = _mode(request.query)
            if mode is PauseMode.KEEP and not gate.can_keep():
                raise ProtocolError(
                    "unsupported_pause_mode",
                    "mode=keep needs a generator that can freeze its running segments (the "
                    "simulated GPU, vllm); use mode=wait.",
                    param="mode",
                )
            log.info("admin.pause", extra={"mode": str(mode)})
            status = await gate.pause(mode)
        elif route == ("POST", "/admin/resume"):
            version = _weight_version(await request.body())
            log.info("admin.resume", extra={"weight_version": version})
            status = await gate.resume(version)
        else:
            raise ProtocolError(
                "not_found",
                f"Nothing is served at {request.method} {request.path}. The admin routes are "
                "POST /admin/pause?mode=wait|keep, POST /admin/resume, GET /admin/paused.",
                status=404,
            )
    except PauseRefused as exc:
        raise ProtocolError("pause_conflict", f"{exc}.", status=409) from None
    except GeneratorError as exc:
        raise ProtocolError(
            exc.code, f"The engine refused: {exc}.", error_type="server_error", status=502
        ) from None
    await send_json(stream, conn, 200, orjson.dumps(attrs.asdict(status)))


def _authorize(admin_key: str | None, authorization: str | None) -> None:
    if admin_key is None:
        raise ProtocolError(
            "not_found",
            "The admin routes are off: start the server with --admin-key KEY (or "
            "PROTO_SERVER_ADMIN_KEY=KEY) and send `Authorization: Bearer KEY`.",
            status=404,
        )
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if (
        scheme.lower() != "bearer"
        or not token
        or not hmac.compare_digest(token.encode(), admin_key.encode())
    ):
        raise ProtocolError(
            "invalid_admin_key",
            "Missing or wrong admin key. Send `Authorization: Bearer <key>` with the key the "
            "server was started with (--admin-key or PROTO_SERVER_ADMIN_KEY); a client's API "
            "key is not one.",
            status=401,
        )


def _mode(query: str) -> PauseMode:
    given = parse_qs(query).get("mode", [PauseMode.WAIT.value])[-1]
    try:
        return PauseMode(given)
    except ValueError:
        raise ProtocolError(
            "invalid_field",
            f"mode must be wait or keep, not {quoted(given)}.",
            param="mode",
        ) from None


def _weight_version(body: bytes) -> str | None:
    """The label a resume gives the weights from now on (None: unchanged)."""
    if not body.strip():
        return None
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ProtocolError("invalid_json", "The body is not JSON.") from None
    version = parsed.get("weight_version") if isinstance(parsed, dict) else ...
    if version is ... or (
        version is not None
        and (not isinstance(version, str) or not 0 < len(version) <= MAX_WEIGHT_VERSION_CHARS)
    ):
        raise ProtocolError(
            "invalid_field",
            'The body must be {"weight_version": "<label>"} (or empty), the label 1 to '
            f"{MAX_WEIGHT_VERSION_CHARS} characters: every item sampled after it carries it.",
            param="weight_version",
        )
    return version
