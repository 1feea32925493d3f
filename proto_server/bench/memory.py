"""`python -m proto_server.bench.memory [MB]`: peak memory per input shape against its charge.

Each shape runs in a fresh process of its own (peak RSS, `VmHWM`, only grows): the frame is
built, the tokenizer loaded, the baseline RSS read; then the server's own steps for that frame
run (decode, check, render, what it keeps) and the peak is read. The ratio printed is peak
above baseline over what the budgets charge at that peak (`PREPARING_FACTOR` x the frame's
size while it is prepared, or what is kept after, whichever is more): under 1 is covered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import orjson

SHAPES = ("huge string", "many items", "many tools", "deep JSON", "big steer", "big inject")


def frame_of(shape: str, nbytes: int) -> dict[str, Any]:
    """A frame of about `nbytes` of JSON, of `shape`."""
    create: dict[str, Any] = {"type": "response.create", "model": "m"}
    if shape == "huge string":
        return {**create, "input": [{"role": "user", "content": "word " * (nbytes // 5)}]}
    if shape == "many items":
        return {**create, "input": [{"role": "user", "content": "hi"}] * (nbytes // 34)}
    if shape == "many tools":
        tool = {
            "type": "function",
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        }
        size = len(orjson.dumps(tool)) + 1
        tools = [{**tool, "name": f"f{i}"} for i in range(nbytes // size)]
        return {**create, "tools": tools, "input": "hi"}
    if shape == "deep JSON":
        deep: Any = 1
        for _ in range(60):  # 120 levels: within the decoder's 128
            deep = {"a": [deep]}
        item = {"type": "reasoning", "summary": [deep]}
        size = len(orjson.dumps(item)) + 1
        return {**create, "input": [item] * (nbytes // size)}
    if shape == "big steer":
        return {
            "type": "response.steer",
            "previous_response_id": "resp_1",
            "input": "word " * (nbytes // 5),
        }
    if shape == "big inject":
        text = "word " * (nbytes // 5)
        output = {"type": "function_call_output", "call_id": "c1", "output": text}
        return {"type": "response.inject", "response_id": "resp_1", "input": [output]}
    raise ValueError(shape)


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def measure(shape: str, nbytes: int) -> dict[str, Any]:
    """In this process: the server's steps for one frame of `shape`; peak RSS against charge."""
    from proto_server.core.conversation import (
        Conversation,
        decoded_bytes,
        render_items,
    )
    from proto_server.core.render import O200kRenderer
    from proto_server.core.request import input_items, request_bytes
    from proto_server.server.memory import preparing_bytes
    from proto_server.wire.converter import decode_client_event, steer_items
    from proto_server.wire.events import ResponseCreate, ResponseInject, ResponseSteer

    renderer = O200kRenderer()
    renderer.render_prefix(None, ())
    message = orjson.dumps(frame_of(shape, nbytes)).decode()
    size = len(message)
    charge = preparing_bytes(message)
    baseline = _rss("VmRSS")
    event = decode_client_event(message)
    if isinstance(event, ResponseCreate):
        kept = request_bytes(event)
        conversation = Conversation(renderer, instructions=event.instructions, tools=event.tools)
        conversation.extend_rendered(render_items(renderer, input_items(event)))
        kept = max(kept, conversation.retained_bytes)
    elif isinstance(event, ResponseSteer):
        items = steer_items(event.input)
        kept = decoded_bytes(items, text=isinstance(event.input, str))
        rendered = render_items(renderer, items)  # as its successor renders it
        kept += rendered.nbytes
    else:
        assert isinstance(event, ResponseInject)
        rendered = render_items(renderer, event.input)
        kept = rendered.nbytes
    peak = _rss("VmHWM") - baseline
    return {"shape": shape, "frame": size, "peak": peak, "charge": max(charge, kept)}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        shape, count = sys.argv[2].rsplit(":", 1)
        print(json.dumps(measure(shape, int(count))))
        return 0
    megabytes = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
    nbytes = int(megabytes * 1024 * 1024)
    print(
        f"{'shape':<12} {'frame MB':>9} {'peak MB':>9} {'charge MB':>10} {'peak/frame':>11} "
        f"{'peak/charge':>12}"
    )
    worst = 0.0
    for shape in SHAPES:
        out = subprocess.run(
            [sys.executable, "-m", "proto_server.bench.memory", "--child", f"{shape}:{nbytes}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        row = json.loads(out)
        ratio = row["peak"] / row["charge"]
        worst = max(worst, ratio)
        mb = 1024 * 1024
        print(
            f"{shape:<12} {row['frame'] / mb:>9.1f} {row['peak'] / mb:>9.1f} "
            f"{row['charge'] / mb:>10.1f} {row['peak'] / row['frame']:>10.1f}x "
            f"{ratio:>12.2f}"
        )
    print(f"worst peak/charge: {worst:.2f} (at most 1: every shape within its charge)")
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
