"""How a store fails: at start-up (`StoreError`), on a call (`StoreUnavailable`, with what
the call could not do), or fenced off by another connection (`SuspensionLost`)."""

from __future__ import annotations

from proto_server.wire.errors import ServerFault


class StoreError(Exception):
    """The store could not be opened at start-up (a database that does not answer, a schema
    from a newer server): the server does not start."""


class StoreUnavailable(ServerFault):
    """The store failed or did not answer within its timeout (locked, full, gone)."""

    status = 503

    def __init__(self, message: str) -> None:
        super().__init__("store_unavailable", message)


class SuspensionLost(ServerFault):
    """Another connection claimed this suspended Response (resumed it by id) after this one
    last wrote it: this copy is fenced off, and what it did is not stored."""

    status = 409

    def __init__(self, response_id: str) -> None:
        super().__init__(
            "response_resumed_elsewhere",
            f"Response {response_id} was resumed by id on another connection; this copy of it "
            "ends here and is not stored.",
        )


#: What a failed call of any store could not do, as its `StoreUnavailable` says.
PUT_FAILED = "the response could not be stored; retry, or send it with store: false"
SUSPEND_FAILED = "the suspension could not be stored (it stays resumable on this connection only)"


def resume_failed(response_id: str) -> str:
    return f"suspended response {response_id!r} could not be looked up or claimed; retry shortly"


#: A process's load could not be published or the others' read (shared admission).
LOADS_FAILED = (
    "the other server processes' loads could not be read; this one admits by their last known"
)
ITEMS_FAILED = "the referenced items could not be looked up; retry shortly, or send the items"


def delete_failed(response_id: str) -> str:
    return f"response {response_id!r} could not be deleted; retry shortly"


def get_failed(response_id: str) -> str:
    return f"response {response_id!r} could not be looked up; retry shortly"


def chain_failed(response_id: str) -> str:
    return (
        f"previous response {response_id!r} could not be looked up; retry shortly, or resend "
        "the full history without previous_response_id"
    )
