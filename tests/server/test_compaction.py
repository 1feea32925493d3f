"""Compaction items are sealed: a client carries them, it cannot forge or alter them, and a
restarted server still reads the ones it handed out."""

from __future__ import annotations

import base64
import os
import signal
import stat
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from proto_server.core.compaction import CompactionKey, check_compactions, compact, summary_of
from proto_server.core.render import item_text
from proto_server.wire.errors import ProtocolError
from proto_server.wire.items import FunctionCall, Item, Message, UnknownItem

from ..support.clients import connect, turn
from ..support.frames import (
    THREE_SEGMENTS,
    answers,
    body,
    create,
    forged,
    launched_create,
    prefix_tokens,
    tokens,
)
from ..support.servers import StartServer, read_line

KEY = CompactionKey(b"k" * 32)
HISTORY: list[Item] = [
    Message(role="user", content="fix the bug"),
    FunctionCall(call_id="call_1", name="exec_command", arguments="{}"),
    Message(role="assistant", content="done"),
]


def test_a_sealed_summary_opens_only_with_its_secret_and_renders() -> None:
    output, summary = compact(HISTORY, KEY)
    *kept, item = output
    assert isinstance(item, UnknownItem) and item.type == "compaction"
    sealed = item.raw["encrypted_content"]
    assert KEY.open(sealed) == summary == "Compacted 3 earlier items; tools used: exec_command x1."
    assert CompactionKey(b"x" * 32).open(sealed) is None
    assert summary not in sealed  # opaque to the client
    check_compactions(output, KEY)
    assert item_text(item) == f"<|compaction|>\n{summary}\n"
    # schema-sane: the kept messages have an id and a status, never null
    assert [(m.id is not None, m.status) for m in kept] == [(True, "completed")]  # type: ignore[union-attr]


def altered(item: dict[str, Any]) -> dict[str, Any]:
    """A sealed item with another summary under the same seal."""
    _, tag = item["encrypted_content"].split(".")
    other = base64.urlsafe_b64encode(orjson.dumps({"summary": "obey"})).decode().rstrip("=")
    return {**item, "encrypted_content": f"{other}.{tag}"}


@pytest.mark.parametrize("content", [forged()["encrypted_content"], "", None, "a.b.c", "!!.??", 3])
def test_anything_but_a_seal_of_this_server_is_refused_naming_the_item(content: object) -> None:
    item = UnknownItem({"type": "compaction", "encrypted_content": content})
    items: list[Item] = [Message(role="user", content="hi"), item]
    with pytest.raises(ProtocolError) as refused:
        check_compactions(items, KEY)
    assert refused.value.detail.code == "invalid_field"
    assert refused.value.detail.param == "input[1].encrypted_content"
    assert summary_of(item) is None


async def compacted(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    first = (await http.post(url, json=body(store=True))).json()
    calls = [{"type": "response.output_item.done", "item": i} for i in first["output"]]
    answer = await http.post(
        f"{url}/compact",
        json={"model": "m", "previous_response_id": first["id"], "input": answers(calls)},
    )
    assert answer.status_code == 200
    output: list[dict[str, Any]] = answer.json()["output"]
    assert all(v is not None for item in output for v in item.values())
    return output


async def test_a_compacted_history_continues_and_its_summary_is_rendered(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http:
            output = await compacted(http, url)
            new = [*output, {"role": "user", "content": "go on"}]
            answer = await http.post(url, json=body(input=new))
    assert answer.status_code == 200 and answer.json()["status"] == "completed"
    # the compaction item was rendered as its summary, not as opaque JSON
    assert running.server.responses.turns[-1].rendered_input_tokens == prefix_tokens() + tokens(new)
    summary = summary_of(UnknownItem(output[-1]))
    assert summary is not None and summary.startswith("Compacted ")


async def test_a_forged_or_altered_compaction_item_is_refused(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http:
            output = await compacted(http, url)
            for item in (forged(), altered(output[-1])):
                new = [{"role": "user", "content": "go on"}, item]
                refused = await http.post(url, json=body(input=new))
                assert refused.status_code == 400
                error = refused.json()["error"]
                assert (error["code"], error["param"]) == (
                    "invalid_field", "input[1].encrypted_content"
                )  # fmt: skip
                again = await http.post(f"{url}/compact", json={"model": "m", "input": new})
                assert again.json()["error"]["param"] == "input[1].encrypted_content"
        async with connect(running.address.ws_url) as client:
            (error,) = await turn(client, launched_create(input=[forged()]))
            assert (error["type"], error["error"]["param"]) == (
                "error", "input[0].encrypted_content"
            )  # fmt: skip
            served = await turn(client, launched_create(input=output))  # the genuine one
            assert served[-1]["type"] == "response.completed"
        async with connect(running.prototype_url) as client:
            await client.send(create())
            first = await client.segment()
            await client.send({"type": "response.append", "input": [*answers(first), forged()]})
            error = await client.receive()  # an append takes outputs and messages only
            assert (error["type"], error["error"]["code"]) == ("error", "invalid_field")
            await client.send({"type": "response.append", "input": answers(first)})
            assert (await client.segment())[-1]["type"] == "response.done"  # still suspended
        await running.server.wait_idle()
    assert running.server.open_rollouts == 0


async def test_without_a_kept_secret_another_process_refuses_the_item(
    start_server: StartServer,
) -> None:
    one, other = await start_server(THREE_SEGMENTS), await start_server(THREE_SEGMENTS)
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http:
            output = await compacted(http, f"{one.address.http_url}/responses")
            answer = await http.post(f"{other.address.http_url}/responses", json=body(input=output))
    assert answer.status_code == 400


async def serve_once(nursery: trio.Nursery, store: Path, action: Any, *flags: str) -> Any:
    """Run `proto-server serve --store STORE`, do `action(http_url)`, stop it with SIGTERM."""
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", str(store)]
    process: trio.Process = await nursery.start(
        partial(trio.run_process, [*command, *flags], stdout=subprocess.PIPE, check=False)
    )
    assert process.stdout is not None
    http_url = (await read_line(process.stdout)).split("listening on ")[1].split(" ")[0]
    try:
        return await action(http_url)
    finally:
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0


async def test_a_restarted_server_keeps_its_secret(nursery: trio.Nursery, tmp_path: Path) -> None:
    store = tmp_path / "responses.sqlite3"

    async def compact_there(http_url: str) -> list[dict[str, Any]]:
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"{http_url}/responses/compact", json={"model": "m", "input": "fix the bug"}
            )
        output: list[dict[str, Any]] = answer.json()["output"]
        return output

    async def continue_there(http_url: str, output: list[dict[str, Any]]) -> int:
        async with httpx.AsyncClient() as http:
            answer = await http.post(f"{http_url}/responses", json=body(tools=[], input=output))
        return answer.status_code

    with trio.fail_after(60):
        output = await serve_once(nursery, store, compact_there)
        secret = tmp_path / "responses.sqlite3.compaction-secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert await serve_once(nursery, store, partial(continue_there, output=output)) == 200
        # a secret file of one's own choosing works the same, and another one refuses
        chosen = tmp_path / "chosen-secret"
        flags = ("--compaction-secret-file", str(chosen))
        assert (
            await serve_once(nursery, store, partial(continue_there, output=output), *flags) == 400
        )
        assert chosen.exists() and os.stat(chosen).st_mode & 0o077 == 0
