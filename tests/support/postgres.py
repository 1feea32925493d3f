"""A real PostgreSQL for the tests (marker `postgres`): a throwaway cluster per session.

The cluster lives in a temporary directory, listens on a free loopback port (and a socket in
that directory), and is removed at the end. PostgreSQL refuses to run as root, so under root
(as CI runs) it runs as the `postgres` user the Debian package creates. Without the server
binaries the tests are skipped and say what to install; in CI (`CI` set) they fail instead.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .servers import free_port

INSTALL = "apt-get install postgresql (the Debian package: initdb, pg_ctl, postgres)"


def server_binaries() -> Path:
    """The directory of `initdb` and `pg_ctl`, or a skip (a failure in CI)."""
    found = shutil.which("initdb")
    if found is not None:
        return Path(found).resolve().parent
    for directory in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(directory, "initdb").exists():
            return Path(directory)
    message = f"no PostgreSQL server here; install it: {INSTALL}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (.ci/run must install it)", pytrace=False)
    pytest.skip(message)


class Cluster:
    """One PostgreSQL cluster; `stop()` and `start()` take it away and bring it back."""

    def __init__(self, binaries: Path, root: Path) -> None:
        self.binaries = binaries
        self.data = root / "data"
        self.log = root / "postgres.log"
        self.sockets = root
        self.port = free_port()
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @property
    def url(self) -> str:
        return self.database("postgres")

    def database(self, name: str) -> str:
        return f"postgresql://proto@127.0.0.1:{self.port}/{name}"

    def _run(self, *command: str) -> None:
        subprocess.run([*self._as, *command], check=True, capture_output=True, timeout=120)

    def create(self) -> None:
        self._run(str(self.binaries / "initdb"), "-D", str(self.data), "-U", "proto",
                  "--auth=trust", "--no-sync", "-E", "UTF8")  # fmt: skip
        self.start()

    def start(self) -> None:
        options = f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(self.binaries / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                  "-o", options, "-w", "start")  # fmt: skip

    def stop(self) -> None:
        self._run(str(self.binaries / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                  "-w", "stop")  # fmt: skip


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    binaries = server_binaries()
    root = Path(tempfile.mkdtemp(prefix="proto-server-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    cluster = Cluster(binaries, root)
    try:
        cluster.create()
        yield cluster
    finally:
        subprocess.run([*cluster._as, str(binaries / "pg_ctl"), "-D", str(cluster.data), "-m",
                        "immediate", "stop"], capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(postgres: Cluster, request: pytest.FixtureRequest) -> str:
    """A new, empty database of the session's cluster, for one test (marked `postgres`, as
    `-m 'not postgres'` needs: asked for by `getfixturevalue` too, which collection cannot see)."""
    if request.node.get_closest_marker("postgres") is None:
        pytest.fail(f"{request.node.nodeid} uses PostgreSQL without the postgres marker")
    import uuid

    import psycopg

    name = f"test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres.database(name)
