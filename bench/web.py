#!/usr/bin/env python3
"""Benchmark of the VESTI web pages (the editor's desk first) on a big
database. Prints figures and PASS/MISS next to each target. Exits 0 when
everything ran (a MISS is a figure, not a failure); exits 1 when something
broke: an exception, a server not starting or not exiting 0 on SIGTERM, a
request answered with another status than expected, a check that does not
hold (e.g. /api/queue differing from the file, a desk page without the cards
the file holds for it). Run from the repository root: `python bench/web.py`;
`python bench/web.py --smoke` runs the whole path in a few seconds on a small
database built in a temporary directory (the cache is not touched; the
figures only show that it runs).

What it measures:

1. Building the database (timed, printed): vesti.Database(path) creates the
   schema, then executemany in big transactions fills it with --sources
   sources (slugs src0000...; mostly rss, about 12% telegram; priorities 0-3;
   about 2% dead with a last_error, about 1% disabled), --posts posts over the
   last 30 days (ids in fetched_at order; published_at up to a few hours
   earlier; about 0.3% pending, the newest ones, plus a few older ones waiting
   for a retry and a few with classified NULL; 8 processing; 0.01% failed;
   the rest classified, today's included), rss_state and tg_state rows, and
   --runs runs per source. Classified posts look like the desk's: about 45%
   not relevant (relevance 0, direction NULL), the rest relevance 1-10 with a
   direction, interest 0-10, a summary, often a reason and keywords; the
   editor has decided about 2% approved and 8% rejected (mostly among the
   relevant ones, each with decided_at and decided_by), the rest are 'new'.
   Titles and texts are made of real words: COMMON_WORD is in about 85% of
   the posts, each of RARE_WORDS in RARE_POSTS classified relevant new posts.
   vesti's triggers on posts are dropped for the bulk load and put back
   after it; then the posts are counted and indexed for search
   (vesti.reindex_posts) and checked. The file is cached as
   /tmp/vesti-bench-web-v<CACHE_VERSION>-<sizes>-<UTC day>.db (a day's share
   of the posts is put after midnight UTC, so "done today" only means
   something on the day it was built); --rebuild forces a new one.
2. Latency of the real server: `vesti.py serve --host 127.0.0.1 --port 0`
   on that file, with a sources.yaml listing every source (so that the sync
   every command does leaves them as built) and VESTI_WEB_PASSWORD set. One
   http.client connection (reused when the server keeps it open) with a
   Basic auth header sends --warmup requests, then --requests timed ones
   (request sent to body read) to each path; printed: median, p95 and max
   in ms, response size, cards shown.
     targets:  GET /crawlers   median < 100 ms
               GET /api/queue  median <  20 ms
               the desk: median < 20 ms, p95 < 50 ms for each of
                 GET /                    (the default desk: new, min 3, newest)
                 GET /?status=S&after=…   page --page and the last page of
                                          S = new, approved, rejected, any; the
                                          cursors are computed in-process (the
                                          card before the page, in the desk's
                                          order, with the default relevance floor)
                 GET /?q=COMMON_WORD, GET /?q=RARE_WORDS[0]
                 POST /posts/<id>/status  (Accept: application/json; a new post
                                          each time; put back afterwards)
               GET /metrics: median < 50 ms (Prometheus text, 1M posts)
     no target: GET /approved.atom
   Checked: every answer's status; /api/queue equals the four numbers counted
   directly in the file; /crawlers has one row per source; each desk page
   shows exactly the cards the file holds for it (counted in-process);
   /approved.atom has its entries; each decision answers {"id", "status"}.
   Also printed: the server's open files, threads and RSS before and after
   the requests (from /proc), and how long it took to stop on SIGTERM.
   With --compare PATH (e.g. the previous main's vesti.py), PATH is served the
   same way on a copy of the file (it migrates the copy as it likes). One
   with the JSON desk (GET /api/posts, keyset pages) is timed and checked on
   exactly the new one's paths; an older one on the paths it has: the
   offset-paged `/?status=S&page=N` for the desk pages (its own last page:
   it had no relevance floor), its desk page for /api/posts, its decision
   form (answered 303) for the decision; no search, no feed. A table puts
   its figures beside the new ones. --rounds N serves each N times, alternating
   (new, old, then old, new, ...), so a noisy machine weighs on both alike;
   the table gives the least and the median of each path's per-round
   medians, and their ratio.
3. Where the time goes, in-process on the same file (median of --repeat):
   vesti.queue_sizes and its parts, vesti.source_health, vesti.crawlers_page,
   vesti.desk_posts and vesti.desk_counts of each desk case, vesti.desk_page
   as a whole, vesti.decided_posts (the feed), and a new vesti.connect()
   connection plus queue_sizes. --explain prints EXPLAIN QUERY PLAN of the
   queries each of them ran (recorded as they ran).
"""

import argparse
import base64
import contextlib
import email.utils
import glob
import hashlib
import hmac
import http.client
import importlib.util
import json
import math
import os
import queue
import random
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import vesti  # noqa: E402
from harness import cached, fail, run  # noqa: E402

CRAWLERS_TARGET_MS = 100
METRICS_TARGET_MS = 50
QUEUE_TARGET_MS = 20
DESK_TARGET_MS = (20, 50)  # median, p95
CACHE_VERSION = 5
DAYS = 30
PASSWORD = "bench-web-password"
USER = "admin"
START_TIMEOUT = 180
STOP_TIMEOUT = 30
MEASURE_BUDGET = 300  # seconds per path at most, warm-up included
# Sizes: the full benchmark's defaults, and --smoke's (each overridable).
FULL = {"sources": 2000, "posts": 1_000_000, "runs": 10, "requests": 50, "warmup": 3,
        "repeat": 10, "page": 200, "rounds": 1}
SMOKE = {"sources": 20, "posts": 5_000, "runs": 2, "requests": 5, "warmup": 1, "repeat": 3,
         "page": 3, "rounds": 1}
# Seconds the request threads are given to finish before the server's open
# files and threads are read again; --smoke's figures mean nothing, so less.
SETTLE = 0.5
SMOKE_SETTLE = 0.1
DIRECTIONS = {"linux": "Linux", "security": "Security", "science": "Science", "ai": "AI"}
# Crawl interval of each priority (VESTI_CRAWL_EVERY's default 15m,1h,6h).
INTERVALS = (900, 3600, 21600, 21600)
WORDS = """kernel patch driver memory network storage scheduler compiler
    library server update security filesystem desktop terminal package mirror
    cluster database queue worker feed editor article reader browser protocol
    session socket thread process signal buffer cache index journal report
    review proposal version branch commit merge build benchmark latency
    throughput window device firmware module option setting default""".split()
COMMON_WORD = "release"  # in about COMMON_SHARE of the posts (not in WORDS)
COMMON_SHARE = 0.85
RARE_WORDS = ("quokka", "zeppelin", "marzipan")  # each in RARE_POSTS posts
RARE_POSTS = 8
NOT_RELEVANT = 0.45  # classified posts with relevance 0
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



# Building ----------------------------------------------------------------------

def cache_path(sources, posts, runs):
    day = time.strftime("%Y%m%d", time.gmtime())
    return (f"{tempfile.gettempdir()}/vesti-bench-web-v{CACHE_VERSION}-{sources}s-{posts}p-"
            f"{runs}r-{day}.db")


def stale_caches(path, sources, posts, runs):
    """Cached files of this version and these sizes built on another day
    (useless now). Other versions are left alone: another checkout's
    benchmark may be using them."""
    pattern = (f"{tempfile.gettempdir()}/vesti-bench-web-v{CACHE_VERSION}-{sources}s-{posts}p-"
               f"{runs}r-*.db")
    return [p for p in glob.glob(pattern) if p != path]


def remove_db(path):
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + suffix)


def copy_db(source, target):
    """A copy of a database file, its WAL checkpointed into it first."""
    with contextlib.closing(sqlite3.connect(source)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    remove_db(target)
    shutil.copyfile(source, target)


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


def text_pool(rng, count, low, high, common=0.0):
    """`count` texts of `low` to `high` characters made of WORDS; a share
    `common` of them has COMMON_WORD somewhere."""
    pool = []
    for _ in range(count):
        target, words = rng.randint(low, high), []
        while sum(len(w) + 1 for w in words) < target:
            words.append(rng.choice(WORDS))
        text = " ".join(words)[:target].rstrip()
        if rng.random() < common:
            words = text.split()
            words.insert(rng.randrange(len(words) + 1), COMMON_WORD)
            text = " ".join(words)
        pool.append(text)
    return pool


def reason_pool(rng, count):
    return [f"{rng.choice(WORDS).capitalize()} {rng.choice(WORDS)} news that matters to "
            f"readers of the {rng.choice(WORDS)} {rng.choice(WORDS)} desk." for _ in range(count)]


def decision(relevance, roll):
    """The editor's decision: about 2% approved and 8% rejected overall,
    mostly among the posts the desk shows (relevance >= 3)."""
    if relevance >= 3:
        return "approved" if roll < 0.045 else "rejected" if roll < 0.195 else "new"
    if relevance > 0:
        return "rejected" if roll < 0.05 else "new"
    return "rejected" if roll < 0.01 else "new"


def post_rows(sources, n_posts, rng, now):
    """Every post as an INSERT tuple, ids in fetched_at order; the sources
    carry their post_count already."""
    owners = [s["id"] for s in sources for _ in range(s["post_count"])]
    rng.shuffle(owners)
    moments = post_moments(n_posts, rng, now)
    states, retries = queue_states(n_posts, rng)
    texts = text_pool(rng, 4000, 150, 190, COMMON_SHARE)
    summaries = text_pool(rng, 2000, 80, 140)
    reasons = reason_pool(rng, 500)
    done = [i for i in range(n_posts) if states[i] == 1]
    rare = {}  # post index -> its rare word: classified, relevant, new
    for word in RARE_WORDS:
        for i in rng.sample(done, min(RARE_POSTS, len(done))):
            rare.setdefault(i, word)
    del done
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
        word = rare.get(i)
        title = " ".join((word.capitalize() if word else rng.choice(WORDS).capitalize(),
                          rng.choice(WORDS), rng.choice(WORDS), rng.choice(WORDS)))
        text = f"Post {post_id}: {texts[post_id % len(texts)]}"
        if word:
            text = f"{text} The {word} {rng.choice(WORDS)}."
        sha = hashlib.sha256(f"{title}\n{text}".encode()).hexdigest()
        state = states[i]
        attempts, claimed, token, next_attempt, error = 0, None, None, None, None
        direction, relevance, interest, summary = source["direction"], None, None, None
        keywords = reason = decided_at = decided_by = None
        status = "new"
        if state == 1:
            classified, attempts = 1, 1
            summary = summaries[post_id % len(summaries)]
            if word:
                relevance = rng.randint(3, 10)
            elif rng.random() < NOT_RELEVANT:
                relevance = 0
            else:
                relevance = rng.randint(1, 10)
            if relevance == 0:
                direction, interest = None, rng.randint(0, 3)
            else:
                direction = rng.choice(directions) if rng.random() < 0.95 else None
                interest = rng.randint(0, 10)
                if direction and rng.random() < 0.4:
                    keywords = direction
                if rng.random() < 0.7:
                    reason = rng.choice(reasons)
            status = "new" if word else decision(relevance, rng.random())
            if status != "new":
                decided_at = vesti.utc_text(max(published, min(
                    now - 60, published + rng.uniform(300, 36 * 3600))))
                decided_by = USER
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
               summary, keywords, reason, decided_at, decided_by)


POST_COLUMNS = ("id", "source_id", "external_id", "url", "canonical_url", "title", "text",
                "content_type", "sha256", "fetched_at", "published_at", "status", "classified",
                "attempts", "claimed_at", "claim_token", "next_attempt_at", "error",
                "direction", "relevance", "interest", "summary", "keywords", "reason",
                "decided_at", "decided_by")
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
    # vesti's own connection class, as vesti's functions called below expect.
    conn = sqlite3.connect(part, isolation_level=None,
                           factory=getattr(vesti, "Connection", sqlite3.Connection))
    conn.path = part
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
        # vesti's triggers on posts (search index, count tables) cost a lot
        # per row: dropped for the bulk load, put back as they were, and what
        # they maintain is rebuilt from posts.
        triggers = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' "
                                "AND tbl_name = 'posts'").fetchall()
        for name, _ in triggers:
            conn.execute(f'DROP TRIGGER "{name}"')
        started, done = time.perf_counter(), 0
        posts = Inserter(conn, "posts", POST_COLUMNS)
        for chunk in chunks(post_rows(sources, n_posts, rng, now), 100_000):
            conn.execute("BEGIN")
            posts.insert(chunk)
            conn.execute("COMMIT")
            done += len(chunk)
            if sys.stdout.isatty():
                print(f"    {done:,} posts", end="\r", flush=True)
        print(f"    posts inserted in {time.perf_counter() - started:.1f} s "
              f"(triggers dropped: {', '.join(n for n, _ in triggers) or 'none'})")
        conn.execute("BEGIN")
        for _, sql in triggers:
            conn.execute(sql)
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        started = time.perf_counter()
        if hasattr(vesti, "reindex_posts"):
            vesti.reindex_posts(conn)
            print(f"    posts counted and indexed in {time.perf_counter() - started:.1f} s")
        else:
            if "posts_fts" in tables:
                conn.execute("INSERT INTO posts_fts (posts_fts) VALUES ('rebuild')")
            if "post_counts" in tables and hasattr(vesti, "recount_posts"):
                vesti.recount_posts(conn)
            print(f"    search index and count tables rebuilt in {time.perf_counter() - started:.1f} s")
        conn.execute("COMMIT")
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


def fts_term(word):
    """A word as vesti's search asks the index for it (a prefix term)."""
    return f'"{word.casefold()}"*'


def file_figures(path):
    """Counts straight from the file, by the contract's definitions."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        one = lambda sql, *params: conn.execute(sql, params).fetchone()[0]  # noqa: E731
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        figures = {
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
            "decisions": dict(conn.execute(
                "SELECT status, count(*) FROM posts WHERE classified = 1 GROUP BY status")),
            "not_relevant": one("SELECT count(*) FROM posts WHERE classified = 1 "
                                "AND relevance = 0"),
            "relevant_new": one("SELECT count(*) FROM posts WHERE classified = 1 "
                                "AND relevance >= 3 AND status = 'new'"),
            "tables": tables,
        }
        # What the triggers keep in step, checked after the bulk load.
        problems = []
        if "post_counts" in tables:
            counted = dict(conn.execute("SELECT status, sum(n) FROM post_counts GROUP BY status"))
            direct = {k: v for k, v in figures["decisions"].items()}
            if {k: v for k, v in counted.items() if v} != direct:
                problems.append(f"post_counts says {counted}, posts {direct}")
            by_source = one("SELECT coalesce(sum(n), 0) FROM source_post_counts") \
                if "source_post_counts" in tables else figures["done"]
            if by_source != figures["done"]:
                problems.append(f"source_post_counts sums to {by_source}, "
                                f"{figures['done']} classified posts")
        figures["matches"] = {}
        for word in (COMMON_WORD, *RARE_WORDS):
            like = one("SELECT count(*) FROM posts WHERE title LIKE ? OR text LIKE ?",
                       f"%{word}%", f"%{word}%")
            figures["matches"][word] = like
            if "posts_fts" in tables:
                found = one("SELECT count(*) FROM posts_fts WHERE posts_fts MATCH ?",
                            fts_term(word))
                if found != like:
                    problems.append(f"the search index finds {found} posts with {word!r}, "
                                    f"LIKE finds {like}")
        figures["problems"] = problems
        return figures


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

    def __init__(self, program, db, sources, tmp, tag="serve", **settings):
        self.log_path = os.path.join(tmp, f"{tag}.log")
        self.log = open(self.log_path, "w", encoding="utf-8")
        self.lines = queue.Queue()
        self.proc = subprocess.Popen(
            [*cached(program), "serve", "--host", "127.0.0.1", "--port", "0",
             "--db", db, "--sources", sources],
            cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=child_env(VESTI_WEB_PASSWORD=PASSWORD, VESTI_WEB_USER=USER,
                                     VESTI_WEB_HOST="127.0.0.1", **settings))
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
        self.origin = f"http://127.0.0.1:{port}"
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        self.headers = {"Authorization": f"Basic {token}"}
        self.closed_by_server = self.sent = 0

    def request(self, method, path, body=None, headers=()):
        """(seconds, status, body)."""
        started = time.perf_counter()
        self.conn.request(method, path, body=body, headers={**self.headers, **dict(headers)})
        response = self.conn.getresponse()
        answer = response.read()
        seconds = time.perf_counter() - started
        self.sent += 1
        if response.will_close:
            self.closed_by_server += 1
        return seconds, response.status, answer

    def get(self, path):
        return self.request("GET", path)

    def post(self, path, fields, accept_json=True):
        """A form posted as the page's own script would (same Origin)."""
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Origin": self.origin}
        if accept_json:
            headers["Accept"] = "application/json"
        return self.request("POST", path, urllib.parse.urlencode(fields).encode(), headers)

    def close(self):
        self.conn.close()


def p95(values):
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * 95 // 100) - 1)]


def cards_in(body):
    return body.count(b'<article class="post"')


class Case:
    """One thing timed through the server: a GET of `path` (or, with
    `decide`, POST /posts/<id>/status on each of `decide`'s ids in turn), on
    the new vesti; `old` the same for --compare's (None: it has no such
    page). `cards`/`old_cards`: the cards the page must show (None: not
    a desk page). `target`: (median, p95) ms, a median alone, or None."""

    def __init__(self, label, path, old=None, cards=None, old_cards=None, target=None,
                 decide=None, note=""):
        self.label, self.path, self.old = label, path, old
        self.cards, self.old_cards, self.target = cards, old_cards, target
        self.decide, self.note = decide, note
        self.checks = {}  # "new"/"old" -> check(body) -> a problem or None
        self.same = False  # the old vesti.py is asked as the new one

    def as_new(self):
        """The case for an old vesti.py with the new one's paths."""
        self.old, self.old_cards, self.same = self.path, self.cards, True


def has_json_desk(program):
    """True when the vesti.py at `program` answers GET /api/posts (and pages
    its desk by keyset): --compare then times it on the new one's paths."""
    with open(program, encoding="utf-8") as f:
        return "def api_posts(" in f.read()


def page_count(n):
    return max(1, math.ceil(n / vesti.PAGE_SIZE))


def desk_path(status, cursor=None, **more):
    query = [("status", status)] if status != "new" or cursor else []
    if cursor:
        query.append(("after", "~".join("" if v is None else str(v) for v in cursor)))
    query += list(more.items())
    return "/" + ("?" + urllib.parse.urlencode(query) if query else "")


def old_desk_path(status, page):
    query = [] if status == "any" else [("status", status)]
    if page > 1:
        query.append(("page", page))
    return "/" + ("?" + urllib.parse.urlencode(query) if query else "")


def desk_cases(db, deep_page, floor, decisions):
    """Every path timed, with what each page must show, counted here in
    SQL (not timed); and the posts the decisions will change, as they are
    (to put them back)."""
    size = vesti.PAGE_SIZE
    cases = []
    started = time.perf_counter()
    with contextlib.closing(sqlite3.connect(db)) as conn:
        one = lambda sql, *params: conn.execute(sql, params).fetchone()  # noqa: E731

        def where(status, relevance=True):
            """The page's filter: the relevance floor is on posts still to
            decide (a decided post is shown whatever its relevance)."""
            clause = "classified = 1" + ("" if status == "any" else " AND status = ?")
            values = [] if status == "any" else [status]
            if relevance and status in ("new", "any"):
                clause += " AND (status != 'new' OR relevance >= ?)"
                values.append(floor)
            return clause, values

        def cursor_at(status, offset, ascending=False):
            """(None, published_at, id) of the row at `offset` in the desk's order."""
            clause, values = where(status)
            order = "ASC" if ascending else "DESC"
            row = one(f"SELECT published_at, id FROM posts WHERE {clause} "
                      f"ORDER BY published_at {order}, id {order} LIMIT 1 OFFSET ?",
                      *values, offset)
            return None, row[0], row[1]

        cases.append(Case("GET /api/queue", "/api/queue", "/api/queue", target=QUEUE_TARGET_MS))
        cases.append(Case("GET /crawlers", "/crawlers", "/crawlers", target=CRAWLERS_TARGET_MS))
        approved = one("SELECT count(*) FROM posts WHERE classified = 1 "
                       "AND status = 'approved'")[0]
        atom = Case("GET /approved.atom", "/approved.atom")
        feed = min(approved, getattr(vesti, "FEED_POSTS", 100))
        atom.checks["new"] = lambda body: None if body.count(b"<entry>") == feed else \
            f"{body.count(b'<entry>')} entries, {feed} expected"
        cases.append(atom)
        metrics = Case("GET /metrics", "/metrics", target=METRICS_TARGET_MS)
        metrics.checks["new"] = lambda body: None if b"vesti_queue_posts{" in body else \
            "no vesti_queue_posts in the answer"
        cases.append(metrics)
        total_new = one(f"SELECT count(*) FROM posts WHERE {where('new')[0]}",
                        *where("new")[1])[0]
        total_old = one("SELECT count(*) FROM posts WHERE classified = 1")[0]
        cases.append(Case("desk /", "/", "/", min(size, total_new), min(size, total_old),
                          DESK_TARGET_MS))
        # The desk as JSON, beside the old desk page (it had no JSON of its own).
        api = Case("GET /api/posts", f"/api/posts?limit={size}", "/", target=DESK_TARGET_MS)
        expected = min(size, total_new)
        api.checks["new"] = lambda body: None if len(json.loads(body)["posts"]) == expected \
            else f"{len(json.loads(body)['posts'])} posts, {expected} expected"
        cases.append(api)
        for status in ("new", "approved", "rejected", "any"):
            clause, values = where(status)
            n = one(f"SELECT count(*) FROM posts WHERE {clause}", *values)[0]
            clause, values = where(status, relevance=False)
            n_old = one(f"SELECT count(*) FROM posts WHERE {clause}", *values)[0]
            pages, old_pages = page_count(n), page_count(n_old)
            page = min(deep_page, pages)
            note = f"(only {pages} pages)" if page < deep_page else ""
            cursor = cursor_at(status, (page - 1) * size - 1) if page > 1 else None
            old_page = min(page, old_pages)
            cases.append(Case(
                f"desk {status} p{page}", desk_path(status, cursor), old_desk_path(status, page),
                min(size, n - (page - 1) * size), min(size, n_old - (old_page - 1) * size),
                DESK_TARGET_MS, note=note))
            on_last = n - (pages - 1) * size
            cursor = cursor_at(status, on_last, ascending=True) if pages > 1 else None
            cases.append(Case(
                f"desk {status} last", desk_path(status, cursor),
                old_desk_path(status, old_pages), on_last if n else 0,
                n_old - (old_pages - 1) * size if n_old else 0, DESK_TARGET_MS,
                note=f"(page {pages}; old: page {old_pages}, no relevance floor)"))
        for kind, word in (("common", COMMON_WORD), ("rare", RARE_WORDS[0])):
            if "posts_fts" in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}:
                shown = one("""SELECT count(*) FROM (SELECT 1 FROM posts_fts f
                                   JOIN posts p ON p.id = f.rowid
                               WHERE posts_fts MATCH ? AND p.classified = 1
                                   AND p.status = 'new' AND p.relevance >= ? LIMIT ?)""",
                            fts_term(word), floor, size)[0]
            else:
                shown = None  # no FTS5: the LIKE fallback, not counted here
            cases.append(Case(f"search {kind} ({word})", desk_path("new", q=word), None, shown,
                              target=DESK_TARGET_MS))
        clause, values = where("new")
        rows = conn.execute(f"""SELECT id, status, decided_at, decided_by FROM posts
                                WHERE {clause} ORDER BY published_at DESC, id DESC
                                LIMIT ? OFFSET ?""",
                            [*values, decisions, max(0, total_new // 2 - decisions)]).fetchall()
        cases.append(Case("POST decision", "/posts/<id>/status", "/posts/<id>/status",
                          target=DESK_TARGET_MS, decide=[row[0] for row in rows]))
    print(f"cursors and expected cards counted in {time.perf_counter() - started:.1f} s "
          f"(relevance floor {floor}, page size {size})")
    return cases, rows


def restore_posts(db, rows):
    """Put the decided posts back as they were (the triggers keep the counts),
    and forget what a vesti that learns from decisions learned from them."""
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("BEGIN")
        conn.executemany("UPDATE posts SET status = ?, decided_at = ?, decided_by = ? "
                         "WHERE id = ?", [(s, at, by, i) for i, s, at, by in rows])
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        if "learners" in tables:
            conn.execute("DELETE FROM learners")
            conn.execute("DELETE FROM learned_words")
            conn.execute("UPDATE posts SET learned_as = NULL, learned_in = NULL "
                         "WHERE learned_as IS NOT NULL")
        if "learn_pending" in tables:
            conn.execute("DELETE FROM learn_pending")
        conn.execute("COMMIT")


def web_token(db, password=PASSWORD):
    """WebApp.token() of a server on `db`: hmac-sha256, with the secret it
    keeps in the meta table, of the web user's name and its password's hash
    in the users table (the token changes with the password)."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        row = conn.execute("SELECT value FROM meta WHERE key = 'web_secret'").fetchone()
        user = conn.execute("SELECT password_hash FROM users WHERE name = ?", (USER,)).fetchone()
    if not row or not user:
        return None
    signed = f"user\0{USER}\0{user[0]}"
    return hmac.new(row[0].encode(), signed.encode(), hashlib.sha256).hexdigest()


def measure(send, check, warmup, requests):
    """send(k) -> (seconds, status, body) for k = 0, 1, ...; check(k, status,
    body) -> a problem or None. Timings in ms, the last status and body, the
    first problem; stops early past MEASURE_BUDGET."""
    deadline = time.monotonic() + MEASURE_BUDGET
    timings, status, body, problem = [], None, b"", None
    for k in range(warmup + requests):
        seconds, status, body = send(k)
        if k >= warmup:
            timings.append(seconds * 1000)
        problem = problem or check(k, status, body)
        if time.monotonic() > deadline:
            break
    return timings, status, body, problem


def verdict(figures, target):
    """'PASS', 'MISS (...)' or '' for (median, p95) against a target."""
    if target is None or figures is None:
        return ""
    median, high = figures["median"], figures["p95"]
    if isinstance(target, tuple):
        misses = [f"{name} {value:.1f} >= {limit}" for name, value, limit in
                  (("median", median, target[0]), ("p95", high, target[1])) if value >= limit]
    else:
        misses = [f"median {median:.1f} >= {target}"] if median >= target else []
    return "MISS (" + ", ".join(misses) + ")" if misses else "PASS"


def target_text(target):
    if target is None:
        return "no target"
    if isinstance(target, tuple):
        return f"median < {target[0]} ms, p95 < {target[1]} ms"
    return f"median < {target} ms"


def time_case(client, case, which, token, warmup, requests, expected):
    """Time one case on one server; its figures (None if not run)."""
    path = case.path if which == "new" else case.old
    if path is None:
        return None
    # An old vesti.py with the new one's paths is asked and checked as the new one.
    shape = "new" if which == "new" or case.same else "old"
    if case.decide:
        ids = case.decide
        if len(ids) < warmup + requests:
            fail(f"{which}: only {len(ids)} posts to decide, {warmup + requests} needed")
            return None
        status_of = lambda k: "approved" if k % 2 == 0 else "rejected"  # noqa: E731

        def send(k):
            fields = {"token": token or "", "status": status_of(k)}
            if shape == "old":
                fields["back"] = "/"
            return client.post(f"/posts/{ids[k]}/status", fields, accept_json=shape == "new")

        def check(k, status, body):
            if shape == "old":
                return None if status == 303 else f"HTTP {status}, 303 expected: {body[:100]!r}"
            try:
                answer = json.loads(body)
            except ValueError:
                answer = body[:100]
            want = {"id": ids[k], "status": status_of(k)}
            return None if status == 200 and answer == want else \
                f"HTTP {status} {answer!r}, expected 200 {want}"
    else:
        cards = case.cards if shape == "new" else case.old_cards
        extra = case.checks.get(shape)

        def send(k):
            return client.get(path)

        def check(k, status, body):
            if status != 200:
                return f"HTTP {status}: {body[:100]!r}"
            if cards is not None and cards_in(body) != cards:
                return f"{cards_in(body)} cards shown, {cards} expected"
            if path == "/api/queue":
                got = json.loads(body)
                return None if got == expected["queue"] else \
                    f"{got}, counted in the file {expected['queue']}"
            if path == "/crawlers":
                rows = body.count(b'<tr id="source-')
                return None if rows == expected["sources"] else \
                    f"{rows} source rows for {expected['sources']} sources"
            return extra(body) if extra and k == 0 else None
    timings, status, body, problem = measure(send, check, warmup, requests)
    if problem:
        fail(f"{which} {case.label}: {problem}")
    if not timings:
        print(f"{case.label:<26} no timed request (HTTP {status})")
        return None
    figures = {"median": statistics.median(timings), "p95": p95(timings), "max": max(timings),
               "bytes": len(body), "status": status, "count": len(timings),
               "cards": cards_in(body) if case.cards is not None or case.old_cards is not None
               else None}
    line = (f"{case.label:<26} median {figures['median']:7.1f} ms   p95 {figures['p95']:7.1f} ms"
            f"   max {figures['max']:7.1f} ms   {len(body):>9,} bytes   HTTP {status}")
    if figures["cards"] is not None:
        line += f"   {figures['cards']} cards"
    if len(timings) < requests:
        line += f"   (only {len(timings)} timed: budget {MEASURE_BUDGET} s)"
    print(line)
    shown = path if not case.decide else f"POST {path}"
    print(f"    {shown}" + (f"   {case.note}" if case.note and which == "new" else ""))
    if which == "new" and case.target is not None:
        print(f"    target: {target_text(case.target)}   {verdict(figures, case.target)}")
    return figures


def latency_benchmark(program, db, sources_yaml, tmp, expected, cases, which, warmup, requests,
                      floor, settle=SETTLE):
    """Serve `program` on `db` and time every case; {label: figures}."""
    shown = os.path.relpath(program, REPO) if program.startswith(REPO + os.sep) else program
    print(f"== web latency ({which}): `{shown} serve --port 0` on {os.path.basename(db)}, "
          f"{warmup} warm-up + {requests} timed requests per path, one http.client connection")
    started = time.monotonic()
    serve = Serve(program, db, sources_yaml, tmp, tag=f"serve-{which}",
                  VESTI_MIN_RELEVANCE=floor)
    results = {}
    try:
        port = serve.port(START_TIMEOUT)
        if port is None:
            print(f"server did not announce its port within {START_TIMEOUT} s "
                  f"(exit {serve.proc.poll()})")
            for line in serve.tail():
                print(f"    vesti> {line}")
            fail(f"the {which} server did not start")
            return results
        print(f"server up on 127.0.0.1:{port} in {time.monotonic() - started:.2f} s "
              f"(start-up, sources.yaml read and synced)")
        before = proc_figures(serve.proc.pid)
        client = Client(port)
        try:
            seconds, status, body = client.get("/")  # the form token, as a browser gets it
            shown = re.search(rb'name="token" value="([0-9a-f]{64})"', body)
            token = shown[1].decode() if shown else None
            if which == "new":
                computed = web_token(db)
                if computed != token:
                    fail(f"the token computed from meta.web_secret ({computed}) is not the "
                         f"page's ({token})")
                token = computed
            elif token is None:
                print("    note: no form token on the old page: its decisions will be refused")
            for case in cases:
                figures = time_case(client, case, which, token, warmup, requests, expected)
                if figures:
                    results[case.label] = figures
            sent = client.sent
            note = (" (no keep-alive: a new TCP connection, and a new server thread, per "
                    "request)" if client.closed_by_server >= sent else "")
            print(f"    connections: the server closed the connection after "
                  f"{client.closed_by_server} of {sent} responses{note}")
        finally:
            client.close()
        time.sleep(settle)  # let the request threads finish
        after = proc_figures(serve.proc.pid)
        show_proc("at start", before)
        show_proc(f"after {sent} requests", after)
    finally:
        code, seconds = serve.stop()
        print(f"server stopped on SIGTERM: exit {code} in {seconds:.2f} s")
        if code != 0:
            fail(f"the {which} server exited {code} on SIGTERM")
        for line in serve.tail(3):
            if "vesti.access" not in line:
                print(f"    vesti> {line}")
    return results


def comparison_table(cases, new, old, old_program):
    """new and old: a {label: figures} per round. For each path, the least
    and the median of its per-round medians, and the ratio of the medians."""
    shape = "the same paths" if any(case.same for case in cases) else \
        "its desk is offset-paged, its page N is /?status=S&page=N"
    print(f"== new vs old: the median of each path in ms, least and median of "
          f"{max(len(new), len(old))} round(s) (old: {old_program} on a copy of the file; "
          f"{shape})")
    print(f"{'path':<26} {'new least':>9} {'median':>7}  {'old least':>9} {'median':>7}  "
          f"{'new/old':>7}  {'target':<28} verdict")
    for case in cases:
        a = [r[case.label] for r in new if case.label in r]
        b = [r[case.label] for r in old if case.label in r]
        a_median = statistics.median(f["median"] for f in a) if a else None
        b_median = statistics.median(f["median"] for f in b) if b else None

        def cell(figures, median, absent):
            if not figures:
                return f"{absent:>9} {'':>7}"
            return f"{min(f['median'] for f in figures):9.1f} {median:7.1f}"
        ratio = f"{a_median / b_median:7.2f}" if a and b else f"{'':>7}"
        worst = {"median": a_median, "p95": max(f["p95"] for f in a)} if a else None
        print(f"{case.label:<26} {cell(a, a_median, '-')}  "
              f"{cell(b, b_median, '-' if case.old else 'n/a')}  {ratio}  "
              f"{target_text(case.target):<28} {verdict(worst, case.target)}")


# In-process ----------------------------------------------------------------------

class Recorder:
    """A connection that remembers the statements run through it."""

    def __init__(self, conn):
        self.conn, self.statements = conn, []

    def execute(self, sql, params=()):
        self.statements.append((sql, params))
        return self.conn.execute(sql, params)

    def __getattr__(self, name):
        return getattr(self.conn, name)


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


def plan_lines(conn, sql, params=()):
    depth, lines = {0: -1}, []
    for node, parent, _, detail in conn.execute("EXPLAIN QUERY PLAN " + sql, params):
        depth[node] = depth.get(parent, -1) + 1
        lines.append("    " * depth[node] + detail)
    return tuple(lines)


def inprocess_benchmark(db, sources_yaml, cases, floor, repeat, show_plans):
    print(f"== where the time goes: in-process on the same file, median of {repeat} calls")
    conn = vesti.connect(db)
    try:
        settings = vesti.load_settings(environ={}, env_file=None)
        directions = vesti.load_registry(sources_yaml).directions
        page = vesti.Page("en", "t" * 64, {})
        rows = [
            ("vesti.queue_sizes", lambda c: vesti.queue_sizes(c)),
            *((f"    {label}", lambda c, sql=sql: c.execute(sql).fetchone())
              for label, sql in QUEUE_PARTS.items()),
            ("vesti.source_health", lambda c: vesti.source_health(c)),
            ("vesti.crawlers_page (all of it)", lambda c: vesti.crawlers_page(c, page, settings)),
        ]
        for case in cases:
            if case.cards is None or case.decide:
                continue
            query = {k: v[-1] for k, v in
                     urllib.parse.parse_qs(urllib.parse.urlsplit(case.path).query).items()}
            desk = vesti.DeskQuery.read(query, directions, floor)
            rows.append((f"desk_posts, {case.label}", lambda c, d=desk: vesti.desk_posts(c, d)))
            rows.append((f"desk_counts, {case.label}", lambda c, d=desk: vesti.desk_counts(c, d)))
        default = vesti.DeskQuery.read({}, directions, floor)
        rows += [
            ("vesti.desk_page (all of it), desk /",
             lambda c: vesti.desk_page(c, default, page, directions, settings)),
            ("vesti.decided_posts (approved.atom)",
             lambda c: vesti.decided_posts(c, "approved", None, vesti.FEED_POSTS)),
            ("new vesti.connect() + queue_sizes", lambda c: fresh_connection_queue(db)),
        ]
        plans = {}  # plan -> labels
        for label, function in rows:
            print(f"{label:<44} {timed(lambda: function(conn), repeat):8.2f} ms")
            recorder = Recorder(conn)
            function(recorder)
            for sql, params in recorder.statements:
                key = (" ".join(sql.split())[:60], plan_lines(conn, sql, params))
                plans.setdefault(key, []).append(label.strip())
        if show_plans:
            print("EXPLAIN QUERY PLAN (of each statement the calls above ran, grouped by plan):")
            for (start, lines), labels in plans.items():
                shown = sorted(set(labels), key=labels.index)
                print(f"    {'; '.join(shown)}\n        {start}…")
                for line in lines:
                    print(f"            {line}")
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


def show_file(figures, args):
    print(f"file: {figures['size'] / 1e6:,.1f} MB; {figures['posts']:,} posts, "
          f"{figures['sources']:,} sources ({figures['telegram']} telegram, "
          f"{figures['dead']} dead), {figures['runs']:,} runs, "
          f"{figures['rss_state']:,} rss_state rows; queue {figures['queue']}")
    done = max(1, figures["done"])
    decisions = ", ".join(f"{k} {v:,} ({v / done:.1%})"
                          for k, v in sorted(figures["decisions"].items()))
    print(f"classified: {figures['done']:,}; {decisions}; relevance 0: "
          f"{figures['not_relevant'] / done:.0%}; on the default desk (new, relevance >= 3): "
          f"{figures['relevant_new']:,}")
    print("search words, posts holding each: " + ", ".join(
        f"{w} {n:,}" for w, n in figures["matches"].items()))
    if figures["posts"] != args.posts or figures["sources"] != args.sources:
        fail(f"the file has {figures['posts']} posts and {figures['sources']} sources, "
             f"built with {args.posts} and {args.sources}")
    for problem in figures["problems"]:
        fail(problem)


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
    parser.add_argument("--page", type=int,
                        help=f"the deep desk page timed for each status (default "
                             f"{FULL['page']}; the last page if there are fewer)")
    parser.add_argument("--rebuild", action="store_true",
                        help="build the database even if a cached one exists")
    parser.add_argument("--explain", action="store_true",
                        help="print EXPLAIN QUERY PLAN of the pages' queries")
    parser.add_argument("--vesti", metavar="PATH", default=os.path.join(REPO, "vesti.py"),
                        help="the vesti.py to serve and time in-process, e.g. a patched "
                             "copy (default: the repository's)")
    parser.add_argument("--compare", metavar="PATH",
                        help="also serve this vesti.py (e.g. the previous main's) on a copy "
                             "of the file and time the same paths where it has them")
    parser.add_argument("--rounds", type=int,
                        help="serve and time each program this many times, alternating "
                             f"(default {FULL['rounds']})")
    parser.add_argument("--smoke", action="store_true",
                        help="small sizes (" + ", ".join(f"{k} {v}" for k, v in SMOKE.items())
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
    args.page, args.rounds = max(1, args.page), max(1, args.rounds)
    vesti.import_optional("yaml", "pyyaml", "the benchmark")  # not timed
    floor = vesti.load_settings(environ={}, env_file=None).min_relevance
    if args.smoke:
        print("smoke mode: small sizes; the figures show that the benchmark runs, the "
              "PASS/MISS verdicts mean nothing\n")
    with tempfile.TemporaryDirectory(prefix="vesti-bench-web-") as tmp:
        db = prepare_database(args, tmp)
        figures = file_figures(db)
        show_file(figures, args)
        print()
        sources_yaml = os.path.join(tmp, "sources.yaml")
        write_sources(sources_yaml, sources_of(db))
        cases, decided = desk_cases(db, args.page, floor, args.warmup + args.requests)
        served = {"new": (args.vesti, db)}
        if args.compare:
            if has_json_desk(args.compare):
                for case in cases:
                    case.as_new()
            copy = os.path.join(tmp, "compare.db")
            started = time.perf_counter()
            copy_db(db, copy)
            print(f"copied the file for {args.compare} in {time.perf_counter() - started:.1f} s\n")
            served["old"] = (os.path.abspath(args.compare), copy)
        rounds = {"new": [], "old": []}
        for number in range(args.rounds):
            for which in list(served)[::-1 if number % 2 else 1]:
                program, file = served[which]
                if args.rounds > 1:
                    print(f"-- round {number + 1} of {args.rounds}")
                try:
                    rounds[which].append(latency_benchmark(
                        program, file, sources_yaml, tmp, figures, cases, which, args.warmup,
                        args.requests, floor, SMOKE_SETTLE if args.smoke else SETTLE))
                finally:
                    restore_posts(file, decided)     # the decisions taken back
                print()
        if args.compare:
            remove_db(served["old"][1])
            comparison_table(cases, rounds["new"], rounds["old"], args.compare)
            print()
        inprocess_benchmark(db, sources_yaml, cases, floor, args.repeat, args.explain)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
