"""The blocking facade (plain sync tests: it owns its own trio thread) and the rich display."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
import trio

from proto_server.client.facade import BlockingClient, ClientStopped
from proto_server.client.state import RolloutState
from proto_server.engine.simulated import TimingModel
from proto_server.hosted import serving

from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS
from ..support.servers import FAST


def trio_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "proto-client-trio"]


def test_a_rollout_lives_across_calls_and_close_stops_everything() -> None:
    client = serving(THREE_SEGMENTS, timing=FAST)
    rollout = client.connect("prototype").create("fix it", tools=[EXEC_COMMAND])
    first = rollout.step()
    assert first.end == "response.done"
    assert rollout.state is RolloutState.SUSPENDED
    rollout.append({call.call_id: "a.py" for call in rollout.pending_calls})
    rollout.step()
    rollout.append({call.call_id: "x" for call in rollout.pending_calls})
    rollout.step()
    assert rollout.state is RolloutState.COMPLETED
    assert [r.sequence_number for r in rollout.events] == list(range(len(rollout.events)))

    client.close()
    assert not client._thread.is_alive()
    with pytest.raises(ClientStopped, match="create a new one"):
        client.connect("prototype")
    client.close()  # idempotent


def test_closing_a_client_closes_its_connections_on_a_server_it_does_not_own() -> None:
    with serving(THREE_SEGMENTS, timing=FAST) as host:
        assert host.server is not None and host.url is not None
        guest = BlockingClient(host.url)
        rollout = guest.connect("prototype").create("fix it", tools=[EXEC_COMMAND])
        rollout.step()
        assert host.server.open_rollouts == 1  # suspended, holding its state
        guest.close()

        async def idle() -> None:
            with trio.fail_after(5):
                await host.server.wait_idle()  # type: ignore[union-attr]

        host.call(idle)
        assert host.server.open_connections == 0
    assert not trio_threads()


def test_a_closed_connection_ends_its_rollout_on_the_server() -> None:
    with serving(THREE_SEGMENTS, timing=FAST) as client:
        connection = client.connect("prototype")
        connection.create("fix it", tools=[EXEC_COMMAND]).step()
        connection.close()
        server = client.server
        assert server is not None

        async def idle() -> None:
            with trio.fail_after(5):
                await server.wait_idle()

        client.call(idle)


def test_a_rollout_whose_connection_closed_mid_segment_is_taken_up_on_another() -> None:
    # 400 words at 200 tokens/s: the segment streams for about 2 s of real time.
    slow = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=200)
    script = {"segments": [{"text": "word " * 400, "tool_calls": [{"name": "exec_command",
              "arguments": {"cmd": "ls"}}]}, {"text": "Done."}]}  # fmt: skip
    with serving(script, timing=slow) as client:
        first = client.connect("prototype")
        rollout = first.create("fix it", tools=[EXEC_COMMAND])
        seen = rollout.read(5)
        assert [r.event.type for r in seen][-1] == "response.output_text.delta"
        assert rollout.read(0) == []
        first.close()  # mid-text: the Response runs on, kept for --reattach-grace

        again = client.connect("prototype").reattach(
            rollout.response_id or "", starting_after=seen[-1].sequence_number or 0
        )
        segment = again.step()
        assert again.state is RolloutState.SUSPENDED
        numbers = [r.sequence_number for r in seen + segment.events]
        assert numbers == list(range(len(numbers)))  # one stream: no gap, nothing twice
        assert again.response_id == rollout.response_id
        again.append({call.call_id: "a.py" for call in again.pending_calls})
        again.step()
        assert again.state is RolloutState.COMPLETED

        missing = client.connect("prototype").reattach("resp_nope")
        missing.step()
        assert missing.state is RolloutState.FAILED
        assert missing.rollout.tracker.error is not None
        assert missing.rollout.tracker.error.code == "response_not_found"


def test_reattach_is_the_prototype_dialects() -> None:
    with (
        serving(THREE_SEGMENTS, timing=FAST) as client,
        pytest.raises(ValueError, match="stream=true&starting_after"),
    ):
        client.connect("launched").reattach("resp_1")


def test_the_low_level_door_shows_what_the_server_answers() -> None:
    with serving(THREE_SEGMENTS, timing=FAST) as client:
        connection = client.connect("prototype")
        connection.send({"type": "response.append", "input": []})
        received = connection.receive()
        assert received.event.type == "error"
        assert received.sequence_number == 0
        with pytest.raises(TimeoutError, match="no server event"):
            connection.receive(timeout=0.05)


def test_a_rollout_shows_its_events_pending_calls_and_timing_chart() -> None:
    with serving(THREE_SEGMENTS, timing=FAST) as client:
        rollout = client.connect("prototype").create("fix it", tools=[EXEC_COMMAND])
        segment = rollout.step()
        (call,) = rollout.pending_calls
        table = segment._repr_html_()
        assert "output_item.done" in table and "function_call_arguments.delta" in table
        assert call.call_id in table  # the calls the model made, under the table
        page = rollout._repr_html_()
        assert "suspended" in page and call.call_id in page and "Pending calls" in page
        rollout.append({call.call_id: "a.py"})
        rollout.step()
        chart = rollout.timing_chart()
        assert chart._repr_png_().startswith(b"\x89PNG")
        figure = chart.figure
        bars = figure.axes[0].patches
        assert len(bars) == 3 * len(rollout.segments)  # client, modelled GPU, server + wire
        labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
        assert "GPU (modelled)" in labels


def python_blocks() -> list[str]:
    page = (Path(__file__).resolve().parents[2] / "docs" / "clients.md").read_text()
    return re.findall(r"```python\n(.*?)\n```", page, re.S)


def test_the_client_pages_examples_run_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    trio_example, blocking_example = (
        block for block in python_blocks() if "proto_server.client" in block
    )
    with serving() as host:  # the default model, as `proto-server serve` has
        assert host.url is not None
        namespace: dict[str, object] = {}
        exec(trio_example.replace("http://127.0.0.1:8000/v1", host.url), namespace)
        exec(blocking_example, namespace)
    printed = capsys.readouterr().out
    assert printed.count("RolloutState.COMPLETED") == 2  # prototype and launched
    assert "0 response.created" in printed
    http_sizes = orjson.loads(printed.strip().splitlines()[-1])
    assert len(http_sizes) == 2 and http_sizes[1] > http_sizes[0]
    assert not trio_threads()


def test_an_interrupt_cancels_the_call_in_the_clients_thread_too() -> None:
    long_text = {"segments": [{"text": " word" * 5000}]}  # 5 s at 1,000 tokens/s
    with serving(long_text, timing=TimingModel()) as client:
        rollout = client.connect("prototype").create("talk")
        main = threading.main_thread().ident
        assert main is not None

        def interrupt_once_it_streams() -> None:  # mid-segment, however busy the machine
            deadline = time.monotonic() + 10
            while not rollout.rollout.received and time.monotonic() < deadline:
                time.sleep(0.01)
            signal.pthread_kill(main, signal.SIGINT)

        threading.Thread(target=interrupt_once_it_streams, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            rollout.step()
        assert rollout.state is RolloutState.STREAMING  # stopped reading mid-segment
        read = len(rollout.events)
        assert read > 0
        rollout.cancel()  # runs at once: the interrupted step no longer holds the thread
        assert rollout.state is RolloutState.CANCELLED
        assert len(rollout.events) > read


def test_interpreter_exit_closes_a_client_left_open() -> None:
    """What a kernel shutdown does: the atexit hook closes the client, silently and promptly."""
    with serving(THREE_SEGMENTS, timing=FAST) as host:
        assert host.url is not None and host.server is not None
        program = (
            "from proto_server.client.facade import BlockingClient\n"
            f"client = BlockingClient({host.url!r})\n"
            f"rollout = client.connect().create('fix it', tools=[{EXEC_COMMAND!r}])\n"
            "rollout.step()\n"
            "print(rollout.state.value)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, timeout=30
        )
        assert (done.returncode, done.stdout, done.stderr) == (0, "suspended\n", "")

        async def idle() -> None:
            with trio.fail_after(5):
                await host.server.wait_idle()  # type: ignore[union-attr]

        host.call(idle)
