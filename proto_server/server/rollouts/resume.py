"""A suspended prototype Response survives its connection and its process, through the store.

At each suspension, before its `response.done` goes out, a `store: true` Response writes what
rebuilding it takes (`SuspendedResponse`: its settings, output and usage so far, the calls it
waits on, and its conversation's new items) to the store. A client whose connection dropped, or
whose process died, connects again, to any process on that store, and answers the calls with a
`response.append` that names the Response (`response_id`): `Responses.resume`
(responses.py) finds it here (`claimable`), rebuilds it cold (`rebuild`, `restored`: the
prompt rendered and prefilled again: the model's warm state is gone) and claims it (`claim`),
and it goes on with the same id and output indices, on the new connection's sequence numbers.

Exactly once: a resume claims the suspension in the store, one atomic UPDATE on the version it
read, so of several connections racing only one gets it (`response_already_resumed` for the
others); every later write of a Response names the version it holds, so a copy that lost the
suspension to a claim is fenced off (`SuspensionLost`) and stores nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import attrs
import trio

from proto_server.core.conversation import (
    Conversation,
    RenderedItems,
    is_model_item,
    render_items,
)
from proto_server.core.render import Renderer, requested_effort
from proto_server.core.response import ResponseMachine
from proto_server.server.process import metrics
from proto_server.server.process.logs import log
from proto_server.server.store import StoreUnavailable, SuspendedResponse
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.items import Item

if TYPE_CHECKING:
    from proto_server.server.process.metrics import TimedStore


class Durable:
    """One Response's place among the store's suspensions: the version it last wrote or
    claimed (0: none yet), how many of its conversation's items are stored, where its output
    begins in them, and whether it holds a claim (it was resumed and has not suspended since)."""

    def __init__(
        self,
        store: TimedStore,
        owner: str,
        response_id: str,
        *,
        first_output: int,
        version: int = 0,
        written: int = 0,
        claimed: bool = False,
    ) -> None:
        self.store = store
        self.owner = owner
        self.response_id = response_id
        self.first_output = first_output
        self.version = version
        self.written = written
        self.claimed = claimed

    @property
    def ends(self) -> int | None:
        """The suspension version an ending write deletes with it (None: nothing stored)."""
        return self.version or None

    async def suspended(self, machine: ResponseMachine) -> None:
        """Write the suspension `machine` is in; only its new items are sent. A store that
        fails raises `StoreUnavailable`; a copy fenced off raises `SuspensionLost`."""
        conversation = machine.conversation
        items = tuple(conversation.items)
        snapshot = machine.snapshot()
        record = SuspendedResponse(
            # the output is in `items` already (from `first_output` on): not written twice
            response=attrs.evolve(snapshot, output=()),
            items=items,
            first_output=self.first_output,
            instructions=conversation.instructions,
            tools=conversation.tools,
            pending=tuple(machine.pending_calls),
            segments=machine.segments,
            tool_calls=machine.tool_calls,
            owner=self.owner,
            logprobs=machine.logprobs,
            token_ids=machine.token_ids,
        )
        await self.store.suspend(record, since=self.written, expected=self.version)
        self.version += 1
        self.written = len(items)
        self.claimed = False

    async def release(self) -> None:
        """The connection went away before the resumed Response suspended again: let its claim
        go, so the client can resume it once more (from the same suspension)."""
        if not self.claimed:
            return
        self.claimed = False
        with trio.CancelScope(shield=True):  # the store's own --store-timeout bounds it
            try:
                await self.store.release(self.response_id, version=self.version)
                log.debug("response.claim_released", extra={"response": self.response_id})
            except StoreUnavailable as exc:
                why = {"response": self.response_id, "reason": str(exc)}
                log.warning("response.claim_kept", extra=why)


def output_of(suspended: SuspendedResponse) -> tuple[Item, ...]:
    """The output a suspension had: its model's items, from where its output began."""
    return tuple(item for item in suspended.items[suspended.first_output :] if is_model_item(item))


def rebuild(renderer: Renderer, suspended: SuspendedResponse) -> tuple[Conversation, RenderedItems]:
    """A suspension's conversation, its prefix rendered again, and its history rendered (for
    `restored` to append): the cold path, O(history); pure, for a thread."""
    conversation = Conversation(
        renderer,
        instructions=suspended.instructions,
        tools=suspended.tools,
        # the effort is the one its Response echoes (`reasoning`), as it was created with
        effort=requested_effort(suspended.response.reasoning),
    )
    return conversation, render_items(renderer, suspended.items)


def restored(
    suspended: SuspendedResponse, conversation: Conversation, history: RenderedItems
) -> ResponseMachine:
    """The machine of `suspended`, on `conversation` (its prefix rendered) with `history`
    (`rebuild`'s) appended: its output, calls and counts as they were when it suspended."""
    conversation.extend_rendered(history)
    return ResponseMachine.restore(
        response=attrs.evolve(suspended.response, output=output_of(suspended)),
        conversation=conversation,
        pending=suspended.pending,
        segments=suspended.segments,
        tool_calls=suspended.tool_calls,
        clock=lambda: int(time.time()),
        logprobs=suspended.logprobs,
        token_ids=suspended.token_ids,
    )


def _refused(code: str, message: str, status: int = 400) -> ProtocolError:
    metrics.RESUMES.labels(code).inc()
    return ProtocolError(code, message, param="response_id", status=status)


async def claimable(
    store: TimedStore, response_id: str, *, owner: str, timeout_s: float
) -> tuple[SuspendedResponse, float]:
    """The suspension `response_id` names, if `owner` may resume it now, and how long it has
    waited. Refused with a `ProtocolError`: `response_not_found` (never suspended here, another
    key's, or idle past `--suspend-timeout`), `response_already_completed`,
    `response_already_resumed` (another connection holds it), or `store_unavailable` (503)."""
    shown = quoted(response_id)
    if store.suspensions is None:
        raise _refused(
            "response_not_found",
            f"No suspended Response {shown}: this server's store keeps no suspensions.",
        )
    found = await store.suspended(response_id, owner=owner)
    if found is None:
        if await store.get(response_id, owner=owner) is not None:
            raise _refused(
                "response_already_completed",
                f"Response {shown} already ended; nothing can be appended to it. Start a new "
                "one with response.create.",
            )
        raise _refused(
            "response_not_found",
            f"No suspended Response {shown} in the store (never suspended with store: true, "
            "expired, or another key's).",
        )
    # a claim is stamped when it is taken, and lapses after --suspend-timeout: its holder has
    # neither suspended again nor ended (its process died mid-segment), so it may be taken over
    idle = time.time() - found.stored_at
    if found.claimed and idle <= timeout_s:
        raise _refused(
            "response_already_resumed",
            f"Response {shown} was resumed by another connection, which holds it now (a claim "
            f"whose holder goes silent lapses after --suspend-timeout, {timeout_s:g} s).",
            status=409,
        )
    if not found.claimed and idle > timeout_s:
        raise _refused(
            "response_not_found",
            f"Suspended Response {shown} waited {idle:.0f} s, past --suspend-timeout "
            f"({timeout_s:g} s); start a new one with response.create.",
        )
    return found, idle


async def claim(
    store: TimedStore,
    response_id: str,
    suspended: SuspendedResponse,
    *,
    owner: str,
    timeout_s: float,
) -> Durable:
    """Claim `suspended` for this connection, on the version it was read at: exactly one of
    several racing connections gets it, the others are refused `response_already_resumed`."""
    lapsed = time.time() - timeout_s
    version = suspended.version
    if not await store.claim(response_id, owner=owner, version=version, lapsed_before=lapsed):
        raise _refused(
            "response_already_resumed",
            f"Response {quoted(response_id)} was resumed by another connection just now, which "
            "holds it.",
            status=409,
        )
    return Durable(
        store, owner, response_id, first_output=suspended.first_output, version=version + 1,
        written=len(suspended.items), claimed=True,
    )  # fmt: skip
