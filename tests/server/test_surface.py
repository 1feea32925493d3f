"""The rest of the Responses surface: `item_reference` input items resolved (from the chain, the
connection's cache or the owner's stored responses) or refused naming the id; a tool output
answering no call fails its turn as OpenAI's does (and evicts on the WebSocket); input items
listed as OpenAI pages them; responses deleted; input tokens counted; models listed. Driven by
the real openai-python where it has the call."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from openai import OpenAI

from proto_server.core.compaction import CompactionKey, compact
from proto_server.core.conversation import Conversation
from proto_server.core.paging import MAX_LIMIT, page, parse_page_query
from proto_server.core.request import check_tool_outputs
from proto_server.engine.chat_template import ChatTemplateRenderer
from proto_server.engine.default_model import DefaultModel
from proto_server.engine.simulated import SimulatedGenerator, SimulatedSession
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.wire.errors import ProtocolError
from proto_server.wire.items import CustomToolCallOutput, FunctionCall, FunctionCallOutput, Message

from ..support.clients import connect, in_thread, turn
from ..support.frames import answers, body, launched_create
from ..support.requirements import MODEL_EXTRA, require
from ..support.servers import FAST, Running, StartServer

K1 = {"Authorization": "Bearer k1"}
K2 = {"Authorization": "Bearer k2"}


def client(running: Running, key: str = "sk-test") -> OpenAI:
    return OpenAI(base_url=running.address.http_url, api_key=key, max_retries=0)


def text_of(item: dict[str, Any]) -> str:
    content = item["content"]
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


# -- input items, paged ------------------------------------------------------------------------


def list_two_turns(running: Running) -> dict[str, Any]:
    api = client(running)
    first = api.responses.create(model="m", input="first question", store=True)
    second = api.responses.create(
        model="m", input="second question", previous_response_id=first.id, store=True
    )
    listed = api.responses.input_items.list(second.id)
    page = api.responses.input_items.list(second.id, limit=1, order="asc")
    walked = [item.id for item in api.responses.input_items.list(second.id, limit=1)]
    after = api.responses.input_items.list(second.id, order="asc", after=page.data[0].id)
    return {
        "first": first,
        "second": second,
        "listed": listed,
        "page": page,
        "walked": walked,
        "after": after,
    }


async def test_input_items_are_what_the_response_was_given_paged_as_openai_pages_them(
    start_server: StartServer,
) -> None:
    running = await start_server(store=None)
    with trio.fail_after(30):
        got = await in_thread(list_two_turns, running)
    first, listed = got["first"], got["listed"]
    # newest first by default: its own input, then the chain it continued (input and output)
    assert [item.type for item in listed.data] == ["message"] * 3
    assert [item.role for item in listed.data] == ["user", "assistant", "user"]
    assert listed.data[0].content[0].text == "second question"  # as OpenAI lists it: parts
    assert all(item.status == "completed" for item in listed.data)
    assert listed.data[1].id == first.output[0].id
    assert all(item.id and item.id.startswith("msg_") for item in listed.data)
    assert (listed.first_id, listed.last_id) == (listed.data[0].id, listed.data[-1].id)
    assert listed.has_more is False
    page = got["page"]
    assert [item.id for item in page.data] == [listed.data[-1].id] and page.has_more is True
    # the SDK's auto-paging follows `after` to the end: every item once, in order
    assert got["walked"] == [item.id for item in listed.data]
    assert [item.id for item in got["after"].data] == [i.id for i in reversed(listed.data)][1:]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=ten", "limit"),
        ("order=newest", "order"),
        ("after=msg_nowhere", "after"),
        ("include[]=everything", "include"),
    ],
)
async def test_a_bad_page_query_is_a_400_naming_the_parameter(
    start_server: StartServer, query: str, param: str
) -> None:
    running = await start_server()
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http:
            created = (await http.post(url, json=body(store=True, tools=[]))).json()
            good = await http.get(
                f"{url}/{created['id']}/input_items?include[]=reasoning.encrypted_content"
            )
            bad = await http.get(f"{url}/{created['id']}/input_items?{query}")
            missing = await http.get(f"{url}/resp_nowhere/input_items")
    assert good.status_code == 200 and good.json()["object"] == "list"
    assert bad.status_code == 400
    assert (bad.json()["error"]["code"], bad.json()["error"]["param"]) == ("invalid_field", param)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"


# -- delete --------------------------------------------------------------------------------------


async def test_a_deleted_response_is_gone_and_a_chain_through_it_breaks(
    start_server: StartServer,
) -> None:
    running = await start_server(api_keys=("k1", "k2"))
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(20):
        async with httpx.AsyncClient() as http:
            first = (await http.post(url, json=body(store=True, tools=[]), headers=K1)).json()
            second = await http.post(
                url, json=body(store=True, tools=[], previous_response_id=first["id"]), headers=K1
            )
            by_other = await http.delete(f"{url}/{first['id']}", headers=K2)
            assert by_other.status_code == 404  # another key's: as if absent, and kept
            assert (await http.get(f"{url}/{first['id']}", headers=K1)).status_code == 200

            api = client(running, "k1")
            assert await in_thread(api.responses.delete, first["id"]) is None
            with pytest.raises(openai.NotFoundError):
                await in_thread(api.responses.retrieve, first["id"])
            with pytest.raises(openai.NotFoundError):
                await in_thread(api.responses.delete, first["id"])
            again = await http.delete(f"{url}/{first['id']}", headers=K1)
            continued = await http.post(
                url,
                json=body(store=True, tools=[], previous_response_id=second.json()["id"]),
                headers=K1,
            )
            direct = await http.delete(f"{url}/{second.json()['id']}", headers=K1)
    assert again.json()["error"]["code"] == "response_not_found"
    # the later response is still stored, but its chain lost a link: it cannot be continued
    assert continued.status_code == 400
    assert continued.json()["error"]["code"] == "previous_response_not_found"
    assert direct.json() == {"id": second.json()["id"], "object": "response", "deleted": True}


# -- input tokens ---------------------------------------------------------------------------------


def count_and_create(running: Running) -> tuple[int, int, int, int]:
    api = client(running)
    asked = dict(model="m", instructions="Be brief.", input="how many tokens is this?")
    counted = api.responses.input_tokens.count(**asked)  # type: ignore[arg-type]
    assert counted.object == "response.input_tokens"
    created = api.responses.create(**asked, store=True)  # type: ignore[arg-type]
    follow = dict(model="m", previous_response_id=created.id, input="and this?")
    counted_next = api.responses.input_tokens.count(**follow)  # type: ignore[arg-type]
    created_next = api.responses.create(**follow, store=True)  # type: ignore[arg-type]
    assert created.usage is not None and created_next.usage is not None
    return (
        counted.input_tokens,
        created.usage.input_tokens,
        counted_next.input_tokens,
        created_next.usage.input_tokens,
    )


async def test_input_tokens_are_the_prompt_tokens_a_create_is_served_with(
    start_server: StartServer,
) -> None:
    running = await start_server()
    with trio.fail_after(30):
        counted, served, counted_next, served_next = await in_thread(count_and_create, running)
    assert counted == served > 0
    assert counted_next == served_next > served  # with the chain it continues


async def test_input_tokens_refuse_what_a_create_refuses(start_server: StartServer) -> None:
    running = await start_server()
    url = f"{running.address.http_url}/responses/input_tokens"
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http:
            unknown = await http.post(url, json=body(previous_response_id="resp_nowhere"))
            bad_choice = await http.post(url, json=body(tools=[], tool_choice="required"))
            not_json = await http.post(url, content=b"{")
    assert unknown.json()["error"]["code"] == "previous_response_not_found"
    assert bad_choice.status_code == 400 and bad_choice.json()["error"]["param"] == "tool_choice"
    assert not_json.status_code == 400


# -- item_reference -------------------------------------------------------------------------------


class Recording:
    """The default model, keeping each conversation it is asked to continue."""

    forces_tool_calls = True
    renderer = None

    def __init__(self) -> None:
        self.inner = SimulatedGenerator(DefaultModel(), FAST)
        self.conversations: list[Conversation] = []

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> SimulatedSession:
        self.conversations.append(conversation)
        return self.inner.open_session(conversation, cache_salt=cache_salt)


@pytest.mark.model  # a tokenizer of transformers' (the model extra)
async def test_a_referenced_reply_is_what_the_chat_template_renders(
    nursery: trio.Nursery,
) -> None:
    require("transformers", MODEL_EXTRA)
    from ..support.tinymodel import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    generator = Recording()
    server = ProtoServer(generator, ServerConfig(port=0), renderer=ChatTemplateRenderer(tokenizer))
    running = Running(server, await nursery.start(server.serve))
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(20):
        async with httpx.AsyncClient() as http:
            first = (await http.post(url, json=body(store=True, tools=[], input="say 42"))).json()
            reply = first["output"][0]
            history = [
                {"type": "message", "role": "user", "content": "say 42"},
                {"type": "item_reference", "id": reply["id"]},
                {"type": "message", "role": "user", "content": "again"},
            ]
            # as the Vercel AI SDK sends a history with store: true: no previous_response_id
            referenced = await http.post(url, json=body(store=True, tools=[], input=history))
            inline = [history[0], reply, history[2]]
            counted = await http.post(f"{url}/input_tokens", json=body(tools=[], input=history))
            counted_inline = await http.post(
                f"{url}/input_tokens", json=body(tools=[], input=inline)
            )
    assert referenced.status_code == 200, referenced.text
    prompt = tokenizer.decode(list(generator.conversations[-1].tokens))
    assert text_of(reply) in prompt.split("<|im_start|>assistant\n")[1]
    # the reference renders exactly as the item itself would, and as the create rendered it
    assert counted.json()["input_tokens"] == counted_inline.json()["input_tokens"]
    generation_prompt = ChatTemplateRenderer(tokenizer).generation_prompt
    served = referenced.json()["usage"]["input_tokens"]  # the simulated engine adds none
    assert counted.json()["input_tokens"] == served + len(generation_prompt)


async def test_an_unknown_or_another_keys_reference_is_a_400_naming_it(
    start_server: StartServer,
) -> None:
    running = await start_server(api_keys=("k1", "k2"))
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(20):
        async with httpx.AsyncClient() as http:
            mine = (await http.post(url, json=body(store=True, tools=[]), headers=K1)).json()
            reply_id = mine["output"][0]["id"]
            user = {"type": "message", "role": "user", "content": "hi"}
            answers_ = []
            for key, named in [(K1, "msg_nowhere"), (K2, reply_id), (K1, reply_id)]:
                refs = [user, {"type": "item_reference", "id": named}]
                answers_.append(await http.post(url, json=body(tools=[], input=refs), headers=key))
            stream = await http.post(
                url,
                json=body(tools=[], stream=True, input=[user, {"type": "item_reference"}]),
                headers=K1,
            )
    nowhere, others, own = answers_
    for refused, named in [(nowhere, "msg_nowhere"), (others, reply_id)]:
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error", "item_not_found", "input[1]",
        )  # fmt: skip
        assert named in error["message"]
    assert own.status_code == 200 and own.json()["status"] == "completed"
    # refused before the stream begins: a JSON 400, not an event stream
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "input[1].id"


async def test_a_reference_is_resolved_from_the_connections_cache_with_store_false(
    start_server: StartServer,
) -> None:
    running = await start_server()
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as ws:
            events = await turn(ws, launched_create(tools=[]))
            first = events[-1]["response"]
            reply = first["output"][0]
            refs = [{"type": "item_reference", "id": reply["id"]}]
            chained = await turn(
                ws, launched_create(tools=[], previous_response_id=first["id"], input=refs)
            )
            fresh = await turn(ws, launched_create(tools=[], input=refs))
    assert chained[-1]["type"] == "response.completed"
    # without the chain, and stored nowhere: nothing to resolve it from
    assert fresh[-1]["type"] == "error" and fresh[-1]["error"]["code"] == "item_not_found"
    assert [t.source for t in running.server.responses.turns] == ["fresh", "cache"]


# -- a tool output that answers no call -------------------------------------------------------


NO_CALL = "No tool call found for function call output with call_id call_nope."


async def test_an_output_answering_no_call_is_a_400_over_http(start_server: StartServer) -> None:
    running = await start_server()
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(20):
        async with httpx.AsyncClient() as http:
            first = (await http.post(url, json=body(store=True))).json()
            calls = [{"type": "response.output_item.done", "item": i} for i in first["output"]]
            outputs = answers(calls)
            stray = {"type": "function_call_output", "call_id": "call_nope", "output": "?"}
            refused = await http.post(
                url,
                json=body(store=True, previous_response_id=first["id"], input=[*outputs, stray]),
            )
            streamed = await http.post(
                url, json=body(stream=True, previous_response_id=first["id"], input=[stray])
            )
            whole = await http.post(url, json=body(input=[*outputs, stray]))  # calls not sent
            answered = await http.post(
                url, json=body(store=True, previous_response_id=first["id"], input=outputs)
            )
    error = refused.json()["error"]
    assert refused.status_code == 400
    assert (error["code"], error["message"], error["param"]) == (
        "unknown_call_id", NO_CALL, f"input[{len(outputs)}]",
    )  # fmt: skip
    assert streamed.status_code == 400 and streamed.json()["error"]["message"] == NO_CALL
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "input[0]"
    assert answered.status_code == 200 and answered.json()["status"] == "completed"


async def test_a_failed_continuation_on_the_socket_evicts_what_it_continued(
    start_server: StartServer,
) -> None:
    running = await start_server()
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as ws:
            events = await turn(ws, launched_create())
            first = events[-1]["response"]["id"]
            stray = [{"type": "function_call_output", "call_id": "call_nope", "output": "?"}]
            failed = await turn(ws, launched_create(previous_response_id=first, input=stray))
            retried = await turn(
                ws, launched_create(previous_response_id=first, input=answers(events))
            )
    assert failed[-1]["type"] == "error" and failed[-1]["status"] == 400
    assert (failed[-1]["error"]["code"], failed[-1]["error"]["message"]) == (
        "unknown_call_id", NO_CALL,
    )  # fmt: skip
    # as OpenAI's: the previous response is gone from the connection's cache (store: false)
    assert retried[-1]["type"] == "error"
    assert retried[-1]["error"]["code"] == "previous_response_not_found"


# -- models ---------------------------------------------------------------------------------------


class ListingEngine(Recording):
    """The default model behind an engine that lists models of its own, as vLLM does."""

    def __init__(self, models: list[dict[str, Any]] | None) -> None:
        super().__init__()
        self.models = models

    async def engine_models(self) -> list[dict[str, Any]] | None:
        return self.models


async def test_models_are_the_engines_when_it_lists_them(nursery: trio.Nursery) -> None:
    listed = [
        {"id": "org/base", "object": "model", "owned_by": "vllm", "max_model_len": 2048},
        {"id": "adapter", "object": "model", "owned_by": "vllm", "parent": "org/base"},
    ]
    engine = ListingEngine(listed)
    server = ProtoServer(engine, ServerConfig(port=0, default_model="org/base"))
    running = Running(server, await nursery.start(server.serve))
    url = f"{running.address.http_url}/models"
    with trio.fail_after(20):
        models = await in_thread(lambda: list(client(running).models.list()))
        async with httpx.AsyncClient() as http:
            one = await http.get(f"{url}/org/base")
            nowhere = await http.get(f"{url}/other")
            engine.models = None
            down = await http.get(url)
    assert [model.id for model in models] == ["org/base", "adapter"]
    assert one.json() == listed[0]
    assert (
        nowhere.status_code == 404 and "'org/base', 'adapter'" in nowhere.json()["error"]["message"]
    )
    assert down.status_code == 503 and down.json()["error"]["code"] == "engine_unavailable"


async def test_the_prototype_dialect_refuses_an_output_answering_no_call_too(
    start_server: StartServer,
) -> None:
    running = await start_server()
    stray = {"type": "function_call_output", "call_id": "call_nope", "output": "?"}
    user = {"type": "message", "role": "user", "content": "hi"}
    with trio.fail_after(20):
        async with connect(running.prototype_url) as ws:
            refused = await turn(ws, launched_create(input=[user, stray]))
            served = await turn(ws, launched_create(tools=[], input=[user]))
    assert refused[-1]["type"] == "error"
    assert (refused[-1]["error"]["code"], refused[-1]["error"]["param"]) == (
        "unknown_call_id", "input[1]",
    )  # fmt: skip
    assert served[-1]["type"] == "response.completed"  # the connection lives on


# -- the pure pieces ------------------------------------------------------------------------------


@given(
    count=st.integers(0, 250),
    limit=st.integers(1, MAX_LIMIT),
    order=st.sampled_from(["asc", "desc"]),
)
def test_following_after_walks_every_item_once_in_order(count: int, limit: int, order: str) -> None:
    items = [{"id": f"msg_{i}"} for i in range(count)]
    seen: list[str] = []
    after = ""
    for _ in range(count + 1):  # bounded: one page at least per item, and the empty one
        query = parse_page_query(
            f"limit={limit}&order={order}" + (f"&after={after}" if after else "")
        )
        listed = page(items, query)
        seen += [item["id"] for item in listed["data"]]
        assert len(listed["data"]) <= limit
        if not listed["has_more"]:
            break
        after = listed["last_id"]
    expected = [item["id"] for item in items]
    assert seen == (expected if order == "asc" else expected[::-1])


def test_a_tool_output_needs_a_call_before_it_unless_a_compaction_hides_it() -> None:
    call = FunctionCall(call_id="call_1", name="f", arguments="{}")
    output = FunctionCallOutput(call_id="call_1", output="ok")
    check_tool_outputs([call], [output])  # the call in the history
    check_tool_outputs([], [call, output])  # or earlier in the input
    with pytest.raises(ProtocolError) as refused:
        check_tool_outputs([], [output, call])  # after it: OpenAI reads the input in order
    assert refused.value.detail.param == "input[0]"
    hidden = compact([Message(role="user", content="hi"), call], CompactionKey(b"k" * 32))[0]
    check_tool_outputs([*hidden], [output])  # the call was summarized away: not refused
    custom = CustomToolCallOutput(call_id="call_2", output="ok")
    with pytest.raises(ProtocolError, match="custom tool call output with call_id call_2"):
        check_tool_outputs([call], [custom])
