#!/usr/bin/env python3
"""Benchmark of how often decisions that carry no signal switch a model on
(issue 41, "an editor whose decisions carry no signal leaves the desk as
keywords made it"): many random editors, each on a fresh copy of one
database, and how often each threshold of the separation test would have let
their model judge the desk. Beside the threshold vesti.py uses, in the same
run, the others (the chi-squared quantiles of one degree of freedom at 1 %,
0.5 %, 0.2 %, 0.1 %, 0.05 % and 0.02 %), so a change of SEPARATION is
weighed by what it lets through. Run from the repository root:
`python bench/random_editors.py` (two to four minutes on one core);
`--seeds N` editors per direction and share (default 100), `--vesti PATH`
another vesti.py.

The database is bench/trust.py's (a): the English labelled news of
bench/news (HuffPost, CC BY 4.0; see bench/news/README.md), the older
--train items (1,500) served as 8 RSS feeds on loopback addresses, with
bench/learning.py's three English directions and keywords, crawled and
classified once by `vesti.py crawl --all` and `vesti.py worker` (keyword
mode). Each editor then works in this process, on its own copy, through
vesti.py's own functions (set_decisions, Learners.refresh, as `serve` does
after each decision): it takes --decisions (60) cards of one direction's
default desk at random (undecided cards of relevance 3 or more) and decides
them in random order, 60 % or 85 % approved (exactly round(share x n)),
whatever their label. Each time its decisions reach VESTI_LEARN_MIN (30)
and every 5 after, the model is calibrated as every process calibrates it,
and the separation statistic it computed (vesti.separation) is noted (none
while it has fewer than 5 of either decision: no model yet).

Per threshold: the share of those checks it passes ("per check"), the share
of editors whose model it would have switched on at some check ("ever",
and for 85 % approved alone: there a model used lifts every card over the
floor) and at the last ("at the end"). The row of vesti.py's SEPARATION is
marked. Exits 1 if something broke.
"""

import argparse
import collections
import importlib.util
import logging
import os
import random
import shutil
import sys
import tempfile
import time
import types

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

import learning  # noqa: E402
import trust  # noqa: E402
from harness import fail, run  # noqa: E402

SHARES = (0.6, 0.85)
LEARN_MIN = 30
EVERY = 5                           # Learners recalibrate at multiples of this
THRESHOLDS = (6.63, 7.88, 9.55, 10.83, 12.12, 13.81)  # chi-squared, 1 df


def load(path):
    spec = importlib.util.spec_from_file_location("vesti", path)
    vesti = importlib.util.module_from_spec(spec)
    sys.modules["vesti"] = vesti
    spec.loader.exec_module(vesti)
    return vesti


def build(args, tmp):
    """The base database: (a)'s feeds crawled and classified once."""
    items = learning.distinct(learning.read_en(learning.NEWS))
    training, held = learning.split_by_date("en", items, args.train, 0)
    served = collections.Counter()
    feeds = learning.deal_out(training, held, trust.NEWS_FEEDS, "en", served)
    with learning.feed_hosts(feeds, learning.POLL):
        sources = os.path.join(tmp, "sources.yaml")
        learning.write_sources(sources, "en", feeds)
        options = types.SimpleNamespace(vesti=args.vesti, learn_min=LEARN_MIN, smoke=False)
        corpus = trust.Corpus(options, tmp, "news", feeds, sources, list(learning.DIRECTIONS["en"]),
                              training, held)
        if not corpus.build():
            return None, None
    return corpus.db, sources


def one_editor(vesti, base, sources, folder, direction, share, rng, decisions, noted):
    """A random editor on a copy of base: the statistics of its checks."""
    db_path = os.path.join(folder, "vesti.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db_path + suffix):
            os.remove(db_path + suffix)
    shutil.copyfile(base, db_path)
    settings = vesti.load_settings(environ={"OLLAMA_URL": "", "VESTI_LEARN_MIN": str(LEARN_MIN)},
                                   env_file=None, db=db_path, sources=sources)
    _, db = vesti.open_intake(settings)
    conn = db.conn()
    cards = [row[0] for row in conn.execute(
        "SELECT id FROM posts WHERE direction = ? AND status = 'new' AND relevance >= 3 "
        "AND (story_id IS NULL OR story_id = id) ORDER BY id", (direction,))]
    chosen = rng.sample(cards, min(decisions, len(cards)))
    approved = round(share * len(chosen))
    statuses = ["approved"] * approved + ["rejected"] * (len(chosen) - approved)
    rng.shuffle(statuses)
    learners, checks = vesti.Learners(LEARN_MIN), []
    for count, (post, status) in enumerate(zip(chosen, statuses), 1):
        vesti.set_decisions(conn, [post], status, "bench")
        if count >= LEARN_MIN and count % EVERY == 0:
            noted.clear()
            learners.refresh(conn, now=True)
            if len(noted) > 1:
                fail(f"{direction}: {len(noted)} statistics at {count} decisions, not 1")
                return None
            if noted:           # none: fewer than 5 of a decision, no model yet
                checks.append(noted[0])
    conn.close()
    return checks


def report(runs, current):
    print(f"\n== how often a random editor's model would be used, by threshold "
          f"({len(runs)} editors, {sum(len(c) for _, c in runs)} checks)")
    print("threshold        | per check | ever   | ever, 85 % approved | at the end")
    for threshold in sorted({*THRESHOLDS, current}):
        checks = [s for _, c in runs for s in c]
        ever = [any(s >= threshold for s in c) for _, c in runs]
        ever85 = [any(s >= threshold for s in c) for share, c in runs if share == 0.85]
        end = [bool(c) and c[-1] >= threshold for _, c in runs]
        mark = "(vesti.py)" if threshold == current else ""
        print(f"{threshold:5.2f} {mark:<11}| {sum(s >= threshold for s in checks) / len(checks):8.2%}  "
              f"| {sum(ever) / len(ever):5.2%} | {sum(ever85) / max(1, len(ever85)):18.2%}  "
              f"| {sum(end) / len(end):.2%}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vesti", default=os.path.join(REPO, "vesti.py"))
    parser.add_argument("--seeds", type=int, default=100, help="editors per direction and share")
    parser.add_argument("--decisions", type=int, default=60)
    parser.add_argument("--train", type=int, default=trust.FULL["train"])
    args = parser.parse_args(argv)
    started = time.monotonic()
    vesti = load(args.vesti)
    if not hasattr(vesti, "separation"):
        fail(f"{args.vesti} has no separation(): it has no separation test to measure")
        return
    noted, separation = [], vesti.separation

    def noting(points, scale, shift):
        noted.append(separation(points, scale, shift))
        return noted[-1]
    vesti.separation = noting
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="vesti-random-editors-") as tmp:
        base, sources = build(args, tmp)
        if base is None:
            return
        folder = tempfile.mkdtemp(dir=tmp)
        runs = []
        for seed in range(args.seeds):
            for share in SHARES:
                for n, direction in enumerate(learning.DIRECTIONS["en"]):
                    rng = random.Random(seed * 1000 + n * 10 + round(share * 100))
                    checks = one_editor(vesti, base, sources, folder, direction, share, rng,
                                        args.decisions, noted)
                    if checks is None:
                        return
                    runs.append((share, checks))
            if (seed + 1) % 20 == 0:
                print(f"    {seed + 1} of {args.seeds} seeds, {time.monotonic() - started:.0f} s",
                      flush=True)
    report(runs, vesti.SEPARATION)
    print(f"\nbenchmark: {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(run(main))
