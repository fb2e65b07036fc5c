#!/usr/bin/env python3
"""Benchmark of signing in under attack: the three figures issue 39 asks
for, measured against a real `vesti.py serve` at scrypt's real cost. Prints
each figure beside its target (or its baseline), with PASS/MISS. Exits 0
when everything ran (a MISS is a figure, not a failure); exits 1 when
something broke: an exception, a vesti.py command exiting non-zero (or a
server not starting, or not exiting 0 on SIGTERM), a request answered with
a status the step cannot get (e.g. the right password refused before any
lock, a signed-in editor's page not 200, a wrong password answered with
anything but 401 where no lock or limit applies). Run from the repository
root: `python bench/signin.py`; `--smoke` runs the whole path with tiny
sizes in about half a minute (the figures only show that it runs).

Set-up: a temporary directory with a SQLite database (vesti's schema and
--posts classified posts, so the desk shows cards), a minimal sources.yaml,
VESTI_WEB_PASSWORD set, and the accounts made as an admin makes them:
`vesti.py user add NAME --role editor`, the password on stdin. Every
server is `vesti.py serve --host 127.0.0.1 --port 0`; clients speak to it
from addresses of 127.0.0.0/8 of their own (http.client's source_address:
Linux answers the whole block on loopback), since the locks count per name,
per (address, name) and per address.

1. No oracle. From one address, a name is signed in once with its right
   password (so that the server remembers it matched and could answer it
   without scrypt), then locked with LOGIN_FAILURES (5) wrong passwords;
   then --tries tries (default 3,000) for that name follow from the same
   address, from --clients threads at once, every --every-th (10th) with
   the right password, the rest wrong. Done three ways: Basic auth for an
   editor, Basic auth for the VESTI_WEB_USER account (VESTI_WEB_PASSWORD),
   and the sign-in page (POST /login with the form's token and the
   vesti_login cookie GET /login gave). Printed: how many tries were let
   in (200 for Basic auth, 303 with a session cookie for the page),
   target 0 of --tries; how all of them, and the right ones, were
   answered (429 expected); whether the right password's answers were the
   wrong ones' to the byte (status and body); the median time of a right
   and of a wrong try (a difference would be an oracle too); and answers
   per second.
2. A signed-in editor's latency under a flood of wrong passwords. The
   editor signs in on POST /login (from 127.0.0.1) and requests the desk
   (GET /, the session cookie, Accept: text/html) in a loop on one kept-open
   connection, --pause (20 ms) between two requests (a tight loop would
   take a core of this 2-core machine from the server). Flood: --addresses
   (30) client addresses, round r using 127.0.r.2, 127.0.r.3, …
   (127.0.0.2–127.0.0.31 in the first), each sending --wrong (5) wrong
   Basic-auth passwords as fast as it can, all starting at once, over as
   many names (the signed-in editor's own among them, the rest names no
   account has), each name tried by --wrong addresses. The editor's
   requests overlapping the flood are its sample;
   the quiet baseline is the same loop for as long with no flood, in the
   same run: flood, quiet, flood, quiet, … (--rounds, default 3). Printed
   per round and pooled: p50, p95 and max in ms; the rounds' p95 min and
   median; how the wrong tries were answered (401 checked and refused, 503
   no room to wait for a check, 429 locked). Checked first: the desk the
   editor is signed in to answers 200 with its cards. Target: the flood's
   pooled p95 < 1 s.
3. The time of a wrong password, by name. On a server of its own each
   round (so that the VESTI_WEB_USER account, one name that locks after 5
   tries, can be tried again under a new name: chief1, chief2, …), wrong
   Basic-auth passwords for an existing editor, for a name no account has,
   and for the VESTI_WEB_USER account, one at a time, interleaved
   (existing, made-up, then made-up, existing, …; the settings' account
   LOGIN_FAILURES - 1 times a round, spread among them), --samples of each
   of the first two a round. No try may meet a lock: every try comes from
   an address of its own (127.3.x.y), a made-up name is never used twice,
   and an existing one at most LOGIN_FAILURES - 1 times in the whole run
   (many editors are added for it). Each round starts with one untimed try
   of a made-up name and one of an existing name (printed: the first
   made-up name of a server makes its decoy hash as well). Printed: the
   median (and the rounds' medians, min and median) of each, and made-up /
   existing and settings / existing (target: within 10 %), and the median
   of made-up / existing over each pair of tries made one after the other
   (less swayed by the machine's load drifting).
"""

import argparse
import base64
import collections
import http.client
import http.cookies
import itertools
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
sys.path.insert(0, REPO)

import vesti  # noqa: E402
from harness import cached, fail, run  # noqa: E402

SETTINGS_USER = "admin"
SETTINGS_PASSWORD = "bench-signin-settings"
WRONG = "not-the-password"
LET_IN_TARGET = 0           # tries let in once locked
FLOOD_P95_TARGET = 1.0      # seconds
TIMING_TARGET = 0.10        # made-up / existing within 10 %
START_TIMEOUT = 60
STOP_TIMEOUT = 30
REQUEST_TIMEOUT = 120
WARM = 0.3                  # seconds the editor's loop runs before a round's window
PAUSE = 0.5                 # between two rounds
FULL = {"tries": 3000, "every": 10, "clients": 4, "addresses": 30, "wrong": 5, "rounds": 3,
        "samples": 32, "posts": 300, "pause": 0.02}
SMOKE = {"tries": 30, "every": 10, "clients": 2, "addresses": 3, "wrong": 2, "rounds": 1,
         "samples": 2, "posts": 20, "pause": 0.02}
SOURCES = """\
directions:
  linux:
    title: Linux
    keywords: [linux, kernel]
sources:
  - slug: wire
    crawler: rss
    url: http://127.0.0.1:9/feed
    direction: linux
    enabled: false
"""


# Set-up ------------------------------------------------------------------------------

def password_of(name):
    return f"bench-{name}-password"


def make_home(folder, posts):
    """sources.yaml and a database with `posts` classified posts; the
    environment vesti runs in (VESTI_WEB_USER added per server)."""
    with open(os.path.join(folder, "sources.yaml"), "w", encoding="utf-8") as f:
        f.write(SOURCES)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VESTI_", "RSS_", "OLLAMA_", "TG_"))}
    env.update({"VESTI_DB": os.path.join(folder, "vesti.db"),
                "VESTI_SOURCES": os.path.join(folder, "sources.yaml"),
                "OLLAMA_URL": "", "VESTI_WEB_PASSWORD": SETTINGS_PASSWORD,
                "VESTI_WEB_USER": SETTINGS_USER, "VESTI_WEB_PORT": "0",
                "PYTHONUNBUFFERED": "1"})
    settings = vesti.load_settings(environ=env, env_file=None)
    _, db = vesti.open_intake(settings)
    conn = db.conn()
    source = conn.execute("SELECT id FROM sources WHERE slug = 'wire'").fetchone()[0]
    with vesti.transaction(conn):
        conn.executemany(
            "INSERT INTO posts (source_id, external_id, url, title, text, classified, status, "
            "direction, relevance, interest, summary, published_at, fetched_at) "
            "VALUES (?, ?, ?, ?, ?, 1, 'new', 'linux', 7, 5, ?, ?, ?)",
            [(source, f"e{k}", f"http://bench.example/{k + 1}", f"Kernel news number {k}",
              f"The Linux kernel, part {k}. " * 8, f"What happened to the kernel, part {k}.",
              vesti.utc_text(time.time() - 60 * (posts - k)), vesti.utc_text())
             for k in range(posts)])
    return env


def add_users(names, env, cwd):
    """`vesti.py user add NAME --role editor`, the password on stdin, two at a time."""
    def add(name):
        result = subprocess.run([*cached(os.path.join(REPO, "vesti.py")), "user", "add", name,
                                 "--role", "editor"], input=password_of(name) + "\n", env=env,
                                cwd=cwd, capture_output=True, text=True, timeout=120)
        if result.returncode != 0 or "added" not in result.stdout:
            fail(f"user add {name}: exit code {result.returncode}: "
                 f"{(result.stdout + result.stderr)[-300:]}")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(add, names))


class Server:
    """`vesti.py serve` in its own process, its output in files (a pipe
    nobody reads would stop it once full)."""

    def __init__(self, env, cwd, user, label):
        self.label = label
        self.out = open(os.path.join(cwd, f"{label}.out"), "w+", encoding="utf-8")
        self.err = open(os.path.join(cwd, f"{label}.err"), "w+", encoding="utf-8")
        self.process = subprocess.Popen(
            [*cached(os.path.join(REPO, "vesti.py")), "serve", "--host", "127.0.0.1",
             "--port", "0"], cwd=cwd, env={**env, "VESTI_WEB_USER": user},
            stdout=self.out, stderr=self.err, text=True)
        self.port = None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.process.poll() is None:
            self.out.seek(0)
            found = re.search(r"http://127\.0\.0\.1:(\d+)/", self.out.read())
            if found:
                self.port = int(found[1])
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{label}: the server did not start: {self.tail()}")

    def tail(self):
        self.err.seek(0)
        return self.err.read()[-800:]

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            fail(f"{self.label}: did not stop on SIGTERM")
        else:
            if self.process.returncode != 0 and self.port is not None:
                fail(f"{self.label}: exit code {self.process.returncode}: {self.tail()}")
        self.out.close()
        self.err.close()


# HTTP ------------------------------------------------------------------------------------

def basic(name, password):
    return "Basic " + base64.b64encode(f"{name}:{password}".encode()).decode()


def ask(port, method, path, headers=None, body=None, source=None):
    """One request on a connection of its own (from `source`): (status,
    headers, body, seconds from connecting to the body read)."""
    began = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
        return response.status, response.headers, data, time.perf_counter() - began
    finally:
        conn.close()


def set_cookies(headers):
    jar = http.cookies.SimpleCookie()
    for value in headers.get_all("Set-Cookie") or ():
        jar.load(value)
    return {name: morsel.value for name, morsel in jar.items()}


class LoginForm:
    """The sign-in page's form as a browser at `source` holds it: the
    vesti_login cookie and the token tied to it (the same for every post)."""

    def __init__(self, port, source):
        self.port, self.source = port, source
        status, headers, body, _ = ask(port, "GET", "/login", {"Accept": "text/html"},
                                       source=source)
        nonce = set_cookies(headers).get(vesti.LOGIN_COOKIE)
        token = re.search(rb'name="token" value="([0-9a-f]+)"', body)
        if status != 200 or nonce is None or token is None:
            raise RuntimeError(f"GET /login answered {status} without its form or cookie")
        self.cookie, self.token = f"{vesti.LOGIN_COOKIE}={nonce}", token[1].decode()

    def post(self, name, password):
        body = urllib.parse.urlencode({"token": self.token, "next": "/", "user": name,
                                       "password": password})
        return ask(self.port, "POST", "/login", {
            "Content-Type": "application/x-www-form-urlencoded", "Cookie": self.cookie,
            "Accept": "text/html"}, body, self.source)


def percentile(values, share):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(share * len(ordered))) - 1)]


def counted(statuses):
    """'429 ×2700, 401 ×3' (most first)."""
    common = collections.Counter(statuses).most_common()
    return ", ".join(f"{status} ×{n}" for status, n in common) or "none"


def verdict(ok):
    return "PASS" if ok else "MISS"


# 1. No oracle ------------------------------------------------------------------------------

class Tries:
    """One way of signing in as `name` from `address`: Basic auth on GET /,
    or the sign-in page. try_(password) -> (status, body, seconds, let in)."""

    def __init__(self, port, way, name, address):
        self.port, self.way, self.name, self.address = port, way, name, address
        self.form = LoginForm(port, address) if way == "page" else None
        self.right_status = 200 if way == "basic" else 303

    def try_(self, password):
        if self.form is not None:
            status, headers, body, seconds = self.form.post(self.name, password)
            let_in = status == 303 and vesti.SESSION_COOKIE in set_cookies(headers)
        else:
            status, headers, body, seconds = ask(
                self.port, "GET", "/", {"Authorization": basic(self.name, password)},
                source=self.address)
            let_in = status == 200
        return status, body, seconds, let_in


def no_oracle(port, label, way, name, password, address, args):
    tries = Tries(port, way, name, address)
    status, _, _, let_in = tries.try_(password)
    if not let_in:
        fail(f"{label}: the right password before any lock answered {status}, "
             f"not {tries.right_status}")
    locking = [tries.try_(WRONG)[0] for _ in range(vesti.LOGIN_FAILURES)]
    if locking != [401] * vesti.LOGIN_FAILURES:
        fail(f"{label}: the {vesti.LOGIN_FAILURES} wrong passwords that lock the name were "
             f"answered {locking}, not 401 each")
    results = [None] * args.tries
    errors = []

    def client(first):
        for i in range(first, args.tries, args.clients):
            right = i % args.every == args.every - 1
            try:
                results[i] = (right, *tries.try_(password if right else WRONG))
            except OSError as e:
                errors.append(f"{type(e).__name__}: {e}")

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    if errors:
        fail(f"{label}: {len(errors)} tries got no answer, e.g. {errors[0]}")
    answered = [r for r in results if r is not None]
    right = [r for r in answered if r[0]]
    wrong = [r for r in answered if not r[0]]
    let_in = sum(r[4] for r in answered)
    wrong_answers = {(r[1], r[2]) for r in wrong}
    alike = all((r[1], r[2]) in wrong_answers for r in right)
    if any(r[4] for r in wrong):
        fail(f"{label}: a wrong password was let in")
    others = [r[1] for r in answered if not r[4]]
    print(f"   {label}: {let_in} of {args.tries:,} tries let in (right password every "
          f"{args.every}th)  target {LET_IN_TARGET}  {verdict(let_in <= LET_IN_TARGET)}")
    print(f"      answers: {counted(r[1] for r in answered)}; the right password's "
          f"({len(right)}): {counted(r[1] for r in right)}; refused ones: {counted(others)}")
    print(f"      right password answered as the wrong ones, byte for byte: "
          f"{'yes' if alike else 'NO (an oracle)'}; median time right "
          f"{statistics.median(r[3] for r in right) * 1000 if right else math.nan:.1f} ms, "
          f"wrong {statistics.median(r[3] for r in wrong) * 1000 if wrong else math.nan:.1f} ms; "
          f"{len(answered) / seconds:,.0f} answers/s ({args.clients} clients, {seconds:.1f} s)",
          flush=True)
    return let_in


# 2. Latency under a flood ------------------------------------------------------------------

class EditorLoop(threading.Thread):
    """The signed-in editor asking for the desk again and again on one
    kept-open connection: [(start, seconds, status)]."""

    def __init__(self, port, session, pause):
        super().__init__(daemon=True)
        self.port, self.session, self.pause = port, session, pause
        self.records, self.problems = [], []
        self.stopping = threading.Event()

    def run(self):
        conn = None
        while not self.stopping.is_set():
            began = time.monotonic()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                      timeout=REQUEST_TIMEOUT)
                conn.request("GET", "/", headers={
                    "Cookie": f"{vesti.SESSION_COOKIE}={self.session}", "Accept": "text/html"})
                response = conn.getresponse()
                response.read()
                self.records.append((began, time.monotonic() - began, response.status))
                if response.status != 200:
                    self.problems.append(f"GET / answered {response.status}")
                if response.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as e:
                self.problems.append(f"{type(e).__name__}: {e}")
                if conn is not None:
                    conn.close()
                conn = None
            self.stopping.wait(self.pause)
        if conn is not None:
            conn.close()

    def finish(self):
        self.stopping.set()
        self.join()
        for problem in self.problems[:3]:
            fail(f"the signed-in editor's request: {problem}")
        return self.records


def overlapping(records, start, end):
    return [seconds for began, seconds, _ in records if began <= end and began + seconds >= start]


def flood_names(number, editor, args):
    return [editor] + [f"guess{number}n{i:02d}" for i in range(1, args.addresses)]


def flood_round(port, session, editor, number, args):
    """The editor's latencies while --addresses addresses send --wrong wrong
    passwords each; (latencies, window in seconds, the wrong tries' answers)."""
    names = flood_names(number, editor, args)
    step = max(1, args.addresses // args.wrong)
    barrier = threading.Barrier(args.addresses + 1)
    answers = []

    def guesser(a):
        address = f"127.0.{number % 250}.{a + 2}"
        barrier.wait()
        for k in range(args.wrong):
            name = names[(a + k * step) % len(names)]
            try:
                status = ask(port, "GET", "/", {"Authorization": basic(name, WRONG)},
                             source=address)[0]
            except (OSError, http.client.HTTPException) as e:
                status = type(e).__name__
            answers.append(status)

    guessers = [threading.Thread(target=guesser, args=(a,), daemon=True)
                for a in range(args.addresses)]
    for thread in guessers:
        thread.start()
    editor_loop = EditorLoop(port, session, args.pause)
    editor_loop.start()
    time.sleep(WARM)
    barrier.wait()
    start = time.monotonic()
    for thread in guessers:
        thread.join()
    end = time.monotonic()
    records = editor_loop.finish()
    unexpected = [a for a in answers if a not in (401, 429, 503)]
    if unexpected:
        fail(f"flood round {number + 1}: wrong passwords answered {counted(unexpected)}")
    return overlapping(records, start, end), end - start, answers


def quiet_round(port, session, seconds, args):
    editor_loop = EditorLoop(port, session, args.pause)
    editor_loop.start()
    time.sleep(WARM)
    start = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    return overlapping(editor_loop.finish(), start, end)


def latency_line(latencies):
    if not latencies:
        return "no requests"
    return (f"p50 {statistics.median(latencies) * 1000:7.1f} ms  p95 "
            f"{percentile(latencies, 0.95) * 1000:7.1f} ms  max {max(latencies) * 1000:7.1f} ms  "
            f"(n={len(latencies)})")


def flood_benchmark(port, editor, args):
    form = LoginForm(port, "127.0.0.1")
    status, headers, _, _ = form.post(editor, password_of(editor))
    session = set_cookies(headers).get(vesti.SESSION_COOKIE)
    if status != 303 or not session:
        raise RuntimeError(f"{editor} signing in on /login: answered {status} without a session")
    status, _, page, seconds = ask(port, "GET", "/", {
        "Cookie": f"{vesti.SESSION_COOKIE}={session}", "Accept": "text/html"})
    cards = len(re.findall(rb'<article class="post" id="post-', page))
    print(f"   the desk {editor} is signed in to: {status}, {len(page) / 1000:.0f} kB, "
          f"{cards} cards, {seconds * 1000:.1f} ms (first)")
    if status != 200 or cards != min(args.posts, vesti.PAGE_SIZE):
        fail(f"the signed-in desk answered {status} with {cards} cards, not "
             f"{min(args.posts, vesti.PAGE_SIZE)}")
    flood, quiet, answers = [], [], []
    for number in range(args.rounds):
        latencies, window, said = flood_round(port, session, editor, number, args)
        flood.append(latencies)
        answers += said
        print(f"   round {number + 1} flood  {latency_line(latencies)}; flood {window:.2f} s, "
              f"wrong tries: {counted(said)}", flush=True)
        time.sleep(PAUSE)
        latencies = quiet_round(port, session, max(1.0, window), args)
        quiet.append(latencies)
        print(f"   round {number + 1} quiet  {latency_line(latencies)}", flush=True)
        time.sleep(PAUSE)
    pooled = {"flood": [x for r in flood for x in r], "quiet": [x for r in quiet for x in r]}
    for kind, rounds in (("flood", flood), ("quiet", quiet)):
        p95s = [percentile(r, 0.95) * 1000 for r in rounds if r]
        line = f"{kind}: signed-in GET / {latency_line(pooled[kind])}"
        if p95s:
            line += f"; rounds' p95 min {min(p95s):.1f} ms, median {statistics.median(p95s):.1f} ms"
        if kind == "flood" and pooled[kind]:
            p95 = percentile(pooled[kind], 0.95)
            line += (f"  target p95 < {FLOOD_P95_TARGET * 1000:.0f} ms  "
                     f"{verdict(p95 < FLOOD_P95_TARGET)}")
        elif kind == "quiet":
            line += "  (baseline)"
        print(line)
    if pooled["flood"] and pooled["quiet"]:
        flood, quiet = pooled["flood"], pooled["quiet"]
        print(f"flood / quiet: p50 {statistics.median(flood) / statistics.median(quiet):.2f}, "
              f"p95 {percentile(flood, 0.95) / percentile(quiet, 0.95):.2f}")
    status = collections.Counter(answers)
    print(f"the {len(answers)} wrong tries ({args.addresses} addresses × {args.wrong}, "
          f"{args.rounds} rounds): 401 (checked, refused) ×{status[401]}, 503 (no room to "
          f"wait for a check) ×{status[503]}, 429 (locked) ×{status[429]}"
          + "".join(f", {k} ×{v}" for k, v in status.items() if k not in (401, 429, 503)))
    if not pooled["flood"]:
        fail("the editor made no request during the flood")
    return pooled


# 3. Timing of a wrong password ------------------------------------------------------------

def fresh_addresses():
    for x in range(256):
        for y in range(1, 255):
            yield f"127.3.{x}.{y}"


def existing_names(pool):
    """Each existing editor at most LOGIN_FAILURES - 1 times (no lock)."""
    for _ in range(vesti.LOGIN_FAILURES - 1):
        yield from pool


def timing_round(env, tmp, number, existing, addresses, args):
    chief = f"chief{number + 1}"
    server = Server(env, tmp, chief, f"serve-timing-{number + 1}")
    times = {"existing": [], "made-up": [], "settings": [], "pairs": []}
    try:
        def wrong_try(name):
            status, _, _, seconds = ask(server.port, "GET", "/",
                                        {"Authorization": basic(name, WRONG)},
                                        source=next(addresses))
            if status != 401:
                fail(f"timing round {number + 1}: a wrong password for {name!r} answered "
                     f"{status}, not 401")
            return seconds

        made_up = (f"ed{number + 1}x{i:03d}" for i in itertools.count())
        first = wrong_try(next(made_up))
        wrong_try(next(existing))
        settings_at = {round((k + 0.5) * args.samples / (vesti.LOGIN_FAILURES - 1))
                       for k in range(vesti.LOGIN_FAILURES - 1)}
        for i in range(args.samples):
            order = ("existing", "made-up") if i % 2 == 0 else ("made-up", "existing")
            for kind in order:
                name = next(existing) if kind == "existing" else next(made_up)
                times[kind].append(wrong_try(name))
            times["pairs"].append(times["made-up"][-1] / times["existing"][-1])
            if i in settings_at:
                times["settings"].append(wrong_try(chief))
    finally:
        server.stop()
    medians = {kind: statistics.median(values) * 1000 if values else math.nan
               for kind, values in times.items()}
    print(f"   round {number + 1} ({chief}): median existing {medians['existing']:.1f} ms, "
          f"made-up {medians['made-up']:.1f} ms, settings' account {medians['settings']:.1f} ms "
          f"(n={len(times['existing'])}/{len(times['made-up'])}/{len(times['settings'])}); "
          f"the server's first made-up name {first * 1000:.1f} ms", flush=True)
    return times


def timing_benchmark(env, tmp, pool, args):
    existing, addresses = existing_names(pool), fresh_addresses()
    rounds = [timing_round(env, tmp, number, existing, addresses, args)
              for number in range(args.rounds)]
    medians = {}
    for kind, label in (("existing", "existing editor"), ("made-up", "name no account has"),
                        ("settings", "VESTI_WEB_USER account")):
        values = [x for r in rounds for x in r[kind]]
        per_round = [statistics.median(r[kind]) * 1000 for r in rounds if r[kind]]
        if not values:
            continue
        medians[kind] = statistics.median(values)
        print(f"{label:<24} wrong password: median {medians[kind] * 1000:7.1f} ms, mean "
              f"{statistics.fmean(values) * 1000:7.1f} ms (n={len(values)}); rounds' medians min "
              f"{min(per_round):.1f} ms, median {statistics.median(per_round):.1f} ms")
    for kind, label in (("made-up", "made-up / existing"), ("settings", "settings / existing")):
        if kind in medians and "existing" in medians:
            ratio = medians[kind] / medians["existing"]
            print(f"{label} = {ratio:.3f} (of the medians)  target within {TIMING_TARGET:.0%}  "
                  f"{verdict(abs(ratio - 1) <= TIMING_TARGET)}")
    pairs = [x for r in rounds for x in r["pairs"]]
    print(f"made-up / existing of each pair of tries one after the other: median "
          f"{statistics.median(pairs):.3f}, middle half {percentile(pairs, 0.25):.3f}–"
          f"{percentile(pairs, 0.75):.3f} (n={len(pairs)}; less swayed by the machine's load "
          f"drifting)")
    return medians


# Main -------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int,
                        help=f"tries after the lock (default {FULL['tries']:,})")
    parser.add_argument("--every", type=int,
                        help=f"the right password every Nth try (default {FULL['every']})")
    parser.add_argument("--clients", type=int,
                        help=f"threads sending those tries at once (default {FULL['clients']})")
    parser.add_argument("--addresses", type=int,
                        help=f"flooding addresses (default {FULL['addresses']})")
    parser.add_argument("--wrong", type=int,
                        help=f"wrong passwords per flooding address (default {FULL['wrong']})")
    parser.add_argument("--rounds", type=int,
                        help=f"flood and quiet rounds, and timing rounds "
                             f"(default {FULL['rounds']})")
    parser.add_argument("--samples", type=int,
                        help=f"timed wrong passwords per kind of name a round (default "
                             f"{FULL['samples']})")
    parser.add_argument("--posts", type=int, help=f"posts on the desk (default {FULL['posts']})")
    parser.add_argument("--pause", type=float,
                        help=f"seconds the signed-in editor waits between two requests "
                             f"(default {FULL['pause']})")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (" + ", ".join(f"{k} {v}" for k, v in SMOKE.items())
                        + "): checks that the whole benchmark runs")
    args = parser.parse_args(argv)
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("tries", "every", "clients", "addresses", "wrong", "rounds", "samples"):
        setattr(args, name, max(1, getattr(args, name)))
    args.addresses = min(args.addresses, 253)
    args.rounds = min(args.rounds, 250)
    if args.smoke:
        print("smoke mode: tiny sizes; the figures show that the benchmark runs, the "
              "PASS/MISS verdicts mean nothing\n")
    began = time.monotonic()
    vesti.import_optional("yaml", "pyyaml", "the benchmark")
    tmp = tempfile.mkdtemp(prefix="vesti-bench-signin-")
    try:
        env = make_home(tmp, args.posts)
        per_name = vesti.LOGIN_FAILURES - 1
        pool = [f"ed{k:03d}" for k in
                range(math.ceil(args.rounds * (args.samples + 1) / per_name))]
        editor = "vera"
        started = time.monotonic()
        add_users(["anna", "boris", editor, *pool], env, tmp)
        print(f"set-up: {args.posts} posts, {3 + len(pool)} editors added with `vesti.py user "
              f"add` in {time.monotonic() - started:.1f} s; "
              f"scrypt {vesti.Process.password_cost}", flush=True)
        server = Server(env, tmp, SETTINGS_USER, "serve")
        try:
            print(f"\n1. no oracle: a name locked by {vesti.LOGIN_FAILURES} wrong passwords from "
                  f"one address, then {args.tries:,} tries from it", flush=True)
            for label, way, name, password, address in (
                    ("Basic auth, editor anna", "basic", "anna", password_of("anna"), "127.2.0.2"),
                    (f"Basic auth, VESTI_WEB_USER {SETTINGS_USER}", "basic", SETTINGS_USER,
                     SETTINGS_PASSWORD, "127.2.0.3"),
                    ("POST /login, editor boris", "page", "boris", password_of("boris"),
                     "127.2.0.4")):
                no_oracle(server.port, label, way, name, password, address, args)
            print(f"\n2. signed-in editor {editor}'s GET / while {args.addresses} addresses send "
                  f"{args.wrong} wrong Basic-auth passwords each, at once; flood, quiet, … "
                  f"{args.rounds} rounds", flush=True)
            flood_benchmark(server.port, editor, args)
        finally:
            server.stop()
        print(f"\n3. time of a wrong password (Basic auth), interleaved, {args.samples} of each "
              f"kind a round, {args.rounds} rounds (a server each)", flush=True)
        timing_benchmark(env, tmp, pool, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\ntook {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
