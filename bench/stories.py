#!/usr/bin/env python3
"""Benchmark of stories (near-duplicate posts). Prints figures and ratios.
Exits 0 when everything ran (a MISS is a figure, not a failure); exits 1
when something broke. Run from the repository root: `python
bench/stories.py`; `--smoke` runs the whole path in seconds with tiny sizes;
`--only SECTION` (quality, lookup, llm, flood; repeatable) runs only those.

What it measures:

1. Quality: the labelled set of tests/fixtures/story_set.py (pairs built
   from ../shared/corpus: rewrites, teasers, reposts; template releases,
   other stories of one feed, digests) through the worker's look-up:
   pairwise precision and recall, and right/of per kind.
     target: precision >= 0.98, recall >= 0.85
2. Look-up time with --window posts already in the story window (default
   100,000 and 1,000,000): the window's posts carry random story keys (as
   many as a real post: LEAD_BANDS lead and BODY_BANDS body bands), so their index has the
   real size; then --probes real texts of the corpus (half of them with a
   copy already stored) are looked up one by one with vesti.join_story, as
   the worker does (words, keys, index seeks, the exact check, the post
   entered in its story), each timed. The window databases are cached in
   the temporary directory by size.
     target: median < 5 ms
3. LLM calls saved: every text of the labelled set's pairs (copies and
   all, each text once) queued and classified by `run_workers` against a fake Ollama
   (every post matches a keyword, so each would go to the LLM): LLM calls
   made, posts, calls saved, against the stories the set holds.
4. A flood: --flood posts (default 10,000) that are near-identical copies
   of one story (one text of about 290 characters, one or two words of
   each its own, each with its own address, from 40 sources), queued and
   classified by `run_workers` with keywords alone, as a worker enters
   them in their story (flood classified, posts/s; how many of them its
   story took, none being a failure). Its posts are undated, so every
   source is a new one (see vesti.is_new_source): the flood a network of
   fresh sites or channels sends, each copy checked against the story's
   first post both ways. Then:
   - the desk as an editor opens it: `GET /` with Basic auth from the real
     web server on 127.0.0.1, timed (median of DESK_GETS): the page's size
     and the copies the flood's card names;
   - --unrelated posts (default 2,000) of other stories queued after the
     flood, classified by `run_workers` with keywords alone (posts/s, beside
     the same posts on a database without the flood);
   - --flood-probes look-ups (default 200) each of a post of another story
     and of one more copy, with vesti.join_story as in 2 (ms per look-up,
     median and max); no post of another story may join the flood, every
     copy must.
     target: median < 5 ms for either look-up, as in 2
   Each run is a process of its own importing the vesti.py measured (the
   repository's; with --compare PATH an earlier one too, e.g. `git show
   REV:vesti.py > /tmp/old/vesti.py`, in turns: new, old, then old, new,
   ... over --rounds rounds, default 2). A table gives each figure's least
   and median per side, and how many times the new one is better (the old
   median over the new for ms and KB, the new over the old for posts/s).
"""

import argparse
import base64
import http.client
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(REPO, "tests", "fixtures"))
# A flood run (--flood-run PATH, see flood_runs) measures that vesti.py, in a
# process of its own: its folder comes first, so `import vesti` is that file.
FLOOD_PROGRAM = (os.path.abspath(sys.argv[sys.argv.index("--flood-run") + 1])
                 if "--flood-run" in sys.argv[1:-1] else None)
if FLOOD_PROGRAM:
    sys.path.insert(0, os.path.dirname(FLOOD_PROGRAM))

import vesti  # noqa: E402
import story_set  # noqa: E402
from harness import fail, run  # noqa: E402
from worker import POLL, SMOKE_POLL, fake_ollama, post_text  # noqa: E402

CORPUS = os.path.join(os.path.dirname(REPO), "shared", "corpus")
if not os.path.isdir(CORPUS):       # a checkout on its own: the part of it the tests read
    CORPUS = os.path.join(REPO, "tests", "fixtures", "corpus")
KEYS_PER_POST = vesti.LEAD_BANDS + vesti.BODY_BANDS
CACHE_VERSION = 2


def quality(tmp, pairs):
    print(f"== quality: {len(pairs)} labelled pairs "
          f"({sum(same for _, same, _, _ in pairs)} same story, "
          f"{sum(not same for _, same, _, _ in pairs)} not)")
    precision, recall, kinds = story_set.measure(pairs, os.path.join(tmp, "quality.db"))
    for kind, (right, of) in kinds.items():
        print(f"    {kind:24s} {right:4d} of {of:4d} right")
    print(f"precision = {precision:.3f}   target >= 0.98   {'PASS' if precision >= 0.98 else 'MISS'}")
    print(f"recall    = {recall:.3f}   target >= 0.85   {'PASS' if recall >= 0.85 else 'MISS'}")


def window_db(tmp, size, cache_dir):
    """A database with `size` posts in the story window, each with random keys."""
    cached = os.path.join(cache_dir, f"vesti-bench-stories-v{CACHE_VERSION}-{size}.db")
    path = os.path.join(tmp, f"window-{size}.db")
    if not os.path.exists(cached):
        started = time.monotonic()
        building = cached + ".part"
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(building + suffix):
                os.remove(building + suffix)
        conn = vesti.connect(building)
        vesti.migrate(conn)
        conn.execute("INSERT INTO sources (id, slug, url) VALUES (1, 'window', 'http://w/')")
        rng = random.Random(size)
        now = vesti.utc_text()
        step = 20_000
        for first in range(1, size + 1, step):
            last = min(size, first + step - 1)
            with vesti.transaction(conn):
                conn.executemany("INSERT INTO posts (id, source_id, title, text, fetched_at, "
                                 "classified, story_id) VALUES (?, 1, '', 'x', ?, 1, ?)",
                                 [(i, now, i) for i in range(first, last + 1)])
                conn.executemany("INSERT OR IGNORE INTO story_keys (key, post_id) VALUES (?, ?)",
                                 [(rng.getrandbits(63), i) for i in range(first, last + 1)
                                  for _ in range(KEYS_PER_POST)])
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        os.replace(building, cached)
        print(f"built the window of {size} posts in {time.monotonic() - started:.0f} s "
              f"(cached: {cached})")
    shutil.copy(cached, path)
    return path


def lookups(tmp, size, texts, cache_dir):
    print(f"== look-up: {size} posts in the window, {len(texts)} probes")
    path = window_db(tmp, size, cache_dir)
    db = vesti.Database(path)
    conn = db.conn()
    times, joined = [], 0
    for title, text in texts:
        post_id = conn.execute("INSERT INTO posts (source_id, title, text) VALUES (1, ?, ?)",
                               (title, text)).lastrowid
        started = time.perf_counter()
        story = vesti.join_story(conn, post_id, title, text, 72)
        times.append((time.perf_counter() - started) * 1000)
        joined += story != post_id
    db.close()
    times.sort()
    median, p95 = statistics.median(times), times[int(len(times) * 0.95) - 1]
    print(f"look-up per post: median {median:.2f} ms, p95 {p95:.2f} ms, max {times[-1]:.2f} ms "
          f"({joined} of {len(texts)} joined a story)")
    print(f"median = {median:.2f} ms   target < 5 ms   {'PASS' if median < 5 else 'MISS'}")
    if joined == 0:
        fail("no probe joined the story of its stored copy")


def llm_saved(tmp, pairs, workers, poll=POLL):
    # Each text once: a text stored twice is caught before it is queued.
    posts = list(dict.fromkeys(post for _, _, a, b in pairs for post in (a, b)))
    print(f"== LLM calls saved: {len(posts)} posts of the labelled pairs, fake Ollama, "
          f"{workers} workers")
    home = os.path.join(tmp, "llm")
    os.makedirs(home)
    with open(os.path.join(home, "sources.yaml"), "w", encoding="utf-8") as f:
        f.write("directions:\n  linux:\n    title: Linux\n"
                "    keywords: [the, a, and, of, in, to, и, в, на, digest, release, released]\n"
                "sources:\n  - slug: mixed\n    crawler: rss\n    url: http://mixed.example/feed\n")
    with fake_ollama(0.0, poll) as (url, titles):
        settings = vesti.load_settings(environ={"OLLAMA_URL": url, "RSS_HOST_DELAY": "0"},
                                       env_file=None, db=os.path.join(home, "vesti.db"),
                                       sources=os.path.join(home, "sources.yaml"))
        registry, db = vesti.open_intake(settings)
        conn = db.conn()
        conn.executemany("INSERT INTO posts (source_id, title, text, url) VALUES (1, ?, ?, ?)",
                         [(f"{n} {title}"[:200], text, f"http://mixed.example/{n}")
                          for n, (title, text) in enumerate(posts)])
        stats, _ = vesti.run_workers(db, settings, registry, workers=workers, quiet=True)
        # Copies that waited for their story's verdict are taken again at once.
        while conn.execute("SELECT count(*) FROM posts WHERE classified = 0").fetchone()[0]:
            conn.execute("UPDATE posts SET next_attempt_at = NULL WHERE classified = 0")
            vesti.run_workers(db, settings, registry, workers=workers, quiet=True)
        calls = sum(titles.values())
        figures = vesti.story_figures(conn)
        # Every post with a keyword hit is in a story (its own, when it leads one).
        stories = conn.execute("SELECT count(DISTINCT story_id) FROM posts "
                               "WHERE story_id IS NOT NULL").fetchone()[0]
        db.close()
    copies = len({(a, b) for _, same, a, b in pairs if same})
    print(f"posts {len(posts)}, LLM calls {calls}, saved {figures['llm_calls_saved']} "
          f"({figures['llm_calls_saved'] / len(posts):.0%} of posts); "
          f"the set holds {copies} pairs of copies")
    print(f"stories {stories}, LLM calls per story = {calls / max(stories, 1):.2f}   target 1.00   "
          f"{'PASS' if calls == stories else 'MISS'}")
    keywords = vesti.KeywordIndex(registry.directions)
    asking = sum(1 for title, text in posts if keywords.matches(f"{title}\n{text}"))
    if calls + figures["llm_calls_saved"] != asking:
        fail(f"{calls} calls + {figures['llm_calls_saved']} saved != {asking} posts "
             f"with a keyword hit")


# The flood: one story copied thousands of times (a press release every site
# reposts, a channel network pushing one post). Each of its posts has words
# of its own only where FLOOD_TEXT says {first} and {second}: alphabetic
# words, since numbers are part of every story key.
FLOOD_TITLE = "Linux kernel update released"
FLOOD_TEXT = ("The Linux kernel maintainers released the long awaited update today after three "
              "months of work. It brings a new scheduler for large servers, faster network "
              "drivers, better support for {first} laptops and many security fixes; "
              "distributions will ship it to {second} users in the coming weeks.")
FLOOD_SOURCES = 40
FLOOD_SOURCES_YAML = """\
directions:
  linux: {title: Linux, keywords: [linux, kernel, scheduler, security]}
sources:
"""
SYLLABLES = ("ba", "ko", "ri", "tu", "me", "sa", "lo", "ni", "ve", "du")
FLOOD = {"flood": 10_000, "unrelated": 2_000, "flood_probes": 200, "rounds": 2}
FLOOD_SMOKE = {"flood": 100, "unrelated": 30, "flood_probes": 10, "rounds": 1}
DESK_GETS = 5
PASSWORD = "bench-flood"
# (figure, label, unit, better): "lower" for costs, "higher" for rates, None
# for a count that is only shown.
FLOOD_FIGURES = (
    ("flood_rate", "flood classified", "posts/s", "higher"),
    ("desk_ms", "desk GET /", "ms", "lower"),
    ("desk_kb", "desk page", "KB", "lower"),
    ("named", "copies named on the card", "", None),
    ("after_rate", "other stories after the flood", "posts/s", "higher"),
    ("alone_rate", "other stories, no flood", "posts/s", "higher"),
    ("other_median", "look-up, other story: median", "ms", "lower"),
    ("other_max", "look-up, other story: max", "ms", "lower"),
    ("copy_median", "look-up, one more copy: median", "ms", "lower"),
    ("copy_max", "look-up, one more copy: max", "ms", "lower"),
)


def invented_word(n):
    """A word of letters only, another for every n."""
    return "".join(SYLLABLES[int(digit)] for digit in str(n))


def flood_post(n):
    """(title, text) of the flood's nth copy: one word of its own, every
    other copy two."""
    second = invented_word(n // 2) if n % 2 else "their"
    return FLOOD_TITLE, FLOOD_TEXT.format(first=invented_word(n), second=second)


def flood_intake(tmp, name):
    """(settings, registry, db) of a new database with the flood's sources,
    keywords alone deciding."""
    sources = os.path.join(tmp, f"{name}.yaml")
    with open(sources, "w", encoding="utf-8") as f:
        f.write(FLOOD_SOURCES_YAML + "".join(
            f"  - {{slug: wire-{k}, name: Wire {k}, crawler: rss, "
            f"url: 'http://wire-{k}.example/feed'}}\n" for k in range(1, FLOOD_SOURCES + 1)))
    settings = vesti.load_settings(environ={"OLLAMA_URL": ""}, env_file=None,
                                   db=os.path.join(tmp, f"{name}.db"), sources=sources)
    registry, db = vesti.open_intake(settings)
    return settings, registry, db


def queue_posts(db, posts):
    """Pending posts [(title, text, url)], from the sources in turn, as
    store_posts leaves them (counted, searchable)."""
    conn = db.conn()
    sources = [row[0] for row in conn.execute("SELECT id FROM sources ORDER BY id")]
    with vesti.transaction(conn):
        conn.executemany("INSERT INTO posts (source_id, title, text, url, classified) "
                         "VALUES (?, ?, ?, ?, 0)",
                         [(sources[n % len(sources)], title, text, url)
                          for n, (title, text, url) in enumerate(posts)])
    vesti.catch_up_index(conn)


def classify_queue(db, settings, registry, workers, what):
    """posts/s of `run_workers` on the queue; every post must end classified."""
    conn = db.conn()
    pending = conn.execute("SELECT count(*) FROM posts WHERE classified = 0").fetchone()[0]
    started = time.perf_counter()
    stats, finished = vesti.run_workers(db, settings, registry, workers=workers, quiet=True)
    seconds = time.perf_counter() - started
    left = conn.execute("SELECT count(*) FROM posts WHERE classified != 1").fetchone()[0]
    print(f"    {what}: {pending} posts in {seconds:.2f} s, {pending / seconds:.0f} posts/s "
          f"({stats.line()})")
    if not finished or left:
        fail(f"{what}: {left} posts not classified" + ("" if finished else ", workers stuck"))
    return pending / seconds


def other_posts(first, count):
    """Posts of stories of their own: bench/worker.py's texts, whose numbers
    differ (and numbers are part of every story key)."""
    return [(f"Bench post {n}", post_text(n), f"http://other.example/{n}")
            for n in range(first, first + count)]


def get_desk(port, user):
    """(status, body, ms) of `GET /` with Basic auth."""
    auth = base64.b64encode(f"{user}:{PASSWORD}".encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        started = time.perf_counter()
        conn.request("GET", "/", headers={"Authorization": f"Basic {auth}"})
        response = conn.getresponse()
        body = response.read()
        return response.status, body, (time.perf_counter() - started) * 1000
    finally:
        conn.close()


def desk_card(db, settings, registry):
    """The desk with the flood's card, from the real web server: (median ms,
    KB, copies named on the card, what its story line says)."""
    app = vesti.WebApp(db, settings, registry, PASSWORD)
    server = vesti.make_web_server(app, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        answers = [get_desk(server.server_address[1], settings.web_user)
                   for _ in range(DESK_GETS)]
    finally:
        server.shutdown()
        server.server_close()
    status, body, _ = answers[-1]
    lines = re.findall(rb'<p class="small story">(.*?)</p>', body, re.S)
    named = lines[0].count(b'target="_blank"') if lines else 0
    said = re.sub(r"<[^>]+>", "", lines[0].decode()) if lines else ""
    head, _, rest = said.partition(":")
    tail = rest.rsplit(",", 1)[-1].strip()
    ms = statistics.median(ms for _, _, ms in answers)
    cards = body.count(b'<article class="post"')
    print(f"    desk: GET / {status} in {ms:.0f} ms (median of {DESK_GETS}), "
          f"{len(body) / 1024:.1f} KB, {cards} card{'s' * (cards != 1)}; the flood's card says "
          f"\"{head}: …{tail[-40:]}\", {named} copies named")
    if status != 200 or len(lines) != 1:
        fail(f"the desk answered {status} with {len(lines)} story lines, not the flood's one")
    return ms, len(body) / 1024, named


def timed_lookups(db, posts, hours):
    """ms of each post's vesti.join_story, and how many joined a story."""
    conn = db.conn()
    times, joined = [], 0
    for title, text, url in posts:
        post_id = conn.execute("INSERT INTO posts (source_id, title, text, url) "
                               "VALUES (1, ?, ?, ?)", (title, text, url)).lastrowid
        started = time.perf_counter()
        story = vesti.join_story(conn, post_id, title, text, hours)
        times.append((time.perf_counter() - started) * 1000)
        joined += story != post_id
    return times, joined


def flood_run(size, others, probes, workers):
    """The figures of one flood run of the vesti.py imported."""
    figures = {}
    with tempfile.TemporaryDirectory(prefix="vesti-bench-flood-") as tmp:
        settings, registry, db = flood_intake(tmp, "alone")
        queue_posts(db, other_posts(1, others))
        figures["alone_rate"] = classify_queue(db, settings, registry, workers,
                                               "other stories, no flood")
        db.close()

        settings, registry, db = flood_intake(tmp, "flood")
        queue_posts(db, [(*flood_post(n), f"http://wire.example/flood/{n}")
                         for n in range(size)])
        figures["flood_rate"] = classify_queue(db, settings, registry, workers, "flood classified")
        story, posts = db.conn().execute(
            "SELECT coalesce(story_id, id), count(*) FROM posts GROUP BY 1 "
            "ORDER BY 2 DESC LIMIT 1").fetchone()
        print(f"    the flood's story: {posts} of {size} posts (led by #{story})")
        if posts < 2:
            fail("no copy of the flood joined its story")
        figures["desk_ms"], figures["desk_kb"], figures["named"] = \
            desk_card(db, settings, registry)

        queue_posts(db, other_posts(others + 1, others))
        figures["after_rate"] = classify_queue(db, settings, registry, workers,
                                               "other stories after the flood")

        for kind, posts, joining in (
                ("other", other_posts(2 * others + 1, probes), False),
                ("copy", [(*flood_post(n), f"http://wire.example/probe/{n}")
                          for n in range(size, size + probes)], True)):
            times, joined = timed_lookups(db, posts, settings.story_hours)
            figures[f"{kind}_median"], figures[f"{kind}_max"] = statistics.median(times), max(times)
            print(f"    look-up, {'one more copy' if joining else 'other story'}: median "
                  f"{figures[f'{kind}_median']:.2f} ms, max {figures[f'{kind}_max']:.2f} ms "
                  f"({joined} of {probes} joined a story)")
            if joined != (probes if joining else 0):
                fail(f"{joined} of {probes} look-ups of {'copies' if joining else 'other stories'}"
                     f" joined a story, {probes if joining else 0} expected")
        db.close()
    return figures


def flood_runs(programs, args):
    """Each program's flood runs in turns, each a process of its own:
    {side: [figures, or None for a run that broke]}."""
    rounds = {side: [] for side in programs}
    for number in range(args.rounds):
        for side in list(programs)[::-1 if number % 2 else 1]:
            print(f"-- round {number + 1} of {args.rounds}, {side}: {programs[side]}", flush=True)
            rounds[side].append(flood_child(programs[side], args))
    return rounds


def flood_child(program, args):
    """One flood run of `program` in a process of its own; its figures."""
    with tempfile.TemporaryDirectory(prefix="vesti-bench-flood-") as tmp:
        out = os.path.join(tmp, "figures.json")
        command = [sys.executable, os.path.abspath(__file__), "--flood-run", program,
                   "--flood", str(args.flood), "--unrelated", str(args.unrelated),
                   "--flood-probes", str(args.flood_probes), "--workers", str(args.workers),
                   "--flood-out", out]
        timeout = 1800 + args.flood / 10
        try:
            code = subprocess.run(command, cwd=tmp, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = f"none, killed after {timeout:.0f} s"
        if code != 0:
            fail(f"the flood run of {program} exited {code}")
        if not os.path.exists(out):
            return None
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def shown(value, unit):
    return f"{value:.2f}" if unit == "ms" else f"{value:.1f}" if unit == "KB" else f"{value:.0f}"


def flood_table(rounds, programs):
    """Least and median of each figure per side, and how many times the new
    one is better (a run that broke left out)."""
    sides = [side for side in ("new", "old") if side in programs]
    print(f"== flood: least and median of {len(rounds['new'])} round(s)"
          + ("" if all(all(rounds[side]) for side in sides) else ", runs that broke left out"))
    for side in sides:
        print(f"    {side}: {programs[side]}")
    print(f"{'figure':<34}{'unit':>8}" + "".join(f" {side + ' least':>10} {'median':>9}"
                                                  for side in sides)
          + (f" {'new better':>11}" if len(sides) == 2 else ""))
    medians = {}
    for key, label, unit, better in FLOOD_FIGURES:
        row = f"{label:<34}{unit:>8}"
        for side in sides:
            values = [run[key] for run in rounds[side] if run is not None]
            if not values:
                row += f" {'-':>10} {'-':>9}"
                continue
            medians[side, key] = statistics.median(values)
            row += f" {shown(min(values), unit):>10} {shown(medians[side, key], unit):>9}"
        if len(sides) == 2:
            new, old = medians.get(("new", key)), medians.get(("old", key))
            ratio = None if better is None or not new or not old else \
                old / new if better == "lower" else new / old
            row += f" {ratio:10.2f}x" if ratio is not None else ""
        print(row)
    median = medians.get(("new", "copy_median"))
    if median is not None:
        other = medians[("new", "other_median")]
        print(f"new: copy look-up median = {median:.2f} ms, other story {other:.2f} ms   "
              f"target < 5 ms   {'PASS' if max(median, other) < 5 else 'MISS'}")


def flood(args):
    programs = {"new": os.path.join(REPO, "vesti.py")}
    if args.compare:
        programs["old"] = os.path.abspath(args.compare)
    print(f"== flood: {args.flood} near-identical posts of one story from {FLOOD_SOURCES} "
          f"sources, keywords alone, {args.workers} workers; {args.unrelated} posts of other "
          f"stories; {args.flood_probes} look-ups of each kind")
    flood_table(flood_runs(programs, args), programs)


SECTIONS = ("quality", "lookup", "llm", "flood")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=SECTIONS,
                        help="run only this section (repeatable; default all)")
    parser.add_argument("--window", type=int, action="append",
                        help="posts in the story window (repeatable; default 100000 and 1000000)")
    parser.add_argument("--probes", type=int, default=1000, help="look-ups timed (default 1000)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--flood", type=int,
                        help=f"posts of the flood (default {FLOOD['flood']})")
    parser.add_argument("--unrelated", type=int,
                        help=f"posts of other stories after it (default {FLOOD['unrelated']})")
    parser.add_argument("--flood-probes", type=int,
                        help=f"look-ups of each kind timed (default {FLOOD['flood_probes']})")
    parser.add_argument("--compare", metavar="PATH",
                        help="an earlier vesti.py whose flood figures are taken in turns with "
                             "the repository's (the flood section only)")
    parser.add_argument("--rounds", type=int,
                        help=f"flood runs of each vesti.py (default {FLOOD['rounds']}; "
                             f"{FLOOD_SMOKE['rounds']} with --smoke)")
    parser.add_argument("--corpus", default=CORPUS, help=f"the corpus (default {CORPUS})")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    # One flood run, in a process of its own (see flood_child).
    parser.add_argument("--flood-run", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--flood-out", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value in (FLOOD_SMOKE if args.smoke else FLOOD).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.rounds = max(1, args.rounds)
    if args.flood_run:
        return flood_measured(args)
    sections = args.only or SECTIONS
    if args.compare and "flood" not in sections:
        parser.error("--compare applies to the flood section only")
    if args.compare and not os.path.isfile(args.compare):
        parser.error(f"{args.compare}: no such file")
    windows = args.window or ([2000] if args.smoke else [100_000, 1_000_000])
    probes = 40 if args.smoke else args.probes
    if {"quality", "lookup", "llm"} & set(sections):
        pairs = story_set.labelled_pairs(args.corpus, feeds=4 if args.smoke else None)
        rng = random.Random(5)
        texts = [post for _, _, a, b in pairs for post in (a, b)]
        texts = [texts[i] for i in sorted(rng.sample(range(len(texts)), min(probes, len(texts))))]
    with tempfile.TemporaryDirectory() as tmp:
        if "quality" in sections:
            quality(tmp, pairs)
        if "lookup" in sections:
            for size in windows:
                lookups(tmp, size, texts, tmp if args.smoke else tempfile.gettempdir())
        if "llm" in sections:
            llm_saved(tmp, pairs, args.workers, SMOKE_POLL if args.smoke else POLL)
    if "flood" in sections:
        flood(args)


def flood_measured(args):
    """A flood run (--flood-run): the figures of the vesti.py imported, into
    --flood-out."""
    print(f"    vesti: {vesti.__file__}")
    if os.path.realpath(vesti.__file__) != os.path.realpath(FLOOD_PROGRAM):
        fail(f"imported {vesti.__file__}, not {FLOOD_PROGRAM}")
        return
    figures = flood_run(args.flood, args.unrelated, args.flood_probes, args.workers)
    with open(args.flood_out, "w", encoding="utf-8") as f:
        json.dump(figures, f)


if __name__ == "__main__":
    sys.exit(run(main))
