#!/usr/bin/env python3
"""Benchmark of the VESTI web page on a big database. Prints figures and
PASS/MISS next to each target. Exits 0 when everything ran (a MISS is a
figure, not a failure); exits 1 when something broke: an exception, the
server not starting or not exiting 0 on SIGTERM, a check that does not hold
(e.g. /api/queue differing from the file, no posts where posts were
expected). Run from the repository root: `python bench/web.py`;
`python bench/web.py --smoke` runs the whole path in a few seconds on a tiny
database built in a temporary directory (the cache is not touched; the
figures only show that it runs).

What it measures:

1. Building the database (timed, printed): vesti.Database(path) creates the
   schema, then executemany in big transactions fills it with --sources
   sources (slugs src0000...; mostly rss, about 12% telegram; priorities 0-3;
   about 2% dead with a last_error, about 1% disabled; post_count = their
   posts), --posts posts over the last 30 days (ids in fetched_at order;
   published_at up to a few hours earlier; about 0.3% pending, the newest
   ones, plus a few older ones waiting for a retry and a few with classified
   NULL; 8 processing; 0.01% failed; the rest done, today's included),
   rss_state rows for the RSS sources, tg_state rows for the Telegram ones,
   and --runs runs per source. The file is cached as
   /tmp/vesti-bench-web-<sizes>-<UTC day>.db (a day's share of the posts is
   put after midnight UTC, so "done today" only means something on the day
   it was built); --rebuild forces a new one.
2. Latency of the real server: `vesti.py serve --host 127.0.0.1 --port 0`
   on that file, with a sources.yaml listing every source (so that the sync
   every command does leaves them as built) and VESTI_WEB_PASSWORD set. One
   http.client connection (reused when the server keeps it open) with a
   Basic auth header sends --warmup requests, then --requests timed ones
   (request sent to body read) to each path; printed: median, p95 and max
   in ms, response size. Checked: /api/queue equals the four numbers counted
   directly in the file; /crawlers has one row per source.
     targets:  GET /crawlers   median < 100 ms
               GET /api/queue  median <  20 ms
     no target: GET / (candidates, first page), GET /?page=200
   Also printed: the server's open files, threads and RSS before and after
   the requests (from /proc), and how long it took to stop on SIGTERM.
3. Where the time goes, in-process on the same file (median of --repeat):
   vesti.queue_sizes, vesti.source_health, vesti.crawlers_page as a whole, the
   candidates query of page 1 and page 200, and a new vesti.connect()
   connection plus queue_sizes (what a request pays when its thread has no
   connection yet). --explain prints EXPLAIN QUERY PLAN of those queries.
"""

import argparse
import base64
import contextlib
import email.utils
import glob
import hashlib
import http.client
import importlib.util
import json
import os
import queue
import random
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import vesti  # noqa: E402

CRAWLERS_TARGET_MS = 100
QUEUE_TARGET_MS = 20
CACHE_VERSION = 2
DAYS = 30
PASSWORD = "bench-web-password"
USER = "admin"
START_TIMEOUT = 180
STOP_TIMEOUT = 30
MEASURE_BUDGET = 300  # seconds per path at most, warm-up included
# Sizes: the full benchmark's defaults, and --smoke's (each overridable).
FULL = {"sources": 2000, "posts": 1_000_000, "runs": 10, "requests": 50, "warmup": 3,
        "repeat": 10}
SMOKE = {"sources": 20, "posts": 2000, "runs": 2, "requests": 5, "warmup": 1, "repeat": 3}
DIRECTIONS = {"linux": "Linux", "security": "Security", "science": "Science", "ai": "AI"}
# Crawl interval of each priority (VESTI_CRAWL_EVERY's default 15m,1h,6h).
INTERVALS = (900, 3600, 21600, 21600)
WORDS = """kernel release patch driver memory network storage scheduler compiler
    library server update security filesystem desktop terminal package mirror
    cluster database queue worker feed editor article reader browser protocol
    session socket thread process signal buffer cache index journal report
    review proposal version branch commit merge build benchmark latency
    throughput window device firmware module option setting default""".split()
ERRORS = (
    "HTTP 404 Not Found from {url}",
    "HTTP 410 Gone from {url}",
    "connection refused: [Errno 111] Connection refused ({url})",
    "timed out after 20 s reading {url}",
    "feed error: not a feed: <unknown>:1:0: syntax error; the server answered text/html "
    "with a page that looks like a login form, a cookie wall or a captcha rather than "
    "RSS or Atom; check the address in sources.yaml or remove the source if the site "
    "has stopped publishing a feed ({url})",
)

FAILURES = []


def fail(message):
    """Something broke (not a missed target): printed now, exit code 1 at the end."""
    FAILURES.append(message)
    print(f"    FAILED: {message}", flush=True)


# Building ----------------------------------------------------------------------

def cache_path(sources, posts, runs):
    day = time.strftime("%Y%m%d", time.gmtime())
    return (f"{tempfile.gettempdir()}/vesti-bench-web-v{CACHE_VERSION}-{sources}s-{posts}p-"
            f"{runs}r-{day}.db")


def stale_caches(path, sources, posts, runs):
    """Cached files of the same sizes built on another day (useless now)."""
    pattern = (f"{tempfile.gettempdir()}/vesti-bench-web-v*-{sources}s-{posts}p-{runs}r-*.db")
    return [p for p in glob.glob(pattern) if p != path]


def remove_db(path):
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + suffix)


def host_of(i):
    return f"127.0.{i // 250}.{i % 250 + 2}"


def make_sources(n, rng, now):
    """One dict per source, the same for the database and sources.yaml."""
    sources = []
    for i in range(n):
        telegram = rng.random() < 0.12
        priority = rng.choice((0, 0, 0, 0, 1, 1, 1, 2, 2, 3))
        roll = rng.random()
        dead, failing, disabled = roll < 0.02, 0.02 <= roll < 0.07, 0.07 <= roll < 0.08
        url = f"@chan{i}" if telegram else f"http://{host_of(i)}/feed"
        error = rng.choice(ERRORS).format(url=url) if dead or failing else None
        last_fetch = now - rng.uniform(0, INTERVALS[priority])
        sources.append({
            "id": i + 1, "slug": f"src{i:04d}", "name": f"Source {i:04d}",
            "crawler": "telegram" if telegram else "rss", "url": url,
            "direction": rng.choice([None, *DIRECTIONS]), "priority": priority,
            "enabled": 0 if disabled else 1, "status": "dead" if dead else "alive",
            "last_fetch": vesti.utc_text(last_fetch), "last_fetch_at": last_fetch,
            "last_error": error,
            "error_count": rng.randint(5, 40) if dead else rng.randint(1, 3) if failing else 0,
            "next_fetch_at": vesti.utc_text(now + rng.uniform(600, 86400)) if dead else None,
            "weight": rng.lognormvariate(0, 1.3) * (0.2 if dead or disabled else 1),
        })
    return sources


def spread(total, weights):
    """Whole numbers in proportion to `weights`, summing exactly to `total`."""
    whole = sum(weights)
    shares = [total * w / whole for w in weights]
    counts = [int(s) for s in shares]
    by_fraction = sorted(range(len(weights)), key=lambda i: counts[i] - shares[i])
    for i in by_fraction[:total - sum(counts)]:
        counts[i] += 1
    return counts


def text_pool(rng, count, low, high):
    pool = []
    for _ in range(count):
        target, words = rng.randint(low, high), []
        while sum(len(w) + 1 for w in words) < target:
            words.append(rng.choice(WORDS))
        pool.append(" ".join(words)[:target].rstrip())
    return pool


def queue_states(n_posts, rng):
    """classified value of every post (index = id - 1), and the ids waiting
    for a retry. Pending: the newest 0.3%, a few older retries and a few
    NULLs; processing: the 8 posts just before them (the claim takes the
    oldest pending); failed: 0.01% scattered; the rest done."""
    states = bytearray([1]) * n_posts  # 1 done; 0 pending; 2 NULL; 3 processing; 4 failed
    pending = max(1, n_posts * 3 // 1000)
    for i in range(n_posts - pending, n_posts):
        states[i] = 0
    for i in range(max(0, n_posts - pending - 8), n_posts - pending):
        states[i] = 3
    retries = set()
    recent = max(1, n_posts // DAYS)  # about the last day
    for _ in range(max(1, n_posts // 5000)):
        i = rng.randrange(max(0, n_posts - recent), n_posts)
        if states[i] == 1:
            states[i] = 0
            retries.add(i)
    for _ in range(max(1, n_posts // 50000)):
        i = rng.randrange(n_posts)
        if states[i] == 1:
            states[i] = 2
    for _ in range(max(1, n_posts // 10000)):
        i = rng.randrange(n_posts)
        if states[i] == 1:
            states[i] = 4
    return states, retries


def post_moments(n_posts, rng, now):
    """Fetch times in order: a day's share of the posts since midnight UTC
    (so "done today" is as big at 00:10 as at 23:50), the rest over the
    days before."""
    midnight = now - now % 86400
    today = max(1, n_posts // DAYS)
    start = midnight - (DAYS - 1) * 86400
    earlier = sorted(start + rng.random() * (midnight - start - 1) for _ in range(n_posts - today))
    recent = sorted(midnight + rng.random() * max(1, now - midnight - 1) for _ in range(today))
    return earlier + recent


def post_rows(sources, n_posts, rng, now):
    """Every post as an INSERT tuple, ids in fetched_at order; the sources
    carry their post_count already."""
    owners = [s["id"] for s in sources for _ in range(s["post_count"])]
    rng.shuffle(owners)
    moments = post_moments(n_posts, rng, now)
    states, retries = queue_states(n_posts, rng)
    texts = text_pool(rng, 4000, 150, 190)
    summaries = text_pool(rng, 2000, 80, 140)
    by_id = {s["id"]: s for s in sources}
    directions = list(DIRECTIONS)
    message_ids = {}
    for i in range(n_posts):
        post_id = i + 1
        source = by_id[owners[i]]
        fetched = int(moments[i])
        published = fetched - int(min(rng.expovariate(1 / 3600), 2 * 86400))
        if source["crawler"] == "rss":
            url = f"http://{host_of(source['id'] - 1)}/post/{post_id}"
            canonical, external = url, url
            if rng.random() < 0.2:
                url += "?utm_source=rss"
            content_type = "full" if rng.random() < 0.7 else "summary"
        else:
            message = message_ids[source["id"]] = message_ids.get(source["id"], 1000) + 1
            url = canonical = f"https://t.me/chan{source['id'] - 1}/{message}"
            external = str(message)
            content_type = rng.choice(("text", "text", "text", "photo", "photo", "video"))
        title = " ".join((rng.choice(WORDS).capitalize(), rng.choice(WORDS), rng.choice(WORDS),
                          f"#{post_id}"))
        text = f"Post {post_id}: {texts[post_id % len(texts)]}"
        sha = hashlib.sha256(f"{title}\n{text}".encode()).hexdigest()
        state = states[i]
        attempts, claimed, token, next_attempt, error = 0, None, None, None, None
        direction, relevance, interest, summary = source["direction"], None, None, None
        status = "new"
        if state == 1:
            classified, attempts = 1, 1
            direction = rng.choice(directions) if rng.random() < 0.9 else None
            relevance, interest = rng.randint(0, 10), rng.randint(0, 10)
            summary = summaries[post_id % len(summaries)]
            roll = rng.random()
            status = "approved" if roll < 0.03 else "rejected" if roll < 0.08 else "new"
        elif state == 0:
            classified = 0
            if i in retries:
                attempts = rng.randint(1, 4)
                next_attempt = vesti.utc_text(now + rng.uniform(30, 600))
                error = "Ollama: timed out after 120 s"
        elif state == 2:
            classified = None
        elif state == 3:
            classified, attempts = -1, 1
            claimed, token = vesti.utc_text(now - rng.uniform(1, 60)), f"{post_id:032x}"
        else:
            classified, attempts = -2, 5
            error = "Ollama: the answer is not JSON: 'I cannot help with that'"
        yield (post_id, source["id"], external, url, canonical, title, text, content_type, sha,
               vesti.utc_text(fetched), vesti.utc_text(published), status, classified,
               attempts, claimed, token, next_attempt, error, direction, relevance, interest,
               summary)


POST_COLUMNS = ("id", "source_id", "external_id", "url", "canonical_url", "title", "text",
                "content_type", "sha256", "fetched_at", "published_at", "status", "classified",
                "attempts", "claimed_at", "claim_token", "next_attempt_at", "error",
                "direction", "relevance", "interest", "summary")
SOURCE_COLUMNS = ("id", "slug", "name", "crawler", "url", "direction", "priority", "enabled",
                  "status", "last_fetch", "last_error", "error_count", "next_fetch_at",
                  "post_count")
RSS_STATE_COLUMNS = ("source_id", "etag", "modified", "last_build_date", "last_error", "status",
                     "http_status", "body_sha256", "moved_to", "updated_at")
TG_STATE_COLUMNS = ("source_id", "last_message_id", "updated_at")
RUN_COLUMNS = ("source_id", "task", "trigger", "started_at", "finished_at", "status",
               "new_posts", "error")


class Inserter:
    """INSERTs of rows given as tuples in the order of `columns`, into only
    the columns the table has in the schema vesti created (PRAGMA
    table_info), so a column vesti drops cannot break the build: the
    benchmark's values for it are left out, with a note. A column vesti adds
    gets its default, or fails the build if it has none (NOT NULL)."""

    def __init__(self, conn, table, columns):
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if not have:
            raise RuntimeError(f"vesti's schema has no table {table}")
        keep = [i for i, name in enumerate(columns) if name in have]
        dropped = [name for name in columns if name not in have]
        if dropped:
            print(f"    note: vesti's {table} table has no {', '.join(dropped)}: left out")
        self.conn = conn
        self.sql = (f"INSERT INTO {table} ({', '.join(columns[i] for i in keep)}) "
                    f"VALUES ({', '.join('?' * len(keep))})")
        self.project = None if len(keep) == len(columns) else keep

    def insert(self, rows):
        if self.project is not None:
            keep = self.project
            rows = (tuple(row[i] for i in keep) for row in rows)
        self.conn.executemany(self.sql, rows)


def chunks(rows, size):
    chunk = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def state_rows(sources, rng, now):
    rss, tg = [], []
    for s in sources:
        if s["crawler"] == "rss":
            if s["last_fetch"] is None:
                continue
            etag = f'"{rng.getrandbits(64):016x}"' if rng.random() < 0.7 else None
            modified = (email.utils.formatdate(now - rng.uniform(0, 86400), usegmt=True)
                        if rng.random() < 0.6 else None)
            built = (email.utils.formatdate(now - rng.uniform(0, 86400), usegmt=True)
                     if rng.random() < 0.5 else None)
            status = ("error" if s["last_error"] else
                      "not_modified" if etag and rng.random() < 0.6 else "ok")
            moved = (f"https://example.org/moved/{s['slug']}.xml"
                     if rng.random() < 0.005 else None)
            rss.append((s["id"], etag, modified, built, s["last_error"], status,
                        404 if s["last_error"] else 304 if status == "not_modified" else 200,
                        f"{rng.getrandbits(256):064x}", moved, s["last_fetch"]))
        else:
            tg.append((s["id"], 1000 + s["post_count"], s["last_fetch"]))
    return rss, tg


def run_rows(sources, runs, rng, now):
    """`runs` runs per source, back from its last fetch, in started_at order."""
    rows = []
    for s in sources:
        last = s["last_fetch_at"]
        for k in range(runs):
            started = last - (runs - 1 - k) * INTERVALS[s["priority"]]
            failed = s["last_error"] is not None and k >= runs - min(runs, s["error_count"])
            rows.append((s["id"], s["crawler"], "schedule" if rng.random() < 0.95 else "cli",
                         vesti.utc_text(started), vesti.utc_text(started + rng.uniform(0.2, 5)),
                         "error" if failed else "ok",
                         0 if failed else rng.choice((0, 0, 0, 1, 2, 5)),
                         s["last_error"] if failed else None))
    rows.sort(key=lambda row: row[3])
    return rows


def build_database(path, n_sources, n_posts, runs, seed=20240601):
    """Build into path.part, then rename; returns the sources (for the YAML)."""
    part = path + ".part"
    remove_db(part)
    try:
        sources = _build(part, n_sources, n_posts, runs, seed)
    except BaseException:
        remove_db(part)  # nothing half-built is left in /tmp
        raise
    os.replace(part, path)
    remove_db(part)
    return sources


def _build(part, n_sources, n_posts, runs, seed):
    rng = random.Random(seed)
    now = int(time.time())
    vesti.Database(part).close()  # the schema, exactly as vesti creates it
    conn = sqlite3.connect(part, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = DELETE")  # leave WAL for the bulk load
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA cache_size = -524288")  # 512 MiB
        sources = make_sources(n_sources, rng, now)
        for source, count in zip(sources, spread(n_posts, [s["weight"] for s in sources])):
            source["post_count"] = count
        conn.execute("BEGIN")
        Inserter(conn, "sources", SOURCE_COLUMNS).insert(
            [tuple(s[name] for name in SOURCE_COLUMNS) for s in sources])
        rss, tg = state_rows(sources, rng, now)
        Inserter(conn, "rss_state", RSS_STATE_COLUMNS).insert(rss)
        Inserter(conn, "tg_state", TG_STATE_COLUMNS).insert(tg)
        Inserter(conn, "runs", RUN_COLUMNS).insert(run_rows(sources, runs, rng, now))
        conn.execute("COMMIT")
        done = 0
        posts = Inserter(conn, "posts", POST_COLUMNS)
        for chunk in chunks(post_rows(sources, n_posts, rng, now), 100_000):
            conn.execute("BEGIN")
            posts.insert(chunk)
            conn.execute("COMMIT")
            done += len(chunk)
            if sys.stdout.isatty():
                print(f"    {done:,} posts", end="\r", flush=True)
        conn.execute("PRAGMA journal_mode = WAL")  # as vesti.connect leaves it
    finally:
        conn.close()
    return sources


def sources_of(path):
    """The sources of a cached file, for the YAML."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute("SELECT * FROM sources ORDER BY id")]


def write_sources(path, sources):
    """sources.yaml listing every source as built, so the sync changes nothing."""
    lines = ["directions:"]
    for key, title in DIRECTIONS.items():
        lines.append(f"  {key}: {{title: {title}, keywords: [{key}]}}")
    lines.append("sources:")
    for s in sources:
        lines += [f"  - slug: {s['slug']}", f"    name: {s['name']}",
                  f"    crawler: {s['crawler']}", f"    url: '{s['url']}'",
                  f"    priority: {s['priority']}"]
        if s["direction"]:
            lines.append(f"    direction: {s['direction']}")
        if not s["enabled"]:
            lines.append("    enabled: false")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def file_figures(path):
    """Counts straight from the file, by the contract's definitions."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        one = lambda sql: conn.execute(sql).fetchone()[0]  # noqa: E731
        return {
            "queue": {
                "pending": one("SELECT count(*) FROM posts WHERE classified IS NULL "
                               "OR classified = 0"),
                "processing": one("SELECT count(*) FROM posts WHERE classified = -1"),
                "done_today": one("SELECT count(*) FROM posts WHERE classified = 1 "
                                  "AND fetched_at >= date('now')"),
                "failed": one("SELECT count(*) FROM posts WHERE classified = -2"),
            },
            "posts": one("SELECT count(*) FROM posts"),
            "done": one("SELECT count(*) FROM posts WHERE classified = 1"),
            "sources": one("SELECT count(*) FROM sources"),
            "dead": one("SELECT count(*) FROM sources WHERE status = 'dead'"),
            "telegram": one("SELECT count(*) FROM sources WHERE crawler = 'telegram'"),
            "runs": one("SELECT count(*) FROM runs"),
            "rss_state": one("SELECT count(*) FROM rss_state"),
            "size": os.path.getsize(path),
        }


# The server ----------------------------------------------------------------------

def child_env(**settings):
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update({k: str(v) for k, v in settings.items()})
    return env


def proc_figures(pid):
    """(open files, threads, RSS MB) of a live process, from /proc."""
    try:
        files = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return files, int(status["Threads"]), int(status["VmRSS"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return None


def show_proc(label, figures):
    if figures:
        print(f"    server {label}: {figures[0]} open files, {figures[1]} threads, "
              f"RSS {figures[2]:.0f} MB")


class Serve:
    """`vesti.py serve` in a subprocess; stderr goes to a file."""

    def __init__(self, program, db, sources, tmp):
        self.log_path = os.path.join(tmp, "serve.log")
        self.log = open(self.log_path, "w", encoding="utf-8")
        self.lines = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, program, "serve", "--host", "127.0.0.1", "--port", "0",
             "--db", db, "--sources", sources],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=child_env(VESTI_WEB_PASSWORD=PASSWORD, VESTI_WEB_USER=USER,
                                     VESTI_WEB_HOST="127.0.0.1"))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def port(self, timeout):
        """The port announced on stdout, or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    return None
                continue
            match = re.match(r"web: http://127\.0\.0\.1:(\d+)/", line)
            if match:
                return int(match[1])
        return None

    def tail(self, lines=5):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read().strip().splitlines()[-lines:]

    def stop(self):
        """SIGTERM and wait; (exit code, seconds)."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return f"none: killed after {STOP_TIMEOUT} s", time.monotonic() - started
        self.log.close()
        return self.proc.returncode, time.monotonic() - started


# Measuring -----------------------------------------------------------------------

class Client:
    """One http.client connection, reopened only when the server closes it."""

    def __init__(self, port):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        self.headers = {"Authorization": f"Basic {token}"}
        self.closed_by_server = self.sent = 0

    def get(self, path):
        """(seconds, status, body)."""
        started = time.perf_counter()
        self.conn.request("GET", path, headers=self.headers)
        response = self.conn.getresponse()
        body = response.read()
        seconds = time.perf_counter() - started
        self.sent += 1
        if response.will_close:
            self.closed_by_server += 1
        return seconds, response.status, body

    def close(self):
        self.conn.close()


def p95(values):
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * 95 // 100) - 1)]


def measure(client, path, warmup, requests):
    """Timings in ms, last status and body; stops early past MEASURE_BUDGET."""
    deadline = time.monotonic() + MEASURE_BUDGET
    timings, status, body = [], None, b""
    for k in range(warmup + requests):
        seconds, status, body = client.get(path)
        if k >= warmup:
            timings.append(seconds * 1000)
        if time.monotonic() > deadline:
            break
    return timings, status, body


def verdict(value, limit):
    return "PASS" if value < limit else "MISS"


def report(path, timings, status, body, target=None, requests=None):
    if not timings:
        print(f"GET {path:<14} no timed request (HTTP {status})")
        return None
    median = statistics.median(timings)
    line = (f"GET {path:<14} median {median:7.1f} ms   p95 {p95(timings):7.1f} ms   "
            f"max {max(timings):7.1f} ms   {len(body):>9,} bytes   HTTP {status}")
    if len(timings) < (requests or 0):
        line += f"   (only {len(timings)} timed: budget {MEASURE_BUDGET} s)"
    print(line)
    if target is not None:
        print(f"    target: median < {target} ms   {verdict(median, target)}")
    return median


def latency_benchmark(program, db, sources_yaml, tmp, expected, warmup, requests):
    shown = os.path.relpath(program, REPO) if program.startswith(REPO + os.sep) else program
    print(f"== web latency: `{shown} serve --port 0` on the file, "
          f"{warmup} warm-up + {requests} timed requests per path, one http.client connection")
    started = time.monotonic()
    serve = Serve(program, db, sources_yaml, tmp)
    try:
        port = serve.port(START_TIMEOUT)
        if port is None:
            print(f"server did not announce its port within {START_TIMEOUT} s "
                  f"(exit {serve.proc.poll()})")
            for line in serve.tail():
                print(f"    vesti> {line}")
            fail("the server did not start")
            return
        print(f"server up on 127.0.0.1:{port} in {time.monotonic() - started:.2f} s "
              f"(start-up, sources.yaml read and synced)")
        before = proc_figures(serve.proc.pid)
        client = Client(port)
        try:
            cases = (("/api/queue", QUEUE_TARGET_MS), ("/crawlers", CRAWLERS_TARGET_MS),
                     ("/", None), ("/?page=200", None))
            results = {}
            for path, target in cases:
                timings, status, body = measure(client, path, warmup, requests)
                report(path, timings, status, body, target, requests)
                results[path] = (status, body)
            sent = client.sent
            note = (" (no keep-alive: a new TCP connection, and a new server thread, per "
                    "request)" if client.closed_by_server >= sent else "")
            print(f"    connections: the server closed the connection after "
                  f"{client.closed_by_server} of {sent} responses{note}")
        finally:
            client.close()
        check_pages(results, expected)
        time.sleep(0.5)  # let the request threads finish
        after = proc_figures(serve.proc.pid)
        show_proc("at start", before)
        show_proc(f"after {sent} requests", after)
    finally:
        code, seconds = serve.stop()
        print(f"server stopped on SIGTERM: exit {code} in {seconds:.2f} s")
        if code != 0:
            fail(f"the server exited {code} on SIGTERM")
        for line in serve.tail(3):
            if "vesti.access" not in line:
                print(f"    vesti> {line}")


def check_pages(results, expected):
    status, body = results.get("/api/queue", (None, b""))
    try:
        got = json.loads(body)
    except ValueError:
        got = body[:200]
    ok = status == 200 and got == expected["queue"]
    print(f"    check /api/queue: {got} -> "
          f"{'as counted in the file' if ok else 'UNEXPECTED, counted ' + str(expected['queue'])}")
    if not ok:
        fail(f"/api/queue: HTTP {status}, {got}, counted {expected['queue']}")
    status, body = results.get("/crawlers", (None, b""))
    rows = body.count(b'<tr id="source-')
    ok = status == 200 and rows == expected["sources"]
    print(f"    check /crawlers: {rows} source rows -> "
          f"{'one per source' if ok else 'UNEXPECTED, expected ' + str(expected['sources'])}")
    if not ok:
        fail(f"/crawlers: HTTP {status}, {rows} source rows for {expected['sources']} sources")
    for path in ("/", "/?page=200"):
        status, body = results.get(path, (None, b""))
        shown = body.count(b'<article class=')
        print(f"    check {path}: HTTP {status}, {shown} posts shown")
        if status != 200:
            fail(f"GET {path}: HTTP {status}")
        elif path == "/" and shown == 0 and expected["done"]:
            fail(f"GET /: no post shown, {expected['done']} classified in the file")


# In-process ----------------------------------------------------------------------

def timed(function, repeat):
    """Median ms of `repeat` calls."""
    timings = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings)


def fresh_connection_queue(db):
    conn = vesti.connect(db)
    try:
        vesti.queue_sizes(conn)
    finally:
        conn.close()


QUEUE_PARTS = {
    "pending (NULL)": "SELECT count(*) FROM posts WHERE classified IS NULL",
    "pending (0)": "SELECT count(*) FROM posts WHERE classified = 0",
    "processing": "SELECT count(*) FROM posts WHERE classified = -1",
    "done today": "SELECT count(*) FROM posts WHERE classified = 1 AND fetched_at >= date('now')",
    "failed": "SELECT count(*) FROM posts WHERE classified = -2",
}
def explain(conn, label, sql, params=()):
    print(f"    {label}:")
    for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params):
        print(f"        {row[3]}")


def inprocess_benchmark(db, repeat, show_plans):
    print(f"== where the time goes: in-process on the same file, median of {repeat} calls")
    conn = vesti.connect(db)
    try:
        size = vesti.PAGE_SIZE + 1
        rows = [
            ("vesti.queue_sizes", lambda: vesti.queue_sizes(conn)),
            *((f"    {label}", lambda sql=sql: conn.execute(sql).fetchone())
              for label, sql in QUEUE_PARTS.items()),
            ("vesti.source_health", lambda: vesti.source_health(conn)),
            ("vesti.crawlers_page (all of it)", lambda: vesti.crawlers_page(conn, "t" * 64)),
            ("candidates query, page 1", lambda: vesti.candidate_posts(conn, limit=size)),
            ("candidates query, page 200",
             lambda: vesti.candidate_posts(conn, offset=199 * vesti.PAGE_SIZE, limit=size)),
            ("new vesti.connect() + queue_sizes", lambda: fresh_connection_queue(db)),
        ]
        for label, function in rows:
            print(f"{label:<36} {timed(function, repeat):8.2f} ms")
        if show_plans:
            print("EXPLAIN QUERY PLAN:")
            for label, sql in QUEUE_PARTS.items():
                explain(conn, f"queue_sizes, {label}", sql)
    finally:
        conn.close()


# Main -----------------------------------------------------------------------------

def use_vesti(path):
    """Import `path` as the module vesti, unless it is the one imported."""
    global vesti
    if os.path.samefile(path, vesti.__file__):
        return
    spec = importlib.util.spec_from_file_location("vesti", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vesti"] = module
    spec.loader.exec_module(module)
    vesti = module


def prepare_database(args, tmp):
    """The cached file of these sizes, built if needed; with --smoke a new
    file in `tmp`, the cache left alone."""
    if args.smoke:
        path = os.path.join(tmp, "smoke.db")
        print(f"== smoke: building {path}: {args.sources:,} sources, {args.posts:,} posts, "
              f"{args.runs} runs per source (the cache is not used)")
    else:
        path = cache_path(args.sources, args.posts, args.runs)
        for stale in stale_caches(path, args.sources, args.posts, args.runs):
            remove_db(stale)
        if not args.rebuild and os.path.exists(path):
            print(f"== using the cached {path} (--rebuild to build it again)")
            return path
        remove_db(path)
        print(f"== building {path}: {args.sources:,} sources, {args.posts:,} posts, "
              f"{args.runs} runs per source")
    started = time.perf_counter()
    build_database(path, args.sources, args.posts, args.runs)
    print(f"built in {time.perf_counter() - started:.1f} s")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=int, help=f"sources (default {FULL['sources']})")
    parser.add_argument("--posts", type=int, help=f"posts (default {FULL['posts']})")
    parser.add_argument("--runs", type=int, help=f"runs per source (default {FULL['runs']})")
    parser.add_argument("--requests", type=int,
                        help=f"timed requests per path (default {FULL['requests']})")
    parser.add_argument("--warmup", type=int,
                        help=f"untimed requests per path first (default {FULL['warmup']})")
    parser.add_argument("--repeat", type=int,
                        help=f"calls per in-process figure (default {FULL['repeat']})")
    parser.add_argument("--rebuild", action="store_true",
                        help="build the database even if a cached one exists")
    parser.add_argument("--explain", action="store_true",
                        help="print EXPLAIN QUERY PLAN of the page's queries")
    parser.add_argument("--vesti", metavar="PATH", default=os.path.join(REPO, "vesti.py"),
                        help="the vesti.py to serve and time in-process, e.g. a patched "
                             "copy (default: the repository's)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (" + ", ".join(f"{k} {v}" for k, v in SMOKE.items())
                        + ") on a database built in a temporary directory, cache untouched: "
                        "checks that the whole benchmark runs, in a few seconds")
    args = parser.parse_args(argv)
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.vesti = os.path.abspath(args.vesti)
    use_vesti(args.vesti)
    args.sources, args.posts = max(1, args.sources), max(1, args.posts)
    args.runs, args.requests = max(1, args.runs), max(1, args.requests)
    args.warmup, args.repeat = max(0, args.warmup), max(1, args.repeat)
    vesti.import_optional("yaml", "pyyaml", "the benchmark")  # not timed
    if args.smoke:
        print("smoke mode: tiny sizes; the figures show that the benchmark runs, the "
              "PASS/MISS verdicts mean nothing\n")
    with tempfile.TemporaryDirectory(prefix="vesti-bench-web-") as tmp:
        db = prepare_database(args, tmp)
        figures = file_figures(db)
        print(f"file: {figures['size'] / 1e6:,.1f} MB; {figures['posts']:,} posts, "
              f"{figures['sources']:,} sources ({figures['telegram']} telegram, "
              f"{figures['dead']} dead), {figures['runs']:,} runs, "
              f"{figures['rss_state']:,} rss_state rows; queue {figures['queue']}")
        if figures["posts"] != args.posts or figures["sources"] != args.sources:
            fail(f"the file has {figures['posts']} posts and {figures['sources']} sources, "
                 f"built with {args.posts} and {args.sources}")
        print()
        sources_yaml = os.path.join(tmp, "sources.yaml")
        write_sources(sources_yaml, sources_of(db))
        latency_benchmark(args.vesti, db, sources_yaml, tmp, file_figures(db), args.warmup,
                          args.requests)
        print()
        inprocess_benchmark(db, args.repeat, args.explain)
    return 0


def run(argv=None):
    """main(); exit code 1 if it raised or anything in it failed."""
    try:
        main(argv)
    except Exception:  # noqa: BLE001 - printed, then the exit code says it
        sys.stdout.flush()
        traceback.print_exc()
        print("benchmark aborted by the error above", flush=True)
        FAILURES.append("aborted by an exception")
    if FAILURES:
        print(f"\nFAILED ({len(FAILURES)}): " + "; ".join(FAILURES), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
