"""A coding-agent rollout shaped like the Codex CLI's, generated from a seed.

What every request carries, as Codex 0.171 sends it: a developer message of about 17 KB and the
tool definitions (`codex_tools.json`, the 9 tools of a captured Codex 0.171 request, ~19 KB), both
resent with every request by a stateless client. Then 30 to 50 tool rounds: the model calls
`exec_command` (arguments of ~50 tokens), the tool answers with 1 to 8 KB of source, search hits
or listings, and now and then a large test log; at the end the model writes a final message of a
few hundred tokens. The history passes 100k tokens.

The text is made up, but shaped like the real thing (code, paths, numbers, log lines), so it
tokenizes like it: about 3 characters a token. The same seed gives the same workload.
"""

from __future__ import annotations

import importlib.resources
import random
from typing import Any

import attrs
import orjson

from proto_server.core.tokenizer import o200k_base
from proto_server.engine.script import RolloutScript, ScriptedCall, Segment

WORKDIR = "/home/user/project"
MODEL = "gpt-5.1-codex"

_MODULES = (
    "core/response", "core/conversation", "core/render", "server/app", "server/connection",
    "server/http", "server/launched", "server/sampling", "server/store", "wire/converter",
    "wire/events", "wire/items", "engine/simulated", "engine/script", "cli",
)  # fmt: skip
_WORDS = (
    "conversation", "response", "segment", "rollout", "tokens", "render", "stream", "event",
    "channel", "writer", "reader", "session", "cache", "prefix", "sequence", "usage", "store",
    "append", "cancel", "state", "machine", "item", "output", "input", "call", "delta", "frame",
    "limit", "config", "error", "detail", "status", "model", "tool", "schema", "request",
)  # fmt: skip
_TYPES = ("int", "str", "bool", "float", "list[Item]", "Response", "Sequence[Tool]", "None")
_GUIDANCE = (
    "You are a coding agent running in a terminal. Be precise, safe and helpful.",
    "Read the relevant files before you change them, and keep each change as small as the task "
    "allows.",
    "Prefer `rg` over `grep` for searching, and read files in chunks of at most 250 lines.",
    "When you run tests, run the narrowest set that covers the change first, then the whole suite.",
    "Never revert changes you did not make; if the working tree has unexpected changes, ask.",
    "Explain what you did in a short final message: what changed, where, and how you checked it.",
    "Do not add licence headers or reformat files you did not otherwise touch.",
    "Use the `apply_patch` tool for edits; never write files with shell redirection.",
    "If a command fails, read its output and fix the cause instead of retrying blindly.",
    "Keep the user informed with brief preambles before groups of related tool calls.",
    "Follow the repository's conventions: its formatter, its linters, its test layout.",
    "When the sandbox blocks a command that the task needs, request escalation with a one-line "
    "justification.",
    "Plans are for multi-step work: keep them short, update them as steps complete.",
    "Reference files as clickable paths with line numbers, like `src/app.py:42`.",
)


@attrs.frozen
class Round:
    """One tool round: what the model calls, and what the tool prints."""

    command: str
    arguments: str  # the call's JSON arguments, as they stream
    output: str


@attrs.frozen
class Workload:
    seed: int
    developer: str
    task: str
    tools: tuple[dict[str, Any], ...]
    rounds: tuple[Round, ...]
    final: str

    @property
    def turns(self) -> int:
        """Requests in one rollout: one per tool round, and one for the final answer."""
        return len(self.rounds) + 1

    def script(self) -> RolloutScript:
        """What the simulated model says: a tool call per round, then the final message."""
        calls = [
            Segment(tool_calls=(ScriptedCall(name="exec_command", arguments=r.arguments),))
            for r in self.rounds
        ]
        return RolloutScript((*calls, Segment(text=self.final)))

    def opening(self, nonce: str) -> list[dict[str, Any]]:
        """The first request's input: the developer message, the environment (with a `nonce`
        that makes each rollout's conversation its own past the shared prefix), the task."""
        environment = (
            f"<environment_context>\n  <cwd>{WORKDIR}</cwd>\n  <shell>bash</shell>\n"
            f"  <session_id>{nonce}</session_id>\n</environment_context>"
        )
        return [
            _message("developer", self.developer),
            _message("user", environment),
            _message("user", self.task),
        ]

    def tool_output(self, index: int, call_id: str) -> dict[str, Any]:
        return {
            "type": "function_call_output",
            "call_id": call_id,
            "output": self.rounds[index].output,
        }

    def sizes(self) -> dict[str, Any]:
        outputs = [len(r.output.encode()) for r in self.rounds]
        return {
            "seed": self.seed,
            "turns": self.turns,
            "tool_rounds": len(self.rounds),
            "developer_bytes": len(self.developer.encode()),
            "tools_bytes": len(orjson.dumps(self.tools)),
            "tool_output_bytes": {"total": sum(outputs), "min": min(outputs), "max": max(outputs)},
            "final_message_bytes": len(self.final.encode()),
        }


def _message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def codex_tools() -> tuple[dict[str, Any], ...]:
    """The tools of a real Codex 0.171 request (9 of them, a namespace and web_search included)."""
    data = importlib.resources.files("proto_server_bench").joinpath("codex_tools.json")
    return tuple(orjson.loads(data.read_bytes()))


def make_workload(
    seed: int = 0,
    *,
    rounds: int | None = None,
    output_kb: tuple[float, float] = (1.0, 8.0),
    large_share: float = 0.15,
    large_kb: tuple[float, float] = (16.0, 48.0),
    developer_kb: float = 17.0,
    final_tokens: int = 300,
) -> Workload:
    """A rollout from `seed`: `rounds` tool rounds (30 to 50 by the seed when None), tool outputs
    of `output_kb` KB, a `large_share` of them `large_kb` KB test logs instead."""
    if rounds is not None and rounds < 1:
        raise ValueError(f"a rollout needs at least one tool round, got {rounds}")
    rng = random.Random(seed)
    count = rng.randint(30, 50) if rounds is None else rounds
    made = []
    for _ in range(count):
        if rng.random() < large_share:
            size = int(rng.uniform(*large_kb) * 1024)
            made.append(_test_run(rng, size))
        else:
            size = int(rng.uniform(*output_kb) * 1024)
            made.append(rng.choice((_read_file, _search, _listing, _diff))(rng, size))
    return Workload(
        seed=seed,
        developer=_prose(rng, int(developer_kb * 1024), _GUIDANCE),
        task="The launched dialect drops tool outputs when two calls answer in one request; "
        "find out why, fix it, and add a test.",
        tools=codex_tools(),
        rounds=tuple(made),
        final=_final(rng, final_tokens),
    )


# -- the text ------------------------------------------------------------------------------------


def _name(rng: random.Random) -> str:
    return "_".join(rng.sample(_WORDS, rng.randint(1, 3)))


def _path(rng: random.Random) -> str:
    return f"proto_server/{rng.choice(_MODULES)}.py"


def _round(rng: random.Random, command: str, body: str) -> Round:
    arguments = orjson.dumps(
        {"cmd": command, "workdir": WORKDIR, "yield_time_ms": 10000, "max_output_tokens": 10000}
    ).decode()
    header = (
        f"Chunk ID: {rng.getrandbits(24):06x}\nWall time: {rng.uniform(0.01, 3):.4f} seconds\n"
        f"Process exited with code 0\nOriginal token count: {len(body) // 3}\nOutput:\n"
    )
    return Round(command=command, arguments=arguments, output=header + body)


def _fill(size: int, line: Any) -> str:
    """Lines from `line()` until `size` bytes (at least one line)."""
    lines: list[str] = []
    total = 0
    while not lines or total < size:
        text = line()
        lines.append(text)
        total += len(text) + 1
    return "\n".join(lines)


def _code_line(rng: random.Random) -> str:
    kind = rng.random()
    a, b = _name(rng), _name(rng)
    if kind < 0.15:
        return f"    def {a}(self, {b}: {rng.choice(_TYPES)}) -> {rng.choice(_TYPES)}:"
    if kind < 0.35:
        return f"        {a} = self._{b}.get({rng.randint(0, 4096)})"
    if kind < 0.5:
        return f"        if {a} is None or len({b}) > {rng.randint(1, 999)}:"
    if kind < 0.65:
        return f"            return {a}({b}, limit={rng.randint(1, 64)})"
    if kind < 0.75:
        return f'        raise ProtocolError("{a}", f"{b} {{{a}!r}} is not valid")'
    if kind < 0.85:
        return f"        # {' '.join(rng.sample(_WORDS, rng.randint(3, 8)))}"
    return ""


def _read_file(rng: random.Random, size: int) -> Round:
    start = rng.randint(1, 400)
    counter = iter(range(start, 10**6))
    body = _fill(size, lambda: f"{next(counter):>5}\t{_code_line(rng)}")
    return _round(rng, f"nl -ba {_path(rng)} | sed -n '{start},{start + 200}p'", body)


def _search(rng: random.Random, size: int) -> Round:
    pattern = _name(rng)
    body = _fill(size, lambda: f"{_path(rng)}:{rng.randint(1, 900)}:{_code_line(rng)}")
    return _round(rng, f"rg -n '{pattern}' proto_server tests", body)


def _listing(rng: random.Random, size: int) -> Round:
    def entry() -> str:
        size_bytes, minute = rng.randint(90, 48000), rng.randint(0, 59)
        return f"-rw-r--r-- 1 user user {size_bytes:>6} Nov 29 10:{minute:02d} {_path(rng)}"

    return _round(rng, "ls -la $(git ls-files)", _fill(size, entry))


def _diff(rng: random.Random, size: int) -> Round:
    def hunk_line() -> str:
        sign = rng.choice(" +-")
        return f"{sign}{_code_line(rng)}" if rng.random() > 0.1 else f"@@ -{rng.randint(1, 900)} @@"

    return _round(rng, f"git diff -- {_path(rng)}", _fill(size, hunk_line))


def _test_run(rng: random.Random, size: int) -> Round:
    def result() -> str:
        if rng.random() < 0.03:
            return (
                f"E       AssertionError: assert {rng.randint(0, 99)} == {rng.randint(0, 99)}\n"
                f"tests/test_{_name(rng)}.py:{rng.randint(10, 400)}: AssertionError"
            )
        test = f"tests/test_{_name(rng)}.py::test_{_name(rng)}"
        return f"{test} PASSED [{rng.randint(0, 100):>3}%] ({rng.uniform(0, 2):.3f}s)"

    return _round(rng, "python -m pytest -v", _fill(size, result))


def _prose(rng: random.Random, size: int, sentences: tuple[str, ...]) -> str:
    paragraphs: list[str] = []
    total = 0
    while total < size:
        picked = rng.sample(sentences, rng.randint(3, 6))
        paragraph = " ".join(picked) + f" ({' '.join(rng.sample(_WORDS, 6))}.)"
        paragraphs.append(paragraph)
        total += len(paragraph) + 2
    return "\n\n".join(paragraphs)[:size]


def _final(rng: random.Random, tokens: int) -> str:
    words: list[str] = ["Fixed:"]
    while len(words) < tokens * 3 // 4:  # about 4/3 tokens a word
        words.append(rng.choice(_WORDS))
        if rng.random() < 0.1:
            words.append(f"(`{_path(rng)}:{rng.randint(1, 900)}`).")
    return " ".join(words)


def streaming_text(tokens: int, seed: int = 0) -> str:
    """Prose of about `tokens` tokens, for a model that just talks (the streaming measurements)."""
    encoding = o200k_base()
    rng = random.Random(seed)
    prose = _prose(rng, tokens * 6, _GUIDANCE)
    return encoding.decode(encoding.encode_ordinary(prose)[:tokens])
