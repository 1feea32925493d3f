"""Rollout scripts: what the simulated model says and which tools it calls, segment by segment.

    {"segments": [
      {"reasoning": "The test fails at the last index; look at the loop first.",
       "text": "Let me look.",
       "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]},
      {"text": "Fixed: the loop was off by one."}
    ]}

A segment thinks (`reasoning`: a reasoning item), then speaks (`text`), then calls (`tool_calls`),
each optional. A segment with tool calls ends in a suspension; one without ends the Response.
Which segment comes next is derived from the conversation (how many model turns it already
holds), so a client that reconnects and resends its whole history continues where it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import orjson

from proto_server.core.conversation import Conversation
from proto_server.engine.limits import GenerationLimits, GenerationRefused
from proto_server.wire.errors import some_of
from proto_server.wire.tools import offered_tool_names


class ScriptError(GenerationRefused):
    """The script is malformed, exhausted, or does not fit the request."""

    def __init__(self, message: str) -> None:
        super().__init__("script_error", message)


@attrs.frozen(kw_only=True)
class ScriptedCall:
    name: str
    arguments: str  # JSON text, as it streams on the wire


@attrs.frozen(kw_only=True)
class Segment:
    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[ScriptedCall, ...] = ()


class Planner(Protocol):
    """Decides what the model says next, given the conversation so far and what the request
    allows; cheap and bounded (it runs on the event loop)."""

    def plan(self, conversation: Conversation, limits: GenerationLimits) -> Segment: ...


@attrs.frozen
class RolloutScript:
    segments: tuple[Segment, ...]

    def plan(self, conversation: Conversation, limits: GenerationLimits) -> Segment:
        """The next segment; one that breaks the request's limits on tool calls is a
        `ScriptError` naming the segment and the limit (text over `max_output_tokens` is not:
        the model is cut short, as a real one would be)."""
        position = conversation.model_segments
        if position >= len(self.segments):
            raise ScriptError(
                f"the rollout script has {len(self.segments)} segment(s) and the conversation "
                f"already holds {position} model turn(s): nothing is left to say. Lengthen the "
                "script or start a new conversation."
            )
        segment = self.segments[position]
        offered = offered_tool_names(conversation.tools)
        for call in segment.tool_calls:
            if call.name not in offered:
                raise ScriptError(
                    f"segment {position + 1} of the rollout script calls tool {call.name!r}, but "
                    f"the request offered {some_of(offered) if offered else 'no tools'}; offer "
                    "that tool in the request or fix the script."
                )
        broken = _broken_limit(segment, limits)
        if broken is not None:
            raise ScriptError(
                f"segment {position + 1} of the rollout script {broken}; fix the script or "
                "the request."
            )
        return segment


def _broken_limit(segment: Segment, limits: GenerationLimits) -> str | None:
    """What `segment` does that `limits` forbid, in words; None if it fits."""
    calls, choice = len(segment.tool_calls), limits.tool_choice
    allowed = limits.max_calls
    if allowed is not None and calls > allowed:
        if choice.mode == "none":
            why = 'tool_choice is "none"'
        elif allowed == limits.max_tool_calls:
            why = f"max_tool_calls leaves {allowed} more in this Response"
        else:
            why = "parallel_tool_calls is false: one call per segment"
        return f"makes {calls} tool call(s), but the request allows {allowed} ({why})"
    if limits.must_call and not calls:
        what = f"names {choice.name!r}" if choice.name is not None else "is 'required'"
        return f"makes no tool call, but the request requires one (tool_choice {what})"
    named = choice.name
    if named is not None and any(call.name != named for call in segment.tool_calls):
        return f"calls a tool other than {named!r}, the one tool_choice names"
    return None


def parse_script(data: Any, *, source: str = "script") -> RolloutScript:
    """A script from decoded JSON; `ScriptError` names the first thing wrong and where."""

    def fail(where: str, what: str) -> ScriptError:
        return ScriptError(f"{source}: {where} {what}")

    if not isinstance(data, Mapping) or not isinstance(data.get("segments"), list):
        raise fail("the top level", 'must be an object with a "segments" array')
    if not data["segments"]:
        raise fail("segments", "is empty; give at least one segment")
    segments = []
    for i, raw in enumerate(data["segments"]):
        where = f"segments[{i}]"
        if not isinstance(raw, Mapping):
            raise fail(where, "must be an object")
        unknown = raw.keys() - {"reasoning", "text", "tool_calls"}
        if unknown:
            raise fail(
                where, f"has unknown keys {sorted(unknown)}; use reasoning, text and tool_calls"
            )
        text, reasoning = raw.get("text", ""), raw.get("reasoning", "")
        for key, value in (("text", text), ("reasoning", reasoning)):
            if not isinstance(value, str):
                raise fail(f"{where}.{key}", "must be a string")
        calls = []
        for j, call in enumerate(raw.get("tool_calls", [])):
            at = f"{where}.tool_calls[{j}]"
            if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
                raise fail(at, 'must be an object with a string "name"')
            arguments = call.get("arguments", {})
            if isinstance(arguments, Mapping):
                arguments = orjson.dumps(arguments).decode()
            elif not isinstance(arguments, str):
                raise fail(f"{at}.arguments", "must be an object or a JSON string")
            calls.append(ScriptedCall(name=call["name"], arguments=arguments))
        if not text and not calls:
            raise fail(where, "says nothing; give it text, tool_calls, or both")
        segments.append(Segment(text=text, reasoning=reasoning, tool_calls=tuple(calls)))
    return RolloutScript(tuple(segments))


def load_script(path: str | Path) -> RolloutScript:
    try:
        data = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ScriptError(f"cannot read the rollout script {path}: {exc.strerror}") from None
    except orjson.JSONDecodeError as exc:
        raise ScriptError(f"the rollout script {path} is not valid JSON: {exc}") from None
    return parse_script(data, source=str(path))
