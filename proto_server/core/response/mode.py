"""The dialect, as the Response machine sees it: what a Response does when its model calls tools."""

from __future__ import annotations

import enum


class Mode(enum.Enum):
    """How a Response meets the tool calls its model makes: the dialect, as one value."""

    #: Launched (WebSocket mode, HTTP): the calls end the Response; the next create answers.
    SUCCESSOR = "successor"
    #: Prototype: it suspends, says `response.done`, and `response.append` resumes it.
    SUSPEND = "suspend"
    #: The multi-agent beta: it waits, silently, for `response.inject`; clients act on each
    #: call's `output_item.done`.
    WAIT = "wait"
