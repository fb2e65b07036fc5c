"""What the tests of vesti.py stand on: a home for each test on SQLite or
PostgreSQL, and the real servers and fakes around VESTI (feeds, Ollama,
Telegram, slow peers, the web page and a browser for it)."""

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import gzip
import hashlib
import hmac
import html.parser
import http.client
import http.server
import inspect
import itertools
import json
import os
import pathlib
import re
import py_compile
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zlib

import pytest
from telethon import TelegramClient, errors as tg_errors
from telethon.sessions import MemorySession
from telethon.tl import types as tg

import vesti
from tests.chromium import Chromium

ROOT = pathlib.Path(__file__).resolve().parent
# The real feeds, pages and URL vectors the tests read: the repository's
# copy of what they need of the shared corpus (see its README.md).
CORPUS = ROOT / "tests" / "fixtures" / "corpus"

# The command that runs vesti.py as `python vesti.py` does (the same argv[0]
# and sys.path[0]), but from its cached bytecode: Python compiles a script
# afresh each time it runs one, which took 0.3 s of every command a test ran.
VESTI = [sys.executable, "-c", "import os, runpy, sys; sys.argv.pop(0); "
         "sys.path[0] = os.path.dirname(sys.argv[0]); "
         "runpy.run_module('vesti', run_name='__main__', alter_sys=True)", str(ROOT / "vesti.py")]
# That bytecode is written here, once: with PYTHONDONTWRITEBYTECODE set (as
# some shells and CI runners do) no command would write it, and each would
# compile vesti.py again.
with contextlib.suppress(OSError, py_compile.PyCompileError):
    py_compile.compile(str(ROOT / "vesti.py"), doraise=True)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """With -n, a process that runs out of tests takes half of what another
    has left (unless --dist says otherwise)."""
    if config.pluginmanager.hasplugin("xdist") and config.option.dist == "no":
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(items):
    """The slow tests first, so the quick ones even out the end: neither
    process waits long for the other's last test."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def away_from_the_checkout(tmp_path, monkeypatch):
    """Every test runs in a directory of its own: VESTI's defaults
    (sources.yaml, .env, vesti.db in the working directory) never reach the
    checkout's, which a newsroom edits."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def cheap_password_hashes(monkeypatch):
    """Passwords hashed in a test's own process cost scrypt's least
    (N=2**10, p=1) instead of a tenth of a second each: a hash carries its
    parameters, so it checks as any other. The commands a test runs keep
    the real cost (test_the_user_command_adds_lists_and_disables_accounts
    checks it)."""
    monkeypatch.setattr(vesti, "SCRYPT", {"n": 2 ** 10, "r": 8, "p": 1})


# A home: settings, sources.yaml and a database -------------------------------

SOURCES_YAML = """\
directions:
  linux:
    title: Linux
    keywords: [linux, kernel, ядро]
  space:
    title: Space
    keywords: [rocket, orbit]
sources:
{sources}
"""

# The database URL of the running test (None: a SQLite file in its home).
BACKEND = {"db": None}


def write_sources(path, sources):
    lines = []
    for s in sources:
        lines.append(f"  - slug: {s['slug']}")
        for key in ("name", "crawler", "url", "direction", "priority", "enabled"):
            if key in s:
                lines.append(f"    {key}: {json.dumps(s[key])}")
    pathlib.Path(path).write_text(SOURCES_YAML.format(sources="\n".join(lines) or "  []"),
                                  encoding="utf-8")


def make_settings(home, **overrides):
    env = {"RSS_TIMEOUT": "2", "RSS_HOST_DELAY": "0", "OLLAMA_URL": "",
           "VESTI_RETRY_DELAY": "0"}
    env.update({k: str(v) for k, v in overrides.items()})
    return vesti.load_settings(environ=env, env_file=None, db=BACKEND["db"] or str(home / "vesti.db"),
                               sources=str(home / "sources.yaml"))


def rss_source(slug, url, **extra):
    return {"slug": slug, "crawler": "rss", "url": url, **extra}


@pytest.fixture
def home(tmp_path, monkeypatch, backend):
    """A working directory with its own database and sources.yaml."""
    monkeypatch.chdir(tmp_path)
    for name in [n for n, *_ in vesti.SETTINGS]:
        monkeypatch.delenv(name, raising=False)
    BACKEND["db"] = backend
    yield tmp_path
    BACKEND["db"] = None


# PostgreSQL ------------------------------------------------------------------

# Tests marked `both` run twice: on a SQLite file and on a PostgreSQL database
# of their own, made from a migrated template on the server VESTI_TEST_POSTGRES
# names (a postgresql:// URL of a role that may create databases; .ci/run
# starts one). Without it the PostgreSQL half is skipped.
POSTGRES_SERVER = os.environ.get("VESTI_TEST_POSTGRES", "")


def both(test):
    test.backends = ["sqlite", "postgresql"]
    return test


def postgres_only(test):
    """For what only PostgreSQL has (a server of its own, copies between the two)."""
    test.backends = ["postgresql"]
    return test


def restarts_postgres(test):
    """For a test that stops and starts the database server: its database is
    on a server of this process's own, which needs only Debian's PostgreSQL
    binaries (not VESTI_TEST_POSTGRES)."""
    test.backends = ["postgresql"]
    return pytest.mark.parametrize("postgres_server", ["own"], indirect=True)(test)


def pytest_generate_tests(metafunc):
    if hasattr(metafunc.function, "backends"):
        metafunc.parametrize("backend", metafunc.function.backends, indirect=True)


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
        self.admin(f"DROP DATABASE IF EXISTS {self.template}")
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


@pytest.fixture(scope="session")
def postgres_server(request):
    """The server VESTI_TEST_POSTGRES names, or ("own", see restarts_postgres)
    one this process starts."""
    if getattr(request, "param", None) == "own":
        if postgres_binaries() is None or (os.geteuid() == 0 and shutil.which("runuser") is None):
            pytest.skip("no PostgreSQL server binaries (Debian's postgresql package) here")
        pytest.importorskip("psycopg")
        server = OwnPostgresServer()
    elif not POSTGRES_SERVER:
        pytest.skip("no PostgreSQL server: set VESTI_TEST_POSTGRES to a postgresql:// URL "
                    "of a role that may create databases (.ci/run starts one)")
    else:
        server = PostgresServer(POSTGRES_SERVER)
    yield server
    server.close()


@pytest.fixture
def backend(request):
    """None for SQLite, or the URL of a fresh PostgreSQL database."""
    if getattr(request, "param", "sqlite") == "sqlite":
        yield None
        return
    server = request.getfixturevalue("postgres_server")
    url = server.database()
    yield url
    server.done_with(url)


# Waiting ---------------------------------------------------------------------

def wait_for(condition, timeout=20, state=None, patient=False):
    """Polls condition() until it holds, for at most `timeout` seconds, then
    fails the test naming the condition and the last state() (what the
    condition looks at, e.g. the queue's counts). `patient`: the timeout
    counts from state()'s last change instead, so a loaded machine that is
    still getting there is waited for, and a stuck one is not. Returns True,
    so a call reads as the assertion it is."""
    last = state() if state else None
    deadline = time.monotonic() + timeout
    while not condition():
        if state:
            now = state()
            if patient and now != last:
                deadline = time.monotonic() + timeout
            last = now
        if time.monotonic() > deadline:
            unchanged = " without a change" if patient else ""
            pytest.fail(f"{timeout} s{unchanged} and still not true: {described(condition)}"
                        + (f"\nlast seen: {last!r}" if state else ""))
        time.sleep(0.05)
    return True


def described(function):
    with contextlib.suppress(OSError, TypeError):
        return inspect.getsource(function).strip()
    return repr(function)


# Feeds and the hosts around them ---------------------------------------------

class LoopbackServer:
    """A real ThreadingHTTPServer on a loopback address, in a thread."""

    def serve(self, handler, host="127.0.0.1"):
        self.httpd = http.server.ThreadingHTTPServer((host, 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class FeedServer(LoopbackServer):
    """Feeds on a loopback address; each path answers with a
    handler(request) -> (status, headers, body) or does its own writing."""

    def __init__(self, host="127.0.0.1"):
        self.routes, self.requests = {}, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                server.requests.append((self.path, dict(self.headers), time.monotonic()))
                route = server.routes.get(self.path)
                if route is None:
                    return self.answer(404, {}, b"not found")
                result = route(self)
                if result is not None:
                    self.answer(*result)

            def answer(self, status, headers, body):
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.serve(Handler, host)

    def feed(self, path, body, etag='"v1"', modified="Mon, 30 Nov 2026 10:00:00 GMT",
             content_type="application/rss+xml; charset=utf-8", encoding=None):
        """Serve a feed with validators, answering 304 when they match."""
        def handler(request):
            if etag and request.headers.get("If-None-Match") == etag:
                return 304, {"ETag": etag}, b""
            headers = {"Content-Type": content_type}
            if etag:
                headers["ETag"] = etag
            if modified:
                headers["Last-Modified"] = modified
            data = body
            if encoding == "gzip":
                data, headers["Content-Encoding"] = gzip.compress(body), "gzip"
            elif encoding == "deflate":
                data, headers["Content-Encoding"] = zlib.compress(body), "deflate"
            return 200, headers, data
        self.routes[path] = handler

    def status(self, path, code, headers=None, body=b""):
        self.routes[path] = lambda request: (code, headers or {}, body)

    def redirect(self, path, code, target):
        self.status(path, code, {"Location": target})

    def sent(self, path):
        return [headers for p, headers, _ in self.requests if p == path]


@pytest.fixture
def server():
    s = FeedServer()
    yield s
    s.close()


@pytest.fixture
def internal():
    """The "internal" host: a server on another loopback address that a feed
    on 127.0.0.1 has no business reaching."""
    srv = FeedServer("127.0.0.2")
    srv.page = (CORPUS / "html" / "bbc.com.52241221.html").read_bytes()
    srv.secret = json.loads((CORPUS / "html" / "expected.json").read_text()
                            )["pages"]["bbc.com.52241221.html"]["with"][0]
    srv.routes["/secret"] = lambda request: (200, {"Content-Type": "text/html"}, srv.page)
    yield srv
    srv.close()


class DripServer:
    """A raw TCP server on a loopback address that reads the request, sends a
    status line and the start of a header, then one more header byte every
    `every` seconds: the headers never end. Every loop is bounded: a
    connection drips for `lifetime` seconds at most, accept() gives up after
    `lifetime` too, and close() stops everything at once."""

    def __init__(self, host="127.0.0.1", every=0.2, lifetime=30.0):
        self.every, self.lifetime = every, lifetime
        self.connections = 0
        self.stopped = threading.Event()
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(0.05)
        self.url = f"http://{host}:{self.listener.getsockname()[1]}"
        self.threads = [threading.Thread(target=self.accept, daemon=True)]
        self.threads[0].start()

    def accept(self):
        ends = time.monotonic() + self.lifetime
        while not self.stopped.is_set() and time.monotonic() < ends:
            try:
                conn, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            self.connections += 1
            thread = threading.Thread(target=self.drip, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def drip(self, conn):
        ends = time.monotonic() + self.lifetime
        with conn, contextlib.suppress(OSError):
            conn.settimeout(1)
            conn.recv(65536)                                  # the request
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not self.stopped.wait(self.every) and time.monotonic() < ends:
                conn.sendall(b"x")

    def close(self):
        self.stopped.set()
        for thread in list(self.threads):
            thread.join(2)
        self.listener.close()


class TcpListener:
    """A bare TCP port that only records whether anyone connected."""

    def __init__(self, host="127.0.0.1"):
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.connected = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.accept, daemon=True)
        self.thread.start()

    def accept(self):
        ends = time.monotonic() + 30
        while not self.stopped.is_set() and time.monotonic() < ends:
            try:
                conn, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            self.connected.set()
            conn.close()

    def close(self):
        self.stopped.set()
        self.thread.join(2)
        self.listener.close()


# Ollama ----------------------------------------------------------------------

class FakeOllama(LoopbackServer):
    """Speaks Ollama's /api/chat: answers with a verdict, or misbehaves.
    `mode`: "ok", or "500", "garbage", "bad-verdict" or "hang" for every post;
    `fails_on`: answers HTTP 500 for the posts whose text has these words;
    `reason`: the reason each verdict gives;
    `latency`: seconds of thinking before each answer;
    `keep_alive`: keeps connections open as the real one does (HTTP/1.1);
    `drops`: then closes each one after its answer all the same, unsaid."""

    def __init__(self, mode="ok", latency=0.0, keep_alive=False, drops=False, fails_on=None,
                 reason=None):
        self.mode, self.latency, self.requests = mode, latency, []
        self.fails_on, self.reason = fails_on, reason
        self.connections = []       # the client's address of each request
        self.lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"
            disable_nagle_algorithm = keep_alive    # as Ollama (Go) sends

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append((self.path, body))
                    fake.connections.append(self.client_address)
                self.close_connection = drops
                time.sleep(fake.latency)
                status, answer = fake.answer(body)
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.serve(Handler)

    def verdict(self, body):
        verdict = {"direction": "linux", "relevance": 8, "interest": 6,
                   "summary": "Summary: " + body["messages"][-1]["content"].splitlines()[0]}
        if self.reason:
            verdict["reason"] = self.reason
        return verdict

    def answer(self, body):
        if self.fails_on and self.fails_on in body["messages"][-1]["content"]:
            return 500, {"error": "cannot classify this one"}
        if self.mode == "500":
            return 500, {"error": "model crashed"}
        if self.mode == "garbage":
            return 200, b"<html>not json</html>"
        if self.mode == "bad-verdict":
            return 200, {"model": "m", "message": {"role": "assistant",
                                                   "content": '{"direction": "sport"}'}, "done": True}
        if self.mode == "hang":
            time.sleep(5)
        content = json.dumps(self.verdict(body), ensure_ascii=False)
        return 200, {"model": body["model"], "created_at": "2026-11-30T10:00:00Z",
                     "message": {"role": "assistant", "content": content},
                     "done_reason": "stop", "done": True}

    def titles(self):
        with self.lock:
            return [body["messages"][-1]["content"].splitlines()[0] for _, body in self.requests]


@pytest.fixture
def ollama():
    fake = FakeOllama()
    yield fake
    fake.close()


# Publishing ------------------------------------------------------------------

class BotHtml(html.parser.HTMLParser):
    """Checks a message's HTML as the Bot API does: only the tags it knows,
    each closed in order, every <, > and & that is not markup escaped (as
    &lt; &gt; &amp; &quot; or a numeric entity); the text as it would show,
    for the 4096 limit (Telegram counts UTF-16 code units)."""
    TAGS = {"b", "strong", "i", "em", "u", "ins", "s", "strike", "del", "a", "code", "pre",
            "tg-spoiler", "span", "blockquote", "tg-emoji"}
    BARE = re.compile(r"&(?!(?:lt|gt|amp|quot|#[0-9]+|#x[0-9a-fA-F]+);)|<|>")
    TAG = re.compile(r'<(/?)([a-z-]+)((?:\s+[a-z-]+="[^"<>]*")*)\s*>')

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.open, self.text, self.problem = [], [], None

    def feed(self, data):
        bare = self.BARE.search(self.TAG.sub("", data))
        if bare:
            self.problem = self.problem or f"unsupported start tag or bare {bare[0]!r}"
        super().feed(data)

    def handle_starttag(self, tag, attrs):
        if tag not in self.TAGS:
            self.problem = self.problem or f"unsupported start tag \"{tag}\""
        self.open.append(tag)

    def handle_endtag(self, tag):
        if not self.open or self.open[-1] != tag:
            self.problem = self.problem or f"unmatched end tag \"{tag}\""
        else:
            self.open.pop()

    def handle_data(self, data):
        self.text.append(data)


class FakeBotApi(LoopbackServer):
    """Speaks the Telegram Bot API as its documentation describes it: POST
    /bot<token>/<method> with a JSON body; answers {"ok": true, "result": …}
    or {"ok": false, "error_code": …, "description": …, "parameters": …}
    with the same HTTP status. `chats`: the chats the bot may post to (any
    other is 400 "chat not found"); `not_member`: chats it was removed from
    (403); `script`: what the next sendMessage calls meet, in turn: "ok",
    ("429", seconds), ("500",) (not posted), ("400", description) (refused),
    ("hang", seconds): the message
    is posted and the answer comes that much later; ("close", seconds): it
    is posted, and the connection closed that much later without an
    answer; ("posted-502", seconds): it is posted and a proxy's 502 page
    comes that much later."""

    TOKEN = "123456789:AAE-test-token_secret"

    def __init__(self, chats=("@vesti_test", "-1001234567890"), not_member=()):
        self.chats, self.not_member = set(chats), set(not_member)
        self.script, self.messages, self.deleted, self.calls = [], [], [], []
        self.next_id = 100
        self.lock = threading.Lock()
        self.posted = threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                token, _, method = self.path.removeprefix("/bot").partition("/")
                status, answer, wait = fake.answer(token, method, body)
                if wait:
                    time.sleep(wait)
                if answer == "close":
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                data = json.dumps(answer).encode() if isinstance(answer, dict) else answer
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

            def log_message(self, *args):
                pass

        self.serve(Handler)

    @staticmethod
    def error(code, description, **parameters):
        answer = {"ok": False, "error_code": code, "description": description}
        if parameters:
            answer["parameters"] = parameters
        return code, answer, 0

    def answer(self, token, method, body):
        with self.lock:
            try:
                payload = json.loads(body)
            except ValueError:
                return self.error(400, "Bad Request: invalid JSON")
            self.calls.append((method, payload, time.time()))
            if token != self.TOKEN:
                return self.error(401, "Unauthorized")
            chat = str(payload.get("chat_id"))
            if chat in self.not_member:
                return self.error(403, "Forbidden: bot is not a member of the channel chat")
            if chat not in self.chats:
                return self.error(400, "Bad Request: chat not found")
            if method == "sendMessage":
                return self.send_message(chat, payload)
            if method == "deleteMessage":
                found = [m for m in self.messages if m["chat"] == chat
                         and m["message_id"] == payload.get("message_id")]
                if not found:
                    return self.error(400, "Bad Request: message to delete not found")
                self.messages.remove(found[0])
                self.deleted.append(found[0])
                return 200, {"ok": True, "result": True}, 0
            return self.error(404, "Not Found")

    def send_message(self, chat, payload):
        step = self.script.pop(0) if self.script else "ok"
        if step[0] == "429":
            return self.error(429, f"Too Many Requests: retry after {step[1]}",
                              retry_after=step[1])
        if step[0] == "500":
            return self.error(500, "Internal Server Error")
        if step[0] == "400":
            return self.error(400, step[1])
        text = payload.get("text") or ""
        parsed = BotHtml()
        if payload.get("parse_mode") == "HTML":
            parsed.feed(text)
            parsed.close()
            if parsed.problem or parsed.open:
                return self.error(400, "Bad Request: can't parse entities: "
                                  + (parsed.problem or f"unclosed tag \"{parsed.open[-1]}\""))
            shown = "".join(parsed.text)
        else:
            shown = text
        if not shown.strip():
            return self.error(400, "Bad Request: message text is empty")
        if len(shown.encode("utf-16-le")) // 2 > 4096:
            return self.error(400, "Bad Request: message is too long")
        self.next_id += 1
        message = {"message_id": self.next_id, "chat": chat, "text": text, "shown": shown,
                   "date": int(time.time()), "at": time.time()}
        self.messages.append(message)
        self.posted.set()
        if step[0] == "close":
            return 200, "close", step[1]
        if step[0] == "posted-502":
            return 502, b"<html><body><h1>502 Bad Gateway</h1></body></html>", step[1]
        result = {"message_id": self.next_id, "date": message["date"],
                  "chat": {"id": -1001234567890, "type": "channel", "title": "VESTI test"},
                  "text": shown}
        return 200, {"ok": True, "result": result}, step[1] if step[0] == "hang" else 0

    def sent(self):
        with self.lock:
            return [m["text"] for m in self.messages + self.deleted]


@pytest.fixture
def bot():
    fake = FakeBotApi()
    yield fake
    fake.close()


class WebhookReceiver(LoopbackServer):
    """A webhook's receiving end: checks X-Vesti-Signature with `secret`,
    keeps every delivery (headers, JSON body), and answers in turn what
    `script` says: a status, or ("hang", seconds, status): the delivery is
    kept and the answer comes that much later; 200 once it is used up.
    `received` is set on each delivery."""

    def __init__(self, secret):
        self.secret, self.script, self.deliveries, self.refused = secret, [], [], 0
        self.lock = threading.Lock()
        self.received = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                expected = "sha256=" + hmac.new(receiver.secret.encode(), body,
                                                hashlib.sha256).hexdigest()
                with receiver.lock:
                    if not hmac.compare_digest(self.headers.get("X-Vesti-Signature", ""), expected):
                        receiver.refused += 1
                        status, headers = 401, {}
                    else:
                        receiver.deliveries.append((dict(self.headers), json.loads(body)))
                        status = receiver.script.pop(0) if receiver.script else 200
                        receiver.received.set()
                        headers = {"Retry-After": "1"} if status == 429 else {}
                if isinstance(status, tuple):
                    time.sleep(status[1])
                    status = status[2]
                answer = json.dumps({"received": status == 200}).encode()
                with contextlib.suppress(OSError):
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.serve(Handler)


# Telegram --------------------------------------------------------------------

class FakeTelegram:
    """Telethon's real TelegramClient with only its network layer replaced:
    every request it sends reaches `answer`, which speaks Telegram's TL types
    over fixed channel histories, and is counted by type."""

    def __init__(self, history=(), authorized=True, flood=(), channels=None):
        self.channels = channels if channels is not None else {"linuxnews": list(history)}
        self.authorized = authorized
        self.flood = list(flood)          # FloodWait seconds for the next history requests
        self.flood_on = {}                # username -> seconds, once
        self.hashes = {}                  # username -> access hash Telegram accepts now
        self.drop_connection = 0          # history requests to fail with ConnectionError
        self.requests = []
        self.connects = 0

    @property
    def history(self):
        return self.channels["linuxnews"]

    @history.setter
    def history(self, messages):
        self.channels["linuxnews"] = messages

    def count(self, name):
        return sum(r == name for r in self.requests)

    def __call__(self, settings):
        fake = self

        class Client(TelegramClient):
            async def connect(self):
                fake.connects += 1

            async def disconnect(self):
                pass

            async def is_user_authorized(self):
                return fake.authorized

        client = Client(MemorySession(), 1, "0" * 32, flood_sleep_threshold=0)
        client._sender.send = self.send
        return client

    def send(self, request, ordered=False):
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self.answer(request))
        except BaseException as e:
            future.set_exception(e)
        return future

    def channel_id(self, name):
        return 1000 + sorted(self.channels).index(name)

    def answer(self, request):
        name = type(request).__name__
        self.requests.append(name)
        if name == "ResolveUsernameRequest":
            username = request.username.lower()
            if username not in self.channels:
                raise tg_errors.UsernameNotOccupiedError(request=request)
            cid = self.channel_id(username)
            self.hashes.setdefault(username, cid * 7)
            chat = tg.Channel(id=cid, title=username, photo=tg.ChatPhotoEmpty(), date=None,
                              broadcast=True, access_hash=self.hashes[username],
                              username=username)
            return tg.contacts.ResolvedPeer(peer=tg.PeerChannel(cid), chats=[chat], users=[])
        if name == "GetHistoryRequest":
            if self.drop_connection:
                self.drop_connection -= 1
                raise ConnectionError("Cannot send requests while disconnected")
            username = next(n for n in self.channels if self.channel_id(n) == request.peer.channel_id)
            if self.flood:
                raise tg_errors.FloodWaitError(request=request, capture=self.flood.pop(0))
            if username in self.flood_on:
                raise tg_errors.FloodWaitError(request=request,
                                               capture=self.flood_on.pop(username))
            if request.peer.access_hash != self.hashes.get(username):
                raise tg_errors.ChannelInvalidError(request=request)
            return self.history_page(self.channels[username], request)
        raise AssertionError(f"unexpected request {name}")

    @staticmethod
    def history_page(history, request):
        """messages.getHistory: newest first, from offset_id (exclusive)
        moved by add_offset, at most limit, within min_id and max_id."""
        newest_first = sorted(history, key=lambda m: m.id, reverse=True)
        start = next((i for i, m in enumerate(newest_first) if m.id < request.offset_id),
                     len(newest_first)) if request.offset_id else 0
        start += request.add_offset
        page = newest_first[max(0, start):max(0, start + request.limit)]
        page = [m for m in page if m.id > request.min_id and
                (not request.max_id or m.id < request.max_id)]
        return tg.messages.ChannelMessages(pts=1, count=len(history), messages=page, topics=[],
                                           chats=[], users=[])


# The web page ----------------------------------------------------------------

class Web:
    """The real web server of VESTI on a free port, and a client for it."""

    def __init__(self, home, password="s3cret", settings=None):
        if settings is None:
            write_sources(home / "sources.yaml", [rss_source(
                "lwn", "https://lwn.net/headlines/rss", direction="linux")])
        self.settings = settings or make_settings(home, VESTI_WEB_PASSWORD=password)
        self.registry, self.db = vesti.open_intake(self.settings)
        self.app = vesti.WebApp(self.db, self.settings, self.registry, password)
        self.server = vesti.make_web_server(self.app, "127.0.0.1", 0)
        self.port = self.server.server_address[1]
        self.origin = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.auth = "Basic " + base64.b64encode(f"admin:{password}".encode()).decode()

    def request(self, method, path, body=None, headers=None, auth=True):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        all_headers = {"Authorization": self.auth} if auth else {}
        if body is not None:
            all_headers["Content-Type"] = "application/x-www-form-urlencoded"
        all_headers.update(headers or {})
        conn.request(method, path, body=body, headers=all_headers)
        response = conn.getresponse()
        text = response.read().decode("utf-8")
        conn.close()
        return response.status, dict(response.getheaders()), text

    def get(self, path, **kwargs):
        return self.request("GET", path, **kwargs)

    def post(self, path, form, origin=None, headers=None, **kwargs):
        headers = {"Origin": origin or self.origin, **(headers or {})}
        return self.request("POST", path, urllib.parse.urlencode(form), headers, **kwargs)

    def token(self):
        return self.app.token()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def web(home):
    w = Web(home)
    yield w
    w.close()


class SlowClients:
    """`count` connections to the page from the loopback addresses `hosts`,
    each sending one byte of an endless header every `every` seconds and
    connecting again as soon as the server drops it, all from one thread."""

    REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "

    def __init__(self, port, hosts, count, every):
        self.port, self.every = port, every
        self.hosts = [hosts[i % len(hosts)] for i in range(count)]
        self.connections = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.attack, daemon=True)
        self.thread.start()

    def connect(self, host):
        sock = socket.socket()
        sock.setblocking(False)                 # a full backlog holds no other client
        try:
            sock.bind((host, 0))
        except OSError:
            sock.close()
            return None
        sock.connect_ex(("127.0.0.1", self.port))
        self.connections += 1
        return sock

    def attack(self):
        socks, sent = [None] * len(self.hosts), [0] * len(self.hosts)
        # The first connections are spread over a second, as clients' are.
        due = [time.monotonic() + i / len(socks) for i in range(len(socks))]
        next_byte = time.monotonic()
        while not self.stopped.is_set():
            waits = [next_byte] + [d for s, d in zip(socks, due) if s is None]
            dropped = select.select([s for s in socks if s is not None], [], [],
                                    max(0, min(waits) - time.monotonic()))[0]
            for i, sock in enumerate(socks):
                if sock is not None and sock in dropped:     # closed or answered: again
                    sock.close()
                    socks[i], sent[i], due[i] = None, 0, 0
                if socks[i] is None and due[i] <= time.monotonic():
                    socks[i] = self.connect(self.hosts[i])
            if time.monotonic() >= next_byte:
                next_byte += self.every
                for i, sock in enumerate(socks):
                    with contextlib.suppress(OSError, AttributeError):
                        sock.send(self.REQUEST[sent[i]:sent[i] + 1] or b"z")
                        sent[i] += 1
        for sock in socks:
            if sock is not None:
                sock.close()

    def close(self):
        self.stopped.set()
        self.thread.join(10)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """One headless Chromium for the browser tests (starting one takes a while)."""
    browser = Chromium(tmp_path_factory.mktemp("chromium"))
    yield browser
    browser.close()


@pytest.fixture
def browser(chromium):
    chromium.new_page()
    return chromium
