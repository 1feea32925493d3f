"""Where a Response is built: a create checked, a rollout opened, its sampling loop made.

The server makes one `Responses` and hands it to every dialect (`prototype.py`, `launched.py`)
and to every HTTP exchange (`http.py`); none of them knows the server, which keeps to the
listener, the handshake and shutdown (`app.py`). So a dialect can be driven without a socket:
a `Responses`, a connection's lanes as channels, and events in.
"""

from __future__ import annotations

import collections
import secrets
import time
from collections.abc import Callable, Sequence
from functools import partial

import attrs
import trio

from proto_server.core.compaction import CompactionKey
from proto_server.core.conversation import TOKEN_BYTES, Conversation
from proto_server.core.ids import new_id
from proto_server.core.reasoning import ENCRYPTED_CONTENT, ReasoningSealer, replayed
from proto_server.core.references import (
    Expansion,
    check_expansion,
    expansion,
    find_in,
    references,
    resolve,
)
from proto_server.core.render import O200kRenderer, Renderer, requested_effort
from proto_server.core.request import (
    ROLLOUT_ID,
    PreparedInput,
    check_tool_outputs,
    compact_turn,
    compaction_threshold,
    input_items,
    is_warmup,
    prepare_input,
    response_template,
    rollout_id,
    wants_logprobs,
    wants_token_ids,
)
from proto_server.core.response import Mode, ResponseMachine
from proto_server.engine.base import TokenGenerator
from proto_server.engine.model_renderer import ModelRenderer
from proto_server.server.process import metrics
from proto_server.server.process.auth import Tenants
from proto_server.server.process.config import ServerConfig
from proto_server.server.process.logs import log
from proto_server.server.process.memory import PREPARING_FACTOR, MemoryBudget
from proto_server.server.process.observe import ServerObserver
from proto_server.server.process.offload import INLINE_BYTES, Offload
from proto_server.server.rollouts.admission import admission_for
from proto_server.server.rollouts.appending import prepare_append
from proto_server.server.rollouts.background import Background
from proto_server.server.rollouts.checks import check_servable, compiles_schema, servable_bytes
from proto_server.server.rollouts.inflight import InFlight
from proto_server.server.rollouts.kept import Detached, KeptEvents
from proto_server.server.rollouts.pausing import PauseGate
from proto_server.server.rollouts.resume import Durable, claim, claimable, rebuild, restored
from proto_server.server.rollouts.rollout import Rollout
from proto_server.server.rollouts.sampling import LoopSettings, SamplingLoop
from proto_server.server.rollouts.storing import persister
from proto_server.server.rollouts.suspension import Suspensions
from proto_server.server.rollouts.turns import TurnRecord, TurnSource, TurnStart
from proto_server.server.store import ANONYMOUS, ResponseStore, SQLiteStore
from proto_server.server.transport.outbox import EventSink
from proto_server.wire.events import ResponseAppend, ResponseCreate
from proto_server.wire.items import Item


class Responses:
    """What building a rollout and a Response takes, kept once for the whole process: the
    settings, the generator and its renderer, the store, the compaction key, the budgets, the
    cap on suspensions, the worker threads, and whoever measures.

    `generator`, `config` and `observer` may be replaced between Responses (the benchmark does);
    each Response takes what they are when it is built."""

    def __init__(
        self,
        generator: TokenGenerator,
        config: ServerConfig | None = None,
        *,
        renderer: Renderer | None = None,
        store: ResponseStore | None = None,
        compaction_secret: bytes | None = None,
        on_rollout: Callable[[int], None] = lambda _: None,
    ) -> None:
        """`on_rollout`: told +1 when a rollout opens and -1 when it closes (the server waits
        on these to be idle)."""
        self.config = config or ServerConfig()
        self.generator = generator
        #: When this process began serving: the `created` of the model it lists.
        self.started_at = int(time.time())
        self.renderer = renderer or generator.renderer or O200kRenderer()
        # every call timed into the metrics (proto_server_store_seconds)
        self.store = metrics.TimedStore(store or SQLiteStore(":memory:"))
        secret = compaction_secret or secrets.token_bytes(32)
        #: Seals compaction items; without a kept secret they live as long as this process.
        self.compaction_key = CompactionKey(secret)
        #: Who each request is, and its sessions' cache salt (server/process/auth.py).
        self.tenants = Tenants(self.config.api_keys, secret)
        self.suspensions = Suspensions(self.config.max_suspended_rollouts)
        #: Everything the process keeps for its clients, counted (see server/process/memory.py).
        self.memory = MemoryBudget(
            self.config.max_memory_bytes, flag="--max-memory", name="process"
        )
        #: Streamed Responses whose clients went away, kept for a reattach (kept.py).
        self.detached = Detached()
        #: Every running Response by id, for a cancel or a poll (inflight.py).
        self.in_flight = InFlight()
        #: Responses run by the process, not by a connection (background.py).
        self.background = Background(
            self.detached, limit=self.config.max_background, keep_s=self.config.reattach_grace_s
        )
        #: Decodes and renders large requests on worker threads (see server/process/offload.py).
        self.offload = Offload(self.config.prepare_threads)
        #: The most recent Responses' costs, newest last (tests and the benchmark read them).
        self.turns: collections.deque[TurnRecord] = collections.deque(maxlen=10_000)
        #: Told what each request costs, as it happens (the benchmark sets one); None: no cost.
        self.observer: ServerObserver | None = None
        self._on_rollout = on_rollout
        #: Admission by the engine's KV capacity (server/rollouts/admission.py); None: off.
        self.admission = admission_for(self.config, generator)
        #: The gate a trainer's pause closes for a weight update (pausing.py, admin.py).
        self.pause = PauseGate(generator, timeout_s=self.config.pause_timeout_s)

    def keeper(self, owner: str, *, background: bool = False) -> KeptEvents | None:
        """Where a streamed (or `background`) Response's events are kept for a reattach by
        `owner` (None: `--reattach-grace 0` and not in the background, nothing is)."""
        config = self.config
        if config.reattach_grace_s <= 0 and not background:
            return None
        return KeptEvents(owner, limit=config.reattach_keep_bytes, budget=self.memory)

    def connection_budget(self) -> MemoryBudget:
        """The memory budget of one connection, inside the process's."""
        return self.memory.child(
            self.config.max_connection_memory_bytes,
            flag="--max-connection-memory",
            name="connection",
        )

    # -- checks ----------------------------------------------------------------------------------

    def check_create(self, create: ResponseCreate) -> None:
        """Refuse, when it arrives, a create this server cannot serve (`check_servable`)."""
        check_servable(create, self.generator, self.compaction_key)

    async def check(self, create: ResponseCreate, *, size: int) -> int:
        """`servable_bytes` for a create that took `size` bytes on the wire, off the event loop
        when its work grows with more than its size: a `text.format` schema a grammar engine
        compiles (a small schema can cost a tenth of a second to compile, or to bisect for the
        part to blame) runs on a preparation thread, whatever its size."""
        if compiles_schema(create, self.generator):
            size = max(size, INLINE_BYTES + 1)
        key = self.compaction_key
        return await self.offload.run(servable_bytes, create, self.generator, key, size=size)

    # -- rollouts and Responses ------------------------------------------------------------------

    def _new_rollout(
        self,
        create: ResponseCreate,
        budget: MemoryBudget,
        prepared: PreparedInput,
        owner: str,
    ) -> Rollout:
        """A cold rollout: a conversation with only the rendered prefix, a fresh session."""
        conversation = Conversation(
            self.renderer,
            instructions=create.instructions,
            tools=create.tools,
            effort=requested_effort(create.reasoning),
            prefix=prepared.prefix,
            prefix_nbytes=prepared.prefix_nbytes,
        )
        return self._rollout_of(conversation, budget, owner, rollout_id(create))

    def _rollout_of(
        self, conversation: Conversation, budget: MemoryBudget, owner: str, affinity: str | None
    ) -> Rollout:
        """A rollout of `owner`'s on `conversation` (rendered already) with a fresh session:
        nothing warm. `affinity`: the rollout id its client named, if it did."""
        self._on_rollout(1)
        salt = self.tenants.cache_salt(owner)
        return Rollout(
            conversation,
            self.generator.open_session(conversation, cache_salt=salt, affinity=affinity),
            budget=budget,
            on_close=self._rollout_closed,
            owner=owner,
        )

    def _rollout_closed(self, rollout: Rollout) -> None:
        if self.admission is not None:
            self.admission.release(rollout)
        self._on_rollout(-1)

    async def begin(
        self,
        create: ResponseCreate,
        events: EventSink,
        *,
        budget: MemoryBudget,
        source: TurnSource,
        owner: str = ANONYMOUS,
        rollout: Rollout | None = None,
        history: Sequence[Item] = (),
        mode: Mode = Mode.SUCCESSOR,
        response_id: str | None = None,
        size: int = 0,
    ) -> SamplingLoop:
        """A Response for `create`, on a warm `rollout` or on a new one holding `history`.

        Only what is new is rendered: the create's input on a warm rollout; the prefix, the
        history and the input on a cold one. Rendering runs off the event loop when the input
        is large (`size`: the bytes of the request, to which what its references expand to is
        added; each history item counts as 1 KiB). What it adds must fit `budget`, else a
        `ProtocolError` says so and nothing changes (a warm `rollout` stays its caller's to
        close). Stored, it belongs to `owner`. `response_id`: the id a `response.queued`
        already announced; `mode`: see `ResponseMachine`.
        """
        arrived_at = trio.current_time()
        known = rollout.conversation.items if rollout is not None else history
        create, expanded = await self.resolved(create, known, owner, budget, size=size)
        size += expanded.nbytes
        # rendering peaks as decoding does (`proto-server bench memory`): room is held for it
        with self.memory.reserve(PREPARING_FACTOR * size, _what(expanded)):
            prepared = await self.offload.run(
                partial(prepare_input, cold=rollout is None),
                self.renderer,
                create,
                history,
                size=size + 1024 * len(history),
            )
        compaction = None
        discarded = 0  # tokens rendered for a prompt that compaction replaced: work all the same
        threshold = compaction_threshold(create)
        warm = rollout.conversation.token_count if rollout is not None else 0
        if threshold is not None and warm + prepared.tokens > threshold:
            # the prompt is over the client's threshold: served from its compaction, cold
            items = rollout.conversation.items if rollout is not None else prepared.history.items
            discarded = prepared.tokens
            prepared, compaction = await self.offload.run(
                compact_turn,
                self.renderer,
                create,
                [*items, *prepared.input.items],
                self.compaction_key,
                size=size + 1024 * len(items),
            )
            source = TurnSource.COMPACTED
            if rollout is not None:
                await rollout.aclose()  # its state is of a prompt no longer served
                rollout = None
        budget.check(prepared.nbytes, "This request")
        if rollout is None:
            rollout = self._new_rollout(create, budget, prepared, owner)
            rendered_mark = -discarded
            rollout.conversation.extend_rendered(prepared.history)
        else:
            rendered_mark = rollout.conversation.rendered_tokens
        conversation = rollout.conversation
        # a compacted Response stores the history it was served from: a chain restarts there
        first_item = 0 if compaction is not None else len(conversation.items)
        conversation.extend_rendered(prepared.input)
        rollout.account()
        if self.observer is not None:
            self.observer.rendered()
        # echoing a create's tools costs 6 us each: 0.2 s for the 36,000 tools of 4 MB
        response = await self.offload.run(
            partial(
                response_template,
                create,
                response_id=response_id or new_id("resp"),
                created_at=int(time.time()),
                default_model=self.config.default_model,
            ),
            size=size,
        )
        machine = ResponseMachine(
            response=response,
            conversation=conversation,
            mode=mode,
            clock=lambda: int(time.time()),
            compaction=compaction,
            max_pending_steers=self.config.max_pending_steers,
            # as OpenAI's: a Response with automatic compaction is not steered
            steering="unsupported" if create.context_management else None,
            seal=ReasoningSealer(self.compaction_key)
            if ENCRYPTED_CONTENT in (create.include or ())
            else None,
            logprobs=wants_logprobs(create),
            token_ids=wants_token_ids(create),
        )

        durable = None
        # a stored prototype Response outlives its process: its suspensions are stored too
        prototype = mode is Mode.SUSPEND
        if response.store and prototype and self.store.suspensions is not None:
            first_output = len(conversation.items)
            durable = Durable(self.store, owner, response.id, first_output=first_output)
        turn = TurnStart(
            source=source,
            rendered_mark=rendered_mark,
            persist=(
                persister(self.store, self.offload, first_item, owner, durable)
                if response.store
                else None
            ),
            durable=durable,
            arrived_at=arrived_at,
            warmup=is_warmup(create),
        )
        return SamplingLoop(machine, rollout, events, self._loop_settings(), turn)

    async def resolved(
        self,
        create: ResponseCreate,
        history: Sequence[Item],
        owner: str,
        budget: MemoryBudget,
        *,
        size: int,
    ) -> tuple[ResponseCreate, Expansion]:
        """`create` with its `item_reference`s replaced by the items they name (from `history`,
        the conversation it continues, else from what `owner` stored), its tool outputs each
        answering a call of the conversation; refused (400) otherwise, changing nothing. Its
        sealed reasoning items get their text back: the model reads it as it wrote it.

        With what its references expand to, measured and bounded before anything is rendered
        or unsealed: past `--max-message-bytes`, or past what `budget` (the connection's) has
        room for, refused whatever the request's own size. What the store reads to find them is
        bounded by `--max-message-bytes` too, before it is read. Each pass over the items runs
        off the event loop when `size` (the request's bytes) is large."""
        items = input_items(create)
        # each pass below walks every item: a large request's run off the loop
        wanted = await self.offload.run(references, items, size=size)
        expanded = Expansion()
        if wanted:
            found = await self.offload.run(find_in, history, list(wanted), size=size)
            elsewhere = [named for named in wanted if named not in found]
            if elsewhere:
                found |= await self.store.items(
                    elsewhere, owner=owner, max_bytes=self.config.max_message_bytes
                )
            expanded = await self.offload.run(expansion, items, found, size=size)
            check_expansion(expanded, self.config.max_message_bytes)
            budget.check(expanded.nbytes, _what(expanded))  # what its conversation will hold
            items = await self.offload.run(resolve, items, found, size=size)
        unsealed = await self.offload.run(
            self._answering, history, items, size=size + expanded.nbytes
        )
        if unsealed is not items or wanted:
            create = attrs.evolve(create, input=unsealed)
        return create, expanded

    def _answering(self, history: Sequence[Item], items: tuple[Item, ...]) -> tuple[Item, ...]:
        """`items`, each tool output answering a call of `history` (else refused), its sealed
        reasoning items unsealed."""
        check_tool_outputs(history, items)
        return replayed(items, self.compaction_key)

    async def input_tokens(
        self,
        create: ResponseCreate,
        history: Sequence[Item],
        *,
        owner: str,
        budget: MemoryBudget,
        size: int,
    ) -> int:
        """The prompt tokens `create` would be served with on a cold rollout holding `history`:
        rendered as `begin` renders it (references resolved, bounded and charged as `begin`
        bounds and charges them), with the chat template's generation prompt where the model
        has one."""
        create, expanded = await self.resolved(create, history, owner, budget, size=size)
        size += expanded.nbytes
        with self.memory.reserve(PREPARING_FACTOR * size, _what(expanded)):
            prepared = await self.offload.run(
                partial(prepare_input, cold=True),
                self.renderer,
                create,
                history,
                size=size + 1024 * len(history),
            )
        renderer = self.renderer
        prompt = renderer.generation_prompt if isinstance(renderer, ModelRenderer) else ()
        return prepared.tokens + len(prompt)

    async def resume(
        self,
        append: ResponseAppend,
        *,
        owner: str,
        budget: MemoryBudget,
        events: EventSink,
        size: int,
    ) -> SamplingLoop:
        """The suspended Response `append` names, rebuilt from the store and claimed for this
        connection, with `append`'s items committed (it resumes when its loop runs): a fresh
        session on its re-rendered conversation, so its next prefill is cold. Refused with a
        `ProtocolError` that changes nothing: what `claimable` and `claim` refuse, or the
        append's own errors (`unknown_call_id`, `missing_tool_output`, ...)."""
        response_id = append.response_id
        assert response_id is not None
        timeout = self.config.suspend_timeout_s
        found, idle = await claimable(self.store, response_id, owner=owner, timeout_s=timeout)
        conversation, history = await self.offload.run(
            rebuild, self.renderer, found, size=size + 1024 * len(found.items)
        )
        budget.check(
            history.nbytes + TOKEN_BYTES * (len(conversation.tokens) + len(history.tokens)),
            "This resume",
        )
        machine = restored(found, conversation, history)
        rendered = await prepare_append(
            machine, append, generator=self.generator, offload=self.offload, size=size
        )
        durable = await claim(self.store, response_id, found, owner=owner, timeout_s=timeout)
        rollout = self._rollout_of(
            conversation, budget, owner, found.response.metadata.get(ROLLOUT_ID)
        )
        try:
            turn = TurnStart(
                source=TurnSource.STORE,
                rendered_mark=0,  # its whole prompt was rendered again: count it
                persist=persister(self.store, self.offload, 0, owner, durable),
                durable=durable,
                resumed=True,
            )
            loop = SamplingLoop(machine, rollout, events, self._loop_settings(), turn)
            loop.append(append.input, rendered, tool_choice=append.tool_choice)
        except BaseException:  # refused (the append does not fit its budget): nothing is kept
            await durable.release()
            await rollout.aclose()
            raise
        metrics.RESUMES.labels("resumed").inc()
        log.info(
            "response.resumed",
            extra={"response": response_id, "items": len(found.items), "idle_s": round(idle, 3)},
        )
        return loop

    def _loop_settings(self) -> LoopSettings:
        """What this process's sampling loops share: its queue, measures and suspensions."""
        config = self.config
        return LoopSettings(
            chunk_queue=config.chunk_queue,
            suspend_timeout_s=config.suspend_timeout_s,
            engine_priority=config.engine_priority,
            on_end=self._turn_ended,
            observer=self.observer,
            suspensions=self.suspensions,
            admission=self.admission,
            in_flight=self.in_flight,
            pause=self.pause,
        )

    def _turn_ended(self, record: TurnRecord) -> None:
        self.turns.append(record)
        metrics.turn_ended(
            source=record.source,
            rendered=record.rendered_input_tokens,
            prompt=record.prompt_tokens,
            cached=record.cached_tokens,
            prepare_s=record.prepare_s,
            decode_s=record.decode_s,
            first_event_s=record.first_event_s,
        )
        metrics.rendered(self.renderer)


def _what(expanded: Expansion) -> str:
    """A request, as a memory budget's refusal names it: with its references, if any."""
    return f"This request ({expanded})" if expanded.references else "This request"
