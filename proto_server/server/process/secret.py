"""The server's kept secret (it seals compaction items): one file, made on first start.

A restarted server must still verify the compaction items it handed out, so the secret lives in
a file (mode 0600), by default next to the store file. It is made atomically: two servers
starting at once on the same store end up with the same secret.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def secret_path_for_store(store: str | Path) -> Path:
    return Path(f"{store}.compaction-secret")


def load_or_create_secret(path: Path) -> bytes:
    """The secret kept in `path` (hex), or a new random one written there if there is none."""
    if not path.exists():
        fresh = secrets.token_bytes(32)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as file:
                file.write(fresh.hex() + "\n")
            with contextlib.suppress(FileExistsError):  # another server made one first: keep it
                os.link(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    text = path.read_text().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ValueError(f"{path} does not hold a secret (at least 32 hex digits)")
    return secret
