"""The Vercel AI SDK (`ai` 6 with `@ai-sdk/openai`, tests/clients/package.json), unmodified.

Its Responses provider is what a TypeScript user points at a server: `Output.object` for
structured output, and multi-turn with `store: true` (its default), where it sends its earlier
replies back as `item_reference`s. `tests/clients/vercel_ai.mjs` runs it and prints what it
got and every request body it sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import jsonschema
import orjson
import pytest
import trio

from ..support.servers import StartServer

pytestmark = pytest.mark.npm  # the Vercel AI SDK runs in Node.js from tests/clients

CLIENTS = Path(__file__).resolve().parents[1] / "clients"


async def vercel(base_url: str, mode: str) -> dict[str, Any]:
    with trio.fail_after(60):
        done = await trio.run_process(
            ["node", str(CLIENTS / "vercel_ai.mjs"), base_url, mode],
            cwd=CLIENTS, capture_stdout=True, capture_stderr=True, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    result: dict[str, Any] = orjson.loads(done.stdout.splitlines()[-1])
    return result


async def test_output_object_gets_an_instance_of_its_zod_schema(
    start_server: StartServer,
) -> None:
    running = await start_server()
    result = await vercel(running.address.http_url, "structured")
    (request,) = result["sent"]
    form = request["text"]["format"]
    assert (form["type"], form["strict"]) == ("json_schema", True)
    jsonschema.validate(result["output"], form["schema"])


async def test_multi_turn_with_store_sends_item_references_that_resolve(
    start_server: StartServer,
) -> None:
    """The tool loop runs (call, output, answer); the next turn refers to the answer by id,
    and the server finds it: a reference it could not find would be a 400, and the SDK would
    throw."""
    running = await start_server()
    result = await vercel(running.address.http_url, "multiturn")
    assert result["steps"] == 2 and "ran echo" in result["first"]
    last = result["sent"][-1]["input"]
    references = [item["id"] for item in last if item.get("type") == "item_reference"]
    base = running.address.http_url
    async with httpx.AsyncClient() as http:
        first = (await http.get(f"{base}/responses/{result['firstId']}")).json()
        given = (await http.get(f"{base}/responses/{result['secondId']}/input_items")).json()
    (answer,) = [item for item in first["output"] if item["type"] == "message"]
    assert references == [answer["id"]]
    # what the second turn was served from: the answer itself, where the reference stood
    assert [item for item in given["data"] if item.get("id") == answer["id"]] == [answer]
    assert not [item for item in given["data"] if item["type"] == "item_reference"]
    assert result["second"]
