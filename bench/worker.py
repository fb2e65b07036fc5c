#!/usr/bin/env python3
"""Benchmark of the VESTI worker pool (phase 3). Prints figures and ratios.
Exits 0 when everything ran (a MISS is a figure, not a failure); exits 1
when something broke: an exception, a `vesti.py` run exiting non-zero, a
check not holding (e.g. posts left unclassified, a post asked twice). Run
from the repository root: `python bench/worker.py`; `python bench/worker.py
--smoke` runs the whole path in a few seconds with tiny sizes (the figures
only show that it runs).

What it measures:

1. Queue throughput with keyword-only classification. A database of --posts
   pending posts (about 300 characters of text each, all containing "Linux
   kernel") is built once and copied for each run:
   - CLI: `vesti.py worker --workers W` with OLLAMA_URL empty (keywords
     decide), timed as a whole; afterwards every post must be classified=1.
     Python start-up is measured apart as the median wall time of three
     `vesti.py status` runs on the same database (one with --smoke).
   - 2 CLI workers: two such processes started together on one database,
     timed until the last exits (one start-up taken off).
     target: 2 processes faster than 1
   - in-process: vesti.run_workers(db, settings, registry, workers=W,
     quiet=True), timed around that call alone.
   - bare: one vesti.connect() connection (autocommit, WAL, synchronous
     NORMAL, busy_timeout) running the worker's claim UPDATE ... RETURNING
     and then its complete UPDATE, one post at a time, until the queue is
     empty: the ceiling for one-row claim/complete transactions.
     target: (posts / (CLI wall - start-up)) / bare cycles/s >= 0.5
     (the raw CLI ratio and the in-process ratio are printed as well)
2. Concurrency with a slow LLM. A fake Ollama on 127.0.0.1 answers every
   POST /api/chat after --latency seconds with a valid verdict and counts
   requests per post title; like Ollama, it keeps connections open
   (HTTP/1.1) and sends with no Nagle delay. --llm-posts pending posts, each with a keyword
   hit, so each goes to the LLM; `vesti.py worker --workers W` runs with
   OLLAMA_URL pointing at the fake.
     ideal  = llm-posts * latency / W
     target: CLI wall <= 1.2 * ideal
   Checked: every post asked exactly once (distinct titles = llm-posts, no
   title twice) and every post classified=1 with the fake's verdict.

With --db postgresql://... both parts run on PostgreSQL too (the bare loop
claims with FOR UPDATE SKIP LOCKED, as VESTI does there): the queue is
built in a template database of the benchmark's own on that server and
each run gets a copy (CREATE DATABASE ... TEMPLATE); all are dropped at the
end. A table then prints SQLite's figures beside PostgreSQL's.

3. Only with --db: two processes whatever plan the server picks. The
   slow-LLM queue (at most 200 posts), two `vesti.py worker --workers W`
   processes started together, the server's planner left nothing but
   nested loops (PGOPTIONS turns off hash and merge joins, hash aggregates,
   materializing and sorting), as it may plan a claim for a table it
   believes tiny: how many posts each process classified (its `worker:`
   line), and every post asked once.
     target: each process classifies at least a third of the posts
   wall / ideal (ideal = posts * latency / (2 * W)) is printed with no
   target: the other statements are planned with nested loops too.

VESTI_* settings in the environment apply to every run (VESTI_STORY_HOURS=0
measures the queue without stories: every post here has a keyword hit, so
each is looked up in its story and leaves its keys).
"""

import argparse
import contextlib
import http.server
import json
import os
import re
import shutil
import socketserver
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import vesti  # noqa: E402
from harness import fail, run  # noqa: E402

THROUGHPUT_TARGET = 0.5
LLM_TARGET = 1.2
STARTUP_RUNS = 3
SMOKE_STARTUP_RUNS = 1
FULL = {"posts": 50_000, "llm_posts": 800, "latency": 0.05, "workers": 8}
# --smoke: sizes of the whole path in a few seconds (each overridable).
SMOKE = {"posts": 50, "llm_posts": 8, "latency": 0.01, "workers": 4}
# Seconds the idle fake Ollama waits between looks for shutdown()
# (serve_forever's default); --smoke's looks more often, so it stops at once.
POLL = 0.5
SMOKE_POLL = 0.05
SOURCES_YAML = """\
directions:
  linux: {title: Linux, keywords: [linux, kernel]}
sources: []
"""
FILLER = ("The maintainers merged the scheduler changes, the new filesystem driver "
          "and a long list of fixes for memory management, networking and storage. ")
VERDICT = {"direction": "linux", "relevance": 7, "interest": 5,
           "summary": "A Linux kernel release with scheduler and driver changes."}

CLAIM_SQL = """
    UPDATE posts SET classified = -1, claimed_at = ?, claim_token = ?, attempts = attempts + 1
    WHERE id = (SELECT id FROM posts INDEXED BY posts_pending
                WHERE (classified IS NULL OR classified = 0)
                  AND (next_attempt_at IS NULL OR next_attempt_at <= ?)
                ORDER BY id LIMIT 1)
    RETURNING id"""
COMPLETE_SQL = """
    UPDATE posts SET classified = 1, direction = ?, relevance = ?, interest = ?, summary = ?,
                     claim_token = NULL
    WHERE id = ? AND classified = -1 AND claim_token = ?"""


# Databases ------------------------------------------------------------------

def post_text(n):
    """About 300 characters, with the keywords 'Linux kernel' in it."""
    return (f"Post {n}: Linux kernel 6.{n % 20} is out. " + FILLER * 2)[:300].rstrip() + "."


def build_queue(path, posts):
    """A fresh database with `posts` pending posts of one source."""
    db = vesti.Database(path)
    try:
        with vesti.transaction(db.conn()) as conn:
            source_id = conn.execute("INSERT INTO sources(slug, url) VALUES "
                                     "('bench', 'http://127.0.0.1:9/feed.xml') "
                                     "RETURNING id").fetchone()[0]
            conn.executemany(
                "INSERT INTO posts(source_id, title, text, url, classified) VALUES (?, ?, ?, ?, 0)",
                ((source_id, f"Bench post {n}", post_text(n), f"http://127.0.0.1:9/post/{n}")
                 for n in range(1, posts + 1)))
        if hasattr(vesti, "catch_up_index"):  # as store_posts leaves them: counted, searchable
            vesti.catch_up_index(db.conn())
        if not vesti.is_postgres(path):
            db.conn().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    return path


def copy_db(template, path):
    """A byte copy of a closed, checkpointed database."""
    shutil.copyfile(template, path)
    return path


def query(path, sql, params=()):
    """The rows of one query on a SQLite file or a PostgreSQL URL."""
    if vesti.is_postgres(path):
        conn = vesti.open_connection(path)
        try:
            return [tuple(row) for row in conn.execute(sql, params).fetchall()]
        finally:
            conn.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql, params).fetchall()


def classified_counts(path):
    """{classified value: count}."""
    return dict(query(path, "SELECT classified, count(*) FROM posts GROUP BY classified"))


def check_all_done(path, posts, label):
    """Prints the check; a failure when some post is not classified=1."""
    counts = classified_counts(path)
    ok = counts == {1: posts}
    print(f"    check: classified {counts}: "
          f"{'all done' if ok else f'UNEXPECTED, expected {{1: {posts}}}'}")
    if not ok:
        fail(f"{label}: classified {counts}, expected {{1: {posts}}}")
    return ok


def write_sources(tmp):
    path = os.path.join(tmp, "sources.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(SOURCES_YAML)
    return path


# Command line runs ----------------------------------------------------------

def child_env(**settings):
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update({k: str(v) for k, v in settings.items()})
    return env


def run_vesti(args, env, timeout, cwd):
    """(wall seconds, CompletedProcess) of `vesti.py ARGS` in `cwd` (beside
    its sources.yaml: a .env in the checkout is not the benchmark's)."""
    command = [sys.executable, os.path.join(REPO, "vesti.py"), *args]
    started = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess(command, f"none, killed after {timeout:.0f} s", "", "")
    return time.monotonic() - started, proc


def show_output(proc, lines=5):
    print(f"    exit {proc.returncode}")
    for line in (proc.stdout + proc.stderr).strip().splitlines()[-lines:]:
        print(f"    vesti> {line}")
    if proc.returncode != 0:
        fail(f"`vesti.py {proc.args[2] if len(proc.args) > 2 else ''}` exited {proc.returncode}")


def run_worker_cli(db, sources, workers, env, timeout):
    wall, proc = run_vesti(["worker", "--workers", str(workers), "--db", db,
                            "--sources", sources], env, timeout, os.path.dirname(sources))
    return wall, proc


def startup_seconds(db, sources, env, runs=STARTUP_RUNS):
    """Median wall time of `runs` `vesti.py status`: interpreter, imports,
    settings, sources.yaml, schema check, a few queries."""
    walls = []
    for _ in range(runs):
        wall, proc = run_vesti(["status", "--db", db, "--sources", sources], env, 120,
                               os.path.dirname(sources))
        if proc.returncode != 0:
            show_output(proc)
            return None
        walls.append(wall)
    return statistics.median(walls)


# Part 1: throughput -----------------------------------------------------------

def claim_sql(path):
    """The bare loop's claim: the oldest pending post, in one statement (on
    PostgreSQL a row no other claim holds)."""
    if not vesti.is_postgres(path):
        return CLAIM_SQL
    return CLAIM_SQL.replace("INDEXED BY posts_pending", "").replace(
        "ORDER BY id LIMIT 1)", "ORDER BY id, classified LIMIT 1 FOR UPDATE SKIP LOCKED)")


def bare_loop(path):
    """(cycles, seconds) of claim + complete on one connection until empty."""
    conn = vesti.open_connection(path) if vesti.is_postgres(path) else vesti.connect(path)
    claim = claim_sql(path)
    try:
        cycles = 0
        started = time.perf_counter()
        while True:
            now, token = vesti.utc_text(), uuid.uuid4().hex
            row = conn.execute(claim, (now, token, now)).fetchone()
            if row is None:
                break
            conn.execute(COMPLETE_SQL, (VERDICT["direction"], VERDICT["relevance"],
                                        VERDICT["interest"], VERDICT["summary"], row[0], token))
            cycles += 1
        return cycles, time.perf_counter() - started
    finally:
        conn.close()


def in_process(path, sources, workers):
    """(stats, finished, seconds) of vesti.run_workers, keyword-only."""
    environ = {k: v for k, v in os.environ.items() if k.startswith("VESTI_")}
    settings = vesti.load_settings(environ={**environ, "OLLAMA_URL": ""}, env_file=None,
                                   db=path, sources=sources)
    registry = vesti.load_registry(sources)
    db = vesti.Database(path)
    try:
        started = time.perf_counter()
        stats, finished = vesti.run_workers(db, settings, registry, workers=workers, quiet=True)
        return stats, finished, time.perf_counter() - started
    finally:
        db.close()


def rate(count, seconds):
    return count / seconds if seconds and seconds > 0 else 0.0


def verdict_min(value, limit):
    return "PASS" if value >= limit else "MISS"


def verdict_max(value, limit):
    return "PASS" if value <= limit else "MISS"


class SQLiteStore:
    """SQLite: the queue built once in a file, copied byte for byte for each run."""
    name = "SQLite"

    def __init__(self, tmp):
        self.tmp = tmp

    def build(self, name, posts):
        self.template = build_queue(os.path.join(self.tmp, f"{name}.db"), posts)
        return self.template

    def copy(self, name):
        return copy_db(self.template, os.path.join(self.tmp, f"{name}.db"))

    def discard(self, path):
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + suffix)

    def close(self):
        pass


class PostgresStore:
    """PostgreSQL: the queue built once in a template database of its own on
    the server, each run on a copy of it (CREATE DATABASE ... TEMPLATE); all
    of them dropped at the end."""
    name = "PostgreSQL"

    def __init__(self, url):
        psycopg = vesti.import_optional("psycopg", "psycopg[binary]", "the PostgreSQL benchmark")
        self.url, self.made = url, []
        self.admin = psycopg.connect(url, autocommit=True)
        settings = dict(self.admin.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('server_version', 'fsync', 'synchronous_commit', 'shared_buffers')").fetchall())
        print(f"PostgreSQL {settings.get('server_version')} at {vesti.redacted(url)}: "
              f"fsync {settings.get('fsync')}, synchronous_commit "
              f"{settings.get('synchronous_commit')} (VESTI's sessions, the bare loop's too, "
              f"turn it off, as SQLite's synchronous=NORMAL), "
              f"shared_buffers {settings.get('shared_buffers')}")

    def database(self, name):
        return urllib.parse.urlunsplit(urllib.parse.urlsplit(self.url)._replace(path=f"/{name}"))

    def create(self, name, template=None):
        name = f"vesti_bench_{name}"
        self.admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        self.admin.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
        self.made.append(name)
        return self.database(name)

    def build(self, name, posts):
        self.template = f"vesti_bench_{name}"
        return build_queue(self.create(name), posts)

    def copy(self, name):
        return self.create(name, self.template)

    def discard(self, url):
        """Drop a finished run's database at once: its autovacuum (50,000
        rows just updated) would otherwise run during the next run."""
        name = urllib.parse.urlsplit(url).path.lstrip("/")
        self.admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def close(self):
        for name in reversed(self.made):
            self.admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        self.admin.close()


def run_workers_at_once(db, sources, workers, env, processes, timeout):
    """(wall seconds, exit codes) of `processes` worker commands started
    together on one database, until the last one exits."""
    command = [sys.executable, os.path.join(REPO, "vesti.py"), "worker", "--workers",
               str(workers), "--db", db, "--sources", sources]
    started = time.monotonic()
    running = [subprocess.Popen(command, cwd=os.path.dirname(sources), env=env,
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    codes = []
    for process in running:
        try:
            _, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            err = process.communicate()[1]
        codes.append(process.returncode)
        if process.returncode != 0:
            print(f"    vesti> {err.strip().splitlines()[-1] if err.strip() else ''}")
            fail(f"a worker of {processes} exited {process.returncode}")
    return time.monotonic() - started, codes


def throughput_benchmark(store, sources, posts, workers, startup_runs=STARTUP_RUNS):
    """The figures of part 1 on one store: {'one': posts/s of one process
    (start-up excluded), 'two': posts/s of two processes at once, 'bare':
    cycles/s of the bare loop}."""
    print(f"== throughput on {store.name}: {posts} pending posts, keyword-only (OLLAMA_URL "
          f"empty), {workers} workers")
    started = time.perf_counter()
    store.build("template", posts)
    print(f"built the queue in {time.perf_counter() - started:.2f} s")
    env = child_env(OLLAMA_URL="")
    timeout = 120 + posts / 50
    figures = {}

    cli_db = store.copy("cli")
    cli_wall, proc = run_worker_cli(cli_db, sources, workers, env, timeout)
    print(f"CLI worker: {cli_wall:.2f} s wall, {rate(posts, cli_wall):.0f} posts/s")
    show_output(proc)
    check_all_done(cli_db, posts, "CLI worker")
    startup = startup_seconds(cli_db, sources, env, startup_runs)
    if startup is not None:
        print(f"start-up (median of {startup_runs} `vesti.py status` on the same db): "
              f"{startup:.2f} s")
    store.discard(cli_db)

    two_db = store.copy("two")
    two_wall, _ = run_workers_at_once(two_db, sources, workers, env, 2, timeout)
    figures["two"] = rate(posts, two_wall - (startup or 0))
    print(f"2 CLI workers at once: {two_wall:.2f} s wall, {rate(posts, two_wall):.0f} posts/s "
          f"({figures['two']:.0f} without one start-up)")
    check_all_done(two_db, posts, "2 CLI workers")
    store.discard(two_db)

    inproc_db = store.copy("inproc")
    stats, finished, inproc_seconds = in_process(inproc_db, sources, workers)
    print(f"in-process run_workers: {inproc_seconds:.2f} s, {rate(posts, inproc_seconds):.0f} "
          f"posts/s ({stats.line()}{'' if finished else ', NOT finished'})")
    if not finished:
        fail("in-process run_workers did not finish")
    check_all_done(inproc_db, posts, "in-process run_workers")
    store.discard(inproc_db)

    bare_db = store.copy("bare")
    cycles, bare_seconds = bare_loop(bare_db)
    bare = figures["bare"] = rate(cycles, bare_seconds)
    print(f"bare loop, one connection: {cycles} cycles in {bare_seconds:.2f} s, "
          f"{bare:.0f} cycles/s")
    check_all_done(bare_db, posts, "bare loop")
    store.discard(bare_db)
    if not bare:
        fail("bare loop: no cycle")
        return figures

    cli_rate = rate(posts, cli_wall)
    print(f"CLI / bare                  = {cli_rate / bare:.2f}   (raw, start-up included)")
    print(f"in-process / bare           = {rate(posts, inproc_seconds) / bare:.2f}")
    if startup is not None and cli_wall > startup:
        net = figures["one"] = rate(posts, cli_wall - startup)
        ratio = net / bare
        print(f"(CLI - start-up) / bare     = {ratio:.2f}   target >= {THROUGHPUT_TARGET} "
              f"({net:.0f} vs {THROUGHPUT_TARGET * bare:.0f} posts/s)  "
              f"{verdict_min(ratio, THROUGHPUT_TARGET)}   <- the target uses this one")
    else:
        figures["one"] = cli_rate
        ratio = cli_rate / bare
        print(f"start-up not measured: the target uses the raw CLI ratio {ratio:.2f}   "
              f"target >= {THROUGHPUT_TARGET}  {verdict_min(ratio, THROUGHPUT_TARGET)}")
    two_ratio = figures["two"] / figures["one"] if figures["one"] else 0
    print(f"2 processes / 1 process     = {two_ratio:.2f}   target > 1  "
          f"{'PASS' if two_ratio > 1 else 'MISS'}")
    return figures


# Part 2: slow LLM -------------------------------------------------------------

class FakeOllama(http.server.BaseHTTPRequestHandler):
    """POST /api/chat: sleeps, then answers VERDICT; counts requests by the
    post title (the first line of the user message). Keeps connections open
    (HTTP/1.1) and sends at once (no Nagle delay), as Ollama does."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_POST(self):
        site = self.server.site
        length = int(self.headers.get("Content-Length") or 0)
        try:
            request = json.loads(self.rfile.read(length))
            title = request["messages"][-1]["content"].split("\n", 1)[0]
        except (ValueError, KeyError, IndexError, TypeError):
            title = None
        time.sleep(site["latency"])
        if self.path != "/api/chat" or title is None:
            self.send_error(404 if self.path != "/api/chat" else 400)
            return
        with site["lock"]:
            site["titles"][title] += 1
        body = json.dumps({"model": request.get("model"), "created_at": vesti.utc_text(),
                           "message": {"role": "assistant", "content": json.dumps(VERDICT)},
                           "done": True}).encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # 8 workers connect at once; a full backlog costs a 1 s SYN retry

    def server_bind(self):
        # HTTPServer.server_bind calls getfqdn(): slow on a machine without a resolver.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


@contextlib.contextmanager
def fake_ollama(latency, poll=POLL):
    """Yields (base URL, Counter of titles)."""
    server = Server(("127.0.0.1", 0), FakeOllama)
    server.site = {"latency": latency, "titles": Counter(), "lock": threading.Lock()}
    threading.Thread(target=server.serve_forever, args=(poll,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.site["titles"]
    finally:
        server.shutdown()
        server.server_close()


def check_llm_posts(path, titles, posts):
    expected = {f"Bench post {n}" for n in range(1, posts + 1)}
    asked_twice = sum(1 for count in titles.values() if count > 1)
    asked_ok = set(titles) == expected and asked_twice == 0
    print(f"    fake Ollama: {sum(titles.values())} requests, {len(titles)} distinct titles, "
          f"{asked_twice} asked more than once -> "
          f"{'each post classified exactly once' if asked_ok else 'UNEXPECTED'}")
    if not asked_ok:
        fail(f"fake Ollama: {len(titles)} distinct titles of {posts} posts, "
             f"{asked_twice} asked more than once")
    rows = {int(done): n for done, n in query(
        path, "SELECT CASE WHEN classified = 1 AND direction = ? AND relevance = ? AND "
              "interest = ? THEN 1 ELSE 0 END, count(*) FROM posts GROUP BY 1",
        (VERDICT["direction"], VERDICT["relevance"], VERDICT["interest"]))}
    stored_ok = rows == {1: posts}
    print(f"    database: {rows.get(1, 0)} of {posts} posts classified=1 with the fake's verdict"
          f" -> {'as expected' if stored_ok else 'UNEXPECTED ' + str(classified_counts(path))}")
    if not stored_ok:
        fail(f"slow LLM: {rows.get(1, 0)} of {posts} posts classified with the fake's verdict")


def llm_benchmark(store, sources, posts, latency, workers, poll=POLL):
    """Part 2 on one store; returns wall / ideal."""
    ideal = posts * latency / workers
    print(f"== slow LLM on {store.name}: {posts} posts, fake Ollama answering after "
          f"{latency * 1000:.0f} ms, {workers} workers")
    db = store.build("llm", posts)
    with fake_ollama(latency, poll) as (url, titles):
        env = child_env(OLLAMA_URL=url)
        wall, proc = run_worker_cli(db, sources, workers, env, timeout=120 + 10 * ideal)
        print(f"CLI worker: {wall:.2f} s wall")
        show_output(proc)
        check_llm_posts(db, titles, posts)
    limit = LLM_TARGET * ideal
    print(f"ideal time = {posts} x {latency} s / {workers} = {ideal:.2f} s")
    print(f"wall / ideal = {wall / ideal:.2f}   target <= {LLM_TARGET}  "
          f"({wall:.2f} s vs {limit:.2f} s)  {verdict_max(wall, limit)}")
    return wall / ideal


# Part 3 (PostgreSQL): two processes whatever plan the server picks -------------

# Part 3's queue: at most this many of the slow-LLM part's posts. With
# nested loops only, the server plans the workers' other statements badly
# too, and they slow down as the table grows.
SPLIT_POSTS = 200
NESTED_LOOPS_ONLY = " ".join(f"-c enable_{method}=off" for method in
                             ("hashjoin", "hashagg", "mergejoin", "material", "sort"))


def split_benchmark(store, sources, posts, latency, workers, poll=POLL):
    """Part 3 on PostgreSQL; returns (the smaller share of the posts, wall / ideal)."""
    ideal = posts * latency / (2 * workers)
    print(f"== two processes on {store.name}, its planner left nested loops only: {posts} "
          f"posts, fake Ollama answering after {latency * 1000:.0f} ms, 2 x {workers} workers")
    db = store.build("split", posts)
    command = [sys.executable, os.path.join(REPO, "vesti.py"), "worker", "--workers",
               str(workers), "--db", db, "--sources", sources]
    with fake_ollama(latency, poll) as (url, titles):
        env = child_env(OLLAMA_URL=url, PGOPTIONS=NESTED_LOOPS_ONLY)
        started = time.monotonic()
        running = [subprocess.Popen(command, cwd=os.path.dirname(sources), env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for _ in range(2)]
        done = []
        for process in running:
            try:
                out, err = process.communicate(timeout=120 + 20 * ideal)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            if process.returncode != 0:
                print(f"    vesti> {err.strip().splitlines()[-1] if err.strip() else ''}")
                fail(f"a worker of 2 exited {process.returncode}")
            said = re.search(r"worker: (\d+) processed", out)
            done.append(int(said[1]) if said else 0)
        wall = time.monotonic() - started
        check_llm_posts(db, titles, posts)
    share = min(done) / posts
    print(f"posts per process: {done[0]} and {done[1]}; the smaller share {share:.2f}   "
          f"target >= 0.33  {verdict_min(share, 1 / 3)}")
    # No target: with nested loops only, the server plans every other
    # statement as badly; the wall shows what a claim holding the queue costs.
    print(f"wall {wall:.2f} s; ideal = {posts} x {latency} s / (2 x {workers}) = {ideal:.2f} s; "
          f"wall / ideal = {wall / ideal:.2f}")
    return share, wall / ideal


def side_by_side(figures):
    """The figures of every store in one table."""
    names = list(figures)
    print("== side by side (posts/s; start-up excluded)")
    print(f"{'':38s}" + "".join(f"{name:>12s}" for name in names))
    rows = (("1 process x workers", lambda f: f"{f['one']:.0f}"),
            ("2 processes x workers", lambda f: f"{f['two']:.0f}"),
            ("bare claim+complete loop", lambda f: f"{f['bare']:.0f}"),
            ("1 process / bare (>= 0.5)", lambda f: f"{f['one'] / f['bare']:.2f}"),
            ("2 processes / 1 (> 1)", lambda f: f"{f['two'] / f['one']:.2f}"),
            ("50 ms LLM, wall / ideal (<= 1.2)", lambda f: f"{f['llm']:.2f}"),
            ("nested loops: smaller share (>= 0.33)", lambda f: f"{f['share']:.2f}"),
            ("nested loops: wall / ideal", lambda f: f"{f['split']:.2f}"))
    for label, cell in rows:
        cells = []
        for name in names:
            try:
                cells.append(cell(figures[name]))
            except (KeyError, ZeroDivisionError):
                cells.append("-")
        print(f"{label:38s}" + "".join(f"{c:>12s}" for c in cells))


# Main -------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--posts", type=int,
                        help=f"pending posts for the throughput part (default {FULL['posts']})")
    parser.add_argument("--llm-posts", type=int,
                        help=f"pending posts for the slow-LLM part (default {FULL['llm_posts']})")
    parser.add_argument("--latency", type=float,
                        help="seconds the fake Ollama waits before answering "
                             f"(default {FULL['latency']})")
    parser.add_argument("--workers", type=int,
                        help=f"worker threads (default {FULL['workers']})")
    parser.add_argument("--db", metavar="URL",
                        help="also run on PostgreSQL: a postgresql:// URL of a role that may "
                             "create databases (the benchmark makes its own and drops them)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (" + ", ".join(f"{k.replace('_', '-')} {v}"
                                                        for k, v in SMOKE.items())
                        + f", {SMOKE_STARTUP_RUNS} `vesti.py status` for the start-up): "
                        "checks that the whole benchmark runs, in a few seconds")
    args = parser.parse_args(argv)
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    vesti.import_optional("yaml", "pyyaml", "the benchmark")  # not timed
    if args.smoke:
        print("smoke mode: tiny sizes; the figures show that the benchmark runs, the "
              "PASS/MISS verdicts mean nothing\n")
    with tempfile.TemporaryDirectory(prefix="vesti-bench-") as tmp:
        sources = write_sources(tmp)
        stores = [SQLiteStore(tmp)] + ([PostgresStore(args.db)] if args.db else [])
        figures = {}
        try:
            for store in stores:
                figures[store.name] = throughput_benchmark(
                    store, sources, args.posts, args.workers,
                    SMOKE_STARTUP_RUNS if args.smoke else STARTUP_RUNS)
                print()
                figures[store.name]["llm"] = llm_benchmark(
                    store, sources, args.llm_posts, args.latency, args.workers,
                    SMOKE_POLL if args.smoke else POLL)
                print()
                if isinstance(store, PostgresStore):
                    figures[store.name]["share"], figures[store.name]["split"] = \
                        split_benchmark(store, sources, min(args.llm_posts, SPLIT_POSTS),
                                        args.latency, args.workers,
                                        SMOKE_POLL if args.smoke else POLL)
                    print()
        finally:
            for store in stores:
                store.close()
        side_by_side(figures)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
