"""The simulated GPU seen from the tests: a conversation to serve, one segment's chunks with the
virtual time of each, and a generator that keeps the sessions it opens."""

from __future__ import annotations

import math

import trio
import trio.testing

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.engine.chunks import Chunk, SegmentEnd
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.simulated import SimulatedGenerator, SimulatedSession
from proto_server.wire.converter import converter
from proto_server.wire.items import Message
from proto_server.wire.tools import Tool

from .frames import EXEC_COMMAND


def conversation() -> Conversation:
    tools: tuple[Tool, ...] = (converter.structure(EXEC_COMMAND, Tool),)  # type: ignore[arg-type]
    conv = Conversation(O200kRenderer(), instructions="You fix bugs.", tools=tools)
    conv.extend([Message(role="user", content="fix it")])
    return conv


async def run_segment(session: SimulatedSession) -> list[tuple[float, Chunk]]:
    """Every chunk of one segment, with the virtual time it arrived."""
    timeline: list[tuple[float, Chunk]] = []
    send, receive = trio.open_memory_channel[Chunk](math.inf)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.generate, send, GenerationLimits())
        async for chunk in receive:
            timeline.append((trio.current_time(), chunk))
            if isinstance(chunk, SegmentEnd):
                break
    return timeline


class RecordingGenerator:
    """Wraps a generator and keeps every session it opens, to check they were all closed."""

    forces_tool_calls = True

    def __init__(self, inner: SimulatedGenerator) -> None:
        self.inner = inner
        self.sessions: list[SimulatedSession] = []

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> SimulatedSession:
        session = self.inner.open_session(conversation, cache_salt=cache_salt)
        self.sessions.append(session)
        return session
