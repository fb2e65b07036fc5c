#!/usr/bin/env python3
"""Benchmark of the VESTI RSS crawler (phase 1). Prints figures and ratios.
Exits 0 when everything ran (a MISS is a figure, not a failure); exits 1
when something broke: an exception, `vesti.py rss` exiting non-zero, a check
after a crawl not holding (e.g. no posts stored), a big body not refused.
Run from the repository root: `python bench/crawl.py`; `python
bench/crawl.py --smoke` runs the whole path in a few seconds with tiny sizes
(the figures only show that it runs).

What it measures:

1. Crawl wall time through the real command line. --feeds RSS 2.0 feeds of
   --entries entries each are served from distinct loopback hosts 127.0.0.2,
   127.0.0.3, ... (one ThreadingHTTPServer per address); every answer,
   304s included, is delayed by --latency seconds. The servers send ETag and
   Last-Modified and answer 304 to a matching If-None-Match. `vesti.py rss
   --all` runs twice with RSS_HOST_DELAY=0 and RSS_CONCURRENCY=C
   (VESTI_BENCH_CONCURRENCY, default 8): first crawl all 200s, second all
   304s. After each, the database is checked (post count, run statuses).
     ideal      = feeds * latency / C
     parse time = parse_feed + store_posts of every body, serially, in-process
     targets:   first crawl  <= 1.5 * (ideal + parse time)
                second crawl <= 1.5 * ideal
2. Parse and store rate on one feed of 5,000 entries, in-process:
   entries/s for vesti.parse_feed alone, vesti.store_posts alone, and both.
3. Peak memory (ru_maxrss of a fresh process) while vesti.http_get refuses
   a 50 MB body (with and without Content-Length) and a gzip bomb that
   expands to 1 GiB (about 1 MB of gzip: deflate compresses at most about
   1032:1, so a 50 KB bomb could only expand to about 50 MB). RSS_MAX_BYTES
   is 10 MiB by default, so each must end in FetchError with the peak RSS
   staying near the baseline plus that cap. With --smoke: a 3 MB body and
   a 32 MiB bomb against RSS_MAX_BYTES=1 MiB instead.
"""

import argparse
import contextlib
import email.utils
import hashlib
import http.server
import json
import os
import random
import socketserver
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from xml.sax.saxutils import escape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import vesti  # noqa: E402
from harness import fail, run  # noqa: E402

CONTENT_TYPE = "application/rss+xml; charset=utf-8"
LAST_MODIFIED = email.utils.formatdate(1_700_000_000, usegmt=True)
RATE_ENTRIES = 5000
BIG_BODY = 50 * 1000 * 1000
BOMB_SIZE = 1 << 30
CRAWL_TARGET = 1.5
# --smoke: sizes of the whole path in a few seconds (each size overridable).
SMOKE = {"feeds": 5, "entries": 5, "latency": 0.01}
SMOKE_RATE_ENTRIES = 200
SMOKE_BIG_BODY = 3 * 1000 * 1000
SMOKE_BOMB_SIZE = 32 << 20
SMOKE_MAX_BYTES = 1 << 20
# Seconds an idle server waits between looks for shutdown() (serve_forever's
# default); --smoke's servers look more often, so they stop at once.
POLL = 0.5
SMOKE_POLL = 0.05
WORDS = """kernel release patch driver memory network storage scheduler compiler
    library server update security filesystem desktop terminal package mirror
    cluster database queue worker feed editor article reader browser protocol
    session socket thread process signal buffer cache index journal report
    review proposal version branch commit merge build benchmark latency
    throughput window device firmware module option setting default""".split()


# Feeds ----------------------------------------------------------------------

def entry_text(feed_no, k):
    """300-800 characters of text no other entry has."""
    rng = random.Random(feed_no * 1_000_003 + k)
    target = rng.randint(300, 800)
    words = [f"Feed {feed_no} story {k}:"]
    length = len(words[0])
    while length < target:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:target].rstrip() + "."


def build_feed(feed_no, base_url, entries):
    """A valid RSS 2.0 document with unique guids, links, titles and texts."""
    items = []
    for k in range(1, entries + 1):
        link = f"{base_url}/post/{k}"
        date = email.utils.formatdate(1_700_000_000 - k * 600, usegmt=True)
        items.append(
            f"<item><title>Feed {feed_no} headline {k}</title><link>{escape(link)}</link>"
            f'<guid isPermaLink="false">feed{feed_no}-entry{k}</guid><pubDate>{date}</pubDate>'
            f"<description>{escape(entry_text(feed_no, k))}</description></item>")
    return ('<?xml version="1.0" encoding="utf-8"?>\n<rss version="2.0"><channel>'
            f"<title>Bench feed {feed_no}</title><link>{escape(base_url)}/</link>"
            f"<description>VESTI benchmark feed {feed_no}</description>"
            f"<lastBuildDate>{LAST_MODIFIED}</lastBuildDate>"
            + "\n".join(items) + "</channel></rss>\n").encode("utf-8")


# Feed servers ---------------------------------------------------------------

class FeedHandler(http.server.BaseHTTPRequestHandler):
    """Serves the server's one feed at /feed.xml after a fixed delay."""

    def do_GET(self):
        site = self.server.site
        time.sleep(site["latency"])
        if self.path != "/feed.xml":
            self.send_error(404)
            return
        if self.headers.get("If-None-Match") == site["etag"]:
            self.send_response(304)
            self.validators(site)
            self.end_headers()
            count(site, "304")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(site["body"])))
        self.validators(site)
        self.end_headers()
        self.wfile.write(site["body"])
        count(site, "200")

    def validators(self, site):
        self.send_header("ETag", site["etag"])
        self.send_header("Last-Modified", LAST_MODIFIED)

    def log_message(self, *args):
        pass


COUNT_LOCK = threading.Lock()


def count(site, status):
    with COUNT_LOCK:
        site["counter"][status] += 1


class Server(http.server.ThreadingHTTPServer):
    def server_bind(self):
        # HTTPServer.server_bind looks the address up in DNS (getfqdn): about
        # 75 ms per loopback address on a machine without a resolver.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


def start_server(address, handler, site=None, poll=POLL):
    server = Server((address, 0), handler)
    server.site = site
    threading.Thread(target=server.serve_forever, args=(poll,), daemon=True).start()
    return server


def stop_servers(servers):
    """Shut all down at once: each shutdown() waits for its poll interval."""
    def stop(server):
        server.shutdown()
        server.server_close()
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        list(pool.map(stop, servers))


@contextlib.contextmanager
def feed_farm(feeds, entries, latency, poll=POLL):
    """One server per loopback host 127.0.0.2...; yields [(slug, url, body)]."""
    counter, servers, farm = Counter(), [], []
    try:
        for n in range(1, feeds + 1):
            host = f"127.{(n + 1) >> 16 & 255}.{(n + 1) >> 8 & 255}.{(n + 1) & 255}"
            server = start_server(host, FeedHandler, poll=poll)
            base = f"http://{host}:{server.server_address[1]}"
            body = build_feed(n, base, entries)
            server.site = {"body": body, "etag": f'"{hashlib.sha256(body).hexdigest()[:32]}"',
                           "latency": latency, "counter": counter}
            servers.append(server)
            farm.append((f"feed{n}", f"{base}/feed.xml", body))
        yield farm, counter
    finally:
        stop_servers(servers)


def write_sources(path, farm):
    lines = ["directions: {}", "sources:"]
    for slug, url, _ in farm:
        lines += [f"  - slug: {slug}", "    crawler: rss", f"    url: {url}", "    priority: 0"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


# Crawl through the command line ---------------------------------------------

def child_env(**settings):
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update({k: str(v) for k, v in settings.items()})
    return env


def run_crawl(db, sources, env, timeout):
    """(wall seconds, CompletedProcess) of `vesti.py rss --all`."""
    started = time.monotonic()
    # Run beside its sources.yaml: a .env in the checkout is not the benchmark's.
    proc = subprocess.run([sys.executable, os.path.join(REPO, "vesti.py"), "rss", "--all",
                           "--db", db, "--sources", sources], cwd=os.path.dirname(sources),
                          env=env, capture_output=True, text=True, timeout=timeout)
    return time.monotonic() - started, proc


def last_run_id(db):
    if not os.path.exists(db):
        return 0
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT coalesce(max(id), 0) FROM runs").fetchone()[0]


def db_figures(db, after_run):
    """Post count, statuses of the runs newer than `after_run`, rss_state statuses."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        posts = conn.execute("SELECT count(*) FROM posts").fetchone()[0]
        runs = dict(conn.execute("SELECT status, count(*) FROM runs WHERE id > ? "
                                 "GROUP BY status", (after_run,)).fetchall())
        new = conn.execute("SELECT coalesce(sum(new_posts), 0) FROM runs WHERE id > ?",
                           (after_run,)).fetchone()[0]
        errors = [row[0] for row in conn.execute(
            "SELECT DISTINCT error FROM runs WHERE id > ? AND error IS NOT NULL LIMIT 3",
            (after_run,))]
        states = dict(conn.execute("SELECT status, count(*) FROM rss_state GROUP BY status"))
    return {"posts": posts, "runs": runs, "new_posts": new, "errors": errors, "states": states}


def crawl_once(label, db, sources, env, counter, expect, timeout):
    """One crawl, timed and checked; returns its wall time."""
    with COUNT_LOCK:
        before_served = Counter(counter)
    before_run = last_run_id(db)
    wall, proc = run_crawl(db, sources, env, timeout)
    with COUNT_LOCK:
        served = dict(counter - before_served)
    got = db_figures(db, before_run)
    ok = (proc.returncode == 0 and got["posts"] == expect["posts"]
          and got["runs"] == expect["runs"] and got["states"] == expect["states"]
          and served == expect["served"])
    print(f"{label}: {wall:.2f} s wall, exit {proc.returncode}")
    for line in (proc.stdout + proc.stderr).strip().splitlines()[-5:]:
        print(f"    vesti> {line}")
    print(f"    served {served}; posts {got['posts']}; runs {got['runs']} "
          f"(+{got['new_posts']} new); rss_state {got['states']}")
    for error in got["errors"]:
        print(f"    run error: {vesti.shorten(error, 200)}")
    print(f"    check: {'as expected' if ok else 'UNEXPECTED, expected ' + str(expect)}")
    if proc.returncode != 0:
        fail(f"{label}: `vesti.py rss --all` exited {proc.returncode}")
    if got["posts"] == 0 and expect["posts"]:
        fail(f"{label}: no post stored, {expect['posts']} expected")
    elif not ok:
        fail(f"{label}: {got} / served {served}, expected {expect}")
    return wall


# In-process parse and store --------------------------------------------------

def fresh_db(tmp, name, slugs):
    db = vesti.Database(os.path.join(tmp, name))
    with vesti.transaction(db.conn()) as conn:
        ids = [conn.execute("INSERT INTO sources(slug, url) VALUES (?, 'http://x/')",
                            (slug,)).lastrowid for slug in slugs]
    return db, ids


def serial_parse_store(tmp, farm, entries):
    """Seconds to parse and store every farm body, one after another."""
    db, ids = fresh_db(tmp, "serial.db", [slug for slug, _, _ in farm])
    try:
        started = time.perf_counter()
        for source_id, (_, url, body) in zip(ids, farm):
            feed = vesti.parse_feed(body, url, max_entries=entries, content_type=CONTENT_TYPE)
            vesti.store_posts(db.conn(), source_id, None, feed.drafts)
        return time.perf_counter() - started
    finally:
        db.close()


def parse_store_rate(tmp, entries):
    """Entries/s of parse_feed, store_posts and both on one big feed."""
    url = "http://127.0.0.1:9/big.xml"
    body = build_feed(0, "http://127.0.0.1:9", entries)
    db, (source_id,) = fresh_db(tmp, "rate.db", ["big"])
    try:
        started = time.perf_counter()
        feed = vesti.parse_feed(body, url, max_entries=entries)
        parsed = time.perf_counter()
        stored = vesti.store_posts(db.conn(), source_id, None, feed.drafts)
        done = time.perf_counter()
    finally:
        db.close()
    parse, store = parsed - started, done - parsed
    print(f"feed of {entries} entries, {len(body) / 1e6:.1f} MB: "
          f"{len(feed.drafts)} parsed, {stored} stored")
    print(f"    parse        {parse:6.2f} s  {entries / parse:8.0f} entries/s")
    print(f"    store        {store:6.2f} s  {entries / store:8.0f} entries/s")
    print(f"    parse+store  {parse + store:6.2f} s  {entries / (parse + store):8.0f} entries/s")
    if len(feed.drafts) != entries or stored != entries:
        fail(f"parse and store: {len(feed.drafts)} parsed, {stored} stored of {entries} entries")


# Refused bodies ---------------------------------------------------------------

def gzip_bomb(size):
    """gzip of `size` zero bytes, built 1 MiB at a time."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    parts = [compressor.compress(block) for _ in range(size // len(block))]
    parts.append(compressor.flush())
    return b"".join(parts)


class BigHandler(http.server.BaseHTTPRequestHandler):
    """/plain: the big body (50 MB) with Content-Length; /stream: the same
    without it; /bomb: the gzip bomb with Content-Encoding: gzip."""

    def do_GET(self):
        try:
            if self.path == "/bomb":
                bomb = self.server.site["bomb"]
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(bomb)))
                self.end_headers()
                self.wfile.write(bomb)
            elif self.path in ("/plain", "/stream"):
                size = self.server.site["size"]
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                if self.path == "/plain":
                    self.send_header("Content-Length", str(size))
                self.end_headers()
                chunk = b"<item><title>x</title></item>\n" * 33_000
                for offset in range(0, size, len(chunk)):
                    self.wfile.write(chunk[:size - offset])
            else:
                self.send_error(404)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client refused the body: what is measured

    def log_message(self, *args):
        pass


PROBE = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import vesti
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
settings = vesti.load_settings(environ=json.loads(sys.argv[3]), env_file=None)
before = peak()
started = time.monotonic()
try:
    response = vesti.http_get(sys.argv[2], settings)
    outcome = f"NO FetchError: HTTP {response.status}, {len(response.body)} bytes"
except vesti.FetchError as e:
    outcome = f"FetchError: {e}"
print(json.dumps({"before": before, "after": peak(), "seconds": time.monotonic() - started,
                  "outcome": outcome, "limit": settings.max_bytes}))
"""

# On Linux a child's ru_maxrss starts at its parent's resident size (vfork/fork,
# then exec, carry the high-water mark over), which here is the whole benchmark.
# A small launcher process in between gives the probe a baseline of its own.
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def probe(url, environ):
    command = [sys.executable, "-c", LAUNCHER, sys.executable, "-c", PROBE, REPO, url,
               json.dumps(environ)]
    proc = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        tail = "\n    ".join(proc.stderr.strip().splitlines()[-6:])
        return {"outcome": f"probe failed (exit {proc.returncode}):\n    {tail}"}
    return json.loads(proc.stdout)


def refused_bodies(big_body=BIG_BODY, bomb_size=BOMB_SIZE, environ=None, poll=POLL):
    """`environ`: the probe's settings (default: none, so RSS_MAX_BYTES's default)."""
    bomb = gzip_bomb(bomb_size)
    server = start_server("127.0.0.1", BigHandler, {"bomb": bomb, "size": big_body}, poll)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    cases = [(f"{big_body / 1e6:.0f} MB body, Content-Length", "/plain"),
             (f"{big_body / 1e6:.0f} MB body, no Content-Length", "/stream"),
             (f"gzip bomb {len(bomb) / 1e3:.0f} KB -> {bomb_size >> 20} MiB", "/bomb")]
    try:
        for label, path in cases:
            got = probe(base + path, environ or {})
            if "before" not in got:
                print(f"{label}: {got['outcome']}")
                fail(f"{label}: the probe crashed (traceback above)")
                continue
            print(f"{label}: peak RSS {got['after']:.1f} MB (baseline {got['before']:.1f} MB, "
                  f"+{got['after'] - got['before']:.1f} MB; limit "
                  f"{got['limit'] / 2**20:.0f} MiB), {got['seconds']:.2f} s")
            print(f"    {got['outcome']}")
            if not got["outcome"].startswith("FetchError"):
                fail(f"{label}: not refused ({got['outcome']})")
    finally:
        stop_servers([server])


# Main -------------------------------------------------------------------------

def verdict(value, limit):
    return "PASS" if value <= limit else "MISS"


def ratio(value, base):
    return f"{value / base:.2f}" if base > 0 else "n/a"


def crawl_benchmark(tmp, feeds, entries, latency, concurrency, poll=POLL):
    posts = feeds * entries
    ideal = feeds * latency / concurrency
    timeout = 60 + 10 * (ideal + posts / 1000)
    db, sources = os.path.join(tmp, "crawl.db"), os.path.join(tmp, "sources.yaml")
    env = child_env(RSS_HOST_DELAY=0, RSS_CONCURRENCY=concurrency,
                    RSS_MAX_ENTRIES=max(200, entries))
    print(f"== crawl: {feeds} feeds x {entries} entries, {latency * 1000:.0f} ms per "
          f"answer, RSS_CONCURRENCY={concurrency}")
    with feed_farm(feeds, entries, latency, poll) as (farm, counter):
        write_sources(sources, farm)
        first = crawl_once("first crawl (200s)", db, sources, env, counter, timeout=timeout,
                           expect={"posts": posts, "runs": {"ok": feeds},
                                   "states": {"ok": feeds}, "served": {"200": feeds}})
        second = crawl_once("second crawl (304s)", db, sources, env, counter, timeout=timeout,
                            expect={"posts": posts, "runs": {"ok": feeds},
                                    "states": {"not_modified": feeds},
                                    "served": {"304": feeds}})
        parse = serial_parse_store(tmp, farm, entries)
    first_limit = CRAWL_TARGET * (ideal + parse)
    second_limit = CRAWL_TARGET * ideal
    print(f"ideal time  = {feeds} x {latency} s / {concurrency} = {ideal:.2f} s")
    print(f"parse time  = {parse:.2f} s (parse_feed + store_posts of {posts} entries, "
          f"serial, in-process; {posts / parse:.0f} entries/s)")
    print(f"first  / ideal = {ratio(first, ideal)}")
    print(f"second / ideal = {ratio(second, ideal)}")
    print(f"first  / (ideal + parse) = {ratio(first, ideal + parse)}   target <= {CRAWL_TARGET}"
          f"  ({first:.2f} s vs {first_limit:.2f} s)  {verdict(first, first_limit)}")
    print(f"second / ideal = {ratio(second, ideal)}   target <= {CRAWL_TARGET}"
          f"  ({second:.2f} s vs {second_limit:.2f} s)  {verdict(second, second_limit)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--feeds", type=int, help="number of feeds (default 200)")
    parser.add_argument("--entries", type=int, help="entries per feed (default 50)")
    parser.add_argument("--latency", type=float,
                        help="seconds each server waits before answering (default 0.1)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny sizes ({SMOKE['feeds']} feeds x {SMOKE['entries']} entries, "
                             f"{SMOKE['latency'] * 1000:.0f} ms latency, a feed of "
                             f"{SMOKE_RATE_ENTRIES} entries for the rate, a "
                             f"{SMOKE_BIG_BODY / 1e6:.0f} MB body and a "
                             f"{SMOKE_BOMB_SIZE >> 20} MiB bomb against RSS_MAX_BYTES="
                             f"{SMOKE_MAX_BYTES}): checks that the whole benchmark runs, "
                             "in a few seconds")
    args = parser.parse_args(argv)
    defaults = SMOKE if args.smoke else {"feeds": 200, "entries": 50, "latency": 0.1}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    concurrency = int(os.environ.get("VESTI_BENCH_CONCURRENCY") or 8)
    vesti.import_optional("feedparser", "feedparser", "the benchmark")  # not timed
    if args.smoke:
        print("smoke mode: tiny sizes; the figures show that the benchmark runs, the "
              "PASS/MISS verdicts mean nothing\n")
    with tempfile.TemporaryDirectory(prefix="vesti-bench-") as tmp:
        crawl_benchmark(tmp, args.feeds, args.entries, args.latency, concurrency,
                        SMOKE_POLL if args.smoke else POLL)
        print("\n== parse and store rate, in-process")
        parse_store_rate(tmp, SMOKE_RATE_ENTRIES if args.smoke else RATE_ENTRIES)
        if args.smoke:
            print(f"\n== memory while refusing big bodies (vesti.http_get, smoke: "
                  f"RSS_MAX_BYTES={SMOKE_MAX_BYTES}, small bodies)")
            refused_bodies(SMOKE_BIG_BODY, SMOKE_BOMB_SIZE, {"RSS_MAX_BYTES": SMOKE_MAX_BYTES},
                           SMOKE_POLL)
        else:
            print("\n== memory while refusing big bodies (vesti.http_get, default settings)")
            refused_bodies()
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
