"""Where a store is: a file, `:memory:` or a PostgreSQL URL, and how it may be printed."""

from __future__ import annotations

import re


def is_postgres_url(text: str) -> bool:
    return text.startswith(("postgresql://", "postgres://"))


def redact(location: str) -> str:
    """A store's location as it may be printed: a URL's password left out."""
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", location)
