"""Real servers on loopback addresses that misbehave on purpose: feeds and
articles, a server that drips its answer, a listener that never answers,
clients that drip their requests."""

import contextlib
import gzip
import http.client
import http.server
import select
import socket
import threading
import time
import zlib


class LoopbackServer:
    """A real ThreadingHTTPServer on a loopback address, in a thread."""

    def serve(self, handler, host="127.0.0.1"):
        self.httpd = http.server.ThreadingHTTPServer((host, 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class FeedServer(LoopbackServer):
    """Feeds on a loopback address; each path answers with a
    handler(request) -> (status, headers, body) or does its own writing."""

    def __init__(self, host="127.0.0.1"):
        self.routes, self.requests = {}, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                server.requests.append((self.path, dict(self.headers), time.monotonic()))
                route = server.routes.get(self.path)
                if route is None:
                    return self.answer(404, {}, b"not found")
                result = route(self)
                if result is not None:
                    self.answer(*result)

            def answer(self, status, headers, body):
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.serve(Handler, host)

    def feed(self, path, body, etag='"v1"', modified="Mon, 30 Nov 2026 10:00:00 GMT",
             content_type="application/rss+xml; charset=utf-8", encoding=None):
        """Serve a feed with validators, answering 304 when they match."""
        def handler(request):
            if etag and request.headers.get("If-None-Match") == etag:
                return 304, {"ETag": etag}, b""
            headers = {"Content-Type": content_type}
            if etag:
                headers["ETag"] = etag
            if modified:
                headers["Last-Modified"] = modified
            data = body
            if encoding == "gzip":
                data, headers["Content-Encoding"] = gzip.compress(body), "gzip"
            elif encoding == "deflate":
                data, headers["Content-Encoding"] = zlib.compress(body), "deflate"
            return 200, headers, data
        self.routes[path] = handler

    def status(self, path, code, headers=None, body=b""):
        self.routes[path] = lambda request: (code, headers or {}, body)

    def redirect(self, path, code, target):
        self.status(path, code, {"Location": target})

    def sent(self, path):
        return [headers for p, headers, _ in self.requests if p == path]


class DripServer:
    """A raw TCP server on a loopback address that reads the request, sends a
    status line and the start of a header, then one more header byte every
    `every` seconds: the headers never end. Every loop is bounded: a
    connection drips for `lifetime` seconds at most, accept() gives up after
    `lifetime` too, and close() stops everything at once."""

    def __init__(self, host="127.0.0.1", every=0.2, lifetime=30.0):
        self.every, self.lifetime = every, lifetime
        self.connections = 0
        self.stopped = threading.Event()
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(0.05)
        self.url = f"http://{host}:{self.listener.getsockname()[1]}"
        self.threads = [threading.Thread(target=self.accept, daemon=True)]
        self.threads[0].start()

    def accept(self):
        ends = time.monotonic() + self.lifetime
        while not self.stopped.is_set() and time.monotonic() < ends:
            try:
                conn, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            self.connections += 1
            thread = threading.Thread(target=self.drip, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def drip(self, conn):
        ends = time.monotonic() + self.lifetime
        with conn, contextlib.suppress(OSError):
            conn.settimeout(1)
            conn.recv(65536)                                  # the request
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not self.stopped.wait(self.every) and time.monotonic() < ends:
                conn.sendall(b"x")

    def close(self):
        self.stopped.set()
        for thread in list(self.threads):
            thread.join(2)
        self.listener.close()


class TcpListener:
    """A bare TCP port that only records whether anyone connected."""

    def __init__(self, host="127.0.0.1"):
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.connected = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.accept, daemon=True)
        self.thread.start()

    def accept(self):
        ends = time.monotonic() + 30
        while not self.stopped.is_set() and time.monotonic() < ends:
            try:
                conn, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            self.connected.set()
            conn.close()

    def close(self):
        self.stopped.set()
        self.thread.join(2)
        self.listener.close()


class SlowClients:
    """`count` connections to the page from the loopback addresses `hosts`,
    each sending one byte of an endless header every `every` seconds and
    connecting again as soon as the server drops it, all from one thread."""

    REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "

    def __init__(self, port, hosts, count, every):
        self.port, self.every = port, every
        self.hosts = [hosts[i % len(hosts)] for i in range(count)]
        self.connections = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.attack, daemon=True)
        self.thread.start()

    def connect(self, host):
        sock = socket.socket()
        sock.setblocking(False)                 # a full backlog holds no other client
        try:
            sock.bind((host, 0))
        except OSError:
            sock.close()
            return None
        sock.connect_ex(("127.0.0.1", self.port))
        self.connections += 1
        return sock

    def attack(self):
        socks, sent = [None] * len(self.hosts), [0] * len(self.hosts)
        # The first connections are spread over a second, as clients' are.
        due = [time.monotonic() + i / len(socks) for i in range(len(socks))]
        next_byte = time.monotonic()
        while not self.stopped.is_set():
            waits = [next_byte] + [d for s, d in zip(socks, due) if s is None]
            dropped = select.select([s for s in socks if s is not None], [], [],
                                    max(0, min(waits) - time.monotonic()))[0]
            for i, sock in enumerate(socks):
                if sock is not None and sock in dropped:     # closed or answered: again
                    sock.close()
                    socks[i], sent[i], due[i] = None, 0, 0
                if socks[i] is None and due[i] <= time.monotonic():
                    socks[i] = self.connect(self.hosts[i])
            if time.monotonic() >= next_byte:
                next_byte += self.every
                for i, sock in enumerate(socks):
                    with contextlib.suppress(OSError, AttributeError):
                        sock.send(self.REQUEST[sent[i]:sent[i] + 1] or b"z")
                        sent[i] += 1
        for sock in socks:
            if sock is not None:
                sock.close()

    def close(self):
        self.stopped.set()
        self.thread.join(10)
