"""The published schema, held to everything the servers in a test send.

`conftest.py` installs a `SchemaNet` around every test: each event a server in this process
frames (WebSocket and SSE: what the writer hands each transport), each JSON body it answers over
HTTP (Responses, stored ones, compactions) and each error body is validated against the Open
Responses document (`proto_server.testing.schema`). As they leave it only keeps them (validating
on the event loop would slow the server the tests time); at teardown it validates them all and
fails the test naming each violation. It covers what real clients (Codex, the SDKs) receive as
much as what this suite's own clients do.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import pytest

from proto_server.server.dialects import routes
from proto_server.server.listener import app
from proto_server.server.transport import connection, http, sse
from proto_server.testing.schema import Transport, wire_schema

#: What the net quotes of one violation; the first few of a test are shown.
SHOWN = 5


class SchemaNet:
    def __init__(self) -> None:
        self.schema = wire_schema()
        self.violations: list[str] = []
        #: What was sent and not yet validated: (transport or HTTP path, status, text, method).
        self.sent: list[tuple[str, int, str | bytes, str]] = []
        self.checked: Counter[str] = Counter()

    def event(self, text: str, transport: Transport) -> None:
        self.sent.append((transport, 0, text, ""))

    def body(self, path: str, status: int, body: bytes, method: str = "GET") -> None:
        self.sent.append((path or "error", status, body, method))

    def validate(self) -> list[str]:
        """Validate what was sent since the last call; the violations found so far."""
        sent, self.sent = self.sent, []
        for where, status, text, method in sent:
            obj = orjson.loads(text)
            if where in ("websocket", "sse"):
                self.checked[where] += 1
                transport: Transport = "sse" if where == "sse" else "websocket"
                errors = self.schema.event_errors(obj, transport=transport)
            else:
                self.checked["http"] += 1
                errors = self.schema.body_errors(where, status, obj, method)
            shown = text if isinstance(text, str) else text.decode()
            self._record(errors, shown)
        return self.violations

    def _record(self, errors: list[str], sent: str) -> None:
        if errors:
            shown = sent if len(sent) <= 400 else sent[:399] + "…"
            self.violations.append(f"{'; '.join(errors[:3])}\n    sent: {shown}")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        add_frame = connection.WebSocketTransport.add
        add_block = sse.SSETransport.add
        exchange_json = routes.Exchange._json
        error_body = http.error_body

        def websocket_event(transport: Any, event: Any, payload: bytes) -> int:
            self.event(payload.decode(), "websocket")  # a copy: orjson's bytes hold 4 KiB each
            return add_frame(transport, event, payload)

        def sse_event(transport: Any, event: Any, payload: bytes) -> int:
            self.event(payload.decode(), "sse")
            return add_block(transport, event, payload)

        async def json_body(exchange: Any, status: int, body: Any) -> int:
            if exchange.path.startswith("/v1/"):
                self.body(exchange.path, status, orjson.dumps(body), exchange.method)
            return await exchange_json(exchange, status, body)  # type: ignore[no-any-return]

        def checked_error_body(error: Any) -> bytes:
            body = error_body(error)
            self.body("", error.status, body)
            return body

        monkeypatch.setattr(connection.WebSocketTransport, "add", websocket_event)
        monkeypatch.setattr(sse.SSETransport, "add", sse_event)
        monkeypatch.setattr(routes.Exchange, "_json", json_body)
        monkeypatch.setattr(http, "error_body", checked_error_body)
        monkeypatch.setattr(app, "error_body", checked_error_body)

    def verdict(self) -> None:
        if self.validate():
            listed = "\n".join(f"- {v}" for v in self.violations[:SHOWN])
            more = len(self.violations) - SHOWN
            tail = f"\n... and {more} more" if more > 0 else ""
            pytest.fail(
                f"{len(self.violations)} things the server sent fail the published schema:\n"
                f"{listed}{tail}",
                pytrace=False,
            )
