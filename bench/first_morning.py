#!/usr/bin/env python3
"""Benchmark of a new newsroom's first morning: how long `vesti.py run`,
started on an empty database, takes to fill the editor's desk. Prints
figures (and, with --compare, an earlier vesti.py's beside them). Exits 0
when everything ran (a run that does not fill the desk within --timeout is
a figure, "> timeout", not a failure); exits 1 when something broke: an
exception, `run` exiting before it was stopped or not exiting 0 within
STOP_WAIT seconds of SIGTERM, a source whose crawl failed, a post stored
twice or missing, a post failed, a desk with no card. Run from the
repository root: `python bench/first_morning.py`; `--smoke` runs the whole
path in about 2 s (5 with --compare) with the 6 small feeds of SMOKE_FEEDS,
one entry each, one round and the file read every 0.05 s (the figures only
show that it runs).

What it measures:

The feeds. 27 real feeds of ../shared/corpus/feeds/real (FEEDS below: 21
English, 4 German, 2 Russian, one of them written in windows-1251; see
MANIFEST.tsv there) are read with feedparser and written again as fresh
RSS 2.0 feeds of at most --entries (25) entries each, about 600 in all:
real titles, texts and dates (every fifth entry's date is left out, and the heise RDF feed has
none), each entry's link an article page on the bench's own server for that
feed. 14 feeds carry the full text in the entry (content:encoded, the
entry's own text cut to at most FULL_TEXT_MAX characters; only entries with
at least FULL_TEXT_MIN + 100 characters are taken); 13 carry only a teaser
(the text's first sentence, under TEASER_MAX characters), so VESTI fetches
each such article in phase 3: /article/N serves a real page of
../shared/corpus/html (the pages in turn; trafilatura extracts its text).
Every generated feed is read back with the repository's vesti.parse_feed
before the first run: each entry must come out as one post, with
content_type 'full' or 'summary' as intended (FULL_TEXT_MIN, vesti.py's
"Shorter than this, a feed's text is a teaser", is 600 characters). Entries
whose text another entry already has are left out, so every entry is one
post.

The hosts. Each feed and its articles are served from a loopback address of
its own (127.0.0.2 ... 127.0.0.28, one ThreadingHTTPServer bound to each,
all on one port): VESTI paces requests per host (RSS_HOST_DELAY, 1 s), and
that pace is part of what is measured. A teaser feed of 25 entries costs its
host the feed and 25 article requests, so the full desk cannot come sooner
than about 25 x RSS_HOST_DELAY after the feed's crawl (printed as "host
pace floor").

A run. sources.yaml lists the 27 sources (priorities 0, 1 and 2, each with a
direction) and three directions whose keywords (English, German and Russian
words of the feeds' and the pages' own texts) hit a good share of the posts.
`vesti.py run` starts in a fresh temporary directory (no .env) with VESTI_DB
a new SQLite file, VESTI_SOURCES that file, OLLAMA_URL empty (keyword mode),
VESTI_WEB_PORT a free port, VESTI_WEB_PASSWORD set; everything else default
(RSS_HOST_DELAY 1, VESTI_WORKERS 4, RSS_CONCURRENCY 8; a VESTI_, RSS_ or
OLLAMA_ setting in the environment applies to every run and is printed).
Every POLL seconds the file is read (read-only): posts pending or processing,
posts classified, enabled sources fetched (last_fetch set). Measured from the
moment `run` is started (Python's start-up included):
    first post   seconds until the first post is classified
    all crawled  seconds until every enabled source has been fetched once
    full desk    seconds until every source has been fetched and no post is
                 pending or processing
Then, per run: posts (of which summary-only, and how many of those got
their article's text), articles served, hosts, posts relevant enough for the
desk, and when the articles were fetched (first, last, per second, beside
the hosts' own limit of one request per RSS_HOST_DELAY each); `GET /` with
Basic auth must show cards. Then SIGTERM: `run` must exit 0 within
STOP_WAIT seconds (else it is killed). A run not full after --timeout
seconds (default 900) shows "> timeout" for what it did not reach. There is
no target: the figures are what a new install waits.

--compare PATH runs a second vesti.py (e.g. `git show REV:vesti.py >
/tmp/old/vesti.py`; it needs no other file) on the same feeds, in turns with
--vesti (default the repository's): new, old, then old, new, ... over
--rounds rounds (default 2; 1 with --smoke), so a noisy machine weighs on
both alike. A table gives each figure's least and median on each side and
the ratio old/new of the medians (above 1: the new one is faster).
"""

import argparse
import base64
import calendar
import contextlib
import email.utils
import html
import http.client
import http.server
import math
import os
import re
import signal
import socket
import socketserver
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from xml.sax.saxutils import escape

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)

import vesti  # noqa: E402
from harness import fail, run  # noqa: E402

CORPUS = os.path.join(os.path.dirname(REPO), "shared", "corpus")
if not os.path.isdir(CORPUS):       # a checkout on its own: the part of it the tests read
    CORPUS = os.path.join(REPO, "tests", "fixtures", "corpus")
PASSWORD = "bench-first-morning"
USER = "admin"
POLL = 0.2
# Seconds an idle feed host waits between looks for shutdown()
# (serve_forever's default).
STOP_POLL = 0.5
STOP_WAIT = 15
START_TIMEOUT = 900
ENTRIES = 25
TEASER_MAX = 140
FULL_TEXT_MAX = 2500
FULL_TEXT_MIN = getattr(vesti, "FULL_TEXT_MIN", 600)
NO_DATE_EVERY = 5
FIGURES = (("first", "first post"), ("crawled", "all crawled"), ("full", "full desk"))
SMOKE = {"feeds": 6, "entries": 1, "rounds": 1}
# --smoke: shorter polls of the file and of the feed hosts (which then stop
# at once).
SMOKE_POLL = 0.05
SMOKE_STOP_POLL = 0.05

# (file in feeds/real, slug, language, full text or teaser, priority, direction).
FEEDS = [
    ("nnw__cloudblog.rss", "cloudblog", "en", "full", 0, "tech"),
    ("miniflux__encoding_WINDOWS-1251.xml", "ibash", "ru", "teaser", 1, "world"),
    ("feedjira__CRE.xml", "cre", "de", "full", 2, "tech"),
    ("rssparser__guardian.rss", "guardian", "en", "teaser", 0, "world"),
    ("nodefp__tpm.atom", "tpm", "en", "full", 1, "world"),
    ("miniflux__encoding_ISO-8859-1.xml", "golem", "de", "teaser", 2, "tech"),
    ("nodefp__iconv.xml", "oren", "ru", "teaser", 0, "world"),
    ("nnw__draw-down.atom", "drawdown", "en", "full", 1, "tech"),
    ("nnw__macworld.rss", "macworld", "en", "teaser", 1, "tech"),
    ("nnw__atp.rss", "atp", "en", "full", 2, "tech"),
    ("nnw__medscape.rss", "medscape", "en", "teaser", 0, "science"),
    ("rssparser__many-links.rss", "testing-blog", "en", "full", 1, "tech"),
    ("nnw__livemint.xml", "livemint", "en", "teaser", 1, "world"),
    ("rome__rss_1.0-ns-on-channel.xml", "vegetation", "en", "full", 2, "science"),
    ("nodefp__wapowellness.xml", "wapo-wellness", "en", "teaser", 1, "science"),
    ("feedjira2009__StakeVentures.xml", "stakeventures", "en", "full", 2, "tech"),
    ("feedjira2009__Slashdot.xml", "slashdot", "en", "teaser", 0, "tech"),
    ("feedjira2009__Juniordeveloper.xml", "juniordev", "en", "full", 2, "tech"),
    ("miniflux__rdf_UTF8.xml", "heise", "de", "teaser", 1, "tech"),
    ("feedjira2009__SignalvsNoise.xml", "svn", "en", "full", 1, "tech"),
    ("rssparser__heise.atom", "heise-dev", "de", "teaser", 2, "tech"),
    ("feedjira__TechCrunch.xml", "techcrunch", "en", "full", 0, "tech"),
    ("nnw__bio.rdf", "biorxiv", "en", "teaser", 2, "science"),
    ("rssparser__feedburner.atom", "ads-dev", "en", "full", 2, "tech"),
    ("nnw__neverworkintheory.atom", "nwit", "en", "teaser", 1, "science"),
    ("miniflux__large_rss.xml", "artificial-truth", "en", "full", 1, "tech"),
    ("feedjira2009__ZedShaw.xml", "zedshaw", "en", "full", 2, "tech"),
]
ENCODINGS = {"ibash": "windows-1251"}     # the rest are written in UTF-8
# --smoke's feeds (taken in FEEDS' order): both kinds, three languages and
# three priorities, in files that feedparser reads quickly.
SMOKE_FEEDS = ("cloudblog", "ibash", "guardian", "tpm", "golem", "stakeventures")

DIRECTIONS = {
    "tech": ("Technology", [
        "software", "google", "apple", "iphone", "mac", "linux", "cloud", "developer*",
        "programming", "programmer*", "code", "ruby", "rails", "javascript", "python",
        "security", "internet", "computer*", "app", "apps", "database", "server*", "browser",
        "Entwickler*", "Programm*", "Rechner", "Netz", "Sicherheit", "Daten",
        "программ*", "компьютер*", "интернет*", "сайт*", "админ*"]),
    "science": ("Science and health", [
        "health", "study", "studies", "research*", "patient*", "doctor*", "disease*",
        "cancer", "plant*", "species", "vegetation", "climate", "scientist*", "medical",
        "virus", "coronavirus", "covid", "Studie", "Forscher*", "Wissenschaft*", "Gesundheit",
        "Klima", "здоровь*", "врач*", "больниц*", "учён*", "учен*"]),
    "world": ("Politics and the world", [
        "government", "president", "election*", "trump", "obama", "congress", "senate",
        "police", "court", "minister*", "war", "parliament", "Regierung", "Polizei",
        "Bundesregierung", "Gericht", "Wahl*", "Krieg", "губернатор*", "правительств*",
        "полици*", "суд*", "выбор*", "оренбург*", "росси*", "москв*"]),
}


# The feeds --------------------------------------------------------------------

def first_sentence(text, limit=TEASER_MAX):
    """The text's first sentence (its start when that sentence is only a
    few words), cut at a word under `limit` characters."""
    text = " ".join(text.split())
    sentence = re.split(r"(?<=[.!?…])\s+", text, maxsplit=1)[0]
    if len(sentence) < 40:
        sentence = text
    if len(sentence) < limit:
        return sentence
    cut = sentence[:limit - 1].rsplit(" ", 1)[0].rstrip(",;:–—-")
    return cut + "…"


def cut_text(text, limit=FULL_TEXT_MAX):
    """At most `limit` characters, ending at a paragraph or a word."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    paragraph = cut.rfind("\n")
    if paragraph > limit // 2:
        return cut[:paragraph].rstrip()
    return cut.rsplit(" ", 1)[0].rstrip() + "…"


def entry_date(entry):
    parsed = dict.get(entry, "published_parsed") or dict.get(entry, "updated_parsed")
    return email.utils.formatdate(calendar.timegm(parsed), usegmt=True) if parsed else None


def read_feed(path, kind, limit, seen):
    """(title, [(title, text, date or None)]) of one corpus feed: at most
    `limit` entries with a title and a text of the kind asked for, none whose
    text `seen` holds already."""
    import feedparser
    with open(path, "rb") as f:
        parsed = feedparser.parse(f.read())
    entries = []
    for entry in parsed.entries:
        if len(entries) >= limit:
            break
        title = vesti.readable(entry.get("title"), (entry.get("title_detail") or {}).get("type"))
        title = " ".join(title.split())
        text, _ = vesti.entry_text(entry)
        if kind == "full":
            if len(text) < FULL_TEXT_MIN + 100:
                continue
            text = cut_text(text)
        else:
            text = first_sentence(text if len(text) >= 40 else f"{title}. {text}")
        key = vesti.normalize_text(text).casefold()
        if not title or not text or key in seen:
            continue
        seen.add(key)
        entries.append((title, text, entry_date(entry)))
    return " ".join((parsed.feed.get("title") or "").split()), entries


def rss_body(feed, base, entries, encoding):
    """A fresh RSS 2.0 document: links and guids on the feed's own host."""
    items = []
    for k, (title, text, date) in enumerate(entries, 1):
        link = f"{base}/article/{k}"
        date = None if k % NO_DATE_EVERY == 0 else date
        parts = [f"<title>{escape(title)}</title>", f"<link>{link}</link>",
                 f'<guid isPermaLink="true">{link}</guid>']
        if date:
            parts.append(f"<pubDate>{date}</pubDate>")
        if feed["kind"] == "full":
            markup = "".join(f"<p>{html.escape(p)}</p>" for p in text.split("\n") if p.strip())
            parts.append(f"<description>{escape(first_sentence(text))}</description>")
            parts.append(f"<content:encoded>{escape(markup)}</content:encoded>")
        else:
            parts.append(f"<description>{escape(text)}</description>")
        items.append("<item>" + "".join(parts) + "</item>")
    document = (
        f'<?xml version="1.0" encoding="{encoding}"?>\n'
        '<rss version="2.0" xmlns:content="http://purl.org/rss/1.0/modules/content/">'
        f"<channel><title>{escape(feed['name'])}</title><link>{base}/</link>"
        f"<description>{escape(feed['name'])} (VESTI first-morning benchmark)</description>"
        f"<language>{feed['lang']}</language>\n" + "\n".join(items) + "\n</channel></rss>\n")
    return document.encode(encoding, "xmlcharrefreplace")


def load_feeds(corpus, count, entries, pool=FEEDS):
    """The feeds' entries and names (the first `count` of `pool`), before any
    server exists."""
    seen, feeds = set(), []
    for file, slug, lang, kind, priority, direction in pool[:count]:
        path = os.path.join(corpus, "feeds", "real", file)
        name, items = read_feed(path, kind, entries, seen)
        feeds.append({"file": file, "slug": slug, "lang": lang, "kind": kind,
                      "priority": priority, "direction": direction, "name": name or slug,
                      "entries": items, "encoding": ENCODINGS.get(slug, "utf-8")})
    return feeds


def article_pages(corpus):
    folder = os.path.join(corpus, "html")
    pages = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".html"):
            with open(os.path.join(folder, name), "rb") as f:
                pages.append(f.read())
    return pages


def check_feeds(feeds):
    """Each feed read back with vesti.parse_feed: one post per entry, each
    with the content_type intended. Returns False (and fails) if not."""
    ok = True
    for feed in feeds:
        parsed = vesti.parse_feed(feed["body"], feed["url"], max(200, len(feed["entries"])),
                                  content_type=feed["content_type"])
        kinds = Counter(draft.content_type for draft in parsed.drafts)
        want = {"full" if feed["kind"] == "full" else "summary": len(feed["entries"])}
        if dict(kinds) != want:
            fail(f"feed {feed['slug']}: vesti.parse_feed gives {dict(kinds)}, expected {want}")
            ok = False
    return ok


# The hosts --------------------------------------------------------------------

SERVED_LOCK = threading.Lock()
ARTICLE_TIMES = []      # (monotonic time, host) of each article served, per run


class Handler(http.server.BaseHTTPRequestHandler):
    """/feed.xml: the host's feed; /article/N: a corpus page."""

    def do_GET(self):
        site = self.server.site
        if self.path == "/feed.xml":
            body, kind, what = site["body"], site["content_type"], "feed"
        elif self.path.startswith("/article/") and self.path[9:].isdigit() \
                and 1 <= int(self.path[9:]) <= len(site["entries"]):
            body, kind = site["pages"][int(self.path[9:]) - 1], "text/html"
            what = f"article of {site['kind']}"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)
        with SERVED_LOCK:
            site["served"][what] += 1
            if what != "feed":
                ARTICLE_TIMES.append((time.monotonic(), self.server.server_address[0]))

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self):
        # HTTPServer.server_bind looks the address up in DNS (getfqdn): slow
        # for a loopback address on a machine without a resolver.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


def host_address(n):
    """127.0.0.2, 127.0.0.3, ... for n = 1, 2, ..."""
    return f"127.{(n + 1) >> 16 & 255}.{(n + 1) >> 8 & 255}.{(n + 1) & 255}"


def bind_all(count, attempts=20):
    """One server per loopback address, all on one port."""
    for _ in range(attempts):
        servers = []
        try:
            first = Server((host_address(1), 0), Handler)
            servers.append(first)
            port = first.server_address[1]
            for n in range(2, count + 1):
                servers.append(Server((host_address(n), port), Handler))
            return servers, port
        except OSError:
            for server in servers:
                server.server_close()
    raise RuntimeError(f"no port free on all of {host_address(1)}..{host_address(count)}")


@contextlib.contextmanager
def feed_hosts(feeds, pages, stop_poll=STOP_POLL):
    """Serves each feed and its articles from its own address; fills in each
    feed's url, body and site, and yields the served Counter."""
    served = Counter()
    servers, port = bind_all(len(feeds))
    next_page = 0
    try:
        for n, (feed, server) in enumerate(zip(feeds, servers), 1):
            base = f"http://{host_address(n)}:{port}"
            feed["host"], feed["url"] = host_address(n), f"{base}/feed.xml"
            feed["body"] = rss_body(feed, base, feed["entries"], feed["encoding"])
            feed["content_type"] = f"application/rss+xml; charset={feed['encoding']}"
            # Articles of teaser feeds take the pages in turn across the farm.
            cycled = [pages[(next_page + k) % len(pages)] for k in range(len(feed["entries"]))]
            if feed["kind"] == "teaser":
                next_page += len(feed["entries"])
            server.site = {"body": feed["body"], "content_type": feed["content_type"],
                           "entries": feed["entries"], "pages": cycled,
                           "kind": feed["kind"], "served": served}
            threading.Thread(target=server.serve_forever, args=(stop_poll,), daemon=True).start()
        yield served
    finally:
        def stop(server):
            server.shutdown()
            server.server_close()
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            list(pool.map(stop, servers))


def write_sources(path, feeds):
    lines = ["directions:"]
    for direction, (title, keywords) in DIRECTIONS.items():
        lines += [f"  {direction}:", f"    title: {title}",
                  "    keywords: [" + ", ".join(f'"{k}"' for k in keywords) + "]"]
    lines.append("sources:")
    for feed in feeds:
        name = feed["name"].replace("\\", "\\\\").replace('"', '\\"')
        lines += [f"  - slug: {feed['slug']}", f'    name: "{name}"', "    crawler: rss",
                  f"    url: {feed['url']}", f"    direction: {feed['direction']}",
                  f"    priority: {feed['priority']}"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


# One run ----------------------------------------------------------------------

def child_env(**settings):
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update({k: str(v) for k, v in settings.items()})
    return env


def free_port():
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Poller:
    """Reads the run's database read-only; None until it has its tables."""

    def __init__(self, path):
        self.path, self.conn = path, None

    def read(self):
        try:
            if self.conn is None:
                if not os.path.exists(self.path):
                    return None
                self.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=1)
            open_ = self.conn.execute(
                "SELECT count(*) FROM posts WHERE classified IN (0, -1) OR classified IS NULL"
            ).fetchone()[0]
            done = self.conn.execute(
                "SELECT count(*) FROM posts WHERE classified = 1").fetchone()[0]
            enabled, fetched = self.conn.execute(
                "SELECT count(*), count(last_fetch) FROM sources WHERE enabled = 1").fetchone()
            return {"open": open_, "done": done, "enabled": enabled, "fetched": fetched}
        except sqlite3.Error:
            self.close()    # not created yet, or caught mid-migration: next time
            return None

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def final_figures(path, feeds, floor):
    teasers = [feed["slug"] for feed in feeds if feed["kind"] == "teaser"]
    marks = ",".join("?" * len(teasers)) or "''"
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        one = lambda sql, params=(): conn.execute(sql, params).fetchone()[0]  # noqa: E731
        return {
            "posts": one("SELECT count(*) FROM posts"),
            "classified": dict(conn.execute(
                "SELECT coalesce(classified, 0), count(*) FROM posts GROUP BY 1")),
            "summary_posts": one(f"SELECT count(*) FROM posts JOIN sources s ON s.id = source_id "
                                 f"WHERE s.slug IN ({marks})", teasers),
            "with_article": one(f"SELECT count(*) FROM posts JOIN sources s ON s.id = source_id "
                                f"WHERE s.slug IN ({marks}) AND content_type = 'full'", teasers),
            "relevant": one("SELECT count(*) FROM posts WHERE classified = 1 AND status = 'new' "
                            "AND relevance >= ?", (floor,)),
            "hits": one("SELECT count(*) FROM posts WHERE classified = 1 AND relevance > 0"),
            "source_errors": conn.execute(
                "SELECT slug, last_error FROM sources WHERE enabled = 1 "
                "AND last_error IS NOT NULL ORDER BY slug").fetchall(),
            "post_errors": conn.execute(
                "SELECT DISTINCT error FROM posts WHERE error IS NOT NULL LIMIT 3").fetchall(),
        }


def get_desk(port):
    """(status, cards) of GET / with Basic auth."""
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/", headers={"Authorization": f"Basic {auth}"})
        response = conn.getresponse()
        body = response.read()
        return response.status, body.count(b'<article class="post"')
    finally:
        conn.close()


def stop_run(proc):
    """SIGTERM, then (exit code or None if it had to be killed, seconds)."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    return code, time.monotonic() - started


def show_log(log_path, lines=8):
    with open(log_path, encoding="utf-8", errors="replace") as f:
        tail = f.read().strip().splitlines()[-lines:]
    for line in tail:
        print(f"    vesti> {line}")


def fmt(seconds, timeout):
    return f"> {timeout:.0f}" if seconds is None or math.isinf(seconds) else f"{seconds:.1f}"


def one_run(label, program, feeds, sources, tmp, served, timeout, floor, delay, poll=POLL):
    """`program run` from an empty database until the desk is full; its figures."""
    folder = tempfile.mkdtemp(prefix="run-", dir=tmp)
    db, log_path = os.path.join(folder, "vesti.db"), os.path.join(folder, "run.log")
    port = free_port()
    env = child_env(VESTI_DB=db, VESTI_SOURCES=sources, OLLAMA_URL="", VESTI_WEB_HOST="127.0.0.1",
                    VESTI_WEB_PORT=port, VESTI_WEB_PASSWORD=PASSWORD)
    expected = sum(len(feed["entries"]) for feed in feeds)
    with SERVED_LOCK:
        served.clear()
        ARTICLE_TIMES.clear()
    times = {"first": math.inf, "crawled": math.inf, "full": math.inf}
    poller = Poller(db)
    print(f"{label}: {program} run")
    with open(log_path, "wb") as log:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, program, "run"], cwd=folder, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    exited = None
    try:
        tick = started
        while True:
            tick += poll
            time.sleep(max(0.0, tick - time.monotonic()))
            now = time.monotonic() - started
            state = poller.read()
            if state is not None:
                if state["done"] and math.isinf(times["first"]):
                    times["first"] = now
                crawled = state["enabled"] == len(feeds) and state["fetched"] == state["enabled"]
                if crawled and math.isinf(times["crawled"]):
                    times["crawled"] = now
                if crawled and state["open"] == 0 and state["done"]:
                    times["full"] = now
                    break
            exited = proc.poll()
            if exited is not None or now > timeout:
                break
        poller.close()
        if exited is not None:
            print(f"    `run` exited {exited} by itself after {now:.1f} s; the end of what it said:")
            with open(log_path, "rb") as said:
                for line in said.read().decode("utf-8", "replace").splitlines()[-30:]:
                    print(f"    | {line}")
            fail(f"{label}: `run` exited {exited} before it was stopped")
        else:
            try:
                status, cards = get_desk(port)
            except OSError as e:
                status, cards = f"no answer ({e})", 0
        figures = final_figures(db, feeds, floor) if os.path.exists(db) else None
    finally:
        if proc.poll() is None:
            code, stop_seconds = stop_run(proc)
        else:
            code, stop_seconds = proc.returncode, 0.0
    with SERVED_LOCK:
        counts = dict(served)
        fetched = sorted(t - started for t, _ in ARTICLE_TIMES)
        article_hosts = len({host for _, host in ARTICLE_TIMES})
    articles = sum(n for what, n in counts.items() if what.startswith("article"))
    if exited is None:
            print("    " + ", ".join(f"{name} {fmt(times[key], timeout)} s"
                                  for key, name in FIGURES)
              + ("" if not math.isinf(times["full"]) else f"  (not full after {timeout:.0f} s)"))
    if figures is not None:
        summary = len([f for f in feeds if f["kind"] == "teaser"])
        print(f"    {figures['posts']} posts of {expected} entries, {figures['summary_posts']} "
              f"summary-only ({figures['with_article']} got their article's text), "
              f"{articles} articles served, {counts.get('feed', 0)} feed requests, "
              f"{len(feeds)} hosts ({summary} with teasers)")
        print(f"    classified {figures['classified']}; {figures['hits']} with a keyword hit, "
              f"{figures['relevant']} at relevance >= {floor}")
    if len(fetched) > 1 and fetched[-1] > fetched[0]:
        rate = (len(fetched) - 1) / (fetched[-1] - fetched[0])
        ceiling = (f"; {article_hosts} hosts at one per {delay:g} s allow "
                   f"{article_hosts / delay:.0f}/s" if delay > 0 else "")
        print(f"    articles fetched from {fetched[0]:.1f} s to {fetched[-1]:.1f} s: "
              f"{rate:.1f}/s{ceiling}")
    if exited is None:
        print(f"    desk: GET / {status}, {cards} cards; stopped on SIGTERM: "
              + (f"exit {code} in {stop_seconds:.1f} s" if code is not None
                 else f"still running after {STOP_WAIT} s, killed"))
        if status != 200 or cards == 0:
            fail(f"{label}: the desk answered {status} with {cards} cards")
        if code != 0:
            fail(f"{label}: `run` " + (f"exited {code} on SIGTERM" if code is not None
                                       else f"did not exit within {STOP_WAIT} s of SIGTERM"))
    if figures is not None:
        for slug, error in figures["source_errors"]:
            fail(f"{label}: source {slug}: {vesti.shorten(error, 200)}")
        for (error,) in figures["post_errors"]:
            print(f"    post error: {vesti.shorten(error, 200)}")
        if figures["classified"].get(-2):
            fail(f"{label}: {figures['classified'][-2]} posts failed")
        if not math.isinf(times["full"]) and figures["posts"] != expected:
            fail(f"{label}: {figures['posts']} posts stored, {expected} expected")
    if code != 0 or figures is None:
        show_log(log_path)
    return None if exited is not None else times


# Main -------------------------------------------------------------------------

def summary_table(rounds, programs, timeout):
    """Least and median of each figure per side; old/new of the medians. A
    run that broke (None) is left out."""
    sides = [side for side in ("new", "old") if rounds[side]]
    print(f"== first morning, seconds: least and median of {len(rounds['new'])} round(s)"
          + ("" if all(all(rounds[side]) for side in sides) else ", runs that broke left out"))
    for side in sides:
        print(f"    {side}: {programs[side]}")
    header = f"{'figure':<12}" + "".join(f" {side + ' least':>10} {'median':>7}" for side in sides)
    print(header + (f"  {'old/new':>7}" if len(sides) == 2 else ""))
    for key, name in FIGURES:
        row, medians = f"{name:<12}", {}
        for side in sides:
            values = [r[key] for r in rounds[side] if r is not None]
            if not values:
                row += f" {'-':>10} {'-':>7}"
                continue
            medians[side] = statistics.median(values)
            row += f" {fmt(min(values), timeout):>10} {fmt(medians[side], timeout):>7}"
        if len(sides) == 2:
            finite = len(medians) == 2 and all(not math.isinf(m) for m in medians.values()) \
                and medians["new"] > 0
            row += f"  {medians['old'] / medians['new']:7.2f}" if finite else f"  {'n/a':>7}"
        print(row)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vesti", metavar="PATH", default=os.path.join(REPO, "vesti.py"),
                        help="the vesti.py measured (default: the repository's)")
    parser.add_argument("--compare", metavar="PATH",
                        help="an earlier vesti.py, run in turns with --vesti on the same feeds")
    parser.add_argument("--rounds", type=int, help="runs of each (default 2; 1 with --smoke)")
    parser.add_argument("--feeds", type=int,
                        help=f"feeds, 1-{len(FEEDS)} (default {len(FEEDS)}; with --smoke, "
                             f"1-{len(SMOKE_FEEDS)} of SMOKE_FEEDS)")
    parser.add_argument("--entries", type=int,
                        help=f"entries per feed at most (default {ENTRIES})")
    parser.add_argument("--timeout", type=float, default=START_TIMEOUT,
                        help=f"seconds a run may take to fill the desk (default {START_TIMEOUT})")
    parser.add_argument("--corpus", default=CORPUS, help=f"the corpus (default {CORPUS})")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE['feeds']} feeds x {SMOKE['entries']} entries, "
                             f"{SMOKE['rounds']} round, the file read every {SMOKE_POLL} s: "
                             "checks that the whole benchmark runs")
    args = parser.parse_args(argv)
    defaults = SMOKE if args.smoke else {"feeds": len(FEEDS), "entries": ENTRIES, "rounds": 2}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    pool = [feed for feed in FEEDS if feed[1] in SMOKE_FEEDS] if args.smoke else FEEDS
    args.feeds = min(max(1, args.feeds), len(pool))
    args.entries, args.rounds = max(1, args.entries), max(1, args.rounds)
    programs = {"new": os.path.abspath(args.vesti)}
    if args.compare:
        programs["old"] = os.path.abspath(args.compare)
    for program in programs.values():
        if not os.path.isfile(program):
            parser.error(f"{program}: no such file")
    vesti.import_optional("feedparser", "feedparser", "the benchmark")
    settings = vesti.load_settings(environ=dict(os.environ, OLLAMA_URL=""), env_file=None)
    poll, stop_poll = (SMOKE_POLL, SMOKE_STOP_POLL) if args.smoke else (POLL, STOP_POLL)
    if args.smoke:
        print(f"smoke mode: {SMOKE['feeds']} feeds of {SMOKE['entries']} entries, one round, "
              f"the file read every {poll} s; the figures show that the benchmark runs\n")

    started = time.perf_counter()
    feeds = load_feeds(args.corpus, args.feeds, args.entries, pool)
    pages = article_pages(args.corpus)
    entries = sum(len(feed["entries"]) for feed in feeds)
    teasers = [feed for feed in feeds if feed["kind"] == "teaser"]
    with tempfile.TemporaryDirectory(prefix="vesti-bench-morning-") as tmp, \
            feed_hosts(feeds, pages, stop_poll) as served:
        sources = os.path.join(tmp, "sources.yaml")
        write_sources(sources, feeds)
        languages = Counter(feed["lang"] for feed in feeds)
        priorities = Counter(feed["priority"] for feed in feeds)
        print(f"feeds: {len(feeds)} on {feeds[0]['host']}..{feeds[-1]['host']} port "
              f"{feeds[0]['url'].rsplit(':', 1)[1].split('/')[0]}, {entries} entries "
              f"({', '.join(f'{n} {lang}' for lang, n in languages.items())} feeds; priority "
              + ", ".join(f"{p}: {n}" for p, n in sorted(priorities.items())) + ")")
        print(f"    {len(feeds) - len(teasers)} with full texts "
              f"({sum(len(f['entries']) for f in feeds if f['kind'] == 'full')} entries, "
              f"{FULL_TEXT_MIN + 100}-{FULL_TEXT_MAX} characters), {len(teasers)} with teasers "
              f"({sum(len(f['entries']) for f in teasers)} entries under {TEASER_MAX} "
              f"characters; their articles: {len(pages)} corpus pages in turn)")
        print(f"    {len(DIRECTIONS)} directions ({', '.join(DIRECTIONS)}); built and read "
              f"back in {time.perf_counter() - started:.1f} s")
        delay = settings.host_delay
        floor = max((len(feed["entries"]) for feed in teasers), default=0) * delay
        print(f"    host pace floor: {floor:.0f} s after a teaser feed's crawl "
              f"(its {floor / delay if delay else 0:.0f} articles, RSS_HOST_DELAY={delay:g})")
        own = {k: v for k, v in os.environ.items()
               if k.startswith(("VESTI_", "RSS_", "OLLAMA_")) and k != "OLLAMA_URL"}
        if own:
            print("    from the environment: " + ", ".join(f"{k}={v}" for k, v in own.items()))
        print()
        if not check_feeds(feeds):
            return 0
        rounds = {"new": [], "old": []}
        for number in range(args.rounds):
            for side in list(programs)[::-1 if number % 2 else 1]:
                if args.rounds > 1 or len(programs) > 1:
                    print(f"-- round {number + 1} of {args.rounds}, {side}")
                rounds[side].append(one_run(side, programs[side], feeds, sources, tmp, served,
                                            args.timeout, settings.min_relevance, delay, poll))
                print()
        summary_table(rounds, programs, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
