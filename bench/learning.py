#!/usr/bin/env python3
"""Benchmark of learning from the editors' decisions: on news whose
publishers labelled every item with its section, how well the desk finds
what an editor wants after 300 decisions per direction, beside keywords
alone and beside a logistic regression that saw every label. Prints per
language a table and the goals with PASS/MISS. Exits 0 when everything ran
(a MISS is a figure, not a failure); exits 1 when something broke: an
exception, a vesti.py command exiting non-zero, no posts stored, a post
failed or left unclassified, the server not starting or answering a
request otherwise than the contract says, or the learned side missing
(GET /api/posts answering 404). Run from the repository root:
`python bench/learning.py` (a few minutes on two cores); `--smoke` runs the
whole path with tiny sizes in seconds, in English (the Russian set only
read; `--smoke --lang ru` runs it), the figures only showing that it runs.

The data (bench/news, gzipped, see its README.md for provenance and licence):
    en  News_Category_Dataset_v3.json: the newest 10,000 items (2018-05 to
        2022-09) of Rishabh Misra's News Category Dataset (CC BY 4.0):
        HuffPost headlines and short descriptions, each with HuffPost's own
        section as `category`. Directions: POLITICS, ENTERTAINMENT, WORLD NEWS.
    ru  ria_news_topics_3/7/9.csv: 1,450 distinct ria.ru articles (2023-10 to
        2023-12), each with the site's own rubric as `topic`: economy,
        culture, society.
An item is wanted in a direction when its publisher's label is that
direction's. An article listed twice is one item (with both rubrics when
they differ); an item whose text an earlier one has is left out (VESTI
would store it once).

The split, by date: within each direction's label (and among the items of
none), the older 70 % are training items, the newer 30 % held out: news
that arrives after the editor's decisions. Then about --train training
items (each group's newest) and --held held-out ones (each group's oldest).
By label, not in one cut over all items: the RIA set covers each rubric over
a span of its own (society only its last six days), and one cut would leave
society 19 training items.

A run, per language, in a temporary directory (no .env), as a user would:
the items are served as RSS 2.0 feeds (--feeds or more, so that no feed
holds more than RSS_MAX_ENTRIES=200; items dealt out in turn; a feed lists
its newest first, and the held-out items, once they arrive, before the rest;
each feed on a loopback address of its own, 127.0.0.2 ...; the label is not
in the feed). Title, link and date; the text as `description` (en: the short
description, a teaser, so VESTI asks for the article: its link answers 404
and the teaser stands, as for any article it cannot fetch) or, for ru, the
article's text as content:encoded with the subtitle as description. The
sources.yaml lists the feeds (no direction) and the three directions with
the keywords in DIRECTIONS below: what a newsroom would write in five
minutes, 10-25 words or stems each. Then, each a `vesti.py` command:
    crawl --all; worker (OLLAMA_URL empty: keywords alone; RSS_HOST_DELAY=0,
    since the teasers' article requests are not what is measured); serve
    (VESTI_WEB_PASSWORD set); [the editor]; the held-out items arrive (the
    feeds gain them); crawl --all; worker; the lists are read; serve stops.
The editor (the learned run only): for each direction in turn, --decisions
times (300): the first card of the direction's default desk
(GET /api/posts?direction=D&limit=1) is approved when the item's label is
D, else rejected: POST /posts/<id>/status with status, the form token
scraped from GET /, Accept: application/json and an Origin naming the
server. So the model learns as the decisions land. A desk that runs dry
is said and ends that direction's decisions. Then `vesti.py learn` says what
was learned. The keyword-only run is the same on a fresh database without
the editor.

The figures, per direction D, on the held-out items only (R = the held-out
items labelled D; an item a list lacks counts as missed):
    P@20     of the list GET /api/posts?direction=D&status=any&min=0&sort=likely
             (every page, `after` = the previous answer's `next`): the
             share of the first 20 held-out items listed that are labelled D
             (of the first R when R < 20, in --smoke)
    R-prec   of the same list: the share of the first R held-out items listed
             that are labelled D
    desk P   of the default desk GET /api/posts?direction=D (every page): the
             share of the held-out items shown that are labelled D
    desk R   the share of the R items that the default desk shows
A card standing for a story counts for each item of it. Without a model,
sort=likely orders as sort=relevance; a vesti.py without /api/posts has its
keyword-only lists read from its desk's HTML pages (GET /?… with
sort=relevance, following rel=next), and its learned side is not measured.
The reference: a logistic regression (one per direction, over the words and
word pairs of title and text, casefolded \\w+, the pairs of neighbouring
words; L2-penalised, AdaGrad SGD over REF_EPOCHS passes in a fixed order)
trained on every training item's label, ranking every held-out item: its
P@20 and R-precision.

With --curve (and in --smoke), per language, how many labels a learner
needs: the reference's learner and vesti.py's own model (its Model over
post_features, against the news in general read from the newest training
items; no keywords, no source), each trained on 300 and 1,000 training
items drawn at random (three draws) and on all of them, every label known:
their R-precision on the held-out items, beside 0.9 x the reference's.

The goals, per language (on the learned run):
    R-precision >= 0.9 x the reference's, in every direction
    the default desk's F1 >= 0.9 x the reference's R-precision (the
      break-even F1 of full supervision), or >= keyword-only's F1 where
      that is higher, and its precision no more than 0.05 under
      keyword-only's, in every direction (to 0.01)
    mean P@20 over the directions >= 0.9
"""

import argparse
import base64
import collections
import contextlib
import csv
import datetime
import email.utils
import gzip
import html
import http.client
import http.server
import importlib.util
import json
import math
import os
import queue
import random
import re
import signal
import socketserver
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

from harness import cached, fail, run  # noqa: E402

NEWS = os.path.join(REPO, "bench", "news")
USER = "admin"
PASSWORD = "bench-learning"
START_TIMEOUT = 60
STOP_TIMEOUT = 30
COMMAND_TIMEOUT = 1800
MAX_ENTRIES = 200           # RSS_MAX_ENTRIES' default: no feed holds more
TRAIN_SHARE = 0.7
TOP = 20
PAGE = 500                  # /api/posts' largest page
WINDOW = 50                 # the editor's figures per this many decisions
FULL = {"train": 4000, "held": 1500, "decisions": 300, "feeds": 24, "learn_min": None}
SMOKE = {"train": 90, "held": 40, "decisions": 10, "feeds": 3, "learn_min": 10}
# Seconds an idle feed host waits between looks for shutdown()
# (serve_forever's default); --smoke's hosts look more often, so they stop
# at once.
POLL = 0.5
SMOKE_POLL = 0.05
GOAL_RPREC = 0.9            # of the reference's
GOAL_PRECISION_DROP = 0.05  # the default desk's precision under keyword-only's, at most
GOAL_P20 = 0.9              # mean over the directions
REF_EPOCHS, REF_RATE, REF_L2, REF_SEED = 10, 0.2, 1e-5, 20240601

# Per language: direction id -> (title, the publisher's label, keywords).
# Written as a newsroom writes sources.yaml: common words and stems of the
# field, no look at the held-out items.
DIRECTIONS = {
    "en": {
        "politics": ("Politics", "POLITICS", [
            "trump", "biden", "congress*", "senate", "senator*", "republican*", "democrat*",
            "gop", "white house", "election*", "campaign*", "vote", "voters", "voting",
            "impeach*", "lawmaker*", "legislat*", "governor", "supreme court", "pelosi",
            "mcconnell", "administration", "capitol", "midterm*", "house speaker"]),
        "entertainment": ("Entertainment", "ENTERTAINMENT", [
            "movie*", "film*", "actor*", "actress*", "hollywood", "netflix", "oscar*", "emmy*",
            "grammy*", "singer*", "album*", "song*", "rapper*", "music*", "concert*",
            "celebrit*", "star wars", "tv show*", "series", "sitcom*", "box office",
            "broadway", "disney", "taylor swift", "kardashian*"]),
        "world": ("World news", "WORLD NEWS", [
            "ukrain*", "russia*", "putin", "china", "chinese", "beijing", "israel*",
            "palestin*", "gaza", "iran*", "afghan*", "taliban", "syria*", "north korea*",
            "kim jong un", "united nations", "prime minister", "brexit", "european union",
            "refugee*", "migrant*", "mexico", "india*", "hong kong", "saudi*"]),
    },
    "ru": {
        "economy": ("Экономика", "economy", [
            "экономик*", "рубл*", "доллар*", "банк*", "нефт*", "газ", "газа", "газов*",
            "инфляци*", "ввп", "бюджет*", "налог*", "инвест*", "экспорт*", "импорт*", "рынок",
            "рынк*", "бизнес*", "предприяти*", "производств*", "ставк*", "кредит*",
            "ипотек*", "торгов*", "минфин*"]),
        "culture": ("Культура", "culture", [
            "культур*", "театр*", "фильм*", "кино*", "сериал*", "музе*", "выставк*",
            "спектакл*", "балет*", "опера", "оперн*", "концерт*", "музык*", "певиц*", "певец",
            "певца", "актер*", "актёр*", "актрис*", "режиссер*", "режиссёр*", "писател*",
            "художник*", "искусств*", "фестивал*"]),
        "society": ("Общество", "society", [
            "школ*", "учител*", "студент*", "образован*", "пенси*", "дети", "детей", "детск*",
            "семьи", "семей", "многодетн*", "больниц*", "врач*", "пациент*", "погод*", "снег*",
            "мороз*", "жител*", "волонтер*", "волонтёр*", "мигрант*", "соцсет*", "социальн*",
            "праздник*", "жкх"]),
    },
}


# The data ---------------------------------------------------------------------

@dataclass
class Item:
    key: str                # en17, ru4: its link on the bench's hosts ends /item/<key>
    title: str
    text: str               # what the feed carries as the text
    summary: str            # the feed's description
    published: float        # UTC seconds
    labels: frozenset       # the publisher's sections
    link: str = ""          # its link in the feed that carries it


def one_text(text):
    return " ".join((text or "").split())


def read_en(folder):
    """HuffPost's items, each at its day's end minus a minute per newer item
    of that day (the file lists the newest first; only the day is given)."""
    items, per_day = [], collections.Counter()
    with gzip.open(os.path.join(folder, "en", "News_Category_Dataset_v3.json.gz"), "rt", encoding="utf-8") as f:
        for n, line in enumerate(f):
            row = json.loads(line)
            day = datetime.datetime.strptime(row["date"], "%Y-%m-%d").replace(
                tzinfo=datetime.timezone.utc).timestamp()
            published = day + 86400 - 60 * (1 + per_day[row["date"]])
            per_day[row["date"]] += 1
            text = one_text(row["short_description"])
            items.append(Item(f"en{n}", one_text(row["headline"]), text, text, published,
                              frozenset([row["category"]])))
    return items


RIA_FILES = ("ria_news_topics_3.csv", "ria_news_topics_7.csv", "ria_news_topics_9.csv")
MOSCOW = datetime.timezone(datetime.timedelta(hours=3))


def read_ru(folder):
    """RIA's articles, one item per URL with every rubric it was filed under."""
    by_url = {}
    for name in RIA_FILES:
        with gzip.open(os.path.join(folder, "ru", name + ".gz"), "rt", encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                known = by_url.get(row["url"])
                if known is not None:
                    known.labels = known.labels | {row["topic"]}
                    continue
                published = datetime.datetime.strptime(row["datetime"], "%H:%M %d.%m.%Y").replace(
                    tzinfo=MOSCOW).timestamp()
                by_url[row["url"]] = Item(f"ru{len(by_url)}", one_text(row["title"]),
                                          row["content"].strip(),
                                          one_text(row["subtitle"]) or one_text(row["title"]),
                                          published, frozenset([row["topic"]]))
    return list(by_url.values())


READERS = {"en": read_en, "ru": read_ru}


def distinct(items):
    """Items whose text no earlier item has (VESTI stores one of them)."""
    seen, kept = set(), []
    for item in items:
        text = one_text(item.text).casefold()
        if text and text not in seen:
            seen.add(text)
            kept.append(item)
    return kept


def split_by_date(lang, items, train, held):
    """(training, held-out), each in date order. Within each direction's
    label, and among the items of none, the older TRAIN_SHARE are training
    items and the rest held out (an item of two labels is held out when
    either holds it out): the RIA set covers each rubric over a span of its
    own (society only its last six days), so one cut over all items would
    leave a rubric nearly out of training. Then about `train` training
    items and `held` held-out ones, the same share of each group: its
    newest training items, its oldest held-out ones."""
    items = sorted(items, key=lambda item: (item.published, item.key))
    labels = [label for _, label, _ in DIRECTIONS[lang].values()]
    groups = collections.defaultdict(list)
    for item in items:
        for label in [label for label in labels if label in item.labels] or [None]:
            groups[label].append(item)
    later = {item.key for group in groups.values()
             for item in group[round(len(group) * TRAIN_SHARE):]}

    def group_of(item):
        return next((label for label in labels if label in item.labels), None)
    return (capped([item for item in items if item.key not in later], train, group_of, True),
            capped([item for item in items if item.key in later], held, group_of, False))


def capped(items, limit, group_of, newest):
    """About `limit` of the items (in date order), the same share of each
    group: its newest, or its oldest."""
    share = min(1.0, limit / len(items)) if items else 0.0
    groups = collections.defaultdict(list)
    for item in items:
        groups[group_of(item)].append(item)
    kept = set()
    for group in groups.values():
        count = round(len(group) * share)
        kept.update(item.key for item in (group[len(group) - count:] if newest else group[:count]))
    return [item for item in items if item.key in kept]


# The feeds --------------------------------------------------------------------

def host_address(n):
    """127.0.0.2, 127.0.0.3, ... for n = 1, 2, ..."""
    return f"127.{(n + 1) >> 16 & 255}.{(n + 1) >> 8 & 255}.{(n + 1) & 255}"


class Handler(http.server.BaseHTTPRequestHandler):
    """/feed.xml: the host's feed as it is now; anything else 404 (the
    articles' pages are not in the data)."""

    def do_GET(self):
        site = self.server.site
        if self.path != "/feed.xml":
            site.count("article")
            self.send_error(404)
            return
        body = site.body()
        site.count("feed")
        self.send_response(200)
        self.send_header("Content-Type", "application/rss+xml; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self):
        # HTTPServer.server_bind looks the address up in DNS (getfqdn): slow
        # for a loopback address on a machine without a resolver.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


class Feed:
    """One feed: its training items newest first; once the held-out items
    have arrived, those before them (whatever their dates: they came
    later), and no more than MAX_ENTRIES (a feed drops its oldest)."""

    def __init__(self, number, name, lang, served):
        self.number, self.name, self.lang, self.served = number, name, lang, served
        self.training, self.held = [], []
        self.arrived, self.url, self.base = False, "", ""
        self._lock = threading.Lock()

    def count(self, what):
        with self._lock:
            self.served[what] += 1

    def body(self):
        def newest_first(items):
            return sorted(items, key=lambda item: (-item.published, item.key))
        items = (newest_first(self.held) if self.arrived else []) + newest_first(self.training)
        return rss_document(self, items[:MAX_ENTRIES])


def rss_item(item):
    parts = [f"<title>{escape(item.title)}</title>", f"<link>{escape(item.link)}</link>",
             f'<guid isPermaLink="true">{escape(item.link)}</guid>',
             f"<pubDate>{email.utils.formatdate(item.published, usegmt=True)}</pubDate>",
             f"<description>{escape(item.summary)}</description>"]
    if item.text != item.summary:
        paragraphs = "".join(f"<p>{html.escape(p.strip())}</p>"
                             for p in re.split(r"\n|\s{2,}", item.text) if p.strip())
        parts.append(f"<content:encoded>{escape(paragraphs)}</content:encoded>")
    return "<item>" + "".join(parts) + "</item>"


def rss_document(feed, items):
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        '<rss version="2.0" xmlns:content="http://purl.org/rss/1.0/modules/content/">'
        f"<channel><title>{escape(feed.name)}</title><link>{feed.base}/</link>"
        f"<description>{escape(feed.name)} (VESTI learning benchmark)</description>"
        f"<language>{feed.lang}</language>\n" + "\n".join(map(rss_item, items))
        + "\n</channel></rss>\n").encode("utf-8")


def deal_out(training, held, count, lang, served):
    """`count` feeds; the items dealt out in date order, in turn."""
    feeds = [Feed(n, f"{lang} news {n:02d}", lang, served) for n in range(1, count + 1)]
    later = {item.key for item in held}
    for k, item in enumerate(sorted(training + held, key=lambda item: (item.published, item.key))):
        feed = feeds[k % count]
        (feed.held if item.key in later else feed.training).append(item)
    return feeds


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
def feed_hosts(feeds, poll=POLL):
    """Serves each feed from its own address; fills in the feeds' and their
    items' links."""
    servers, port = bind_all(len(feeds))
    try:
        for feed, server in zip(feeds, servers):
            feed.base = f"http://{host_address(feed.number)}:{port}"
            feed.url = f"{feed.base}/feed.xml"
            for item in feed.training + feed.held:
                item.link = f"{feed.base}/item/{item.key}"
            server.site = feed
            threading.Thread(target=server.serve_forever, args=(poll,), daemon=True).start()
        yield port
    finally:
        def stop(server):
            server.shutdown()
            server.server_close()
        with ThreadPoolExecutor(max_workers=min(16, len(servers))) as pool:
            list(pool.map(stop, servers))


def write_sources(path, lang, feeds):
    lines = ["directions:"]
    for direction, (title, _, keywords) in DIRECTIONS[lang].items():
        lines += [f"  {direction}:", f"    title: {title}",
                  "    keywords: [" + ", ".join(f'"{k}"' for k in keywords) + "]"]
    lines.append("sources:")
    for feed in feeds:
        lines += [f"  - slug: {lang}-news-{feed.number:02d}", f'    name: "{feed.name}"',
                  "    crawler: rss", f"    url: {feed.url}", "    priority: 0"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


# The reference ----------------------------------------------------------------

WORD = re.compile(r"\w+")


def features(item):
    """The words of title and text and the pairs of neighbouring words."""
    words = WORD.findall(f"{item.title}\n{item.text}".casefold())
    return set(words) | {f"{a} {b}" for a, b in zip(words, words[1:])}


def sigmoid(z):
    return 1 / (1 + math.exp(-max(-35.0, min(35.0, z))))


def train_logistic(docs, labels):
    """Weights and bias of an L2-penalised logistic regression: AdaGrad SGD,
    REF_EPOCHS passes in an order fixed by REF_SEED. A document's features
    weigh 1/sqrt(their number), so long and short texts count alike."""
    weights, squares, bias, bias_squares = {}, {}, 0.0, 1e-8
    order, rng = list(range(len(docs))), random.Random(REF_SEED)
    for _ in range(REF_EPOCHS):
        rng.shuffle(order)
        for i in order:
            doc = docs[i]
            norm = 1 / math.sqrt(len(doc)) if doc else 0.0
            error = sigmoid(norm * sum(weights.get(f, 0.0) for f in doc) + bias) - labels[i]
            for f in doc:
                w = weights.get(f, 0.0)
                gradient = error * norm + REF_L2 * w
                squares[f] = squares.get(f, 1e-8) + gradient * gradient
                weights[f] = w - REF_RATE * gradient / math.sqrt(squares[f])
            bias_squares += error * error
            bias -= REF_RATE * error / math.sqrt(bias_squares)
    return weights, bias


def logistic_score(model, doc):
    weights, bias = model
    norm = 1 / math.sqrt(len(doc)) if doc else 0.0
    return norm * sum(weights.get(f, 0.0) for f in doc) + bias


def logistic_ranking(training, labels, held):
    """Held-out keys, most likely first, by a logistic regression trained on
    these items and labels. Only features seen in more than one of these
    training items count, in training and in ranking."""
    docs = [features(item) for item in training]
    frequency = collections.Counter(f for doc in docs for f in doc)
    known = {f for f, n in frequency.items() if n > 1}
    model = train_logistic([doc & known for doc in docs], labels)
    scores = [logistic_score(model, features(item) & known) for item in held]
    return [held[i].key for i in sorted(range(len(held)), key=lambda i: (-scores[i], held[i].key))]


def reference_rankings(lang, training, held):
    """{direction: held-out keys, most likely first}, trained on every
    training item's label."""
    return {direction: logistic_ranking(training, [1 if label in item.labels else 0
                                                   for item in training], held)
            for direction, (_, label, _) in DIRECTIONS[lang].items()}


# How many labels the learners need (--curve) -----------------------------------
# Each learner trained on N training items drawn at random, their labels
# all known: the reference's logistic regression, and vesti.py's own model
# (its Model over post_features, against the news in general read from the
# newest training items as VESTI reads it from the newest posts), both
# without keywords or source. Where 300 random labels leave a learner far
# from what every label gives, 300 decisions will too.

CURVE_SIZES = (300, 1000)       # and every training item
CURVE_DRAWS = 3


def load_vesti(path):
    spec = importlib.util.spec_from_file_location("vesti_measured", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_ranking(vesti, direction, wanted, news, training_features, held_features, held):
    """Held-out keys, most likely first, by vesti.py's Model of `direction`
    taught `wanted` (True/False) of the training items whose features are given."""
    model = vesti.Model(direction)
    model.background = news
    for features_of, approved in zip(training_features, wanted):
        model.learn(features_of, approved)
    scores = [model.score(f) for f in held_features]
    return [held[i].key for i in sorted(range(len(held)), key=lambda i: (-scores[i], held[i].key))]


def learning_curve(lang, vesti_path, training, held, reference):
    """Print R-precision on the held-out items per direction, learner and N."""
    started = time.monotonic()
    vesti = load_vesti(vesti_path)
    newest = sorted(training, key=lambda item: item.published)[-vesti.BACKGROUND_POSTS:]
    news = vesti.Background(mark=0)
    for item in newest:
        news.counts.update(vesti.post_features(item.title, item.text, None))
        news.docs += 1
    held_features = [vesti.post_features(item.title, item.text, None) for item in held]
    relevant = relevant_items(lang, held)
    sizes = sorted({min(n, len(training)) for n in CURVE_SIZES} | {len(training)})
    print(f"== {lang}: how many labels the learners need: R-precision on the held-out items, "
          f"trained on N training items drawn at random (least / median / most of "
          f"{CURVE_DRAWS} draws), no keywords, no source")
    print(f"{'direction':14s} {'learner':14s} " + " ".join(f"{f'N={n}':>20s}" for n in sizes)
          + "   0.9 x the reference")
    for direction, (_, label, _) in DIRECTIONS[lang].items():
        if not relevant[direction]:
            continue
        figures = {"reference": [], "vesti's model": []}
        for n in sizes:
            draws = [list(range(len(training)))] if n == len(training) else \
                [random.Random(seed).sample(range(len(training)), n) for seed in range(1, CURVE_DRAWS + 1)]
            found = {name: [] for name in figures}
            for chosen in draws:
                sample = [training[i] for i in chosen]
                labels = [label in item.labels for item in sample]
                found["reference"].append(ranking_figures(
                    logistic_ranking(sample, [int(x) for x in labels], held), relevant[direction])[1])
                found["vesti's model"].append(ranking_figures(model_ranking(
                    vesti, direction, labels, news,
                    [vesti.post_features(item.title, item.text, None) for item in sample],
                    held_features, held), relevant[direction])[1])
            for name in figures:
                values = sorted(found[name])
                figures[name].append(f"{cell(values[0])} {cell(statistics.median(values))} "
                                     f"{cell(values[-1])}" if len(values) > 1 else
                                     f"{cell(values[0]):>20s}")
        goal = GOAL_RPREC * reference[direction].rprec
        for name, cells in figures.items():
            print(f"{direction:14s} {name:14s} " + " ".join(f"{c:>20s}" for c in cells)
                  + (f"   {goal:.2f}" if name == "reference" else ""))
    print(f"    learning curve: {time.monotonic() - started:.1f} s\n")


# vesti.py ---------------------------------------------------------------------

def child_env(**settings):
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update({k: str(v) for k, v in settings.items() if v is not None})
    return env


def vesti_command(program, args, env, cwd, label, lines=1):
    """One vesti.py command; its time and the last `lines` lines it wrote
    on stdout. False (and a failure, with what it wrote last) when it exits
    non-zero."""
    started = time.monotonic()
    proc = subprocess.run([*cached(program), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    seconds = time.monotonic() - started
    shown = proc.stdout.strip().splitlines()[-lines:] or [""]
    print(f"    {' '.join(args):<12} {seconds:6.1f} s  {shown[0]}")
    for line in shown[1:]:
        print(f"        {line}")
    sys.stdout.flush()
    if proc.returncode != 0:
        for line in (proc.stdout + proc.stderr).strip().splitlines()[-6:]:
            print(f"        vesti> {line}")
        fail(f"{label}: `vesti.py {' '.join(args)}` exited {proc.returncode}")
        return False
    return True


def queue_of(db):
    """(posts, {classified: count}) read from the file."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        total = conn.execute("SELECT count(*) FROM posts").fetchone()[0]
        states = dict(conn.execute(
            "SELECT coalesce(classified, 0), count(*) FROM posts GROUP BY 1"))
    return total, states


def check_stored(db, expected, label):
    """The posts the feeds gave are stored and classified; False if none are."""
    total, states = queue_of(db)
    if total == 0:
        fail(f"{label}: no posts stored")
        return False
    if total != expected:
        print(f"    note: {total} posts stored of {expected} items served")
    waiting = states.get(0, 0) + states.get(-1, 0)
    if waiting or states.get(-2):
        fail(f"{label}: after the worker, {waiting} posts pending or processing and "
             f"{states.get(-2, 0)} failed")
    return True


class Serve:
    """`vesti.py serve` in a subprocess; its log goes to a file."""

    def __init__(self, program, env, cwd):
        self.log_path = os.path.join(cwd, "serve.log")
        self.log = open(self.log_path, "w", encoding="utf-8")
        self.lines = queue.Queue()
        self.proc = subprocess.Popen(
            [*cached(program), "serve", "--host", "127.0.0.1", "--port", "0"], cwd=cwd,
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def port(self, timeout=START_TIMEOUT):
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
        self.log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read().strip().splitlines()[-lines:]

    def stop(self):
        """SIGTERM and wait; the exit code, or None when it had to be killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.log.close()
                return None
        self.log.close()
        return self.proc.returncode


class NotThere(Exception):
    """What the learned side needs answers 404: the one line says what."""


class Desk:
    """The desk over HTTP, as a script sees it: Basic auth, one connection
    kept open while the server keeps it."""

    def __init__(self, port):
        self.port, self.conn = port, None
        self.auth = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        self.token = None

    def request(self, method, path, body=None, headers=None):
        """(status, body bytes); a connection the server closed is opened again."""
        headers = {"Authorization": self.auth, **(headers or {})}
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            try:
                self.conn.request(method, path, body, headers)
                response = self.conn.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, ConnectionError):
                self.close()
                if attempt == 2:
                    raise
                continue
            if response.will_close:
                self.close()
            return response.status, data

    def get_json(self, path):
        status, data = self.request("GET", path)
        if status != 200:
            return status, None
        return status, json.loads(data)

    def form_token(self):
        """The decision forms' token, from GET / as a browser gets it."""
        status, body = self.request("GET", "/")
        found = re.search(rb'name="token" value="([0-9a-f]{16,})"', body)
        if status != 200 or not found:
            raise RuntimeError(f"GET / answered {status} without a form token")
        self.token = found[1].decode()
        return self.token

    def decide(self, post_id, status):
        """POST /posts/<id>/status as the page's script does; the answer's JSON."""
        body = urllib.parse.urlencode({"token": self.token or self.form_token(), "status": status})
        code, data = self.request("POST", f"/posts/{post_id}/status", body, {
            "Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json",
            "Origin": f"http://127.0.0.1:{self.port}"})
        if code != 200:
            raise RuntimeError(f"POST /posts/{post_id}/status ({status}) answered {code}: "
                               f"{data[:200].decode('utf-8', 'replace')}")
        return json.loads(data)

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


ITEM_LINK = re.compile(r"/item/([a-z]{2}[0-9]+)$")
POST_FIELDS = ("id", "url", "likely")    # and "story", when a card stands for one


def key_of(url):
    found = ITEM_LINK.search(urllib.parse.urlsplit(url or "").path)
    return found[1] if found else None


def card_keys(post):
    """The items a card of /api/posts stands for: its own and its story's."""
    keys = [key_of(post["url"])] + [key_of(copy.get("url")) for copy in post.get("story") or []]
    return [key for key in dict.fromkeys(keys) if key]


def api_list(desk, params):
    """Every card of /api/posts under `params`, page after page: [(post, keys)].
    Raises NotThere when the server has no /api/posts."""
    query, cards, seen = dict(params, limit=PAGE), [], set()
    while True:
        path = "/api/posts?" + urllib.parse.urlencode(query)
        status, data = desk.get_json(path)
        if status == 404:
            raise NotThere(f"GET {path} answered 404 (no JSON desk yet: SPEC \"Desk API\")")
        if status != 200:
            raise RuntimeError(f"GET {path} answered {status}")
        missing = [name for name in POST_FIELDS for post in data["posts"][:1] if name not in post]
        if missing:
            raise RuntimeError(f"GET {path}: its posts have no {', '.join(missing)}")
        cards += [(post, card_keys(post)) for post in data["posts"]]
        cursor = data.get("next")
        if not cursor or not data["posts"]:
            return cards
        if cursor in seen:
            raise RuntimeError(f"GET {path}: `next` repeats {cursor!r}")
        seen.add(cursor)
        query["after"] = cursor


CARD_START = '<article class="post"'
NEXT_PAGE = re.compile(r'<a href="([^"]+)" rel="next">')
CARD_LINK = re.compile(r'href="([^"]+)"')


def html_list(desk, params):
    """Every card of the desk's HTML pages under `params`, following their
    rel=next links: [(None, keys)]."""
    path, cards = "/?" + urllib.parse.urlencode(params), []
    while path:
        status, body = desk.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path} answered {status}")
        page = body.decode("utf-8")
        for card in page.split(CARD_START)[1:]:
            card = card.split("</article>", 1)[0]
            keys = [key_of(html.unescape(link)) for link in CARD_LINK.findall(card)]
            cards.append((None, [key for key in dict.fromkeys(keys) if key]))
        following = NEXT_PAGE.search(page)
        path = html.unescape(following[1]) if following else None
    return cards


# The editor -------------------------------------------------------------------

@dataclass
class Decisions:
    """One direction's decisions, in order: True where the first card was
    wanted; `stopped` once its desk ran dry or misbehaved."""
    wanted: list = field(default_factory=list)
    stopped: bool = False


def first_card(desk, direction):
    """The first card of the direction's default desk, or None when it is empty."""
    path = "/api/posts?" + urllib.parse.urlencode({"direction": direction, "limit": 1})
    status, data = desk.get_json(path)
    if status == 404:
        raise NotThere(f"GET {path} answered 404 (no JSON desk yet: SPEC \"Desk API\")")
    if status != 200:
        raise RuntimeError(f"GET {path} answered {status}")
    return data["posts"][0] if data["posts"] else None


def timed(timings, function, *args):
    """function(*args), its milliseconds appended to `timings`."""
    started = time.perf_counter()
    try:
        return function(*args)
    finally:
        timings.append((time.perf_counter() - started) * 1000)


def simulated_editor(desk, lang, items, decisions):
    """Decisions on the first card of each direction's desk in turn, until
    each has `decisions` or is stopped: {direction: Decisions} and the
    milliseconds each request took."""
    directions = DIRECTIONS[lang]
    done = {direction: Decisions() for direction in directions}
    timings = {"GET /api/posts?limit=1": [], "POST /posts/<id>/status": []}
    decided = set()
    desk.form_token()
    for _ in range(decisions):
        for direction, (_, label, _) in directions.items():
            if not done[direction].stopped:
                decide_first_card(desk, f"{lang} {direction}", label, items, done[direction],
                                  decided, timings)
    return done, timings


def decide_first_card(desk, who, label, items, decisions, decided, timings):
    """One decision on the first card of a direction's default desk, as the
    publisher's label says. A desk that ran dry, or showed a card it should
    not, stops that direction's decisions."""
    direction = who.split()[-1]
    post = timed(timings["GET /api/posts?limit=1"], first_card, desk, direction)
    problem = None
    if post is None:
        print(f"    {direction}: the desk ran dry after {len(decisions.wanted)} decisions")
    elif post["id"] in decided:
        problem = f"the desk shows post {post['id']} again after it was decided"
    elif key_of(post["url"]) not in items:
        problem = f"the desk's first card {post['url']} is no training item"
    if post is None or problem:
        decisions.stopped = True
        if problem:
            fail(f"{who}: {problem}")
        return
    wanted = label in items[key_of(post["url"])].labels
    status = "approved" if wanted else "rejected"
    answer = timed(timings["POST /posts/<id>/status"], desk.decide, post["id"], status)
    if answer.get("id") != post["id"] or answer.get("status") != status:
        decisions.stopped = True
        fail(f"{who}: POST /posts/{post['id']}/status ({status}) answered {answer}")
        return
    decided.add(post["id"])
    decisions.wanted.append(wanted)


def show_decisions(done, timings):
    for direction, decisions in done.items():
        wanted = decisions.wanted
        windows = [wanted[k:k + WINDOW] for k in range(0, len(wanted), WINDOW)]
        shares = " ".join(f"{sum(w) / len(w):.2f}" for w in windows)
        print(f"    {direction:<14} {len(wanted):4d} decisions, {sum(wanted):4d} approved; "
              f"wanted share of the first card per {WINDOW}: {shares or '-'}")
    for name, values in timings.items():
        if values:
            values = sorted(values)
            print(f"    {name:<26} median {statistics.median(values):6.1f} ms, "
                  f"p95 {values[int(0.95 * (len(values) - 1))]:6.1f} ms, max {values[-1]:6.1f} ms")


# Measuring --------------------------------------------------------------------

@dataclass
class Figures:
    p20: float = None
    rprec: float = None
    desk_p: float = None
    desk_r: float = None
    ranking: list = None        # the reference's: held-out keys, most likely first
    relevant: set = None


def held_order(cards, held):
    """The held-out items a list names, in its order, each once."""
    return list(dict.fromkeys(key for _, keys in cards for key in keys if key in held))


def ranking_figures(ranked, relevant):
    """(P@20, R-precision) of held-out keys in order; an item the ranking
    lacks is missed."""
    if not relevant:
        return None, None
    top = min(TOP, len(relevant))
    return (sum(key in relevant for key in ranked[:top]) / top,
            sum(key in relevant for key in ranked[:len(relevant)]) / len(relevant))


def desk_figures(shown, relevant):
    """(precision, recall) of the held-out items a desk shows."""
    hits = sum(key in relevant for key in shown)
    return (hits / len(shown) if shown else None,
            hits / len(relevant) if relevant else None)


def relevant_items(lang, held):
    return {direction: {item.key for item in held if label in item.labels}
            for direction, (_, label, _) in DIRECTIONS[lang].items()}


def measure(desk, lang, held, via_html):
    """{direction: Figures} of a run, from its lists; with `via_html`, from
    the desk's HTML pages (sort=relevance for sort=likely)."""
    held_keys = {item.key for item in held}
    relevant = relevant_items(lang, held)
    figures, likely, stories = {}, [0, 0], 0
    for direction in DIRECTIONS[lang]:
        ranked_params = {"direction": direction, "status": "any", "min": 0,
                         "sort": "relevance" if via_html else "likely"}
        listing = html_list if via_html else api_list
        cards = listing(desk, ranked_params)
        shown = listing(desk, {"direction": direction})
        for post, keys in cards:
            if post is not None and any(key in held_keys for key in keys):
                likely[0] += 1
                likely[1] += post.get("likely") is not None
            stories += len(keys) > 1
        ranked = held_order(cards, held_keys)
        figures[direction] = Figures(*ranking_figures(ranked, relevant[direction]),
                                     *desk_figures(held_order(shown, held_keys),
                                                   relevant[direction]))
    if not via_html:
        print(f"    held-out cards in the directions' lists: {likely[0]}, with `likely` "
              f"{likely[1]}; cards standing for a story: {stories}")
    return figures


# One run ----------------------------------------------------------------------

@dataclass
class Setup:
    program: str
    lang: str
    training: list
    held: list
    feeds: list
    sources: str
    tmp: str
    decisions: int
    learn_min: int = None


def one_run(setup, learned):
    """A fresh database through crawl, worker, serve, [the editor], the
    held-out items' crawl and worker: its {direction: Figures}, or None when
    it broke (said already)."""
    label = f"{setup.lang} {'learned' if learned else 'keyword-only'}"
    folder = tempfile.mkdtemp(prefix="run-", dir=setup.tmp)
    env = child_env(VESTI_DB=os.path.join(folder, "vesti.db"), VESTI_SOURCES=setup.sources,
                    OLLAMA_URL="", RSS_HOST_DELAY=0, VESTI_WEB_PASSWORD=PASSWORD,
                    VESTI_WEB_USER=USER, VESTI_LEARN_MIN=setup.learn_min)
    print(f"-- {label}")
    started = time.monotonic()
    for feed in setup.feeds:
        feed.arrived = False
    if not crawl_and_classify(setup, env, folder, label, len(setup.training)):
        return None
    serve = Serve(setup.program, env, folder)
    try:
        port = serve.port()
        if port is None:
            fail(f"{label}: `vesti.py serve` did not start: {' | '.join(serve.tail(3))}")
            return None
        figures = served_run(setup, env, folder, label, Desk(port), learned)
    finally:
        code = serve.stop()
        if code != 0:
            fail(f"{label}: `vesti.py serve` " + (f"exited {code} on SIGTERM" if code is not None
                                                  else f"was killed after {STOP_TIMEOUT} s"))
    print(f"    {label}: {time.monotonic() - started:.1f} s in all")
    return figures


def crawl_and_classify(setup, env, folder, label, expected):
    return (vesti_command(setup.program, ["crawl", "--all"], env, folder, label)
            and vesti_command(setup.program, ["worker"], env, folder, label)
            and check_stored(env["VESTI_DB"], expected, label))


def served_run(setup, env, folder, label, desk, learned):
    try:
        if learned and not editor_turn(setup, env, folder, label, desk):
            return None
        for feed in setup.feeds:
            feed.arrived = True
        if not crawl_and_classify(setup, env, folder, label,
                                  len(setup.training) + len(setup.held)):
            return None
        return read_lists(setup, desk, learned)
    except NotThere as e:
        fail(f"{label}: {e}")
        return None
    finally:
        desk.close()


def editor_turn(setup, env, folder, label, desk):
    started = time.monotonic()
    items = {item.key: item for item in setup.training}
    done, timings = simulated_editor(desk, setup.lang, items, setup.decisions)
    print(f"    the editor: {sum(len(d.wanted) for d in done.values())} decisions "
          f"in {time.monotonic() - started:.1f} s")
    show_decisions(done, timings)
    return vesti_command(setup.program, ["learn"], env, folder, label, lines=20)


def read_lists(setup, desk, learned):
    """The run's figures; a keyword-only run on a vesti.py without
    /api/posts reads the HTML desk instead (said once)."""
    try:
        return measure(desk, setup.lang, setup.held, via_html=False)
    except NotThere as e:
        if learned:
            raise
        print(f"    {e}: the keyword-only lists are read from the desk's HTML pages "
              f"(sort=relevance, the order sort=likely has without a model)")
        return measure(desk, setup.lang, setup.held, via_html=True)


# The report -------------------------------------------------------------------

COLUMNS = ("P@20", "R-prec", "desk P", "desk R")


def cell(value):
    return f"{value:6.2f}" if value is not None else f"{'-':>6}"


def verdict(ok):
    return "PASS" if ok else "MISS"


def table(lang, runs, reference):
    """One line per direction: keyword-only, learned and the reference."""
    sides = (("keyword-only", runs["keyword"], 4), ("learned", runs["learned"], 4),
             ("reference", reference, 2))
    print(f"== {lang}: on the held-out items")
    print((f"{'':<14}" + "".join(f" | {name:<{7 * n - 1}}" for name, _, n in sides)).rstrip())
    print(f"{'direction':<14}" + "".join(" | " + " ".join(f"{c:>6}" for c in COLUMNS[:n])
                                         for _, _, n in sides))
    for direction in DIRECTIONS[lang]:
        row = f"{direction:<14}"
        for _, figures, n in sides:
            f = (figures or {}).get(direction) or Figures()
            row += " | " + " ".join(cell(v) for v in (f.p20, f.rprec, f.desk_p, f.desk_r)[:n])
        print(row)


def rprec_goal(lang, learned, reference):
    ratios = {}
    for direction in DIRECTIONS[lang]:
        new, best = learned[direction].rprec, reference[direction].rprec
        ratios[direction] = new / best if new is not None and best else None
    ok = all(ratio is not None and ratio >= GOAL_RPREC for ratio in ratios.values())
    return (f"{lang} R-precision / the reference's: "
            + ", ".join(f"{d} {cell(r).strip()}" for d, r in ratios.items())
            + f"  goal >= {GOAL_RPREC} in every direction  {verdict(ok)}")


def f1(precision, recall):
    return 2 * precision * recall / (precision + recall) if precision and recall else 0.0


def desk_goal(lang, learned, keyword, reference):
    """The goal's line, then each direction's default desk, keyword-only ->
    learned: precision, recall and F1, the F1 wanted (0.9 x the reference's
    R-precision, the break-even F1 of full supervision, or keyword-only's
    F1 where that is higher) and the precision it may not fall under
    (keyword-only's - GOAL_PRECISION_DROP)."""
    lines, ok = [], True
    for direction in DIRECTIONS[lang]:
        new, old = learned[direction], keyword[direction]
        if new.desk_r is None or old.desk_r is None:
            lines.append(f"    {direction:<14} -")
            ok = False
            continue
        wanted = max(GOAL_RPREC * (reference[direction].rprec or 0.0), f1(old.desk_p, old.desk_r))
        floor = (old.desk_p or 0.0) - GOAL_PRECISION_DROP
        new_f1 = f1(new.desk_p, new.desk_r)
        met = round(new_f1, 2) >= round(wanted, 2) and round(new.desk_p or 0.0, 2) >= round(floor, 2)
        ok = ok and met
        lines.append(f"    {direction:<14} precision {cell(old.desk_p).strip()} -> "
                     f"{cell(new.desk_p).strip()} (floor {floor:.2f}), recall {old.desk_r:.2f} -> "
                     f"{new.desk_r:.2f}, F1 {f1(old.desk_p, old.desk_r):.2f} -> {new_f1:.2f} "
                     f"(wanted {wanted:.2f})  {verdict(met)}")
    return [f"{lang} default desk: F1 >= max(0.9 x the reference's R-precision, keyword-only's), "
            f"precision >= keyword-only's - {GOAL_PRECISION_DROP}, in every direction  "
            f"{verdict(ok)}", *lines]


def p20_goal(lang, learned):
    values = [learned[direction].p20 for direction in DIRECTIONS[lang]]
    mean = statistics.mean(values) if None not in values else None
    return (f"{lang} mean P@20 = {cell(mean).strip()}  goal >= {GOAL_P20}  "
            f"{verdict(mean is not None and mean >= GOAL_P20)}")


def goals(lang, runs, reference):
    """The goal lines, each with PASS or MISS."""
    learned, keyword = runs["learned"], runs["keyword"]
    if learned is None:
        print(f"{lang} goals: not measured (the learned run did not finish)")
        return
    print(rprec_goal(lang, learned, reference))
    if keyword is None:
        print(f"{lang} default desk: not measured (the keyword-only run did not finish)")
    else:
        print("\n".join(desk_goal(lang, learned, keyword, reference)))
    print(p20_goal(lang, learned))


def reference_figures(lang, training, held):
    started = time.monotonic()
    rankings = reference_rankings(lang, training, held)
    relevant = relevant_items(lang, held)
    figures = {d: Figures(*ranking_figures(rankings[d], relevant[d]), ranking=rankings[d],
                          relevant=relevant[d]) for d in rankings}
    print(f"    reference: {len(DIRECTIONS[lang])} logistic regressions on {len(training)} "
          f"training items in {time.monotonic() - started:.1f} s")
    return figures


def describe(lang, training, held, feeds, read, dropped):
    def counts(items):
        return ", ".join(f"{d} {sum(label in item.labels for item in items)}"
                         for d, (_, label, _) in DIRECTIONS[lang].items())

    def span(items):
        return " .. ".join(time.strftime("%Y-%m-%d", time.gmtime(t))
                           for t in (items[0].published, items[-1].published))
    print(f"== {lang}: {len(training)} training items ({span(training)}: {counts(training)}), "
          f"{len(held)} held-out ({span(held)}: {counts(held)})")
    print(f"    {len(feeds)} feeds on {host_address(1)}..{host_address(len(feeds))}, "
          f"{max(len(f.training) for f in feeds)} training items each at most; of {read} "
          f"items read, {dropped} left out (their text another item has)")


def one_language(lang, args, tmp):
    """Both runs and the reference of one language."""
    items = READERS[lang](args.corpus)
    kept = distinct(items)
    training, held = split_by_date(lang, kept, args.train, args.held)
    count = max(args.feeds, math.ceil(len(training) / MAX_ENTRIES),
                math.ceil(len(held) / MAX_ENTRIES))
    served = collections.Counter()
    feeds = deal_out(training, held, count, lang, served)
    describe(lang, training, held, feeds, len(items), len(items) - len(kept))
    reference = reference_figures(lang, training, held)
    with feed_hosts(feeds, SMOKE_POLL if args.smoke else POLL):
        sources = os.path.join(tmp, f"sources-{lang}.yaml")
        write_sources(sources, lang, feeds)
        setup = Setup(args.vesti, lang, training, held, feeds, sources, tmp, args.decisions,
                      args.learn_min)
        runs = {"keyword": one_run(setup, learned=False), "learned": one_run(setup, learned=True)}
    print(f"    the feeds' hosts answered {served['feed']} feed and {served['article']} "
          f"article requests (404: no article pages)\n")
    table(lang, runs, reference)
    goals(lang, runs, reference)
    print()
    if args.curve or args.smoke:
        learning_curve(lang, args.vesti, training, held, reference)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vesti", metavar="PATH", default=os.path.join(REPO, "vesti.py"),
                        help="the vesti.py measured (default: the repository's)")
    parser.add_argument("--lang", choices=("en", "ru", "both"), default="both")
    parser.add_argument("--train", type=int, help=f"training items (default about {FULL['train']})")
    parser.add_argument("--held", type=int, help=f"held-out items (default about {FULL['held']})")
    parser.add_argument("--decisions", type=int,
                        help=f"the editor's decisions per direction (default {FULL['decisions']})")
    parser.add_argument("--feeds", type=int, help=f"feeds at least (default {FULL['feeds']})")
    parser.add_argument("--learn-min", type=int,
                        help="VESTI_LEARN_MIN of the runs (default vesti's; "
                             f"{SMOKE['learn_min']} with --smoke)")
    parser.add_argument("--corpus", default=NEWS, help=f"the labelled news (default {NEWS})")
    parser.add_argument("--curve", action="store_true",
                        help="also train the reference's learner and vesti.py's model on "
                             f"{' and '.join(map(str, CURVE_SIZES))} training items drawn at "
                             "random and on all of them: how many labels they need")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (" + ", ".join(f"{k} {v}" for k, v in SMOKE.items())
                        + "): checks that the whole benchmark runs, in seconds")
    args = parser.parse_args(argv)
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.vesti = os.path.abspath(args.vesti)
    if not os.path.isfile(args.vesti):
        parser.error(f"{args.vesti}: no such file")
    args.train, args.held = max(1, args.train), max(1, args.held)
    args.decisions, args.feeds = max(0, args.decisions), max(1, args.feeds)
    if args.smoke:
        print("smoke mode: tiny sizes; the figures show that the benchmark runs, the "
              "PASS/MISS verdicts mean nothing\n")
    own = {k: v for k, v in os.environ.items() if k.startswith(("VESTI_", "RSS_", "OLLAMA_"))}
    if own:
        print("from the environment (a run's own settings win): "
              + ", ".join(f"{k}={v}" for k, v in own.items()))
    started = time.monotonic()
    languages = ("en", "ru") if args.lang == "both" else (args.lang,)
    if args.smoke and args.lang == "both":
        # The path is the same for both: the smoke run takes it in English
        # and only reads the Russian set.
        print(f"ru: {len(distinct(READERS['ru'](args.corpus)))} distinct items read "
              f"(the run itself: --lang ru)")
        languages = ("en",)
    with tempfile.TemporaryDirectory(prefix="vesti-bench-learning-") as tmp:
        for lang in languages:
            one_language(lang, args, tmp)
    print(f"benchmark: {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
