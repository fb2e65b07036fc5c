"""A PostgreSQL server for the tests: the one VESTI_TEST_POSTGRES names, or
one of their own started from the binaries Debian installs."""
import collections
import concurrent.futures
import contextlib
import itertools
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import urllib.parse

import vesti


def postgres_binaries():
    found = sorted(pathlib.Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return found[-1].parent if found else None


class PostgresServer:
    """Databases for the tests of one pytest process: each is a copy of a
    template migrated once, dropped after its test. The next AHEAD are
    copied while tests run, side by side: one copy at a time took 0.2 to
    0.4 s of waiting on the server, which copies made at once share."""

    ahead = 3

    def __init__(self, url):
        import psycopg
        self.psycopg, self.url = psycopg, url
        self.prefix = f"vesti_test_{os.getpid()}"
        self.template = f"{self.prefix}_template"
        self.count = itertools.count()
        self.background = concurrent.futures.ThreadPoolExecutor(self.ahead or 1)
        self.coming = collections.deque()
        # What an earlier process of the same id left behind (killed before
        # it dropped its databases) would stand in the way of this one's.
        with self.psycopg.connect(self.url, autocommit=True) as conn:
            left = [row[0] for row in conn.execute(
                "SELECT datname FROM pg_database WHERE datname LIKE %s", (f"{self.prefix}\\_%",))]
        for name in left:
            self.drop(self.database_url(name))
        self.admin(f"CREATE DATABASE {self.template}")
        vesti.Database(self.database_url(self.template)).close()

    def admin(self, statement):
        # A connection each time: a server of our own may have restarted since.
        with self.psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(statement)

    def database_url(self, name):
        parts = urllib.parse.urlsplit(self.url)
        return urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))

    def copy(self):
        name = f"{self.prefix}_{next(self.count)}"
        self.admin(f"CREATE DATABASE {name} TEMPLATE {self.template}")
        return self.database_url(name)

    def database(self):
        """The URL of a new database."""
        while len(self.coming) < self.ahead + 1:
            self.coming.append(self.background.submit(self.copy))
        return self.coming.popleft().result()

    def drop(self, url):
        name = urllib.parse.urlsplit(url).path.lstrip("/")
        self.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def done_with(self, url):
        """Drop a test's database: meanwhile the next test runs (a drop
        took a tenth of a second or more), unless the server is one a test
        may stop."""
        if self.ahead:
            self.background.submit(self.drop, url)
        else:
            self.drop(url)

    def close(self):
        while self.coming:
            self.drop(self.coming.popleft().result())
        self.background.shutdown()
        self.drop(self.database_url(self.template))


class OwnPostgresServer(PostgresServer):
    """A PostgreSQL server of this process's own, in a temporary directory,
    so a test can restart it without disturbing the other processes' tests
    (as a non-root user: PostgreSQL refuses to run as root)."""

    ahead = 0               # a copy under way would fail while a test has it stopped

    def __init__(self):
        self.bin = postgres_binaries()
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="vesti-pg-"))
        self.root.chmod(0o777)
        self.data = self.root / "pgdata"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.run("initdb", "-D", str(self.data), "-U", "vesti", "--auth=trust", "-E", "UTF8",
                 "--locale=C.UTF-8")
        self.start()
        super().__init__(f"postgresql://vesti@127.0.0.1:{self.port}/postgres")

    def run(self, tool, *args):
        subprocess.run([*self.as_user, str(self.bin / tool), *args], check=True,
                       capture_output=True, timeout=60)

    def start(self):
        self.run("pg_ctl", "-D", str(self.data), "-w", "-l", str(self.root / "log"),
                 "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                       f"-c fsync=off", "start")
        self.running = True

    def stop(self):
        self.run("pg_ctl", "-D", str(self.data), "-w", "-m", "fast", "stop")
        self.running = False

    def admin(self, statement):
        if not self.running:            # a test that stopped it failed before it started it
            self.start()
        super().admin(statement)

    def close(self):
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
