"""Which dialect a WebSocket speaks: the registry, and how a client picks one at its upgrade.

A dialect turns a connection's client events into Responses (`connection.Dialect`). The two
this server speaks are registered here by name; a client picks the prototype by Codex 0.107's
beta header, or any registered dialect by name (`X-Proto-Dialect: NAME` or `?dialect=NAME`);
everything else speaks the launched dialect, as OpenAI's WebSocket mode does. Adding one is a
class and a line here (docs/adding-a-dialect.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from proto_server.server.dialects.lanes import MULTI_AGENT_BETA, beta_values
from proto_server.server.dialects.launched import LaunchedDialect
from proto_server.server.dialects.prototype import PrototypeDialect
from proto_server.wire.errors import ProtocolError, quoted

if TYPE_CHECKING:
    import trio

    from proto_server.server.rollouts.responses import Responses
    from proto_server.server.transport.connection import ClientLanes, Dialect
    from proto_server.server.transport.handshake import RequestHead

#: The beta value that opts into the prototype dialect (what Codex 0.100-0.107 sent).
PROTOTYPE_BETA = "responses_websockets=2026-02-04"
#: What Codex 0.171 sends: the launched dialect.
LAUNCHED_BETA = "responses_websockets=2026-02-06"
#: The dialect of a client that names none.
DEFAULT = "launched"


class DialectFactory(Protocol):
    """How a dialect is made for one connection (a dialect class is one)."""

    def __call__(
        self,
        responses: Responses,
        connection: ClientLanes,
        nursery: trio.Nursery,
        *,
        owner: str,
        multi_agent: bool,
    ) -> Dialect: ...


DIALECTS: dict[str, DialectFactory] = {
    "launched": LaunchedDialect,
    "prototype": PrototypeDialect,
}

#: The dialects whose clients build a Response's output from its `response.output_item.done`
#: events (Codex's parser reads only `id` and `usage` of the terminal one), so a snapshot
#: over `--max-event-bytes` goes without it (`EventBound`); a launched client may read it there.
OUTPUT_FROM_ITEMS = frozenset({"prototype"})


def select_dialect(head: RequestHead) -> str:
    """The registered dialect the upgrade asks for; a `ProtocolError` if it names another.

    Prototype if the client opts in with Codex 0.107's beta header; a dialect named by
    `X-Proto-Dialect` or the query's `dialect=`; else launched: Codex 0.171's `LAUNCHED_BETA`,
    no header, an unknown beta."""
    if PROTOTYPE_BETA in beta_values(head.header(b"openai-beta")):
        return "prototype"
    _, _, query = head.target.partition("?")
    named = [part[len("dialect=") :] for part in query.split("&") if part.startswith("dialect=")]
    if (header := head.header(b"x-proto-dialect")) is not None:
        named.append(header.strip().lower())
    for name in named:
        if name not in DIALECTS:
            raise ProtocolError(
                "bad_request",
                f"No dialect {quoted(name)} is spoken here; name one of {', '.join(DIALECTS)} "
                "(X-Proto-Dialect or ?dialect=), or none for the launched dialect.",
            )
        return name
    return DEFAULT


def multi_agent_beta(head: RequestHead) -> bool:
    """Whether the client opted into the multi-agent beta (`response.inject`)."""
    return MULTI_AGENT_BETA in beta_values(head.header(b"openai-beta"))
