"""A string that a JSON schema `pattern` accepts, for the default model's examples.

JSON Schema matches a `pattern` anywhere in the string (`re.search`). A pattern is read into a
small tree (literals, character classes, groups, alternation, quantifiers, `^`, `$`, `\\b`) and
its shortest match is written out, each open quantifier repeated more where a `minLength` asks
for more; a pattern outside that subset (look-around, back-references, inline flags) is
refused, never guessed. Every candidate is checked with `re.search` before it is used: a string
that does not match is never returned, a refusal is. The work is bounded: a pattern is at most
`MAX_PATTERN_CHARS` long; its shortest match's length, and its size with every fixed repeat
written out (as the `regex` engine compiles it), are counted on the tree before either is
built; and the regular expression runs on a handful of candidates of bounded length, within
`PATTERN_SEARCH_S`.
"""

from __future__ import annotations

import re
import time

import attrs
import regex  # type: ignore[import-untyped]

#: Characters of a `pattern` the default model reads; a longer one is refused.
MAX_PATTERN_CHARS = 1_000

#: Groups a `pattern` may nest (the reader recurses once per level).
MAX_PATTERN_DEPTH = 32

#: How large a `pattern` may be with its fixed repeats written out, as the `regex` engine writes
#: them when it compiles (`(a{1000}|b){1000}`, 17 characters, took 0.35 s and 275 MB; a
#: hundred times that, a MemoryError); past it the pattern is refused before it is compiled.
MAX_PATTERN_SIZE = 20_000

#: Seconds of matching one schema's `pattern`s may take, every pattern and candidate together.
#: Python's `re` backtracks exponentially on some patterns (`(x+x+)+y` against 30 x's: minutes);
#: matching runs on the `regex` engine, which is faster on most of them and stops at this bound
#: on the rest.
PATTERN_SEARCH_S = 0.05


class SearchTime:
    """What is left of `PATTERN_SEARCH_S` for one schema: shared by all its patterns, so a
    schema of a thousand `anyOf` branches costs the bound once, not a thousand times."""

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds = PATTERN_SEARCH_S if seconds is None else seconds
        self._deadline = time.monotonic() + self.seconds
        #: The searching done so far, in this thread's CPU time.
        self._worked = 0.0

    def search(self, compiled: regex.Pattern[str], text: str) -> bool:
        """Whether `compiled` finds a match in `text` within the bound. A search stopped while
        the walk's searches had used under half the bound in CPU time (the time went elsewhere:
        the process descheduled, the GIL held by another thread) is tried once more with what
        is left of it, so that a busy machine does not refuse a simple pattern."""
        for attempt in range(2):
            started = time.thread_time()
            try:
                left = self._deadline - time.monotonic()
                return compiled.search(text, timeout=max(left, 0)) is not None
            except TimeoutError:
                pass
            finally:
                self._worked += time.thread_time() - started
            if attempt or self._worked >= self.seconds / 2:
                break
            self._deadline = time.monotonic() + self.seconds - self._worked
        raise PatternRefused(f"matching it took longer than {self.seconds} s (it backtracks badly)")


#: Characters tried, in order, as the one a class or `.` stands for: readable ones first.
_SAMPLES = "aA0x_-. !~@#%&*+,/:;=?^|()[]{}<>$'\"\\\t\n"

_ESCAPED = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
_QUANTIFIERS: dict[str, tuple[int, int | None]] = {"*": (0, None), "+": (1, None), "?": (0, 1)}
_CATEGORY_SAMPLES = {"d": "0", "D": "x", "w": "a", "W": "-", "s": " ", "S": "x"}


class PatternRefused(ValueError):
    """A pattern no string is built for: why, in words."""


@attrs.frozen
class _Node:
    """A part of the pattern: a fixed `text`, a sequence of `parts`, or a `body` repeated
    `least` to `most` times (None: no limit); `length` is its shortest match's."""

    text: str = ""
    parts: tuple[_Node, ...] = ()
    body: _Node | None = None
    least: int = 1
    most: int | None = 1
    length: int = 0  # the shortest match's length, counted before anything is built
    size: int = 1  # the pattern's, every fixed repeat written out (every branch counted)


def _chars(text: str) -> _Node:
    return _Node(text=text, length=len(text), size=max(len(text), 1))


def _sequence(parts: list[_Node]) -> _Node:
    return (
        parts[0]
        if len(parts) == 1
        else _Node(
            parts=tuple(parts),
            length=sum(p.length for p in parts),
            size=sum(p.size for p in parts),
        )
    )


def _repeat(body: _Node, least: int, most: int | None) -> _Node:
    size = body.size * max(least, 1)
    return _Node(body=body, least=least, most=most, length=least * body.length, size=size)


class _Reader:
    """A recursive-descent reader of the subset, depth-bounded."""

    def __init__(self, pattern: str) -> None:
        self._text = pattern
        self._at = 0

    def read(self) -> _Node:
        node = self._alternation(0)
        if self._at < len(self._text):
            raise PatternRefused(f"an unbalanced `)` at {self._at}")
        return node

    def _peek(self, ahead: int = 0) -> str:
        at = self._at + ahead
        return self._text[at] if at < len(self._text) else ""

    def _next(self) -> str:
        char = self._peek()
        if not char:
            raise PatternRefused("it ends in the middle of a construct")
        self._at += 1
        return char

    def _alternation(self, depth: int) -> _Node:
        branches = [self._sequence(depth)]
        while self._peek() == "|":
            self._at += 1
            branches.append(self._sequence(depth))
        shortest = min(branches, key=lambda branch: branch.length)  # the first of the shortest
        return attrs.evolve(shortest, size=sum(branch.size for branch in branches))

    def _sequence(self, depth: int) -> _Node:
        parts: list[_Node] = []
        while self._peek() not in ("", "|", ")"):
            parts.append(self._quantified(self._atom(depth)))
        return _sequence(parts) if parts else _chars("")

    def _atom(self, depth: int) -> _Node:
        char = self._next()
        if char == "(":
            return self._group(depth)
        if char == "[":
            return _chars(self._class())
        if char == ".":
            return _chars("x")
        if char in "^$":
            return _chars("")  # where it may stand is checked on the candidate
        if char == "\\":
            return _chars(self._escape(in_class=False))
        if char in "*+?" or (char == "{" and self._counts() is not None):
            raise PatternRefused(f"a quantifier with nothing to repeat at {self._at - 1}")
        return _chars(char)

    def _group(self, depth: int) -> _Node:
        if depth >= MAX_PATTERN_DEPTH:
            raise PatternRefused(f"groups nest deeper than {MAX_PATTERN_DEPTH}")
        if self._peek() == "?":
            self._at += 1
            kind = self._next()
            if kind == "P" and self._peek() == "<":
                self._at += 1
                kind = "<"
            if kind == "<" and self._peek() not in ("=", "!"):
                while self._next() != ">":
                    pass
            elif kind != ":":
                raise PatternRefused(
                    "a look-around or an inline flag (`(?...`), which this server does not build"
                )
        node = self._alternation(depth + 1)
        if self._next() != ")":
            raise PatternRefused("a group that is not closed")
        return node

    def _counts(self) -> tuple[int, int | None] | None:
        """`{n}`, `{n,}` or `{n,m}` at the reader's place (after the `{`), consumed; None (and
        nothing consumed) if the brace is a literal one."""
        found = re.match(r"(\d+)(,(\d*))?\}", self._text[self._at :])
        if found is None:
            return None
        self._at += found.end()
        least = int(found[1])
        most = least if found[2] is None else (int(found[3]) if found[3] else None)
        return least, most

    def _quantified(self, atom: _Node) -> _Node:
        char = self._peek()
        counts = _QUANTIFIERS.get(char)
        if counts is not None:
            self._at += 1
        elif char == "{":
            self._at += 1
            counts = self._counts()
            if counts is None:
                self._at -= 1
        if counts is None:
            return atom
        if self._peek() in ("?", "+"):  # lazy or possessive: the same strings match
            self._at += 1
        return _repeat(atom, *counts)

    def _escape(self, *, in_class: bool) -> str:
        char = self._next()
        if char in _CATEGORY_SAMPLES:
            return _CATEGORY_SAMPLES[char]
        if char in _ESCAPED:
            return _ESCAPED[char]
        if char in "bB":
            if in_class and char == "b":
                return "\b"
            if not in_class:
                return ""  # a word boundary: checked on the candidate
        if char == "0" and not self._peek().isdigit():
            return "\0"
        if char in "xu":
            digits = 2 if char == "x" else 4
            code = self._text[self._at : self._at + digits]
            if len(code) == digits and all(c in "0123456789abcdefABCDEF" for c in code):
                self._at += digits
                return chr(int(code, 16))
        if char.isalnum():
            raise PatternRefused(f"`\\{char}` (a back-reference or a property escape)")
        return char

    def _class(self) -> str:
        """The first readable character the class `[...]` (its `[` read) matches."""
        negated = self._peek() == "^"
        if negated:
            self._at += 1
        if self._peek() == "]":
            raise PatternRefused("a class that begins with `]`, read differently by dialects")
        ranges: list[tuple[str, str]] = []
        categories: list[str] = []
        while (char := self._next()) != "]":
            if char == "[" and self._peek() in (":", "=", "."):
                raise PatternRefused("a POSIX class (`[:...:]`)")
            if char == "\\":
                escaped = self._peek()
                if escaped in _CATEGORY_SAMPLES:
                    self._at += 1
                    categories.append(escaped)
                    continue
                char = self._escape(in_class=True)
            if self._peek() == "-" and self._peek(1) not in ("]", ""):
                self._at += 1
                high = self._next()
                if high == "\\":
                    if self._peek() in _CATEGORY_SAMPLES:
                        raise PatternRefused("a range that ends at a class escape")
                    high = self._escape(in_class=True)
                ranges.append((char, high))
            else:
                ranges.append((char, char))

        def inside(sample: str) -> bool:
            return any(low <= sample <= high for low, high in ranges) or any(
                _in_category(sample, category) for category in categories
            )

        for sample in _SAMPLES:
            if inside(sample) != negated:
                return sample
        if not negated and ranges:
            return ranges[0][0]
        raise PatternRefused("a class whose members this server does not find")


def _in_category(char: str, category: str) -> bool:
    test = {"d": str.isdigit, "w": lambda c: c.isalnum() or c == "_", "s": str.isspace}
    found = test[category.lower()](char)
    return found if category.islower() else not found


def _write(node: _Node, extra: int, *, exact: bool = False) -> str:
    """`node`'s shortest match, made about `extra` characters longer by repeating what may
    repeat, earliest first: whole copies past `extra`, or (`exact`) only those that fit, the
    rest left to a copy's own repeats and to what follows."""
    if node.body is not None:
        body, copies = node.body, node.least
        room = None if node.most is None else node.most - copies
        if extra > 0 and room != 0 and body.length > 0:
            more = extra // body.length if exact else -(-extra // body.length)
            more = more if room is None else min(more, room)
            copies, extra = copies + more, extra - more * body.length
        if extra > 0 and (copies > 0 or (room != 0 and body.length == 0)):
            return _write(body, extra, exact=exact) + _write(body, 0) * max(copies - 1, 0)
        return _write(body, 0) * copies
    if node.parts:
        written = []
        for part in node.parts:
            text = _write(part, extra, exact=exact)
            extra -= len(text) - part.length
            written.append(text)
        return "".join(written)
    return node.text


def matching_string(
    pattern: str,
    *,
    seed: str,
    least: int,
    most: int | None,
    limit: int,
    time_left: SearchTime | None = None,
) -> str:
    """A string that `pattern` matches (searched for, as JSON Schema does), `least` to `most`
    characters long: `seed` itself when it fits, else one built from the pattern. Raises
    `PatternRefused` for a pattern outside the subset, one whose shortest match is longer than
    `limit` characters, or where no candidate fits the lengths."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternRefused(f"it is longer than {MAX_PATTERN_CHARS} characters")
    try:
        re.compile(pattern)  # what a validator reads (jsonschema's `re`): read, never run
    except (re.error, RecursionError, OverflowError) as error:
        raise PatternRefused(f"it is not a regular expression ({error})") from None
    tree = _Reader(pattern).read()
    if tree.size > MAX_PATTERN_SIZE:
        raise PatternRefused(f"its repeats write out more than {MAX_PATTERN_SIZE} characters")
    if tree.length > limit:
        raise PatternRefused(f"its shortest match is longer than {limit} characters")
    try:
        compiled = regex.compile(pattern)  # what matches, within a time bound
    except (regex.error, RecursionError, OverflowError) as error:
        raise PatternRefused(f"it is not a regular expression ({error})") from None
    clock = time_left if time_left is not None else SearchTime()

    def fits(text: str) -> bool:
        if not least <= len(text) <= (most if most is not None else len(text)):
            return False
        return clock.search(compiled, text)

    if fits(seed):
        return seed
    shortest = _write(tree, 0)
    candidates = [shortest]
    if len(shortest) < least:
        missing = least - len(shortest)
        candidates += [
            _write(tree, missing, exact=True),
            _write(tree, missing),
            shortest + "x" * missing,
        ]
    for text in candidates:
        if len(text) <= max(limit, least) and fits(text):
            return text
    if most is not None and len(shortest) > most:
        raise PatternRefused(f"its shortest match is longer than maxLength {most}")
    raise PatternRefused(
        "no string this server builds from it matches it"
        + (f" with at least {least} characters" if least > len(shortest) else "")
    )
