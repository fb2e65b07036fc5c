#!/usr/bin/env python3
"""Side-by-side crawl benchmark: VESTI against `reader` 3.27 (lemon24/reader,
a feed-reader library on SQLite with conditional GET). Prints wall-time and
peak-memory ratios. Exits 0 when everything ran (a MISS is a figure, not a
failure); exits 1 when something broke: an exception, a crawl exiting
non-zero or timing out, a feed failing, nothing stored.

reader is never a runtime dependency of VESTI: it is installed only in the
venv this benchmark runs the crawls with (Python 3.12+). Make one with
  ~/.pyenv/versions/3.12.1/bin/python -m venv /tmp/rc-venv-3.12 &&
  /tmp/rc-venv-3.12/bin/pip install -r requirements.txt reader==3.27
or let the benchmark make it: run it with a 3.12+ interpreter and
`--setup DIR`. Run from anywhere: `python bench/reader_compare.py [--python
VENV/bin/python]` (default: the first of /tmp/rc-venv-3.12, /tmp/rc-venv-3.13
that exists); the script itself only orchestrates and runs on any Python
3.10+. `--smoke` runs the whole path in a few seconds with tiny sizes (the
figures only show that it runs).

What it measures:

The feed farm of bench/crawl.py: --feeds RSS 2.0 feeds (default 200) of
--entries entries (default 50) served from distinct loopback hosts 127.0.0.2,
127.0.0.3, ... (one ThreadingHTTPServer per address, in this process); every
answer, 304s included, is delayed by --latency seconds (default 0.1). The
servers send ETag and Last-Modified and answer 304 to a matching
If-None-Match. Newest entries come first, as in real feeds.

Each of --rounds rounds (default 4) starts both programs on FRESH databases
and the farm at --entries entries per feed, then crawls three times, each
crawl by both programs one after the other (VESTI first in odd rounds,
reader first in even rounds):
  first   every feed answers 200 with its entries;
  second  nothing changed: every feed answers 304;
  +5      every feed gains 5 entries at the top (new body, new ETag and
          Last-Modified) before this crawl: 200s again, 5 new entries each.
VESTI crawls through its real command line, `vesti.py rss --all` in an empty
temporary directory with a sources.yaml of the farm, RSS_HOST_DELAY=0 and
RSS_CONCURRENCY=--workers (a source's own host may be a loopback address, so
no VESTI_ALLOW_PRIVATE_NETWORKS is needed). reader crawls in a process that
opens its database with make_reader, adds the farm's feeds it does not have
yet (the counterpart of VESTI reading sources.yaml), and runs
update_feeds_iter(workers=--workers, scheduled=False): scheduled=False
because reader's default only updates feeds whose update interval (an hour)
has passed, so a second crawl minutes later would fetch nothing.

Wall time is that of the crawling process, interpreter start-up and imports
included. Peak RSS is its ru_maxrss, from os.wait4 in a small launcher
process: on Linux a child's ru_maxrss starts at its parent's resident size
(fork/vfork, then exec, keep the high-water mark), and the parent here holds
the whole feed farm; the launcher gives both programs the same small floor.
Stored entries are counted in each database after each crawl: `posts` in
VESTI's, `entries` in reader's. Per crawl kind it prints min and median wall
times, the ratio of medians VESTI / reader against its goal (first <= 0.7,
second <= 1.0, +5 <= 0.7), the median peak RSS of both against the goal
VESTI <= reader + 20 MB, and the stored-entry counts (they should be equal
and feeds x entries, then feeds x (entries + 5); a difference is a warning).
"""

import argparse
import contextlib
import email.utils
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from xml.sax.saxutils import escape

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

import crawl  # noqa: E402  (the feed farm's servers and texts)
from harness import fail, run  # noqa: E402

READER_VERSION = "3.27"
DEFAULT_VENVS = ("/tmp/rc-venv-3.12", "/tmp/rc-venv-3.13")
GROWTH = 5
BASE_TIME = 1_700_000_000
ENTRY_SPACING = 600
RSS_SLACK_MB = 20
# "VESTI": the crawl as the README's cron lines start it, `python -m
# crawler.rss_crawler --all`, which imports vesti.py from its cached
# bytecode, as reader's crawl imports reader; "vesti.py": `python vesti.py rss
# --all`, which Python compiles from source at every start (a script's
# bytecode is never cached), shown beside it.
TOOLS = ("VESTI", "reader")
SHOWN = ("VESTI", "vesti.py", "reader")
# Crawl kinds, in the order of a round: (key, label, goal for wall VESTI / reader).
CRAWLS = (("first", "first", 0.7),
          ("second", "second, all 304", 1.0),
          ("grown", f"every feed +{GROWTH} entries", 0.7))
DEFAULTS = {"feeds": 200, "entries": 50, "latency": 0.1, "rounds": 4}
SMOKE = {"feeds": 6, "entries": 5, "latency": 0.01, "rounds": 1}
SETUP_HINT = ("make one: ~/.pyenv/versions/3.12.1/bin/python -m venv /tmp/rc-venv-3.12 && "
              f"/tmp/rc-venv-3.12/bin/pip install -r {REPO}/requirements.txt "
              f"reader=={READER_VERSION}  (or run this script with a 3.12+ python and "
              "--setup DIR)")


# The feed farm --------------------------------------------------------------

def feed_host(feed_no):
    """127.0.0.2 for feed 1, 127.0.0.3 for feed 2, ... as in bench/crawl.py."""
    n = feed_no + 1
    return f"127.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"


def feed_version(feed_no, base_url, entries):
    """(body, ETag, Last-Modified) of a feed with entries 1..entries, newest
    (highest number) first: a feed that grows gains its items at the top."""
    items = []
    for k in range(entries, 0, -1):
        link = f"{base_url}/post/{k}"
        date = email.utils.formatdate(BASE_TIME + k * ENTRY_SPACING, usegmt=True)
        items.append(
            f"<item><title>Feed {feed_no} headline {k}</title><link>{escape(link)}</link>"
            f'<guid isPermaLink="false">feed{feed_no}-entry{k}</guid><pubDate>{date}</pubDate>'
            f"<description>{escape(crawl.entry_text(feed_no, k))}</description></item>")
    modified = email.utils.formatdate(BASE_TIME + entries * ENTRY_SPACING, usegmt=True)
    body = ('<?xml version="1.0" encoding="utf-8"?>\n<rss version="2.0"><channel>'
            f"<title>Bench feed {feed_no}</title><link>{escape(base_url)}/</link>"
            f"<description>VESTI benchmark feed {feed_no}</description>"
            f"<lastBuildDate>{modified}</lastBuildDate>"
            + "\n".join(items) + "</channel></rss>\n").encode("utf-8")
    return body, f'"{hashlib.sha256(body).hexdigest()[:32]}"', modified


class GrowingFeedHandler(crawl.FeedHandler):
    """bench/crawl.py's handler, with a Last-Modified that changes with the feed."""

    def validators(self, site):
        self.send_header("ETag", site["etag"])
        self.send_header("Last-Modified", site["modified"])


class FeedFarm:
    """One server per feed; publish(n) gives every feed n entries."""

    def __init__(self, servers, counter):
        self.servers, self.counter = servers, counter
        self.urls = [f"{self.base_url(server)}/feed.xml" for server in servers]

    @staticmethod
    def base_url(server):
        host, port = server.server_address[:2]
        return f"http://{host}:{port}"

    def publish(self, entries):
        for feed_no, server in enumerate(self.servers, 1):
            body, etag, modified = feed_version(feed_no, self.base_url(server), entries)
            server.site.update(body=body, etag=etag, modified=modified)

    def served(self):
        """Answers by status so far, e.g. {'200': 200, '304': 200}."""
        with crawl.COUNT_LOCK:
            return Counter(self.counter)


@contextlib.contextmanager
def feed_farm(feeds, latency):
    """--feeds servers on 127.0.0.2, ...; nothing is served before publish()."""
    counter, servers = Counter(), []
    try:
        for feed_no in range(1, feeds + 1):
            site = {"latency": latency, "counter": counter}
            servers.append(crawl.start_server(feed_host(feed_no), GrowingFeedHandler, site))
        yield FeedFarm(servers, counter)
    finally:
        crawl.stop_servers(servers)


# Measured processes ---------------------------------------------------------

# Runs the crawl as its own child and reports that child's wall time, exit
# code and ru_maxrss (KiB on Linux). Started with -I -S to stay small: its
# resident size is the floor of the crawl's ru_maxrss (see the docstring).
LAUNCHER = """
import json, os, subprocess, sys, time
started = time.monotonic()
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
wall = time.monotonic() - started
with open(sys.argv[1], "w") as out:
    json.dump({"wall": wall, "exit": os.waitstatus_to_exitcode(status),
               "maxrss_kb": usage.ru_maxrss}, out)
"""

# One reader crawl: argv = database, workers, file of feed URLs.
READER_CRAWL = """
import json, sys
from reader import make_reader
db, workers, urls_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(urls_file, encoding="utf-8") as f:
    urls = f.read().split()
feeds = make_reader(db)
known = {feed.url for feed in feeds.get_feeds()}
for url in urls:
    if url not in known:
        feeds.add_feed(url)
summary = {"updated": 0, "not_modified": 0, "new_entries": 0, "errors": []}
for result in feeds.update_feeds_iter(workers=workers, scheduled=False):
    if result.error:
        summary["errors"].append(f"{result.url}: {result.error!r}")
    elif result.not_modified:
        summary["not_modified"] += 1
    else:
        summary["updated"] += 1
        summary["new_entries"] += result.updated_feed.new
feeds.close()
print(json.dumps(summary))
"""


class Measured:
    """What one crawl process did: wall seconds, exit code, peak RSS in MB, output."""

    def __init__(self, wall, exit_code, peak_mb, stdout, stderr):
        self.wall, self.exit, self.peak_mb = wall, exit_code, peak_mb
        self.stdout, self.stderr = stdout, stderr

    def tail(self, lines=5):
        return (self.stdout + self.stderr).strip().splitlines()[-lines:]


def measure(python, command, cwd, env, timeout, report_path):
    """Run `command` under the launcher; its whole process group is killed on timeout."""
    proc = subprocess.Popen([python, "-I", "-S", "-c", LAUNCHER, report_path, *command],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{command[1]}: no answer after {timeout:.0f} s, killed") from None
    if proc.returncode != 0 or not os.path.exists(report_path):
        raise RuntimeError(f"launcher exited {proc.returncode}: {stderr.strip()[-500:]}")
    with open(report_path, encoding="utf-8") as f:
        report = json.load(f)
    os.remove(report_path)
    return Measured(report["wall"], report["exit"], report["maxrss_kb"] / 1024, stdout, stderr)


def count_rows(db, table):
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


# The two crawlers --------------------------------------------------------------

class VestiCrawler:
    """`python -m crawler.rss_crawler --all` (name VESTI), or, as a
    `script`, `python vesti.py rss --all` (name vesti.py)."""

    def __init__(self, python, work, farm, workers, max_entries, timeout, script=False):
        self.python, self.timeout, self.script = python, timeout, script
        self.name = "vesti.py" if script else "VESTI"
        self.cwd = os.path.join(work, "vesti-cwd")   # empty: no .env is read
        os.makedirs(self.cwd, exist_ok=True)
        self.sources = os.path.join(work, "sources.yaml")
        crawl.write_sources(self.sources, [(f"feed{n}", url, None)
                                           for n, url in enumerate(farm.urls, 1)])
        self.env = crawl.child_env(RSS_HOST_DELAY=0, RSS_CONCURRENCY=workers,
                                   RSS_MAX_ENTRIES=max_entries)
        if not script:
            self.env["PYTHONPATH"] = REPO
            # The bytecode a deployed copy has after its first run (the
            # environment may say not to write it, as this machine's does).
            subprocess.run([python, "-m", "py_compile", os.path.join(REPO, "vesti.py")],
                           check=True)
        self.db = None

    def fresh_database(self, round_dir):
        self.db = os.path.join(round_dir, "vesti.db")

    def crawl(self, report_path):
        """(Measured, stored entries, problem or None)."""
        before = self.last_run_id()
        launch = [os.path.join(REPO, "vesti.py"), "rss"] if self.script else \
            ["-m", "crawler.rss_crawler"]
        got = measure(self.python, [self.python, *launch, "--all", "--db", self.db,
                                    "--sources", self.sources],
                      self.cwd, self.env, self.timeout, report_path)
        if got.exit != 0:
            return got, None, f"`{' '.join(launch)} --all` exited {got.exit}"
        failed = self.failed_runs(before)
        problem = f"{len(failed)} feeds failed, e.g. {failed[0]}" if failed else None
        return got, count_rows(self.db, "posts"), problem

    def last_run_id(self):
        if not os.path.exists(self.db):
            return 0
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            return conn.execute("SELECT coalesce(max(id), 0) FROM runs").fetchone()[0]

    def failed_runs(self, after_run):
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            return [f"{status}: {error}" for status, error in conn.execute(
                "SELECT status, error FROM runs WHERE id > ? AND status != 'ok'", (after_run,))]


class ReaderCrawler:
    name = "reader"

    def __init__(self, python, work, farm, workers, timeout):
        self.python, self.workers, self.timeout = python, workers, timeout
        self.cwd = work
        self.urls_file = os.path.join(work, "reader-urls.txt")
        with open(self.urls_file, "w", encoding="utf-8") as f:
            f.write("\n".join(farm.urls) + "\n")
        self.env = crawl.child_env()
        self.db = None

    def fresh_database(self, round_dir):
        self.db = os.path.join(round_dir, "reader.sqlite")

    def crawl(self, report_path):
        """(Measured, stored entries, problem or None)."""
        got = measure(self.python, [self.python, "-c", READER_CRAWL, self.db, str(self.workers),
                                    self.urls_file], self.cwd, self.env, self.timeout, report_path)
        if got.exit != 0:
            return got, None, f"the reader crawl exited {got.exit}"
        summary = json.loads(got.stdout.strip().splitlines()[-1])
        errors = summary["errors"]
        problem = f"{len(errors)} feeds failed, e.g. {errors[0]}" if errors else None
        return got, count_rows(self.db, "entries"), problem


# Rounds --------------------------------------------------------------------------

def expected_served(kind, feeds):
    return {"304": feeds} if kind == "second" else {"200": feeds}


def crawl_both(kind, order, farm, results, expect_entries, report_path):
    """One crawl of each program, in `order`; results[kind][name] gets a row."""
    feeds = len(farm.urls)
    for crawler in order:
        before = farm.served()
        got, stored, problem = crawler.crawl(report_path)
        served = dict(farm.served() - before)
        stored_text = "-" if stored is None else f"{stored}"
        print(f"    {kind:6} {crawler.name:8} {got.wall:7.2f} s  peak RSS {got.peak_mb:6.1f} MB"
              f"  {stored_text:>6} entries  served {served}", flush=True)
        if problem:
            for line in got.tail():
                print(f"        {crawler.name}> {line}")
            fail(f"{kind} crawl, {crawler.name}: {problem}")
        elif not stored:
            fail(f"{kind} crawl, {crawler.name}: no entry stored")
        elif stored != expect_entries:
            print(f"        WARNING: {stored} entries stored, {expect_entries} expected")
        if served != expected_served(kind, feeds):
            print(f"        WARNING: served {served}, expected {expected_served(kind, feeds)}")
        results[kind][crawler.name].append({"wall": got.wall, "peak": got.peak_mb,
                                            "stored": stored})


def run_round(number, crawlers, farm, work, entries, results):
    order = crawlers if number % 2 else crawlers[::-1]
    print(f"round {number}: {order[0].name} first", flush=True)
    round_dir = os.path.join(work, f"round{number}")
    os.makedirs(round_dir)
    for crawler in crawlers:
        crawler.fresh_database(round_dir)
    report_path = os.path.join(round_dir, "measured.json")
    feeds = len(farm.urls)
    farm.publish(entries)
    crawl_both("first", order, farm, results, feeds * entries, report_path)
    crawl_both("second", order, farm, results, feeds * entries, report_path)
    farm.publish(entries + GROWTH)
    crawl_both("grown", order, farm, results, feeds * (entries + GROWTH), report_path)


# Figures -------------------------------------------------------------------------

def verdict(met):
    return "MET" if met else "MISS"


def ratio_text(value, base):
    return f"{value / base:.2f}" if base > 0 else "n/a"


def summarize(results):
    """Prints each kind's figures; returns the rows of the closing table."""
    table = []
    for kind, label, goal in CRAWLS:
        rows = results[kind]
        if not all(rows[name] for name in TOOLS):
            continue
        shown = [name for name in SHOWN if rows[name]]
        walls = {name: [row["wall"] for row in rows[name]] for name in shown}
        peaks = {name: statistics.median(row["peak"] for row in rows[name]) for name in shown}
        median = {name: statistics.median(walls[name]) for name in shown}
        print(f"\ncrawl: {label}")
        for name in shown:
            stored = sorted({row["stored"] for row in rows[name]}, key=str)
            print(f"    {name:8}  wall min {min(walls[name]):6.2f} s  median {median[name]:6.2f} s"
                  f"   peak RSS median {peaks[name]:6.1f} MB   stored entries "
                  f"{', '.join(str(s) for s in stored)}")
        wall_ratio = ratio_text(median["VESTI"], median["reader"])
        print(f"    wall VESTI / reader = {wall_ratio}   goal <= {goal}   "
              f"{verdict(median['VESTI'] <= goal * median['reader'])}")
        rss_ratio = ratio_text(peaks["VESTI"], peaks["reader"])
        print(f"    peak RSS VESTI / reader = {rss_ratio}   ({peaks['VESTI']:.1f} vs "
              f"{peaks['reader']:.1f} MB; goal VESTI <= reader + {RSS_SLACK_MB} MB)   "
              f"{verdict(peaks['VESTI'] <= peaks['reader'] + RSS_SLACK_MB)}")
        if "vesti.py" in peaks:
            print(f"    vesti.py (compiled at each start) / reader: wall "
                  f"{ratio_text(median['vesti.py'], median['reader'])}, peak RSS "
                  f"{ratio_text(peaks['vesti.py'], peaks['reader'])} ({peaks['vesti.py']:.1f} MB); "
                  f"the compile costs {peaks['vesti.py'] - peaks['VESTI']:+.1f} MB, "
                  f"{median['vesti.py'] - median['VESTI']:+.2f} s")
        mismatched = [i + 1 for i, (v, r) in enumerate(zip(rows["VESTI"], rows["reader"]))
                      if v["stored"] != r["stored"]]
        if mismatched:
            print(f"    WARNING: stored-entry counts differ in round(s) {mismatched}")
        table.append((label, wall_ratio, rss_ratio,
                      ratio_text(peaks["vesti.py"], peaks["reader"]) if "vesti.py" in peaks
                      else "n/a"))
    return table


def print_table(table, args, versions):
    print(f"\nMeasured against reader {versions['reader']}, both crawling the same "
          f"{args.feeds} feeds x {args.entries} entries on {feed_host(1)}-"
          f"{feed_host(args.feeds).rsplit('.', 1)[1]} with {args.latency * 1000:.0f} ms "
          f"latency and {args.workers} workers, Python {versions['python']}, medians of "
          f"{args.rounds} rotating rounds:")
    print("| crawl | VESTI / reader (wall) | peak RSS VESTI / reader | peak RSS vesti.py / reader |")
    print("|---|---|---|---|")
    for label, wall_ratio, rss_ratio, script_ratio in table:
        print(f"| {label} | {wall_ratio} | {rss_ratio} | {script_ratio} |")


# Interpreter ---------------------------------------------------------------------

VERSIONS = ("import json, sys, reader, feedparser, yaml; "
            "print(json.dumps({'python': '%d.%d.%d' % sys.version_info[:3], "
            "'reader': reader.__version__}))")


def setup_venv(path):
    """Make the venv at `path` with this interpreter (3.12+); returns its python."""
    if sys.version_info < (3, 12):
        raise SystemExit(f"--setup: run this script with Python 3.12+ (this is "
                         f"{sys.version.split()[0]}); {SETUP_HINT}")
    python = os.path.join(path, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "-r",
                    os.path.join(REPO, "requirements.txt"), f"reader=={READER_VERSION}"],
                   check=True)
    return python


def choose_python(args):
    if args.setup:
        return setup_venv(os.path.abspath(args.setup))
    if args.python:
        return args.python
    for venv in DEFAULT_VENVS:
        python = os.path.join(venv, "bin", "python")
        if os.path.exists(python):
            return python
    raise SystemExit(f"no venv with reader found at {' or '.join(DEFAULT_VENVS)}; {SETUP_HINT}")


def check_python(python):
    """Versions of Python and reader in `python`; exits with a hint if unusable."""
    proc = subprocess.run([python, "-c", VERSIONS], capture_output=True, text=True,
                          env=crawl.child_env())
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"{python} cannot run both crawlers ({last}); {SETUP_HINT}")
    versions = json.loads(proc.stdout)
    if tuple(int(p) for p in versions["python"].split(".")[:2]) < (3, 12):
        raise SystemExit(f"{python} is Python {versions['python']}, 3.12+ wanted; {SETUP_HINT}")
    return versions


# Main ----------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", help="interpreter (3.12+, with VESTI's requirements and "
                        f"reader=={READER_VERSION}) running both crawlers (default: the first "
                        f"of {', '.join(DEFAULT_VENVS)})")
    parser.add_argument("--setup", metavar="DIR", help="make (or complete) a venv at DIR with "
                        "the running interpreter, install the requirements and reader into it, "
                        "and benchmark with it")
    parser.add_argument("--feeds", type=int, help="number of feeds (default 200)")
    parser.add_argument("--entries", type=int, help="entries per feed (default 50)")
    parser.add_argument("--latency", type=float,
                        help="seconds each server waits before answering (default 0.1)")
    parser.add_argument("--rounds", type=int, help="rounds, each on fresh databases (default 4)")
    parser.add_argument("--workers", type=int, default=8,
                        help="RSS_CONCURRENCY of VESTI, workers of reader (default 8)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny sizes ({SMOKE['feeds']} feeds x {SMOKE['entries']} entries, "
                             f"{SMOKE['latency'] * 1000:.0f} ms latency, 1 round): checks that "
                             "the whole benchmark runs, in a few seconds")
    args = parser.parse_args(argv)
    for name, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.feeds, args.entries, args.rounds, args.workers) < 1 or args.latency < 0:
        parser.error("--feeds, --entries, --rounds and --workers must be 1 or more, "
                     "--latency 0 or more")
    return args


def main(argv=None):
    args = parse_args(argv)
    python = choose_python(args)
    versions = check_python(python)
    if versions["reader"] != READER_VERSION:
        print(f"WARNING: reader {versions['reader']} in {python}, {READER_VERSION} wanted")
    if args.smoke:
        print("smoke mode: tiny sizes; the figures show that the benchmark runs, the "
              "MET/MISS verdicts mean nothing\n")
    print(f"== VESTI vs reader {versions['reader']}: {args.feeds} feeds x {args.entries} "
          f"entries, {args.latency * 1000:.0f} ms per answer, {args.workers} workers, "
          f"{args.rounds} round(s); Python {versions['python']} ({python})", flush=True)
    timeout = 120 + 10 * (args.feeds * args.latency / args.workers
                          + args.feeds * (args.entries + GROWTH) / 1000)
    results = {kind: {name: [] for name in SHOWN} for kind, _, _ in CRAWLS}
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="vesti-reader-")
    try:
        with feed_farm(args.feeds, args.latency) as farm:
            crawlers = [VestiCrawler(python, work, farm, args.workers,
                                     max(200, args.entries + GROWTH), timeout),
                        ReaderCrawler(python, work, farm, args.workers, timeout),
                        VestiCrawler(python, work, farm, args.workers,
                                     max(200, args.entries + GROWTH), timeout, script=True)]
            for number in range(1, args.rounds + 1):
                run_round(number, crawlers, farm, work, args.entries, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = summarize(results)
    print_table(table, args, versions)
    print(f"\n{time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
