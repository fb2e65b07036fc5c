"""Fakes that speak the real wire formats: Ollama's /api/chat, the
Telegram Bot API's JSON (checking HTML as Telegram does), a webhook
receiver, and Telegram channels through Telethon's own types."""

import asyncio
import contextlib
import hashlib
import hmac
import html.parser
import http.client
import http.server
import json
import re
import socket
import threading
import time

from telethon import TelegramClient, errors as tg_errors
from telethon.sessions import MemorySession
from telethon.tl import types as tg

from tests.servers import LoopbackServer


class FakeOllama(LoopbackServer):
    """Speaks Ollama's /api/chat: answers with a verdict, or misbehaves.
    `mode`: "ok", or "500", "garbage", "bad-verdict" or "hang" for every post;
    `fails_on`: answers HTTP 500 for the posts whose text has these words;
    `reason`: the reason each verdict gives;
    `latency`: seconds of thinking before each answer;
    `keep_alive`: keeps connections open as the real one does (HTTP/1.1);
    `drops`: then closes each one after its answer all the same, unsaid."""

    def __init__(self, mode="ok", latency=0.0, keep_alive=False, drops=False, fails_on=None,
                 reason=None):
        self.mode, self.latency, self.requests = mode, latency, []
        self.fails_on, self.reason = fails_on, reason
        self.connections = []       # the client's address of each request
        self.lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"
            disable_nagle_algorithm = keep_alive    # as Ollama (Go) sends

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append((self.path, body))
                    fake.connections.append(self.client_address)
                self.close_connection = drops
                time.sleep(fake.latency)
                status, answer = fake.answer(body)
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.serve(Handler)

    def verdict(self, body):
        verdict = {"direction": "linux", "relevance": 8, "interest": 6,
                   "summary": "Summary: " + body["messages"][-1]["content"].splitlines()[0]}
        if self.reason:
            verdict["reason"] = self.reason
        return verdict

    def answer(self, body):
        if self.fails_on and self.fails_on in body["messages"][-1]["content"]:
            return 500, {"error": "cannot classify this one"}
        if self.mode == "500":
            return 500, {"error": "model crashed"}
        if self.mode == "garbage":
            return 200, b"<html>not json</html>"
        if self.mode == "bad-verdict":
            return 200, {"model": "m", "message": {"role": "assistant",
                                                   "content": '{"direction": "sport"}'}, "done": True}
        if self.mode == "hang":
            time.sleep(5)
        content = json.dumps(self.verdict(body), ensure_ascii=False)
        return 200, {"model": body["model"], "created_at": "2026-11-30T10:00:00Z",
                     "message": {"role": "assistant", "content": content},
                     "done_reason": "stop", "done": True}

    def titles(self):
        with self.lock:
            return [body["messages"][-1]["content"].splitlines()[0] for _, body in self.requests]


class BotHtml(html.parser.HTMLParser):
    """Checks a message's HTML as the Bot API does: only the tags it knows,
    each closed in order, every <, > and & that is not markup escaped (as
    &lt; &gt; &amp; &quot; or a numeric entity); the text as it would show,
    for the 4096 limit (Telegram counts UTF-16 code units)."""
    TAGS = {"b", "strong", "i", "em", "u", "ins", "s", "strike", "del", "a", "code", "pre",
            "tg-spoiler", "span", "blockquote", "tg-emoji"}
    BARE = re.compile(r"&(?!(?:lt|gt|amp|quot|#[0-9]+|#x[0-9a-fA-F]+);)|<|>")
    TAG = re.compile(r'<(/?)([a-z-]+)((?:\s+[a-z-]+="[^"<>]*")*)\s*>')

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.open, self.text, self.problem = [], [], None

    def feed(self, data):
        bare = self.BARE.search(self.TAG.sub("", data))
        if bare:
            self.problem = self.problem or f"unsupported start tag or bare {bare[0]!r}"
        super().feed(data)

    def handle_starttag(self, tag, attrs):
        if tag not in self.TAGS:
            self.problem = self.problem or f"unsupported start tag \"{tag}\""
        self.open.append(tag)

    def handle_endtag(self, tag):
        if not self.open or self.open[-1] != tag:
            self.problem = self.problem or f"unmatched end tag \"{tag}\""
        else:
            self.open.pop()

    def handle_data(self, data):
        self.text.append(data)


class FakeBotApi(LoopbackServer):
    """Speaks the Telegram Bot API as its documentation describes it: POST
    /bot<token>/<method> with a JSON body; answers {"ok": true, "result": …}
    or {"ok": false, "error_code": …, "description": …, "parameters": …}
    with the same HTTP status. `chats`: the chats the bot may post to (any
    other is 400 "chat not found"); `not_member`: chats it was removed from
    (403); `script`: what the next sendMessage calls meet, in turn: "ok",
    ("429", seconds), ("500",) (not posted), ("400", description) (refused),
    ("hang", seconds): the message
    is posted and the answer comes that much later; ("close", seconds): it
    is posted, and the connection closed that much later without an
    answer; ("posted-502", seconds): it is posted and a proxy's 502 page
    comes that much later."""

    TOKEN = "123456789:AAE-test-token_secret"

    def __init__(self, chats=("@vesti_test", "-1001234567890"), not_member=()):
        self.chats, self.not_member = set(chats), set(not_member)
        self.script, self.messages, self.deleted, self.calls = [], [], [], []
        self.next_id = 100
        self.lock = threading.Lock()
        self.posted = threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                token, _, method = self.path.removeprefix("/bot").partition("/")
                status, answer, wait = fake.answer(token, method, body)
                if wait:
                    time.sleep(wait)
                if answer == "close":
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                data = json.dumps(answer).encode() if isinstance(answer, dict) else answer
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

            def log_message(self, *args):
                pass

        self.serve(Handler)

    @staticmethod
    def error(code, description, **parameters):
        answer = {"ok": False, "error_code": code, "description": description}
        if parameters:
            answer["parameters"] = parameters
        return code, answer, 0

    def answer(self, token, method, body):
        with self.lock:
            try:
                payload = json.loads(body)
            except ValueError:
                return self.error(400, "Bad Request: invalid JSON")
            self.calls.append((method, payload, time.time()))
            if token != self.TOKEN:
                return self.error(401, "Unauthorized")
            chat = str(payload.get("chat_id"))
            if chat in self.not_member:
                return self.error(403, "Forbidden: bot is not a member of the channel chat")
            if chat not in self.chats:
                return self.error(400, "Bad Request: chat not found")
            if method == "sendMessage":
                return self.send_message(chat, payload)
            if method == "deleteMessage":
                found = [m for m in self.messages if m["chat"] == chat
                         and m["message_id"] == payload.get("message_id")]
                if not found:
                    return self.error(400, "Bad Request: message to delete not found")
                self.messages.remove(found[0])
                self.deleted.append(found[0])
                return 200, {"ok": True, "result": True}, 0
            return self.error(404, "Not Found")

    def send_message(self, chat, payload):
        step = self.script.pop(0) if self.script else "ok"
        if step[0] == "429":
            return self.error(429, f"Too Many Requests: retry after {step[1]}",
                              retry_after=step[1])
        if step[0] == "500":
            return self.error(500, "Internal Server Error")
        if step[0] == "400":
            return self.error(400, step[1])
        text = payload.get("text") or ""
        parsed = BotHtml()
        if payload.get("parse_mode") == "HTML":
            parsed.feed(text)
            parsed.close()
            if parsed.problem or parsed.open:
                return self.error(400, "Bad Request: can't parse entities: "
                                  + (parsed.problem or f"unclosed tag \"{parsed.open[-1]}\""))
            shown = "".join(parsed.text)
        else:
            shown = text
        if not shown.strip():
            return self.error(400, "Bad Request: message text is empty")
        if len(shown.encode("utf-16-le")) // 2 > 4096:
            return self.error(400, "Bad Request: message is too long")
        self.next_id += 1
        message = {"message_id": self.next_id, "chat": chat, "text": text, "shown": shown,
                   "date": int(time.time()), "at": time.time()}
        self.messages.append(message)
        self.posted.set()
        if step[0] == "close":
            return 200, "close", step[1]
        if step[0] == "posted-502":
            return 502, b"<html><body><h1>502 Bad Gateway</h1></body></html>", step[1]
        result = {"message_id": self.next_id, "date": message["date"],
                  "chat": {"id": -1001234567890, "type": "channel", "title": "VESTI test"},
                  "text": shown}
        return 200, {"ok": True, "result": result}, step[1] if step[0] == "hang" else 0

    def sent(self):
        with self.lock:
            return [m["text"] for m in self.messages + self.deleted]


class WebhookReceiver(LoopbackServer):
    """A webhook's receiving end: checks X-Vesti-Signature with `secret`,
    keeps every delivery (headers, JSON body), and answers in turn what
    `script` says: a status, or ("hang", seconds, status): the delivery is
    kept and the answer comes that much later; 200 once it is used up.
    `received` is set on each delivery."""

    def __init__(self, secret):
        self.secret, self.script, self.deliveries, self.refused = secret, [], [], 0
        self.lock = threading.Lock()
        self.received = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                expected = "sha256=" + hmac.new(receiver.secret.encode(), body,
                                                hashlib.sha256).hexdigest()
                with receiver.lock:
                    if not hmac.compare_digest(self.headers.get("X-Vesti-Signature", ""), expected):
                        receiver.refused += 1
                        status, headers = 401, {}
                    else:
                        receiver.deliveries.append((dict(self.headers), json.loads(body)))
                        status = receiver.script.pop(0) if receiver.script else 200
                        receiver.received.set()
                        headers = {"Retry-After": "1"} if status == 429 else {}
                if isinstance(status, tuple):
                    time.sleep(status[1])
                    status = status[2]
                answer = json.dumps({"received": status == 200}).encode()
                with contextlib.suppress(OSError):
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.serve(Handler)


class FakeTelegram:
    """Telethon's real TelegramClient with only its network layer replaced:
    every request it sends reaches `answer`, which speaks Telegram's TL types
    over fixed channel histories, and is counted by type."""

    def __init__(self, history=(), authorized=True, flood=(), channels=None):
        self.channels = channels if channels is not None else {"linuxnews": list(history)}
        self.authorized = authorized
        self.flood = list(flood)          # FloodWait seconds for the next history requests
        self.flood_on = {}                # username -> seconds, once
        self.hashes = {}                  # username -> access hash Telegram accepts now
        self.drop_connection = 0          # history requests to fail with ConnectionError
        self.requests = []
        self.connects = 0

    @property
    def history(self):
        return self.channels["linuxnews"]

    @history.setter
    def history(self, messages):
        self.channels["linuxnews"] = messages

    def count(self, name):
        return sum(r == name for r in self.requests)

    def __call__(self, settings):
        fake = self

        class Client(TelegramClient):
            async def connect(self):
                fake.connects += 1

            async def disconnect(self):
                pass

            async def is_user_authorized(self):
                return fake.authorized

        client = Client(MemorySession(), 1, "0" * 32, flood_sleep_threshold=0)
        client._sender.send = self.send
        return client

    def send(self, request, ordered=False):
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self.answer(request))
        except BaseException as e:
            future.set_exception(e)
        return future

    def channel_id(self, name):
        return 1000 + sorted(self.channels).index(name)

    def answer(self, request):
        name = type(request).__name__
        self.requests.append(name)
        if name == "ResolveUsernameRequest":
            username = request.username.lower()
            if username not in self.channels:
                raise tg_errors.UsernameNotOccupiedError(request=request)
            cid = self.channel_id(username)
            self.hashes.setdefault(username, cid * 7)
            chat = tg.Channel(id=cid, title=username, photo=tg.ChatPhotoEmpty(), date=None,
                              broadcast=True, access_hash=self.hashes[username],
                              username=username)
            return tg.contacts.ResolvedPeer(peer=tg.PeerChannel(cid), chats=[chat], users=[])
        if name == "GetHistoryRequest":
            if self.drop_connection:
                self.drop_connection -= 1
                raise ConnectionError("Cannot send requests while disconnected")
            username = next(n for n in self.channels if self.channel_id(n) == request.peer.channel_id)
            if self.flood:
                raise tg_errors.FloodWaitError(request=request, capture=self.flood.pop(0))
            if username in self.flood_on:
                raise tg_errors.FloodWaitError(request=request,
                                               capture=self.flood_on.pop(username))
            if request.peer.access_hash != self.hashes.get(username):
                raise tg_errors.ChannelInvalidError(request=request)
            return self.history_page(self.channels[username], request)
        raise AssertionError(f"unexpected request {name}")

    @staticmethod
    def history_page(history, request):
        """messages.getHistory: newest first, from offset_id (exclusive)
        moved by add_offset, at most limit, within min_id and max_id."""
        newest_first = sorted(history, key=lambda m: m.id, reverse=True)
        start = next((i for i, m in enumerate(newest_first) if m.id < request.offset_id),
                     len(newest_first)) if request.offset_id else 0
        start += request.add_offset
        page = newest_first[max(0, start):max(0, start + request.limit)]
        page = [m for m in page if m.id > request.min_id and
                (not request.max_id or m.id < request.max_id)]
        return tg.messages.ChannelMessages(pts=1, count=len(history), messages=page, topics=[],
                                           chats=[], users=[])
