#!/usr/bin/env python3
"""Benchmark of publishing: how soon an approved post reaches the channel,
and how fast a queue of approved posts drains to a webhook. Prints each
figure beside its target or baseline, with PASS/MISS. Exits 0 when
everything ran (a MISS is a figure, not a failure); exits 1 when something
broke: an exception, a vesti.py command exiting non-zero, a message that
never arrived or arrived twice, posts out of approval order, a webhook
with a wrong signature. Run from the repository root:
`python bench/publish.py`; `--smoke` runs the whole path with tiny sizes
in seconds (the figures only show that it runs).

1. Approve to message (no pace). A fake Telegram Bot API on 127.0.0.1
   answers sendMessage as the real one does ({"ok": true, "result":
   {"message_id": …}}) and notes when each message arrived. A temporary
   directory holds a SQLite database of --posts classified posts and a
   sources.yaml with one target `channel` (telegram, every: now). Served
   two ways, in turns (run, separate, separate, run, …, --rounds each):
     run       `vesti.py run --workers 0` (the page and the publisher in
               one process: an approval wakes the publisher at once);
     separate  `vesti.py serve` and `vesti.py publish --forever` in two
               processes (as on two machines: the publisher looks four
               times a second).
   In each round --approvals posts are approved one at a time, as an
   editor does on the page: POST /posts/<id>/status with the form token
   scraped from GET /, Accept: application/json and an Origin naming the
   server; the next once the message has arrived, after a random pause of
   up to --gap seconds. Latency: from just before the POST to the
   message's arrival. Printed per mode: the min and the median of the
   rounds' medians and p95s. Target: p95 < 2 s.
2. Throughput to a webhook. A receiver on 127.0.0.1 checks every
   X-Vesti-Signature and answers 200. --queued posts are approved in
   one go (queued for the target `cms`, webhook, every: now), then
   `vesti.py publish` sends them and exits; timed from start to exit, in
   posts per second. Baseline in the same run, alternating (vesti,
   baseline, baseline, vesti, …): the same number of signed JSON POSTs
   sent by a plain loop in this script with urllib, one connection each as
   vesti makes them, with no database: what the bookkeeping costs.
   Checked: every post delivered once, in approval order, every one
   `published`.
"""

import argparse
import base64
import hashlib
import hmac
import http.client
import http.server
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
sys.path.insert(0, REPO)

import vesti  # noqa: E402
from harness import cached, fail, run  # noqa: E402

TOKEN = "123456789:AAE-bench-token"
SECRET = "bench-webhook-secret"
PASSWORD = "bench-publish"
P95_TARGET = 2.0
START_TIMEOUT = 30
ARRIVAL_TIMEOUT = 15
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
publish:
{targets}
"""


class Receiver:
    """A fake Bot API (sendMessage) and a webhook receiver in one server on
    127.0.0.1: what arrived, when, and how often each post did."""

    def __init__(self):
        self.lock = threading.Lock()
        self.arrived = {}           # post id -> [arrival times]
        self.order = []
        self.bad_signatures = 0
        self.next_id = 1
        self.event = threading.Condition(self.lock)
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, answer = receiver.answer(self.path, self.headers, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def answer(self, path, headers, body):
        now = time.monotonic()
        if path == f"/bot{TOKEN}/sendMessage":
            text = json.loads(body)["text"]
            post = int(re.search(r"http://bench\.example/(\d+)", text)[1])
            with self.lock:
                self.note(post, now)
                self.next_id += 1
                return 200, {"ok": True, "result": {"message_id": self.next_id, "date": int(time.time()),
                                                    "chat": {"id": -1001, "type": "channel"}}}
        if path == "/hook":
            expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
            with self.lock:
                if not hmac.compare_digest(headers.get("X-Vesti-Signature", ""), expected):
                    self.bad_signatures += 1
                    return 401, {"error": "bad signature"}
                self.note(int(json.loads(body)["id"]), now)
                return 200, {"ok": True}
        return 404, {"ok": False, "error_code": 404, "description": "Not Found"}

    def note(self, post, now):
        self.arrived.setdefault(post, []).append(now)
        self.order.append(post)
        self.event.notify_all()

    def wait_for(self, post, timeout):
        deadline = time.monotonic() + timeout
        with self.lock:
            while post not in self.arrived:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.event.wait(left)
            return self.arrived[post][0]

    def reset(self):
        with self.lock:
            self.arrived, self.order, self.bad_signatures = {}, [], 0

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def home(folder, targets, receiver, posts):
    """A directory with sources.yaml naming `targets` and a database of
    `posts` classified posts; returns the environment to run vesti in."""
    os.makedirs(folder, exist_ok=True)
    lines = []
    for name, kind, address in targets:
        lines += [f"  - name: {name}", f"    {kind}: \"{address}\"", "    every: now"]
    with open(os.path.join(folder, "sources.yaml"), "w", encoding="utf-8") as f:
        f.write(SOURCES.format(targets="\n".join(lines)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VESTI_", "RSS_", "OLLAMA_", "TG_"))}
    env.update({"VESTI_DB": os.path.join(folder, "vesti.db"),
                "VESTI_SOURCES": os.path.join(folder, "sources.yaml"),
                "OLLAMA_URL": "", "TG_BOT_TOKEN": TOKEN, "TG_BOT_API": receiver.url,
                "VESTI_WEBHOOK_SECRET": SECRET, "VESTI_WEB_PASSWORD": PASSWORD,
                "VESTI_WEB_PORT": "0", "PYTHONUNBUFFERED": "1"})
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
    return env, settings


def post_ids(settings):
    """The posts' ids, which their links name (a fresh database numbers them from 1)."""
    _, db = vesti.open_intake(settings)
    ids = [row[0] for row in db.conn().execute("SELECT id FROM posts ORDER BY id")]
    if ids != list(range(1, len(ids) + 1)):
        raise RuntimeError("the posts are not numbered from 1")
    return ids


def start(args, env, cwd, name):
    """A vesti.py command in its own process; for a server, its port."""
    process = subprocess.Popen([*cached(os.path.join(REPO, "vesti.py")), *args], cwd=cwd,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if args[0] not in ("serve", "run"):
        return process, None
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", line or "")
        if found:
            return process, int(found[1])
        if not line and process.poll() is not None:
            break
    fail(f"{name}: the server did not start: {process.stderr.read()[-500:]}")
    process.kill()
    return None, None


def stop(process, name):
    if process is None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        fail(f"{name}: did not stop on SIGTERM")
        return
    if process.returncode != 0:
        fail(f"{name}: exit code {process.returncode}: {err[-500:]}")


class Editor:
    """Approves posts on the page, as the desk's own script does."""

    def __init__(self, port):
        self.port = port
        self.auth = "Basic " + base64.b64encode(f"admin:{PASSWORD}".encode()).decode()
        status, page = self.request("GET", "/")
        if status != 200:
            raise RuntimeError(f"GET / answered {status}")
        self.token = re.search(r'name="token" value="([0-9a-f]+)"', page)[1]

    def request(self, method, path, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request(method, path, body=body, headers={"Authorization": self.auth, **(headers or {})})
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        return response.status, text

    def approve(self, post):
        status, text = self.request(
            "POST", f"/posts/{post}/status", f"token={self.token}&status=approved",
            {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json",
             "Origin": f"http://127.0.0.1:{self.port}"})
        if status != 200 or json.loads(text).get("status") != "approved":
            fail(f"approving post {post} answered {status}: {text[:200]}")


def p95(values):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def latency_round(mode, tmp, receiver, args, number):
    folder = os.path.join(tmp, f"latency-{mode}-{number}")
    env, settings = home(folder, [("channel", "telegram", "@bench_channel")], receiver,
                         args.approvals)
    ids = post_ids(settings)
    receiver.reset()
    if mode == "run":
        server, port = start(["run", "--workers", "0"], env, folder, "run")
        publisher = None
    else:
        server, port = start(["serve"], env, folder, "serve")
        publisher, _ = start(["publish", "--forever"], env, folder, "publish --forever")
    latencies = []
    try:
        if port is None:
            return latencies
        editor = Editor(port)
        rng = random.Random(number)
        for post in ids:
            began = time.monotonic()
            editor.approve(post)
            arrived = receiver.wait_for(post, ARRIVAL_TIMEOUT)
            if arrived is None:
                fail(f"{mode}: post {post} did not reach the channel in {ARRIVAL_TIMEOUT} s")
                break
            latencies.append(arrived - began)
            time.sleep(rng.uniform(0, args.gap))
    finally:
        stop(publisher, "publish --forever")
        stop(server, mode)
    twice = [post for post, times in receiver.arrived.items() if len(times) > 1]
    if twice:
        fail(f"{mode}: posts sent twice: {twice[:5]}")
    if receiver.order != ids[:len(receiver.order)]:
        fail(f"{mode}: messages out of approval order")
    return latencies


def vesti_drain(tmp, receiver, args, number):
    """`vesti.py publish` of --queued approved posts to the webhook; posts/s."""
    folder = os.path.join(tmp, f"drain-{number}")
    env, settings = home(folder, [("cms", "webhook", receiver.url + "/hook")], receiver, args.queued)
    _, db = vesti.open_intake(settings)
    ids = post_ids(settings)
    vesti.set_decisions(db.conn(), ids, "approved", "bench")
    receiver.reset()
    began = time.monotonic()
    result = subprocess.run([sys.executable, os.path.join(REPO, "vesti.py"), "publish"], cwd=folder,
                            env=env, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - began
    if result.returncode != 0:
        fail(f"publish: exit code {result.returncode}: {result.stderr[-500:]}")
    if receiver.bad_signatures:
        fail(f"publish: {receiver.bad_signatures} webhooks with a wrong signature")
    if receiver.order != ids:
        fail(f"publish: {len(receiver.order)} of {len(ids)} delivered, "
             f"{'in' if receiver.order == ids[:len(receiver.order)] else 'out of'} order")
    states = dict(db.conn().execute("SELECT state, count(*) FROM publications GROUP BY state").fetchall())
    if states != {"published": len(ids)}:
        fail(f"publish: publications left {states}")
    return len(ids) / seconds


def baseline_drain(receiver, args):
    """The same number of signed webhook POSTs from a plain loop; posts/s."""
    receiver.reset()
    began = time.monotonic()
    for k in range(args.queued):
        body = json.dumps({"id": str(k + 1), "title": f"Kernel news number {k}",
                           "content_text": f"What happened to the kernel, part {k}."}).encode()
        request = urllib.request.Request(receiver.url + "/hook", data=body, method="POST", headers={
            "Content-Type": "application/json", "Idempotency-Key": f"key-{k}",
            "X-Vesti-Signature": "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()})
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
    seconds = time.monotonic() - began
    if len(receiver.order) != args.queued:
        fail("baseline: not every POST arrived")
    return args.queued / seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode (default 3)")
    parser.add_argument("--approvals", type=int, default=40, help="approvals per latency round")
    parser.add_argument("--gap", type=float, default=0.5,
                        help="most seconds between two approvals (random; default 0.5)")
    parser.add_argument("--queued", type=int, default=1000, help="posts drained to the webhook")
    parser.add_argument("--posts", type=int, default=0, help="unused posts besides (default 0)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        print("smoke mode: tiny sizes; the figures show that the benchmark runs, "
              "the PASS/MISS verdicts mean nothing")
        args.rounds, args.approvals, args.gap, args.queued = 1, 1, 0.05, 5
    receiver = Receiver()
    tmp = tempfile.mkdtemp(prefix="vesti-bench-publish-")
    try:
        print(f"1. approve to message, {args.approvals} approvals a round, {args.rounds} rounds "
              f"of each mode, alternating")
        figures = {"run": [], "separate": []}
        for number in range(args.rounds):
            for mode in (("run", "separate") if number % 2 == 0 else ("separate", "run")):
                latencies = latency_round(mode, tmp, receiver, args, number)
                if latencies:
                    figures[mode].append((statistics.median(latencies), p95(latencies),
                                          max(latencies)))
                    print(f"   round {number + 1} {mode:<9} median {statistics.median(latencies):.3f} s"
                          f"  p95 {p95(latencies):.3f} s  max {max(latencies):.3f} s", flush=True)
        for mode, rounds in figures.items():
            if not rounds:
                continue
            medians, p95s = [r[0] for r in rounds], [r[1] for r in rounds]
            verdict = "PASS" if statistics.median(p95s) < P95_TARGET else "MISS"
            print(f"{mode:<9} approve to message: median min {min(medians):.3f} s, median "
                  f"{statistics.median(medians):.3f} s; p95 min {min(p95s):.3f} s, median "
                  f"{statistics.median(p95s):.3f} s  target p95 < {P95_TARGET:.0f} s  {verdict}")
        print(f"\n2. {args.queued} approved posts drained to a webhook by `vesti.py publish`, "
              f"beside a plain loop of the same signed POSTs, alternating")
        ours, plain = [], []
        for number in range(args.rounds):
            for turn in (("vesti", "baseline") if number % 2 == 0 else ("baseline", "vesti")):
                if turn == "vesti":
                    ours.append(vesti_drain(tmp, receiver, args, number))
                else:
                    plain.append(baseline_drain(receiver, args))
                print(f"   round {number + 1} {turn:<8} {(ours if turn == 'vesti' else plain)[-1]:.0f} posts/s",
                      flush=True)
        print(f"webhook throughput: vesti min {min(ours):.0f} median {statistics.median(ours):.0f} posts/s; "
              f"plain loop min {min(plain):.0f} median {statistics.median(plain):.0f} posts/s; "
              f"vesti / plain = {statistics.median(ours) / statistics.median(plain):.2f}")
    finally:
        receiver.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(run(main))
