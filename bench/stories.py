#!/usr/bin/env python3
"""Benchmark of stories (near-duplicate posts). Prints figures and ratios.
Exits 0 when everything ran (a MISS is a figure, not a failure); exits 1
when something broke. Run from the repository root: `python
bench/stories.py`; `--smoke` runs the whole path in seconds with tiny sizes.

What it measures:

1. Quality: the labelled set of tests/fixtures/story_set.py (pairs built
   from ../shared/corpus: rewrites, teasers, reposts; template releases,
   other stories of one feed, digests) through the worker's look-up:
   pairwise precision and recall, and right/of per kind.
     target: precision >= 0.98, recall >= 0.85
2. Look-up time with --window posts already in the story window (default
   100,000 and 1,000,000): the window's posts carry random story keys (as
   many as a real post: 8 lead and 16 body bands), so their index has the
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
"""

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(REPO, "tests", "fixtures"))

import vesti  # noqa: E402
import story_set  # noqa: E402
from harness import fail, run  # noqa: E402
from worker import fake_ollama  # noqa: E402

CORPUS = os.path.join(os.path.dirname(REPO), "shared", "corpus")
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


def llm_saved(tmp, pairs, workers):
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
    with fake_ollama(0.0) as (url, titles):
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, action="append",
                        help="posts in the story window (repeatable; default 100000 and 1000000)")
    parser.add_argument("--probes", type=int, default=1000, help="look-ups timed (default 1000)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args(argv)
    windows = args.window or ([2000] if args.smoke else [100_000, 1_000_000])
    probes = 40 if args.smoke else args.probes
    pairs = story_set.labelled_pairs(CORPUS, feeds=20 if args.smoke else None)
    rng = random.Random(5)
    texts = [post for _, _, a, b in pairs for post in (a, b)]
    texts = [texts[i] for i in sorted(rng.sample(range(len(texts)), min(probes, len(texts))))]
    with tempfile.TemporaryDirectory() as tmp:
        quality(tmp, pairs)
        for size in windows:
            lookups(tmp, size, texts, tmp if args.smoke else tempfile.gettempdir())
        llm_saved(tmp, pairs, args.workers)


if __name__ == "__main__":
    sys.exit(run(main))
