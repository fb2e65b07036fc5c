"""What the tests of vesti.py stand on: a home for each test on SQLite or
PostgreSQL, and fixtures for the real servers and fakes around VESTI (in
tests/: feeds and slow peers in servers.py, Ollama, the Bot API and Telegram
in fakes.py, PostgreSQL in postgres.py), the web page and a browser for it."""

import base64
import contextlib
import http.client
import http.server
import inspect
import json
import os
import pathlib
import py_compile
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

import vesti
from tests.chromium import Chromium
from tests.fakes import FakeBotApi, FakeOllama
from tests.postgres import OwnPostgresServer, PostgresServer, postgres_binaries
from tests.servers import FeedServer

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
    monkeypatch.setattr(vesti.Process, "password_cost", {"n": 2 ** 10, "r": 8, "p": 1})


@pytest.fixture
def closing():
    """closing(thing) gives back `thing` (a fake, a server, the web page, a
    connection) and closes it when the test ends, the last made first,
    whatever failed: no try/finally around a test's body. A process (a
    subprocess.Popen) still running then is killed and waited for, and its
    pipes are closed."""
    with contextlib.ExitStack() as stack:
        def keep(thing):
            if isinstance(thing, subprocess.Popen):
                stack.enter_context(thing)      # then: its pipes closed, waited for
                stack.callback(thing.kill)      # first: killed, if it is still running
            else:
                stack.callback(thing.close)
            return thing
        yield keep


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






# Ollama ----------------------------------------------------------------------



@pytest.fixture
def ollama():
    fake = FakeOllama()
    yield fake
    fake.close()


# Publishing ------------------------------------------------------------------





@pytest.fixture
def bot():
    fake = FakeBotApi()
    yield fake
    fake.close()




# Telegram --------------------------------------------------------------------



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
        vesti.stop_web(self.server)


@pytest.fixture
def web(home):
    w = Web(home)
    yield w
    w.close()




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
