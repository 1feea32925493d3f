"""Structured, quiet-by-default logs: one line per event, `event key=value ...`."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("proto_server")

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        pairs = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
        when = self.formatTime(record, "%H:%M:%S")
        line = f"{when} {record.levelname.lower()} {record.getMessage()}"
        line = f"{line} {pairs}" if pairs else line
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def _quote(value: Any) -> str:
    text = str(value)
    return repr(text) if (" " in text or not text) else text


def configure(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter())
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False
