#!/usr/bin/env python3
"""VESTI: a self-hosted news intake.

Collects RSS/Atom feeds and Telegram channels into one queue (SQLite, or
PostgreSQL for workers on several machines), classifies it in parallel with
keywords and a local LLM through Ollama, groups the copies of one story, and
gives editors a desk to pick from, and sends what they approve to the news
channel (Telegram, webhooks). Nothing is published without a person's
approval.

Sections, each building on the ones above it (the names are where to
start reading):

  Errors: what the user got wrong and what failed, then the signals that steer
      the flow.
      VestiError, ConfigError, StorageError; SourceDeferred, StoryPending,
      EarlyReply
  Settings: the environment, .env and flags, read once into one frozen object.
      SETTINGS (every setting, its default and check), Settings, load_settings
  Text, time and URLs: words, hashes, dates and the canonical form of a link.
      normalize_text, text_sha256, words_sha256, canonical_url, channel_name,
      fresh_for
  Processes: what the threads of one process share, stopping, progress.
      Process (stopping, the wake-ups, write locks, claims and turns, the
      log's mask, warn_once), run_until_stopped, Progress
  Connections: SQLite and PostgreSQL connections, transactions, the two
      dialects.
      connect, Connection, transaction, redoable, last_try, SQLiteDialect,
      PostgresDialect, psycopg_placeholders
  Facts and counters: facts between processes (meta) and the counters behind
      /metrics.
      get_meta, set_meta, classification_state, upsert_counts, counters
  Desk counts: the counts behind the desk's filters, their triggers.
      COUNT_TABLES, COUNT_EVENTS, sqlite_count_triggers,
      postgres_count_function
  Schema and migrations: the tables, their upgrades, the search index,
      opening a database.
      SCHEMA, migrate, postgres_schema, migrate_postgres, Database
  Stories: the same news in other words: keys, look-ups, leads, a story's
      verdict for its copies, the key helper.
      story_keys, same_story, adds_to, join_story, enter_stories,
      settle_stories, story_verdict, lead_now, KeyHelper, story_copies
  Queue: posts in, claims, verdicts out: the queue's states and transitions.
      PENDING/PROCESSING/DONE/FAILED, store_posts, claim_posts,
      complete_and_claim, give_back_posts, release_claims (a stop),
      release_post (a failure), expire_leases, wake_story_copies
  Learning: each direction's model of what its editors approve, learned
      from their decisions.
      post_features, Background, Approvals, Model, Learners, learn_decisions,
      count_decisions (a decision in, an undo out), owe_learning, learn_owed,
      rebuild_learning, rescore_direction, judge_cards, take_in_missed,
      Rescorer (the cards judged again after decisions)
  Records: runs, health, feed and channel state.
      start_run, record_success, record_failure, note_rhythm, save_rss_state;
      next_rhythm and failed_fetch decide from the record alone
  Editors: the newsroom's accounts and roles, their sessions, the record of
      who did what.
      ROLES, password_hash, add_user, change_user, start_session, session_of,
      record_event, note_look, lookers
  Publications: the outbox: approved posts queued for each publish target,
      their messages, the states of a publication and the one function of
      each transition, an editor's actions.
      message_html, post_message, digest_html, queue_publications,
      compose_texts, withdraw_publications, claim_publications,
      deliver_publication, retry_publication, fail_publication,
      doubt_publication, act_on_publication, outbox_trouble
  Decisions and reads: a source's edit that takes a decision back, the
      editor's decisions, what pages and commands read, the classifier's
      report card, copying a database.
      update_edited_post, reword_post, set_decisions, check_decisions,
      wording, decided_posts, source_health, quality_report,
      editor_agreement, copy_database
  Sources: sources.yaml: directions, sources, checks, syncing them into the
      database.
      read_yaml, load_registry (directions, sources, publish targets),
      sync_sources, sync_targets, select_sources
  Fetching: HTTP GET with deadlines, redirects, the network policy, pace per
      host.
      http_get, fetch_once, HostGate, Policy, connect_to, read_body
  RSS: reading feeds (feedparser and a plain reader) and crawling them.
      parse_feed, read_plain_feed, fetch_feed, crawl_feed, crawl_rss
  Telegram: reading channels through Telethon and crawling them.
      telegram_client, message_draft, ChannelReader, crawl_channel,
      crawl_telegram, telegram_login
  Crawling: every source of a selection crawled once.
      crawl_everything
  Classification: keywords, Ollama's answers, articles' full text.
      KeywordIndex, keyword_verdict, ask_ollama, parse_verdict, classify_text,
      fetch_full_text
  Worker: the pool of workers: what to classify how, claims, completions.
      ClassifyStep, Classifier, WorkerPool, Worker, run_workers
  Publishing: sending the outbox: the Bot API, webhooks, one sender per
      target, alerts.
      bot_api, post_webhook, failed_send and failed_deletion (decided from
      the failure alone), queue_alerts, Publisher (look, take, serve, send,
      record_failure, delete)
  Page assets: the style, the words of each language, the pages' scripts.
      STYLE, STRINGS, Page, phrase, DESK_SCRIPT, OUTBOX_SCRIPT
  Web pages: what every page shares, the crawlers page.
      esc, layout, banners, crawlers_page
  Desk page: the editor's desk and its JSON.
      DeskQuery, floor_clause, desk_posts, card_html, question_card,
      desk_answer, desk_page
  Report card page: /quality.
      quality_section, calibration_figure, quality_page
  Outbox page: /outbox.
      outbox_section, publication_row, outbox_page
  Users and sign-in pages: /users and /login.
      users_page, login_form
  Exports and metrics: Atom, JSON Feed, CSV and /metrics.
      atom_feed, json_feed, csv_export, metrics_text
  HTTP front: one thread reads requests whole, a pool answers them; nothing
      of VESTI in it.
      WebConnection, WaitingConnections, WebWorkers, WebHandler, WebServer,
      make_web_server
  Web server: sign-in (Basic auth and sessions), the routes and the roles
      they need.
      Account, WebApp (the routes, check_login, check_forgery and
      same_origin against cross-site forgery), announce_web
  Scheduler: run: crawls on their schedule beside the workers and the page.
      Scheduler, next_slot
  OPML and discovery: importing and exporting OPML, finding a site's feeds.
      read_opml, import_opml, opml_document, discover_feeds
  Command line: the commands, their arguments, how they stop (SIGTERM) and
  say where their threads are (SIGUSR1), main().
      build_parser, main, cmd_run, cmd_worker, cmd_status, cmd_learn,
      cmd_quality, cmd_publish, cmd_user, stop_on_signals, tell_stacks_on_sigusr1
"""

__version__ = "0.1.0"

__all__ = [
    "Settings", "load_settings", "VestiError", "ConfigError", "FetchError",
    "ClassifyError", "Database", "SCHEMA", "load_registry", "sync_sources",
    "canonical_url", "normalize_text", "text_sha256", "store_posts",
    "queue_sizes", "HostGate", "http_get", "parse_feed", "crawl_rss",
    "claim_post", "complete_post", "release_post", "expire_leases", "Verdict",
    "classify_text", "ClassifyStep", "run_workers", "main",
]

import argparse
import base64
import calendar
import codecs
import collections
import contextlib
import csv
import dataclasses
import datetime
import email.utils
import errno
import faulthandler
import functools
import getpass
import hashlib
import heapq
import hmac
import html
import html.entities
import html.parser
import http.client
import http.cookies
import http.server
import io
import ipaddress
import itertools
import json
import logging
import math
import operator
import os
import queue
import re
import secrets
import selectors
import signal
import socket
import sqlite3
import ssl
import struct
import subprocess
import sys
import textwrap
import threading
import time
import typing
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ElementTree
import zlib
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

log = logging.getLogger("vesti")


###############################################################################
# Errors ######################################################################
###############################################################################
# What the user got wrong and what failed, then the signals that steer the flow.

class VestiError(Exception):
    """Base of every error VESTI raises on purpose."""


class ConfigError(VestiError):
    """The user's configuration is wrong: one line, exit code 2."""


class FetchError(VestiError):
    """An HTTP fetch failed; the message is what the source page shows."""


class SourceGone(FetchError):
    """410 Gone: the source is dead at once."""


class RefusedDestination(FetchError):
    """A link or redirect the network policy does not allow (scheme or address)."""


class FeedError(VestiError):
    """A body that is not a usable feed."""


class ClassifyError(VestiError):
    """Classification of one post failed."""


class OllamaUnreachable(ClassifyError):
    """No connection to Ollama at all (as opposed to a bad answer)."""


class TelegramSetupError(VestiError):
    """Telegram cannot be used at all: credentials, session or package missing."""


class TelegramFlood(VestiError):
    """A FloodWait longer than FLOOD_WAIT_MAX: the account must wait."""

    def __init__(self, seconds):
        super().__init__(f"Telegram FloodWait of {seconds} s")
        self.seconds = seconds


class TelegramDisconnected(VestiError):
    """The connection to Telegram is gone and did not come back."""


class StorageError(VestiError):
    """The database cannot be used (disk full, a corrupt file, an I/O error):
    not a source's fault; the command ends with exit code 1."""


class MissingPackage(VestiError):
    """An optional package a feature needs is not installed."""

    def __init__(self, package, feature):
        super().__init__(f"{feature} needs the '{package}' package: pip install {package}")


# Signals: exceptions that steer the flow (a wait, an early answer, a
# post put back), caught where they are expected, never shown as failures.

class SourceDeferred(FetchError):
    """429/503 with Retry-After: try again later, not counted as an error."""

    def __init__(self, message, seconds):
        super().__init__(message)
        self.seconds = seconds


class HostBusy(FetchError):
    """The host is busy with another request for longer than one request may take."""


class DeadlinePassed(TimeoutError):
    """The whole-request deadline passed while reading."""


class StoryPending(VestiError):
    """The post's story has no verdict yet: the post waits for it."""

    def __init__(self, story):
        super().__init__(f"waiting for the verdict of its story (post {story})")
        self.story = story


class NotAsked(VestiError):
    """A question waiting in line behind one that could not reach Ollama
    is not asked: its post goes back to the queue, its attempt uncounted."""


class HelperGone(VestiError):
    """The helper process that works out story keys has stopped: the worker
    works them out itself from then on."""


class TransactionUndone(VestiError):
    """The database server undid a transaction midway: it restarted, or a
    row stayed locked by another session past the busy timeout. The work is
    done again once the server can take it (see `redoable`); `episode` is
    the wait it belongs to."""

    def __init__(self, message, episode):
        super().__init__(message)
        self.episode = episode


class Reworded(VestiError):
    """A decision names words its post no longer has: the post was edited
    after the page that showed them was loaded (see wording)."""

    def __init__(self, post_id):
        super().__init__(f"post {post_id} changed since the decision's page was loaded")
        self.post_id = post_id


class SendFailed(VestiError):
    """A call that did not go through as asked: `pause` seconds for the
    whole target (429: not done, not counted as a failure); `retry`: not
    done, worth trying again (it never reached the receiver, or the receiver
    said so); `unsure`: it went out but no answer says what became of it (a
    timeout, a closed connection, a 5xx), so it may have been done; none of
    them: refused, not done."""

    def __init__(self, message, retry=False, pause=None, unsure=False):
        super().__init__(message)
        self.retry, self.pause, self.unsure = retry, pause, unsure


class Redecided(VestiError):
    """A decision made on a page that showed another decision than the
    post has now: someone decided it meanwhile (see check_decisions)."""

    def __init__(self, post_id, status, by, at):
        who = f" by {by}" if by else ""
        when = f" at {at} UTC" if at else ""
        super().__init__(f"post {post_id} was set to {status}{who}{when} since your page "
                         f"was loaded; reload to see it")
        self.post_id, self.status, self.by, self.at = post_id, status, by, at


class SignInLocked(VestiError):
    """A sign-in refused before its password was looked at: the name or the
    address (`kind`) gave too many wrong passwords lately, until `until`."""

    def __init__(self, kind, until):
        super().__init__(f"too many wrong passwords for this {kind}")
        self.kind, self.until = kind, until


class Conflict(VestiError):
    """An editor's action meets a state someone else (or a sender) changed
    since the page was loaded: nothing is done, the page says so (409)."""


class EarlyReply(Exception):
    """A web handler's early answer (an error status, a redirect): raised by
    abort() and turned into the reply, so a handler never replies and then
    returns a signal to its caller."""

    def __init__(self, status, text, headers=None, page=False):
        super().__init__(f"HTTP {status}: {text[:200]}")
        self.status, self.text, self.headers, self.page = status, text, headers, page


class NotPlain(Exception):
    """The fast path declines a feed: feedparser reads it."""


###############################################################################
# Settings ####################################################################
###############################################################################
# The environment, .env and flags, read once into one frozen object.

DEFAULT_USER_AGENT = f"VESTI/{__version__} (self-hosted news intake)"


def _number(kind, most=None):
    what = "a whole number" if kind is int else "a number"

    def parse(name, raw):
        try:
            value = kind(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected {what}, got {raw!r}") from None
        if not math.isfinite(value):
            raise ConfigError(f"{name}: expected a finite number, got {raw!r}")
        if most is not None and value > most:
            raise ConfigError(f"{name}: must be at most {most}, got {raw!r}")
        if value < 0:
            raise ConfigError(f"{name}: must not be negative, got {raw!r}")
        return value
    return parse


def _positive(kind, most=None):
    number = _number(kind, most)

    def parse(name, raw):
        value = number(name, raw)
        if not value:
            raise ConfigError(f"{name}: must be greater than 0, got {raw!r}")
        return value
    return parse


def _text(name, raw):
    return raw


def _required(name, raw):
    if not raw.strip():
        raise ConfigError(f"{name}: must not be empty")
    return raw


# A libpq key=value connection string ("host=db password=…"): not read, and
# never shown, since it may hold a password.
CONNINFO = re.compile(r"(?:^|\s)(?:host|hostaddr|port|dbname|user|password|passfile|service|"
                      r"sslmode|options|connect_timeout)\s*=")


def _database(name, raw):
    """A SQLite file, or a PostgreSQL URL (its scheme in any case, as URLs
    allow, kept in lower case). Anything else naming a server is refused
    without its password: it would be taken for a file's name."""
    raw = _required(name, raw)
    if raw == ":memory:":
        raise ConfigError(f"{name}: ':memory:' cannot hold the database: each connection of "
                          f"the process (every thread, the page, the workers) would open "
                          f"another, empty one; name a file or a postgresql:// URL")
    scheme, sep, rest = raw.partition("://")
    if sep and scheme.lower() in ("postgresql", "postgres"):
        return f"{scheme.lower()}://{rest}"
    if sep:
        raise ConfigError(f"{name}: a {scheme[:20]}:// URL is not a database VESTI "
                          f"opens; name a SQLite file or a postgresql:// URL")
    if CONNINFO.search(raw):
        raise ConfigError(f"{name}: a key=value connection string is not read (not shown "
                          f"here: it may hold a password); write it as a postgresql:// URL")
    return raw


def _flag(name, raw):
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected 0 or 1, got {raw!r}")


def _choice(*choices):
    def parse(name, raw):
        value = raw.strip().lower()
        if value not in choices:
            raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {raw!r}")
        return value
    return parse


def _user(name, raw):
    if not raw or ":" in raw:
        raise ConfigError(f"{name}: must be a non-empty name without ':' (Basic auth "
                          f"cannot carry one), got {raw!r}")
    return raw


def _url(name, raw):
    raw = raw.strip().rstrip("/")
    try:
        parts = urllib.parse.urlsplit(raw)
        parts.port
    except ValueError as e:
        raise ConfigError(f"{name}: not a valid URL ({e}), got {raw!r}") from None
    if raw and (parts.scheme not in ("http", "https") or not parts.hostname):
        raise ConfigError(f"{name}: expected an http:// or https:// URL, got {raw!r}")
    return raw


def _durations(name, raw):
    """'15m,1h,6h' -> (900, 3600, 21600): crawl intervals by priority."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    values = []
    for part in raw.split(","):
        match = re.fullmatch(r"\s*(\d{1,6}(?:\.\d{1,6})?)\s*([smhd]?)\s*", part)
        if not match:
            raise ConfigError(f"{name}: expected durations like 15m,1h,6h, got {raw!r}")
        seconds = float(match[1]) * units[match[2] or "s"]
        if not 1 <= seconds <= 30 * DAY:
            raise ConfigError(f"{name}: each interval must be 1 s to 30 days, got {raw!r}")
        values.append(seconds)
    return tuple(values)


DAY = 86400
HOUR = 3600

# (environment name, Settings field, parser, default). Every number has a
# ceiling: a value past it is a typo, and 1e308 seconds would overflow a clock.
SETTINGS = [
    ("VESTI_DB", "db", _database, "vesti.db"),
    ("VESTI_SOURCES", "sources", _required, "sources.yaml"),
    ("RSS_USER_AGENT", "user_agent", _required, DEFAULT_USER_AGENT),
    ("RSS_TIMEOUT", "timeout", _positive(float, HOUR), "20"),
    ("RSS_MAX_BYTES", "max_bytes", _positive(int, 1 << 30), "10485760"),
    ("RSS_MAX_ENTRIES", "max_entries", _positive(int, 100000), "200"),
    ("RSS_DEAD_AFTER", "dead_after", _positive(int, 10000), "5"),
    ("RSS_HOST_DELAY", "host_delay", _number(float, HOUR), "1.0"),
    ("RSS_CONCURRENCY", "concurrency", _positive(int, 512), "8"),
    ("OLLAMA_URL", "ollama_url", _url, "http://127.0.0.1:11434"),
    ("OLLAMA_MODEL", "ollama_model", _text, "qwen2.5:7b"),
    ("OLLAMA_TIMEOUT", "ollama_timeout", _positive(float, DAY), "120"),
    ("VESTI_WORKERS", "workers", _positive(int, 512), "4"),
    ("VESTI_LEASE_SECONDS", "lease_seconds", _positive(float, 30 * DAY), "900"),
    ("VESTI_MAX_ATTEMPTS", "max_attempts", _positive(int, 1000), "5"),
    ("VESTI_RETRY_DELAY", "retry_delay", _number(float, DAY), "60"),
    ("VESTI_CRAWL_EVERY", "crawl_every", _durations, "15m,1h,6h"),
    ("VESTI_STOP_GRACE", "stop_grace", _number(float, HOUR), "5"),
    ("VESTI_BUSY_TIMEOUT", "busy_timeout", _positive(float, HOUR), "30"),
    ("VESTI_ALLOW_PRIVATE_NETWORKS", "allow_private", _flag, "0"),
    ("VESTI_WEB_HOST", "web_host", _required, "127.0.0.1"),
    ("VESTI_WEB_PORT", "web_port", _number(int, most=65535), "8080"),
    ("VESTI_WEB_USER", "web_user", _user, "admin"),
    ("VESTI_WEB_PASSWORD", "web_password", _text, ""),
    ("TG_API_ID", "tg_api_id", _text, ""),
    ("TG_API_HASH", "tg_api_hash", _text, ""),
    ("TG_SESSION", "tg_session", _required, "vesti.session"),
    ("VESTI_TG_EDIT_HOURS", "tg_edit_hours", _number(float, 30 * 24), "24"),
    ("VESTI_MIN_RELEVANCE", "min_relevance", _number(int, 10), "3"),
    ("VESTI_LANG", "lang", _choice("auto", "en", "ru"), "auto"),
    ("VESTI_STORY_HOURS", "story_hours", _number(float, 30 * 24), "72"),
    ("VESTI_LEARN_MIN", "learn_min", _positive(int, 1_000_000), "30"),
    ("TG_BOT_TOKEN", "tg_bot_token", _text, ""),
    ("TG_BOT_API", "tg_bot_api", _url, "https://api.telegram.org"),
    ("VESTI_WEBHOOK_SECRET", "webhook_secret", _text, ""),
    ("VESTI_PUBLISH_ATTEMPTS", "publish_attempts", _positive(int, 1000), "5"),
    ("VESTI_PUBLIC_URL", "public_url", _url, ""),
    ("VESTI_SESSION_HOURS", "session_hours", _positive(float, 24 * 365), "12"),
]


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every setting of the program, built once and passed down."""
    db: str
    sources: str
    user_agent: str
    timeout: float
    max_bytes: int
    max_entries: int
    dead_after: int
    host_delay: float
    concurrency: int
    ollama_url: str
    ollama_model: str
    ollama_timeout: float
    workers: int
    lease_seconds: float
    max_attempts: int
    retry_delay: float
    crawl_every: tuple
    stop_grace: float
    busy_timeout: float
    allow_private: bool
    web_host: str
    web_port: int
    web_user: str
    web_password: str
    tg_api_id: str
    tg_api_hash: str
    tg_session: str
    tg_edit_hours: float
    min_relevance: int
    lang: str
    story_hours: float
    learn_min: int
    tg_bot_token: str
    tg_bot_api: str
    webhook_secret: str
    publish_attempts: int
    public_url: str
    session_hours: float

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def read_env_file(path):
    """KEY=VALUE lines of a .env file; comments (whole-line, or after a space
    in an unquoted value), blanks and 'export ' allowed."""
    values = {}
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return values
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "\x00" in line:
            raise ConfigError(f"{path}:{number}: a NUL byte, which no setting can hold "
                              f"(is the file text?)")
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        else:
            value = re.split(r"\s+#", value, maxsplit=1)[0]
        values[key.strip()] = value
    return values


def warn_unknown_settings(values, where):
    """A misspelt setting would silently keep its default: say so."""
    known = {name for name, *_ in SETTINGS}
    for key in values:
        if key.startswith(("VESTI_", "RSS_", "OLLAMA_", "TG_")) and key not in known:
            log.warning("%s: unknown setting %s (known: see .env.example)", where, key)


def load_settings(environ=None, env_file=".env", **overrides):
    """Settings from the environment, then `.env` (the environment wins);
    `overrides` (the command line's --db and --sources) win over both, and
    are checked as the settings they replace are."""
    environ = os.environ if environ is None else environ
    from_file = read_env_file(env_file) if env_file else {}
    warn_unknown_settings(from_file, env_file)
    merged = {**from_file, **environ}
    values = {}
    for name, field, parse, default in SETTINGS:
        if overrides.get(field) is not None:
            values[field] = parse(f"--{field}", str(overrides[field]))
        else:
            values[field] = parse(name, merged.get(name, default))
    return Settings(**values)


###############################################################################
# Text, time and URLs #########################################################
###############################################################################
# Words, hashes, dates and the canonical form of a link.

def digits_only(text):
    """Whether a number in a header, a form or a command's argument is one:
    ASCII digits only (str.isdigit says yes to '²', which int() refuses)."""
    return text.isascii() and text.isdigit()


def utc_text(timestamp=None):
    """UTC time as SQLite's datetime('now') writes it."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(timestamp))


def not_before(timestamp):
    """utc_text of a time nothing may happen before (a pause a 429 asked
    for): rounded up to the second, never down."""
    return utc_text(math.ceil(timestamp))


def iso_time(stamp):
    """'2026-11-30 10:00:00' (UTC) -> '2026-11-30T10:00:00Z'."""
    return (stamp or "1970-01-01 00:00:00").replace(" ", "T") + "Z"


def parse_utc(text):
    """Seconds since the epoch of a utc_text; None for anything else."""
    try:
        return calendar.timegm(time.strptime(text, "%Y-%m-%d %H:%M:%S"))
    except (TypeError, ValueError):
        return None


def duration_text(seconds):
    """'45 min', '5 h', '3 d': how long, roughly."""
    seconds = max(0, int(seconds or 0))
    if seconds < 2 * 3600:
        return f"{seconds // 60} min"
    if seconds < 2 * 86400:
        return f"{seconds // 3600} h"
    return f"{seconds // 86400} d"


# Characters of a secret in a row that, found anywhere, are taken for an
# echo of it: an answer may quote a token cut, or in another case.
ECHOED_RUN = 8


def masked(text, *secrets_):
    """`text` with every secret in it replaced by ***, however it was
    echoed: whole, in another case, or cut (any ECHOED_RUN characters of it
    in a row)."""
    for secret in sorted((s for s in secrets_ if s and len(s) >= 4), key=len, reverse=True):
        if len(secret) < ECHOED_RUN or len(text.lower()) != len(text):
            text = re.sub(re.escape(secret), "***", text, flags=re.I)
            continue
        text = "".join(masked_runs(text, secret.lower()))
    return text


def masked_runs(text, secret):
    """The pieces of `text`, each longest run of `secret` (lower case) in
    it that is at least ECHOED_RUN long replaced by ***."""
    runs = {secret[i:i + ECHOED_RUN] for i in range(len(secret) - ECHOED_RUN + 1)}
    lowered, start, i = text.lower(), 0, 0
    while i <= len(text) - ECHOED_RUN:
        if lowered[i:i + ECHOED_RUN] not in runs:
            i += 1
            continue
        end = i + ECHOED_RUN
        while end < len(text) and lowered[i:end + 1] in secret:
            end += 1
        yield text[start:i] + "***"
        start = i = end
    yield text[start:]


def webhook_secrets(url):
    """What of a webhook's address is its receiver's secret: the path and
    query (Slack's /services/T0/B0/XXXX), and any user part."""
    parts = urllib.parse.urlsplit(url or "")
    secret = parts.path.strip("/") + (f"?{parts.query}" if parts.query else "")
    return [part for part in (secret, parts.password, parts.username) if part and len(part) >= 6]


class SecretMask(logging.Filter):
    """Takes every secret the process was told of (a token, a password, a
    webhook's path) out of every log line, its traceback included."""

    def __init__(self):
        super().__init__()
        self.secrets = frozenset()

    def keep_out(self, *secrets_):
        self.secrets |= {secret for secret in secrets_ if secret and len(secret) >= 4}

    def filter(self, record):
        if not self.secrets:
            return True
        message = record.getMessage()
        cleaned = masked(message, *self.secrets)
        if cleaned != message:
            record.msg, record.args = cleaned, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = masked(logging.Formatter().formatException(record.exc_info),
                                     *self.secrets)
        return True




def normalize_text(text):
    return " ".join((text or "").split())


# The controls that turn the direction of the text after them (embeddings,
# overrides, isolates): a feed's title "photo \u202egnp.exe" reads as
# "photo exe.png". Text of either direction reads right without them.
BIDI_CONTROLS = dict.fromkeys([*range(0x202A, 0x202F), *range(0x2066, 0x206A)])


def without_bidi_controls(text):
    """The text with no control that turns its direction (see BIDI_CONTROLS)."""
    return text.translate(BIDI_CONTROLS) if text else text


BIDI_CONTROL = re.compile("[\u202a-\u202e\u2066-\u2069]")


def link_without_bidi_controls(url):
    """A link whose controls that turn the direction are percent-encoded: it
    leads where it led, and reads as it is ("…/photo\u202egnp.exe" would
    read "…/photoexe.png" in a message)."""
    return BIDI_CONTROL.sub(lambda m: urllib.parse.quote(m[0]), url) if url else url


def plain_address(text):
    """An IP address as one client is known by: an IPv4 one seen through
    IPv6 (::ffff:203.0.113.5) as itself; None for anything else, an IPv6
    zone (fe80::1%eth0) too, which may carry any text."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if "%" in text:
        return None
    return address.ipv4_mapped if address.version == 6 and address.ipv4_mapped else address


def user_key(name):
    """A user name as sign-in compares it: "Anna", "anna" and "ＡＮＮＡ" are
    one name."""
    return unicodedata.normalize("NFKC", name or "").casefold()


# Shorter than this, a text ("Read more…", an empty caption) cannot tell two
# articles apart, so such posts are identified by URL alone.
MIN_IDENTIFYING_TEXT = 40


def text_sha256(text):
    """sha256 of the normalized text, or None for texts too short to identify."""
    text = normalize_text(text)
    if len(text) < MIN_IDENTIFYING_TEXT:
        return None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def content_digest(title, text):
    """A short hash of what an entry says, to tell entries apart."""
    return hashlib.sha256(f"{title}\n{text}".encode("utf-8")).hexdigest()[:16]


def shorten(text, limit):
    """At most `limit` characters: a text cut ends in "…"."""
    text = text or ""
    if len(text) <= limit:
        return text
    return text[: limit - 1] + "…" if limit > 0 else ""


class _TextExtractor(html.parser.HTMLParser):
    BLOCKS = {"p", "br", "div", "li", "h1", "h2", "h3", "h4", "h5", "h6",
              "blockquote", "pre", "tr", "section", "article", "figure"}
    SKIP = {"script", "style", "noscript", "template"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skipping = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skipping = max(0, self.skipping - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)


def html_to_text(markup):
    """Readable plain text from an HTML fragment: paragraphs kept, tags gone."""
    if "<" not in (markup or "") and "&" not in (markup or ""):
        return (markup or "").strip()
    extractor = _TextExtractor()
    extractor.feed(markup)
    extractor.close()
    lines = (" ".join(line.split()) for line in "".join(extractor.parts).split("\n"))
    return "\n".join(line for line in lines if line)


def meaningful_words(text):
    return re.findall(r"\w+", (text or "").casefold())


def words_sha256(text, link=None):
    """sha256 of what a message says: its words (a comma or spacing changes
    nothing) and the link of a teaser, which is classified on its article."""
    said = " ".join(meaningful_words(text)) + (f"\n{link}" if link else "")
    return hashlib.sha256(said.encode("utf-8")).hexdigest()


WEB_SCHEMES = ("http", "https")
DEFAULT_PORTS = {"http": 80, "https": 443}


def http_time(value):
    """Seconds since the epoch of an HTTP date; None if unreadable."""
    try:
        when = email.utils.parsedate_to_datetime((value or "").strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def fresh_for(headers, now=None):
    """Seconds the server says its answer stays fresh: Cache-Control max-age,
    else Expires against the server's own Date. None when it says nothing or
    asks to be asked every time; an unreadable Expires ("0") means stale."""
    cache = (headers.get("cache-control") or "").lower()
    age = re.search(r"(?:^|[,\s])max-age\s*=\s*\"?(\d{1,9})", cache)
    if age:
        return int(age[1])
    if "no-cache" in cache or "no-store" in cache or not headers.get("expires"):
        return None
    expires = http_time(headers["expires"])
    if expires is None:
        return None
    date = http_time(headers.get("date")) or (time.time() if now is None else now)
    return max(0, int(expires - date))


TRACKING_PARAMS = frozenset("""
    fbclid gclid gclsrc dclid gbraid wbraid yclid ysclid msclkid twclid ttclid igshid
    mc_cid mc_eid mkt_tok _openstat _hsenc _hsmi __hssc __hstc __hsfp hsctatracking
    fb_action_ids fb_action_types fb_source fb_ref action_object_map action_type_map
    action_ref_map gs_l oly_anon_id oly_enc_id vero_id vero_conv wickedid rb_clickid
    s_cid ncid cmpid clickid ito spm scid _ga _gl zanpid ml_subscriber ml_subscriber_hash
    """.split())
TRACKING_PREFIXES = ("utm_", "ga_", "hmb_", "mtm_", "pk_", "itm_", "stm_", "wt_", "ns_")
# Parameters that are tracking only with such a value (Medium's ?source=rss-…).
TRACKING_VALUES = {"source": "rss", "ref": "rss", "feature": "youtube_gdata"}


def is_tracking_param(pair):
    name, _, value = urllib.parse.unquote_plus(pair).partition("=")
    name = name.lower()
    if name in TRACKING_VALUES:
        return value.lower().startswith(TRACKING_VALUES[name])
    return name in TRACKING_PARAMS or name.startswith(TRACKING_PREFIXES)


def canonical_url(url, base=None, keep_fragment=False):
    """The URL that identifies an article: scheme and host lowercased, default
    port, tracking parameters and (unless asked) the fragment dropped, relative
    links resolved against `base`. Kept parameters keep their order and
    spelling: what remains is still the link an editor clicks."""
    return canonical_urls(url, base)[keep_fragment]


def canonical_urls(url, base=None):
    """canonical_url without and with the fragment, worked out once."""
    url = link_without_bidi_controls((url or "").strip())
    if base:
        url = urllib.parse.urljoin(base, url)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return url, url
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").rstrip(".")
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None or DEFAULT_PORTS.get(scheme) == port else f"{host}:{port}"
    userinfo = parts.netloc.rpartition("@")[0]
    if userinfo:
        netloc = f"{userinfo}@{netloc}"
    path = parts.path or ("/" if netloc else "")
    query = "&".join(pair for pair in parts.query.split("&")
                     if pair and not is_tracking_param(pair))
    bare = urllib.parse.urlunsplit((scheme, netloc, path, query, ""))
    return bare, urllib.parse.urlunsplit((scheme, netloc, path, query, parts.fragment))


CHANNEL_LINK = re.compile(
    r"(?:(?:https?://)?(?:www\.)?(?:t|telegram)\.me/(?:s/)?|tg://resolve\?domain=|@)?"
    r"(?P<name>[A-Za-z][A-Za-z0-9_]{3,31})(?:[/?#].*)?", re.IGNORECASE)


def channel_name(url):
    """'https://t.me/durov', 't.me/s/durov', 'tg://resolve?domain=durov',
    '@durov' or 'durov' -> 'durov'; None for anything else (invite links)."""
    match = CHANNEL_LINK.fullmatch(url.strip())
    if not match or match["name"].lower() in ("joinchat", "addlist", "share"):
        return None
    return match["name"]


###############################################################################
# Processes ###################################################################
###############################################################################
# What the threads of one process share, stopping, progress.

class WaitEpisode:
    """One warning while the database cannot be used for a while (locked
    past the busy timeout by a backup or a long manual UPDATE; a database
    server restarting), however many threads wait; a note when it is back.
    Threads that find out later (each connection learns of a restart on its
    next statement) belong to the same episode for EPISODE_GAP seconds."""
    EPISODE_GAP = 60

    def __init__(self, waiting, back):
        self.messages = waiting, back
        self.lock = threading.Lock()
        self.waiting = 0
        self.since = self.ended = None

    def enter(self, path):
        with self.lock:
            self.waiting += 1
            if self.since is None:
                self.since = time.monotonic()
                if self.ended is None or self.since - self.ended > self.EPISODE_GAP:
                    log.warning(self.messages[0], path)

    def leave(self, path):
        with self.lock:
            self.waiting -= 1
            if self.waiting == 0 and self.since is not None:
                self.ended = time.monotonic()
                if self.ended - self.since > 1:
                    log.info(self.messages[1], path, self.ended - self.since)
                self.since = None


class Process:
    """What the threads of one process share, all of it here: its stop, the
    wake-ups between its parts, its write locks, the claims and turns under
    way, what it has warned of, the waits for the database, and what must
    run one at a time. Settings are not among it: they are another object
    passed down. `main` makes one and passes it down, to each Database,
    which gives it to its connections; a Database made without one (a
    tool's, a test's) makes its own."""

    def __init__(self):
        # Set when the process is told to stop: a locked database is then no
        # longer waited for (the work is being put down anyway).
        self.stopping = threading.Event()
        # Set when something is queued for publication, so that a publisher
        # in this process sends it at once instead of on its next look.
        self.publish_wake = threading.Event()
        # Set when a crawl of this process queued new posts (`run`), so that
        # its idle workers take them at once instead of a second later
        # (WorkerPool.idle).
        self.posts_queued = threading.Event()
        # One lock per database file for the threads of this process: they
        # queue for the write lock here, woken the moment it is free, instead
        # of in SQLite, whose busy handler sleeps and polls.
        self.write_locks, self.write_locks_lock = {}, threading.Lock()
        # Claim tokens are told apart within the process by this counter.
        self.claims = itertools.count()
        # The claim tokens of complete_and_claim calls under way: one seen
        # again is being done again (see redoable); its threads begin and end
        # them side by side (begin_turn, end_turn).
        self.turns_begun, self.turns_lock = set(), threading.Lock()
        # A missing optional package is warned about once per process, not
        # once per thread or post (warn_once).
        self.warned, self.warned_lock = set(), threading.Lock()
        self.busy = WaitEpisode("%s: the database is locked by another process; waiting "
                                "for it (nothing is lost meanwhile)",
                                "%s: the database is free again after %.0f s")
        self.unreachable = WaitEpisode("%s: the database server cannot be reached; waiting "
                                       "for it (nothing is lost meanwhile)",
                                       "%s: the database server is back after %.0f s")
        # Each thread keeps its connection to Ollama open from one question
        # to the next, as Ollama keeps it open: no connection set-up (or TLS
        # handshake) per post (ollama_connection).
        self.ollama_lines = threading.local()
        # trafilatura shares parsing state between calls: two extractions at
        # once in one process now and then end it with SIGSEGV or SIGABRT
        # (adbar/trafilatura issues 840 and 925). Extraction holds the GIL
        # nearly all along anyway, so one at a time costs the workers next to
        # nothing; the fetches stay parallel.
        self.extracting = threading.Lock()
        # The mask of the process's log lines: configure_logging puts it on
        # every handler; the settings and the publish targets tell it their
        # secrets.
        self.log_mask = SecretMask()

    # scrypt's cost for a password this process keeps: one of OWASP's
    # equivalent settings (N=2**14, r=8, p=5: 16 MB, about a tenth of a
    # second here), paid once per password a client presents: a password
    # that matched is remembered. A hash names its cost, so any checks.
    password_cost = {"n": 2 ** 14, "r": 8, "p": 5}

    def write_lock(self, path):
        with self.write_locks_lock:
            return self.write_locks.setdefault(path, threading.RLock())

    def claim_token(self):
        """Unique to a claim: the process, the thread and a counter."""
        return f"{os.getpid()}-{threading.get_ident()}-{next(self.claims)}"

    def begin_turn(self, token):
        """Mark a complete_and_claim under this claim token as under way; True
        when one was already (it is being done again, see redoable)."""
        with self.turns_lock:
            redone = token in self.turns_begun
            self.turns_begun.add(token)
        return redone

    def end_turn(self, token):
        with self.turns_lock:
            self.turns_begun.discard(token)

    def warn_once(self, key, message, *args):
        """A warning said once per process (a missing package, not every post)."""
        with self.warned_lock:
            if key in self.warned:
                return
            self.warned.add(key)
        log.warning(message, *args)


def import_optional(module, package, feature):
    """Import a dependency only the feature using it needs."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise MissingPackage(package, feature) from None


def run_until_stopped(target, stop, grace):
    """Run target() in a thread until it returns or `stop` is set; after a
    stop it gets `grace` seconds more. Returns (finished, result); an
    exception raised by target is raised here."""
    outcome = {}

    def call():
        try:
            outcome["result"] = target()
        except BaseException as e:
            outcome["error"] = e
    thread = threading.Thread(target=call, daemon=True, name="stoppable")
    thread.start()
    while thread.is_alive() and not stop.is_set():
        thread.join(0.2)
    thread.join(grace)
    if "error" in outcome:
        raise outcome["error"]
    return not thread.is_alive(), outcome.get("result")


class Progress:
    """A self-overwriting status line on a terminal; silent elsewhere."""

    def __init__(self, label, total, unit, quiet=False, stream=None):
        self.label, self.total, self.done, self.quiet = label, total, 0, quiet
        self.unit = unit            # what a step counts, for the rate: "sources", "posts"
        self.stream = stream or sys.stderr
        self.live = not quiet and self.stream.isatty()
        self.lock = threading.Lock()
        self.started = time.monotonic()

    def step(self, note="", count=1):
        with self.lock:
            self.done += count
            if self.live:
                self.stream.write(f"\r{self.label}: {self.done}/{self.total} {note}\033[K")
                self.stream.flush()

    def finish(self, summary):
        """End with one summary line: counts, seconds and the steps' rate."""
        seconds = time.monotonic() - self.started
        if self.quiet:
            return seconds
        if self.live:
            self.stream.write("\r\033[K")
        rate = self.done / seconds if seconds > 0 else 0.0
        print(f"{self.label}: {summary} in {seconds:.1f} s ({rate:.1f} {self.unit}/s)", flush=True)
        return seconds


###############################################################################
# Connections #################################################################
###############################################################################
# SQLite and PostgreSQL connections, transactions, the two dialects.

# claim_post and release_post use UPDATE … RETURNING, start_run INSERT … RETURNING.
MIN_SQLITE = (3, 35, 0)

# What SQLite says when the database, not a statement, is broken: the disk is
# full, the file is corrupt or unreadable. Names from Python 3.11 on, messages
# for 3.10.
STORAGE_FAULTS = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_CORRUPT", "SQLITE_NOTADB",
                  "SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_NOMEM", "SQLITE_NOLFS")
STORAGE_MESSAGES = ("database or disk is full", "disk i/o error", "disk image is malformed",
                    "file is not a database", "readonly database",
                    "unable to open database file", "out of memory")

# SQLite answers some statements "database is locked" at once, without
# waiting out its busy timeout: another connection of the same process
# switching the file to WAL as it opens, a read turning into a write after
# another's write. Such a wait passes in milliseconds; one is said (as the
# database locked by another process) only once its statement has waited
# BUSY_GRACE seconds, and a process that is stopping waits that long too
# before it gives up (a stop's last writes, as a send marked uncertain, are
# not lost to another thread's moment of writing).
BUSY_GRACE = 1.0


def is_busy(error):
    """True for 'database is locked': another connection holds the lock."""
    name = getattr(error, "sqlite_errorname", None) or ""
    return name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or \
        (not name and "is locked" in str(error))


def storage_error(error, path):
    """StorageError for a broken database, None for any other error."""
    name = getattr(error, "sqlite_errorname", None) or ""
    message = str(error)
    if name.startswith(STORAGE_FAULTS) or message.lower().startswith(STORAGE_MESSAGES):
        return StorageError(f"{path}: {message} (a storage problem: check the disk "
                            f"and the file; no source was blamed for it)")
    return None


# Every statement, with how long it took, at DEBUG (-vv) on this logger:
# each connection kind logs what it runs in one place (Connection._retrying,
# PostgresConnection.run), which costs one isEnabledFor when it is off.
# SQLite's time is to its first row (the rest are read as they are fetched),
# PostgreSQL's to its last.
SQL_LOG = logging.getLogger("vesti.sql")
# What a statement's line shows: its text up to SHOWN_SQL characters, up to
# SHOWN_PARAMETERS of its parameters (of executemany: how many rows, and the
# first), each up to SHOWN_CHARS. A secret is never shown: no parameter of a
# statement that names a secret's key itself ('web_password'), nor one named
# like a secret (:token), nor the value that follows a key so named (a meta
# key such as web_secret, given as a parameter), nor a kept password
# (scrypt:…) anywhere. A database URL is no statement's parameter.
SHOWN_SQL, SHOWN_PARAMETERS, SHOWN_CHARS = 1000, 10, 60
SECRET_NAME = re.compile(r"\w*(?:password|secret|token)\w*", re.I)
SECRET_KEY_IN_SQL = re.compile(r"'\w*(?:password|secret|token)\w*'", re.I)


def log_statement(sql, parameters, started, many=False):
    """One statement on SQL_LOG, `started` at time.perf_counter()."""
    text = " ".join(sql.split())
    if len(text) > SHOWN_SQL:
        text = f"{text[:SHOWN_SQL]}… ({len(text)} characters)"
    shown = shown_rows(sql, parameters) if many else shown_parameters(sql, parameters)
    SQL_LOG.debug("%.2f ms: %s%s", (time.perf_counter() - started) * 1000, text,
                  f"; {shown}" if shown else "")


def shown_rows(sql, rows):
    return f"{len(rows)} rows, the first: {shown_parameters(sql, rows[0])}" if rows else "no rows"


def shown_parameters(sql, parameters):
    """A statement's parameters as the log may show them: '(…)', or ''."""
    if not parameters:
        return ""
    if isinstance(parameters, dict):
        shown = [f":{name} {'***' if SECRET_NAME.fullmatch(name) else shown_value(value)}"
                 for name, value in parameters.items()]
    else:
        shown, every, after_key = [], bool(SECRET_KEY_IN_SQL.search(sql)), False
        for value in parameters:
            secret = every or after_key or (isinstance(value, str) and value.startswith("scrypt:"))
            shown.append("***" if secret else shown_value(value))
            after_key = isinstance(value, str) and bool(SECRET_NAME.fullmatch(value))
    more = f", … {len(shown) - SHOWN_PARAMETERS} more" if len(shown) > SHOWN_PARAMETERS else ""
    return f"({', '.join(shown[:SHOWN_PARAMETERS])}{more})"


def shown_value(value):
    text = repr(value)
    if len(text) > SHOWN_CHARS:
        text = text[:SHOWN_CHARS] + "…"
    return f"{text} ({len(value)} items)" if isinstance(value, (list, tuple)) else text


class StorageCursor(sqlite3.Cursor):
    """Rows read later than the first (fetchall, iteration) can meet a
    broken page too: that is a StorageError as well."""

    def _guard(self, call, *args):
        try:
            return call(*args)
        except sqlite3.DatabaseError as e:
            raise storage_error(e, self.connection.path) or e

    def fetchone(self):
        return self._guard(super().fetchone)

    def fetchall(self):
        return self._guard(super().fetchall)

    def fetchmany(self, size=None):
        return self._guard(super().fetchmany, size or self.arraysize)

    def __next__(self):
        return self._guard(super().__next__)


class Connection(sqlite3.Connection):
    """A connection whose statements wait out a database that another
    process keeps locked, and report a broken database as StorageError."""
    path = ""
    depth = 0           # transactions open (see transaction)

    @property
    def dialect(self):
        return SQLITE

    def begin(self, shared=False, stories=False):
        # Take the write lock first, so no read-then-write transaction ever
        # fails with 'database is locked'. It enters stories one transaction
        # at a time too (see PostgresConnection.begin).
        self.execute("BEGIN IMMEDIATE")

    def recover(self):
        """A file has no server to wait for (see PostgresConnection)."""

    def execute(self, sql, parameters=()):
        return self._retrying(self.cursor(StorageCursor).execute, sql, parameters)

    def executemany(self, sql, rows):
        return self._retrying(self.cursor(StorageCursor).executemany, sql, rows, many=True)

    def _retrying(self, call, sql, parameters, many=False):
        """call(sql, parameters), waiting out another process's lock; not
        retried for executemany (`many`): rows written before the lock
        would be written twice."""
        started = None
        if SQL_LOG.isEnabledFor(logging.DEBUG):
            started = time.perf_counter()
            parameters = list(parameters) if many else parameters    # read again by the log
        waiting, began = False, time.monotonic()
        try:
            while True:
                try:
                    return call(sql, parameters)
                except sqlite3.OperationalError as e:
                    if not is_busy(e) or many:
                        raise
                    if self.process.stopping.is_set() and \
                            time.monotonic() - began >= BUSY_GRACE:
                        raise StorageError(f"{self.path}: {e}; stopped waiting for it "
                                           f"since the process is stopping") from None
                    if not waiting and time.monotonic() - began >= BUSY_GRACE:
                        waiting = True
                        self.process.busy.enter(self.path)
                    time.sleep(0.05)
        except sqlite3.DatabaseError as e:
            raise storage_error(e, self.path) or e
        finally:
            if waiting:
                self.process.busy.leave(self.path)
            if started is not None:
                log_statement(sql, parameters, started, many)


def connect(path, busy_timeout=30, process=None):
    """A connection in autocommit mode with the pragmas every connection
    needs, for the threads of `process` (None: a Process of its own)."""
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        raise ConfigError(f"SQLite {sqlite3.sqlite_version} is too old: VESTI needs "
                          f"{'.'.join(map(str, MIN_SQLITE))} or newer (a newer Python build)")
    conn = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None,
                           check_same_thread=False, factory=Connection)
    conn.path, conn.process = path, process or Process()
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


@contextlib.contextmanager
def transaction(conn, shared=False, stories=False):
    """A write transaction that holds the database's write lock from its
    first statement (conn.begin), so that its reads and writes are never
    interleaved with another writer's. A `shared` one (the workers' batches)
    lets other processes' shared ones write beside it where the database can
    (PostgreSQL; SQLite has one writer). The threads of one process still
    take turns: they would only queue on the rows they all share (the
    counts, the pending posts). `stories`: the transaction enters posts in
    their stories, one such transaction at a time."""
    with conn.process.write_lock(conn.path):
        conn.begin(shared and conn.dialect.shared_writes, stories)
        conn.depth += 1
        try:
            yield conn
        except BaseException:
            # The database may have rolled back already (SQLite does on a
            # full disk; a server that went away has).
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error, StorageError, TransactionUndone):
                    conn.execute("ROLLBACK")
            raise
        else:
            conn.execute("COMMIT")
        finally:
            conn.depth -= 1


def redoable(function):
    """For a storage function whose work is one transaction of its own: when
    the database server undoes it (TransactionUndone), wait until the server
    can take it and do the work again. Inside a caller's transaction the
    caller's work is undone too, so the error goes up to the caller. While
    the process stops, the work is done again only once (see last_try)."""
    @functools.wraps(function)
    def again(conn, *args, **kwargs):
        tried = False
        while True:
            try:
                return function(conn, *args, **kwargs)
            except TransactionUndone as e:
                if conn.depth:
                    raise
                if last_try(conn.process, e.episode, tried):
                    raise StorageError(f"{e}; not done again since the process is stopping") from None
                tried = conn.process.stopping.is_set()
                e.episode.enter(conn.path)
                try:
                    conn.recover()
                finally:
                    e.episode.leave(conn.path)
    return again


def last_try(process, episode, tried):
    """Whether a statement or transaction the database could not take is
    given up: only while the process stops. A lock held elsewhere (the busy
    episode) is not waited for then; a connection the server lost (it
    restarted a moment ago) is opened again and the work tried once more
    (`tried`: it was), so a stop right after a restart loses nothing."""
    return process.stopping.is_set() and (episode is process.busy or tried)


def has_fts5():
    try:
        sqlite3.connect(":memory:").execute("CREATE VIRTUAL TABLE t USING fts5(x)")
    except sqlite3.OperationalError:
        return False
    return True


FTS5 = has_fts5()


def fts_query(text):
    """Words as FTS5 terms, any case; a word typed with a * after it matches
    every word it begins: 'Linux ядр*' -> '"linux" "ядр"*'. (Prefixes are
    asked for, not implied: a common prefix makes the index merge the lists
    of every word it begins.)"""
    words = re.findall(r"(\w+)(\*?)", text.casefold())
    return " ".join(f'"{w}"{star}' for w, star in words[:12])


def like_pattern(text):
    return f"%{like_escaped(text)}%"


def like_escaped(text):
    """`text` matched as itself by LIKE ... ESCAPE '\\'."""
    return re.sub(r"([%_\\])", r"\\\1", text)


class SQLiteDialect:
    """Where SQLite's SQL is its own: the claim, the search, statistics."""
    name = "sqlite"
    fts5 = FTS5
    # The claim's condition on a post's id: one of the oldest claimable posts
    # (the claim's UPDATE takes them in the same statement, under SQLite's
    # one write lock).
    claimable = (f"id IN (SELECT id FROM posts INDEXED BY posts_pending WHERE {{pending}} "
                 f"AND (next_attempt_at IS NULL OR next_attempt_at <= ?) ORDER BY id LIMIT ?)")
    claim_window = ("SELECT id, content_type, coalesce(article_url, url) AS link "
                    "FROM posts INDEXED BY posts_pending WHERE {pending} "
                    "AND (next_attempt_at IS NULL OR next_attempt_at <= ?) ORDER BY id LIMIT ?")
    refresh_statistics = "PRAGMA optimize"
    shared_writes = False       # one writer at a time
    # Posts looked up by their ids: the filters beside the ids must not lead
    # the planner to walk an index of all posts of a status instead.
    posts_by_id = "posts p NOT INDEXED"

    def among(self, column, values):
        """[(clause, parameters)] saying `column` is one of `values`: as few
        clauses as the database takes parameters in one statement."""
        values = list(values)
        chunks = [values[first:first + 500] for first in range(0, len(values), 500)]
        return [(f"{column} IN ({', '.join('?' * len(chunk))})", chunk) for chunk in chunks]

    def id_table(self, values):
        """[(a table of one column, column1, holding `values`; parameters)],
        as few as the database takes parameters in one statement. Left
        untyped: a CAST on each would keep SQLite from searching an index by
        the column (30 times slower)."""
        values = list(values)
        chunks = [values[first:first + 500] for first in range(0, len(values), 500)]
        return [(f"(VALUES {', '.join(['(?)'] * len(chunk))}) AS wanted", chunk) for chunk in chunks]

    def store_story_keys(self, conn, rows):
        """Keep (key, post id) rows of story keys, in key order (sorted by
        the key alone: half the time of sorting the pairs, under the write lock)."""
        insert_rows(conn, "story_keys (key, post_id)", sorted(rows, key=operator.itemgetter(0)),
                    "ON CONFLICT DO NOTHING")

    def search_filter(self, text):
        """The WHERE clause (on posts p) and parameters of a search: FTS5, or
        LIKE where this Python's SQLite has no FTS5."""
        if self.fts5:
            return "p.id IN (SELECT rowid FROM posts_fts WHERE posts_fts MATCH ?)", [fts_query(text)]
        pattern = like_pattern(text)
        return "(p.title LIKE ? ESCAPE '\\' OR p.text LIKE ? ESCAPE '\\')", [pattern, pattern]

    def search_matches(self, text):
        """A query of the ids of a search's matches, and its parameters: read
        from the search index alone, so a LIMIT stops it early."""
        if self.fts5:
            return "SELECT rowid FROM posts_fts WHERE posts_fts MATCH ?", [fts_query(text)]
        clause, values = self.search_filter(text)
        return f"SELECT p.id FROM posts p WHERE {clause}", values

    def matches_below(self, text):
        """search_matches below an id, newest collected first: the query
        (the id and a LIMIT to add to its parameters) and its parameters."""
        if self.fts5:
            return ("SELECT rowid FROM posts_fts WHERE posts_fts MATCH ? AND rowid < ? "
                    "ORDER BY rowid DESC LIMIT ?"), [fts_query(text)]
        clause, values = self.search_filter(text)
        return f"SELECT p.id FROM posts p WHERE {clause} AND p.id < ? ORDER BY p.id DESC LIMIT ?", values

    def in_byte_order(self, column):
        """A text column as compared byte by byte (SQLite's default, BINARY):
        what two databases agree on, whatever their collations."""
        return column

    def clear_search(self, conn):
        if self.fts5:
            conn.execute("INSERT INTO posts_fts (posts_fts) VALUES ('delete-all')")

    def index_search(self, conn, after, last):
        """Make posts after..last searchable (see index_new_posts)."""
        if self.fts5:
            conn.execute("INSERT INTO posts_fts (rowid, title, text) SELECT id, title, text "
                         "FROM posts WHERE id > ? AND id <= ?", (after, last))


class PostgresDialect(SQLiteDialect):
    """Where PostgreSQL's SQL differs from SQLite's."""
    name = "postgresql"
    fts5 = False
    # Two workers may look at the same pending rows at once: each takes only
    # rows no other claim holds (SKIP LOCKED), so a post is never claimed twice.
    # The order names both columns of posts_pending, which only that index
    # gives: by id alone, the planner would walk the primary key through
    # every post done already. The ids are chosen once, as an array: as `id
    # IN (SELECT ...)`, a plan that joins each post to the choice would
    # choose again for every post, skip the rows this UPDATE has just taken
    # and claim the whole queue for one worker.
    claimable = (f"id = ANY(ARRAY(SELECT id FROM posts WHERE {{pending}} "
                 f"AND (next_attempt_at IS NULL OR next_attempt_at <= ?) "
                 f"ORDER BY id, classified LIMIT ? FOR UPDATE SKIP LOCKED))")
    claim_window = ("SELECT id, content_type, coalesce(article_url, url) AS link FROM posts "
                    "WHERE {pending} AND (next_attempt_at IS NULL OR next_attempt_at <= ?) "
                    "ORDER BY id, classified LIMIT ? FOR UPDATE SKIP LOCKED")
    refresh_statistics = "ANALYZE"
    shared_writes = True        # the workers' batches write at the same time
    posts_by_id = "posts p"

    # An array is one parameter: a whole batch in one round trip.
    def among(self, column, values):
        values = list(values)
        return [(f"{column} = ANY(CAST(? AS BIGINT[]))", [values])] if values else []

    def id_table(self, values):
        values = list(values)
        return [("unnest(CAST(? AS BIGINT[])) AS wanted (column1)", [values])] if values else []

    def store_story_keys(self, conn, rows):
        rows = sorted(rows)
        if rows:
            conn.execute("INSERT INTO story_keys (key, post_id) SELECT * FROM "
                         "unnest(CAST(? AS BIGINT[]), CAST(? AS BIGINT[])) ON CONFLICT DO NOTHING",
                         ([key for key, _ in rows], [post_id for _, post_id in rows]))

    # The search index: each post's words (whole words in any case, as
    # FTS5's) in post_words, apart from posts, so that a worker's update of
    # a post does not work out its words again (see POSTGRES_EXTRA).
    WORDS = "to_tsvector('simple', coalesce({p}title, '') || ' ' || coalesce({p}text, ''))"

    @staticmethod
    def tsquery(text):
        words = re.findall(r"(\w+)(\*?)", text.casefold())[:12]
        return " & ".join(f"{w}{':*' if star else ''}" for w, star in words)

    def search_filter(self, text):
        query = self.tsquery(text)
        if not query:
            return "false", []
        return ("p.id IN (SELECT post_id FROM post_words WHERE words @@ to_tsquery('simple', ?))",
                [query])

    def search_matches(self, text):
        query = self.tsquery(text)
        if not query:
            return "SELECT post_id FROM post_words WHERE false", []
        return "SELECT post_id FROM post_words WHERE words @@ to_tsquery('simple', ?)", [query]

    def matches_below(self, text):
        query = self.tsquery(text)
        if not query:
            return "SELECT post_id FROM post_words WHERE false AND post_id < ? LIMIT ?", []
        return ("SELECT post_id FROM post_words WHERE words @@ to_tsquery('simple', ?) "
                "AND post_id < ? ORDER BY post_id DESC LIMIT ?"), [query]

    def in_byte_order(self, column):
        # A database's collation may be a language's: en-US puts 'B' after
        # 'a' and passes over punctuation.
        return f'{column} COLLATE "C"'

    def clear_search(self, conn):
        conn.execute("DELETE FROM post_words")

    def index_search(self, conn, after, last):
        conn.execute(f"INSERT INTO post_words (post_id, words) SELECT id, {self.WORDS.format(p='')} "
                     f"FROM posts WHERE id > ? AND id <= ? "
                     f"ON CONFLICT (post_id) DO UPDATE SET words = excluded.words", (after, last))


SQLITE, POSTGRES = SQLiteDialect(), PostgresDialect()


def is_postgres(path):
    return str(path).startswith(("postgresql://", "postgres://"))


# A password in a database URL: user:password@ before the host (up to its
# last @), or a password= parameter.
URL_PASSWORD = re.compile(r"(?<=://)([^/?#@:]*):.*(?=@[^@]*$)|(?<=[?&]password=)[^&#]*")


def redacted(path):
    """A database URL fit for a log line or a page: no password."""
    if "://" not in str(path):
        return path
    return URL_PASSWORD.sub(lambda m: f"{m.group(1)}:***" if m.group(1) is not None else "***",
                            path)


def secrets_of(url):
    """The password a database URL holds, as written and decoded."""
    found = {m.group(0).split(":", 1)[1] if m.group(1) is not None else m.group(0)
             for m in URL_PASSWORD.finditer(url)}
    return {s for text in found for s in (text, urllib.parse.unquote(text)) if s}


def scrubbed(text, url):
    """An error message with the URL's password taken out (a driver may quote it)."""
    for secret in sorted(secrets_of(url), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


# The one thing rewritten in a statement on its way to PostgreSQL: its
# placeholders. Statements are written with sqlite3's ? and :name, which
# psycopg has no paramstyle for (it takes %s and %(name)s, or the server's
# own $1), so what is rewritten is `?` → `%s`, `:name` → `%(name)s` and
# `%` → `%%` (psycopg would read a lone % as a placeholder); nothing else.
# The statement is read token by token: a quoted string, a quoted name or
# a -- comment is passed over whole (only its % doubled), and a :: cast is
# left alone. Where the dialects' SQL differs, each says its own (see
# PostgresDialect and the call sites that ask conn.dialect).
PLACEHOLDERS = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|--[^\n]*|::|\?|:(?=[A-Za-z_])\w+|%")


@functools.lru_cache(maxsize=4096)
def psycopg_placeholders(sql):
    """`sql` with its placeholders as psycopg takes them (see PLACEHOLDERS)."""
    def swap(match):
        token = match.group(0)
        if token == "?":
            return "%s"
        if token.startswith(":") and token != "::":
            return f"%({token[1:]})s"
        return token.replace("%", "%%")
    return PLACEHOLDERS.sub(swap, sql)


@functools.lru_cache(maxsize=None)
def row_type(names):
    """Rows of one shape, read by index or by column name, as sqlite3.Row."""
    where = {name: i for i, name in enumerate(names)}

    class Row(tuple):
        __slots__ = ()

        def __getitem__(self, key):
            return tuple.__getitem__(self, where[key] if isinstance(key, str) else key)

        def keys(self):
            return list(names)
    return Row


def postgres_rows(cursor):
    return row_type(tuple(column.name for column in cursor.description or ()))


@functools.lru_cache(maxsize=None)
def postgres_adapters(psycopg):
    """numeric (what sum() of integers gives) read as int or float, a bool
    written as 0 or 1, as SQLite stores them, and text written without
    U+0000, which PostgreSQL's text cannot hold: one NUL in a feed's entry
    or a page's query would otherwise fail the whole statement (a feed on
    every crawl until it is dead, the page with a 500)."""
    class Number(psycopg.adapt.Loader):
        def load(self, data):
            text = bytes(data).decode()
            return int(text) if text.lstrip("-").isdigit() else float(text)

    class Flag(psycopg.adapt.Dumper):
        oid = psycopg.adapters.types["int8"].oid

        def dump(self, value):
            return b"1" if value else b"0"

    class Text(psycopg.types.string.StrDumperUnknown):
        def dump(self, value):
            return super().dump(value.replace("\x00", ""))
    return Number, Flag, Text


# SQLSTATE classes of a server or disk in trouble, not of a statement:
# insufficient resources (disk full), system errors (I/O), internal errors
# (a corrupt page).
POSTGRES_STORAGE_FAULTS = ("53", "58", "XX")
# The connection is gone: a server shutting down or restarting, a broken link.
POSTGRES_LOST = ("57P01", "57P02", "57P03", "08000", "08001", "08003", "08006")
# Another session holds what the statement needs: a row past lock_timeout
# (the busy timeout), or a deadlock.
POSTGRES_BUSY = ("55P03", "40P01", "40001")


class PostgresCursor:
    """A psycopg cursor whose errors are the ones SQLite's give."""

    def __init__(self, cursor, connection):
        self.cursor, self.connection = cursor, connection

    @property
    def rowcount(self):
        return self.cursor.rowcount

    def fetchone(self):
        return self.connection.guarded(self.cursor.fetchone)

    def fetchall(self):
        return self.connection.guarded(self.cursor.fetchall)

    def __iter__(self):
        return iter(self.fetchall())


class PostgresConnection:
    """A psycopg connection that speaks as the SQLite one does (? and :name
    placeholders, rows by index and by name, in_transaction, the
    DB-API errors as the sqlite3 module names them) and waits as it does:
    outside a transaction a statement waits for a server that restarts or a
    row another session holds, and runs again; inside one, the server has
    undone the transaction: TransactionUndone (see `redoable`)."""
    dialect = POSTGRES
    # One writer at a time, as SQLite has it (see transaction): every write
    # transaction takes this advisory lock first.
    WRITE_LOCK = 0x7665737469    # 'vesti'
    STORIES_LOCK = WRITE_LOCK + 1

    def __init__(self, url, busy_timeout=30, wait=False, process=None):
        """`wait`: a server that cannot be reached is waited for (a process
        that has used the database already); otherwise it is a
        configuration error, as a wrong password always is."""
        self.url, self.path, self.busy_timeout = url, redacted(url), busy_timeout
        self.process = process or Process()
        self.depth, self.open_transaction = 0, False
        self.psycopg = import_optional("psycopg", "psycopg[binary]", "a PostgreSQL database")
        try:
            self.raw = self.connect()
        except self.psycopg.Error as e:
            unreachable = getattr(e, "sqlstate", None) in (None, *POSTGRES_LOST)
            if not (wait and unreachable):
                raise ConfigError(f"{self.path}: cannot open the database: "
                                  f"{self.said(e)}") from None
            self.raw = None
            self.process.unreachable.enter(self.path)
            try:
                self.recover()
            finally:
                self.process.unreachable.leave(self.path)

    def said(self, error):
        """The first line of an error, without the URL's password."""
        return scrubbed(first_line(error), self.url)

    def connect(self):
        raw = self.psycopg.connect(self.url, autocommit=True, connect_timeout=10,
                                   row_factory=postgres_rows)
        number, flag, text = postgres_adapters(self.psycopg)
        raw.adapters.register_loader("numeric", number)
        raw.adapters.register_dumper(bool, flag)
        raw.adapters.register_dumper(str, text)
        # A statement waits at most the busy timeout for a row or the write
        # lock another session holds, as SQLite waits for its lock. A commit
        # does not wait for the disk, as SQLite's synchronous=NORMAL does not
        # (a crash of the server can lose the last moment's commits, never
        # their consistency; what is lost is done again: a lease runs out, a
        # feed is fetched again). Every commit would otherwise wait an fsync.
        raw.execute(f"SET lock_timeout = {max(1, int(self.busy_timeout * 1000))}; "
                    f"SET synchronous_commit = off")
        return raw

    @property
    def in_transaction(self):
        return not self.raw.broken and self.raw.info.transaction_status in (
            self.psycopg.pq.TransactionStatus.INTRANS, self.psycopg.pq.TransactionStatus.INERROR)

    def begin(self, shared=False, stories=False):
        """`stories`: in a shared transaction, stories are entered one at a
        time, so two copies written at once end in one story."""
        lock = f"SELECT pg_advisory_xact_lock{'_shared' if shared else ''}({self.WRITE_LOCK})"
        if stories:
            lock += f"; SELECT pg_advisory_xact_lock({self.STORIES_LOCK})"
        try:
            self.execute(f"BEGIN; {lock}", None)
        except BaseException:
            # The BEGIN may have gone through and the lock not (a stop while
            # waiting for it): no transaction is left open behind the error.
            if self.in_transaction:
                with contextlib.suppress(self.psycopg.Error):
                    self.raw.execute("ROLLBACK")
            raise
        self.open_transaction = True

    def execute(self, sql, parameters=()):
        if sql in ("COMMIT", "ROLLBACK"):
            self.open_transaction = False
        if parameters is None:          # several statements, no placeholders
            return PostgresCursor(self.run(lambda raw: raw.execute(sql), sql), self)
        statement = psycopg_placeholders(sql)
        cursor = self.run(lambda raw: raw.execute(statement, parameters), statement, parameters)
        return PostgresCursor(cursor, self)

    def executemany(self, sql, rows):
        statement = psycopg_placeholders(sql)
        rows = list(rows)
        if rows:
            self.run(lambda raw: raw.cursor().executemany(statement, rows), statement, rows,
                     many=True)

    def run(self, call, statement, parameters=None, many=False):
        """call(psycopg connection), which runs `statement`, waiting out a
        server that is away or a lock held elsewhere when no transaction of
        ours is open."""
        started = time.perf_counter() if SQL_LOG.isEnabledFor(logging.DEBUG) else None
        episode, tried = None, False
        try:
            while True:
                try:
                    return self.guarded(lambda: call(self.raw))
                except (TransactionUndone, sqlite3.OperationalError) as e:
                    waiting = e.episode if isinstance(e, TransactionUndone) else \
                        self.process.busy if getattr(e, "busy", False) else None
                    if waiting is None or self.depth:
                        raise
                    if last_try(self.process, waiting, tried):
                        raise StorageError(f"{e}; stopped waiting since the process is "
                                           f"stopping") from None
                    tried = self.process.stopping.is_set()
                    if episode is None:
                        episode = waiting
                        episode.enter(self.path)
                    self.recover()
        finally:
            if episode is not None:
                episode.leave(self.path)
            if started is not None:
                log_statement(statement, parameters, started, many)

    def guarded(self, call):
        """call(), its psycopg errors turned into the ones SQLite's give."""
        try:
            return call()
        except self.psycopg.Error as e:
            raise self.translated(e) from e

    def translated(self, error):
        state = getattr(error, "sqlstate", None) or ""
        undone = self.open_transaction
        if self.raw.broken or self.raw.closed or state in POSTGRES_LOST:
            self.open_transaction = False
            return TransactionUndone(f"{self.path}: the connection to the database server "
                                     f"was lost ({self.said(error)})", self.process.unreachable)
        if state in POSTGRES_BUSY:
            if undone:
                # The server has undone the transaction; it is done again
                # after a ROLLBACK (see redoable).
                return TransactionUndone(f"{self.path}: {self.said(error)}", self.process.busy)
            busy = sqlite3.OperationalError(f"{self.path}: {self.said(error)}")
            busy.busy = True
            return busy
        if state.startswith(POSTGRES_STORAGE_FAULTS):
            return StorageError(f"{self.path}: {self.said(error)} (a storage problem: check "
                                f"the database server; no source was blamed for it)")
        kind = {"23": sqlite3.IntegrityError, "22": sqlite3.DataError,
                "42": sqlite3.ProgrammingError}.get(state[:2], sqlite3.OperationalError)
        return kind(self.said(error))

    def recover(self):
        """After TransactionUndone or a wait: the transaction is rolled back
        and, when the server went away, a new connection opened once it is
        back. Waits no more than a second when nothing is wrong. While the
        process stops, the server is tried once more, not waited for."""
        if self.raw is not None and not (self.raw.broken or self.raw.closed):
            with contextlib.suppress(self.psycopg.Error):
                self.raw.execute("ROLLBACK")
            self.open_transaction = False
            self.process.stopping.wait(0.05)
            return
        while True:
            try:
                old, self.raw = self.raw, self.connect()
            except self.psycopg.Error:
                if self.process.stopping.is_set():
                    break
                self.process.stopping.wait(1.0)
                continue
            if old is not None:
                with contextlib.suppress(Exception):
                    old.close()
            self.open_transaction = False
            return
        raise StorageError(f"{self.path}: the database server cannot be reached; stopped "
                           f"waiting for it since the process is stopping")

    def close(self):
        with contextlib.suppress(Exception):
            self.raw.close()


def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def open_connection(path, busy_timeout=30, wait=False, process=None):
    """A connection to a SQLite file or a postgresql:// URL (see
    PostgresConnection for `wait`), for the threads of `process`."""
    if is_postgres(path):
        return PostgresConnection(path, busy_timeout, wait, process)
    return connect(path, busy_timeout, process)


def sql_statements(script):
    """The statements of an SQL script, each without its ';' (a trigger's
    body holds statements of its own: SQLite tells where one ends)."""
    statements, lines = [], []
    for line in script.splitlines():
        lines.append(line)
        if line.endswith(";") and sqlite3.complete_statement("\n".join(lines)):
            statements.append("\n".join(lines)[:-1])
            lines = []
    return statements


def insert_rows(conn, into, rows, conflict=""):
    """INSERT INTO `into` VALUES (…), (…) `conflict`: many rows in one
    statement, so one round trip to a database server (executemany costs
    one per row there)."""
    rows = list(rows)
    for first in range(0, len(rows), 500):
        chunk = rows[first:first + 500]
        # The rows are of one width.
        marks = ", ".join([f"({', '.join('?' * len(chunk[0]))})"] * len(chunk))
        conn.execute(f"INSERT INTO {into} VALUES {marks} {conflict}",
                     list(itertools.chain.from_iterable(chunk)))


###############################################################################
# Facts and counters ##########################################################
###############################################################################
# Facts between processes (meta) and the counters behind /metrics.

def get_meta(conn, key):
    row = conn.execute("SELECT value, updated_at FROM meta WHERE key = ?", (key,)).fetchone()
    return (row[0], row[1]) if row else (None, None)


def set_meta(conn, key, value):
    conn.execute("""INSERT INTO meta (key, value, updated_at) VALUES (?, ?, ?)
                    ON CONFLICT(key) DO UPDATE SET value = excluded.value,
                                                   updated_at = excluded.updated_at""",
                 (key, value, utc_text()))


def delete_meta(conn, *keys):
    conn.execute(f"DELETE FROM meta WHERE key IN ({','.join('?' * len(keys))})", keys)


def lasting_secret(conn, key):
    """A random secret made once and kept in the database, so what it signs
    (the page's form tokens) outlives a restart."""
    conn.execute("INSERT INTO meta (key, value, updated_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                 (key, secrets.token_hex(32), utc_text()))
    return get_meta(conn, key)[0]


def note_ollama_down(conn, error):
    """Ollama is unreachable: the time it was first seen so is kept."""
    conn.execute("""INSERT INTO meta (key, value, updated_at) VALUES ('ollama_down', ?, ?)
                    ON CONFLICT(key) DO UPDATE SET value = excluded.value""",
                 (error, utc_text()))


def note_sources_rejected(conn, path, error):
    """A changed sources.yaml that did not load, kept for every process's
    pages until one does."""
    set_meta(conn, "sources_rejected", json.dumps({"file": path, "error": error}))


def sources_rejected(conn):
    """(file, error, since when) of a sources.yaml edit that did not load,
    or None."""
    value, since = get_meta(conn, "sources_rejected")
    if value is None:
        return None
    note = json.loads(value)
    return note["file"], note["error"], since


def forget_sources_rejected(conn, path):
    """This sources.yaml loaded: a rejected edit of it is past."""
    note = sources_rejected(conn)
    if note and os.path.abspath(note[0]) == os.path.abspath(path):
        delete_meta(conn, "sources_rejected")


def classification_state(conn):
    """What the workers last said about themselves and Ollama."""
    rows = {row[0]: (row[1], row[2]) for row in conn.execute(
        "SELECT key, value, updated_at FROM meta WHERE key IN "
        "('worker_seen', 'ollama_down', 'classify_mode')")}
    return {"worker_seen": rows.get("worker_seen", (None, None))[0],
            "ollama_down_since": rows.get("ollama_down", (None, None))[1],
            "ollama_error": rows.get("ollama_down", (None, None))[0],
            "classify_mode": rows.get("classify_mode", (None, None))[0]}


# Upper bounds (seconds) of the LLM latency histogram's buckets.
LLM_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
FETCH_OUTCOMES = {"ok": "ok", "not_modified": "not_modified", "unchanged": "not_modified",
                  "error": "error", "gone": "error", "deferred": "deferred"}


@redoable
def add_counts(conn, increments):
    """Add to counters: {(name, labels): amount}, in one transaction."""
    if not increments:
        return
    with transaction(conn):
        upsert_counts(conn, increments)


def upsert_counts(conn, increments):
    insert_rows(conn, "counters (name, labels, value)",
                [(name, labels, amount) for (name, labels), amount in sorted(increments.items())],
                "ON CONFLICT(name, labels) DO UPDATE SET value = counters.value + excluded.value")


def count_fetches(conn, crawler, results):
    """A crawl's outcomes and new posts, by crawler kind."""
    increments = {}
    for result in results:
        key = ("fetches", f'crawler="{crawler}",outcome="{FETCH_OUTCOMES[result.status]}"')
        increments[key] = increments.get(key, 0) + 1
        key = ("new_posts", f'crawler="{crawler}"')
        increments[key] = increments.get(key, 0) + result.new_posts
    add_counts(conn, increments)


def llm_call_counts(latencies):
    """The counter increments of LLM calls that took these many seconds."""
    increments = {}
    for seconds in latencies:
        bucket = next((b for b in LLM_BUCKETS if seconds <= b), "+Inf")
        for key, amount in ((("llm_calls", ""), 1), (("llm_seconds_sum", ""), seconds),
                            (("llm_seconds_bucket", f'le="{bucket}"'), 1)):
            increments[key] = increments.get(key, 0) + amount
    return increments


def counters(conn):
    """{name: {labels: value}}."""
    found = {}
    for name, labels, value in conn.execute("SELECT name, labels, value FROM counters"):
        found.setdefault(name, {})[labels] = value
    return found


def sources_by_status(conn):
    return conn.execute("""SELECT crawler, CASE WHEN enabled = 0 THEN 'disabled'
                                  WHEN status = 'alive' AND silent_since IS NOT NULL THEN 'silent'
                                  ELSE status END, count(*) FROM sources GROUP BY 1, 2""").fetchall()


def ollama_down(state, settings):
    """Whether the workers last found Ollama unreachable (and it is still
    the one asked)."""
    return bool(state["ollama_down_since"] and settings.ollama_url)


###############################################################################
# Desk counts #################################################################
###############################################################################
# The counts behind the desk's filters and the triggers that keep them.

# The desk's filters show how many posts each decision, direction and
# relevance has (overall and per source) from count tables, so that the desk
# answers at once at a million posts. What they count is said once, here, and
# all that keeps them is made from it: SQLite's triggers (in SCHEMA),
# PostgreSQL's trigger function (in POSTGRES_EXTRA), the batches that take
# new posts in (count_posts) and the workers' completions (count_completions).
#
# A post is counted once it is classified (classified = 1: DONE, see the
# queue's states) and taken in (its id up to meta 'indexed_to'; newer posts
# are taken in by batches, see index_new_posts), in the row of its values in
# the table's key columns. post_counts counts the desk's cards (a story's
# copies are counted with its first post); source_post_counts every post of
# a source.
CountTable = collections.namedtuple("CountTable", "name key cards_only")
COUNT_TABLES = (CountTable("post_counts", ("status", "direction", "relevance", "liked"), True),
                CountTable("source_post_counts",
                           ("source_id", "status", "direction", "relevance", "liked"), False))
# What a direction's learned model does to the desk's default floor, by the
# chance it gives a post that an editor approves it (posts.likely): one of
# LIKELY_HIGH or more is shown whatever its relevance, one under LIKELY_LOW
# is not, and between the two the relevance floor decides, as with keywords
# alone. A model whose decisions carry no signal gives every post about the
# direction's approval rate: between the two, the desk as keywords made it.
# LIKELY_FLOOR: where a chance says yes rather than no (a card's reasons).
LIKELY_LOW = 0.35
LIKELY_HIGH = 0.75
LIKELY_FLOOR = 0.5
# A post's value in each key column: no direction, relevance or source
# counts as '' or 0; liked is 2 at LIKELY_HIGH or more, 0 under LIKELY_LOW,
# 1 between, -1 with no likely.
COUNTED_AS = {"status": "{row}status", "direction": "coalesce({row}direction, '')",
              "relevance": "coalesce({row}relevance, 0)",
              "source_id": "coalesce({row}source_id, 0)",
              "liked": f"(CASE WHEN {{row}}likely IS NULL THEN -1 "
                       f"WHEN {{row}}likely >= {LIKELY_HIGH} THEN 2 "
                       f"WHEN {{row}}likely >= {LIKELY_LOW} THEN 1 ELSE 0 END)"}
# The column of posts each key column is worked out from.
COUNTED_FROM = {"liked": "likely"}
LIKED = (-1, 0, 1, 2)
# Posts up to this id are counted in post_counts and searchable in posts_fts.
INDEXED_TO = "indexed_to"


def card(row=""):
    """SQL: the post is a card of the desk, in no story or its story's first
    post. `row` names the post: 'new.', 'old.', a table and a dot, or nothing."""
    return f"({row}story_id IS NULL OR {row}story_id = {row}id)"


def counted(table, row=""):
    """SQL: `table` counts the post, once it is taken in."""
    return " AND ".join([f"{row}classified = 1", *([card(row)] if table.cards_only else [])])


def counted_value(column, row=""):
    """SQL: the post's value in a key column of the count tables."""
    return COUNTED_AS[column].format(row=row)


def taken_in(row=""):
    """SQL: the post is taken in (NULL while no post is)."""
    return f"{row}id <= (SELECT CAST(value AS BIGINT) FROM meta WHERE key = '{INDEXED_TO}')"


def counting(row):
    """SQL: what counting the post needs, as the columns of a row: its value
    in each key column (named as the column), whether it is taken in, and
    whether each count table counts it (named as the table)."""
    return ", ".join([*(f"{counted_value(column, row)} AS {column}" for column in COUNTED_AS),
                      f"({taken_in(row)}) AS taken_in",
                      *(f"({counted(table, row)}) AS {table.name}" for table in COUNT_TABLES)])


# What changes a count, as the triggers of both databases see it: (SQLite's
# trigger, the change, when it counts, its steps; see count_step). A
# completion into 'new' by a worker's claim, the common case, is counted by
# the worker, a batch at a time (count_completions). Any other completion
# only adds one to rows made ready beforehand (ready_counts): an insert in a
# trigger costs several times an update.
CountEvent = collections.namedtuple("CountEvent", "trigger change when steps")
# A post classified into 'new' just now.
COMPLETION = "new.classified = 1 AND coalesce(old.classified, 0) != 1 AND new.status = 'new'"
# The columns of posts a count depends on.
COUNTED_COLUMNS = ("classified", *(COUNTED_FROM.get(key, key) for key in COUNTED_AS), "story_id")
COUNT_EVENTS = (
    CountEvent("posts_completed", "UPDATE OF classified",
               f"{COMPLETION} AND old.claim_token IS NULL", ("ready",)),
    CountEvent("posts_recounted", f"UPDATE OF {', '.join(COUNTED_COLUMNS)}",
               f"(old.classified = 1 OR new.classified = 1) AND NOT ({COMPLETION})",
               ("out", "in")),
    CountEvent("posts_uncounted", "DELETE", "old.classified = 1", ("out",)),
)


def count_step(table, step):
    """SQL of a trigger's step on `table`: 'out' takes the post as it was
    out of its row, 'in' adds it as it is to its row (made if need be),
    'ready' adds it to its row if that row is there."""
    columns = ", ".join(table.key)
    if step == "in":
        return (f"INSERT INTO {table.name} ({columns}, n)\n"
                f"SELECT {', '.join(counted_value(column, 'new.') for column in table.key)}, 1\n"
                f"WHERE {counted(table, 'new.')}\n"
                f"ON CONFLICT ({columns}) DO UPDATE SET n = {table.name}.n + 1")
    row, sign = ("old.", "-") if step == "out" else ("new.", "+")
    return (f"UPDATE {table.name} SET n = n {sign} 1\n"
            f"WHERE {counted(table, row)}"
            + "".join(f"\n  AND {column} = {counted_value(column, row)}" for column in table.key))


def count_steps(event, indent):
    """SQL: an event's steps on every count table, one statement a line."""
    return textwrap.indent("".join(f"{count_step(table, step)};\n" for step in event.steps
                                   for table in COUNT_TABLES), " " * indent)


def sqlite_count_triggers():
    """SQLite's triggers that keep the counts, one per COUNT_EVENTS."""
    return "".join(f"CREATE TRIGGER IF NOT EXISTS {event.trigger} AFTER {event.change} ON posts\n"
                   f"WHEN ({event.when})\n"
                   f"    AND {taken_in('old.')}\n"
                   f"BEGIN\n{count_steps(event, 4)}END;\n" for event in COUNT_EVENTS)


def postgres_count_function():
    """PostgreSQL's trigger function that keeps the counts: COUNT_EVENTS as
    the branches of one IF."""
    branches = "".join(f"    ELSIF TG_OP = '{event.change.split()[0]}' AND ({event.when}) THEN\n"
                       f"{count_steps(event, 8)}" for event in COUNT_EVENTS)
    return (f"CREATE OR REPLACE FUNCTION vesti_count_posts() RETURNS trigger\n"
            f"LANGUAGE plpgsql AS $$\n"
            f"BEGIN\n"
            f"    IF ({taken_in('old.')}) IS NOT TRUE THEN\n"
            f"        RETURN NULL;\n"
            f"{branches}"
            f"    END IF;\n"
            f"    RETURN NULL;\n"
            f"END $$")


def postgres_count_trigger():
    return (f"CREATE TRIGGER posts_counts\n"
            f"AFTER UPDATE OF {', '.join(COUNTED_COLUMNS)} OR DELETE ON posts\n"
            f"FOR EACH ROW EXECUTE FUNCTION vesti_count_posts()")


###############################################################################
# Schema and migrations #######################################################
###############################################################################
# The tables, their upgrades, the search index, opening a database.

SCHEMA = """\
CREATE TABLE IF NOT EXISTS sources (
    id INTEGER PRIMARY KEY,
    slug TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL DEFAULT '',
    crawler TEXT NOT NULL DEFAULT 'rss',
    url TEXT NOT NULL DEFAULT '',
    direction TEXT,
    priority INTEGER NOT NULL DEFAULT 0,
    enabled INTEGER NOT NULL DEFAULT 1,
    status TEXT NOT NULL DEFAULT 'alive',
    last_fetch TEXT,
    last_error TEXT,
    error_count INTEGER NOT NULL DEFAULT 0,
    next_fetch_at TEXT,
    post_count INTEGER NOT NULL DEFAULT 0,
    -- Its rhythm: when it last brought new posts, the gaps between them
    -- (seconds, JSON, the latest last), since when it has been silent.
    last_new_at TEXT,
    rhythm TEXT,
    silent_since TEXT,
    -- Figures for the operator, refreshed after each of its runs and once
    -- workers classified its posts.
    week_posts INTEGER NOT NULL DEFAULT 0,
    relevant_share REAL,
    approved INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE IF NOT EXISTS posts (
    id INTEGER PRIMARY KEY,
    source_id INTEGER,
    external_id TEXT,
    url TEXT,
    canonical_url TEXT,
    title TEXT NOT NULL DEFAULT '',
    text TEXT NOT NULL DEFAULT '',
    content_type TEXT NOT NULL DEFAULT 'full',
    sha256 TEXT,
    fetched_at TEXT NOT NULL DEFAULT (datetime('now')),
    published_at TEXT,
    status TEXT NOT NULL DEFAULT 'new',
    classified INTEGER DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    claimed_at TEXT,
    claim_token TEXT,
    next_attempt_at TEXT,
    error TEXT,
    direction TEXT,
    relevance INTEGER,
    interest INTEGER,
    summary TEXT,
    article_url TEXT,
    edited_at TEXT,
    keywords TEXT,
    reason TEXT,
    decided_at TEXT,
    decided_by TEXT,
    story_id INTEGER,
    -- 1: the entry gave no date (or one far in the future), so published_at
    -- is the time it was fetched.
    undated INTEGER NOT NULL DEFAULT 0,
    -- What a Telegram post said as the channel last gave it (its words and a
    -- teaser's link, see words_sha256): an edit is told apart from the
    -- article fetched in place of a teaser.
    words_sha256 TEXT,
    -- The verdicts of its earlier words (JSON, {words_sha256: verdict}, the
    -- last few): an edit back to them is not classified again.
    verdicts TEXT,
    -- The decision an edit of its words took back, who made it and when, and
    -- the title and text it was made on: the desk shows the post as edited
    -- after that decision until it is decided again.
    old_decision TEXT,
    old_decided_at TEXT,
    old_decided_by TEXT,
    old_title TEXT,
    old_text TEXT,
    -- The chance (0-1) that an editor approves it in its direction, from the
    -- direction's learned model; NULL while the direction has none.
    likely REAL,
    -- What its decision counts as in its direction's learned model (the
    -- decision, the direction), NULL when it counts as nothing: a story's
    -- decision counts once, as its first post (see learn_decisions).
    learned_as TEXT,
    learned_in TEXT,
    -- Of a copy: the sites and channels it links to or names that its
    -- story's first post does not (space-separated). Such a copy is in its
    -- story but never leads it, so it is never what is shown, published,
    -- exported or alerted for it; its card shows them as the copy's own.
    adds TEXT
);
-- The queue: each state has its own small index, so a claim or a completion
-- touches only the indexes of the states it leaves and enters, and each
-- queue size is counted from its index alone. The claim takes the oldest
-- pending post; leases look at claims by age; done today counts completed
-- posts by fetched_at.
CREATE INDEX IF NOT EXISTS posts_pending ON posts(id, classified) WHERE classified IS NULL OR classified = 0;
CREATE INDEX IF NOT EXISTS posts_claimed ON posts(claimed_at, classified) WHERE classified = -1;
CREATE INDEX IF NOT EXISTS posts_failed ON posts(classified) WHERE classified = -2;
CREATE INDEX IF NOT EXISTS posts_done ON posts(fetched_at, classified) WHERE classified = 1;
CREATE INDEX IF NOT EXISTS posts_sha256 ON posts(sha256);
CREATE INDEX IF NOT EXISTS posts_canonical_url ON posts(canonical_url);
CREATE INDEX IF NOT EXISTS posts_external_id ON posts(source_id, external_id);
-- A channel's recent posts (re-read for edits) without walking all of its posts.
CREATE INDEX IF NOT EXISTS posts_source_time ON posts(source_id, published_at);
-- The desk: classified posts of one decision, newest first or by a score.
CREATE INDEX IF NOT EXISTS posts_desk ON posts(status, published_at, id) WHERE classified = 1;
CREATE INDEX IF NOT EXISTS posts_desk_relevance ON posts(status, relevance, published_at, id) WHERE classified = 1;
CREATE INDEX IF NOT EXISTS posts_desk_interest ON posts(status, interest, published_at, id) WHERE classified = 1;
CREATE INDEX IF NOT EXISTS posts_desk_likely ON posts(status, (coalesce(likely, relevance / 10.0)), published_at, id) WHERE classified = 1;
CREATE INDEX IF NOT EXISTS posts_decided ON posts(status, decided_at);
-- A direction's latest decisions, shown to the LLM as examples.
CREATE INDEX IF NOT EXISTS posts_learned ON posts(learned_in, decided_at) WHERE learned_as IS NOT NULL;

CREATE TABLE IF NOT EXISTS rss_state (
    source_id INTEGER PRIMARY KEY,
    etag TEXT,
    modified TEXT,
    last_build_date TEXT,
    last_error TEXT,
    status TEXT,
    http_status INTEGER,
    body_sha256 TEXT,
    moved_to TEXT,
    keep_fragments INTEGER NOT NULL DEFAULT 0,
    ttl INTEGER,
    updated_at TEXT
);

CREATE TABLE IF NOT EXISTS tg_state (
    source_id INTEGER PRIMARY KEY,
    last_message_id INTEGER NOT NULL DEFAULT 0,
    updated_at TEXT,
    channel_id INTEGER,
    access_hash INTEGER,
    username TEXT
);

CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY,
    source_id INTEGER,
    task TEXT NOT NULL DEFAULT '',
    trigger TEXT NOT NULL DEFAULT 'cli',
    started_at TEXT NOT NULL DEFAULT (datetime('now')),
    finished_at TEXT,
    status TEXT NOT NULL DEFAULT 'running',
    new_posts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    pid INTEGER
);
CREATE INDEX IF NOT EXISTS runs_source ON runs(source_id, id);

-- New posts per source and UTC day: the last week's figure on /crawlers.
CREATE TABLE IF NOT EXISTS source_days (
    source_id INTEGER NOT NULL,
    day TEXT NOT NULL,
    new_posts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (source_id, day)
);

-- Facts the processes leave for each other: the web page's token secret, the
-- workers' last sign of life, Ollama's state.
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT,
    updated_at TEXT
);

-- Monotonic counters for /metrics (fetch outcomes, new posts, LLM calls and
-- their latency), kept here so they survive a restart.
CREATE TABLE IF NOT EXISTS counters (
    name TEXT NOT NULL,
    labels TEXT NOT NULL DEFAULT '',
    value REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (name, labels)
);

-- Classified posts counted by decision, direction and relevance (and the same
-- per source): the desk's filter counts without scanning posts. Overall a
-- story counts once, as the desk shows it; per source every post counts. Posts up to
-- meta 'indexed_to' are counted here and searchable in posts_fts; newer ones
-- are added in batches (index_new_posts), which costs a tenth of doing it
-- row by row as they are stored. Triggers keep what is already in step.
CREATE TABLE IF NOT EXISTS post_counts (
    status TEXT NOT NULL,
    direction TEXT NOT NULL,
    relevance INTEGER NOT NULL,
    liked INTEGER NOT NULL,
    n INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (status, direction, relevance, liked)
);
CREATE TABLE IF NOT EXISTS source_post_counts (
    source_id INTEGER NOT NULL,
    status TEXT NOT NULL,
    direction TEXT NOT NULL,
    relevance INTEGER NOT NULL,
    liked INTEGER NOT NULL,
    n INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (source_id, status, direction, relevance, liked)
);
-- Each direction's model learned from the editors' decisions (see Learning
-- in vesti.py): the decisions it learned from, and per feature (a word, a
-- pair of words, a source) in how many approved and rejected posts it was.
-- version grows with every change and marks the features it changed, so a
-- process reads only what changed since it last read; epoch grows with
-- each rebuild.
CREATE TABLE IF NOT EXISTS learners (
    direction TEXT PRIMARY KEY,
    approved INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 0,
    epoch INTEGER NOT NULL DEFAULT 1,
    since TEXT,
    updated_at TEXT
);
CREATE TABLE IF NOT EXISTS learned_words (
    direction TEXT NOT NULL,
    feature TEXT NOT NULL,
    approved INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (direction, feature)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS learned_words_version ON learned_words(direction, version);
CREATE INDEX IF NOT EXISTS learned_words_seen ON learned_words(direction, (approved + rejected));
-- Posts whose decision changed and is not counted in learned_words yet: a
-- decision notes its posts here and answers; whichever process next judges
-- by the models counts them (learn_owed), several decisions in one go.
CREATE TABLE IF NOT EXISTS learn_pending (
    post_id INTEGER PRIMARY KEY
);
-- The newsroom's accounts (see Editors in vesti.py): passwords only as salted
-- scrypt hashes; role viewer, editor or admin. A session is kept as the
-- sha256 of its cookie, with the token its forms carry; events record who
-- did what, when and from which address. name_key: the name as sign-in
-- compares it (NFKC, case folded); settings: the account of VESTI_WEB_USER,
-- whose hash is that of the settings' password.
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY,
    role TEXT NOT NULL DEFAULT 'editor',
    password_hash TEXT NOT NULL,
    disabled INTEGER NOT NULL DEFAULT 0,
    created_at TEXT,
    password_changed_at TEXT,
    name_key TEXT,
    settings INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS users_key ON users(name_key);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    user_name TEXT NOT NULL,
    form_token TEXT NOT NULL,
    created_at TEXT,
    last_seen_at TEXT,
    address TEXT
);
CREATE INDEX IF NOT EXISTS sessions_user ON sessions(user_name);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    at TEXT NOT NULL,
    user_name TEXT,
    address TEXT,
    action TEXT NOT NULL,
    subject TEXT,
    detail TEXT
);
CREATE INDEX IF NOT EXISTS events_subject ON events(subject, id);
-- Wrong passwords of the last LOGIN_WINDOW, whatever process checked them:
-- when, from which address (an IPv6 client's /64), for which name (its
-- key); the locks are counted from them.
CREATE TABLE IF NOT EXISTS sign_in_failures (
    id INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    address TEXT NOT NULL,
    user_key TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sign_in_failures_user ON sign_in_failures(user_key, at);
CREATE INDEX IF NOT EXISTS sign_in_failures_address ON sign_in_failures(address, at);
-- Who is looking at which card now (the desk's "Anna is looking").
CREATE TABLE IF NOT EXISTS looks (
    post_id INTEGER NOT NULL,
    user_name TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (post_id, user_name)
);
-- Where approved posts go (see Publishing in vesti.py), from sources.yaml's
-- publish: list, with what the senders keep of each: its pace (last_sent_at),
-- a pause a 429 asked for, and the one sender allowed at a time (sender, its
-- lease until sender_until). alerts_from: the first post an alert target has
-- not looked at yet.
CREATE TABLE IF NOT EXISTS targets (
    name TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    address TEXT NOT NULL,
    directions TEXT,
    every REAL NOT NULL DEFAULT 0,
    min_relevance INTEGER,
    min_likely REAL,
    per_hour INTEGER,
    enabled INTEGER NOT NULL DEFAULT 1,
    paused_until TEXT,
    last_sent_at TEXT,
    sender TEXT,
    sender_until TEXT,
    error TEXT,
    alerts_from INTEGER
);
-- One row per post and target: the publication's state (queued, sending,
-- published, failed, uncertain, cancelled; see Publications in vesti.py),
-- the post as it was approved (item, JSON), the text to send (plain text,
-- editable until it is sent), and what became of it: the message and the
-- chat it went to. token: the send under way; idempotency_key: the same on
-- every try of one publication; hurry: "publish now"; retract: taken back
-- after it was sent, to be deleted where it went; version: counts the
-- row's changes, so that an action names the row it was asked on.
CREATE TABLE IF NOT EXISTS publications (
    id INTEGER PRIMARY KEY,
    post_id INTEGER NOT NULL,
    target TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued',
    text TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    message_id TEXT,
    queued_at TEXT,
    sent_at TEXT,
    token TEXT,
    next_attempt_at TEXT,
    hurry INTEGER NOT NULL DEFAULT 0,
    retract INTEGER NOT NULL DEFAULT 0,
    deleted_at TEXT,
    idempotency_key TEXT,
    updated_by TEXT,
    item TEXT,
    chat TEXT,
    version INTEGER NOT NULL DEFAULT 0,
    UNIQUE (post_id, target)
);
CREATE INDEX IF NOT EXISTS publications_order ON publications(target, state, hurry, queued_at, id);
-- The triggers that keep them are made from one description of what they
-- count (COUNT_EVENTS in vesti.py).
""" + sqlite_count_triggers() + """
-- Full-text search over title and text (SQLite FTS5; where a Python build
-- lacks it, search falls back to LIKE).
CREATE VIRTUAL TABLE IF NOT EXISTS posts_fts USING fts5(title, text, content='posts', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
CREATE TRIGGER IF NOT EXISTS posts_fts_update AFTER UPDATE OF title, text ON posts WHEN old.id <= (SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'indexed_to') BEGIN INSERT INTO posts_fts (posts_fts, rowid, title, text) VALUES ('delete', old.id, old.title, old.text); INSERT INTO posts_fts (rowid, title, text) VALUES (new.id, new.title, new.text); END;
CREATE TRIGGER IF NOT EXISTS posts_fts_delete AFTER DELETE ON posts WHEN old.id <= (SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'indexed_to') BEGIN INSERT INTO posts_fts (posts_fts, rowid, title, text) VALUES ('delete', old.id, old.title, old.text); END;
-- Stories: the near-duplicate keys (MinHash bands of its text and of its lead)
-- of every post the workers have looked at; a post's look-up for its story
-- is a few index seeks. Keys of posts older than VESTI_STORY_HOURS are pruned.
CREATE TABLE IF NOT EXISTS story_keys (
    key INTEGER NOT NULL,
    post_id INTEGER NOT NULL,
    PRIMARY KEY (key, post_id)
) WITHOUT ROWID;
-- A story's copies (its first post is found by its id) in the order they
-- came: a card reads its first few and counts a capped number of them along
-- the index, however many there are. Every query of them says
-- `story_id != id`, or the index could not be used for it.
CREATE INDEX IF NOT EXISTS posts_story ON posts(story_id, id) WHERE story_id IS NOT NULL AND story_id != id;
-- Runs still marked running: a stopped or killed crawl leaves them behind.
CREATE INDEX IF NOT EXISTS runs_running ON runs(pid) WHERE status = 'running';
"""


def schema_statements(fts5=FTS5):
    """SCHEMA as statements, comments dropped, in the order they can run:
    tables, then indexes, then triggers. Without FTS5 the search table and
    its triggers are left out."""
    statements = ["\n".join(line for line in chunk.splitlines() if not line.startswith("--")).strip()
                  for chunk in sql_statements(SCHEMA)]
    statements = [s for s in statements if s and (fts5 or "posts_fts" not in s)]

    def kind(statement):
        return ("CREATE TABLE", "CREATE VIRTUAL", "CREATE INDEX", "CREATE TRIGGER").index(
            " ".join(statement.split()[:2]))
    return sorted(statements, key=kind)


@functools.lru_cache(maxsize=None)
def schema_columns():
    """(table, column, type, default) of every column of SCHEMA's tables, as
    a fresh in-memory copy of SCHEMA tells them."""
    fresh = sqlite3.connect(":memory:")
    for statement in schema_statements(fts5=False):
        if statement.startswith("CREATE TABLE"):
            fresh.execute(statement)
    columns = tuple((table, column, kind, default)
                    for (table,) in fresh.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                    for _, column, kind, _, default, _ in fresh.execute(f"PRAGMA table_info({table})"))
    fresh.close()
    return columns


def missing_columns(conn):
    """(table, column, type, default) for every column SCHEMA has and `conn`
    lacks."""
    have = {}
    for table, column, kind, default in schema_columns():
        if table not in have:
            have[table] = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in have[table]:
            yield table, column, kind, default


def add_column(conn, table, column, kind, default):
    """ALTER TABLE cannot add a column whose default is an expression such as
    datetime('now'); such a column is added bare and filled in."""
    if default is not None and "(" in default:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        conn.execute(f"UPDATE {table} SET {column} = {default}")
    else:
        clause = f" DEFAULT {default}" if default is not None else ""
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}{clause}")
    fill_added(conn, table, column)


# What an older database's rows need once a column is added: posts dated
# after they were fetched (a feed's clock ahead) are dated at their fetch,
# as posts are stored since (a search under newest first counts on it).
def plain_publication_texts(conn):
    """Telegram texts kept before texts were kept as plain text hold the Bot
    API's HTML: made plain (a link as its address), as editors edit them
    now and as they are sent."""
    for row in conn.execute("""SELECT id, text FROM publications WHERE text IS NOT NULL
                                   AND target IN (SELECT name FROM targets
                                                  WHERE kind IN ('telegram', 'alert'))""").fetchall():
        text = re.sub(r'<a href="([^"]*)">.*?</a>', lambda m: m[1], row["text"], flags=re.S)
        conn.execute("UPDATE publications SET text = ? WHERE id = ?",
                     (html.unescape(re.sub(r"<[^>]*>", "", text)), row["id"]))


def user_keys(conn):
    for row in conn.execute("SELECT name FROM users").fetchall():
        conn.execute("UPDATE users SET name_key = ? WHERE name = ?", (user_key(row[0]), row[0]))
    for names in same_name_keys(conn):
        log.warning("%s", same_names_said(names))


def same_name_keys(conn):
    """[[name, ...]] of enabled accounts whose names only case (or another
    way of writing a letter) tells apart: an older release let them be
    made. Once all but one are disabled, the name is one account's again."""
    groups = collections.defaultdict(list)
    for name, key in conn.execute("SELECT name, name_key FROM users WHERE disabled = 0 "
                                  "ORDER BY name"):
        groups[key].append(name)
    return [names for names in groups.values() if len(names) > 1]


def same_names_said(names):
    return (f"the accounts {', '.join(names)} differ only in how their names are written: "
            f"each signs in only by its name exactly as written here, any other spelling as "
            f"{names[0]}; keep one and disable the others (user disable NAME)")


# ... once its item (the post as approved) is kept, a publication's text is
# plain text; users are found by their name's key.
WHEN_ADDED = {("posts", "undated"):
              "UPDATE posts SET published_at = fetched_at WHERE published_at > fetched_at",
              ("publications", "item"): plain_publication_texts,
              ("users", "name_key"): user_keys}


def fill_added(conn, table, column):
    fill = WHEN_ADDED.get((table, column))
    if callable(fill):
        fill(conn)
    elif fill:
        conn.execute(fill)


# What an older database has and this one does not: queue indexes replaced by
# one per state, and row-by-row triggers replaced by index_new_posts.
OBSOLETE = ("DROP INDEX IF EXISTS posts_queue", "DROP INDEX IF EXISTS posts_candidates",
            "DROP TRIGGER IF EXISTS posts_counted", "DROP TRIGGER IF EXISTS posts_fts_insert")


def schema_is_current(existing, statements):
    """Whether a SQLite database's objects ({name: sql} of sqlite_master)
    are SCHEMA's word for word: SQLite keeps each CREATE as it ran, without
    IF NOT EXISTS, and rewrites a table's when a column is added. Then
    migrate has nothing to do, and takes no write lock."""
    return all(existing.get(statement.split()[-1]) is None for statement in OBSOLETE) and \
        all(existing.get(re.search(r"IF NOT EXISTS (\w+)", statement)[1]) ==
            statement.replace(" IF NOT EXISTS", "", 1) for statement in statements)


@redoable
def migrate(conn):
    """Create what is missing, idempotently: tables, the columns an older
    database lacks, indexes and triggers (one whose definition changed is
    replaced); what mirrors posts (counts, search) is rebuilt when new. An
    up-to-date database opens at once."""
    if conn.dialect is POSTGRES:
        return migrate_postgres(conn)
    statements = schema_statements()
    tables = [s for s in statements if s.startswith(("CREATE TABLE", "CREATE VIRTUAL"))]
    existing = dict(conn.execute("SELECT name, sql FROM sqlite_master"))
    if schema_is_current(existing, statements) and get_meta(conn, INDEXED_TO)[0] is not None:
        return
    recount = False
    with transaction(conn):
        if "post_counts" in existing and not key_columns_counted(
                {row[1] for row in conn.execute("PRAGMA table_info(post_counts)")}):
            drop_count_tables(conn)
            recount = True
        for statement in tables:
            conn.execute(statement)
        for missing in list(missing_columns(conn)):
            add_column(conn, *missing)
        for statement in OBSOLETE:
            conn.execute(statement)
        for statement in statements[len(tables):]:
            kind, name = statement.split()[1], statement.split()[5]
            if name in existing and existing[name] != statement.replace(" IF NOT EXISTS", "", 1):
                conn.execute(f"DROP {kind} {name}")
                # A count trigger replaced may have counted by another rule until now.
                recount |= name in {event.trigger for event in COUNT_EVENTS}
            conn.execute(statement)
        if "post_counts" not in existing or (FTS5 and "posts_fts" not in existing):
            reindex_posts(conn)
            return
        if get_meta(conn, INDEXED_TO)[0] is None:
            # Kept in step row by row until now: every post is in.
            set_meta(conn, INDEXED_TO, conn.execute("SELECT coalesce(max(id), 0) FROM posts").fetchone()[0])
        if recount:
            count_again(conn)


# SCHEMA is the one description of the tables and indexes; PostgreSQL's are
# made from it by changing only the column definitions of its tables (no
# name, comment, table constraint or index is touched), and in them only:
# - a column's type: POSTGRES_TYPES (SQLite's INTEGER holds 64 bits and its
#   REAL is a double);
# - the definition `id INTEGER PRIMARY KEY` (SQLite's rowid): POSTGRES_ID;
# - a default: POSTGRES_DEFAULTS (one the table does not list is kept);
# and a table's closing `) WITHOUT ROWID` is `)`.
POSTGRES_NOW = "to_char(timezone('UTC', now()), 'YYYY-MM-DD HH24:MI:SS')"
POSTGRES_TYPES = {"INTEGER": "BIGINT", "REAL": "DOUBLE PRECISION", "TEXT": "TEXT"}
POSTGRES_ID = {"id INTEGER PRIMARY KEY": "id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"}
POSTGRES_DEFAULTS = {"datetime('now')": POSTGRES_NOW}
# A line of one of SCHEMA's tables that defines a column (a DEFAULT comes last).
COLUMN_DEFINITION = re.compile(r"(?P<indent> +)(?P<name>\w+) (?P<type>\w+)(?P<constraints>.*?)"
                               r"(?: DEFAULT (?P<default>.+?))?(?P<comma>,?)")
TABLE_CONSTRAINTS = ("PRIMARY", "UNIQUE", "CHECK", "FOREIGN", "CONSTRAINT")

# The tables whose ids PostgreSQL's identity sequences give (POSTGRES_ID).
IDENTITY_TABLES = tuple(statement.split()[5] for statement in schema_statements(fts5=False)
                        if statement.startswith("CREATE TABLE") and
                        any(line.strip().rstrip(",") in POSTGRES_ID for line in statement.splitlines()))

# The desk's counts, kept by one trigger function (see COUNT_EVENTS); ids
# given explicitly (a copy, a test) move the id sequences past them, as
# SQLite's next id follows the largest; and the search index (FTS5's part):
# (name, how to drop it, how to create it).
POSTGRES_EXTRA = (
    ("vesti_count_posts", "", postgres_count_function()),
    ("posts_counts", "DROP TRIGGER IF EXISTS posts_counts ON posts", postgres_count_trigger()),
    *((f"{table}_ids_ahead", f"DROP TRIGGER IF EXISTS {table}_ids_ahead ON {table}", f"""
CREATE OR REPLACE FUNCTION vesti_{table}_ids_ahead() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM setval('{table}_id_seq', top) FROM (SELECT max(id) AS top FROM inserted) t
        WHERE top >= (SELECT last_value + is_called::int FROM {table}_id_seq);
    RETURN NULL;
END $$;
CREATE TRIGGER {table}_ids_ahead AFTER INSERT ON {table} REFERENCING NEW TABLE AS inserted
FOR EACH STATEMENT EXECUTE FUNCTION vesti_{table}_ids_ahead()""") for table in IDENTITY_TABLES),
    ("post_words", "", """
CREATE TABLE IF NOT EXISTS post_words (post_id BIGINT PRIMARY KEY, words tsvector NOT NULL)"""),
    ("post_words_search", "DROP INDEX IF EXISTS post_words_search", """
CREATE INDEX post_words_search ON post_words USING gin (words)"""),
    ("posts_words", "DROP TRIGGER IF EXISTS posts_words ON posts", f"""
CREATE OR REPLACE FUNCTION vesti_post_words() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF old.id > (SELECT CAST(value AS BIGINT) FROM meta WHERE key = 'indexed_to') THEN
        RETURN NULL;
    ELSIF TG_OP = 'DELETE' THEN
        DELETE FROM post_words WHERE post_id = old.id;
    ELSE
        UPDATE post_words SET words = {PostgresDialect.WORDS.format(p="new.")}
            WHERE post_id = new.id;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER posts_words AFTER UPDATE OF title, text OR DELETE ON posts
FOR EACH ROW EXECUTE FUNCTION vesti_post_words()"""),
)


# What an older PostgreSQL database has and this one does not: the search
# index that was on posts itself (its words are in post_words now).
POSTGRES_OBSOLETE = ("DROP INDEX IF EXISTS posts_search",)


def postgres_table(statement):
    """One of SCHEMA's CREATE TABLE statements as PostgreSQL says it (see
    POSTGRES_TYPES)."""
    head, *lines, end = statement.splitlines()
    return "\n".join([head, *map(postgres_line, lines), end.removesuffix(" WITHOUT ROWID")])


def postgres_line(line):
    column = COLUMN_DEFINITION.fullmatch(line)
    if column is None or column["name"] in TABLE_CONSTRAINTS:     # a comment, a PRIMARY KEY (…)
        return line
    definition = postgres_column(*column.group("name", "type", "constraints", "default"))
    return f"{column['indent']}{definition}{column['comma']}"


def postgres_column(name, kind, constraints, default):
    """A column's definition as PostgreSQL says it (see POSTGRES_TYPES);
    `default` as SCHEMA writes it or PRAGMA table_info gives it, or None."""
    if default is None:
        return POSTGRES_ID.get(f"{name} {kind}{constraints}",
                               f"{name} {POSTGRES_TYPES[kind]}{constraints}")
    return f"{name} {POSTGRES_TYPES[kind]}{constraints} DEFAULT {postgres_default(default)}"


def postgres_default(default):
    expression = default[1:-1] if default.startswith("(") else default
    return f"({POSTGRES_DEFAULTS[expression]})" if expression in POSTGRES_DEFAULTS else default


def postgres_schema():
    """(name, drop, create) of every object of PostgreSQL's schema, in the
    order they can be made: SCHEMA's tables and indexes (the same table
    definitions), then POSTGRES_EXTRA."""
    objects = []
    for statement in schema_statements(fts5=False):
        if statement.startswith("CREATE TABLE"):
            objects.append((statement.split()[5], "", postgres_table(statement)))
        elif statement.startswith("CREATE INDEX"):
            name = statement.split()[5]
            objects.append((name, f"DROP INDEX IF EXISTS {name}", statement))
    return objects + [(name, drop, create.strip()) for name, drop, create in POSTGRES_EXTRA]


def migrate_postgres(conn):
    """migrate for PostgreSQL: what is missing is created, the columns an
    older database lacks are added, an index or trigger whose definition
    changed is made again. The schema's digest in meta makes an up-to-date
    database open at once; the write lock makes one process migrate at a time."""
    objects = postgres_schema()
    version = hashlib.sha256(repr(objects).encode()).hexdigest()[:16]
    if conn.execute("SELECT to_regclass('meta')").fetchone()[0] and \
            get_meta(conn, "pg_schema")[0] == version:
        return
    with transaction(conn):
        fresh = None in conn.execute("SELECT to_regclass('post_counts'), "
                                     "to_regclass('post_words')").fetchone()
        recount = not fresh and not key_columns_counted({row[0] for row in conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = 'post_counts'")})
        if recount:
            drop_count_tables(conn)
        for statement in POSTGRES_OBSOLETE:
            conn.execute(statement)
        for _, _, create in objects:
            if create.startswith("CREATE TABLE"):
                conn.execute(create, None)
        have = {(r[0], r[1]) for r in conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema()")}
        for table, column, kind, default in schema_columns():
            if (table, column) not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN "
                             f"{postgres_column(column, kind, '', default)}")
                fill_added(conn, table, column)
        for name, drop, create in objects:
            digest = hashlib.sha256(create.encode()).hexdigest()[:16]
            if not create.startswith("CREATE TABLE") and \
                    get_meta(conn, f"pg_ddl:{name}")[0] != digest:
                if drop:
                    conn.execute(drop)
                conn.execute(create, None)
                set_meta(conn, f"pg_ddl:{name}", digest)
                # A count function replaced may have counted by another rule until now.
                recount |= name in ("vesti_count_posts", "posts_counts") and not fresh
        if fresh:
            reindex_posts(conn)
        elif get_meta(conn, INDEXED_TO)[0] is None:
            set_meta(conn, INDEXED_TO, conn.execute("SELECT coalesce(max(id), 0) FROM posts").fetchone()[0])
        if recount:
            count_again(conn)
        set_meta(conn, "pg_schema", version)


def key_columns_counted(columns):
    """Whether count tables of these columns count by every key column (an
    older database's count by fewer)."""
    return set(COUNT_TABLES[0].key) <= columns


def drop_count_tables(conn):
    """Count tables of an older key go, to be made and counted again (and
    their zero rows made ready again, see ready_counts)."""
    for table in COUNT_TABLES:
        conn.execute(f"DROP TABLE IF EXISTS {table.name}")
    conn.execute("DELETE FROM meta WHERE key = 'count_keys'")


def reindex_posts(conn):
    """Count and index every post again (a database from before the count
    tables or the search index)."""
    for table in COUNT_TABLES:
        conn.execute(f"UPDATE {table.name} SET n = 0")
    conn.dialect.clear_search(conn)
    conn.executemany("INSERT INTO post_counts (status, direction, relevance, liked, n) "
                     "VALUES ('new', '', ?, ?, 0) ON CONFLICT DO NOTHING",
                     [(r, liked) for r in RELEVANCES for liked in LIKED])
    set_meta(conn, INDEXED_TO, 0)
    index_new_posts(conn)


def index_new_posts(conn):
    """Count and index the posts stored since the last call (ids above the
    mark), in the caller's transaction. In one batch this costs a tenth of
    what triggers cost row by row. Returns how many posts it took in."""
    top = conn.execute("SELECT coalesce(max(id), 0) FROM posts").fetchone()[0]
    mark = get_meta(conn, INDEXED_TO)[0]
    if mark is None:
        return reindex_posts(conn)
    mark = settle_index_mark(conn, int(mark), top)
    if mark >= top:
        return 0
    ready_source_counts(conn, mark + 1, top)
    conn.dialect.index_search(conn, mark, top)
    count_posts(conn, mark, top)
    set_meta(conn, INDEXED_TO, top)
    return top - mark


def settle_index_mark(conn, mark=None, top=None):
    """Lower the mark when the newest posts were deleted after they were
    taken in: SQLite hands their ids out again, and the posts that get them
    must be taken in too. Returns the mark."""
    if top is None:
        top = conn.execute("SELECT coalesce(max(id), 0) FROM posts").fetchone()[0]
    if mark is None:
        mark = int(get_meta(conn, INDEXED_TO)[0] or 0)
    if mark > top:
        set_meta(conn, INDEXED_TO, top)
        return top
    return mark


def count_posts(conn, after, last):
    """Add the counted posts with ids after..last to the count tables."""
    for table in COUNT_TABLES:
        columns = ", ".join(table.key)
        values = ", ".join(counted_value(column) for column in table.key)
        conn.execute(f"""INSERT INTO {table.name} ({columns}, n)
                         SELECT {values}, count(*) FROM posts
                         WHERE id > ? AND id <= ? AND {counted(table)}
                         GROUP BY {values}
                         ON CONFLICT ({columns}) DO UPDATE SET n = {table.name}.n + excluded.n""",
                     (after, last))


@redoable
def recount_posts(conn):
    """Count the counted posts again, in one transaction: heals a count the
    completion trigger could not keep (a post of a direction gone from
    sources.yaml, a relevance set by hand out of range). `run` does it daily."""
    with transaction(conn):
        count_again(conn)


def count_again(conn):
    for table in COUNT_TABLES:
        conn.execute(f"UPDATE {table.name} SET n = 0")
    count_posts(conn, 0, int(get_meta(conn, INDEXED_TO)[0] or 0))


RELEVANCES = range(11)


@redoable
def ready_counts(conn, directions):
    """The zero rows a completion adds one to (decision 'new', each direction
    and none, each relevance; overall and for every source), so that the
    completion trigger only updates. Done again only when the directions or
    the sources have changed."""
    directions = sorted({"", *directions})
    signature = json.dumps([directions, *conn.execute(
        "SELECT count(*), coalesce(max(id), 0) FROM sources").fetchone()])
    if get_meta(conn, "count_keys")[0] == signature:
        return
    with transaction(conn):
        conn.executemany("""INSERT INTO post_counts (status, direction, relevance, liked, n)
                            VALUES ('new', ?, ?, ?, 0) ON CONFLICT DO NOTHING""",
                         [(d, r, liked) for d in directions for r in RELEVANCES for liked in LIKED])
        conn.execute("""INSERT INTO source_post_counts
                            (source_id, status, direction, relevance, liked, n)
                        SELECT s.id, 'new', k.direction, k.relevance, k.liked, 0
                        FROM sources s JOIN post_counts k ON k.status = 'new'
                        WHERE true ON CONFLICT DO NOTHING""")
        set_meta(conn, "count_keys", signature)


def ready_source_counts(conn, first, last):
    """The zero rows of the sources of posts first..last that have none yet
    (a source added without a sync, a post with no source)."""
    conn.execute("""INSERT INTO source_post_counts
                        (source_id, status, direction, relevance, liked, n)
                    SELECT b.source_id, 'new', k.direction, k.relevance, k.liked, 0
                    FROM (SELECT DISTINCT coalesce(source_id, 0) AS source_id FROM posts
                          WHERE id >= ? AND id <= ?) b
                    JOIN post_counts k ON k.status = 'new'
                    WHERE NOT EXISTS (SELECT 1 FROM source_post_counts c
                                      WHERE c.source_id = b.source_id AND c.status = 'new')
                    ON CONFLICT DO NOTHING""",
                 (first, last))


@redoable
def catch_up_index(conn):
    """Take the posts stored since the last call into the counts and the
    search index: done by the workers between batches and by the page and
    /metrics before they read counts, so a crawl's writes stay short.
    Writes only when there is something to take in."""
    top, indexed = conn.execute(f"""SELECT coalesce(max(id), 0),
        (SELECT value FROM meta WHERE key = '{INDEXED_TO}') FROM posts""").fetchone()
    if str(top) != indexed:
        with transaction(conn):
            index_new_posts(conn)


# Connections the web server keeps open between requests.
IDLE_CONNECTIONS = 4


class Database:
    """The SQLite file or the PostgreSQL database: one connection per
    thread, schema applied once. Its connections serve the threads of
    `process` (None: a Process of its own)."""

    def __init__(self, path, busy_timeout=30, process=None):
        self.path, self.busy_timeout = path, busy_timeout
        self.process = process or Process()
        self._local = threading.local()
        self._idle, self._idle_lock = [], threading.Lock()
        self.opened = False         # once it has been, a server restarting is waited for
        try:
            migrate(self.conn())
        except sqlite3.DatabaseError as e:
            raise ConfigError(f"{redacted(path)}: cannot open the database: {e}") from None
        self.opened = True

    def conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = self._local.conn = open_connection(self.path, self.busy_timeout,
                                                          self.opened, self.process)
            except sqlite3.OperationalError as e:
                # A missing directory or no permission: the setting is wrong.
                raise ConfigError(f"{redacted(self.path)}: cannot open the database: {e}") from None
        return conn

    def close(self):
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    @contextlib.contextmanager
    def closing(self):
        """For work on a short-lived or pooled thread: its connection is
        closed at the end, not left to the garbage collector."""
        try:
            yield self
        finally:
            self.close()

    @contextlib.contextmanager
    def lent(self):
        """For a thread that lives one web request: a connection lent from a
        few kept open (opening one costs more than most pages), given back
        at the end."""
        with self._idle_lock:
            conn = self._idle.pop() if self._idle else None
        self._local.conn = conn or open_connection(self.path, self.busy_timeout, self.opened,
                                                   self.process)
        try:
            yield self
        finally:
            conn, self._local.conn = self._local.conn, None
            with self._idle_lock:
                kept = len(self._idle) < IDLE_CONNECTIONS and not conn.in_transaction
                if kept:
                    self._idle.append(conn)
            if not kept:
                conn.close()


###############################################################################
# Stories #####################################################################
###############################################################################
# The same news in other words: keys, look-ups, leads, a story's verdict for its copies, the key helper.

# The same news in other words, found without a model: a post's text becomes
# word shingles (three words in a row, Unicode-aware, numbers kept as written,
# links and @handles dropped), MinHash signatures of its whole text and of its
# lead, and LSH band keys kept in story_keys. A look-up seeks its own keys,
# and checks the few posts found against its own text exactly: the same
# story shares most of its wording (or, for a teaser, its lead is the other's
# opening), and carries no number the other lacks ("QEMU 10.0" is not
# "QEMU 10.1").
STORY_WORD = re.compile(r"\w+(?:[.,:/-]\w+)*")
STORY_NOISE = re.compile(r"https?://\S+|www\.\S+|t\.me/\S+|@\w+")
SHINGLE = 3
LEAD_WORDS = 40
LEAD_NUMBERS = 20        # a teaser may stop anywhere after this many words
# Bands of two rows: a pair of texts with half their shingles in common meets
# in one of eight bands nine times in ten. Each key is one index entry to
# write per post (a random page of story_keys), so a post has twelve, not more.
BAND_ROWS = 2
BODY_BANDS = 8
LEAD_BANDS = 4
SAME_WORDING = 0.5       # Jaccard of shingles
SAME_LEAD = 0.8          # share of a teaser's shingles found in the article
TEASER_SHARE = 0.6       # a teaser has at most this share of the article's shingles
STORY_CANDIDATES = 20
# Fewer words than this ("Photo of the day", "Read more…") tell no story apart.
STORY_MIN_WORDS = 12
# A copy whose story's first post is still being classified waits this long.
STORY_WAIT = 10
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def story_words(title, text):
    """The words a story is recognised by: the text's, or with a bare text
    (a caption, a headline-only entry) the title's too."""
    words = STORY_WORD.findall(STORY_NOISE.sub(" ", (text or "").casefold()))
    if len(words) < SHINGLE * 3:
        words = STORY_WORD.findall(STORY_NOISE.sub(" ", f"{title or ''} {text or ''}".casefold()))
    return words


def shingle_hashes(words):
    """Stable 32-bit hashes of the word shingles in order (the same in every
    process): the CRC-32 of each SHINGLE words in a row, joined by spaces."""
    if len(words) < SHINGLE:
        return [zlib.crc32(" ".join(words).encode())] if words else []
    # Encoded in one go: a word has no space in it.
    encoded = " ".join(words).encode().split(b" ")
    return list(map(zlib.crc32, map(b" ".join, zip(*(encoded[i:] for i in range(SHINGLE))))))


def shingles(words):
    return set(shingle_hashes(words))


def minhash(hashes, count):
    """A MinHash signature of `count` values (a power of two) in one pass:
    each shingle's mixed hash falls in one of `count` bins, each bin keeps
    its least value, and an empty bin borrows from the next full one (one
    permutation hashing, densified by rotation)."""
    bits = count.bit_length() - 1
    shift, low = 64 - bits, (1 << (64 - bits)) - 1
    bins = [None] * count
    for h in hashes:
        mixed = (h * _GOLDEN) & _MASK64
        slot, value = mixed >> shift, mixed & low
        if bins[slot] is None or value < bins[slot]:
            bins[slot] = value
    signature = list(bins)
    for slot in range(count):
        distance = 1
        while signature[slot] is None:
            borrowed = bins[(slot + distance) % count]
            if borrowed is not None:
                signature[slot] = borrowed + distance * low
            distance += 1
    return signature


_blake2b_64 = functools.partial(hashlib.blake2b, digest_size=8)
_BAND_VALUES = ", ".join(["%d"] * BAND_ROWS)


def band_keys(signature, kind, numbers):
    """One 63-bit key per band of BAND_ROWS values. The numbers of the text
    are part of every key: posts from one template with other figures
    ("QEMU 10.0" and "10.1", today's rates) never even meet."""
    # Each key is the hash of the repr of (kind, band, [its values], numbers).
    head, rest = f"({kind!r}, ", f"], {numbers!r})"
    bands = enumerate(zip(*(signature[row::BAND_ROWS] for row in range(BAND_ROWS))))
    texts = [f"{head}{band}, [{_BAND_VALUES % values}{rest}".encode() for band, values in bands]
    digests = b"".join([digest.digest() for digest in map(_blake2b_64, texts)])
    return [key >> 1 for key in struct.unpack(f">{len(texts)}Q", digests)]


def story_keys(words):
    """The lead's band keys (every post: a teaser is all lead), and the whole
    text's when it is longer than its lead; none for a text too short to
    tell one story from another."""
    if len(words) < STORY_MIN_WORDS:
        return []
    hashes = shingle_hashes(words)
    lead = words[:LEAD_WORDS]
    keys = band_keys(minhash(hashes[:len(lead) - SHINGLE + 1], LEAD_BANDS * BAND_ROWS), "lead",
                     sorted(numbers_of(lead[:LEAD_NUMBERS])))
    if len(words) > LEAD_WORDS:
        keys += band_keys(minhash(hashes, BODY_BANDS * BAND_ROWS), "body",
                          sorted(numbers_of(words)))
    return keys


HAS_DIGIT = re.compile(r"\d").search


def numbers_of(words):
    return {word for word in words if not word.isalpha() and HAS_DIGIT(word)}


def same_story(words, other_words):
    """Checked exactly: the same wording, or a teaser that is the other's
    opening; and no number in the shorter that the longer lacks."""
    small, large = sorted((words, other_words), key=len)
    if not numbers_of(small) <= numbers_of(large):
        return False
    a, b = shingles(small), shingles(large)
    if not a or not b:
        return False
    shared = len(a & b)
    if shared / len(a | b) >= SAME_WORDING:
        return True
    return len(a) <= TEASER_SHARE * len(b) and shared / len(a) >= SAME_LEAD


# A copy takes its story's verdict unseen, is shown under its card and is
# decided with it: it is taken on trust for what the story's first post says,
# and for no more. A copy with much text of its own is no copy: it is
# classified on its own words and is a card of its own, which deciding the
# story leaves alone. "Much": more than ADDED_SHARE of its shingles are not
# the first post's. On the labelled set a changed sentence adds up to 0.44 of
# a copy's shingles, boilerplate around it 0.1; all of a post's words and as
# many again, 0.5. A teaser is all a story's first post may say of it: when
# that post ends cut short ("…"), a copy may go on where it stops (its
# article). A copy that adds a link to another site or names another channel
# (the lead and "Read more: <link>" most reposts are, or an advert around a
# copied post) is in its story all the same, but what it adds is its own
# (posts.adds): it never leads the story (see may_lead), so the card, what is
# published, exported and alerted are the first post's, and the card names
# the copy's links as the copy's.
ADDED_SHARE = 0.45
STORY_LINK = re.compile(r"https?://[^\s<>\"']+|www\.[^\s<>\"']+")
# Each Telegram channel is a site of its own (t.me/<channel>). A repost's
# source line ("Источник: @channel https://t.me/channel/4821", "via @channel")
# names the channel it comes from: a link to that channel adds nothing.
TELEGRAM_CHANNEL = re.compile(r"(?:https?://)?(?:www\.)?(?:t|telegram)\.me/(?:s/)?(\w+)", re.I)
SOURCE_NAMED = re.compile(r"(?<!\w)(?:источник|source|via)\s*[:—-]?\s*"
                          r"(?:@|(?:https?://)?(?:www\.)?(?:t|telegram)\.me/(?:s/)?)(\w+)", re.I)
CUT_SHORT = re.compile(r"(?:…|\.\.\.|\[…\]|\[\.\.\.\])\s*$")
# A channel named in a text ("Подписывайтесь: @casino").
CHANNEL_NAMED = re.compile(r"(?<![\w@./])@(\w{4,32})")
# "More than a few sentences of its own", whatever the length of the text
# around them: a sentence (at least SENTENCE_WORDS words) is the copy's own
# when less than a fifth of its shingles are the first post's. One changed
# sentence, a source line or "Read more: <link>" are not a few.
OWN_SENTENCES = 3
SENTENCE_WORDS = 5
SENTENCE_END = re.compile(r"(?<=[.!?…])\s+|\n\s*\n")


def goes_on(words, text, lead_words, lead_text):
    """True when a copy (its words and text) says much of its own beside
    its story's first post: more than ADDED_SHARE of its shingles, or
    OWN_SENTENCES sentences, are not the first post's (one cut short may be
    gone on from)."""
    if CUT_SHORT.search(lead_text or ""):
        return False
    own, lead = shingles(words), shingles(lead_words)
    return len(own - lead) > ADDED_SHARE * len(own) or own_sentences(text, lead) >= OWN_SENTENCES


def own_sentences(text, lead):
    """How many sentences of `text` are its own beside the shingles `lead`."""
    counted = 0
    for sentence in SENTENCE_END.split(STORY_NOISE.sub(" ", (text or "").casefold())):
        words = STORY_WORD.findall(sentence)
        if len(words) >= SENTENCE_WORDS:
            mine = shingles(words)
            counted += len(mine & lead) < 0.2 * len(mine)
    return counted


def teaser_of(words, lead_words):
    """True when a post is no more than the opening of another (see same_story)."""
    return len(shingles(words)) <= TEASER_SHARE * len(shingles(lead_words))


def added_sites(text, lead_text, lead_url, mentions=True):
    """The sites (and, with `mentions`, the channels named) a copy links to
    that its story's first post (its text and address) does not, nor the
    channel the copy names as its source."""
    named = {f"t.me/{channel.lower()}" for channel in SOURCE_NAMED.findall(text or "")}
    return link_sites(text, mentions) - link_sites(lead_text) - {link_site(lead_url or "")} - named


def adds_to(words, text, lead_words, lead_text, lead_url):
    """True when a post carries what another (its words, text and address)
    does not: much text of its own (goes_on), or a link to a site of its
    own (added_sites; a handle named in an article is no advert)."""
    return goes_on(words, text, lead_words, lead_text) or \
        bool(added_sites(text, lead_text, lead_url, mentions=False))


def link_sites(text, mentions=True):
    """The sites a text links to (see link_site), and the channels it names."""
    sites = {link_site(link) for link in STORY_LINK.findall(text or "")}
    if mentions:
        sites |= {f"t.me/{channel.lower()}" for channel in CHANNEL_NAMED.findall(text or "")}
    return sites


def link_site(link):
    """A link's host (www. left out), or t.me/<channel> for a Telegram channel's."""
    channel = TELEGRAM_CHANNEL.match(link)
    return f"t.me/{channel[1].lower()}" if channel else link_host(link)


def link_host(link):
    with contextlib.suppress(ValueError):
        host = urllib.parse.urlsplit(link if "://" in link else f"http://{link}").hostname or ""
        return host.removeprefix("www.").rstrip(".")
    return ""


def copies_of(table=""):
    """The copies of one story (a parameter: its first post's id), said as
    the posts_story index has them (`table`: the posts' alias and a dot)."""
    return f"({table}story_id = ? AND {table}story_id != {table}id)"


# A post entering its story: its id, the title and text its words are taken
# from (only needed when it has candidates to check), story_keys and story_since.
StoryEntry = collections.namedtuple("StoryEntry", "post_id title text keys since")


# A story's first post is its card on the desk and what the approved feeds
# export: there the copy of an established source stands rather than a new
# source's (a site that copies the news first, with its own address on it).
# A source is established once its first post was fetched ESTABLISHED_AFTER
# ago. Its first post is the one dated earliest (one index seek): no post is
# dated after its fetch, so a source seems as new as it is, or newer, never
# older. The lead changes while nobody has decided the story: a decided card
# stays as the editor decided it.
ESTABLISHED_AFTER = 7 * 86400
SOURCE_SINCE = """(SELECT f.fetched_at FROM posts f WHERE f.source_id = p.source_id
                   AND f.published_at IS NOT NULL ORDER BY f.published_at LIMIT 1)"""


def is_new_source(since, now=None):
    """True for a source whose first post (SOURCE_SINCE) is recent, or unknown."""
    return since is None or since > utc_text((time.time() if now is None else now)
                                             - ESTABLISHED_AFTER)


def newest_with_keys(conn, keys):
    """{key: ids of the newest posts with it, newest first}, a few more than
    STORY_CANDIDATES: a key thousands of posts share (a story reposted
    everywhere, a flood of near-identical posts) costs no more than a rare
    one, as each key's newest are sought in the index from its
    (STORY_CANDIDATES + 1)th newest, not counted out of all its posts."""
    found = collections.defaultdict(list)
    for wanted, values in conn.dialect.id_table(sorted(set(keys))):
        rows = conn.execute(f"""
            SELECT s.key, s.post_id FROM {wanted}
            JOIN story_keys s ON s.key = wanted.column1 AND s.post_id >= coalesce(
                (SELECT f.post_id FROM story_keys f WHERE f.key = wanted.column1
                 ORDER BY f.post_id DESC LIMIT 1 OFFSET {STORY_CANDIDATES}), 0)
            ORDER BY s.key, s.post_id DESC""", values)
        for key, post_id in rows.fetchall():
            found[key].append(post_id)
    return found


def story_candidates(stored, entries):
    """{post id: the posts to check it against, oldest first}: for each of
    its keys the newest STORY_CANDIDATES posts with it (stored, or entered
    before it), then the posts most of its keys lead to."""
    seen = collections.Counter(itertools.chain.from_iterable(entry.keys for entry in entries))
    shared = {key for key, times in seen.items() if times > 1} | stored.keys()
    entered = collections.defaultdict(list)
    for entry in entries:
        for key in shared.intersection(entry.keys):
            entered[key].append(entry.post_id)
    candidates = {}
    for entry in entries:
        if shared.isdisjoint(entry.keys):       # most posts: a story of their own
            candidates[entry.post_id] = []
            continue
        counted = collections.Counter()
        for key in [key for key in entry.keys if key in shared]:
            before = entered[key][:entered[key].index(entry.post_id)]
            ids = {i for i in stored.get(key, ()) if i != entry.post_id}.union(before)
            counted.update(sorted(ids, reverse=True)[:STORY_CANDIDATES])
        ranked = sorted(counted.items(), key=lambda item: (-item[1], -item[0]))
        candidates[entry.post_id] = sorted(i for i, _ in ranked[:STORY_CANDIDATES])
    return candidates


def candidate_posts(conn, ids):
    """{id: the row} of the posts a look-up checks, and of the first posts
    of their stories (what a copy is checked against, see adds_to)."""
    found = story_posts(conn, ids)
    found.update(story_posts(conn, {row["story_id"] for row in found.values()}
                             - found.keys() - {None}))
    return found


def story_posts(conn, ids):
    found = {}
    for among, values in conn.dialect.among("p.id", sorted(ids)):
        found.update((row["id"], row) for row in conn.execute(
            f"""SELECT p.id, p.fetched_at, p.story_id, p.title, p.text, p.url,
                       {SOURCE_SINCE} AS source_since FROM posts p WHERE {among}""",
            values).fetchall())
    return found


def find_stories(conn, entries):
    """{post id: (its story (the story's first post's id), or None; the
    sites it adds to it)} for entries looked up together, in order: one may
    find the story of one before it. Candidates are checked exactly, oldest
    first, among the posts fetched since the entry's `since`; a story the
    entry goes on from with much text of its own (goes_on), or whose first
    post, from a new source, adds to the entry, is not its story; the sites
    and channels the entry adds to its story's first post are its own
    (added_sites). An entry's own text stands for its stored text (which an
    article fetched for it may have replaced). Words are worked out for the
    posts checked, and only once."""
    candidates = story_candidates(newest_with_keys(conn, [k for e in entries for k in e.keys]),
                                  entries)
    rows = candidate_posts(conn, {i for ids in candidates.values() for i in ids}
                           | {post_id for post_id, ids in candidates.items() if ids})
    texts = {entry.post_id: (entry.title, entry.text) for entry in entries}
    words = {}

    def told(post_id):
        return texts.get(post_id) or (rows[post_id]["title"], rows[post_id]["text"])

    def words_of(post_id):
        if post_id not in words:
            words[post_id] = story_words(*told(post_id))
        return words[post_id]

    def added_to_story(entry, story, candidate):
        """What the entry adds to the story (a set of sites), or None when
        it is no copy of it."""
        lead = story if story in rows else candidate
        mine, theirs = (words_of(entry.post_id), entry.text), (words_of(lead), told(lead)[1])
        if goes_on(*mine, *theirs):
            return None
        # A new source's first post is trusted no more than a copy: a post it
        # adds to does not join its story (nor lead it, see lead_after), but
        # a teaser of it, its lead reposted, is what every article has.
        if is_new_source(rows[lead]["source_since"]) and not teaser_of(mine[0], theirs[0]) and \
                adds_to(*theirs, *mine, rows[entry.post_id]["url"] if entry.post_id in rows else ""):
            return None
        return added_sites(entry.text, theirs[1], rows[lead]["url"])

    stories = {}
    for entry in entries:
        stories[entry.post_id] = (None, set())
        for candidate in candidates[entry.post_id]:
            row = rows.get(candidate)
            if row is None or row["fetched_at"] < entry.since or \
                    not same_story(words_of(entry.post_id), words_of(candidate)):
                continue
            story = (stories[candidate][0] if candidate in stories else row["story_id"]) or candidate
            sites = added_to_story(entry, story, candidate)
            if sites is not None:
                stories[entry.post_id] = (story, sites)
                break
    return stories


def story_since(hours, now=None):
    """The oldest fetch time of the posts a story is looked for among."""
    return utc_text((time.time() if now is None else now) - hours * 3600)


def enter_stories(conn, entries):
    """In the caller's transaction: each entry's story (found, or its own),
    its keys kept for the posts to come; returns {post id: story}. A post
    that led a story and now joins another takes its copies along. A copy
    is written into its story at once, so that it moves with the story
    (take_over_story, leave_story) until its verdict is written; a post
    that starts its story is written as such with its verdict (until then
    its NULL story_id says the same)."""
    found = find_stories(conn, entries)
    stories = {post_id: story or post_id for post_id, (story, _) in found.items()}
    for post_id, story in stories.items():
        if story != post_id:
            conn.execute(f"UPDATE posts SET story_id = ? WHERE {copies_of()} OR id = ?",
                         (story, post_id, post_id))
            sites = found[post_id][1]
            conn.execute("UPDATE posts SET adds = ? WHERE id = ?",
                         (" ".join(sorted(sites)) or None, post_id))
    # In key order: each index page the keys land on is visited once.
    conn.dialect.store_story_keys(conn, [(key, entry.post_id) for entry in entries
                                         for key in entry.keys])
    return stories


def join_story(conn, post_id, title, text, hours, now=None):
    """The story of a post with this title and text (see enter_now)."""
    return enter_now(conn, StoryEntry(post_id, title, text, story_keys(story_words(title, text)),
                                      story_since(hours, now)))


@redoable
def enter_now(conn, entry):
    """enter_stories for one post, in a transaction of its own, one at a
    time with the other stories' (not with the rest), so two copies looked
    at the same moment end in one story."""
    with transaction(conn, shared=True, stories=True):
        return enter_stories(conn, [entry])[entry.post_id]


# A post's verdict, from the classify step that gives it to the queue that writes it.
@dataclasses.dataclass(slots=True)
class Verdict:
    """What a post is classified as (VERDICT_FIELDS, the columns a copy
    takes from its story), and what comes along to be written with it.
    Updated with dataclasses.replace, never in place."""
    direction: str = None       # a direction's id; None: no topic fits
    relevance: int = 0          # 0-10
    interest: int = 0           # 0-10
    summary: str = ""
    keywords: str = None        # the keywords found (matched_keywords)
    reason: str = None          # the LLM's word on why it scored so
    likely: float = None        # the chance an editor approves it (posts.likely)
    text: str = None            # the article's full text, stored over the summary
    story: int = None           # the story it leads, written as its story_id
    story_entry: StoryEntry = None  # its story, entered as the verdict is written
    llm_seconds: float = None   # how long the LLM took; None: it was not asked
    joined: bool = False        # it joined a story (counted: stories_joined)
    llm_saved: bool = False     # it took its story's verdict: no LLM call (llm_calls_saved)


VERDICT_FIELDS = ("direction", "relevance", "interest", "summary", "keywords", "reason", "likely")


def story_verdict(conn, story):
    """The verdict of a story's first post once it is classified; None when it
    cannot give one (it failed, or is gone); StoryPending while it waits."""
    row = conn.execute(f"SELECT classified, {', '.join(VERDICT_FIELDS)} FROM posts WHERE id = ?",
                       (story,)).fetchone()
    if row is None or row["classified"] == FAILED:
        return None
    if row["classified"] != DONE:
        raise StoryPending(story)
    return Verdict(**{key: row[key] for key in VERDICT_FIELDS})


def settle_stories(conn, completions):
    """Quick posts (no LLM call to save) enter their stories as their
    verdicts are written, in the same transaction, and take their story's
    verdict when there is one (not a story led by a post of this batch:
    its verdict is not written yet). Returns the completions with the
    story of each post that leads one (a copy's is written already, see
    enter_stories), and whether it joined one."""
    stories = enter_stories(conn, [verdict.story_entry for _, verdict in completions
                                   if verdict.story_entry is not None])
    found = {}
    for post, _ in completions:
        story = stories.get(post.id)
        if story in (None, post.id):
            continue
        with contextlib.suppress(StoryPending):
            found[post.id] = story_verdict(conn, story)
            lead = lead_after(conn, story, post.id, found[post.id])
            # The posts of this batch in that story are in the lead's.
            stories.update({p: lead for p, s in stories.items() if s == story})
    return [(post, verdict if post.id not in stories else
             settled_verdict(verdict, post.id, stories[post.id], found.get(post.id)))
            for post, verdict in completions]


def settled_verdict(verdict, post_id, story, found):
    """The verdict of a post entered in `story` (settle_stories), with the
    story's verdict `found` (None: it has none for the post to take)."""
    if found is not None:
        # What the post is classified as is its story's; the rest stays its own.
        verdict = dataclasses.replace(verdict, **{key: getattr(found, key)
                                                  for key in VERDICT_FIELDS})
    return dataclasses.replace(verdict, story=post_id if story == post_id else verdict.story,
                               joined=story != post_id or found is not None)


def leads_instead(lead, copy, now=None):
    """True when a copy should lead its story rather than its first post
    (rows of status, old_decision, adds and source_since): an established
    source's copy of an undecided story a new source told first, one that
    adds nothing of its own. A post edited after its decision is not taken
    over: it would be hidden under the copy's card instead of being decided
    again."""
    return lead["status"] == "new" and lead["old_decision"] is None and not copy["adds"] and \
        is_new_source(lead["source_since"], now) and not is_new_source(copy["source_since"], now)


def lead_after(conn, story, post_id, verdict):
    """The first post of a story from now on, as a copy that joined it sees
    it (with the story's `verdict`, None when it has none): the copy, when
    the story's first post failed or is gone (or its copies would stay
    behind a card that is not there) or when leads_instead; else the same.
    A copy that adds sites of its own never leads: with no verdict to take,
    it leaves the story and is a post of its own."""
    rows = {row["id"]: row for row in conn.execute(
        f"SELECT p.id, p.status, p.old_decision, p.adds, {SOURCE_SINCE} AS source_since "
        f"FROM posts p WHERE p.id IN (?, ?)", (story, post_id))}
    if verdict is not None and (story not in rows or post_id not in rows or
                                not leads_instead(rows[story], rows[post_id])):
        return story
    if post_id in rows and rows[post_id]["adds"]:
        conn.execute("UPDATE posts SET story_id = NULL, adds = NULL WHERE id = ?", (post_id,))
        return post_id
    take_over_story(conn, story, post_id)
    return post_id


@redoable
def lead_now(conn, story, post_id, verdict):
    """lead_after in a transaction of its own, one at a time with the
    entries of stories (see enter_now), for a copy that entered `story` and
    read its `verdict` in transactions before. The story may have moved on
    since (another copy took it over, an edit took its lead out of it): it
    is the one the copy's row names now, as a copy moves with its story
    (enter_stories). One moved on from a lead without a verdict is waited
    for (StoryPending): its new lead is a copy classified on its own."""
    with transaction(conn, shared=True, stories=True):
        row = conn.execute("SELECT story_id FROM posts WHERE id = ?", (post_id,)).fetchone()
        if row is None:                 # gone meanwhile: it leads nothing
            return story
        now = story if row[0] is None else row[0]
        if now == post_id:              # an edit made it its story's lead
            return post_id
        if now != story and verdict is None:
            raise StoryPending(now)
        return lead_after(conn, now, post_id, verdict)


def take_over_story(conn, story, post_id):
    """The copies of a story and its first post are this post's from now on.
    One statement: in the caller's transaction, or a transaction of its own."""
    conn.execute(f"UPDATE posts SET story_id = ? WHERE {copies_of()} OR id IN (?, ?)",
                 (post_id, story, story, post_id))


def story_figures(conn):
    """Stories with copies, posts that joined one, LLM calls saved."""
    counted = counters(conn)
    stories = conn.execute("""SELECT count(DISTINCT story_id) FROM posts
                              WHERE story_id IS NOT NULL AND story_id != id""").fetchone()[0]
    return {"stories": stories,
            "joined": int(counted.get("stories_joined", {}).get("", 0)),
            "llm_calls_saved": int(counted.get("llm_calls_saved", {}).get("", 0))}


@redoable
def prune_story_keys(conn, hours, now=None):
    """Forget the keys of posts older than the story window."""
    since = utc_text((time.time() if now is None else now) - hours * 3600)
    first = conn.execute("SELECT min(id) FROM posts WHERE fetched_at >= ?", (since,)).fetchone()[0]
    with transaction(conn):
        return conn.execute("DELETE FROM story_keys WHERE post_id < ?",
                            (first if first is not None else 1 << 62,)).rowcount


# With keywords alone deciding, working out a post's story keys (pure Python)
# is half of what the post costs, and a worker's threads share one
# interpreter: a batch of at least KeyHelper.batch quick posts has its keys
# worked out in a helper process, on another core, while the worker
# classifies it (in requests of KEY_HELPER_CHUNK posts, so the first come
# back soon). The helper starts with the first such batch, and only where
# this process may use more than one core.
KEY_HELPER_CHUNK = 128
# A helper that has not answered in this long is taken to be stuck.
KEY_HELPER_WAIT = 60


def serve_story_keys(requests=None, answers=None):
    """The helper process of KeyHelper: for each line of JSON [[title, text],
    ...] read, a line of JSON with their story keys, in order, until its
    input ends. Signals are for the worker: it closes the input to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    requests, answers = requests or sys.stdin.buffer, answers or sys.stdout.buffer
    with contextlib.suppress(BrokenPipeError):
        for line in requests:
            keys = [story_keys(story_words(title, text)) for title, text in json.loads(line)]
            answers.write(json.dumps(keys, separators=(",", ":")).encode() + b"\n")
            answers.flush()


class KeyHelper:
    """Story keys worked out by a helper process (serve_story_keys), asked
    for in the background: ask() returns a Future at once. Questions go
    out and answers come back in order, one line of JSON each, through a
    writer and a reader thread. Once the helper is gone (it cannot start,
    it died), every question fails with HelperGone at once, and the caller
    works the keys out itself."""

    # -I keeps the helper from the environment's Python settings; -B then
    # carries over the one that says not to write bytecode.
    command = [sys.executable, "-I", *(["-B"] if sys.dont_write_bytecode else []), "-c",
               "import sys; sys.path.insert(0, sys.argv[1]); import vesti; vesti.serve_story_keys()",
               os.path.dirname(os.path.abspath(__file__))]
    batch = 32      # a batch of fewer quick posts is worked out in the worker

    def __init__(self):
        self.lock = threading.RLock()
        self.process = None
        self.questions = queue.SimpleQueue()    # (future, pairs) to write
        self.asked = collections.deque()        # (future, how many pairs) written, not answered
        self.gone = None                        # why the helper stopped

    def ask(self, pairs):
        """A Future of the story keys of these (title, text) pairs."""
        future = Future()
        with self.lock:
            if self.process is None and self.gone is None:
                self.start()
            if self.gone is None:
                self.questions.put((future, pairs))
                return future
        future.set_exception(HelperGone(self.gone))
        return future

    def start(self):
        try:
            self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except (OSError, ValueError) as e:
            self.give_up(f"the helper process for story keys did not start ({e})")
            return
        for target, name in ((self.write, "key-questions"), (self.read, "key-answers")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def write(self):
        pipe = self.process.stdin
        while (question := self.questions.get()) is not None:
            future, pairs = question
            with self.lock:
                if self.gone is not None:
                    future.set_exception(HelperGone(self.gone))
                    continue
                self.asked.append((future, len(pairs)))
            try:
                pipe.write(json.dumps(pairs).encode() + b"\n")
                pipe.flush()
            except (OSError, ValueError):
                self.give_up(self.ended())
        with contextlib.suppress(OSError):
            pipe.close()

    def read(self):
        for line in self.process.stdout:
            with self.lock:
                future, count = self.asked.popleft() if self.asked else (None, 0)
            try:
                keys = json.loads(line)
            except ValueError:
                keys = None
            if future is None or not isinstance(keys, list) or len(keys) != count:
                self.give_up("the helper process for story keys answered out of turn")
                if future is not None:
                    future.set_exception(HelperGone(self.gone))
                self.process.kill()
                break
            future.set_result(keys)
        self.give_up(self.ended())

    def ended(self):
        """Why the helper is gone: it exited (or, no longer talking, is made to)."""
        try:
            code = self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        return f"the helper process for story keys stopped (exit code {code})"

    def give_up(self, reason, quietly=False):
        """Fail every question not answered. The first reason stays, and is
        said once (unless `quietly`)."""
        with self.lock:
            first, self.gone = self.gone is None, self.gone or reason
            waiting, self.asked = list(self.asked), collections.deque()
        if first and not quietly:
            log.warning("%s; story keys are worked out in the worker from now on", reason)
        for future, _ in waiting:
            future.set_exception(HelperGone(self.gone))

    def close(self):
        """Stop the helper (its input closes, it exits), saying nothing."""
        self.give_up("the helper process was closed", quietly=True)
        process = self.process
        if process is None:
            return
        self.questions.put(None)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# A card names this many of its story's other posts and counts the rest up
# to STORY_COUNTED ("+1000+ sources"): a story thousands of posts joined costs
# its card what a story of a thousand does.
STORY_NAMED = 10
STORY_COUNTED = 1000
# A card's story line: the other posts it names (rows of id, url, source) and
# how many other posts its story has (STORY_COUNTED: at least that many).
StoryLine = collections.namedtuple("StoryLine", "named count")


def story_copies(conn, posts):
    """{card's post id: its StoryLine} for the cards of a page: the story's
    first post, then its copies in the order they came."""
    stories = sorted({post.story_id for post in posts if post.story_id is not None})
    members = {row["id"]: [row] for row in story_leads(conn, stories)}
    for row in first_copies(conn, stories):
        members.setdefault(row["story_id"], []).append(row)
    lines = {}
    for post in posts:
        story = members.get(post.story_id, ())
        others = [member for member in story if member["id"] != post.id]
        if others:
            count = story[0]["copies"] if story[0]["id"] == post.story_id else len(others)
            lines[post.id] = StoryLine(others[:STORY_NAMED], count)
    return lines


def story_leads(conn, stories):
    """The first posts of these stories (id, url, source), each with how many
    copies its story has, up to STORY_COUNTED (counted in the copies' index)."""
    if not stories:
        return []
    return conn.execute(f"""
        SELECT p.id, p.url, s.name AS source, p.adds,
               (SELECT count(*) FROM (SELECT 1 FROM posts c WHERE c.story_id = p.id
                                      AND c.story_id != c.id ORDER BY c.id
                                      LIMIT {STORY_COUNTED}) AS c) AS copies
        FROM posts p LEFT JOIN sources s ON s.id = p.source_id
        WHERE p.id IN ({", ".join("?" * len(stories))})""", stories).fetchall()


def first_copies(conn, stories):
    """The first STORY_NAMED + 1 copies of each of these stories (story_id,
    id, url, source), in the order they came: read along the copies' index,
    however many there are."""
    if not stories:
        return []
    return conn.execute(" UNION ALL ".join(f"""
        SELECT * FROM (SELECT p.story_id, p.id, p.url, s.name AS source, p.adds
                       FROM posts p LEFT JOIN sources s ON s.id = p.source_id
                       WHERE {copies_of("p.")} ORDER BY p.id LIMIT {STORY_NAMED + 1}) AS story{n}"""
                                             for n in range(len(stories))), stories).fetchall()


###############################################################################
# Queue #######################################################################
###############################################################################
# Posts in, claims, verdicts out: the queue's states and transitions.

# posts.classified: the queue's states (NULL counts as pending), and the
# one function that moves a post along each arrow:
#
#   from        to          by
#   (stored)    PENDING     store_posts
#   DONE        PENDING     reword_post (a Telegram edit into other words)
#   PENDING     PROCESSING  claim_posts, claim_post (a claim token and a lease)
#   PROCESSING  DONE        complete_post, complete_and_claim (the claim still ours)
#   PROCESSING  PENDING     release_post (after a backoff), defer_post (not the
#                           post's fault: Ollama away, its story's verdict not in),
#                           expire_leases (its worker died), release_claims,
#                           give_back_posts, take_claim_back (edited meanwhile)
#   PROCESSING  FAILED      release_post, expire_leases (its attempts used up)
#   PENDING     (sooner)    wake_story_copies (its story's verdict came)
#
# A state changes in one statement or one short transaction, guarded by the
# claim token where a worker holds the post.
PENDING, PROCESSING, DONE, FAILED = 0, -1, 1, -2
IS_PENDING = f"(classified IS NULL OR classified = {PENDING})"


def queue_sizes(conn):
    """The four queue numbers, from posts alone (each from its state's index)."""
    row = conn.execute(f"""
        SELECT (SELECT count(*) FROM posts WHERE {IS_PENDING}) AS pending,
               (SELECT count(*) FROM posts WHERE classified = {PROCESSING}) AS processing,
               (SELECT count(*) FROM posts WHERE classified = {DONE}
                                           AND fetched_at >= ?) AS done_today,
               (SELECT count(*) FROM posts WHERE classified = {FAILED}) AS failed
    """, (utc_text()[:10],)).fetchone()
    return dict(row)


def pending_count(conn):
    """queue_sizes' first number alone (a page's banner asks for no more)."""
    return conn.execute(f"SELECT count(*) FROM posts WHERE {IS_PENDING}").fetchone()[0]


def waiting_count(conn, cap):
    """Posts pending or processing, counted up to `cap` each (from their
    states' indexes): a page's note needs no more, and a first crawl's
    queue counted whole would cost more than the page."""
    return conn.execute(f"""
        SELECT (SELECT count(*) FROM (SELECT 1 FROM posts WHERE {IS_PENDING} LIMIT ?) AS p)
             + (SELECT count(*) FROM (SELECT 1 FROM posts WHERE classified = {PROCESSING}
                                      LIMIT ?) AS c)""", (cap, cap)).fetchone()[0]


def process_claims(pid=None):
    """The LIKE pattern of every claim token of a process."""
    return f"{os.getpid() if pid is None else pid}-%"


def claim_post(conn, now=None):
    """Take the oldest claimable post, or None. One statement, so two workers
    can never hold the same post."""
    posts = claim_posts(conn, 1, now)
    return posts[0] if posts else None


# What a worker gets of a post it claims.
CLAIMED = """id, source_id, url, article_url, title, text, content_type, attempts, claim_token,
             old_decision,
             (SELECT url FROM sources WHERE sources.id = posts.source_id) AS source_url"""


class Claimed(typing.NamedTuple):
    """A post as a worker holds it from its claim to its verdict, made from
    the row in one place (claimed). `content_type` "summary": its article
    (`article_url`, else `url`) is read for the full text; `source_url`, the
    feed's, is where a relative link is read from; `old_decision`, an
    editor's decision an edit of the post took back."""
    id: int
    title: str
    text: str
    url: str = None
    content_type: str = "full"
    source_id: int = None
    article_url: str = None
    attempts: int = 1
    claim_token: str = None
    old_decision: str = None
    source_url: str = None


def claimed(rows):
    """The claimed posts of these rows (of CLAIMED), by id."""
    return sorted((Claimed(**{name: row[name] for name in Claimed._fields}) for row in rows),
                  key=operator.attrgetter("id"))


def claim_posts(conn, limit, now=None, token=None, choose=None):
    """Take up to `limit` of the oldest claimable posts, each with a claim
    token of its own (the claim's token and the post's id). `choose`, when
    given, picks the ids to take from a window of the oldest claimable
    posts, CLAIM_LOOKAHEAD more than `limit`: [(id, content_type, the link
    of its article)] (see pass_over_busy_hosts)."""
    now_text, token = utc_text(now), token or conn.process.claim_token()
    if choose is not None:
        window = conn.execute(conn.dialect.claim_window.format(pending=IS_PENDING),
                              (now_text, limit + CLAIM_LOOKAHEAD)).fetchall()
        return claim_ids(conn, choose(window)[:limit], now_text, token)
    return claimed(conn.execute(f"""
        UPDATE posts SET classified = {PROCESSING}, claimed_at = ?,
                         claim_token = ? || '-' || id, attempts = attempts + 1
        WHERE {conn.dialect.claimable.format(pending=IS_PENDING)}
        RETURNING {CLAIMED}
    """, (now_text, token, now_text, limit)).fetchall())


# A claim that chooses its posts sees this many more of the oldest claimable ones.
CLAIM_LOOKAHEAD = 256


def claim_ids(conn, ids, now_text, token):
    """claim_posts for these posts, those still pending; by id."""
    posts = []
    for among, values in conn.dialect.among("id", ids):
        posts += conn.execute(f"""
            UPDATE posts SET classified = {PROCESSING}, claimed_at = ?,
                             claim_token = ? || '-' || id, attempts = attempts + 1
            WHERE {among} AND {IS_PENDING}
            RETURNING {CLAIMED}
        """, (now_text, token, *values)).fetchall()
    return claimed(posts)


def claimed_under(conn, token):
    """The posts claimed with this claim token and still held: a claim done
    again after its commit was lost on the way back (see complete_and_claim)."""
    # No ORDER BY: SQLite would walk every post in id order instead of the
    # few held ones in their own index (posts_claimed).
    return claimed(conn.execute(f"SELECT {CLAIMED} FROM posts WHERE classified = {PROCESSING} "
                                f"AND claim_token LIKE ?", (f"{token}-%",)).fetchall())


# What complete_post returns of a post: what counting it needs (see
# count_completions).
COMPLETED = f"posts.id, {counting('posts.')}"


def complete_post(conn, post_id, token, verdict):
    """Write the classification (and the article's full text, when phase 3
    fetched it), only if the claim is still ours; returns what the counts
    need of the post, or None. The text is only written when there is a new
    one: search reindexes a post whose text is set. A worker's completion is
    counted by its caller (see count_completions)."""
    article = ", text = :text, content_type = 'full'" if verdict.text else ""
    cursor = conn.execute(f"""
        UPDATE posts SET classified = {DONE}, direction = :direction, relevance = :relevance,
                         interest = :interest, summary = :summary, keywords = :keywords,
                         reason = :reason, likely = :likely, error = NULL, claim_token = NULL,
                         story_id = coalesce(:story, story_id){article}
        WHERE id = :id AND classified = {PROCESSING} AND claim_token = :token
        RETURNING {COMPLETED}
    """, {"direction": verdict.direction, "relevance": verdict.relevance,
          "interest": verdict.interest, "summary": verdict.summary,
          "keywords": verdict.keywords, "reason": verdict.reason, "likely": verdict.likely,
          "text": verdict.text, "story": verdict.story, "id": post_id,
          "token": token})
    return cursor.fetchone()


def complete_posts(conn, completions):
    """complete_post for many (claimed post, verdict), those without a new
    text in one statement per hundred (one round trip to a server, one
    statement for SQLite to run); the rows returned, in order."""
    done = {}
    plain = [(post, verdict) for post, verdict in completions if not verdict.text]
    for first in range(0, len(plain), 100):
        chunk = plain[first:first + 100]
        values = [(post.id, post.claim_token, verdict.direction, verdict.relevance,
                   verdict.interest, verdict.summary, verdict.keywords,
                   verdict.reason, verdict.story, verdict.likely) for post, verdict in chunk]
        # VALUES names its columns column1, column2, … in both dialects; the
        # casts tell PostgreSQL the types of parameters that may all be NULL.
        marks = "(CAST(? AS INTEGER), ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        rows = conn.execute(f"""
            UPDATE posts SET classified = {DONE}, direction = v.column3,
                             relevance = CAST(v.column4 AS INTEGER),
                             interest = CAST(v.column5 AS INTEGER), summary = v.column6,
                             keywords = v.column7, reason = v.column8, error = NULL,
                             claim_token = NULL,
                             story_id = coalesce(CAST(v.column9 AS INTEGER), posts.story_id),
                             likely = CAST(v.column10 AS REAL)
            FROM (VALUES {", ".join([marks] * len(values))}) AS v
            WHERE posts.id = v.column1 AND posts.classified = {PROCESSING}
              AND posts.claim_token = v.column2
            RETURNING {COMPLETED}""", list(itertools.chain.from_iterable(values))).fetchall()
        done.update((row["id"], row) for row in rows)
    for post, verdict in completions:
        if verdict.text:
            done[post.id] = complete_post(conn, post.id, post.claim_token, verdict)
    return [done.get(post.id) for post, _ in completions]


def count_completions(conn, completed):
    """Count what a batch completed into 'new' (the triggers leave the
    claimed ones to this, see COUNT_EVENTS), at the end of its transaction:
    each count row once, in one order, held for the moment before the
    commit. Posts not taken in yet are counted later, in batches."""
    counts = {table: collections.Counter() for table in COUNT_TABLES}
    for row in completed:
        if row is None or not row["taken_in"] or row["status"] != "new":
            continue
        for table in COUNT_TABLES:
            if row[table.name]:
                counts[table][tuple(row[column] for column in table.key)] += 1
    for table, rows in counts.items():
        columns = ", ".join(table.key)
        insert_rows(conn, f"{table.name} ({columns}, n)",
                    [(*key, n) for key, n in sorted(rows.items())],
                    f"ON CONFLICT ({columns}) DO UPDATE SET n = {table.name}.n + excluded.n")


@redoable
def complete_and_claim(conn, completions, claims, now=None, token=None, choose=None):
    """In one transaction: complete_posts for the (claimed post, verdict),
    quick posts entered in their stories (settle_stories; where writers work
    side by side, in a short transaction before), LLM calls and stories
    counted; then claim_posts for `claims` posts (those `choose` picks,
    see claim_posts). Returns (whether each verdict was written, the posts
    claimed).

    Workers write at the same time where the database lets them (a shared
    transaction; stories one at a time), and take the count rows they share
    only at the end (count_completions). The caller's claim `token` makes it
    safe to do again (see redoable): when the server committed but the
    answer was lost, the posts it claimed are taken again."""
    token = token or conn.process.claim_token()
    redone = conn.process.begin_turn(token)
    stories = any(verdict.story_entry is not None for _, verdict in completions)
    if stories and conn.dialect.shared_writes:
        # Stories one at a time, in a short transaction of their own: the
        # rest is written beside the other processes' turns. Done again, it
        # finds the same stories (a post's own keys are not looked at).
        with transaction(conn, shared=True, stories=True):
            completions = settle_stories(conn, completions)
        stories = False
    with transaction(conn, shared=True, stories=stories):
        if stories:
            completions = settle_stories(conn, completions)
        counts = llm_call_counts([verdict.llm_seconds for _, verdict in completions
                                  if verdict.llm_seconds is not None])
        written = complete_posts(conn, completions)
        for (post, verdict), row in zip(completions, written):
            if row and verdict.joined:
                counts[("stories_joined", "")] = counts.get(("stories_joined", ""), 0) + 1
                counts[("llm_calls_saved", "")] = (counts.get(("llm_calls_saved", ""), 0)
                                                   + verdict.llm_saved)
        posts = claimed_under(conn, token) if claims and redone else []
        if claims > len(posts):
            posts += claim_posts(conn, claims - len(posts), now, token, choose)
        if counts:
            upsert_counts(conn, counts)
        count_completions(conn, written)
    conn.process.end_turn(token)
    return written, posts


# A claim given back for a reason that is not the post's own: its attempt uncounted.
ATTEMPT_UNCOUNTED = "attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END"


def release_post(conn, post_id, token, error, max_attempts, retry_delay, now=None):
    """Give a failed post back: pending again after a backoff that doubles
    with each attempt, or failed for good once it has used its attempts.
    Returns the new state (None when the claim is no longer ours)."""
    now = time.time() if now is None else now
    row = conn.execute("SELECT attempts FROM posts WHERE id = ? AND claim_token = ?",
                       (post_id, token)).fetchone()
    if row is None:
        return None
    retry_at = utc_text(now + retry_delay * (1 << min(max(row[0], 1) - 1, 6)))
    row = conn.execute(f"""
        UPDATE posts SET
            classified = CASE WHEN attempts >= ? THEN {FAILED} ELSE {PENDING} END,
            next_attempt_at = CASE WHEN attempts >= ? THEN NULL ELSE ? END,
            error = ?, claim_token = NULL
        WHERE id = ? AND classified = {PROCESSING} AND claim_token = ?
        RETURNING classified
    """, (max_attempts, max_attempts, retry_at, shorten(error, 2000), post_id, token)).fetchone()
    return None if row is None else row[0]


def defer_post(conn, post_id, token, error, retry_delay, now=None, text=None):
    """Put a post back for a reason that is not its fault (Ollama cannot be
    reached, its story's verdict is not there yet): the claim is given back
    (its attempt uncounted), the error kept, and an article's text already
    fetched (`text`) stored, so it is not fetched again."""
    now = time.time() if now is None else now
    article = ", text = :text, content_type = 'full'" if text else ""
    row = conn.execute(f"""
        UPDATE posts SET classified = {PENDING}, error = :error, claim_token = NULL,
               {ATTEMPT_UNCOUNTED}, next_attempt_at = :retry_at{article}
        WHERE id = :id AND classified = {PROCESSING} AND claim_token = :token
        RETURNING classified
    """, {"error": shorten(error, 2000), "retry_at": utc_text(now + retry_delay),
          "text": text, "id": post_id, "token": token}).fetchone()
    return None if row is None else row[0]


def wake_story_copies(conn, post_ids):
    """Copies put back to wait for their story's verdict (defer_post) are
    claimable at once when the story's first post is classified, failed or
    gone, instead of waiting out STORY_WAIT. Returns the ids woken."""
    woken = []
    for among, values in conn.dialect.among("id", sorted(post_ids)):
        woken += [row[0] for row in conn.execute(f"""
            UPDATE posts SET next_attempt_at = NULL
            WHERE {among} AND {IS_PENDING} AND next_attempt_at IS NOT NULL
              AND NOT EXISTS (SELECT 1 FROM posts AS lead WHERE lead.id = posts.story_id
                              AND (lead.classified IS NULL
                                   OR lead.classified IN ({PENDING}, {PROCESSING})))
            RETURNING id""", values)]
    return woken


@redoable
def expire_leases(conn, lease_seconds, max_attempts, now=None):
    """Take back posts whose worker died: pending at once (the post did not
    fail), or failed when it has used its attempts. A claim without a time
    (a database from before leases) counts as expired. Returns (pending, failed)."""
    cutoff = utc_text((time.time() if now is None else now) - lease_seconds)
    expired = f"classified = {PROCESSING} AND (claimed_at IS NULL OR claimed_at <= ?)"
    with transaction(conn):
        failed = conn.execute(f"""
            UPDATE posts SET classified = {FAILED}, claim_token = NULL,
                   error = coalesce(error || '; ', '') || 'lease expired on the last attempt'
            WHERE {expired} AND attempts >= ?
        """, (cutoff, max_attempts)).rowcount
        pending = conn.execute(f"""
            UPDATE posts SET classified = {PENDING}, claim_token = NULL, next_attempt_at = NULL
            WHERE {expired}
        """, (cutoff,)).rowcount
    return pending, failed


def release_claims(conn, pattern):
    """Put posts whose claim token matches `pattern` (LIKE) back to pending,
    their attempt uncounted: used when workers are stopped before they could
    finish. Returns how many."""
    return conn.execute(f"""
        UPDATE posts SET classified = {PENDING}, claim_token = NULL, {ATTEMPT_UNCOUNTED}
        WHERE classified = {PROCESSING} AND claim_token LIKE ?""", (pattern,)).rowcount


def take_claim_back(conn, post_id):
    """A claimed post whose words changed goes back to the queue at once, its
    attempt uncounted: its worker's verdict, on the words before, is then
    not written (a completion needs the claim) and the post is classified
    on its new words."""
    conn.execute(f"""
        UPDATE posts SET classified = {PENDING}, claim_token = NULL, next_attempt_at = NULL,
               {ATTEMPT_UNCOUNTED}
        WHERE id = ? AND classified = {PROCESSING}""", (post_id,))


def give_back_posts(conn, tokens):
    """Put claimed posts back to pending, their attempt uncounted: a worker
    hands back what it claimed but will not classify."""
    marks = ", ".join("?" * len(tokens))
    return conn.execute(f"""
        UPDATE posts SET classified = {PENDING}, claim_token = NULL, {ATTEMPT_UNCOUNTED}
        WHERE classified = {PROCESSING} AND claim_token IN ({marks})""", tokens).rowcount


@dataclasses.dataclass
class Draft:
    """A post as a crawler found it, before it is stored."""
    external_id: str
    url: str
    canonical_url: str
    title: str
    text: str
    content_type: str
    published_at: str           # None: the entry gave no date (see insert_new_posts)
    url_identifies: bool = True
    text_identifies: bool = True
    article_url: str = None     # a Telegram teaser's link, fetched in phase 3
    edited_at: str = None
    words_sha256: str = None    # what a Telegram message says (see words_sha256)

    def __post_init__(self):
        self.title, self.text = without_bidi_controls(self.title), without_bidi_controls(self.text)
        self.url = link_without_bidi_controls(self.url)
        self.article_url = link_without_bidi_controls(self.article_url)


def is_stored(conn, source_id, draft, sha):
    """Stored already: the same canonical URL (where it identifies an entry),
    the same text (where it identifies one), or the same entry id of the
    same source."""
    url = draft.canonical_url if draft.canonical_url and draft.url_identifies else None
    return conn.execute("""
        SELECT EXISTS (SELECT 1 FROM posts WHERE canonical_url = :url)
            OR EXISTS (SELECT 1 FROM posts WHERE source_id = :source AND external_id = :id)
            OR EXISTS (SELECT 1 FROM posts WHERE sha256 = :sha)""",
        {"url": url, "source": source_id, "id": draft.external_id, "sha": sha}).fetchone()[0] == 1


@redoable
def store_posts(conn, source_id, direction, drafts, fetched_at=None):
    """Queue the drafts that are new (see is_stored), in one transaction.
    They are counted and made searchable later, many at once
    (index_new_posts): by the workers before they classify, by the page
    before it reads."""
    with transaction(conn):
        return insert_new_posts(conn, source_id, direction, drafts, fetched_at)


def known_entries(conn, source_id, drafts):
    """The entry ids of these drafts the source has given before, in one
    query: most of a feed's entries are old news (see is_stored)."""
    ids = list({draft.external_id for draft in drafts})
    known = set()
    for first in range(0, len(ids), 500):
        chunk = ids[first:first + 500]
        known.update(row[0] for row in conn.execute(
            f"SELECT external_id FROM posts WHERE source_id = ? AND external_id IN "
            f"({', '.join('?' * len(chunk))})", (source_id, *chunk)))
    return known


def insert_new_posts(conn, source_id, direction, drafts, fetched_at=None):
    """store_posts in the caller's transaction. Returns how many were new."""
    if not drafts:
        return 0
    fetched_at = fetched_at or utc_text()
    new = 0
    settle_index_mark(conn)
    known = known_entries(conn, source_id, drafts)
    for draft in drafts:
        if draft.external_id in known:
            continue
        sha = text_sha256(draft.text) if draft.text_identifies else None
        if is_stored(conn, source_id, draft, sha):
            continue
        conn.execute("""
            INSERT INTO posts (source_id, external_id, url, canonical_url, title, text,
                               content_type, sha256, fetched_at, published_at, undated,
                               classified, direction, article_url, edited_at, words_sha256)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
        """, (source_id, draft.external_id, draft.url, draft.canonical_url,
              draft.title, draft.text, draft.content_type, sha, fetched_at,
              min(draft.published_at or fetched_at, fetched_at), int(draft.published_at is None), PENDING,
              direction, draft.article_url, draft.edited_at, draft.words_sha256))
        new += 1
    if new:
        conn.execute("UPDATE sources SET post_count = post_count + ? WHERE id = ?",
                     (new, source_id))
    return new


###############################################################################
# Learning ####################################################################
###############################################################################
# Each direction learns what its editors want from their decisions: approved
# in the direction is wanted, rejected is not, a story counts once (as its
# first post), and posts nobody decided teach nothing. The model is naive
# Bayes over the distinct words, word pairs and source of a post's lead,
# kept as counts in the database (learners, learned_words): a decision adds
# its post's features to its side and an undo takes exactly them back (a
# decision notes its posts in learn_pending and answers; the next process to
# judge by the models counts them first, see learn_owed), so
# every process and machine judges by the same counts, and `learn --rebuild`
# counts them again from the decisions. A direction's model is used once it
# has VESTI_LEARN_MIN decisions, at least LEARN_EACH of each kind.

LEARN_WORDS = 150       # words of a post's title and text it is judged by
LEARN_CHARS = 2000      # characters of its text read for them
LEARN_EACH = 5
LEARN_REFRESH = 1.0     # seconds a process judges by the counts it read
LEARN_REASONS = 4       # features a card names as what weighed most
# The LLM is shown this many of a direction's past decisions most like the
# post (their titles cut to LEARN_EXAMPLE_CHARS), picked among the latest
# LEARN_EXAMPLES_FROM of them.
LEARN_EXAMPLES = 4
LEARN_EXAMPLE_CHARS = 120
LEARN_EXAMPLES_FROM = 300
# What news looks like in general is read from this many of the newest
# classified posts, moved on every BACKGROUND_REFRESH seconds.
BACKGROUND_POSTS = 1000
BACKGROUND_REFRESH = 600
CALIBRATION_PULL = 0.01
# A model's curve is fitted again whenever its decisions reach another
# multiple of this: at the same counts in every process, so that they agree
# on whether it is used (Model.used).
RECALIBRATE = 5
LEARN_SMOOTHING = 100
# A feature's weight counts seen / (seen + WEIGHT_SHRINK) of itself, seen
# the posts it was in (decided, or in the news in general).
WEIGHT_SHRINK = 1
# A direction's model, and the news in general, keep at most about this many
# features: past it, those in the fewest posts go (see seen_floor). A word
# of a single random post is no evidence; load time, page time and memory
# stay flat however many posts are decided.
MODEL_FEATURES = 50_000
# A source's own approval rate weighs once it differs beyond chance (a
# binomial test at SOURCE_SURE) from what its posts' words would have had
# approved, counted from SOURCE_PRIOR decisions at that rate: fewer than
# SOURCE_LEAST decisions on a source say nothing; five rejections running
# of posts whose words say half sink it (see Model.source_weight).
SOURCE_PRIOR = 4
SOURCE_SURE = 0.05
SOURCE_LEAST = 5
# A post some keyword of the direction matched has this much more evidence
# for approval than its features alone give, and each keyword it matched
# KEYWORD_EVIDENCE more: the editors' own words are a judgement the model
# would need many decisions to learn.
KEYWORD_HIT_EVIDENCE = 0.3
KEYWORD_EVIDENCE = 0.05
# Words of its own that must speak for a direction before a post no keyword
# matched joins it (see Learners.wanted).
WANTED_WORDS = 3
# ... and its chance there is at least this: it is in the direction's lists,
# ranked by its likely, but on the default desk only from LIKELY_HIGH.
WANTED_LIKELY = 0.2
LEARN_WORD = re.compile(r"[^\W\d_]{2,}")
CYRILLIC_WORD = re.compile(r"[а-яё]").match


@functools.lru_cache(maxsize=1)
def stemmers():
    """Snowball's English and Russian stemmers (snowballstemmer; in C, and
    keeping the stems of the words it saw last, when PyStemmer is there),
    and the lock a thread holds while it uses them."""
    snowball = import_optional("snowballstemmer", "snowballstemmer", "learning from decisions")
    return snowball.stemmer("english"), snowball.stemmer("russian"), threading.Lock()


def stems(words):
    """The words' stems, each by the stemmer of its script: "выборах" and
    "выборы" are one, "elections" and "election" too. Stemmed in one call
    per script; a stemmer keeps state while it works, so one call at a time."""
    english, russian, stemming = stemmers()
    russian_words = [CYRILLIC_WORD(word) is not None for word in words]
    with stemming:
        if not any(russian_words):
            return english.stemWords(words)
        if all(russian_words):
            return russian.stemWords(words)
        russian_stems = iter(russian.stemWords([w for w, r in zip(words, russian_words) if r]))
        english_stems = iter(english.stemWords([w for w, r in zip(words, russian_words) if not r]))
    return [next(russian_stems) if r else next(english_stems) for r in russian_words]



# Words that say nothing of what a post is about, whatever the direction: a
# card's reasons never name them, and they weigh nothing (nor does any
# stem found in more than COMMON_SHARE of the news in general).
FUNCTION_WORDS = """
der die das den dem des ein eine einer eines einem und oder mit von für auf aus bei nach
über unter vor zum zur im ist sind war wird werden wurde hat haben nicht auch sich es wie
als an dass noch nur mehr sehr schon wenn aber bis durch
a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from
further had has have having he her here hers herself him himself his how i if in into is it
its itself just me more most my myself no nor not now of off on once only or other our ours
ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we were
what when where which while who whom why will with would you your yours yourself yourselves
says said say new one two also get got like just year years day days time week news read
more via full story click here today still much many even may might must since though
ll re ve isn aren wasn weren doesn didn hasn hadn wouldn couldn shouldn
а без более бы был была были было быть в вам вас весь во вот все всего всех вы где да даже
для до его ее ей ему если есть еще же за здесь и из или им их к как ко когда кто ли либо мне
может мы на над надо наш не него нее нет ни них но ну о об однако он она они оно от очень по
под при с со так также такой там те тем то того тоже той только том ты у уже хотя чего чей
чем что чтобы чье чья эта эти это я который которая которые которых этот этой этого года
году год также время сообщает сообщил заявил заявила рассказал отметил подробнее читать
""".split()
COMMON_SHARE = 0.3
COMMON_AFTER = 200      # posts of the news in general it takes to tell a common stem


@functools.lru_cache(maxsize=1)
def function_stems():
    return frozenset(stems(FUNCTION_WORDS))


class Features(set):
    """A post's features (see post_features) and, for a stored post, its id:
    judged, a post is never evidence about itself (see Model.weights)."""
    __slots__ = ("post",)


def post_features(title, text, source_id, post_id=None):
    """What a post is learned and judged by: the stems of the words of its
    lead (two letters or more, no numbers), each pair of stems that
    follow each other, and its source (as '@' and the source's id). Words
    of every post (function words) are no evidence: see Model.weights."""
    lead = f"{title or ''}\n{(text or '')[:LEARN_CHARS]}".casefold()
    dropped = function_stems()
    words = [word for word in stems(LEARN_WORD.findall(lead)[:LEARN_WORDS]) if word not in dropped]
    features = Features(words)
    features.post = post_id
    features.update(f"{a} {b}" for a, b in zip(words, words[1:]))
    if source_id is not None:
        features.add(f"@{source_id}")
    return features


class Background:
    """What news looks like in general: in how many of the newest classified
    posts (BACKGROUND_POSTS, of every direction, up to the id in meta
    'learn_background') each feature was, and which posts they were. Against
    it a model learns what sets its approved posts apart, not only from the
    few its editors rejected."""

    def __init__(self, mark=None, counts=None, docs=0, posts=()):
        self.mark, self.counts, self.docs = mark, collections.Counter(counts or {}), docs
        self.posts = frozenset(posts)

    @classmethod
    def load(cls, conn, mark):
        """The background at `mark` as the first process that needed it kept
        it (meta 'learn_background_counts'): a process starting up reads its
        counts instead of working out the features of a thousand posts again.
        None kept for this mark: read from the posts (see read), then kept."""
        kept, _ = get_meta(conn, "learn_background_counts")
        with contextlib.suppress(ValueError, TypeError, KeyError):
            found = json.loads(kept)
            if found["mark"] == mark:
                return cls(mark, found["counts"], found["docs"], found["posts"])
        background = cls.read(conn, mark)
        text = json.dumps({"mark": mark, "docs": background.docs, "counts": background.counts,
                           "posts": sorted(background.posts)},
                          ensure_ascii=False, separators=(",", ":"))
        with transaction(conn):
            set_meta(conn, "learn_background_counts", text)
        return background

    @classmethod
    def read(cls, conn, mark):
        """The background at `mark`, worked out from the posts."""
        background, posts = cls(mark), []
        for row in conn.execute(f"""SELECT id, title, substr(text, 1, {LEARN_CHARS}) AS text,
                                           source_id FROM posts WHERE id <= ? AND classified = {DONE}
                                    ORDER BY id DESC LIMIT ?""", (mark, BACKGROUND_POSTS)).fetchall():
            background.counts.update(post_features(row["title"], row["text"], row["source_id"]))
            background.docs += 1
            posts.append(row["id"])
        background.posts = frozenset(posts)
        floor = 2
        while len(background.counts) > MODEL_FEATURES:
            background.counts = collections.Counter(
                {feature: n for feature, n in background.counts.items() if n >= floor})
            floor += 1
        return background


class Approvals:
    """What every direction's editors approved: in how many approved posts
    (of any direction) each feature was, and how many there were. Kept in
    step with the models as their counts move (Learners.refresh)."""

    def __init__(self, models=()):
        self.counts, self.total, self.directions = collections.Counter(), 0, set()
        for model in models:
            self.directions.add(model.direction)
            self.total += model.approved
            self.counts.update({feature: approved for feature, (approved, _) in model.counts.items()
                                if approved})

    def move(self, feature, was, now):
        """A model's count of approved posts with the feature went from was to now."""
        count = self.counts[feature] + now - was
        if count:
            self.counts[feature] = count
        else:
            del self.counts[feature]


class Model:
    """One direction's learned model as a process holds it: how many
    approved and rejected decisions it learned from, in how many of each
    every feature was, and how its scores turn into chances (calibrate)."""

    def __init__(self, direction):
        self.direction = direction
        self.approved = self.rejected = self.version = 0
        self.epoch, self.since = None, None
        self.counts = {}                # feature: (approved, rejected)
        self.totals = [0, 0]
        self.floor = 1                  # of the decided posts a feature is in (seen_floor)
        self.background = Background()
        self.elsewhere = Approvals()
        self.scale, self.shift = 1.0, 0.0
        self.separates = False          # its curve tells its decisions apart (see calibrate)
        self.calibrated_at = None       # the decisions it had when last calibrated
        self.expected = {}      # at the last calibration: see expected_by_source

    def set(self, feature, approved, rejected):
        old = self.counts.pop(feature, None)
        if old:
            self.totals[0] -= old[0]
            self.totals[1] -= old[1]
        if approved or rejected:
            self.counts[feature] = (approved, rejected)
            self.totals[0] += approved
            self.totals[1] += rejected

    def learn(self, features, approved):
        """Count one decision in, as the counts in the database would."""
        for feature in features:
            seen = self.counts.get(feature, (0, 0))
            self.set(feature, seen[0] + approved, seen[1] + (not approved))
        self.approved += approved
        self.rejected += not approved

    def ready(self, learn_min):
        """It has the decisions a model needs, to be calibrated (see used)."""
        return self.approved + self.rejected >= learn_min and \
            min(self.approved, self.rejected) >= LEARN_EACH

    def used(self, learn_min):
        """It judges posts: it is ready, and at its last calibration its curve
        told the editors' decisions apart beyond chance (tells_apart)."""
        return self.ready(learn_min) and self.separates

    def weights(self, features, own=(0, 0)):
        """(weight, feature) of the features seen before: how much each speaks
        for approval, as the log of how much more often it is in approved
        posts than in the others: rejected, background, and approved in
        other directions (news of another kind for this one). The share of
        posts that have it is smoothed toward its share of all posts by
        LEARN_SMOOTHING posts. `own`: a decided post's own decision, left
        out when it is judged (calibrate). A post is never evidence about
        itself: one of the news in general is judged as if it were not in it,
        as a post is before the news in general moves on to take it in, so
        its chance does not drop when that happens."""
        background, elsewhere = self.background, self.elsewhere
        itself = int(getattr(features, "post", None) in background.posts)
        mine = self.direction in elsewhere.directions       # its own approvals are in it
        approved = self.approved - own[0]
        other = self.rejected - own[1] + background.docs - itself + elsewhere.total - \
            mine * self.approved
        everything = approved + other
        # Smoothed by as many posts as it has decisions, up to LEARN_SMOOTHING:
        # a few decisions are not drowned by it, many are steadied.
        smoothing = min(LEARN_SMOOTHING, self.approved + self.rejected)
        docs = background.docs - itself
        common = COMMON_SHARE * docs if docs >= COMMON_AFTER else 0
        found = []
        for feature in features:
            general = background.counts.get(feature, 0)
            if itself and general:          # (one its count dropped holds no post)
                general -= 1
            if feature[0] == "@" or (common and general > common):
                continue            # the source weighs on its own (source_weight)
            counted = self.counts.get(feature)
            wanted, unwanted = counted or (0, 0)
            unwanted += general + elsewhere.counts.get(feature, 0) - mine * wanted
            if counted is not None:     # one the model dropped (seen_floor) holds no decision
                wanted, unwanted = max(0, wanted - own[0]), max(0, unwanted - own[1])
            if wanted + unwanted <= 0:
                continue            # never seen but in this post: it says nothing
            share = (wanted + unwanted + 1) / (everything + 2)
            weight = math.log((wanted + smoothing * share) / (approved + smoothing)) \
                - math.log((unwanted + smoothing * share) / (other + smoothing))
            # A word in one post, and nowhere in the news in general, says
            # little, however far its share is from the others'.
            seen = wanted + unwanted
            found.append((weight * seen / (seen + WEIGHT_SHRINK), feature))
        return found

    def source_weight(self, features, own=(0, 0)):
        """How much a post's source speaks for approval: the log odds of its
        posts' approval in the direction over the share their words would
        have had approved, both among the latest decisions (see
        expected_by_source; a source decided only before them: all its
        decisions against the rate of the direction's other sources),
        smoothed toward that share by SOURCE_PRIOR decisions, once the two
        differ beyond chance on SOURCE_LEAST decisions or more. So a source
        whose posts were rejected although their words speak for them sinks
        (five rejections running where the words say half); one whose
        posts' words explain its rejections does not: they weigh already."""
        source = next((feature for feature in features if feature[0] == "@"), None)
        if source is None:
            return 0.0
        expected = self.expected.get(source)
        if expected is not None:    # its posts among the latest decisions, as many as were
            rate, approved, rejected = expected
        else:                       # decided before them: all of them, against the others
            approved, rejected = self.counts.get(source, (0, 0))
        # A decision another process counted after this one read the
        # counts is left out of counts that do not hold it yet: none goes
        # below zero.
        approved, rejected = max(0, approved - own[0]), max(0, rejected - own[1])
        if expected is None:
            others_approved = max(0, self.approved - own[0] - approved)
            others_rejected = max(0, self.rejected - own[1] - rejected)
            rate = (others_approved + 1) / (others_approved + others_rejected + 2)
        rate = min(max(rate, 0.02), 0.98)
        if approved + rejected < SOURCE_LEAST or \
                binomial_tail(approved, approved + rejected, rate) >= SOURCE_SURE:
            return 0.0
        share = (approved + SOURCE_PRIOR * rate) / (approved + rejected + SOURCE_PRIOR)
        return math.log(share / (1 - share)) - math.log(rate / (1 - rate))

    def score(self, features, keywords=0, own=(0, 0)):
        """The evidence of a post for approval: what its words say
        (words_score) and its source's weight."""
        return self.words_score(features, keywords, own) + self.source_weight(features, own)

    def words_score(self, features, keywords=0, own=(0, 0)):
        """Its words' weights' mean (naive Bayes would add them up, counting
        words that come together as if each were news, and be sure of itself
        far beyond what it knows), and for the `keywords` of the direction it
        matched, KEYWORD_HIT_EVIDENCE and KEYWORD_EVIDENCE for each."""
        weights = self.weights(features, own)
        return sum(weight for weight, _ in weights) / max(1, len(weights)) + \
            (KEYWORD_HIT_EVIDENCE + KEYWORD_EVIDENCE * keywords if keywords else 0.0)

    def likely(self, features, keywords=0):
        """The chance that an editor approves a post of these features, no
        surer than the direction's decisions can make it: after n of them,
        between 1 / (n + 2) and (n + 1) / (n + 2) (had all n gone one way,
        the rule of succession's chance that the next does too), the curve's
        chance counted as n decisions beside one approval and one rejection.
        The order of the posts is the curve's."""
        decided = self.approved + self.rejected
        return round((decided * self.curve(features, keywords) + 1) / (decided + 2), 4)

    def curve(self, features, keywords=0):
        """The chance its fitted curve gives, unbounded: what directions are
        compared by (see Learners.wanted), whatever decisions each has."""
        return chance(self.scale * self.score(features, keywords) + self.shift)

    def calibrate(self, decided):
        """Fit how scores turn into chances (see fit_chances) to decided posts
        [(features, keywords matched, approved)], each judged with its own
        decision left out, so the chances say how often editors approve:
        first by their words alone, which tells what each source's posts
        should have had approved (expected_by_source), then with their
        sources' weights."""
        own = [(1, 0) if approved else (0, 1) for _, _, approved in decided]
        words = [self.words_score(features, keywords, mine)
                 for (features, keywords, _), mine in zip(decided, own)]
        self.expected = self.expected_by_source(decided, words)
        points = [(score + self.source_weight(features, mine), approved)
                  for score, (features, _, approved), mine in zip(words, decided, own)]
        self.scale, self.shift = fit_chances(points)
        self.separates = tells_apart(points, self.scale, self.shift)

    def expected_by_source(self, decided, words):
        """{source: (the share of its decided posts that their words alone
        (`words`: each one's words_score) would have had approved, how many
        of them were approved, how many rejected)}: a source's rate is
        weighed against what its words say on the same posts, however the
        latest decisions fell (a bulk decision of one kind fills them)."""
        scale, shift = fit_chances([(score, approved) for score, (_, _, approved)
                                    in zip(words, decided)])
        chances = collections.defaultdict(list)
        for score, (features, _, approved) in zip(words, decided):
            source = next((feature for feature in features if feature[0] == "@"), None)
            if source is not None:
                chances[source].append((chance(scale * score + shift), approved))
        return {source: (sum(share for share, _ in posts) / len(posts),
                         sum(1 for _, approved in posts if approved),
                         sum(1 for _, approved in posts if not approved))
                for source, posts in chances.items()}

    def reasons(self, features, likely):
        """The features that weighed most toward its verdict, heaviest first
        (twice LEARN_REASONS of them: see reason_words): its source when
        that weighs more than any word."""
        toward = 1 if likely >= LIKELY_FLOOR else -1
        weights = [(toward * w, f) for w, f in self.weights(features) if toward * w > 0]
        source = self.source_weight(features)
        if toward * source > 0:
            weights.append((toward * source, next(f for f in features if f[0] == "@")))
        return [feature for _, feature in sorted(weights, reverse=True)[:2 * LEARN_REASONS]]


def reason_words(reasons, title, text, source=None):
    """The first LEARN_REASONS of a card's reasons (Model.reasons) in the
    post's own words: each stem as the word of the post it stands for, a
    pair as the two words, the source by `source` (its name), each said
    once. A word of the source's name ("Read more at Slashdot", "Ars
    Technica"), alone or in a pair, is the source said again."""
    lead = f"{title or ''}\n{(text or '')[:LEARN_CHARS]}".casefold()
    dropped, said = function_stems(), {}
    found = LEARN_WORD.findall(lead)[:LEARN_WORDS]
    words = [(word, root) for word, root in zip(found, stems(found)) if root not in dropped]
    for (word, root), after in zip(words, [*words[1:], None]):
        said.setdefault(root, word)
        if after is not None:
            said.setdefault(f"{root} {after[1]}", f"{word} {after[0]}")
    name = LEARN_WORD.findall((source or "").casefold())
    named = {"".join(name), *(word for word, root in zip(name, stems(name))
                              if len(word) > 2 and root not in dropped)}   # "Golem.de": golem
    shown = {}
    for reason in reasons:
        word = said.get(reason, reason)
        if reason[0] == "@" or named & set(word.split()):
            word = source or reason
        shown.setdefault(word.casefold(), word)
    return list(shown.values())[:LEARN_REASONS]


def binomial_tail(successes, trials, rate):
    """The chance of a count as far from trials x rate as `successes` is, or
    farther on its side, were each trial a success with chance `rate`."""
    if trials <= 0:
        return 1.0
    if trials > 500:        # the normal curve, near enough
        spread = math.sqrt(trials * rate * (1 - rate)) or 1.0
        return 0.5 * math.erfc(abs(successes - trials * rate) / spread / math.sqrt(2))
    below = successes <= trials * rate
    counts = range(0, successes + 1) if below else range(successes, trials + 1)
    return min(1.0, sum(math.comb(trials, k) * rate ** k * (1 - rate) ** (trials - k)
                        for k in counts))


def seen_floor(conn, direction):
    """The fewest decided posts a feature of the direction must be in to be
    kept in its model: 1 while it has at most MODEL_FEATURES features, else
    the least that keeps it under that (each count stops past it)."""
    floor = 1
    while conn.execute("""SELECT count(*) FROM (SELECT 1 FROM learned_words WHERE direction = ?
                              AND approved + rejected >= ? LIMIT ?) AS kept""",
                       (direction, floor, MODEL_FEATURES + 1)).fetchone()[0] > MODEL_FEATURES:
        floor += 1
    return floor


SCALE_FLOOR = 0.05
# A model judges posts only once its curve, on the decided posts each judged
# with its own decision left out, explains the decisions better than the
# editors' approval rate alone beyond chance: the likelihood-ratio statistic
# at least SEPARATION (chi-squared, one degree of freedom, 0.1 %). Decisions
# that carry no signal give every post about that rate, and one of 85 %
# would lift every post over the floor; without a model the desk stays as
# keywords made it (see Model.used). The curve is fitted to the decisions
# it is tested on, and the test repeated every RECALIBRATE decisions, so
# random decisions pass more often than the level says: at 1 %, 6 % of
# random editors had their model used at some point of their first 60
# decisions; at 0.1 %, under 2 % (bench/random_editors.py).
SEPARATION = 10.83


def tells_apart(points, scale, shift):
    """Whether the curve (scale, shift) tells the points [(score,
    approved)] apart beyond chance (see SEPARATION)."""
    return separation(points, scale, shift) >= SEPARATION


def separation(points, scale, shift):
    """The likelihood-ratio statistic of the curve (scale, shift) against
    the approval rate alone on points [(score, approved)]; 0 when they are
    all of one decision."""
    approved = sum(1 for _, yes in points if yes)
    if not 0 < approved < len(points):
        return 0.0
    rate = approved / len(points)
    alone = -approved * math.log(rate) - (len(points) - approved) * math.log(1 - rate)
    return 2 * (alone - log_loss(points, scale, shift))


def fit_chances(points):
    """(scale, shift) of the logistic curve that turns scores into chances on
    points [(score, approved)]. A curve never turns over: where higher scores
    went with fewer approvals, the slope is held at SCALE_FLOOR and only the
    level is fitted, so the chances stay near the editors' rate."""
    scale, shift = fit_curve(points)
    if scale < SCALE_FLOOR:
        scale, shift = fit_curve(points, SCALE_FLOOR, hold_scale=True)
    return scale, shift


def fit_curve(points, scale=1.0, hold_scale=False):
    """The (scale, shift) of the logistic curve that makes calibration_loss
    least on points [(score, approved)], by Newton's method, each step halved
    until it helps; with hold_scale, only the shift moves."""
    shift = 0.0
    loss = calibration_loss(points, scale, shift)
    for _ in range(30):
        grad_a, grad_b = CALIBRATION_PULL * (scale - 1.0), CALIBRATION_PULL * shift
        h_aa = h_bb = CALIBRATION_PULL
        h_ab = 0.0
        for x, approved in points:
            p = 1 / (1 + math.exp(-max(-30.0, min(30.0, scale * x + shift))))
            w = p * (1 - p)
            grad_a, grad_b = grad_a + (p - approved) * x, grad_b + p - approved
            h_aa, h_ab, h_bb = h_aa + w * x * x, h_ab + w * x, h_bb + w
        if hold_scale:
            step_a, step_b = 0.0, grad_b / h_bb
        else:
            det = h_aa * h_bb - h_ab * h_ab
            step_a = (h_bb * grad_a - h_ab * grad_b) / det
            step_b = (h_aa * grad_b - h_ab * grad_a) / det
        for _ in range(20):
            tried = calibration_loss(points, scale - step_a, shift - step_b)
            if tried <= loss:
                break
            step_a, step_b = step_a / 2, step_b / 2
        else:
            break
        scale, shift, before, loss = scale - step_a, shift - step_b, loss, tried
        if before - loss < 1e-9:
            break
    return scale, shift


def calibration_loss(points, scale, shift):
    """What Model.calibrate makes least: the log loss of its curve on the
    points, and a pull toward no change (CALIBRATION_PULL)."""
    return CALIBRATION_PULL / 2 * ((scale - 1.0) ** 2 + shift ** 2) + \
        log_loss(points, scale, shift)


def log_loss(points, scale, shift):
    """The log loss of the curve (scale, shift) on points [(score, approved)]."""
    loss = 0.0
    for x, approved in points:
        z = max(-30.0, min(30.0, scale * x + shift))
        loss += math.log1p(math.exp(-z)) if approved else math.log1p(math.exp(z))
    return loss


def keyword_count(keywords):
    """How many keywords a post matched (posts.keywords, see matched_keywords)."""
    return len(keywords.split(", ")) if keywords else 0


def chance(log_odds):
    return round(1 / (1 + math.exp(-max(-30.0, min(30.0, log_odds)))), 4)


class Learners:
    """Every direction's learned model as this process holds it, brought up
    to date from the database at most every LEARN_REFRESH seconds (or when
    asked to), reading only the counts changed since it last did."""

    def __init__(self, learn_min):
        self.learn_min = learn_min
        self.models = {}
        self.checked = -math.inf
        self.lock = threading.Lock()
        self.background = Background()
        self.approvals = Approvals()    # of every model this process holds
        self.decided = {}           # direction: (its model's version, latest())
        self.features = {}          # direction: {post id: features} of its latest decisions
        self.features_checked = False   # see relearn_if_features_changed

    def refresh(self, conn, now=False, owed=None):
        """Read what changed, once the decisions still owed are counted (at
        most `owed` of them: a page's; the rest wait for the next). While
        some are still owed after that (thousands decided at once, or every
        decision after an upgrade), a model this process calibrated already
        is not calibrated again: that would be done anew for every batch;
        the process that counts the last one does it."""
        with self.lock:
            if not now and time.monotonic() - self.checked < LEARN_REFRESH:
                return self
            self.checked = time.monotonic()
            if not self.features_checked and not conn.in_transaction:
                relearn_if_features_changed(conn)
                self.features_checked = True
            backlog = not conn.in_transaction and owes_learning(conn)
            if backlog:
                learn_owed(conn, owed)
                backlog = owed is not None and owes_learning(conn)
            rows = conn.execute("SELECT direction, approved, rejected, version, epoch, since "
                                "FROM learners").fetchall()
            if any(row["approved"] + row["rejected"] >= self.learn_min and
                   min(row["approved"], row["rejected"]) >= LEARN_EACH for row in rows):
                self.read_background(conn)
            replaced, recalibrate, approvals = False, [], self.approvals
            for row in rows:
                model = self.models.get(row["direction"])
                if model is None or model.epoch != row["epoch"]:
                    model = self.models[row["direction"]] = Model(row["direction"])
                    model.epoch, replaced = row["epoch"], True
                if model.background is not self.background or model.calibrated_at is None or \
                        (row["approved"] + row["rejected"]) // RECALIBRATE != \
                        model.calibrated_at // RECALIBRATE:
                    recalibrate.append(model)
                if model.version != row["version"]:
                    self.read_counts(conn, model, approvals)
                approvals.total += row["approved"] - model.approved
                model.approved, model.rejected = row["approved"], row["rejected"]
                model.version, model.since = row["version"], row["since"]
                model.background = self.background
                model.elsewhere = approvals
            if replaced:        # counted anew: the models it replaced are in the old tally
                self.approvals = Approvals(self.models.values())
                for model in self.models.values():
                    model.elsewhere = self.approvals
            for model in recalibrate:
                if model.ready(self.learn_min) and not (backlog and model.calibrated_at is not None):
                    model.calibrate([(features, keywords, decision == "approved")
                                     for features, _, keywords, decision in self.latest(conn, model)])
                    model.calibrated_at = model.approved + model.rejected
        return self

    @staticmethod
    def read_counts(conn, model, approvals):
        """A model's counts changed since it last read them (all of them, the
        first time: only those of its features in at least its seen_floor
        posts); one grown past twice MODEL_FEATURES is read anew."""
        if model.version and len(model.counts) > 2 * MODEL_FEATURES:
            for feature, (approved, _) in model.counts.items():
                approvals.move(feature, approved, 0)
            model.counts, model.totals, model.version = {}, [0, 0], 0
        if model.version == 0:
            model.floor = seen_floor(conn, model.direction)
            rows = conn.execute("SELECT feature, approved, rejected FROM learned_words "
                                "WHERE direction = ? AND approved + rejected >= ?",
                                (model.direction, model.floor)).fetchall()
        else:
            rows = conn.execute("SELECT feature, approved, rejected FROM learned_words "
                                "WHERE direction = ? AND version > ?",
                                (model.direction, model.version)).fetchall()
        for feature, approved, rejected in rows:
            if approved + rejected < model.floor:
                approved = rejected = 0
            approvals.move(feature, model.counts.get(feature, (0, 0))[0], approved)
            model.set(feature, approved, rejected)

    def read_background(self, conn):
        """The background every process judges by: the newest posts up to the
        mark in meta, moved on to the newest post at most every
        BACKGROUND_REFRESH seconds by whichever process finds it older."""
        mark, updated = get_meta(conn, "learn_background")
        fresh = parse_utc(updated) if updated else None
        if mark is None or fresh is None or time.time() - fresh > BACKGROUND_REFRESH:
            with transaction(conn):
                top = conn.execute(f"SELECT coalesce(max(id), 0) FROM posts "
                                   f"WHERE classified = {DONE}").fetchone()[0]
                set_meta(conn, "learn_background", str(top))
            mark = str(top)
        if self.background.mark != int(mark):
            self.background = Background.load(conn, int(mark))

    def latest(self, conn, model):
        """[(features, title, keywords matched, decision)] of the direction's
        latest decisions (the features of each post worked out once)."""
        version, decided = self.decided.get(model.direction, (None, []))
        if version != (model.epoch, model.version):
            known = self.features.setdefault(model.direction, {})
            rows = conn.execute("""SELECT id, title, keywords, learned_as FROM posts
                                   WHERE learned_in = ? AND learned_as IS NOT NULL
                                   ORDER BY decided_at DESC, id DESC LIMIT ?""",
                                (model.direction, LEARN_EXAMPLES_FROM)).fetchall()
            missing = [row["id"] for row in rows if row["id"] not in known]
            for among, values in conn.dialect.among("id", missing):
                for row in conn.execute(f"""SELECT id, title, substr(text, 1, {LEARN_CHARS}) AS text,
                                                   source_id FROM posts WHERE {among}""", values):
                    known[row["id"]] = post_features(row["title"], row["text"], row["source_id"],
                                                     row["id"])
            for gone in set(known) - {row["id"] for row in rows}:
                del known[gone]
            decided = [(known[row["id"]], row["title"], keyword_count(row["keywords"]),
                        row["learned_as"]) for row in rows if row["id"] in known]
            self.decided[model.direction] = ((model.epoch, model.version), decided)
        return decided

    def model(self, direction):
        """The direction's model when it is used (Model.used), else None."""
        model = self.models.get(direction)
        return model if model is not None and model.used(self.learn_min) else None

    def ready(self, direction):
        """Whether the direction has the decisions a model needs, used or not."""
        model = self.models.get(direction)
        return model is not None and model.ready(self.learn_min)

    def likely(self, direction, features, keywords=0):
        model = self.model(direction)
        return None if model is None else model.likely(features, keywords)

    def examples(self, conn, direction, features):
        """[(title, decision)] of the direction's latest decisions most like a
        post of these features (words in common), once it has the decisions a
        model needs (used or not: the LLM reads them as examples)."""
        if not self.ready(direction):
            return []
        decided = self.latest(conn, self.models[direction])
        alike = sorted(((len(features & seen) / math.sqrt(len(features) * len(seen) or 1), k)
                        for k, (seen, _, _, _) in enumerate(decided)), reverse=True)
        return [(shorten(decided[k][1], LEARN_EXAMPLE_CHARS), decided[k][3])
                for score, k in alike[:LEARN_EXAMPLES] if score > 0]

    def wanted(self, features):
        """(direction, likely) of the direction whose model wants a post no
        keyword matched, on its own evidence: with no keyword's, its chance
        by the direction's curve (not bounded by how many decisions each
        direction has: see Model.likely) is the highest, WANTED_LIKELY or
        more, and WANTED_WORDS of its words are words the
        direction's approved posts share (each in two or more of them) more
        than the news in general does.
        Else None: the post stays out of every direction. One that joins is
        on the desk only at LIKELY_HIGH (see floor_clause); below, it waits
        in the direction's list for an editor who looks further."""
        best = max(((model.curve(features), direction) for direction in list(self.models)
                    if (model := self.model(direction)) is not None), default=None)
        if best is None or best[0] < WANTED_LIKELY:
            return None
        model = self.models[best[1]]
        shared = [feature for weight, feature in model.weights(features)
                  if weight > 0 and model.counts.get(feature, (0, 0))[0] >= 2]
        return (best[1], model.likely(features)) if len(shared) >= WANTED_WORDS else None


# A post's decision counts in its direction's model when the post is a card
# of the desk (in no story, or its story's first post), approved or rejected
# in a direction.
LEARNED_ROW = f"""SELECT p.id, p.title, substr(p.text, 1, {LEARN_CHARS}) AS text, p.source_id,
                         p.status, p.direction, p.story_id, p.learned_as, p.learned_in,
                         p.decided_at
                  FROM posts p"""


def counts_as(row):
    """(decision, direction) the post's decision should count as, or (None, None)."""
    card_of_desk = row["story_id"] is None or row["story_id"] == row["id"]
    if card_of_desk and row["status"] in ("approved", "rejected") and row["direction"]:
        return row["status"], row["direction"]
    return None, None


def learn_decisions(conn, post_ids):
    """Bring the learned counts in step with the decisions on these posts'
    stories, in the caller's transaction: a story's first post counts as its
    decision now says, any other post of it (one that led it before) as
    nothing. Returns the directions whose counts changed."""
    changes = []
    for post_id in sorted(set(post_ids)):
        lead = conn.execute("SELECT coalesce(story_id, id) FROM posts WHERE id = ?",
                            (post_id,)).fetchone()
        if lead is None:
            continue
        rows = conn.execute(f"{LEARNED_ROW} WHERE p.id = ? OR (p.learned_as IS NOT NULL AND "
                            f"{copies_of('p.')})", (lead[0], lead[0])).fetchall()
        for row in rows:
            now = counts_as(row)
            if now != (row["learned_as"], row["learned_in"]):
                changes.append((row, now))
    return count_decisions(conn, changes)


def count_decisions(conn, changes):
    """Apply (post row, what it counts as now) to the counts and the posts'
    marks; returns the directions changed."""
    deltas = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
    decisions = collections.defaultdict(lambda: [0, 0])
    first = {}          # direction: its earliest decision counted now (learners.since)
    for row, (decision, direction) in changes:
        if decision is not None and row["decided_at"]:
            first[direction] = min(first.get(direction, row["decided_at"]), row["decided_at"])
        features = post_features(row["title"], row["text"], row["source_id"])
        for sign, was, where in ((-1, row["learned_as"], row["learned_in"]), (1, decision, direction)):
            if was is None:
                continue
            side = 0 if was == "approved" else 1
            decisions[where][side] += sign
            for feature in features:
                deltas[where][feature][side] += sign
        conn.execute("UPDATE posts SET learned_as = ?, learned_in = ? WHERE id = ?",
                     (decision, direction, row["id"]))
    now = utc_text()
    for direction in sorted(decisions):
        approved, rejected = decisions[direction]
        version = conn.execute(
            """INSERT INTO learners (direction, approved, rejected, version, epoch, since, updated_at)
               VALUES (?, ?, ?, 1, 1, ?, ?)
               ON CONFLICT (direction) DO UPDATE SET approved = learners.approved + excluded.approved,
                   rejected = learners.rejected + excluded.rejected, version = learners.version + 1,
                   since = coalesce(learners.since, excluded.since), updated_at = excluded.updated_at
               RETURNING version""", (direction, approved, rejected, first.get(direction, now),
                                      now)).fetchone()[0]
        insert_rows(conn, "learned_words (direction, feature, approved, rejected, version)",
                    [(direction, feature, a, r, version)
                     for feature, (a, r) in sorted(deltas[direction].items()) if a or r],
                    """ON CONFLICT (direction, feature) DO UPDATE SET
                           approved = learned_words.approved + excluded.approved,
                           rejected = learned_words.rejected + excluded.rejected,
                           version = excluded.version""")
    return sorted(decisions)


LEARN_BATCH = 500


def owe_learning(conn, post_ids):
    """In the caller's transaction: these posts' decisions are to be counted
    (see learn_owed), which a decision leaves to the next look at the models
    so that it answers at once."""
    insert_rows(conn, "learn_pending (post_id)", [(i,) for i in sorted(set(post_ids))],
                "ON CONFLICT (post_id) DO NOTHING")


@redoable
def learn_owed(conn, limit=None):
    """Count the decisions noted in learn_pending (learn_decisions), at most
    `limit` of them (None: all), each taken off the list by the process that
    counts it, so that two processes never count one twice. Returns the
    directions whose counts changed."""
    changed, left = set(), limit
    while left is None or left > 0:
        with transaction(conn):
            ids = [row[0] for row in conn.execute(
                "DELETE FROM learn_pending WHERE post_id IN (SELECT post_id FROM learn_pending "
                "ORDER BY post_id LIMIT ?) RETURNING post_id",
                (LEARN_BATCH if left is None else min(LEARN_BATCH, left),))]
            if not ids:
                break
            changed.update(learn_decisions(conn, ids))
        left = None if left is None else left - len(ids)
    return sorted(changed)


def owes_learning(conn):
    return conn.execute("SELECT 1 FROM learn_pending LIMIT 1").fetchone() is not None


# How a post's features are made (post_features, stems): counts made
# another way, by an older release, are of other words. A database whose
# meta 'learn_features' is not this one (or has none: its decisions may
# predate learning) has every decision counted again.
LEARN_FEATURES = "stems-1"


def relearn_if_features_changed(conn):
    """Once per change of LEARN_FEATURES: forget the models' counts, what
    the news in general was counted as and the undecided cards' chances,
    and note every decided card in learn_pending, to be counted as any
    decision is (learn_owed), a batch at a time, by the processes that
    judge by the models."""
    if get_meta(conn, "learn_features")[0] == LEARN_FEATURES:
        return
    with transaction(conn):
        if get_meta(conn, "learn_features")[0] == LEARN_FEATURES:
            return                  # another process did it meanwhile
        conn.execute("DELETE FROM learned_words")
        conn.execute("DELETE FROM learn_pending")
        conn.execute("UPDATE learners SET approved = 0, rejected = 0, version = 0, "
                     "epoch = epoch + 1, since = NULL")
        conn.execute("UPDATE posts SET learned_as = NULL, learned_in = NULL "
                     "WHERE learned_as IS NOT NULL")
        # The older counts' chances: the desk is as keywords make it until
        # the counts are made again and judge the cards (Rescorer.catch_up).
        conn.execute("UPDATE posts SET likely = NULL WHERE status = 'new' AND likely IS NOT NULL")
        conn.execute(f"""INSERT INTO learn_pending (post_id)
                         SELECT p.id FROM posts p WHERE p.status IN ('approved', 'rejected')
                           AND p.direction IS NOT NULL AND {card('p.')}""")
        delete_meta(conn, "learn_background_counts")
        set_meta(conn, "learn_features", LEARN_FEATURES)


@redoable
def rebuild_learning(conn, progress=None):
    """Count every direction's model again from the stored decisions (in one
    transaction; a process holding a model reads it anew). Returns
    {direction: (approved, rejected)}."""
    with transaction(conn):
        conn.execute("DELETE FROM learned_words")
        conn.execute("DELETE FROM learn_pending")
        conn.execute("UPDATE learners SET approved = 0, rejected = 0, version = 0, "
                     "epoch = epoch + 1, since = NULL")
        conn.execute("UPDATE posts SET learned_as = NULL, learned_in = NULL "
                     "WHERE learned_as IS NOT NULL")
        last = 0
        while True:
            rows = conn.execute(f"""{LEARNED_ROW} WHERE p.id > ? AND p.status IN ('approved', 'rejected')
                                    AND p.direction IS NOT NULL AND {card('p.')}
                                    ORDER BY p.id LIMIT ?""", (last, LEARN_BATCH)).fetchall()
            if not rows:
                break
            count_decisions(conn, [(row, counts_as(row)) for row in rows])
            last = rows[-1]["id"]
            if progress:
                progress.step(count=len(rows))
        conn.execute("""UPDATE learners SET since = (SELECT min(decided_at) FROM posts p
                            WHERE p.learned_in = learners.direction)""")
        delete_meta(conn, "learn_background_counts")
        set_meta(conn, "learn_features", LEARN_FEATURES)
        return {row[0]: (row[1], row[2]) for row in conn.execute(
            "SELECT direction, approved, rejected FROM learners ORDER BY direction")}


def decided_directions(conn, post_ids):
    """The directions of these posts: whose models their decisions changed."""
    marks = ",".join("?" * len(post_ids))
    return sorted({row[0] for row in conn.execute(
        f"SELECT DISTINCT direction FROM posts WHERE id IN ({marks}) AND direction IS NOT NULL",
        list(post_ids))})


# After a decision, the newest undecided cards of its direction are judged
# again by the model it changed, and as many of the newest posts no keyword
# matched, so the desk's next page reflects it. Cards the model has not
# judged at all (classified before it was ready, older than those) are
# judged JUDGE_BATCH at a time once the editor pauses (Rescorer.run), and
# every card on `learn --rebuild`.
RESCORE_LIMIT = 500
JUDGE_BATCH = 500


def judge_cards(conn, learners, direction, after=None, limit=None, unjudged=False):
    """Judge (likely, or none while its model is not ready) up to `limit`
    (JUDGE_BATCH) undecided cards of a direction, newest first, after the
    cursor `after` (published_at, id); only those not judged yet when
    `unjudged`. Returns how many changed and the cursor to go on from (None:
    none are left)."""
    limit = limit or JUDGE_BATCH
    model = learners.model(direction)
    if unjudged and model is None:
        return 0, None
    where = ["p.status = 'new'", f"p.classified = {DONE}", "p.direction = ?", card("p.")]
    params = [direction]
    if unjudged:
        where.append("p.likely IS NULL")
    if after:
        where.append("(p.published_at, p.id) < (?, ?)")
        params += after
    rows = conn.execute(f"""SELECT p.id, p.title, substr(p.text, 1, {LEARN_CHARS}) AS text,
                                   p.source_id, p.keywords, p.likely, p.published_at FROM posts p
                            WHERE {' AND '.join(where)}
                            ORDER BY p.published_at DESC, p.id DESC LIMIT ?""",
                        (*params, limit)).fetchall()
    changed = []
    for row in rows:
        likely = None if model is None else \
            model.likely(post_features(row["title"], row["text"], row["source_id"], row["id"]),
                         keyword_count(row["keywords"]))
        if likely != row["likely"]:
            changed.append((likely, row["id"]))
    if changed:
        with transaction(conn):
            conn.executemany("UPDATE posts SET likely = ? WHERE id = ?", changed)
    more = len(rows) == limit
    return len(changed), ((rows[-1]["published_at"], rows[-1]["id"]) if more else None)


def rescore_direction(conn, learners, direction, limit=None):
    """Judge the newest `limit` (RESCORE_LIMIT) undecided cards of a
    direction again; returns how many changed."""
    return judge_cards(conn, learners, direction, limit=limit or RESCORE_LIMIT)[0]


def judge_every_card(conn, learners, direction):
    """Judge every undecided card of a direction again, a batch at a time;
    returns how many changed."""
    changed, after = 0, None
    while True:
        count, after = judge_cards(conn, learners, direction, after)
        changed += count
        if after is None:
            return changed


def unjudged_cards(conn, direction):
    """How many undecided cards of a direction have no likely (post_counts)."""
    return conn.execute("SELECT coalesce(sum(n), 0) FROM post_counts WHERE status = 'new' "
                        "AND direction = ? AND liked = -1", (direction,)).fetchone()[0]


def forget_chances(conn, direction, limit=None):
    """Take the chance off up to `limit` (JUDGE_BATCH) undecided cards of a
    direction whose model is not used (see Model.used, judge_cards): its
    desk is then as keywords make it. Returns how many."""
    if not conn.execute("""SELECT 1 FROM post_counts WHERE status = 'new' AND direction = ?
                               AND liked != -1 AND n > 0 LIMIT 1""", (direction,)).fetchone():
        return 0
    ids = [(row[0],) for row in conn.execute(
        f"""SELECT p.id FROM posts p WHERE p.status = 'new' AND p.classified = {DONE}
              AND p.direction = ? AND {card('p.')} AND p.likely IS NOT NULL LIMIT ?""",
        (direction, limit or JUDGE_BATCH))]
    if ids:
        with transaction(conn):
            conn.executemany("UPDATE posts SET likely = NULL WHERE id = ? AND status = 'new'", ids)
    return len(ids)


def take_in_missed(conn, learners, limit=RESCORE_LIMIT):
    """The newest undecided posts no keyword matched that a direction's model
    now wants join that direction, as the worker would classify them now
    (see Classifier.prepare): with relevance and interest 2, what keywords
    give a match of no word. Returns how many joined one."""
    if not any(learners.model(direction) for direction in list(learners.models)):
        return 0
    rows = conn.execute(f"""SELECT p.id, p.title, substr(p.text, 1, {LEARN_CHARS}) AS text,
                                   p.source_id FROM posts p
                            WHERE p.status = 'new' AND p.classified = {DONE}
                              AND p.direction IS NULL AND p.keywords IS NULL AND {card('p.')}
                            ORDER BY p.published_at DESC, p.id DESC LIMIT ?""", (limit,)).fetchall()
    joined = []
    for row in rows:
        wanted = learners.wanted(post_features(row["title"], row["text"], row["source_id"],
                                               row["id"]))
        if wanted:
            joined.append((*wanted, row["id"]))
    if joined:
        with transaction(conn):
            conn.executemany("""UPDATE posts SET direction = ?, likely = ?,
                                    relevance = CASE WHEN relevance >= 2 THEN relevance ELSE 2 END,
                                    interest = CASE WHEN interest >= 2 THEN interest ELSE 2 END
                                WHERE id = ? AND direction IS NULL""", joined)
    return len(joined)


class Stopped(Exception):
    """The page is stopping: the thread that judges in the background ends."""


class Rescorer:
    """After decisions, the undecided cards of their directions are judged
    again (rescore_direction) by the model they changed. Not at once, so a
    decision answers at once and a run of decisions pays for one judging:
    the newest `first` cards of a direction when a desk page of it is asked
    for next (the page then reflects the last decision), the newest `limit`
    of them, the posts no keyword matched (take_in_missed) and the cards its
    model has not judged yet (judge_unjudged, `batch` at a time) in a thread
    of its own once no decision came for `idle` seconds. Of the decisions
    owed to the models (see learn_owed), a page counts `owed` at most before
    it answers (a bulk decision of thousands would hold it a minute); the
    rest are counted once the editor pauses, a batch at a time; a page
    waiting to judge goes before the thread's next batch. As the page
    starts, every direction is judged so (catch_up)."""
    first = 100
    owed = 100
    limit = RESCORE_LIMIT
    batch = JUDGE_BATCH
    idle = 2.0
    whole = 50          # decided at once, this many posts have every card judged again

    def __init__(self, db, learners):
        self.db, self.learners = db, learners
        self.stale, self.later = set(), set()
        self.every_card = set()         # directions whose every card is to be judged again
        self.everything = False         # see catch_up
        self.last_decision, self.thread = 0.0, None
        self.lock = threading.Lock()        # one judging at a time
        self.changed = threading.Lock()     # guards the sets, the thread and `pages`
        self.pages = 0                      # pages waiting for the lock
        self.stopped = False                # see stop
        self.stopping = threading.Event()   # wakes the thread of `run` from its pause

    def ask(self, directions, count=1):
        """Decisions on `count` posts changed these directions' models: the
        next page of each judges its newest cards (wait), and the thread of
        `run` the rest once the editor pauses, a page asked for or not (a
        script's decisions are counted too); every card, once `whole` or
        more were decided at once (a bulk decision, or its undo, moves a
        model far)."""
        with self.changed:
            self.stale.update(d for d in directions if d)
            self.later.update(d for d in directions if d)
            if count >= self.whole:
                self.every_card.update(d for d in directions if d)
            self.last_decision = time.monotonic()
            if self.later:
                self.start()

    def catch_up(self):
        """As the page starts, when the database owes the models decisions
        (every one, after an upgrade that counts them anew; those of a
        process stopped before it counted them), in the thread of `run`:
        count them, then in every direction judge the newest `limit` cards
        again and the cards the models have not judged yet (after an
        upgrade, every card)."""
        conn = self.db.conn()
        if not owes_learning(conn) and not (
                get_meta(conn, "learn_features")[0] != LEARN_FEATURES and conn.execute(
                    "SELECT 1 FROM posts WHERE status IN ('approved', 'rejected') "
                    "LIMIT 1").fetchone()):
            return
        with self.changed:
            self.everything = True
            self.start()

    def stop(self, timeout=5.0):
        """No more judging: the thread of `run` ends after its batch (waited
        for up to `timeout` seconds), and starts no more."""
        with self.changed:
            self.stopped, thread = True, self.thread
        self.stopping.set()
        if thread is not None:
            thread.join(timeout)

    def start(self):
        """In self.changed: the thread of `run`, unless it runs already."""
        if self.thread is None and not self.stopped:
            self.thread = threading.Thread(target=self.run, name="rescore", daemon=True)
            self.thread.start()

    def wait(self, direction=None):
        """Judge the newest cards of `direction` (None: of every direction)
        again if a decision changed its model since they were judged."""
        with self.changed:
            due = {d for d in self.stale if direction in (None, d)}
            self.stale -= due
        if not due:
            return
        with self.page_turn():
            conn = self.db.conn()               # the page's own
            learners = self.learners.refresh(conn, now=True, owed=self.owed)
            for stale in sorted(due):
                if stale in learners.models:
                    rescore_direction(conn, learners, stale, self.first)
            take_in_missed(conn, learners, self.first)
        with self.changed:
            self.later |= {d for d in due if d in self.learners.models}
            if self.later:
                self.start()

    @contextlib.contextmanager
    def page_turn(self):
        """The lock, for a page: the thread of `run` waits for it to have
        its turn (a lock is not fair: the thread would take it again)."""
        with self.changed:
            self.pages += 1
        try:
            self.lock.acquire()
        finally:
            with self.changed:
                self.pages -= 1
        try:
            yield
        finally:
            self.lock.release()

    @contextlib.contextmanager
    def batch_turn(self):
        """The lock and a connection, for a batch of the thread of `run`,
        once no page waits for the lock; Stopped once stopped."""
        while self.pages:
            time.sleep(0.01)
        if self.stopped:
            raise Stopped
        with self.lock, self.db.lent():
            if self.stopped:
                raise Stopped
            yield self.db.conn()

    def run(self):
        """The rest, once the editor has paused."""
        while True:
            with self.changed:
                idle = time.monotonic() - self.last_decision
                if self.stopped or (not self.later and not self.everything):
                    self.thread = None
                    return
                if idle >= self.idle:
                    directions, self.later = sorted(self.later), set()
                    every_card, self.every_card = self.every_card, set()
                    everything, self.everything = self.everything, False
                else:
                    directions = None
            if directions is None:
                self.stopping.wait(self.idle - idle)
                continue
            try:
                with self.batch_turn() as conn:
                    catch_up_index(conn)    # the counts judge_unjudged reads
                    if everything:          # first what changed since the last process
                        self.learners.refresh(conn, now=True, owed=0)
                self.count_owed()
                with self.batch_turn() as conn:
                    self.learners.refresh(conn, now=True)
                    if everything:  # the directions the decisions counted now have too
                        directions = sorted(set(directions) | set(self.learners.models))
                    for direction in directions:
                        rescore_direction(conn, self.learners, direction, self.limit)
                    take_in_missed(conn, self.learners, self.limit)
                for direction in directions:
                    self.judge_unjudged(direction, every=direction in every_card)
            except Stopped:
                continue            # ends at the top of the loop
            except Exception as e:  # noqa: BLE001 - the page goes on; the worker judges anew
                log.warning("judging undecided posts again failed: %s", e)

    def count_owed(self):
        """Count the decisions still owed, a batch at a time, letting a
        page's judging go first between batches."""
        while True:
            with self.batch_turn() as conn:
                if not owes_learning(conn):
                    return
                learn_owed(conn, LEARN_BATCH)

    def judge_unjudged(self, direction, every=False):
        """Judge the direction's cards its model has not judged yet (with
        `every`, every card again; while it has no model used: take the
        chance off every card that has one), a batch at a time, letting a
        page's judging go first between batches."""
        after = None
        while True:
            with self.batch_turn() as conn:
                if self.learners.model(direction) is None:
                    if not forget_chances(conn, direction, self.batch):
                        return
                    continue
                if after is None and not every and not unjudged_cards(conn, direction):
                    return
                _, after = judge_cards(conn, self.learners, direction, after, self.batch,
                                       unjudged=not every)
            if after is None:
                return


###############################################################################
# Records #####################################################################
###############################################################################
# Runs, health, feed and channel state. What a fetch's outcome does to a
# source's record is decided by pure functions of the record (next_rhythm,
# failed_fetch); the functions around them read the row, write the result
# and say what changed.

@redoable
def start_run(conn, source_id, task, trigger):
    # In a transaction: the process's threads queue for the write lock and
    # are woken the moment it is free (see write_lock), where a lone
    # statement would wait in SQLite's busy handler, which sleeps and polls.
    with transaction(conn):
        return conn.execute(
            "INSERT INTO runs (source_id, task, trigger, started_at, pid) VALUES (?, ?, ?, ?, ?) "
            "RETURNING id", (source_id, task, trigger, utc_text(), os.getpid())).fetchone()[0]


def finish_run(conn, run_id, status, new_posts=0, error=None):
    conn.execute("""UPDATE runs SET finished_at = ?, status = ?, new_posts = ?, error = ?
                    WHERE id = ?""", (utc_text(), status, new_posts, error, run_id))


def interrupt_runs(conn, pid=None):
    """Close the runs a stopped process leaves unfinished."""
    return conn.execute("""UPDATE runs SET status = 'interrupted', finished_at = ?,
                           error = 'stopped before it finished'
                           WHERE status = 'running' AND pid = ?""",
                        (utc_text(), os.getpid() if pid is None else pid)).rowcount


def close_orphan_runs(conn):
    """Runs left 'running' by a process that no longer exists (killed, or the
    machine restarted) are closed, so the page does not show them running."""
    pids = [row[0] for row in conn.execute(
        "SELECT DISTINCT pid FROM runs WHERE status = 'running' AND pid IS NOT NULL")]
    return sum(interrupt_runs(conn, pid) for pid in pids if not process_alive(pid))


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


DEAD_PROBE_FIRST = 3600
DEAD_PROBE_MAX = 86400


# The longest a server's cache headers or a feed's <ttl> may keep a source
# from being fetched.
MAX_FRESH = 86400


def record_success(conn, source, new_posts=0, fresh_for=None, now=None):
    """A fetch that worked: the source is alive, fetched again no sooner than
    its server allows (`fresh_for` seconds, at most a day), and its rhythm
    of new posts is brought up to date."""
    now = time.time() if now is None else now
    not_before = utc_text(now + min(fresh_for, MAX_FRESH)) if fresh_for and fresh_for > 0 else None
    conn.execute("""UPDATE sources SET status = 'alive', error_count = 0, last_error = NULL,
                    last_fetch = ?, next_fetch_at = ? WHERE id = ?""",
                 (utc_text(now), not_before, source["id"]))
    if source["status"] == "dead":
        log.warning("source %s is alive again", source["slug"])
    note_rhythm(conn, source, new_posts, now)


# Silence: a source is silent when it has brought nothing new for twice the
# longest of its last RHYTHM_GAPS gaps between new posts (a night's or a
# weekend's pause is part of its rhythm), never sooner than SILENT_AFTER_MIN,
# and only once it has a history. The silence itself is not remembered as a gap.
RHYTHM_GAPS = 20
RHYTHM_MIN_GAPS = 5
SILENT_AFTER_MIN = 6 * 3600


def silence_limit(gaps):
    """Seconds without a new post after which a source with these gaps
    between its new posts is silent; None while its history is too short."""
    if len(gaps) < RHYTHM_MIN_GAPS:
        return None
    return max(2 * max(gaps), SILENT_AFTER_MIN)


def usual_gap(gaps):
    return sorted(gaps)[len(gaps) // 2] if gaps else None


def read_gaps(text):
    try:
        gaps = json.loads(text or "[]")
    except ValueError:
        return []
    return [g for g in gaps if isinstance(g, (int, float)) and g >= 0] if isinstance(gaps, list) else []


class Rhythm(typing.NamedTuple):
    """What a fetch that worked does to a source's rhythm: its gaps between
    new posts, the time of its last new post, whether it is silent, and
    what to say ("speaks again", "silent" or None)."""
    gaps: list
    last_new: float
    silent: bool
    news: str


def next_rhythm(gaps, last_new, silent, new_posts, now):
    """A source's rhythm after a fetch that worked at `now`, decided from its
    record alone (no database, no clock, no log): new posts add a gap (none
    while it was silent: the silence is not part of its rhythm) and end a
    silence; none for longer than silence_limit makes it silent."""
    if new_posts:
        if last_new is not None and not silent:
            gaps = (gaps + [max(0, int(now - last_new))])[-RHYTHM_GAPS:]
        return Rhythm(gaps, now, False, "speaks again" if silent and last_new is not None else None)
    limit = silence_limit(gaps)
    if silent or last_new is None or limit is None or now - last_new < limit:
        return Rhythm(gaps, last_new, silent, None)
    return Rhythm(gaps, last_new, True, "silent")


def note_rhythm(conn, source, new_posts, now):
    """After a fetch that worked: the source's rhythm brought up to date (see
    next_rhythm), its new posts counted for the day, one warning each way."""
    row = conn.execute("SELECT last_new_at, rhythm, silent_since FROM sources WHERE id = ?",
                       (source["id"],)).fetchone()
    gaps, last_new = read_gaps(row["rhythm"]), parse_utc(row["last_new_at"])
    rhythm = next_rhythm(gaps, last_new, bool(row["silent_since"]), new_posts, now)
    if new_posts:
        conn.execute("""UPDATE sources SET last_new_at = ?, rhythm = ?, silent_since = NULL
                        WHERE id = ?""", (utc_text(now), json.dumps(rhythm.gaps), source["id"]))
        conn.execute("""INSERT INTO source_days (source_id, day, new_posts) VALUES (?, ?, ?)
                        ON CONFLICT (source_id, day) DO UPDATE SET
                            new_posts = source_days.new_posts + excluded.new_posts""",
                     (source["id"], utc_text(now)[:10], new_posts))
    elif rhythm.news == "silent":
        conn.execute("UPDATE sources SET silent_since = ? WHERE id = ?",
                     (utc_text(now), source["id"]))
    if rhythm.news == "speaks again":
        log.warning("source %s speaks again: %d new posts after %s of silence",
                    source["slug"], new_posts, duration_text(now - last_new))
    elif rhythm.news == "silent":
        log.warning("source %s is silent: no new post for %s (it usually brings some every %s)",
                    source["slug"], duration_text(now - last_new), duration_text(usual_gap(gaps)))


def refresh_figures(conn, source_id, min_relevance, now=None):
    """The operator's figures of one source: new posts in the last 7 days,
    the share of its classified posts that are relevant, approved posts."""
    since = utc_text((time.time() if now is None else now) - 6 * 86400)[:10]
    conn.execute("""
        UPDATE sources SET
            week_posts = (SELECT coalesce(sum(new_posts), 0) FROM source_days
                          WHERE source_id = :id AND day >= :since),
            relevant_share = (SELECT CAST(sum(CASE WHEN relevance >= :floor THEN n ELSE 0 END) AS REAL)
                                     / nullif(sum(n), 0)
                              FROM source_post_counts WHERE source_id = :id),
            approved = (SELECT coalesce(sum(n), 0) FROM source_post_counts
                        WHERE source_id = :id AND status = 'approved')
        WHERE id = :id""", {"id": source_id, "since": since, "floor": min_relevance})


def refresh_every_figure(conn, min_relevance):
    """refresh_figures of every source, once workers classified their posts:
    a source's share of relevant posts is known only then, after its run."""
    with transaction(conn):
        for (source_id,) in conn.execute("SELECT id FROM sources ORDER BY id").fetchall():
            refresh_figures(conn, source_id, min_relevance)


def failed_fetch(error_count, dead, dead_after, gone=False):
    """A source's record after one more failed fetch, decided from the record
    alone: (failures in a row, dead, seconds until a dead source is probed).
    At `dead_after` failures in a row, or at once when the feed is gone
    (410), it is dead; a dead source is probed with a doubling backoff."""
    count = error_count + 1
    dead = gone or dead or count >= dead_after
    return count, dead, min(DEAD_PROBE_FIRST * 2 ** max(0, count - dead_after), DEAD_PROBE_MAX)


def record_failure(conn, source, error, dead_after, dead_now=False, now=None):
    """Count a failure (see failed_fetch); a source that died says so once."""
    now = time.time() if now is None else now
    count, dead, probe_in = failed_fetch(source["error_count"], source["status"] == "dead",
                                         dead_after, dead_now)
    conn.execute("""UPDATE sources SET error_count = ?, last_error = ?, last_fetch = ?,
                    status = ?, next_fetch_at = ? WHERE id = ?""",
                 (count, shorten(error, 2000), utc_text(now), "dead" if dead else "alive",
                  utc_text(now + probe_in) if dead else None, source["id"]))
    if dead and source["status"] != "dead":
        log.warning("source %s is dead after %d failed fetch%s: %s", source["slug"], count,
                    "" if count == 1 else "es", shorten(error, 200))


def record_deferral(conn, source, error, seconds, now=None):
    """429/503 with Retry-After: wait as asked; not an error toward dead."""
    now = time.time() if now is None else now
    conn.execute("""UPDATE sources SET last_fetch = ?, last_error = ?, next_fetch_at = ?
                    WHERE id = ?""",
                 (utc_text(now), error, utc_text(now + seconds), source["id"]))


def record_problem(conn, source, error):
    """A problem that is not the source's fault (Telegram not set up): shown
    on the source, not counted toward dead."""
    conn.execute("UPDATE sources SET last_error = ?, last_fetch = ? WHERE id = ?",
                 (error, utc_text(), source["id"]))


def reset_dead(conn):
    """Every dead source becomes alive with a clean record."""
    return conn.execute("""UPDATE sources SET status = 'alive', error_count = 0,
                           last_error = NULL, next_fetch_at = NULL
                           WHERE status = 'dead'""").rowcount


def load_rss_state(conn, source_id):
    row = conn.execute("SELECT * FROM rss_state WHERE source_id = ?", (source_id,)).fetchone()
    return dict(row) if row else {"source_id": source_id, "keep_fragments": 0}


def save_rss_state(conn, source_id, **fields):
    fields["updated_at"] = utc_text()
    columns = ", ".join(fields)
    updates = ", ".join(f"{c} = excluded.{c}" for c in fields)
    conn.execute(f"""INSERT INTO rss_state (source_id, {columns})
                     VALUES (?, {', '.join('?' * len(fields))})
                     ON CONFLICT(source_id) DO UPDATE SET {updates}""",
                 (source_id, *fields.values()))


def stored_links(conn, source_id, canonical):
    """The links as given of this source's posts stored under a canonical URL."""
    return [row[0] for row in conn.execute(
        "SELECT url FROM posts WHERE canonical_url = ? AND source_id = ? AND url IS NOT NULL",
        (canonical, source_id))]


def moved_feeds(conn):
    """{source_id: URL} of feeds that moved permanently."""
    return {row[0]: row[1] for row in conn.execute(
        "SELECT source_id, moved_to FROM rss_state WHERE moved_to IS NOT NULL")}


def last_message_id(conn, source_id):
    row = conn.execute("SELECT last_message_id FROM tg_state WHERE source_id = ?",
                       (source_id,)).fetchone()
    return row[0] if row else 0


def load_tg_state(conn, source_id):
    row = conn.execute("SELECT * FROM tg_state WHERE source_id = ?", (source_id,)).fetchone()
    return dict(row) if row else {}


def save_channel_peer(conn, source_id, channel_id, access_hash, username):
    """Keep what resolving a channel's username gave, so it is done once."""
    conn.execute("""INSERT INTO tg_state (source_id, channel_id, access_hash, username, updated_at)
                    VALUES (?, ?, ?, ?, ?)
                    ON CONFLICT(source_id) DO UPDATE SET channel_id = excluded.channel_id,
                        access_hash = excluded.access_hash, username = excluded.username,
                        updated_at = excluded.updated_at""",
                 (source_id, channel_id, access_hash, username, utc_text()))


def edit_floor(conn, source_id, hours, now=None):
    """Just below the oldest message of a channel posted within `hours`: the
    messages above it are read again for edits. None when there is none."""
    since = utc_text((time.time() if now is None else now) - hours * 3600)
    row = conn.execute("""SELECT min(CAST(external_id AS INTEGER)) FROM posts
                          WHERE source_id = ? AND published_at >= ?""",
                       (source_id, since)).fetchone()
    return row[0] - 1 if row and row[0] else None


@redoable
def defer_telegram(conn, seconds, now=None):
    """A long FloodWait binds the account: every Telegram source waits until
    it ends (not counted toward dead). Returns when, as UTC text."""
    now = time.time() if now is None else now
    until = utc_text(now + seconds)
    conn.execute("""UPDATE sources SET next_fetch_at = ?, last_fetch = ?,
                    last_error = ? WHERE crawler = 'telegram' AND enabled = 1""",
                 (until, utc_text(now), f"Telegram FloodWait of {int(seconds)} s: every "
                  f"channel waits until {until} UTC"))
    return until


def save_last_message_id(conn, source_id, message_id):
    conn.execute("""INSERT INTO tg_state (source_id, last_message_id, updated_at) VALUES (?, ?, ?)
                    ON CONFLICT(source_id) DO UPDATE SET
                        last_message_id = CASE WHEN excluded.last_message_id > tg_state.last_message_id
                                          THEN excluded.last_message_id ELSE tg_state.last_message_id END,
                        updated_at = excluded.updated_at""",
                 (source_id, message_id, utc_text()))


###############################################################################
# Editors #####################################################################
###############################################################################
# The newsroom's accounts (users), their signed-in sessions, and the record
# of who did what (events). Passwords are kept only as salted scrypt hashes.
# Roles: a viewer reads every page and export, an editor also decides, edits
# and publishes, an admin also resets sources and manages the accounts.

ROLES = ("viewer", "editor", "admin")
# Letters and digits of any script, and . _ - after the first.
USER_NAME = re.compile(r"[^\W_][\w.-]{0,63}")
MIN_PASSWORD = 8


def password_hash(password, cost, salt=None):
    """'scrypt:N:r:p:salt:hash' of a password at `cost` (scrypt's n, r and p:
    Process.password_cost), the only form it is kept in."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, dklen=32, **cost)
    return f"scrypt:{cost['n']}:{cost['r']}:{cost['p']}:{salt.hex()}:{digest.hex()}"


def password_matches(password, kept):
    """True when `password` is the one `kept` is the hash of."""
    try:
        kind, n, r, p, salt, digest = kept.split(":")
        computed = hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt), n=int(n),
                                  r=int(r), p=int(p), dklen=len(digest) // 2)
    except (ValueError, AttributeError):
        return False
    return kind == "scrypt" and hmac.compare_digest(computed.hex(), digest)


def role_allows(role, needed):
    return role in ROLES and ROLES.index(role) >= ROLES.index(needed)


def check_user_name(name):
    """The name as kept (NFKC); ConfigError for one that cannot be a name."""
    name = unicodedata.normalize("NFKC", name or "")
    if not USER_NAME.fullmatch(name):
        raise ConfigError(f"user name {shorten(name, 40)!r}: 1 to 64 letters (of any script), "
                          f"digits, '.', '_' or '-', starting with a letter or digit")
    return name


def check_password(password):
    if len(password) < MIN_PASSWORD:
        raise ConfigError(f"the password must have at least {MIN_PASSWORD} characters")
    if "\x00" in password or password != password.strip():
        raise ConfigError("the password must not start or end with a space, nor hold a NUL")
    return password


def record_event(conn, who, address, action, subject=None, detail=None):
    """Who did what to what, when and from where; in the caller's transaction."""
    conn.execute("INSERT INTO events (at, user_name, address, action, subject, detail) "
                 "VALUES (?, ?, ?, ?, ?, ?)",
                 (utc_text(), who, address, action, subject, shorten(detail or "", 500) or None))


def find_user(conn, name):
    """The account of this name, as written or as sign-in compares it (of
    accounts an older release let differ only in case, the first enabled
    one: see same_name_keys)."""
    return conn.execute("SELECT * FROM users WHERE name = ?", (name,)).fetchone() or \
        conn.execute("SELECT * FROM users WHERE name_key = ? ORDER BY disabled, name LIMIT 1",
                     (user_key(name),)).fetchone()


def add_user(conn, name, role, password, who, address):
    """A new account; ConfigError when the name is taken (in any case) or
    anything is wrong."""
    name = check_user_name(name)
    if role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    kept = password_hash(check_password(password), conn.process.password_cost)
    with transaction(conn):
        taken = find_user(conn, name)
        if taken is not None:
            raise ConfigError(f"user {taken['name']!r} exists already (user passwd "
                              f"{taken['name']} changes the password)")
        conn.execute("INSERT INTO users (name, name_key, role, password_hash, created_at, "
                     "password_changed_at) VALUES (?, ?, ?, ?, ?, ?)",
                     (name, user_key(name), role, kept, utc_text(), utc_text()))
        record_event(conn, who, address, "user add", f"user:{name}", f"role {role}")


def sessions_ended(count):
    return f"{count} session{'' if count == 1 else 's'} ended"


def keep_settings_account(conn, name, password=None, kept=None):
    """The VESTI_WEB_USER account as a row like any other, an admin whose
    hash is that of the settings' password (VESTI_WEB_PASSWORD, or `kept`,
    the generated one's hash): signing in compares it as any other, and a
    new password or name ends the sessions made with the old one (a
    renamed account is disabled, an account like any other from then on),
    and it is an admin again if it was made
    anything else. A name is one in any letters: "Admin" is the row "admin".
    Returns its row."""
    row = conn.execute("""SELECT * FROM users WHERE name_key = ?
                          ORDER BY name = ? DESC, settings DESC, name LIMIT 1""",
                       (user_key(name), name)).fetchone()
    name = name if row is None else row["name"]
    # Its password is the settings' already (an older release's account of
    # that name, say): its hash and sessions stay.
    kept_password = row is not None and (
        row["password_hash"] == kept if password is None else
        password_matches(password, row["password_hash"]))
    same = kept_password and row["settings"] and not row["disabled"]
    new_hash = row["password_hash"] if kept_password else kept if password is None else \
        password_hash(password, conn.process.password_cost)
    with transaction(conn):
        for old in conn.execute("SELECT name, disabled FROM users WHERE settings = 1 "
                                "AND name != ?", (name,)).fetchall():
            conn.execute("UPDATE users SET disabled = 1, settings = 0 WHERE name = ?", (old[0],))
            if not old[1]:
                conn.execute("DELETE FROM sessions WHERE user_name = ?", (old[0],))
                record_event(conn, "settings", "local", "user change", f"user:{old[0]}",
                             f"VESTI_WEB_USER is {name} now: disabled, its sessions ended")
        if same and row["role"] != "admin":
            conn.execute("UPDATE users SET role = 'admin' WHERE name = ?", (name,))
            record_event(conn, "settings", "local", "user change", f"user:{name}",
                         f"role {row['role']} -> admin (VESTI_WEB_USER's account is an admin)")
        if not same:
            if row is not None and not row["settings"]:
                log.warning("web: the account %r of the users table is VESTI_WEB_USER's now: "
                            "it signs in with the settings' password", name)
            conn.execute("""INSERT INTO users (name, name_key, role, password_hash, created_at,
                                               password_changed_at, settings)
                            VALUES (?, ?, 'admin', ?, ?, ?, 1)
                            ON CONFLICT (name) DO UPDATE SET role = 'admin', disabled = 0,
                                password_hash = excluded.password_hash, settings = 1,
                                password_changed_at = excluded.password_changed_at""",
                         (name, user_key(name), new_hash, utc_text(), utc_text()))
            if row is not None and not kept_password:
                ended = conn.execute("DELETE FROM sessions WHERE user_name = ?", (name,)).rowcount
                record_event(conn, "settings", "local", "user change", f"user:{name}",
                             f"the settings' password changed; {sessions_ended(ended)}")
            elif row is not None:
                record_event(conn, "settings", "local", "user change", f"user:{name}",
                             "VESTI_WEB_USER's account now, with the password it had")
        return conn.execute("SELECT * FROM users WHERE name = ?", (name,)).fetchone()


def change_user(conn, name, who, address, password=None, role=None, disabled=None):
    """A new password, role, or disabled flag for an account; a new password
    or disabling ends every session of the user. Returns the account."""
    if role is not None and role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    kept = password_hash(check_password(password), conn.process.password_cost) \
        if password is not None else None
    with transaction(conn):
        user = find_user(conn, name)
        if user is None:
            raise ConfigError(f"no user {name!r} (user list shows them)")
        name, said = user["name"], []
        if kept is not None:
            conn.execute("UPDATE users SET password_hash = ?, password_changed_at = ? WHERE name = ?",
                         (kept, utc_text(), name))
            said.append("password changed")
        if role is not None and role != user["role"]:
            conn.execute("UPDATE users SET role = ? WHERE name = ?", (role, name))
            said.append(f"role {user['role']} -> {role}")
        if disabled is not None and bool(disabled) != bool(user["disabled"]):
            conn.execute("UPDATE users SET disabled = ? WHERE name = ?", (int(disabled), name))
            said.append("disabled" if disabled else "enabled")
        if user["settings"] and (kept is not None or disabled):
            raise ConfigError(f"{name} is the account of VESTI_WEB_USER: its password is "
                              f"VESTI_WEB_PASSWORD (change it there)")
        if user["settings"] and role not in (None, "admin"):
            raise ConfigError(f"{name} is the account of VESTI_WEB_USER: it stays an admin "
                              f"(another VESTI_WEB_USER, or none, frees it)")
        if kept is not None or disabled:
            ended = conn.execute("DELETE FROM sessions WHERE user_name = ?", (name,)).rowcount
            if ended:
                said.append(sessions_ended(ended))
        if said:
            record_event(conn, who, address, "user change", f"user:{name}", "; ".join(said))
        return find_user(conn, name)


# Wrong passwords in LOGIN_WINDOW seconds after which a name, or an address
# (any names: a guesser spraying many), is locked: every try is then
# refused (429), right password or not, until the oldest of them is that old.
LOGIN_FAILURES = 5
ADDRESS_FAILURES = 30
LOGIN_WINDOW = 900


def address_key(address):
    """Who a client address is for the locks: an IPv6 client's whole /64
    (one host has them all)."""
    plain = plain_address(address)
    if plain is not None and plain.version == 6:
        return str(ipaddress.ip_network(f"{plain}/64", strict=False))
    return str(plain or address)


# What each lock counts: the column, and how many wrong passwords lock it.
LOCKS = (("name", "user_key", LOGIN_FAILURES), ("address", "address", ADDRESS_FAILURES))


def locked_until(conn, column, key, limit, now):
    """When the lock on this key ends (a time), or None when it has none."""
    recent = conn.execute(f"""SELECT at FROM sign_in_failures WHERE {column} = ? AND at > ?
                              ORDER BY at DESC LIMIT ?""", (key, now - LOGIN_WINDOW, limit)).fetchall()
    return recent[-1][0] + LOGIN_WINDOW if len(recent) == limit else None


def sign_in_lock(conn, address, name, now=None):
    """(what is locked: "name" or "address", until when as a time) when the
    name or the address gave too many wrong passwords lately, else None.
    Reads only."""
    now = time.time() if now is None else now
    keys = {"name": user_key(name), "address": address_key(address)}
    for kind, column, limit in LOCKS:
        until = locked_until(conn, column, keys[kind], limit, now)
        if until is not None:
            return kind, until
    return None


def note_wrong_password(conn, address, name, how, now=None):
    """A wrong password, kept for every process (and recorded as an event);
    the lock it starts, as sign_in_lock says, or None."""
    now = time.time() if now is None else now
    with transaction(conn):
        conn.execute("DELETE FROM sign_in_failures WHERE at <= ?", (now - LOGIN_WINDOW,))
        conn.execute("INSERT INTO sign_in_failures (at, address, user_key) VALUES (?, ?, ?)",
                     (now, address_key(address), user_key(name)))
        record_event(conn, None, address, "sign-in failed", f"user:{shorten(name, 64)}", how)
        lock = sign_in_lock(conn, address, name, now)
        if lock is not None:
            subject = f"user:{shorten(name, 64)}" if lock[0] == "name" else f"address:{address_key(address)}"
            record_event(conn, None, address, "sign-in locked", subject,
                         f"until {utc_text(lock[1])} UTC")
    return lock


def sign_in_locks(conn, now=None):
    """The names (their keys) and addresses locked now: [(kind, key, until)]."""
    now = time.time() if now is None else now
    found = []
    for kind, column, limit in LOCKS:
        for row in conn.execute(f"""SELECT {column} FROM sign_in_failures WHERE at > ?
                                    GROUP BY {column} HAVING count(*) >= ? ORDER BY 1""",
                                (now - LOGIN_WINDOW, limit)).fetchall():
            until = locked_until(conn, column, row[0], limit, now)
            if until is not None:
                found.append((kind, row[0], until))
    return found


def list_users(conn):
    return conn.execute("""SELECT u.*, (SELECT count(*) FROM sessions s WHERE s.user_name = u.name)
                               AS sessions FROM users u ORDER BY u.disabled, u.name""").fetchall()


def session_key(token):
    """What the sessions table keeps of a session's cookie: its sha256 only."""
    return hashlib.sha256(token.encode()).hexdigest()


def start_session(conn, name, address):
    """A new session of the user: (the cookie's value, the form token)."""
    token, form = secrets.token_urlsafe(32), secrets.token_hex(32)
    with transaction(conn):
        conn.execute("INSERT INTO sessions (id, user_name, form_token, created_at, last_seen_at, address) "
                     "VALUES (?, ?, ?, ?, ?, ?)",
                     (session_key(token), name, form, utc_text(), utc_text(), address))
        record_event(conn, name, address, "sign in")
    return token, form


# A session's last request is written down at most this often.
SESSION_TOUCH = 60


def session_of(conn, token, hours, now=None):
    """The session row (with the user's role) a cookie names, if it is still
    on: its user enabled and its last request within `hours`. An expired
    one is deleted."""
    now = time.time() if now is None else now
    row = conn.execute("""SELECT s.*, u.role, u.disabled FROM sessions s
                          JOIN users u ON u.name = s.user_name WHERE s.id = ?""",
                       (session_key(token),)).fetchone()
    if row is None:
        return None
    seen = parse_utc(row["last_seen_at"]) or 0
    if row["disabled"] or now - seen > hours * HOUR:
        with transaction(conn):
            conn.execute("DELETE FROM sessions WHERE id = ?", (row["id"],))
        return None
    if now - seen > SESSION_TOUCH:
        with transaction(conn):
            conn.execute("UPDATE sessions SET last_seen_at = ? WHERE id = ?", (utc_text(now), row["id"]))
    return row


def end_session(conn, token, address):
    with transaction(conn):
        row = conn.execute("DELETE FROM sessions WHERE id = ? RETURNING user_name",
                           (session_key(token),)).fetchone()
        if row is not None:
            record_event(conn, row["user_name"], address, "sign out")
    return row is not None


# An editor's look at a card is shown to the others for this many seconds
# (the desk says again every LOOK_AGAIN seconds that it still looks).
LOOK_SECONDS = 20


def note_look(conn, post_id, name, now=None):
    now = time.time() if now is None else now
    with transaction(conn):
        conn.execute("DELETE FROM looks WHERE user_name = ? OR at < ?", (name, now - LOOK_SECONDS))
        conn.execute("INSERT INTO looks (post_id, user_name, at) VALUES (?, ?, ?) "
                     "ON CONFLICT (post_id, user_name) DO UPDATE SET at = excluded.at",
                     (post_id, name, now))


def lookers(conn, post_ids, name, now=None):
    """{post id: [names]} of the others looking at these cards now."""
    now = time.time() if now is None else now
    found = collections.defaultdict(list)
    for among, values in conn.dialect.among("post_id", post_ids):
        for row in conn.execute(f"SELECT post_id, user_name FROM looks WHERE {among} AND at >= ? "
                                f"AND user_name != ? ORDER BY user_name",
                                (*values, now - LOOK_SECONDS, name)):
            found[row["post_id"]].append(row["user_name"])
    return dict(found)


def recent_events(conn, limit=100):
    return conn.execute("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,)).fetchall()


###############################################################################
# Publications ################################################################
###############################################################################
# The outbox: one row per approved post and publish target (see Publishing
# for the sending). Approving a post queues it for every enabled target of
# its direction, with the post as it was approved (its item); taking the
# decision back cancels what waits and asks for what was sent to be deleted
# where it went. A story is published once, as its first post.
#
# A publication's states, and the one function that moves it along each
# transition: one statement that names the states it leaves (the sender's
# also its send's token; an editor's the version the page showed) and
# counts the change in `version`. Nothing slow runs inside: a text is
# composed before (compose_texts), a call is made between two transitions.
#
#   queue_publications   (none), cancelled -> queued      approved
#   claim_publications   queued -> sending                 just before the call
#   deliver_publication  sending, uncertain -> published   answered: its message, in its chat
#   retry_publication    sending -> queued                 not done (or a webhook's answer
#                                                          lost): again later, the same key
#   fail_publication     sending -> failed                 refused, or out of tries
#   doubt_publication    sending -> uncertain              may have arrived (no answer, or its
#                                                          sender gone): never again on its own
#   withdraw_publications queued, failed -> cancelled      the decision taken back; a send under
#                        sending, published, uncertain     way or done is marked (retract) to
#                                                          be deleted, an uncertain one to be
#                                                          checked by an editor
#   deleted_publication  published -> cancelled            its message deleted where it went
#   act_on_publication   an editor's: text, now (queued, failed, uncertain), published
#                        (uncertain -> published), again (failed, uncertain -> queued),
#                        cancel (queued, failed, uncertain -> cancelled)
#
# A row taken back while it was being sent goes to cancelled where the
# sender would have queued or failed it, and stays published (to be
# deleted) where its message arrived.

PUBLICATION_STATES = ("queued", "sending", "published", "failed", "uncertain", "cancelled")
TELEGRAM_LIMIT = 4096           # characters of one Bot API message, as Telegram counts them
SUMMARY_CHARS = 1200            # of a post's text, when it has no summary
TITLE_CHARS = 200               # of a title that leaves a message no room otherwise
LABEL_CHARS = 60                # of a link, as a message shows it (its href is whole)
LINK_MAX = 2048                 # characters of the longest link a message carries
WEBHOOK_TEXT_LIMIT = 100000     # characters of an editor's text for a webhook
ITEM_TEXT = 4000                # of a post's text, kept with its publication
# A link in a message's plain text: what message_html makes a link of.
WEB_LINK = re.compile(r"https?://[^\s<>\"]+", re.I)


def hashtag(direction):
    return "#" + re.sub(r"\W+", "_", direction).strip("_") if direction else ""


# Messages: texts are written and kept as plain text, and made into the Bot
# API's HTML only when sent (message_html): everything escaped, the first
# line in bold, links as links. Lengths count what Telegram shows (a link
# by its label) in UTF-16 code units, as Telegram does; a text too long is
# cut on its words, never inside a link.

def telegram_length(text):
    return len(text.encode("utf-16-le")) // 2


def shown_link(url):
    """What a message shows of a link: its label, or, for a link too long
    to carry, the link as text."""
    return shorten(url, LABEL_CHARS) if len(url) <= LINK_MAX else url


def message_parts(plain):
    """`plain` as (text, link) pairs: link is the href of a part shown as a
    link, else None."""
    parts, at = [], 0
    for match in WEB_LINK.finditer(plain):
        if match.start() > at:
            parts.append((plain[at:match.start()], None))
        url = match[0]
        parts.append((url, url if len(url) <= LINK_MAX else None))
        at = match.end()
    if at < len(plain):
        parts.append((plain[at:], None))
    return parts


def shown_length(plain):
    return sum(telegram_length(shown_link(text) if link else text)
               for text, link in message_parts(plain))


def linked_html(plain):
    return "".join(f'<a href="{html.escape(link)}">{html.escape(shown_link(link), quote=False)}</a>'
                   if link else html.escape(text, quote=False) for text, link in message_parts(plain))


def message_html(plain):
    """The Bot API's HTML of a message written as plain text: escaped, its
    first line in bold, each link a link whose label is the link shortened."""
    first, newline, rest = plain.partition("\n")
    head = f"<b>{linked_html(first)}</b>" if first.strip() else linked_html(first)
    return head + newline + linked_html(rest)


def cut_text(text, room):
    """The longest start of `text` that Telegram counts at most `room`
    characters long, ending on a word and "…" when it is cut."""
    if telegram_length(text) <= room:
        return text
    if room <= 1:
        return "…"[:max(room, 0)]
    start = text.encode("utf-16-le")[:2 * (room - 1)].decode("utf-16-le", "ignore")
    space = max(start.rfind(" "), start.rfind("\n"))
    if space > len(start) - 40 and space > 0:
        start = start[:space]
    return start.rstrip() + "…"


def cut_message(plain, limit=TELEGRAM_LIMIT):
    """`plain` cut so that its message is at most `limit` long: on text,
    never inside a link (a link that does not fit is left out)."""
    if shown_length(plain) <= limit:
        return plain
    kept, used = [], 0
    for text, link in message_parts(plain):
        size = telegram_length(shown_link(text) if link else text)
        if used + size <= limit - 1:
            kept.append(text)
            used += size
            continue
        if not link:
            kept.append(cut_text(text, limit - used))
        else:
            kept.append("…")
        break
    return "".join(kept)


def one_line(text):
    return " ".join((text or "").split())


def carried_link(url):
    """A post's link as a message carries it: whole, with what would end
    it in a message's text percent-encoded; None when it is too long."""
    url = re.sub(r"[\s<>\"]", lambda m: urllib.parse.quote(m[0]),
                 link_without_bidi_controls(url or ""))
    return url if len(url) <= LINK_MAX and WEB_LINK.fullmatch(url) else None


def post_message(item, limit=TELEGRAM_LIMIT):
    """A post (its publication item) as the plain text of a Telegram
    message: the title, the summary, the source and the link, the
    direction's hashtag. The summary is cut so that the whole fits in
    `limit`, the title too where it alone leaves no room; a link too long
    for a message is left out, with a note."""
    title = one_line(item.get("title"))
    url = item.get("url") or ""
    link = carried_link(url) if url else None
    source = one_line(item.get("source"))
    if url and link is None:
        where = f"(link left out: {len(url):,} characters, too long for a message)"
    else:
        where = link or ""
    tail = "\n".join(part for part in (" · ".join(p for p in (source, where) if p),
                                       hashtag(item.get("direction"))) if part)
    summary = one_line(item.get("summary") or shorten(item.get("text") or "", SUMMARY_CHARS))
    room = limit - shown_length(title) - shown_length(tail) - 4
    if room < 20:
        title = shorten(title, TITLE_CHARS)
        room = limit - shown_length(title) - shown_length(tail) - 4
    summary = cut_message(summary, max(0, room)) if room > 0 else ""
    return cut_message("\n\n".join(part for part in (title, summary, tail) if part), limit)


def webhook_text(item):
    """A post's text as a webhook carries it (content_text of its item)."""
    return one_line(item.get("summary") or shorten(item.get("text") or "", SUMMARY_CHARS))


def card_address(settings, post_id):
    """A post's card on the desk, as an alert links to it."""
    base = settings.public_url or f"http://{settings.web_host}:{settings.web_port}"
    return f"{base}/?status=any&min=0&story={post_id}#post-{post_id}"


def alert_message(item, settings):
    """An alert: the story's title, how relevant and likely it is, the post
    as a message, and its card on the desk."""
    card = f"Card on the desk: {card_address(settings, item['id'])}"
    likely = f" · likely {item['likely']:.0%}" if item.get("likely") is not None else ""
    head = f"⚡ {hashtag(item.get('direction'))} · relevance {item.get('relevance')}{likely}".strip()
    body = post_message(item, TELEGRAM_LIMIT - shown_length(head) - shown_length(card) - 4)
    title, newline, rest = body.partition("\n")
    return f"{title}\n{head}{newline}{rest}\n{card}"


DIGEST_ITEMS = 30
DIGEST_MORE = 60                # room kept for the digest's last line


def digest_html(items, settings, limit=TELEGRAM_LIMIT):
    """Many alerts in one message: each title linked to its card, as many
    as fit; the rest counted on the last line."""
    head = f"⚡ {len(items)} stories"
    lines, used = [html.escape(head, quote=False)], telegram_length(head)
    for n, item in enumerate(items[:DIGEST_ITEMS]):
        title = shorten(one_line(item.get("title")), TITLE_CHARS) or f"post {item['id']}"
        size = telegram_length(title) + 3
        if used + size > limit - DIGEST_MORE:
            break
        card = card_address(settings, item["id"])
        lines.append(f'• <a href="{html.escape(card)}">{html.escape(title, quote=False)}</a>'
                     if len(card) <= LINK_MAX else f"• {html.escape(title, quote=False)}")
        used += size
    if len(lines) - 1 < len(items):
        lines.append(html.escape(f"… and {len(items) - len(lines) + 1} more on the desk", quote=False))
    return "\n".join(lines)


# What a publication keeps of its post: the post as it was approved.
PUBLISHED_POST = f"""SELECT p.id, p.title, p.url, p.summary, substr(p.text, 1, {ITEM_TEXT}) AS text,
                            p.direction, p.relevance, p.likely, p.status, p.story_id,
                            p.decided_at, p.decided_by, p.published_at, s.name AS source
                     FROM posts p LEFT JOIN sources s ON s.id = p.source_id"""
ITEM_FIELDS = ("id", "title", "url", "summary", "text", "direction", "relevance", "likely",
               "decided_at", "decided_by", "published_at", "source")


def item_of(post):
    """A post read by PUBLISHED_POST as its publication keeps it (JSON)."""
    return json.dumps({field: post[field] for field in ITEM_FIELDS}, ensure_ascii=False)


def publication_item(conn, item, post_id):
    """The post as a publication keeps it (`item`); for one queued before
    items were kept, the post as it reads now."""
    if item:
        return json.loads(item)
    post = conn.execute(f"{PUBLISHED_POST} WHERE p.id = ?", (post_id,)).fetchone()
    return {field: post[field] for field in ITEM_FIELDS} if post else None


def publication_text(kind, item, settings=None):
    """What a target of this kind is sent of an item, as plain text."""
    if kind == "alert":
        return alert_message(item, settings)
    return post_message(item) if kind == "telegram" else webhook_text(item)


@dataclasses.dataclass(frozen=True)
class Target:
    """A publish target as the outbox, the publisher and the pages read it:
    its row of `targets` (TargetSpec is what sources.yaml says of it)."""
    name: str
    kind: str                   # telegram | webhook | alert
    address: str                # the chat, or the webhook's URL
    directions: tuple           # None: every direction
    every: float                # seconds between two sends at least
    min_relevance: int
    min_likely: float
    per_hour: int
    enabled: bool
    paused_until: str           # refused as a whole (or a 429): nothing is sent till then
    last_sent_at: str
    sender: str                 # the process that sends for it now, and till when
    sender_until: str
    error: str
    alerts_from: int            # an alert target's look: the first post not looked at

    @classmethod
    def of(cls, row):
        values = {field.name: row[field.name] for field in dataclasses.fields(cls)}
        return cls(**values | {
            "directions": None if row["directions"] is None else tuple(json.loads(row["directions"])),
            "enabled": bool(row["enabled"])})

    def takes(self, direction):
        """Whether posts of this direction go to it."""
        return self.directions is None or direction in self.directions


@dataclasses.dataclass(frozen=True)
class Publication:
    """A publication as the sender and the outbox read it: its row of
    `publications` (see the states above), with its post's title and link
    where the outbox read them too."""
    id: int
    post_id: int
    target: str
    state: str
    text: str                   # what is sent, plain text (None: not composed yet)
    attempts: int
    error: str
    message_id: str
    queued_at: str
    sent_at: str
    token: str                  # the send under way
    next_attempt_at: str
    hurry: bool                 # "publish now"
    retract: bool               # taken back after it was sent: to be deleted where it went
    deleted_at: str
    idempotency_key: str
    updated_by: str
    item: str                   # the post as it was approved (JSON)
    chat: str                   # where its message went
    version: int
    title: str = None
    url: str = None

    @classmethod
    def of(cls, row):
        """The Publication of a row (None for none)."""
        if row is None:
            return None
        keys = row.keys()
        return cls(**{field.name: row[field.name] if field.name in keys else None
                      for field in dataclasses.fields(cls)}
                   | {"hurry": bool(row["hurry"]), "retract": bool(row["retract"])})


def read_targets(conn, where="", params=()):
    """[Target] of the rows `where` (an SQL condition) names, by name."""
    return [Target.of(row) for row in conn.execute(
        f"SELECT * FROM targets {'WHERE ' + where if where else ''} ORDER BY name", params)]


def read_target(conn, name):
    """The Target of that name, or None."""
    found = read_targets(conn, "name = ?", (name,))
    return found[0] if found else None


def targets_of(conn, direction, kinds=("telegram", "webhook")):
    """The enabled targets that take posts of this direction."""
    return [target for target in read_targets(
                conn, f"enabled = 1 AND kind IN ({','.join('?' * len(kinds))})", kinds)
            if target.takes(direction)]


def queue_publications(conn, post_ids, now=None):
    """In the caller's transaction: each approved post (its story's first
    post) is queued, as it reads now, for every target of its direction
    that does not have it yet, or has it cancelled; one marked to be deleted
    but not deleted yet is kept instead. Its text is composed after the
    transaction (compose_texts). Returns how many were queued (the caller
    wakes the publisher once it committed: Process.publish_wake)."""
    now, queued = utc_text(now), 0
    if conn.execute("SELECT 1 FROM targets WHERE enabled = 1 AND kind != 'alert' LIMIT 1"
                    ).fetchone() is None:
        return 0
    leads = {row[0] for post_id in post_ids for row in conn.execute(
        "SELECT coalesce(story_id, id) FROM posts WHERE id = ?", (post_id,))}
    for lead in sorted(leads):
        post = conn.execute(f"{PUBLISHED_POST} WHERE p.id = ?", (lead,)).fetchone()
        if post is None or post["status"] != "approved":
            continue
        for target in targets_of(conn, post["direction"]):
            row = conn.execute("""
                INSERT INTO publications (post_id, target, state, item, queued_at, idempotency_key)
                VALUES (?, ?, 'queued', ?, ?, ?)
                ON CONFLICT (post_id, target) DO UPDATE SET
                    state = 'queued', item = excluded.item, text = NULL, attempts = 0,
                    queued_at = excluded.queued_at, idempotency_key = excluded.idempotency_key,
                    error = NULL, token = NULL, next_attempt_at = NULL, hurry = 0,
                    message_id = NULL, chat = NULL, sent_at = NULL, deleted_at = NULL,
                    retract = 0, updated_by = NULL, version = publications.version + 1
                WHERE publications.state = 'cancelled'
                RETURNING id""", (lead, target.name, item_of(post), now,
                                  secrets.token_hex(16))).fetchone()
            if row is not None:
                queued += 1
            else:
                conn.execute("""UPDATE publications SET retract = 0, version = version + 1
                                WHERE post_id = ? AND target = ? AND retract = 1
                                  AND state IN ('sending', 'published', 'uncertain')""",
                             (lead, target.name))
    return queued


def compose_texts(conn, settings=None, target=None, limit=100):
    """The texts of queued publications that have none yet, composed from
    their items outside any transaction and written each only where the
    row still has none (an editor's text is never overwritten). Alerts
    need `settings` (their card's address). Returns how many."""
    kinds = ("telegram", "webhook", "alert") if settings is not None else ("telegram", "webhook")
    rows = conn.execute(f"""SELECT u.id, u.post_id, u.item, u.version, t.kind FROM publications u
                            JOIN targets t ON t.name = u.target
                            WHERE u.state = 'queued' AND u.text IS NULL
                              AND t.kind IN ({','.join('?' * len(kinds))})
                              {'AND u.target = ?' if target else ''}
                            ORDER BY u.id LIMIT ?""",
                        (*kinds, *([target] if target else []), limit)).fetchall()
    written = 0
    for row in rows:
        item = publication_item(conn, row["item"], row["post_id"])
        text = publication_text(row["kind"], item, settings) if item else "(the post is gone)"
        with transaction(conn):
            written += conn.execute("""UPDATE publications SET text = ?, version = version + 1
                                       WHERE id = ? AND text IS NULL AND version = ?""",
                                    (text, row["id"], row["version"])).rowcount
    return written


def withdraw_publications(conn, post_ids):
    """In the caller's transaction, for posts no longer approved: what waits
    (queued, failed) is cancelled; what is being sent or was sent is marked
    to be deleted where it went (a webhook tried before, too: its receiver
    may have kept it); an uncertain send, which may have arrived where no
    answer says, is marked for an editor to check. Alerts stay: they were
    never an approval. Returns how many changed."""
    if conn.execute("SELECT 1 FROM publications LIMIT 1").fetchone() is None:
        return 0
    leads = sorted({row[0] for post_id in post_ids for row in conn.execute(
        "SELECT coalesce(story_id, id) FROM posts WHERE id = ? AND status != 'approved'",
        (post_id,))})
    changed = 0
    for lead in leads:
        # A webhook tried before may have kept the item though no answer
        # said so: it hears of the withdrawal (its `deleted` event) all the same.
        changed += conn.execute("""UPDATE publications SET state = 'cancelled', token = NULL,
                                       next_attempt_at = NULL, version = version + 1,
                                       retract = CASE WHEN attempts > 0 AND target IN
                                           (SELECT name FROM targets WHERE kind = 'webhook')
                                           THEN 1 ELSE 0 END
                                   WHERE post_id = ? AND state IN ('queued', 'failed')""",
                                (lead,)).rowcount
        changed += conn.execute("""UPDATE publications SET retract = 1, version = version + 1
                                   WHERE post_id = ? AND retract = 0
                                     AND state IN ('sending', 'published', 'uncertain')
                                     AND target IN (SELECT name FROM targets WHERE kind != 'alert')""",
                                (lead,)).rowcount
    return changed


# The sender's transitions (see Publisher): each names the send's token.

def claim_publications(conn, ids, token):
    """queued -> sending, in the caller's transaction: the rows claimed."""
    claimed = []
    for publication_id in ids:
        row = conn.execute("""UPDATE publications SET state = 'sending', token = ?,
                                  attempts = attempts + 1, version = version + 1
                              WHERE id = ? AND state = 'queued' AND text IS NOT NULL
                              RETURNING *""", (token, publication_id)).fetchone()
        if row is not None:
            claimed.append(Publication.of(row))
    return claimed


def deliver_publication(conn, publication_id, token, message_id, chat, now):
    """sending (or uncertain, given up on before its answer came) ->
    published: the message and the chat it went to."""
    return conn.execute("""UPDATE publications SET state = 'published', message_id = ?, chat = ?,
                               sent_at = ?, error = NULL, token = NULL, next_attempt_at = NULL,
                               version = version + 1
                           WHERE id = ? AND token = ? AND state IN ('sending', 'uncertain')""",
                        (message_id, chat, now, publication_id, token)).rowcount


def retry_publication(conn, publication_id, token, error, wait=None, counted=True, kept=False):
    """sending -> queued, to be tried again at `wait` (UTC text) or at once;
    an attempt not `counted` (a pause) is given back. Taken back meanwhile:
    cancelled, and, where the receiver may have `kept` it (a webhook with
    no answer), still to be deleted there."""
    return conn.execute(f"""UPDATE publications SET
                                state = CASE WHEN retract = 1 THEN 'cancelled' ELSE 'queued' END,
                                retract = CASE WHEN retract = 1 AND ? = 1 THEN 1 ELSE 0 END,
                                error = ?, next_attempt_at = ?, token = NULL,
                                attempts = attempts - {0 if counted else 1}, version = version + 1
                            WHERE id = ? AND token = ? AND state = 'sending'""",
                        (int(kept), error, wait, publication_id, token)).rowcount


def fail_publication(conn, publication_id, token, error, kept=False):
    """sending -> failed (taken back meanwhile: cancelled, and deleted where
    the receiver may have `kept` it)."""
    return conn.execute("""UPDATE publications SET
                               state = CASE WHEN retract = 1 THEN 'cancelled' ELSE 'failed' END,
                               retract = CASE WHEN retract = 1 AND ? = 1 THEN 1 ELSE 0 END,
                               error = ?, token = NULL, version = version + 1
                           WHERE id = ? AND token = ? AND state = 'sending'""",
                        (int(kept), error, publication_id, token)).rowcount


def doubt_publication(conn, publication_id, token, error):
    """sending -> uncertain: it may have arrived. The token is kept: an
    answer that comes after all still delivers it (deliver_publication)."""
    return conn.execute("""UPDATE publications SET state = 'uncertain', error = ?,
                               version = version + 1
                           WHERE id = ? AND token = ? AND state = 'sending'""",
                        (error, publication_id, token)).rowcount


# A Telegram send that may have arrived counts for its target's pace (the
# message may well be in the channel), and a target without a pace waits
# this long before its next send: Telegram answering so is likely to do it
# again, and an outage must not turn the whole queue uncertain at once.
# Publish now goes ahead of the pace, as after any send.
DOUBT_PAUSE = 60


def count_doubtful_send(conn, target, now):
    """A send of the target's was made uncertain (see DOUBT_PAUSE)."""
    conn.execute(f"""UPDATE targets SET last_sent_at = ?,
                         paused_until = CASE WHEN every > 0 THEN paused_until
                             WHEN paused_until > ? THEN paused_until ELSE ? END
                     WHERE name = ?""",
                 (utc_text(now), not_before(now + DOUBT_PAUSE), not_before(now + DOUBT_PAUSE),
                  target))


def doubt_lost_sends(conn, target, sender=None,
                     error="the sender stopped during the send: it may or may not have arrived",
                     now=None):
    """Sends of the target still `sending` (of one sender, or of any when
    its lease ran out or its process died) may have arrived: a Telegram
    send is uncertain; a webhook's is tried again with its key (taken back
    meanwhile: cancelled, its receiver told), and counts for its target's
    pace (count_doubtful_send). Returns how many were made uncertain."""
    mine = "AND substr(token, 1, ?) = ?" if sender else ""
    values = (target, *((len(sender) + 1, sender + ":") if sender else ()))
    if conn.execute("SELECT kind FROM targets WHERE name = ?", (target,)).fetchone()[0] == "webhook":
        conn.execute(f"""UPDATE publications SET
                             state = CASE WHEN retract = 1 THEN 'cancelled' ELSE 'queued' END,
                             error = ?, token = NULL, version = version + 1
                         WHERE target = ? AND state = 'sending' {mine}""",
                     (error + "; tried again with the same Idempotency-Key", *values))
        return 0
    lost = conn.execute(f"""UPDATE publications SET state = 'uncertain', error = ?,
                                version = version + 1
                            WHERE target = ? AND state = 'sending' {mine}""",
                        (error, *values)).rowcount
    if lost:
        count_doubtful_send(conn, target, time.time() if now is None else now)
    return lost


# What may be deleted where it went: a message sent, or a webhook's item
# cancelled after a try its receiver may have kept.
TO_DELETE = "retract = 1 AND state IN ('published', 'cancelled')"


def deleted_publication(conn, publication_id, now, note=None):
    """published (or cancelled) and marked to be deleted -> cancelled: its
    message is gone."""
    return conn.execute(f"""UPDATE publications SET state = 'cancelled', retract = 0, deleted_at = ?,
                                error = ?, next_attempt_at = NULL, version = version + 1
                            WHERE id = ? AND {TO_DELETE}""",
                        (now, note, publication_id)).rowcount


def undeleted_publication(conn, publication_id, error, again_at=None):
    """A deletion that did not go through: tried again at `again_at`, or,
    with none, given up (a message stays published, with the reason)."""
    return conn.execute(f"""UPDATE publications SET retract = ?, next_attempt_at = ?, error = ?,
                                version = version + 1
                            WHERE id = ? AND {TO_DELETE}""",
                        (int(again_at is not None), again_at, error, publication_id)).rowcount


# What an editor may do to one publication, and in which states.
PUBLICATION_ACTIONS = {
    "text": ("queued", "failed", "uncertain"),      # edit the text to send
    "now": ("queued",),                             # publish now: ahead of the pace
    "cancel": ("queued", "failed", "uncertain"),
    "published": ("uncertain",),                    # it did arrive
    "again": ("failed", "uncertain"),               # send it again
}
# What each action changes.
ACTION_CHANGES = {
    "text": "text = ?",
    "now": "hurry = 1, next_attempt_at = NULL",
    "cancel": "state = 'cancelled', token = NULL, retract = 0",
    "published": "state = 'published', sent_at = ?, error = NULL, token = NULL, retract = 0",
    "again": "state = 'queued', attempts = 0, next_attempt_at = NULL, error = NULL, hurry = 0, "
             "token = NULL",
}


def act_on_publication(conn, publication_id, action, editor, text=None, now=None, seen=None,
                       address=None, version=None):
    """An editor's action on a publication; returns the row after it, or
    None for an unknown one. Raises Conflict when its state does not allow
    the action, or is not the state `seen` (or the `version`) the editor's
    page showed: someone, or the sender, changed it meanwhile. An uncertain
    send taken back may only be cancelled, once an editor has looked in the
    channel (no answer named its message, so it cannot be deleted here)."""
    now = utc_text(now)
    with transaction(conn):
        row = conn.execute("SELECT * FROM publications WHERE id = ?", (publication_id,)).fetchone()
        if row is None:
            return None
        if row["state"] not in PUBLICATION_ACTIONS[action] or seen not in (None, row["state"]) \
                or version not in (None, row["version"]) \
                or (row["retract"] and action != "cancel"):
            who = f" by {row['updated_by']}" if row["updated_by"] and \
                row["state"] in ("cancelled", "published") else ""
            raise Conflict(f"this publication is {row['state']} now{who}; reload to see it")
        values = {"text": (text,), "published": (now,)}.get(action, ())
        row = conn.execute(f"""UPDATE publications SET {ACTION_CHANGES[action]},
                                   updated_by = ?, version = version + 1
                               WHERE id = ? AND state = ? AND version = ? RETURNING *""",
                           (*values, editor, publication_id, row["state"], row["version"])).fetchone()
        record_event(conn, editor, address, f"publication {action}", f"publication:{publication_id}",
                     f"post {row['post_id']} to {row['target']}")
    if action in ("now", "again"):
        conn.process.publish_wake.set()
    return Publication.of(row)


def publication_counts(conn):
    """{target: {state: n}} of every publication (status, /metrics)."""
    counts = collections.defaultdict(dict)
    for row in conn.execute("SELECT target, state, count(*) FROM publications "
                            "GROUP BY target, state ORDER BY target, state"):
        counts[row[0]][row[1]] = row[2]
    return dict(counts)


def outbox_trouble(conn, now=None):
    """The enabled targets that need an editor's eye: failing (their last
    call failed, or a setting is missing), paused by a 429, or with sends
    that failed or may have arrived. [(target row, {state: n})]."""
    now = utc_text(now)
    found = []
    for target in read_targets(conn, "enabled = 1"):
        stuck = dict(conn.execute("""SELECT state, count(*) FROM publications WHERE target = ?
                                         AND state IN ('failed', 'uncertain', 'queued')
                                     GROUP BY state""", (target.name,)).fetchall())
        paused = (target.paused_until or "") > now
        if target.error or paused or stuck.get("failed") or stuck.get("uncertain"):
            found.append((target, stuck))
    return found


###############################################################################
# Decisions and reads #########################################################
###############################################################################
# The editor's decisions, what pages and commands read, copying a database.

# A source's edit into other words takes the decision on the post back
# (nothing is approved in words nobody decided on), and with it what was
# queued or sent of it for publication.

def update_edited_posts(conn, source_id, drafts):
    """update_edited_post for each draft, in one transaction (on PostgreSQL
    under the write lock, so an edit cannot slip between the counting of new
    posts and its mark). Returns how many texts changed."""
    with transaction(conn):
        return sum(update_edited_post(conn, source_id, draft) for draft in drafts)


# What an edit needs of the post it changes.
EDITED = f"""id, title, text, content_type, article_url, classified, status, decided_at,
             decided_by, story_id, words_sha256, verdicts, {", ".join(VERDICT_FIELDS)}"""


def update_edited_post(conn, source_id, draft):
    """Store an edited message's new text. Other words (not a fixed comma or
    spacing) make it a new post to classify and to decide (see reword_post);
    the same words in other punctuation are stored as they are, except over
    a teaser's article. Returns 1 when the text changed."""
    row = conn.execute(f"SELECT {EDITED} FROM posts WHERE source_id = ? AND external_id = ?",
                       (source_id, draft.external_id)).fetchone()
    if row is None:
        return 0
    words = draft.words_sha256 or words_sha256(draft.text, draft.article_url)
    if words_lost_to_article(row, draft):
        store_edit(conn, row["id"], {"words_sha256": words})
        return 0
    before = row["words_sha256"] or words_sha256(row["text"], row["article_url"])
    if words != before:
        return reword_post(conn, row, draft, before, words)
    if row["content_type"] == "full" or normalize_text(row["text"]) == normalize_text(draft.text):
        return 0
    store_edit(conn, row["id"], edited_text(draft, words))
    return 1


def words_lost_to_article(row, draft):
    """A teaser stored before its words were kept (words_sha256 NULL) whose
    article was fetched: its text is the article, not the message, so only
    its link can tell an edit. The message's words as read now are kept,
    for its next edit to be told apart."""
    return row["words_sha256"] is None and row["content_type"] == "full" and \
        row["article_url"] is not None and row["article_url"] == draft.article_url


def edited_text(draft, words):
    """The columns an edit sets, whatever it changed."""
    return {"text": draft.text, "title": draft.title, "sha256": text_sha256(draft.text),
            "edited_at": draft.edited_at, "content_type": draft.content_type,
            "article_url": draft.article_url, "words_sha256": words}


def store_edit(conn, post_id, changes):
    conn.execute(f"UPDATE posts SET {', '.join(f'{column} = :{column}' for column in changes)} "
                 f"WHERE id = :id", {**changes, "id": post_id})


# Verdicts kept of a post's earlier words.
VERDICTS_KEPT = 8


def reword_post(conn, row, draft, before, words):
    """An edit from words `before` to other `words`: the post leaves its
    story, takes back the verdict of these words when they were classified
    before (or goes back to the queue), and loses its decision, kept beside
    it until the next one: nothing is approved in words nobody decided on.
    What was queued or sent of it for publication is withdrawn (its story,
    approved in a copy's words, is queued as that copy). Only a classified
    post takes a verdict back: one still in the queue is
    classified anyway, and a completion outside the workers is counted only
    where its count rows are ready. One a worker is classifying is taken
    back from it (take_claim_back): its verdict is on the words before.
    Returns 1."""
    verdicts = remembered_verdicts(row, before)
    restored = verdicts.get(words) if row["classified"] == DONE else None
    changes = {**edited_text(draft, words),
               "story_id": None if row["story_id"] is None else row["id"],
               "verdicts": json.dumps(verdicts) if verdicts else None}
    if restored:
        changes.update(restored)
    elif row["classified"] in (DONE, FAILED):
        changes.update(classified=PENDING, attempts=0, next_attempt_at=None)
    if row["status"] != "new":
        changes.update(status="new", decided_at=None, decided_by=None,
                       old_decision=row["status"], old_decided_at=row["decided_at"],
                       old_decided_by=row["decided_by"], old_title=row["title"],
                       old_text=row["text"])
    heir, alone = leave_story(conn, row)
    store_edit(conn, row["id"], changes)
    learn_decisions(conn, [row["id"], *([heir] if heir else []), *alone])
    if row["status"] == "approved":
        withdraw_publications(conn, [row["id"]])
        if heir is not None:
            queue_publications(conn, [heir])
    if row["classified"] == PROCESSING:
        take_claim_back(conn, row["id"])
    return 1


def remembered_verdicts(row, before):
    """The post's verdicts of earlier words, and its own of the words
    `before` when it is classified: the newest VERDICTS_KEPT."""
    verdicts = json.loads(row["verdicts"] or "{}")
    if row["classified"] == DONE:
        verdicts.pop(before, None)
        verdicts[before] = {key: row[key] for key in VERDICT_FIELDS}
    return dict(list(verdicts.items())[-VERDICTS_KEPT:])


def leave_story(conn, post):
    """A post whose words changed leaves its story, which was found on its
    old words. Where it led one, its copies follow the oldest classified of
    them and keep the decision made on them, as their words are those it was
    made on: the story's card, the verdict later copies take and the
    approved feeds go on with a copy's words, never with the edited post's.
    The edited post is a card of its own (Classifier.prepare keeps it out of
    every story until it is decided again), so it cannot slip back under an
    approved story's card either. A first post still being classified has
    no story_id yet (its verdict writes it), but may have copies already.
    A copy that adds sites of its own never leads (see find_stories): with
    no other copy to follow, such copies are posts of their own, classified
    and decided again on their own words. Returns (the copy that leads the
    story now, or None; the copies left on their own)."""
    if post["story_id"] not in (None, post["id"]):
        return None, []
    heir = conn.execute(f"""SELECT id FROM posts WHERE {copies_of()} AND adds IS NULL
                            ORDER BY CASE WHEN classified = {DONE} THEN 0 ELSE 1 END, id
                            LIMIT 1""", (post["id"],)).fetchone()
    if heir is not None:
        conn.execute(f"UPDATE posts SET story_id = ? WHERE {copies_of()}", (heir[0], post["id"]))
        return heir[0], []
    alone = [row[0] for row in conn.execute(
        f"""UPDATE posts SET story_id = NULL, adds = NULL, status = 'new', decided_at = NULL,
                decided_by = NULL, classified = CASE WHEN classified = {PROCESSING}
                                                     THEN classified ELSE {PENDING} END,
                attempts = 0, next_attempt_at = NULL
            WHERE {copies_of()} RETURNING id""", (post["id"],))]
    return None, alone


def find_source(conn, slug):
    return conn.execute("SELECT * FROM sources WHERE slug = ?", (slug,)).fetchone()


def count_enabled_sources(conn):
    return conn.execute("SELECT count(*) FROM sources WHERE enabled = 1").fetchone()[0]


def enabled_priorities(conn):
    return [row[0] for row in conn.execute(
        "SELECT DISTINCT priority FROM sources WHERE enabled = 1 ORDER BY priority")]


def source_health(conn):
    """Every source with its feed state and its last run, the ones that need
    a look first: failing, then dead, then silent, then the rest, disabled
    last. The last run is found through the runs(source_id, id) index."""
    return conn.execute("""
        SELECT s.*, r.etag, r.modified, r.last_build_date, r.moved_to,
               r.last_error AS feed_warning,
               run.started_at AS run_started, run.status AS run_status,
               run.new_posts AS run_new_posts, run.trigger AS run_trigger
        FROM sources s
        LEFT JOIN rss_state r ON r.source_id = s.id
        LEFT JOIN runs run ON run.id = (SELECT max(id) FROM runs WHERE source_id = s.id)
        ORDER BY s.enabled DESC,
                 CASE WHEN s.status = 'dead' THEN 1 WHEN s.error_count > 0 THEN 0
                      WHEN s.silent_since IS NOT NULL THEN 2 ELSE 3 END,
                 s.priority, s.slug""").fetchall()


def set_decision(conn, post_id, decision, editor):
    """The editor's decision on a post (posts.status), independent of the
    queue; returns 0 for an unknown post."""
    return set_decisions(conn, [post_id], decision, editor)


# A decision from a page names the words its card showed (wording), so that
# a post edited since the page was loaded is not decided on words nobody saw:
# a Telegram message's words (words_sha256), else the post's title and as
# much of its text as a card shows. Every card carries it: it is short, as
# content_digest's.
WORDED_TEXT = 6000
WORDING_CHARS = 16


def wording(title, text, words_sha256):
    """What a card's decision names of the words it shows (its title, its
    text cut to WORDED_TEXT or longer, and their digest when stored)."""
    said = words_sha256 or content_digest(title, (text or "")[:WORDED_TEXT])
    return said[:WORDING_CHARS]


def check_wordings(conn, seen):
    """Reworded for a post whose words are no longer those `seen` names
    ({post id: wording}); an unknown post is left to the decision."""
    for among, values in conn.dialect.among("id", sorted(seen)):
        for row in conn.execute(f"""SELECT id, title, words_sha256,
                                           substr(text, 1, {WORDED_TEXT}) AS text
                                    FROM posts WHERE {among}""", values):
            if wording(row["title"], row["text"], row["words_sha256"]) != seen[row["id"]]:
                raise Reworded(row["id"])


# A decision, or an undo, is made on the post as it reads now: the mark of
# an edit after the decision before goes (see reword_post).
DECIDED_AGAIN = """old_decision = NULL, old_decided_at = NULL, old_decided_by = NULL,
                   old_title = NULL, old_text = NULL"""


@redoable
def set_decisions(conn, post_ids, decision, editor, seen=None, saw=None, address=None):
    """One decision on many posts at once (on any post of a story, for the
    whole story), and the approved figure of their sources; returns how many
    of the posts exist. An undo (back to new) takes the decision back: nobody
    decided the post, so nobody is recorded as its decider (the event says
    who undid it). Where `seen` names the words a page showed of a post
    ({post id: wording}), none is decided unless each still reads so
    (Reworded); where `saw` names the decision it showed ({post id:
    status}), none is decided unless each still has it (Redecided). With an
    `address`, each post's decision is recorded as an event."""
    found, sources, who = 0, set(), editor
    now, editor = (None, None) if decision == "new" else (utc_text(), editor)
    with transaction(conn):
        check_wordings(conn, seen or {})
        check_decisions(conn, saw or {})
        for post_id in post_ids:
            row = conn.execute(f"""UPDATE posts SET status = ?, decided_at = ?, decided_by = ?,
                                       {DECIDED_AGAIN}
                                   WHERE id = ? RETURNING source_id, story_id""",
                               (decision, now, editor, post_id)).fetchone()
            if row is None:
                continue
            found += 1
            sources.add(row["source_id"])
            if address is not None:
                record_event(conn, who, address, "decide", f"post:{post_id}", decision)
            story = row["story_id"]
            if story is not None:
                sources.update(r[0] for r in conn.execute(
                    f"""UPDATE posts SET status = ?, decided_at = ?, decided_by = ?, {DECIDED_AGAIN}
                        WHERE ({copies_of()} OR id = ?) AND id != ? RETURNING source_id""",
                    (decision, now, editor, story, story, post_id)))
        conn.executemany("""UPDATE sources SET approved = (SELECT coalesce(sum(n), 0)
                                FROM source_post_counts WHERE source_id = :id AND status = 'approved')
                            WHERE id = :id""", [{"id": i} for i in sources])
        owe_learning(conn, post_ids)
        outbox = queue_publications(conn, post_ids) if decision == "approved" else \
            withdraw_publications(conn, post_ids)
    if outbox:
        if decision == "approved":
            compose_texts(conn)
        conn.process.publish_wake.set()     # committed: a publisher that wakes finds it
    return found


def check_decisions(conn, saw):
    """Redecided for a post whose decision is no longer the one `saw` names
    ({post id: status}): another editor changed it meanwhile."""
    for among, values in conn.dialect.among("id", sorted(saw)):
        for row in conn.execute(f"SELECT id, status FROM posts WHERE {among}", values):
            if row["status"] != saw[row["id"]]:
                last = conn.execute("SELECT user_name, at FROM events WHERE subject = ? "
                                    "AND action = 'decide' ORDER BY id DESC LIMIT 1",
                                    (f"post:{row['id']}",)).fetchone()
                raise Redecided(row["id"], row["status"], last and last["user_name"],
                                last and last["at"])


def titled_posts(conn, post_ids):
    """The title and source of each of these posts that exists, in the order
    given: what a decision on many posts asks about first."""
    marks = ",".join("?" * len(post_ids))
    found = {row["id"]: row for row in conn.execute(f"""
        SELECT p.id, p.title, s.name AS source FROM posts p
        LEFT JOIN sources s ON s.id = p.source_id WHERE p.id IN ({marks})""", post_ids)}
    return [found[i] for i in post_ids if i in found]


# A story is shown once, as its first post (a source's own list shows all).
ONE_CARD_PER_STORY = card("p.")


def decided_posts(conn, status="approved", direction=None, limit=None, since=None):
    """Classified posts of one decision (or any), newest decision first; a
    story once, as its first post."""
    where, params = [f"p.classified = {DONE}", ONE_CARD_PER_STORY], []
    if status != "any":
        where.append("p.status = ?")
        params.append(status)
    if direction:
        where.append("p.direction = ?")
        params.append(direction)
    if since:
        where.append("coalesce(p.decided_at, p.published_at) >= ?")
        params.append(since)
    order = "p.decided_at DESC, p.id DESC" if status != "any" else \
        "coalesce(p.decided_at, p.published_at) DESC, p.id DESC"
    return conn.execute(f"""
        SELECT p.id, p.title, p.url, p.summary, p.direction, p.relevance, p.interest,
               p.status, p.published_at, p.undated, p.decided_at, p.decided_by, p.keywords,
               p.reason, s.name AS source
        FROM posts p LEFT JOIN sources s ON s.id = p.source_id
        WHERE {' AND '.join(where)} ORDER BY {order}{"" if limit is None else " LIMIT ?"}""",
                        params if limit is None else [*params, limit]).fetchall()


# The classifier's report card (quality, /quality): per direction, from the
# stored decisions alone, how well the classifier and the learned model agree
# with the editors. Precision is measured as the model would have ranked the
# newest QUALITY_HELD_OUT of the decisions, learning from the older ones only.
QUALITY_DECISIONS = 5000        # the latest decisions of a direction the report reads
QUALITY_HELD_OUT = 0.2
QUALITY_WORST = 10
Z95 = 1.959964
# Below these a figure is "too few to say": on fewer than 20 decisions one
# more moves an agreement by 5 points and κ by a tenth or more, and a
# precision on fewer than 10 held-out decisions is a handful of coin tosses.
QUALITY_MIN_DECISIONS = 20
QUALITY_MIN_HELD_OUT = 10
QUALITY_WEEK = 7 * 86400        # what learning changed on the desk: posts of this long


def wilson(approved, decided):
    """The 95 % Wilson score interval of a share approved/decided."""
    if not decided:
        return (0.0, 1.0)
    share = approved / decided
    spread = Z95 * math.sqrt(share * (1 - share) / decided + Z95 ** 2 / (4 * decided ** 2))
    middle = share + Z95 ** 2 / (2 * decided)
    scale = 1 + Z95 ** 2 / decided
    return (round(max(0.0, (middle - spread) / scale), 3), round(min(1.0, (middle + spread) / scale), 3))


def kappa(pairs):
    """Cohen's kappa of [(classifier says yes, editor says yes)], or None
    when it cannot tell anything: one of the two said the same of every
    post (a desk whose editors decide only the cards it shows agrees by
    chance alone, whatever it shows)."""
    if not pairs:
        return None
    n = len(pairs)
    agreed = sum(a == b for a, b in pairs) / n
    yes_a, yes_b = sum(a for a, _ in pairs) / n, sum(b for _, b in pairs) / n
    if yes_a in (0, 1) or yes_b in (0, 1):
        return None
    chance = yes_a * yes_b + (1 - yes_a) * (1 - yes_b)
    return round((agreed - chance) / (1 - chance), 3)


def precision_at(ranked, k):
    """The share approved among the first k of [approved?] (or of all, when fewer)."""
    top = ranked[:k]
    return round(sum(top) / len(top), 3) if top else None


def held_out_precision(rows, background):
    """Precision at 20 and 50 of the newest QUALITY_HELD_OUT of decisions (rows
    oldest first), ranked by a model learned from the older ones, and by
    relevance as the classifier alone ranks them; `rests_on`: how many
    held-out decisions each is the share of (fewer than k when fewer are
    held out)."""
    split = int(len(rows) * (1 - QUALITY_HELD_OUT))
    older, newer = rows[:split], rows[split:]
    model = Model(None)
    model.background = background
    for row in older:
        model.learn(row["features"], row["status"] == "approved")
    learned = [row["status"] == "approved" for row in
               sorted(newer, key=lambda r: -model.score(r["features"], keyword_count(r["keywords"])))]
    by_relevance = [row["status"] == "approved" for row in
                    sorted(newer, key=lambda r: -(r["relevance"] or 0))]
    return {"held_out": len(newer), "learned_from": len(older),
            "enough": len(newer) >= QUALITY_MIN_HELD_OUT,
            "rests_on": {"p20": min(20, len(newer)), "p50": min(50, len(newer))},
            "learned": {"p20": precision_at(learned, 20), "p50": precision_at(learned, 50)},
            "relevance": {"p20": precision_at(by_relevance, 20),
                          "p50": precision_at(by_relevance, 50)}}


def decided_rows(conn, direction):
    """The direction's latest QUALITY_DECISIONS counted decisions, oldest
    first, each with its features."""
    rows = [dict(row) for row in conn.execute(
        f"""SELECT p.id, p.title, p.url, p.status, p.relevance, p.likely, p.decided_by,
                   p.decided_at, p.keywords, p.source_id, s.name AS source,
                   substr(p.text, 1, {LEARN_CHARS}) AS text
            FROM posts p LEFT JOIN sources s ON s.id = p.source_id
            WHERE p.learned_in = ? AND p.learned_as IS NOT NULL
            ORDER BY p.decided_at DESC, p.id DESC LIMIT ?""", (direction, QUALITY_DECISIONS))][::-1]
    for row in rows:
        row["features"] = post_features(row["title"], row["text"], row["source_id"], row["id"])
    return rows


def approval_rates(rows, key):
    """{key: {approved, decided, rate}} of the rows grouped by key(row) (None: left out)."""
    groups = collections.defaultdict(lambda: [0, 0])
    for row in rows:
        if key(row) is not None:
            groups[key(row)][0] += row["status"] == "approved"
            groups[key(row)][1] += 1
    return {k: {"approved": a, "decided": n, "rate": round(a / n, 3)}
            for k, (a, n) in sorted(groups.items())}


def shown_by_floor(row, floor):
    """Whether the desk's default floor shows the post (see floor_clause)."""
    likely = row["likely"]
    if likely is not None and (likely >= LIKELY_HIGH or likely < LIKELY_LOW):
        return likely >= LIKELY_HIGH
    return (row["relevance"] or 0) >= floor


def editors_of(rows):
    """{editor: {decisions, approval_rate, per_day}} of the rows."""
    editors = collections.defaultdict(lambda: {"decisions": 0, "approved": 0, "days": set()})
    for row in rows:
        editor = editors[row["decided_by"] or "-"]
        editor["decisions"] += 1
        editor["approved"] += row["status"] == "approved"
        editor["days"].add((row["decided_at"] or "")[:10])
    return {name: {"decisions": e["decisions"],
                   "approval_rate": round(e["approved"] / e["decisions"], 3),
                   "per_day": round(e["decisions"] / max(1, len(e["days"])), 1)}
            for name, e in sorted(editors.items())}


def worst_disagreements(rows, model):
    """The QUALITY_WORST decisions furthest from the chance the model gave, with why."""
    wrong = sorted((row for row in rows if row["likely"] is not None),
                   key=lambda row: -abs((row["status"] == "approved") - row["likely"]))
    return [{"id": row["id"], "title": row["title"], "url": row["url"],
             "decision": row["status"], "likely": row["likely"],
             "weighed": reason_words(model.reasons(row["features"], row["likely"]),
                                     row["title"], row["text"], row["source"]) if model else []}
            for row in wrong[:QUALITY_WORST]]


def decided_counts(rows):
    """{posts, decided, approved} of (status, count) rows."""
    counts = dict(rows)
    return {"posts": sum(counts.values()),
            "decided": counts.get("approved", 0) + counts.get("rejected", 0),
            "approved": counts.get("approved", 0)}


def keyword_misses(conn, direction, floor):
    """{posts, decided, approved, shown} of the posts no keyword matched that
    the direction's model let in (see Learners.wanted): shown, those the
    desk's default floor shows (the model sure of them, or an LLM's
    relevance at the floor and the model not against, see shown_by_floor)."""
    shown = (f"(likely >= {LIKELY_HIGH} OR coalesce(relevance, 0) >= {int(floor)} "
             f"AND likely >= {LIKELY_LOW})")
    rows = conn.execute(f"""SELECT status, {shown} AS shown, count(*) FROM posts
                            WHERE direction = ? AND keywords IS NULL AND classified = {DONE}
                            GROUP BY status, {shown}""", (direction,)).fetchall()
    counts = collections.Counter()
    for status, _, n in rows:
        counts[status] += n
    return {**decided_counts(counts.items()), "shown": sum(n for _, shown, n in rows if shown)}


def changed_this_week(conn, direction, floor, now=None):
    """What the direction's model did to the desk's default floor among the
    cards of the last QUALITY_WEEK: posts it raised (shown at LIKELY_HIGH
    though their relevance is under the floor) and lowered (hidden under
    LIKELY_LOW though it is at the floor or above), each {posts, decided,
    approved}. A decided post keeps the chance it was decided at."""
    since = utc_text((time.time() if now is None else now) - QUALITY_WEEK)
    rows = conn.execute(f"""
        SELECT CASE WHEN p.likely >= {LIKELY_HIGH} THEN 'raised' ELSE 'lowered' END AS change,
               p.status, count(*) FROM posts p
        WHERE p.direction = ? AND p.classified = {DONE} AND p.published_at >= ? AND {card('p.')}
          AND (p.likely >= {LIKELY_HIGH} AND coalesce(p.relevance, 0) < ?
               OR p.likely < {LIKELY_LOW} AND coalesce(p.relevance, 0) >= ?)
        GROUP BY 1, 2""", (direction, since, floor, floor)).fetchall()
    return {"since": since, "floor": floor, **{
        change: decided_counts([(row[1], row[2]) for row in rows if row[0] == change])
        for change in ("raised", "lowered")}}


def direction_quality(conn, direction, settings, learners):
    """The report card of one direction (see quality_report)."""
    rows = decided_rows(conn, direction.id)
    approved = sum(row["status"] == "approved" for row in rows)
    model = learners.model(direction.id)
    agreement = [(shown_by_floor(row, settings.min_relevance), row["status"] == "approved")
                 for row in rows]
    sources = approval_rates(rows, lambda row: row["source"] or "-")
    for figures in sources.values():
        figures["interval"] = wilson(figures["approved"], figures["decided"])
    misses = keyword_misses(conn, direction.id, settings.min_relevance)
    return {
        "direction": direction.id, "title": direction.title,
        "decisions": len(rows), "approved": approved,
        "approval_rate": round(approved / len(rows), 3) if rows else None,
        "minimum": {"decisions": QUALITY_MIN_DECISIONS, "held_out": QUALITY_MIN_HELD_OUT},
        "model_used": model is not None, "learn_min": settings.learn_min,
        "model_ready": learners.ready(direction.id),
        "precision": held_out_precision(rows, learners.background) if len(rows) >= 10 else None,
        "by_relevance": approval_rates(rows, lambda row: row["relevance"]),
        "by_likely": approval_rates(rows, lambda row: None if row["likely"] is None else
                                    min(9, int(row["likely"] * 10)) / 10),
        "agreed": sum(a == b for a, b in agreement), "kappa": kappa(agreement),
        "sources": sources,
        "keyword_misses": misses["posts"], "keyword_misses_decided": misses["decided"],
        "keyword_misses_approved": misses["approved"], "keyword_misses_shown": misses["shown"],
        "changed_this_week": changed_this_week(conn, direction.id, settings.min_relevance),
        "worst": worst_disagreements(rows, model),
        "editors": editors_of(rows),
    }


def quality_report(conn, directions, settings, direction=None, owed=None):
    """The classifier's report card of every direction (or one): `directions`
    as the registry has them, {id: Direction}; `owed`: how many of the
    decisions still owed to the models to count first (None: all)."""
    learners = Learners(settings.learn_min).refresh(conn, now=True, owed=owed)
    return [direction_quality(conn, d, settings, learners)
            for d in directions.values() if direction in (None, d.id)]


AGREEMENT_EVENTS = 20000        # the latest decisions the editors' agreement is read from


def editor_agreement(conn):
    """How often two editors who decided the same post agreed, from the
    latest decision events: each editor's last word on it (approved or
    rejected; an undo is no word), compared in pairs. Returns {"pairs",
    "agreed", "by_pair": {"anna / boris": {"pairs", "agreed"}}}."""
    words = collections.defaultdict(dict)           # post: {editor: last decision}
    for row in conn.execute("""SELECT subject, user_name, detail FROM events
                               WHERE action = 'decide' AND id > (SELECT coalesce(max(id), 0)
                                   FROM events) - ? ORDER BY id""", (AGREEMENT_EVENTS,)):
        said = words[row["subject"]]
        said.pop(row["user_name"], None)
        if row["detail"] in ("approved", "rejected"):
            said[row["user_name"]] = row["detail"]
    by_pair = collections.defaultdict(lambda: {"pairs": 0, "agreed": 0})
    for said in words.values():
        for a, b in itertools.combinations(sorted(said), 2):
            figures = by_pair[f"{a} / {b}"]
            figures["pairs"] += 1
            figures["agreed"] += said[a] == said[b]
    return {"pairs": sum(f["pairs"] for f in by_pair.values()),
            "agreed": sum(f["agreed"] for f in by_pair.values()),
            "by_pair": dict(sorted(by_pair.items()))}


def prune_runs(conn, days, now=None):
    since = utc_text((time.time() if now is None else now) - int(days) * 86400)
    conn.execute("DELETE FROM source_days WHERE day < ?", (since[:10],))
    return conn.execute("DELETE FROM runs WHERE started_at < ?", (since,)).rowcount


# What copy-db moves, each table after the ones its rows point to, with its
# key: every table of the schema but REBUILT_TABLES (a test holds the two
# lists to the schema, so a table added later is copied or named there).
COPIED_TABLES = (("sources", ("id",)), ("rss_state", ("source_id",)),
                 ("tg_state", ("source_id",)), ("posts", ("id",)), ("runs", ("id",)),
                 ("source_days", ("source_id", "day")), ("counters", ("name", "labels")),
                 ("meta", ("key",)), ("story_keys", ("key", "post_id")),
                 ("learners", ("direction",)), ("learned_words", ("direction", "feature")),
                 ("learn_pending", ("post_id",)), ("targets", ("name",)),
                 ("publications", ("id",)), ("users", ("name",)), ("sessions", ("id",)),
                 ("events", ("id",)), ("looks", ("post_id", "user_name")),
                 ("sign_in_failures", ("id",)))
# What the target makes again from the posts it was given (reindex_posts):
# the desk's counts and the search index (FTS5's on SQLite, post_words on
# PostgreSQL). Copied, they would count and find by the other database's
# rules, and the search index of one dialect has no place in the other.
REBUILT_TABLES = ("post_counts", "source_post_counts", "posts_fts", "post_words")
# What each database keeps of itself: its schema, its counting mark, who it is
# and what it is a copy of.
OWN_META = ("indexed_to", "count_keys", "pg_schema", "pg_ddl:%", "database_id", "copy_of")
COPY_CHUNK = 5000


def key_in_byte_order(conn, table, key):
    """A table's key as `conn` orders it byte by byte: the order in which
    the source gives a chunk's rows must be the one in which the target
    finds that chunk's range."""
    kinds = {column: kind for name, column, kind, _ in schema_columns() if name == table}
    return ", ".join(conn.dialect.in_byte_order(k) if kinds[k] == "TEXT" else k for k in key)


def copy_table(source, target, table, key, progress, chunk=COPY_CHUNK):
    """The target's table made the same as the source's, in key order and in
    chunks of `chunk` rows: rows upserted by key, and the target's rows the source does not
    have deleted, so a second copy changes nothing and a later one brings
    the target up to date. Returns how many rows."""
    columns = [column for name, column, _, _ in schema_columns() if name == table]
    names, keys = ", ".join(columns), ", ".join(key)
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    upsert = (f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(columns))}) "
              f"ON CONFLICT ({keys}) DO {'UPDATE SET ' + updates if updates else 'NOTHING'}")
    own = OWN_META if table == "meta" else ()
    mine = ["key NOT LIKE ?" for _ in own]
    ordered = key_in_byte_order(source, table, key)
    row_key, target_key = f"({keys})", f"({key_in_byte_order(target, table, key)})"
    marks = f"({', '.join('?' * len(key))})"
    copied, after = 0, None
    while True:
        later = [f"({ordered}) > {marks}"] if after else []
        rows = source.execute(
            f"SELECT {names} FROM {table} WHERE {' AND '.join(mine + later) or 'true'} "
            f"ORDER BY {ordered} LIMIT {int(chunk)}", [*own, *(after or ())]).fetchall()
        last = [rows[-1][columns.index(k)] for k in key] if rows else None
        gone = mine + ([f"{target_key} > {marks}"] if after else []) + (
            [f"{target_key} <= {marks}", f"{row_key} NOT IN (VALUES "
             f"{', '.join([marks] * len(rows))})"] if rows else [])
        chunk_keys = [row[columns.index(k)] for row in rows for k in key]
        with transaction(target):
            target.execute(f"DELETE FROM {table} WHERE {' AND '.join(gone) or 'true'}",
                           [*own, *(after or ()), *(last or ()), *chunk_keys])
            target.executemany(upsert, [tuple(row) for row in rows])
        if not rows:
            return copied
        copied += len(rows)
        after = last
        progress.step(f"{table} {copied:,}", count=len(rows))


def empty_copied_tables(target):
    """A new database (perhaps synced from sources.yaml by `init`, with ids
    of its own) emptied, so the copy's ids and slugs cannot clash."""
    for table, _ in reversed(COPIED_TABLES):
        target.execute(f"DELETE FROM {table}" + (" WHERE " + " AND ".join(
            "key NOT LIKE ?" for _ in OWN_META) if table == "meta" else ""),
            OWN_META if table == "meta" else ())


def copy_database(source, target, quiet=False, chunk=COPY_CHUNK):
    """copy-db: every copied table from `source` into `target` (both
    migrated), `chunk` rows at a time, then the target's counts and search index made from its
    posts. The target must hold no posts, or be a copy of this source
    already, finished or cut short. Returns {table: rows}."""
    origin = lasting_secret(source, "database_id")
    posts = target.execute("SELECT count(*) FROM posts").fetchone()[0]
    if posts and get_meta(target, "copy_of")[0] != origin:
        raise ConfigError(f"copy-db: {target.path} already holds {posts} posts that are not a "
                          f"copy of {source.path}; copy into an empty database")
    with transaction(target):
        if not posts:
            empty_copied_tables(target)
        # Said before the first row is copied: a copy cut short (killed, the
        # server gone) is still this source's copy, and running it again
        # completes it.
        set_meta(target, "copy_of", origin)
    total = sum(source.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                for table, _ in COPIED_TABLES)
    progress = Progress("copy-db", total, "rows", quiet=quiet)
    counts = {table: copy_table(source, target, table, key, progress, chunk)
              for table, key in COPIED_TABLES}
    with transaction(target):
        reindex_posts(target)
    progress.finish(", ".join(f"{n:,} {table}" for table, n in counts.items()) +
                    f" copied to {target.path}; post_counts, source_post_counts and the "
                    f"search index made again from its posts")
    return counts


###############################################################################
# Sources #####################################################################
###############################################################################
# Sources.yaml: directions, sources, checks, syncing them into the database.

CRAWLERS = ("rss", "telegram")
SLUG = re.compile(r"[a-z0-9_-]+")


@dataclasses.dataclass(frozen=True)
class Direction:
    id: str
    title: str
    keywords: tuple


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    slug: str
    name: str
    crawler: str
    url: str
    direction: str
    priority: int
    enabled: bool


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """Where approved posts go (telegram, webhook), or where alerts go (alert)."""
    name: str
    kind: str
    address: str
    directions: tuple = None        # None: every direction
    every: float = 0.0              # seconds between two posts; 0: no pace
    min_relevance: int = None       # alerts only
    min_likely: float = None
    per_hour: int = None


@dataclasses.dataclass(frozen=True)
class Registry:
    path: str
    directions: dict
    sources: tuple
    targets: tuple = ()

    def secrets(self):
        """What of its publish targets must stay out of the log (a webhook's
        secret path); see Process.log_mask."""
        return [secret for target in self.targets if target.kind == "webhook"
                for secret in webhook_secrets(target.address)]


MAX_PRIORITY = 1000
SOURCE_FIELDS = ("slug", "name", "crawler", "url", "direction", "priority", "enabled")
DIRECTION_FIELDS = ("title", "keywords")


def _yaml_loader(yaml, path, base=None):
    class LineLoader(base or yaml.SafeLoader):
        """Remembers the line of every mapping, for error messages, and
        refuses a key given twice (YAML would keep the last silently), keys
        that are not plain values, and aliases (a few nested ones expand
        into billions of nodes)."""

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise ConfigError(f"{path}:{event.start_mark.line + 1}: aliases (*{event.anchor}) "
                                  f"are not supported; write the value out")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: a key must be "
                                      f"a plain name, not a {key_node.id}")
                key = key_node.value
                if key in seen:
                    raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: "
                                      f"{key!r} is given twice")
                seen.add(key)
            mapping = super().construct_mapping(node, deep=deep)
            mapping["__line__"] = node.start_mark.line + 1
            return mapping
    return LineLoader


def check_fields(label, mapping, allowed):
    """A misspelt field (`enable: false`) would be ignored: refuse it."""
    for key in mapping:
        if key != "__line__" and key not in allowed:
            raise ConfigError(f"{label}: unknown field {key!r} (expected {', '.join(allowed)})")


# Deeper than this, a YAML file is not a source registry.
MAX_NESTING = 50


def check_events(yaml, path, text):
    """Refuses aliases and deep nesting from libyaml's event stream, which
    is read without recursion: composing 200,000 nested lists in C would
    overflow the stack before any check could run."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        kind = type(event)
        if kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            depth += 1
            if depth > MAX_NESTING:
                raise RecursionError
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            depth -= 1
        elif kind is yaml.AliasEvent:
            raise ConfigError(f"{path}:{event.start_mark.line + 1}: aliases (*{event.anchor}) "
                              f"are not supported; write the value out")


def read_yaml(path):
    yaml = import_optional("yaml", "pyyaml", "reading sources.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if getattr(yaml, "CSafeLoader", None):
            # libyaml reads a registry of thousands of sources four times
            # faster; a syntax error is read again below, for its message.
            with contextlib.suppress(yaml.YAMLError):
                check_events(yaml, path, text)
                return yaml.load(text, Loader=_yaml_loader(yaml, path, yaml.CSafeLoader))
        return yaml.load(text, Loader=_yaml_loader(yaml, path))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found (set VESTI_SOURCES or --sources)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason})") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: YAML syntax error: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {shorten(str(e), 300)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a source registry") from None


def _parse_direction(path, key, value):
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: direction {key!r}: expected a mapping with title and keywords")
    line = value.get("__line__", "?")
    check_fields(f"{path}:{line}: direction {key!r}", value, DIRECTION_FIELDS)
    keywords = value.get("keywords") or []
    if not isinstance(keywords, list) or not all(isinstance(k, (str, int)) for k in keywords):
        raise ConfigError(f"{path}:{line}: direction {key!r}: keywords must be a list of words")
    for keyword in keywords:
        if not re.search(r"\w", str(keyword)):
            raise ConfigError(f"{path}:{line}: direction {key!r}: keyword {keyword!r} "
                              f"has no letters or digits")
    return Direction(str(key), str(value.get("title") or key),
                     tuple(str(k).strip() for k in keywords if str(k).strip()))


def _parse_source(path, item, directions, seen):
    if not isinstance(item, dict):
        raise ConfigError(f"{path}: every entry under 'sources' must be a mapping, "
                          f"got {shorten(repr(item), 60)}")
    line = item["__line__"]
    slug = item.get("slug")
    label = f"{path}:{line}: source {slug!r}" if slug is not None else f"{path}:{line}: source"
    check_fields(label, item, SOURCE_FIELDS)
    for field in ("slug", "crawler", "url"):
        if item.get(field) in (None, ""):
            raise ConfigError(f"{label}: missing field '{field}'")
    slug = str(slug)
    if not SLUG.fullmatch(slug):
        raise ConfigError(f"{label}: slug may contain only a-z, 0-9, '_' and '-'")
    if slug in seen:
        raise ConfigError(f"{label}: duplicate slug (first at line {seen[slug]})")
    seen[slug] = line
    if item["crawler"] not in CRAWLERS:
        raise ConfigError(f"{label}: unknown crawler {item['crawler']!r} (expected rss or telegram)")
    direction = item.get("direction")
    if direction is not None and str(direction) not in directions:
        raise ConfigError(f"{label}: unknown direction {direction!r} "
                          f"(defined: {', '.join(directions) or 'none'})")
    priority = item.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or \
            not 0 <= priority <= MAX_PRIORITY:
        raise ConfigError(f"{label}: priority must be a whole number 0 to {MAX_PRIORITY}, "
                          f"got {shorten(repr(priority), 40)}")
    enabled = item.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{label}: enabled must be true or false, got {enabled!r}")
    url = str(item["url"]).strip()
    if item["crawler"] == "rss":
        check_feed_url(label, url)
    if item["crawler"] == "telegram" and channel_name(url) is None:
        raise ConfigError(f"{label}: url must name a public channel (https://t.me/<name> "
                          f"or @name), got {url!r}")
    return SourceSpec(slug, str(item.get("name") or slug), item["crawler"], url,
                      None if direction is None else str(direction), priority, enabled)


def check_feed_url(label, url):
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port
    except ValueError as e:
        raise ConfigError(f"{label}: url is not a valid URL ({e}): {shorten(url, 100)!r}") from None
    if parts.scheme not in WEB_SCHEMES:
        raise ConfigError(f"{label}: url must start with http:// or https://, "
                          f"got {shorten(url, 100)!r}")
    if not parts.hostname:
        raise ConfigError(f"{label}: url has no host: {shorten(url, 100)!r}")


TARGET_KINDS = ("telegram", "webhook", "alert")
TARGET_FIELDS = {"telegram": ("name", "telegram", "directions", "every"),
                 "webhook": ("name", "webhook", "directions", "every"),
                 "alert": ("name", "alert", "directions", "min_relevance", "min_likely", "per_hour")}
# A chat the Bot API knows: @channelname, or a numeric id (-100… for a channel).
BOT_CHAT = re.compile(r"@[A-Za-z][A-Za-z0-9_]{3,31}|-?[1-9][0-9]{0,19}")
ALERT_MIN_RELEVANCE = 8
ALERT_PER_HOUR = 6


def _parse_target(path, item, directions, seen):
    if not isinstance(item, dict):
        raise ConfigError(f"{path}: every entry under 'publish' must be a mapping, "
                          f"got {shorten(repr(item), 60)}")
    line = item["__line__"]
    name = item.get("name")
    label = f"{path}:{line}: publish target {name!r}" if name is not None else \
        f"{path}:{line}: publish target"
    kinds = [kind for kind in TARGET_KINDS if kind in item]
    if len(kinds) != 1:
        raise ConfigError(f"{label}: name exactly one of telegram, webhook or alert")
    kind = kinds[0]
    check_fields(label, item, TARGET_FIELDS[kind])
    if name in (None, "") or not SLUG.fullmatch(str(name)):
        raise ConfigError(f"{label}: needs a name of a-z, 0-9, '_' and '-'")
    name = str(name)
    if name in seen:
        raise ConfigError(f"{label}: duplicate name (first at line {seen[name]})")
    seen[name] = line
    address = str(item[kind]).strip()
    if kind == "webhook":
        check_feed_url(label, address)
    elif not BOT_CHAT.fullmatch(address):
        raise ConfigError(f"{label}: {kind} must be a chat the bot can post to: "
                          f"\"@channelname\" or a numeric id, got {shorten(address, 60)!r}")
    chosen = item.get("directions")
    if chosen is not None:
        if not isinstance(chosen, list) or not chosen:
            raise ConfigError(f"{label}: directions must be a list of direction ids")
        unknown = [str(d) for d in chosen if str(d) not in directions]
        if unknown:
            raise ConfigError(f"{label}: unknown direction {unknown[0]!r} "
                              f"(defined: {', '.join(directions) or 'none'})")
        chosen = tuple(dict.fromkeys(str(d) for d in chosen))
    every = str(item.get("every", "now")).strip()
    if every == "now":
        every = 0.0
    else:
        try:
            every, = _durations("every", every)
        except (ConfigError, ValueError):
            raise ConfigError(f"{label}: every must be a pace like 10m, 1h or 30s, or now; "
                              f"got {shorten(every, 40)!r}") from None
    spec = TargetSpec(name, kind, address, chosen, every)
    if kind != "alert":
        return spec
    relevance = item.get("min_relevance", ALERT_MIN_RELEVANCE)
    if not isinstance(relevance, int) or isinstance(relevance, bool) or not 0 <= relevance <= 10:
        raise ConfigError(f"{label}: min_relevance must be a whole number 0 to 10")
    likely = item.get("min_likely")
    if likely is not None and (not isinstance(likely, (int, float)) or isinstance(likely, bool)
                               or not 0 <= likely <= 1):
        raise ConfigError(f"{label}: min_likely must be a number 0 to 1")
    per_hour = item.get("per_hour", ALERT_PER_HOUR)
    if not isinstance(per_hour, int) or isinstance(per_hour, bool) or not 1 <= per_hour <= 1000:
        raise ConfigError(f"{label}: per_hour must be a whole number 1 to 1000")
    return dataclasses.replace(spec, min_relevance=relevance,
                               min_likely=None if likely is None else float(likely),
                               per_hour=per_hour)


def load_registry(path):
    """sources.yaml, validated: any problem is a ConfigError naming the file,
    the line or the slug."""
    data = read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'directions' and 'sources'")
    check_fields(path, data, ("directions", "sources", "publish"))
    raw_directions = data.get("directions") or {}
    raw_sources = data.get("sources") or []
    raw_targets = data.get("publish") or []
    if not isinstance(raw_directions, dict):
        raise ConfigError(f"{path}: 'directions' must be a mapping of direction ids")
    if not isinstance(raw_sources, list):
        raise ConfigError(f"{path}: 'sources' must be a list")
    directions = {str(k): _parse_direction(path, k, v)
                  for k, v in raw_directions.items() if k != "__line__"}
    if not isinstance(raw_targets, list):
        raise ConfigError(f"{path}: 'publish' must be a list of targets")
    seen = {}
    sources = tuple(_parse_source(path, item, directions, seen) for item in raw_sources)
    named = {}
    targets = tuple(_parse_target(path, item, directions, named) for item in raw_targets)
    return Registry(path, directions, sources, targets)


@redoable
def sync_sources(conn, registry):
    """Upsert every source by slug (health columns untouched); sources gone
    from the file are disabled, never deleted."""
    with transaction(conn):
        for spec in registry.sources:
            old = conn.execute("SELECT id, url FROM sources WHERE slug = ?", (spec.slug,)).fetchone()
            conn.execute("""
                INSERT INTO sources (slug, name, crawler, url, direction, priority, enabled)
                VALUES (?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT(slug) DO UPDATE SET name = excluded.name,
                    crawler = excluded.crawler, url = excluded.url,
                    direction = excluded.direction, priority = excluded.priority,
                    enabled = excluded.enabled
            """, (spec.slug, spec.name, spec.crawler, spec.url, spec.direction,
                  spec.priority, int(spec.enabled)))
            if old is not None and old["url"] != spec.url:
                # Validators and redirects belong to the old address.
                conn.execute("DELETE FROM rss_state WHERE source_id = ?", (old["id"],))
        slugs = [spec.slug for spec in registry.sources]
        conn.execute(f"UPDATE sources SET enabled = 0 WHERE slug NOT IN "
                     f"({','.join('?' * len(slugs)) or 'NULL'})" if slugs else
                     "UPDATE sources SET enabled = 0", slugs)
        sync_targets(conn, registry.targets)
    ready_counts(conn, registry.directions)


def sync_targets(conn, targets):
    """Upsert the publish targets by name; one gone from the file is
    disabled (its publications stay, and wait for it to come back)."""
    for spec in targets:
        conn.execute("""
            INSERT INTO targets (name, kind, address, directions, every, min_relevance,
                                 min_likely, per_hour, enabled)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1)
            ON CONFLICT (name) DO UPDATE SET kind = excluded.kind, address = excluded.address,
                directions = excluded.directions, every = excluded.every,
                min_relevance = excluded.min_relevance, min_likely = excluded.min_likely,
                per_hour = excluded.per_hour, enabled = 1
        """, (spec.name, spec.kind, spec.address,
              None if spec.directions is None else json.dumps(list(spec.directions)),
              spec.every, spec.min_relevance, spec.min_likely, spec.per_hour))
    names = [spec.name for spec in targets]
    conn.execute(f"UPDATE targets SET enabled = 0 WHERE name NOT IN "
                 f"({','.join('?' * len(names)) or 'NULL'})" if names else
                 "UPDATE targets SET enabled = 0", names)


def select_sources(conn, crawler, selection, now=None, due=True):
    """Enabled sources of one crawler kind (or all kinds) for a selection:
    ('all', None), ('direction', d), ('source', slug), ('priority', n) or
    ('ids', [id, …]) from run's scheduler. --all and the others skip sources
    that asked to wait (cache headers, a feed's ttl, Retry-After) or whose
    dead-probe is not due; --source fetches at once; the scheduler has asked
    already. Not `due`: the ones --all and the others skip."""
    kind, value = selection
    if not due and kind in ("source", "ids"):
        return []
    where, params = ["enabled = 1"], []
    if crawler:
        where.append("crawler = ?")
        params.append(crawler)
    if kind == "source":
        where.append("slug = ?")
        params.append(value)
    elif kind == "ids":         # chosen by run's scheduler, which has asked the same
        where.append(f"id IN ({','.join(str(int(i)) for i in value) or 'NULL'})")
    else:
        where.append("(next_fetch_at IS NULL OR next_fetch_at <= ?)" if due else
                     "next_fetch_at > ?")
        params.append(utc_text(now))
        if kind == "direction":
            where.append("direction = ?")
            params.append(value)
        elif kind == "priority":
            where.append("priority = ?")
            params.append(value)
    return conn.execute(f"SELECT * FROM sources WHERE {' AND '.join(where)} "
                        f"ORDER BY priority, id", params).fetchall()


###############################################################################
# Fetching ####################################################################
###############################################################################
# HTTP GET with deadlines, redirects, the network policy, pace per host.

MAX_REDIRECTS = 5
PERMANENT_REDIRECTS = (301, 308)
REDIRECTS = (301, 302, 303, 307, 308)


def host_of(url):
    try:
        return (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
    except ValueError:
        return ""


class HostGate:
    """One request at a time per host, at least `delay` seconds apart. No lock
    is held during a request: the host is marked busy, and a caller that
    cannot have it within `patience` seconds gets HostBusy instead of waiting."""

    def __init__(self, delay, clock=time.monotonic):
        self.delay, self.clock = delay, clock
        self._changed = threading.Condition()
        self._busy = set()
        self._waiting = collections.Counter()
        self._last = {}

    @contextlib.contextmanager
    def turn(self, url, patience=None):
        host = host_of(url)
        self._take(host, None if patience is None else self.clock() + patience)
        try:
            yield
        finally:
            with self._changed:
                self._busy.discard(host)
                self._last[host] = self.clock()
                self._changed.notify_all()

    def unavailable(self):
        """The hosts a request would wait for now, as two sets: those taken
        (a request under way, or callers waiting for one), and those resting
        (asked less than `delay` seconds ago; the others are forgotten)."""
        with self._changed:
            now = self.clock()
            self._last = {host: at for host, at in self._last.items() if at + self.delay > now}
            taken = self._busy | self._waiting.keys()
            return taken, self._last.keys() - taken

    def _take(self, host, deadline):
        with self._changed:
            self._waiting[host] += 1
            try:
                self._wait_for(host, deadline)
            finally:
                self._waiting[host] -= 1
                if not self._waiting[host]:
                    del self._waiting[host]
            self._busy.add(host)

    def _wait_for(self, host, deadline):
        while True:
            now = self.clock()
            wait = None if host in self._busy else \
                self._last.get(host, -math.inf) + self.delay - now
            if wait is not None and wait <= 0:
                return
            if deadline is not None:
                if now >= deadline:
                    raise HostBusy(f"{host} is busy with another request")
                wait = deadline - now if wait is None else min(wait, deadline - now)
            self._changed.wait(wait)


@dataclasses.dataclass
class Response:
    status: int
    url: str
    headers: dict
    body: bytes
    moved_to: str = None
    location: str = None


def why_refused(address):
    """Why a link may not reach this IP address (loopback, private, …), or
    None for a public address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.version == 6 and (ip.ipv4_mapped or ip.sixtofour):
        ip = ip.ipv4_mapped or ip.sixtofour
    for kind in ("loopback", "link_local", "multicast", "unspecified", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "reserved"


@dataclasses.dataclass(frozen=True)
class Policy:
    """Where a request may go: any public address; a loopback or private one
    only on the source's own host, or everywhere with VESTI_ALLOW_PRIVATE_NETWORKS=1."""
    home_host: str
    allow_private: bool

    def refusal(self, host, address):
        if self.allow_private or host == self.home_host:
            return None
        return why_refused(address)


def check_scheme(url):
    try:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
    except ValueError as e:
        raise FetchError(f"bad URL {shorten(url, 200)!r}: {e}") from None
    if scheme not in WEB_SCHEMES:
        raise RefusedDestination(f"refused a {scheme or 'schemeless'}: link "
                                 f"({shorten(url, 100)!r}): only http and https are fetched")


def connect_to(host, port, policy, timeout):
    """A TCP connection to the first address of `host` the policy allows;
    the address checked is the address connected to."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise FetchError(f"cannot resolve host ({getattr(e, 'strerror', None) or e})") from None
    refused, failure = None, None
    for family, kind, proto, _, address in addresses:
        why = policy.refusal(host, address[0])
        if why:
            refused = refused or (address[0], why)
            continue
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            return sock
        except OSError as e:
            sock.close()
            failure = e
    if failure is None and refused:
        raise RefusedDestination(
            f"refused {host} by the network policy: it resolves to a {refused[1]} address "
            f"({refused[0]}); set VESTI_ALLOW_PRIVATE_NETWORKS=1 to allow links and redirects "
            f"there")
    raise FetchError(describe_error(failure or OSError("no address")))


@functools.lru_cache(maxsize=1)
def tls_context():
    return ssl.create_default_context()


class _DeadlineReader(io.RawIOBase):
    """A socket read until a deadline: each read waits at most the time that
    is left, so a peer dripping bytes cannot hold a request past it."""

    def __init__(self, sock, deadline, timeout):
        self.sock, self.deadline, self.timeout = sock, deadline, timeout

    def readable(self):
        return True

    def readinto(self, buffer):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlinePassed()
        self.sock.settimeout(min(self.timeout, left))
        try:
            return self.sock.recv_into(buffer)
        except (socket.timeout, TimeoutError):
            if time.monotonic() >= self.deadline:
                raise DeadlinePassed() from None
            raise


class _DeadlineSocket:
    """What http.client.HTTPResponse reads from: the socket behind a deadline."""

    def __init__(self, sock, deadline, timeout):
        self.sock, self.deadline, self.timeout = sock, deadline, timeout

    def makefile(self, mode):
        return io.BufferedReader(_DeadlineReader(self.sock, self.deadline, self.timeout), 65536)


def request_target(parts):
    """The path and query to send, percent-encoded where the link was not."""
    target = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    if parts.query:
        target += "?" + urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return target


def header_lines(headers):
    """Request header lines; a value with a line break (an ETag a server
    made up) is left out rather than sent."""
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items()
                   if value is not None and not re.search(r"[\r\n]", str(value)))


def send_get(url, headers, settings, policy, deadline):
    """Connect, send a GET and read the status line and headers, all before
    `deadline`. Returns (socket, HTTPResponse)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or DEFAULT_PORTS[parts.scheme.lower()]
    except (ValueError, KeyError) as e:
        raise FetchError(f"bad URL {shorten(url, 200)!r}: {e}") from None
    host = host_of(url)
    if not host:
        raise FetchError(f"bad URL {shorten(url, 200)!r}: no host")
    timeout = max(0.001, min(settings.timeout, deadline - time.monotonic()))
    sock = connect_to(host, port, policy, timeout)
    try:
        if parts.scheme.lower() == "https":
            sock = tls_context().wrap_socket(sock, server_hostname=host)
        name = f"[{host}]" if ":" in host else host
        if port != DEFAULT_PORTS[parts.scheme.lower()]:
            name = f"{name}:{port}"
        sock.sendall((f"GET {request_target(parts)} HTTP/1.1\r\nHost: {name}\r\n"
                      f"{header_lines(headers)}Connection: close\r\n\r\n").encode("latin-1", "replace"))
        response = http.client.HTTPResponse(_DeadlineSocket(sock, deadline, settings.timeout),
                                            method="GET")
        response.begin()
        return sock, response
    except BaseException:
        sock.close()
        raise


class _Decoder:
    """gzip or deflate (zlib-wrapped or raw) with a bounded output size."""

    STEP = 1 << 18      # most bytes inflated by one call

    def __init__(self, encoding):
        self.encoding = encoding
        wbits = 16 + zlib.MAX_WBITS if encoding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self.inflater = zlib.decompressobj(wbits)
        self.started = False

    def decompress(self, data, room):
        try:
            out = self.inflater.decompress(data, room)
        except zlib.error:
            if self.encoding != "deflate" or self.started:
                raise
            self.inflater = zlib.decompressobj(-zlib.MAX_WBITS)
            out = self.inflater.decompress(data, room)
        self.started = True
        return out

    def pieces(self, data, room):
        """The output of `data`, in pieces of at most STEP bytes (zlib holds
        twice a call's output while it works), until `room` bytes are out."""
        while room > 0:
            step = min(self.STEP, room)
            out = self.decompress(data, step)
            yield out
            room -= len(out)
            data = self.inflater.unconsumed_tail
            if not data and len(out) < step:
                return      # a full step may leave output behind with no input left


def read_body(response, settings, deadline):
    """The body, decompressed, refused past RSS_MAX_BYTES or past `deadline`."""
    limit = settings.max_bytes
    encoding = (response.headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding not in ("identity", "gzip", "x-gzip", "deflate"):
        raise FetchError(f"unsupported Content-Encoding {encoding!r}")
    declared = response.headers.get("Content-Length")
    if encoding == "identity" and declared and digits_only(declared) and int(declared) > limit:
        raise FetchError(f"body of {int(declared)} bytes is over the limit of {limit} bytes")
    decoder = None if encoding == "identity" else _Decoder(encoding)
    chunks, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise FetchError(f"response took longer than {3 * settings.timeout:g} s")
        raw = response.read1(65536)
        if not raw:
            break
        try:
            for data in decoder.pieces(raw, limit + 1 - size) if decoder else (raw,):
                size += len(data)
                if size > limit:
                    raise FetchError(f"body is over the limit of {limit} bytes")
                chunks.append(data)
        except zlib.error as e:
            raise FetchError(f"broken {encoding} body: {e}") from None
    return b"".join(chunks)


def describe_error(error):
    """A short human line for a network error."""
    reason = getattr(error, "reason", error)
    if isinstance(reason, ssl.SSLCertVerificationError):
        return f"TLS certificate not accepted ({reason.verify_message or reason})"
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(reason, socket.gaierror):
        return f"cannot resolve host ({reason.strerror or reason})"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, http.client.HTTPException):
        return f"bad HTTP answer ({type(reason).__name__}: {shorten(str(reason), 100)})"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__


def retry_after_seconds(value, now=None):
    """Retry-After as seconds from now: a number or an HTTP date; None if unreadable."""
    value = (value or "").strip()
    if digits_only(value):
        return int(value[:9])
    when = http_time(value)
    return None if when is None else max(0, when - (time.time() if now is None else now))


def request_headers(settings, extra=None):
    return {"User-Agent": settings.user_agent, "Accept-Encoding": "gzip, deflate",
            "Accept": "application/rss+xml, application/atom+xml, application/xml;q=0.9, "
                      "text/xml;q=0.9, text/html;q=0.8, */*;q=0.5",
            **(extra or {})}


def fetch_once(url, headers, settings, policy):
    """One request, no redirect followed, within one deadline of 3 x
    RSS_TIMEOUT from connect to the last byte: the status, the headers, the
    body of a 2xx answer and the target of a redirect."""
    limit = 3 * settings.timeout
    deadline = time.monotonic() + limit
    sock = None
    try:
        sock, response = send_get(url, headers, settings, policy, deadline)
        status = response.status
        location = response.headers.get("Location")
        if status in REDIRECTS and not location:
            raise FetchError(f"HTTP {status} without a Location header")
        body = read_body(response, settings, deadline) if 200 <= status < 300 else b""
        target = urllib.parse.urljoin(url, location.strip()) if status in REDIRECTS else None
        return Response(status, url, {k.lower(): v for k, v in response.headers.items()},
                        body, location=target)
    except DeadlinePassed:
        raise FetchError(f"response took longer than {limit:g} s") from None
    except (OSError, http.client.HTTPException) as e:
        raise FetchError(describe_error(e)) from None
    finally:
        if sock is not None:
            sock.close()


def http_get(url, settings, headers=None, gate=None, home=None, patience=None):
    """GET with redirects (at most 5; where a chain of permanent ones leads is
    reported as moved_to), gzip/deflate, a size cap after decompression and a
    whole-response deadline. Every hop must be http(s), and may reach a
    loopback or private address only on the host of `home` (the source's
    configured URL; by default `url` itself). The host gate is waited for at
    most `patience` seconds (default: one request's deadline). Returns any
    final status; network failures and refused links raise FetchError."""
    gate = gate or HostGate(0)
    policy = Policy(host_of(url if home is None else home), settings.allow_private)
    headers = request_headers(settings, headers)
    moved_to, permanent = None, True
    for _ in range(MAX_REDIRECTS + 1):
        check_scheme(url)
        with gate.turn(url, 3 * settings.timeout if patience is None else patience):
            response = fetch_once(url, headers, settings, policy)
        if response.location is None:
            response.moved_to = moved_to
            return response
        permanent = permanent and response.status in PERMANENT_REDIRECTS
        url = response.location
        moved_to = url if permanent else moved_to
    raise FetchError(f"more than {MAX_REDIRECTS} redirects")


###############################################################################
# RSS #########################################################################
###############################################################################
# Reading feeds (feedparser and a plain reader) and crawling them.

# Shorter than this, a feed's text is a teaser: the article is fetched in phase 3.
FULL_TEXT_MIN = 600


def readable(value, kind):
    """Plain text of a feed field: markup stripped only when the feed says
    the field is HTML (a plain-text title may well say Vec<T>)."""
    value = value or ""
    return value.strip() if kind == "text/plain" else html_to_text(value)


def entry_text(entry):
    """(text, content_type) of a feed entry: its full content when the feed
    carries it, else its summary."""
    content = "\n".join(readable(c.get("value"), c.get("type")) for c in entry.get("content") or [])
    summary = readable(entry.get("summary"), (entry.get("summary_detail") or {}).get("type"))
    text = content if len(content) >= len(summary) else summary
    return text, "full" if len(text) >= FULL_TEXT_MIN else "summary"


def entry_published(entry):
    """The entry's date as UTC text; None when it has none (or one more than
    a day in the future): it is then stored as undated, at its fetch time."""
    # Plain dict lookups: feedparser's own get() warns when it maps one to the other.
    parsed = dict.get(entry, "published_parsed") or dict.get(entry, "updated_parsed")
    if not parsed:
        return None
    try:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", parsed)
    except (TypeError, ValueError):
        return None
    return None if stamp > utc_text(time.time() + 86400) else stamp


def entry_link(entry, feed_url):
    """The entry's link resolved against the feed; only http(s) links count
    (a javascript: link must never reach the page)."""
    link = (entry.get("link") or "").strip()
    if not link:
        return ""
    if SIMPLE_URL.fullmatch(link):
        return link
    link = urllib.parse.urljoin(feed_url, link)
    return link if urllib.parse.urlsplit(link).scheme in ("http", "https") else ""


def entry_id(entry, link, title, text):
    """The feed's guid; without one, the link plus a hash of the content, since
    some feeds give every entry the same link."""
    if entry.get("id"):
        return str(entry["id"])
    return f"{link or ''}#{content_digest(title, text)}"


@dataclasses.dataclass
class ParsedFeed:
    drafts: list
    last_build_date: str
    warning: str
    keep_fragments: bool
    ttl: int = None       # seconds the feed asks to be left alone (RSS <ttl>)


def feed_ttl(ttl):
    """An RSS <ttl> (minutes) as seconds; None when absent or unreadable."""
    value = str(ttl or "").strip()
    return int(value) * 60 if digits_only(value) and len(value) < 9 else None


def _fragment_sensitive(links):
    """True when two different links differ only by their fragment."""
    seen = {}
    for link in links:
        bare = link.partition("#")[0]
        if seen.setdefault(bare, link) != link:
            return True
    return False


def run_feedparser(body, feed_url, content_type):
    feedparser = import_optional("feedparser", "feedparser", "the RSS crawler")
    headers = {"content-location": feed_url, "content-type": rfc7303_content_type(content_type)}
    if body[:1].isspace() and body.lstrip()[:5] == b"<?xml":
        body = body.lstrip()  # a stray newline before the declaration is common and harmless
    # No sanitizing: every summary and content becomes plain text (html_to_text)
    # and every page escapes it, so feedparser's second pass over the HTML
    # (a third of its time) would change nothing kept.
    return feedparser.parse(body, response_headers=headers, sanitize_html=False)


@dataclasses.dataclass
class FeedReading:
    """What a parser read from a feed body: entries as feedparser shapes
    them (title, title_detail, summary, summary_detail, content, link, id,
    published_parsed, updated_parsed), the feed's own date and ttl, and the
    parser's complaint about the body, if any."""
    entries: list
    updated: str = None
    ttl: str = None
    problem: Exception = None
    version: str = ""


def read_with_feedparser(body, feed_url, content_type):
    parsed = run_feedparser(body, feed_url, content_type)
    return FeedReading(parsed.get("entries") or [], dict.get(parsed.feed, "updated"),
                       dict.get(parsed.feed, "ttl"),
                       parsed.get("bozo_exception") if parsed.get("bozo") else None,
                       parsed.get("version") or "")


# The fast path: a plain, well-formed, UTF-8 RSS 2.0 or Atom 1.0 feed is read
# with the C XML parser and gives exactly what feedparser gives (the
# agreement test runs both over the real corpus); anything else (RSS 1.0,
# Atom 0.3, other encodings, entities, DOCTYPE, xml:base, markup inside
# elements, repeated or unusual fields) goes to feedparser. feedparser spends
# most of a crawl's CPU; this path about a tenth of it.
ATOM_NS = "http://www.w3.org/2005/atom"
CONTENT_NS = "http://purl.org/rss/1.0/modules/content/"
DC_NS = "http://purl.org/dc/elements/1.1/"
DCTERMS_NS = "http://purl.org/dc/terms/"
# Entry fields by (namespace, lower-case name), as feedparser maps them.
ENTRY_FIELDS = {
    ("", "title"): "title", (ATOM_NS, "title"): "title", (DC_NS, "title"): "title",
    ("", "description"): "description", (DC_NS, "description"): "description",
    (ATOM_NS, "summary"): "summary",
    (ATOM_NS, "content"): "content", (CONTENT_NS, "encoded"): "encoded",
    ("", "link"): "link", (ATOM_NS, "link"): "link",
    ("", "guid"): "id", (ATOM_NS, "id"): "id",
    ("", "pubdate"): "published", (ATOM_NS, "published"): "published",
    (ATOM_NS, "issued"): "published", (DCTERMS_NS, "issued"): "published",
    (ATOM_NS, "updated"): "updated", (ATOM_NS, "modified"): "updated",
    (DC_NS, "date"): "updated", (DCTERMS_NS, "modified"): "updated",
    ("", "lastbuilddate"): "updated",
}
FEED_DATES = {("", "lastbuilddate"), (ATOM_NS, "updated"), (ATOM_NS, "modified"),
              (DC_NS, "date"), (DCTERMS_NS, "modified")}
# Names feedparser reads into those fields from other elements too (an
# iTunes summary, a Media RSS title, …): an entry holding one is left to it.
FIELD_NAMES = {"title", "description", "summary", "content", "encoded", "link", "guid", "id",
               "pubdate", "published", "issued", "updated", "modified", "date", "created",
               "abstract", "fullitem", "body", "lastbuilddate", "subtitle", "tagline"}
# Elements with such a name that feedparser keeps elsewhere.
HARMLESS_FIELDS = {("http://search.yahoo.com/mrss/", "content"),
                   ("http://search.yahoo.com/mrss", "content")}
XML_TYPES = ("application/xml", "application/xml-dtd", "application/xml-external-parsed-entity",
             "text/xml", "text/xml-external-parsed-entity")
XML_ENCODING = re.compile(rb'^<\?.*encoding=[\'"](.*?)[\'"].*\?>')
XML_DECLARATION = re.compile(r"^<\?xml[^>]*?>")
URI_FIXER = re.compile("^([A-Za-z][A-Za-z0-9+-.]*://)(/*)(.*?)")
CP1252 = {code: bytes([code]).decode("cp1252") for code in range(128, 160)
          if code not in (129, 141, 143, 144, 157)}


def read_feed(body, feed_url, content_type, max_entries=None):
    """FeedReading of a feed body: the fast path when it can (reading no
    more than `max_entries` entries), else feedparser."""
    try:
        return read_plain_feed(body, feed_url, content_type, max_entries)
    except NotPlain:
        return read_with_feedparser(body, feed_url, content_type)


def read_plain_feed(body, feed_url, content_type, max_entries=None):
    root = parse_plain_xml(body, content_type)
    namespace, name = split_tag(root.tag)
    if (namespace, name) == ("", "rss"):
        channels = [child for child in root if child.tag == "channel"]
        if len(channels) != 1:
            raise NotPlain("not one channel")
        feed, items, atom = channels[0], channels[0].findall("item"), False
        nested = sum(1 for _ in root.iter("item"))
    elif (namespace, name) == (ATOM_NS, "feed"):
        feed, items, atom = root, root.findall(root.tag[:-4] + "entry"), True
        nested = sum(1 for _ in root.iter(root.tag[:-4] + "entry"))
    else:
        raise NotPlain("neither RSS 2.0 nor Atom 1.0")
    if not items or nested != len(items):
        raise NotPlain("no entries, or entries out of place")
    reading = FeedReading([], version="atom10" if atom else "rss20")
    for child in feed:
        key = split_tag(child.tag)
        if key in FEED_DATES:
            reading.updated = feedparser_text(child.text)
        elif key == ("", "ttl") and not atom:
            reading.ttl = feedparser_text(child.text)
    base = rebase(feed_url, root)
    if feed is not root:
        base = rebase(base, feed)
    reading.entries = [plain_entry(item, rebase(base, item), atom) for item in items[:max_entries]]
    return reading


def media_type(content_type):
    """(media type, charset or "") of a Content-Type; none at all is XML."""
    mime, _, params = (content_type or "application/xml").partition(";")
    charset = next((value.strip().strip("\"'") for key, _, value in
                    (chunk.partition("=") for chunk in params.split(";"))
                    if key.strip().lower() == "charset"), "")
    return mime.strip(), charset


def is_xml_type(mime):
    return mime in XML_TYPES or (mime.startswith(("application/", "text/")) and mime.endswith("+xml"))


def rfc7303_content_type(content_type):
    """The Content-Type feedparser is told. Without one it flags every feed
    as malformed. A text/xml without a charset is read as RFC 7303 reads it,
    like application/xml (the XML declaration, else UTF-8): feedparser keeps
    RFC 3023's us-ascii default, which RFC 7303 dropped because servers
    never meant it, and flags every such feed that is not ASCII."""
    mime, charset = media_type(content_type)
    if not content_type or (mime.startswith("text/") and is_xml_type(mime) and not charset):
        return "application/xml"
    return content_type


def parse_plain_xml(body, content_type):
    """The document's root element, decoded as feedparser decodes it (the
    HTTP charset, the XML declaration, UTF-8), or NotPlain where feedparser
    would complain or guess."""
    if body[:1].isspace() and body.lstrip()[:5] == b"<?xml":
        body = body.lstrip()
    if body[:3] == codecs.BOM_UTF8:
        body = body[3:]
    elif body[:2] in (codecs.BOM_UTF16_BE, codecs.BOM_UTF16_LE) or b"\0" in body[:4] \
            or body[:4] == b"\x4c\x6f\xa7\x94":
        raise NotPlain("a UTF-16, UTF-32 or EBCDIC body")
    mime, charset = media_type(content_type)
    if not is_xml_type(mime):
        raise NotPlain(f"{mime} is not an XML media type")
    declared = XML_ENCODING.match(body)
    declared = declared.group(1).decode("utf-8", "replace").lower() if declared else ""
    encoding = charset or declared or "utf-8"
    try:
        text = body.decode("gb18030" if encoding.lower() == "gb2312" else encoding)
    except (UnicodeDecodeError, LookupError):
        raise NotPlain(f"not {encoding}") from None
    if "<!DOCTYPE" in text or "<!ENTITY" in text:
        raise NotPlain("a DOCTYPE")
    try:
        return ElementTree.fromstring(XML_DECLARATION.sub("", text, count=1))
    except (ElementTree.ParseError, ValueError) as e:
        raise NotPlain(str(e)) from None


# Schemes feedparser keeps when it resolves an xml:base.
BASE_SCHEMES = {"file", "ftp", "gopher", "h323", "hdl", "http", "https", "imap", "magnet",
                "mailto", "mms", "news", "nntp", "prospero", "rsync", "rtsp", "rtspu", "sftp",
                "shttp", "sip", "sips", "snews", "svn", "svn+ssh", "telnet", "wais", "aim",
                "callto", "cvs", "facetime", "feed", "git", "gtalk", "irc", "ircs", "irc6",
                "itms", "msnim", "skype", "ssh", "smb", "ymsg"}
XML_BASE = "{http://www.w3.org/XML/1998/namespace}base"


def rebase(base, element):
    """The base URI inside `element`: its xml:base resolved against `base`."""
    value = element.get(XML_BASE) or element.get("base")
    if not value:
        return base
    joined = resolve_link(base, value) if base else value
    return joined if joined.strip().split(":", 1)[0] in BASE_SCHEMES else base


def split_tag(tag):
    """(namespace, lower-case local name) of an ElementTree tag."""
    if tag[:1] == "{":
        namespace, _, name = tag[1:].partition("}")
        return namespace.lower(), name.lower()
    return "", tag.lower()


def feedparser_text(text):
    """A field's text as feedparser leaves it: stripped, UTF-8 read as
    Latin-1 put right, Windows-1252 controls mapped."""
    text = (text or "").strip()
    if text.isascii():
        return text
    try:
        text = text.encode("iso-8859-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        pass
    return text.translate(CP1252)


def resolve_link(base, link):
    """feedparser's urljoin: extra slashes after the scheme dropped first."""
    if SIMPLE_URL.fullmatch(link):
        return link
    link = URI_FIXER.sub(r"\1\3", link)
    try:
        return urllib.parse.urljoin(base, link)
    except ValueError:
        return ""


# An absolute http(s) URL that urljoin would give back unchanged, whatever the
# base: lower-case scheme, an ASCII host, no white space, no empty query or
# fragment (the common case, spared urljoin's cost).
SIMPLE_URL = re.compile(r"https?://[A-Za-z0-9.-]+(?::\d+)?(?:/[^\s?#]*)?(?:\?[^\s#]+)?(?:#\S+)?")


def content_type_of(element, default):
    """A text field's type as feedparser decides it (fast path: text or HTML only)."""
    attributes = {k.lower(): v for k, v in element.attrib.items()}
    kind = (attributes.get("type") or default).lower()
    kind = {"text": "text/plain", "plain": "text/plain", "html": "text/html"}.get(kind, kind)
    if kind not in ("text/plain", "text/html") or attributes.get("mode") == "base64":
        raise NotPlain(f"a {kind} field")
    return kind


def plain_entry(item, feed_url, atom):
    """One entry as feedparser would shape it, from one element of each kind."""
    entry, seen = {"links": []}, set()
    for child in item:
        key = split_tag(child.tag)
        field = ENTRY_FIELDS.get(key)
        base = rebase(feed_url, child)
        if field is None:
            if any(split_tag(e.tag)[1] in FIELD_NAMES and split_tag(e.tag) not in HARMLESS_FIELDS
                   for e in child.iter()):
                raise NotPlain(f"an entry with <{child.tag}>")
            continue
        kind = "summary" if field == "description" else "content" if field == "encoded" else field
        if kind in seen and not (field == "link" and key[0] == ATOM_NS):
            raise NotPlain(f"an entry with two <{child.tag}>")
        seen.add(kind)
        if len(child) and not (field == "link" and key[0] == ATOM_NS):
            raise NotPlain(f"markup inside <{child.tag}>")
        read_entry_field(entry, field, child, base, atom)
    if "summary" not in entry and entry.get("content"):
        entry["summary"] = entry["content"][0]["value"]
    if entry.pop("_guid_is_link", False):
        entry.setdefault("link", entry["id"])
    return entry


def read_entry_field(entry, field, element, feed_url, atom):
    if field in ("title", "description", "summary", "content", "encoded"):
        default = "text/html" if field in ("description", "encoded") else "text/plain"
        kind = content_type_of(element, default)
        value = element.text or ""
        value = value.strip()
        if not atom and kind == "text/plain" and looks_like_html(value):
            kind = "text/html"
        value = feedparser_text(value)
        if field in ("content", "encoded"):
            entry["content"] = [{"type": kind, "value": value}]
        else:
            name = "title" if field == "title" else "summary"
            entry[name], entry[name + "_detail"] = value, {"type": kind}
    elif field == "link":
        read_link(entry, element, feed_url)
    elif field == "id":
        permalink = next((v for k, v in element.attrib.items() if k.lower() == "ispermalink"),
                         "true") == "true"
        value = (element.text or "").strip()
        if permalink and value:
            value = resolve_link(feed_url, value)
        entry["id"] = feedparser_text(value)
        entry["_guid_is_link"] = permalink
    else:
        value = feedparser_text(element.text)
        entry[field], entry[field + "_parsed"] = value, feed_date(value)


def read_link(entry, element, feed_url):
    attributes = {k.lower(): v for k, v in element.attrib.items()}
    href = attributes.get("url", attributes.get("uri", attributes.get("href")))
    if href is None:
        if attributes:
            raise NotPlain("a link with attributes but no href")
        value = (element.text or "").strip()
        value = feedparser_text(resolve_link(feed_url, value) if value else "").replace("&amp;", "&")
        entry["link"] = re.sub("&([A-Za-z0-9_]+);", r"&\g<1>", value)
        return
    if not href or (element.text and element.text.strip()):
        raise NotPlain("a link with an empty href, or with text")
    rel = (attributes.get("rel") or "alternate").lower()
    kind = (attributes.get("type") or ("application/atom+xml" if rel == "self" else "text/html")).lower()
    kind = {"html": "text/html", "xhtml": "application/xhtml+xml"}.get(kind, kind)
    if rel == "alternate" and kind in ("text/html", "application/xhtml+xml"):
        entry["link"] = resolve_link(feed_url, href)


def looks_like_html(text):
    """feedparser's guess that a plain-text field holds HTML: a closing tag
    or an entity, and only known tags and entities."""
    if not (re.search(r"</(\w+)>", text) or re.search(r"&#?\w+;", text)):
        return False
    feedparser = import_optional("feedparser", "feedparser", "the RSS crawler")
    allowed = feedparser.sanitizer._HTMLSanitizer.acceptable_elements
    if any(tag.lower() not in allowed for tag in re.findall(r"</?(\w+)", text)):
        return False
    return all(name in html.entities.entitydefs for name in re.findall(r"&(\w+);", text))


# The two date forms nearly every feed uses, read here exactly as feedparser
# reads them (its W3C-DTF reader first, then its RFC 822 one); anything else
# is left to feedparser.
W3C_DATE = re.compile(r"(\d{4})-(\d\d)-(\d\d)t(\d\d):(\d\d)(?::(\d\d)(?:\.\d+)?)?(z|[+-]\d\d:\d\d)",
                      re.I)
RFC822_DATE = re.compile(r"(?:(?:mon|tue|wed|thu|fri|sat|sun)[a-z]*,?\s+)?(\d{1,2})\s+([a-z]{3})[a-z]*"
                         r"\s+(\d{4})\s+(\d{1,2}):(\d\d)(?::(\d\d))?\s+([+-]\d{4}|gmt|ut|utc|z)", re.I)
MONTHS = {name: number for number, name in enumerate(
    "jan feb mar apr may jun jul aug sep oct nov dec".split(), 1)}


def feed_date(text):
    """An entry date as feedparser reads it (a UTC struct_time), or None."""
    if not text:
        return None
    return plain_date(text) or import_optional(
        "feedparser", "feedparser", "the RSS crawler").datetimes._parse_date(text)


def plain_date(text):
    """W3C-DTF or RFC 822 with a time and a zone, or None."""
    try:
        match = W3C_DATE.fullmatch(text)
        if match:
            year, month, day, hour, minute, second, zone = match.groups()
            zone = zone.lower()
            hours, minutes = (0, 0) if zone == "z" else (int(zone[:3]), int(zone[0] + zone[4:]))
        else:
            match = RFC822_DATE.fullmatch(text)
            if not match or match.group(2).lower() not in MONTHS:
                return None
            day, month, year, hour, minute, second, zone = match.groups()
            month = MONTHS[month.lower()]
            hours, minutes = (int(zone[:3]), int(zone[0] + zone[3:])) if zone[0] in "+-" else (0, 0)
        stamp = datetime.datetime(int(year), int(month), int(day), int(hour), int(minute),
                                  int(second or 0))
        return (stamp - datetime.timedelta(hours=hours, minutes=minutes)).utctimetuple()
    except (ValueError, OverflowError):
        return None


def entry_draft(entry, link, canonical):
    title = readable(entry.get("title"), (entry.get("title_detail") or {}).get("type"))
    text, kind = entry_text(entry)
    return Draft(entry_id(entry, link, title, text), link or None, canonical,
                 title, text, kind, entry_published(entry))


def parse_feed(body, feed_url, max_entries, keep_fragments=False, content_type=None):
    """Drafts from a feed body. Malformed feeds that still yield entries come
    with a warning; a body that yields none is a FeedError."""
    reading = read_feed(body, feed_url, content_type, max_entries)
    entries, problem, built = reading.entries[:max_entries], reading.problem, reading.updated
    if not entries:
        if problem is not None or not reading.version:
            reason = f": {shorten(str(problem), 200)}" if problem is not None else ""
            raise FeedError(f"not a feed (no entries found{reason})")
        return ParsedFeed([], built, None, keep_fragments, feed_ttl(reading.ttl))
    links = [entry_link(e, feed_url) for e in entries]
    canonical = [canonical_urls(link) if link else (None, None) for link in links]
    keep_fragments = keep_fragments or _fragment_sensitive([whole for _, whole in canonical if whole])
    drafts = [entry_draft(e, link, urls[keep_fragments])
              for e, link, urls in zip(entries, links, canonical)]
    mark_ambiguous(drafts)
    warning = f"malformed feed, {len(drafts)} entries kept: {shorten(str(problem), 200)}" \
        if problem is not None else None
    return ParsedFeed(drafts, built, warning, keep_fragments, feed_ttl(reading.ttl))


def mark_ambiguous(drafts):
    """Some feeds give many different entries one link (or repeat a guid and
    link with new text), or one boilerplate summary: such a link or text does
    not identify an entry, so those entries are told apart otherwise."""
    identities = [(d.external_id, content_digest(d.title, d.text)) for d in drafts]
    hashes = [text_sha256(d.text) for d in drafts]
    by_url, by_text, by_id = {}, {}, {}
    for draft, identity, sha in zip(drafts, identities, hashes):
        by_url.setdefault(draft.canonical_url, set()).add(identity)
        by_text.setdefault(sha, set()).add(identity)
        by_id[draft.external_id] = by_id.get(draft.external_id, 0) + 1
    for draft, identity, sha in zip(drafts, identities, hashes):
        draft.text_identifies = len(by_text[sha]) == 1
        if draft.canonical_url and len(by_url[draft.canonical_url]) > 1:
            draft.url_identifies = False
            if by_id[draft.external_id] > 1:
                draft.external_id = f"{draft.external_id}#{identity[1]}"


def fragments_seen_before(conn, source_id, drafts):
    """True when a link differs only by its #fragment from one this source gave
    in an earlier fetch: the feed tells entries apart by fragment, so its
    fragments are kept from now on."""
    for draft in drafts:
        if not (draft.url and "#" in draft.url and draft.canonical_url):
            continue
        link = canonical_url(draft.url, keep_fragment=True)
        for earlier in stored_links(conn, source_id, draft.canonical_url):
            if "#" in earlier and canonical_url(earlier, keep_fragment=True) != link:
                return True
    return False


def conditional_get(source, state, settings, gate):
    """GET the feed with the validators from the last fetch; a permanent
    redirect seen before is followed directly."""
    headers = {}
    if state.get("etag"):
        headers["If-None-Match"] = state["etag"]
    if state.get("modified"):
        headers["If-Modified-Since"] = state["modified"]
    return http_get(state.get("moved_to") or source["url"], settings, headers, gate,
                    home=source["url"])


def status_text(status):
    """"HTTP 404 Not Found": an answer's status, said."""
    return f"HTTP {status} {http.client.responses.get(status, '')}".strip()


# A server may ask to wait; no longer than a day.
MAX_RETRY_AFTER = 86400


def check_status(response):
    """Raise for an answer that is not a feed body or a 304."""
    status = response.status
    if status == 410:
        raise SourceGone("HTTP 410 Gone")
    if status in (429, 503):
        seconds = retry_after_seconds(response.headers.get("retry-after"))
        if seconds is not None:
            seconds = min(seconds, MAX_RETRY_AFTER)
            raise SourceDeferred(f"HTTP {status}, retry after {int(seconds)} s", seconds)
    if status != 304 and not 200 <= status < 300:
        raise FetchError(status_text(status))


@dataclasses.dataclass
class FeedResult:
    source: str
    status: str           # ok | not_modified | unchanged | error | gone | deferred
    new_posts: int = 0
    error: str = None


# rss_state.status of a fetch that worked (last_error then holds a warning).
FETCHED = ("ok", "not_modified", "unchanged")


@dataclasses.dataclass
class Fetched:
    """What one feed fetch did: its status, new posts, the parser's warning,
    and how long the server asks to be left alone (seconds or None)."""
    status: str
    new: int = 0
    note: str = None
    fresh_for: int = None
    state: dict = dataclasses.field(default_factory=dict)    # rss_state to save
    drafts: list = ()                                         # posts to store


def fetch_feed(conn, source, settings, gate):
    """One conditional fetch of one feed, read and parsed; keep_fetched
    stores it."""
    state = load_rss_state(conn, source["id"])
    response = conditional_get(source, state, settings, gate)
    check_status(response)
    moved_to = response.moved_to or state.get("moved_to")
    validators = {"etag": response.headers.get("etag") or state.get("etag"),
                  "modified": response.headers.get("last-modified") or state.get("modified"),
                  "moved_to": moved_to, "http_status": response.status}
    # The same body keeps the parser's warning about it; an old error goes.
    warning = state.get("last_error") if state.get("status") in FETCHED else None
    cached = fresh_for(response.headers)
    if response.status == 304:
        return Fetched("not_modified", fresh_for=polite_wait(cached, state.get("ttl")),
                       state=dict(status="not_modified", last_error=warning, **validators))
    body_hash = hashlib.sha256(response.body).hexdigest()
    if body_hash == state.get("body_sha256"):
        return Fetched("unchanged", fresh_for=polite_wait(cached, state.get("ttl")),
                       state=dict(status="unchanged", last_error=warning, **validators))
    feed = parse_feed(response.body, response.url, settings.max_entries,
                      bool(state.get("keep_fragments")), response.headers.get("content-type"))
    if not feed.keep_fragments and fragments_seen_before(conn, source["id"], feed.drafts):
        feed = parse_feed(response.body, response.url, settings.max_entries, True,
                          response.headers.get("content-type"))
    return Fetched("ok", 0, feed.warning, polite_wait(cached, feed.ttl), drafts=feed.drafts,
                   state=dict(status="ok", last_error=feed.warning, body_sha256=body_hash,
                              last_build_date=feed.last_build_date,
                              keep_fragments=int(feed.keep_fragments), ttl=feed.ttl,
                              **validators))


def keep_fetched(conn, source, fetched):
    """Store a fetch's new posts and the feed's state, in the caller's
    transaction. Returns how many posts were new. A feed lists its newest
    entry first: stored last to first, its newest gets the highest id, and
    the desk, which breaks a tie of times by id, keeps the feed's order
    among entries of one time (all of a fetch's undated ones)."""
    fetched.new = insert_new_posts(conn, source["id"], source["direction"], fetched.drafts[::-1])
    save_rss_state(conn, source["id"], **fetched.state)
    return fetched.new


def polite_wait(cached, ttl):
    """The longer of what the cache headers and the feed's <ttl> ask for."""
    asked = [seconds for seconds in (cached, ttl) if seconds]
    return max(asked) if asked else None


def crawl_feed(db, source, settings, gate, trigger="cli"):
    """Fetch one RSS source and record the run and the source's health.
    Never raises for what a feed or its server did wrong."""
    conn = db.conn()
    run_id = start_run(conn, source["id"], "rss", trigger)
    try:
        fetched = fetch_feed(conn, source, settings, gate)
        record_fetched(conn, source, fetched, run_id, settings)
        if fetched.new:
            conn.process.posts_queued.set()
    except StorageError:
        raise
    except Exception as e:
        return record_not_fetched(conn, source, settings, run_id, e)
    log.info("source %s: %s, %d new posts%s", source["slug"], fetched.status.replace("_", " "),
             fetched.new, f"; next fetch in {duration_text(fetched.fresh_for)} at the earliest, "
             f"as the server asks" if fetched.fresh_for else "")
    return FeedResult(source["slug"], fetched.status, fetched.new)


@redoable
def record_fetched(conn, source, fetched, run_id, settings):
    """What a fetch brought, recorded in one go."""
    with transaction(conn):
        keep_fetched(conn, source, fetched)
        record_success(conn, source, fetched.new, fetched.fresh_for)
        finish_run(conn, run_id, "ok", fetched.new, fetched.note)
        refresh_figures(conn, source["id"], settings.min_relevance)


@redoable
def record_not_fetched(conn, source, settings, run_id, error):
    with transaction(conn):
        result = record_feed_failure(conn, source, settings, run_id, error)
        refresh_figures(conn, source["id"], settings.min_relevance)
    return result


def record_feed_failure(conn, source, settings, run_id, error):
    """A fetch that did not work, recorded on the source, its state and its
    run, in the caller's transaction."""
    if isinstance(error, (SourceDeferred, HostBusy)):
        record_deferral(conn, source, str(error), getattr(error, "seconds", 0))
        save_rss_state(conn, source["id"], status="deferred", last_error=str(error))
        finish_run(conn, run_id, "deferred", error=str(error))
        return FeedResult(source["slug"], "deferred", error=str(error))
    if isinstance(error, (FetchError, FeedError)):
        log.info("source %s: %s", source["slug"], error)
        gone = isinstance(error, SourceGone)
        record_failure(conn, source, str(error), settings.dead_after, dead_now=gone)
        save_rss_state(conn, source["id"], status="gone" if gone else "error",
                       last_error=str(error))
        finish_run(conn, run_id, "error", error=str(error))
        return FeedResult(source["slug"], "gone" if gone else "error", error=str(error))
    log.error("source %s: unexpected error", source["slug"], exc_info=error)
    message = f"internal error: {type(error).__name__}: {error}"
    record_failure(conn, source, message, settings.dead_after)
    finish_run(conn, run_id, "error", error=message)
    return FeedResult(source["slug"], "error", error=message)


def group_by_host(sources, url_of):
    """Sources in priority order, grouped by host in order of first appearance:
    one host's sources are fetched one after another, hosts in parallel."""
    groups = {}
    for source in sources:
        groups.setdefault(host_of(url_of(source)), []).append(source)
    return list(groups.values())


@dataclasses.dataclass
class CrawlSummary:
    results: list
    not_due: int = 0        # sources of the selection that asked to wait (select_sources)

    @property
    def new_posts(self):
        return sum(r.new_posts for r in self.results)

    def count(self, *statuses):
        return sum(r.status in statuses for r in self.results)

    def line(self, stop=None):
        """The run in one line; it says so when `stop` cut it short."""
        cut = "interrupted: " if stop is not None and stop.is_set() else ""
        sources = f"{len(self.results)} source{'' if len(self.results) == 1 else 's'}"
        waiting = f"; {self.not_due} more not due yet (see status)" if self.not_due else ""
        failed = [r.source for r in self.results if r.status in ("error", "gone")]
        named = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
        return (f"{cut}{sources} ({self.count('ok', 'not_modified', 'unchanged')} ok, "
                f"{self.count('deferred')} deferred, {len(failed)} failed"
                f"{f': {named}' if failed else ''}), "
                f"{self.new_posts} new post{'' if self.new_posts == 1 else 's'}{waiting}")


def crawl_rss(db, settings, selection=("all", None), trigger="cli", gate=None, quiet=False,
              stop=None, progress=None):
    """Phase 1 for feeds: every selected RSS source, hosts in parallel. Once
    `stop` is set no further source is started."""
    sources = select_sources(db.conn(), "rss", selection)
    not_due = len(select_sources(db.conn(), "rss", selection, due=False))
    gate = gate or HostGate(settings.host_delay)
    stop = stop or threading.Event()
    own_progress = progress is None
    progress = progress or Progress("rss", len(sources), "sources", quiet)
    moved = moved_feeds(db.conn())
    groups = group_by_host(sources, lambda s: moved.get(s["id"]) or s["url"])

    hosts_left = queue.SimpleQueue()
    for place, group in enumerate(groups):
        hosts_left.put((place, group))

    def crawl_lane():
        """Host after host until none is left, on one connection: opening
        one costs more than recording a feed."""
        crawled = []
        with db.closing():
            while not stop.is_set():
                try:
                    place, group = hosts_left.get_nowait()
                except queue.Empty:
                    break
                crawled.append((place, crawl_group(group)))
        return crawled

    def crawl_group(group):
        results = []
        for source in group:
            if stop.is_set():
                break
            try:
                results.append(crawl_feed(db, source, settings, gate, trigger))
            except StorageError:
                stop.set()      # no other source can be stored either
                raise
            progress.step(f"{source['slug']}: {results[-1].status}")
        return results

    lanes = max(1, min(settings.concurrency, len(groups)))
    with ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="rss") as pool:
        crawled = [pool.submit(crawl_lane) for _ in range(lanes)]
        results = [r for _, group in sorted(c for lane in crawled for c in lane.result())
                   for r in group]
    count_fetches(db.conn(), "rss", results)
    summary = CrawlSummary(results, not_due)
    if own_progress:
        progress.finish(summary.line(stop))
    return summary


###############################################################################
# Telegram ####################################################################
###############################################################################
# Reading channels through Telethon and crawling them.

# FloodWait up to this many seconds is waited out; a longer one defers the
# whole Telegram crawl (the limit is the account's, not one channel's).
FLOOD_WAIT_MAX = 60
# History requests in bulk: Telegram allows about 10 per 30 s (Telethon's docs),
# so a crawl makes at most HISTORY_BURST at once, then one every HISTORY_EVERY s.
HISTORY_BURST = 10
HISTORY_EVERY = 3.0
# Errors that mean the stored channel id and access hash no longer work.
PEER_INVALID = ("ChannelInvalidError", "PeerIdInvalidError", "ChannelIdInvalidError")
# Links to these hosts are other Telegram posts, not articles.
TELEGRAM_HOSTS = ("t.me", "telegram.me", "telegram.org", "www.t.me")
URL_IN_TEXT = re.compile(r"https?://[^\s<>\"'«»]+", re.IGNORECASE)


def session_path(settings):
    """Telethon adds '.session' to a session name that lacks it."""
    path = settings.tg_session
    return path if path.endswith(".session") else path + ".session"


def telegram_client(settings):
    """A Telethon client for the session on disk, or TelegramSetupError
    saying what is missing."""
    if not settings.tg_api_id or not settings.tg_api_hash:
        raise TelegramSetupError("TG_API_ID and TG_API_HASH are not set "
                                 "(get them at https://my.telegram.org)")
    if not digits_only(settings.tg_api_id):
        raise TelegramSetupError(f"TG_API_ID must be a number, got {settings.tg_api_id!r}")
    if not os.path.exists(session_path(settings)):
        raise TelegramSetupError(f"Telegram session {session_path(settings)} not found: "
                                 f"run `python vesti.py telegram --login` once")
    try:
        telethon = import_optional("telethon", "telethon", "Telegram sources")
    except MissingPackage as e:
        raise TelegramSetupError(str(e)) from None
    # FloodWait is handled here, the same way for every call.
    return telethon.TelegramClient(settings.tg_session, int(settings.tg_api_id),
                                   settings.tg_api_hash, flood_sleep_threshold=0)


def media_kind(message):
    """posts.content_type of a message: text, photo, video, audio, document, poll, …"""
    media = getattr(message, "media", None)
    kind = type(media).__name__ if media is not None else "MessageMediaEmpty"
    if kind in ("MessageMediaEmpty", "MessageMediaWebPage"):
        return "text"
    if kind == "MessageMediaPhoto":
        return "photo"
    if kind == "MessageMediaDocument":
        document = getattr(media, "document", None)
        mime = getattr(document, "mime_type", "") or ""
        attributes = {type(a).__name__ for a in getattr(document, "attributes", None) or []}
        if getattr(media, "video", None) or mime.startswith("video/") or \
                "DocumentAttributeVideo" in attributes:
            return "video"
        if getattr(media, "voice", None) or mime.startswith("audio/"):
            return "audio"
        return "document"
    if kind in ("MessageMediaGeo", "MessageMediaGeoLive", "MessageMediaVenue"):
        return "geo"
    return kind.removeprefix("MessageMedia").lower() or "text"


def is_service(message):
    return type(message).__name__ == "MessageService" or \
        getattr(message, "action", None) is not None


def forwarded_from(message):
    header = getattr(message, "fwd_from", None)
    if header is None:
        return None
    return getattr(header, "from_name", None) or getattr(header, "post_author", None) or "another chat"


def group_messages(messages):
    """Albums (messages sharing a grouped_id) become one group; service
    messages and messages with neither text nor media are dropped."""
    groups, albums = [], {}
    for message in messages:
        if is_service(message):
            continue
        album = getattr(message, "grouped_id", None)
        if album is not None:
            if album not in albums:
                albums[album] = []
                groups.append(albums[album])
            albums[album].append(message)
        elif (message.message or "").strip() or media_kind(message) != "text":
            groups.append([message])
    return groups


def message_link(group):
    """(url, title, description) of the article a message points to: its web
    page preview, else a link in its text; None when it carries none."""
    for message in group:
        page = getattr(getattr(message, "media", None), "webpage", None)
        url = getattr(page, "url", None)
        if url and is_article_link(url):
            return url, (getattr(page, "title", None) or "").strip(), \
                (getattr(page, "description", None) or "").strip()
    for message in group:
        links = [getattr(e, "url", None) for e in getattr(message, "entities", None) or []]
        links += URL_IN_TEXT.findall(message.message or "")
        for url in links:
            url = (url or "").rstrip(".,;:!?)")
            if url and is_article_link(url):
                return url, "", ""
    return None


def is_article_link(url):
    return urllib.parse.urlsplit(url).scheme in WEB_SCHEMES and \
        host_of(url) not in TELEGRAM_HOSTS and bool(host_of(url))


def message_draft(channel, group):
    """One post from a message or an album of messages. A short message
    that carries a link is a teaser: the link preview's title and
    description join its text, and its article is fetched in phase 3."""
    first = min(group, key=lambda m: m.id)
    text = "\n\n".join(m.message.strip() for m in sorted(group, key=lambda m: m.id)
                       if (m.message or "").strip())
    kind = "album" if len(group) > 1 else media_kind(first)
    link = message_link(group) if len(normalize_text(text)) < FULL_TEXT_MIN else None
    article_url = None
    if link:
        article_url, preview_title, description = link
        preview = "\n".join(part for part in (preview_title, description)
                            if part and part not in text)
        text = f"{text}\n\n{preview}".strip() if preview else text
        kind = "summary"
    source = forwarded_from(first)
    lead = text.split("\n", 1)[0].strip()
    title = shorten(lead, 120) if lead else f"[{kind}]"
    if source:
        title = f"Forwarded from {source}: {title}"
    url = f"https://t.me/{channel}/{first.id}"
    published = telegram_time(first.date)
    edited = max((m.edit_date for m in group if getattr(m, "edit_date", None)), default=None)
    return Draft(str(first.id), url, url, title, text, kind, published,
                 article_url=article_url, edited_at=telegram_time(edited),
                 words_sha256=words_sha256(without_bidi_controls(text), article_url))


def telegram_time(moment):
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") \
        if moment else None


def flood_wait_seconds(error):
    """Seconds of a Telethon FloodWaitError, else None."""
    if type(error).__name__.startswith("FloodWait"):
        return getattr(error, "seconds", None)
    return None


class Pacer:
    """At most `burst` requests at once, then one every `every` seconds: a
    token bucket, so a short crawl goes at full speed and a long one stays
    inside Telegram's limits."""

    def __init__(self, burst, every, sleep, clock=time.monotonic):
        self.burst, self.every, self.sleep, self.clock = burst, every, sleep, clock
        self.tokens, self.last = float(burst), clock()

    async def turn(self):
        now = max(self.clock(), self.last)
        self.tokens = min(self.burst, self.tokens + (now - self.last) / self.every)
        self.last = now
        if self.tokens < 1:
            wait = (1 - self.tokens) * self.every
            await self.sleep(wait)
            self.tokens, self.last = 1.0, now + wait
        self.tokens -= 1


class ChannelReader:
    """One crawl's view of Telegram: one connection for every channel,
    usernames resolved only when no id and access hash are kept, history
    requests paced, FloodWaits waited out when short."""

    def __init__(self, client, sleep, pacer):
        self.client, self.sleep, self.pacer = client, sleep, pacer
        self.telethon = import_optional("telethon", "telethon", "Telegram sources")
        self.reconnected = False

    async def call(self, request_of):
        """Run one request (built by request_of()), waiting out one short
        FloodWait and reconnecting once per crawl after a dropped connection."""
        for attempt in range(3):
            try:
                return await request_of()
            except ConnectionError as e:
                if self.reconnected:
                    raise TelegramDisconnected(f"connection to Telegram lost: {e}") from None
                self.reconnected = True
                log.warning("telegram: connection lost (%s); reconnecting once", e)
                try:
                    await self.client.connect()
                except Exception as again:
                    raise TelegramDisconnected(f"connection to Telegram lost: {again}") from None
            except Exception as e:
                seconds = flood_wait_seconds(e)
                if seconds is None:
                    raise
                if seconds > FLOOD_WAIT_MAX or attempt:
                    raise TelegramFlood(seconds) from None
                log.info("telegram: FloodWait %d s, waiting", seconds)
                await self.sleep(seconds)
                # Waited out: Telethon's own note of it must not refuse the retry.
                getattr(self.client, "_flood_waited_requests", {}).clear()
        raise TelegramDisconnected("connection to Telegram lost")

    async def resolve(self, channel):
        """(channel id, access hash) of a public channel: one API call."""
        functions, types = self.telethon.functions, self.telethon.types
        try:
            found = await self.call(lambda: self.client(
                functions.contacts.ResolveUsernameRequest(username=channel)))
        except Exception as e:
            if type(e).__name__ in ("UsernameNotOccupiedError", "UsernameInvalidError"):
                raise FetchError(f"@{channel}: no such channel") from None
            raise
        for chat in found.chats:
            if isinstance(chat, types.Channel) and chat.access_hash is not None:
                return chat.id, chat.access_hash
        raise FetchError(f"@{channel} is not a public channel")

    def peer(self, channel_id, access_hash):
        return self.telethon.types.InputPeerChannel(channel_id, access_hash)

    async def history(self, peer, **query):
        await self.pacer.turn()
        return await self.call(lambda: self._collect(peer, query))

    async def _collect(self, peer, query):
        return [m async for m in self.client.iter_messages(peer, **query)]


async def channel_messages(reader, peer, last_id, floor, limit):
    """Messages to look at, oldest first, and whether the batch may have cut
    an album at its oldest end. A first run takes the latest `limit`; later
    runs take what is newer than `floor` (the oldest post still open to
    edits) in one request, or, when more than a batch is new, the oldest new
    ones (the rest come next time)."""
    if not last_id:
        return sorted(await reader.history(peer, limit=limit), key=lambda m: m.id), True
    lower = last_id if floor is None else min(floor, last_id)
    latest = await reader.history(peer, min_id=lower, limit=limit)
    if len(latest) < limit or min(m.id for m in latest) <= last_id + 1:
        return sorted(latest, key=lambda m: m.id), len(latest) >= limit
    return await reader.history(peer, min_id=last_id, reverse=True, limit=limit), False


def whole_albums(messages, limit, first_run):
    """A full batch may cut an album in two. Going forward, an album at the
    newest end is held back for the next run (which starts before it); on a
    first run, an album at the oldest end is older history and is left out.
    Returns (messages, the newest id to remember)."""
    if len(messages) < limit or not messages:
        return messages, max((m.id for m in messages), default=0)
    newest = max(m.id for m in messages)
    oldest_album = getattr(messages[0], "grouped_id", None)
    newest_album = getattr(messages[-1], "grouped_id", None)
    if first_run and oldest_album and oldest_album != newest_album:
        return [m for m in messages if getattr(m, "grouped_id", None) != oldest_album], newest
    if not first_run and newest_album and oldest_album != newest_album:
        kept = [m for m in messages if getattr(m, "grouped_id", None) != newest_album]
        return kept, max(m.id for m in kept)
    return messages, newest


def describe_telegram_error(error):
    if isinstance(error, VestiError):
        return str(error)
    name = type(error).__name__
    return f"{name}: {error}" if str(error) else name


async def channel_peer(reader, conn, source, channel, resolve=False):
    """The channel's InputPeer from its kept id and access hash; resolved
    (one API call) only the first time, when the username in sources.yaml
    changed, or when Telegram said the kept peer is invalid."""
    state = load_tg_state(conn, source["id"])
    if not resolve and state.get("access_hash") is not None and \
            state.get("username") == channel.lower():
        return reader.peer(state["channel_id"], state["access_hash"])
    channel_id, access_hash = await reader.resolve(channel)
    save_channel_peer(conn, source["id"], channel_id, access_hash, channel.lower())
    return reader.peer(channel_id, access_hash)


async def read_channel(reader, conn, source, channel, last_id, floor, limit):
    peer = await channel_peer(reader, conn, source, channel)
    try:
        return await channel_messages(reader, peer, last_id, floor, limit)
    except Exception as e:
        if type(e).__name__ not in PEER_INVALID:
            raise
    log.info("telegram %s: the kept channel id is no longer valid; resolving again", channel)
    peer = await channel_peer(reader, conn, source, channel, resolve=True)
    return await channel_messages(reader, peer, last_id, floor, limit)


async def crawl_channel(db, reader, source, settings, trigger):
    """One channel into the queue (new posts, and edits of recent ones), with
    its run and health recorded. A long FloodWait or a lost connection is
    raised: they end the crawl of every channel."""
    conn = db.conn()
    run_id = start_run(conn, source["id"], "telegram", trigger)
    channel = channel_name(source["url"])
    last_id = last_message_id(conn, source["id"])
    floor = edit_floor(conn, source["id"], settings.tg_edit_hours)
    try:
        if channel is None:
            raise FetchError(f"{source['url']!r} does not name a public channel")
        messages, cut = await read_channel(reader, conn, source, channel, last_id, floor,
                                           settings.max_entries)
    except (TelegramFlood, TelegramDisconnected) as e:
        finish_run(conn, run_id, "deferred", error=str(e))
        raise
    except StorageError:
        raise
    except Exception as e:
        error = describe_telegram_error(e)
        # Telegram's own errors are the channel's; anything else is a bug here.
        expected = isinstance(e, VestiError) or type(e).__module__.startswith("telethon")
        log.log(logging.INFO if expected else logging.WARNING, "telegram %s: %s",
                source["slug"], error, exc_info=not expected)
        record_failure(conn, source, error, settings.dead_after)
        finish_run(conn, run_id, "error", error=error)
        return FeedResult(source["slug"], "error", error=error)
    messages, newest = whole_albums(messages, settings.max_entries, first_run=cut)
    groups = group_messages(messages)
    drafts = [message_draft(channel, g) for g in groups if min(m.id for m in g) > last_id]
    new = store_posts(conn, source["id"], source["direction"], drafts)
    if new:
        conn.process.posts_queued.set()
    edits = [message_draft(channel, g) for g in groups
             if min(m.id for m in g) <= last_id and edited_in_window(g, settings.tg_edit_hours)]
    edited = update_edited_posts(conn, source["id"], edits)
    save_last_message_id(conn, source["id"], max(newest, last_id))
    record_success(conn, source, new)
    note = f"{edited} edited posts updated" if edited else None
    finish_run(conn, run_id, "ok", new, note)
    refresh_figures(conn, source["id"], settings.min_relevance)
    log.info("telegram %s: %d new posts%s", source["slug"], new, f", {note}" if note else "")
    return FeedResult(source["slug"], "ok", new)


def edited_in_window(group, hours):
    """True when a message of the group was edited within `hours` of posting."""
    return any(m.edit_date and m.date and m.edit_date - m.date <= datetime.timedelta(hours=hours)
               for m in group if getattr(m, "edit_date", None))


def record_setup_error(db, sources, error, trigger):
    """Telegram cannot run at all: say so on every Telegram source, without
    counting it against the sources themselves."""
    conn = db.conn()
    for source in sources:
        run_id = start_run(conn, source["id"], "telegram", trigger)
        record_problem(conn, source, error)
        finish_run(conn, run_id, "error", error=error)
    return [FeedResult(s["slug"], "error", error=error) for s in sources]


async def crawl_channels(db, settings, sources, trigger, client_factory, sleep, progress, stop):
    try:
        client = client_factory(settings)
        await client.connect()
    except Exception as e:
        return record_setup_error(db, sources, describe_telegram_error(e), trigger)
    try:
        if not await client.is_user_authorized():
            return record_setup_error(db, sources, "the Telegram session is not logged in: run "
                                      "`python vesti.py telegram --login`", trigger)
        reader = ChannelReader(client, sleep, Pacer(HISTORY_BURST, HISTORY_EVERY, sleep))
        results = []
        for number, source in enumerate(sources):
            if stop.is_set():
                break
            try:
                results.append(await crawl_channel(db, reader, source, settings, trigger))
            except TelegramFlood as e:
                until = defer_telegram(db.conn(), e.seconds)
                log.warning("telegram: FloodWait of %d s; every channel waits until %s UTC",
                            e.seconds, until)
                return results + [FeedResult(s["slug"], "deferred", error=str(e))
                                  for s in sources[number:]]
            except TelegramDisconnected as e:
                log.warning("telegram: %s; the other channels wait for the next crawl", e)
                rest = sources[number:]
                for s in rest:
                    record_problem(db.conn(), s, str(e))
                return results + [FeedResult(s["slug"], "error", error=str(e)) for s in rest]
            progress.step(f"{source['slug']}: {results[-1].status}")
        return results
    finally:
        await client.disconnect()


def crawl_telegram(db, settings, selection=("all", None), trigger="cli", client_factory=None,
                   sleep=None, quiet=False, stop=None, progress=None):
    """Phase 1 for Telegram channels, one after another through one session."""
    sources = select_sources(db.conn(), "telegram", selection)
    not_due = len(select_sources(db.conn(), "telegram", selection, due=False))
    own_progress = progress is None
    progress = progress or Progress("telegram", len(sources), "sources", quiet)
    results = []
    if sources:
        import asyncio      # here: its import costs every other command 35 ms
        results = asyncio.run(crawl_channels(db, settings, sources, trigger,
                                             client_factory or telegram_client,
                                             sleep or asyncio.sleep, progress,
                                             stop or threading.Event()))
        count_fetches(db.conn(), "telegram", results)
    summary = CrawlSummary(results, not_due)
    if own_progress:
        progress.finish(summary.line(stop))
    return summary


def telegram_login(settings):
    """Interactive login that writes the session file."""
    if not settings.tg_api_id or not settings.tg_api_hash:
        raise ConfigError("set TG_API_ID and TG_API_HASH first (https://my.telegram.org → "
                          "API development tools), in the environment or in .env")
    telethon = import_optional("telethon", "telethon", "Telegram sources")
    print(f"Logging in to Telegram; the session will be saved to {session_path(settings)}.\n"
          "Telegram asks for your phone number (international format, e.g. +7…), then for\n"
          "the code it sends to your Telegram app, and your 2FA password if you have one.")

    async def login():
        client = telethon.TelegramClient(settings.tg_session, int(settings.tg_api_id),
                                         settings.tg_api_hash)
        await client.start()
        me = await client.get_me()
        await client.disconnect()
        return me

    import asyncio
    me = asyncio.run(login())
    print(f"Logged in as {getattr(me, 'username', None) or getattr(me, 'first_name', 'you')}; "
          f"session saved to {session_path(settings)}. Keep that file private.")


###############################################################################
# Crawling ####################################################################
###############################################################################
# Every source of a selection crawled once.

def crawl_everything(db, settings, selection=("all", None), trigger="cli", quiet=False,
                     client_factory=None, gate=None, stop=None):
    """Phase 1: RSS and Telegram sources at once, each in priority order."""
    total = len(select_sources(db.conn(), None, selection))
    progress = Progress("crawl", total, "sources", quiet)
    result = {"telegram": CrawlSummary([])}

    def crawl_channels_aside():
        try:
            with db.closing():
                result["telegram"] = crawl_telegram(db, settings, selection, trigger,
                                                    client_factory, stop=stop, progress=progress)
        except StorageError as e:
            result["failure"] = e
        except Exception:
            log.exception("the Telegram crawl failed")
    channels = threading.Thread(target=crawl_channels_aside, name="telegram")
    channels.start()
    try:
        feeds = crawl_rss(db, settings, selection, trigger, gate, stop=stop, progress=progress)
    finally:
        channels.join()
    if "failure" in result:
        raise result["failure"]
    summary = CrawlSummary(feeds.results + result["telegram"].results,
                           feeds.not_due + result["telegram"].not_due)
    progress.finish(summary.line(stop))
    return summary


###############################################################################
# Classification ##############################################################
###############################################################################
# Keywords, Ollama's answers, articles' full text.

class KeywordIndex:
    """Whole-word, case-insensitive keyword matching per direction. A keyword
    ending in '*' matches any ending (ядр* finds ядро, ядра, ядром); words
    of a keyword of several match across any white space, a line break too."""

    def __init__(self, directions):
        self.patterns = {}
        for direction in directions.values():
            words = [self._pattern(k) for k in direction.keywords]
            if words:
                self.patterns[direction.id] = re.compile(
                    r"(?<!\w)(?:" + "|".join(words) + r")(?!\w)", re.IGNORECASE)

    @staticmethod
    def _pattern(keyword):
        stem = keyword.endswith("*")
        words = keyword.rstrip("*").split()
        return r"\s+".join(map(re.escape, words)) + (r"\w*" if stem else "")

    def matches(self, text):
        """{direction: the distinct words found, sorted}, best first: the
        direction with most. Each form of a stem counts (a text that says
        фильм, фильма and фильме is about films more than one that says
        фильм once); a keyword of several words counts once however the
        text breaks its lines."""
        found = {}
        for direction, pattern in self.patterns.items():
            words = sorted({" ".join(m.split()).casefold() for m in pattern.findall(text)})
            if words:
                found[direction] = words
        return dict(sorted(found.items(), key=lambda item: -len(item[1])))


def lead_summary(text, limit=300):
    """The first sentences of a text, at most `limit` characters."""
    text = normalize_text((text or "")[: limit * 2])
    sentences = re.split(r"(?<=[.!?…])\s+", text)
    summary = ""
    for sentence in sentences:
        if summary and len(summary) + len(sentence) + 1 > limit:
            break
        summary = f"{summary} {sentence}".strip()
    return shorten(summary, limit)


def keyword_verdict(title, text, matches):
    """What keywords alone can say: the direction with most distinct words
    found (see KeywordIndex.matches), relevance and interest growing with
    their number, and the words."""
    if not matches:
        return Verdict(summary=lead_summary(text or title))
    direction, words = next(iter(matches.items()))
    count = len(words)
    return Verdict(direction=direction, relevance=min(10, 2 + 2 * count),
                   interest=min(10, 2 + count), summary=lead_summary(text or title),
                   keywords=matched_keywords(matches))


def matched_keywords(matches):
    """posts.keywords: the words that matched, each once, best direction first."""
    words = [w for found in matches.values() for w in found]
    return ", ".join(dict.fromkeys(words)) or None


OLLAMA_SYSTEM_PROMPT = """\
You screen news for the editors of a news channel. Read the post and answer in
JSON: "direction" is the id of the topic it belongs to (one of: {ids}) or null
if none fits; "relevance" (0-10) is how well it fits that topic; "interest"
(0-10) is how interesting it is for the channel's readers; "summary" is one or
two sentences in the language of the post; "reason" is one short line saying
why it scored so.
Topics:
{topics}"""


OLLAMA_EXAMPLES = ("The editors' past decisions on posts most like this one (titles), "
                   "to judge its relevance as they would:")


def ollama_request(title, text, directions, settings, examples=()):
    """The /api/chat body: the contract's shape, with a JSON schema whose
    direction enum lists the direction ids, and the editors' past decisions
    most like the post ([(title, decision)]), when there are any."""
    ids = list(directions)
    schema = {"type": "object", "required": ["direction", "relevance", "interest", "summary"],
              "properties": {
                  "direction": {"type": ["string", "null"], "enum": [*ids, None]},
                  "relevance": {"type": "integer", "minimum": 0, "maximum": 10},
                  "interest": {"type": "integer", "minimum": 0, "maximum": 10},
                  "summary": {"type": "string"},
                  "reason": {"type": "string"}}}
    topics = "\n".join(f"- {d.id}: {d.title} ({', '.join(d.keywords)})"
                       for d in directions.values())
    return {"model": settings.ollama_model, "stream": False, "format": schema,
            "options": {"temperature": 0},
            "messages": [
                {"role": "system", "content": OLLAMA_SYSTEM_PROMPT.format(
                    ids=", ".join(ids), topics=topics)},
                *([{"role": "system", "content": OLLAMA_EXAMPLES + "".join(
                    f"\n- {decision}: {example}" for example, decision in examples)}]
                  if examples else []),
                {"role": "user", "content": f"{title}\n\n{shorten(text, 6000)}".strip()}]}


def ollama_connection(lines, parts, timeout, fresh=False):
    """(this thread's connection to the server of `parts`, kept in `lines`
    (Process.ollama_lines), whether it carried a question before)."""
    server = (parts.scheme, parts.netloc)
    kept = getattr(lines, "kept", None)
    if kept is not None and kept[0] == server and not fresh:
        kept[1].timeout = timeout
        if kept[1].sock is not None:
            kept[1].sock.settimeout(timeout)
        return kept[1], True
    close_ollama_connection(lines)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout)
    lines.kept = (server, connection)
    return connection, False


def close_ollama_connection(lines):
    """Close this thread's connection to Ollama, if it kept one in `lines`."""
    kept = getattr(lines, "kept", None)
    lines.kept = None
    if kept is not None:
        kept[1].close()


def post_json(url, payload, timeout, process=None):
    """POST JSON, return the decoded JSON answer. Connection failures raise
    OllamaUnreachable, anything else ClassifyError. A kept connection the
    server closed meanwhile is replaced once, the question asked again.
    The connection is kept for the thread's next question in `process`; with
    none, it is closed after this one."""
    if process is None:
        lines = threading.local()
        try:
            return post_json_on(lines, url, payload, timeout)
        finally:
            close_ollama_connection(lines)
    return post_json_on(process.ollama_lines, url, payload, timeout)


def post_json_on(lines, url, payload, timeout):
    """post_json on the connection kept in `lines`."""
    parts = urllib.parse.urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    body = json.dumps(payload).encode("utf-8")
    for fresh in (False, True):
        connection, reused = ollama_connection(lines, parts, timeout, fresh)
        try:
            connection.request("POST", target, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            answer = response.read()
        except (OSError, http.client.HTTPException) as e:
            close_ollama_connection(lines)
            if reused and isinstance(e, ConnectionError):
                continue
            if isinstance(e, (socket.timeout, TimeoutError)):
                raise ClassifyError(f"Ollama did not answer within {timeout:g} s") from None
            raise OllamaUnreachable(f"Ollama unreachable at {url}: {describe_error(e)}") from None
        if response.will_close:
            close_ollama_connection(lines)
        break
    if response.status >= 300:
        detail = shorten(answer[:300].decode("utf-8", "replace").strip(), 200)
        raise ClassifyError(f"Ollama answered HTTP {response.status}: {detail}")
    try:
        return json.loads(answer)
    except ValueError:
        raise ClassifyError(f"Ollama answered with no JSON: {shorten(answer.decode('utf-8', 'replace'), 200)!r}") from None


def _score(reply, key):
    value = reply.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10:
        raise ClassifyError(f"Ollama gave {key}={value!r}, expected an integer 0-10")
    return value


def parse_verdict(answer, directions):
    """Validate Ollama's reply: message.content must be the JSON object the
    schema asks for."""
    try:
        reply = json.loads(answer["message"]["content"])
    except (KeyError, TypeError, ValueError):
        raise ClassifyError(f"Ollama's reply is not a JSON verdict: {shorten(str(answer), 200)!r}") from None
    if not isinstance(reply, dict):
        raise ClassifyError(f"Ollama's verdict is not an object: {shorten(str(reply), 200)!r}")
    direction = reply.get("direction")
    if direction is not None and direction not in directions:
        raise ClassifyError(f"Ollama gave an unknown direction {direction!r}")
    summary = reply.get("summary")
    if not isinstance(summary, str):
        raise ClassifyError(f"Ollama gave no summary: {shorten(str(reply), 200)!r}")
    reason = reply.get("reason")
    return Verdict(direction=direction, relevance=_score(reply, "relevance"),
                   interest=_score(reply, "interest"), summary=summary.strip(),
                   reason=shorten(reason.strip(), 300)
                   if isinstance(reason, str) and reason.strip() else None)


def ask_ollama(title, text, directions, settings, examples=(), process=None):
    answer = post_json(f"{settings.ollama_url}/api/chat",
                       ollama_request(title, text, directions, settings, examples),
                       settings.ollama_timeout, process)
    return parse_verdict(answer, directions)


def classify_text(text, directions, settings, title="", keywords=None, matches=None, examples=(),
                  process=None):
    """The text's Verdict. Keywords first (title and text): no hit means not
    relevant, and no LLM call. Then Ollama, or with OLLAMA_URL empty the
    keywords alone decide. `matches`: the keywords' matches, when the caller
    has them already; `examples`: past decisions to show the LLM; `process`:
    whose threads keep their connection to Ollama."""
    if matches is None:
        matches = (keywords or KeywordIndex(directions)).matches(f"{title}\n{text}")
    if not matches or not settings.ollama_url:
        return keyword_verdict(title, text, matches)
    started = time.monotonic()
    verdict = ask_ollama(title, text, directions, settings, examples, process)
    return dataclasses.replace(verdict, keywords=matched_keywords(matches),
                               llm_seconds=time.monotonic() - started)


def extract_article(html_bytes, url, process=None):
    """The article's main text from its page, or None; one extraction at a
    time among the threads of `process` (see Process.extracting)."""
    trafilatura = import_optional("trafilatura", "trafilatura", "full-text extraction")
    with process.extracting if process else contextlib.nullcontext():
        return trafilatura.extract(html_bytes, url=url, include_comments=False,
                                   include_tables=False, favor_precision=True)


def fetch_full_text(url, summary, settings, gate, home="", process=None):
    """The full text of a summary-only post, or None (the summary stands)
    when the page cannot be fetched or read. `home` is the source's URL: only
    its host may be a loopback or private address. A busy article host is
    waited for no longer than one request may take."""
    patience = min(3 * settings.timeout, settings.host_delay + settings.timeout)
    try:
        response = http_get(url, settings, {"Accept": "text/html,*/*;q=0.5"}, gate, home=home,
                            patience=patience)
        if response.status != 200:
            raise FetchError(f"HTTP {response.status}")
        text = extract_article(response.body, response.url, process)
    except FetchError as e:
        log.info("full text of %s: %s; using the summary", url, e)
        return None
    except MissingPackage as e:
        (process or Process()).warn_once(
            "trafilatura", "%s; posts are classified on their feed's summary", e)
        return None
    except Exception:
        log.warning("full text of %s: extraction failed; using the summary", url, exc_info=True)
        return None
    if not text or len(normalize_text(text)) <= len(normalize_text(summary)):
        return None
    return text.strip()


###############################################################################
# Worker ######################################################################
###############################################################################
# The pool of workers: what to classify how, claims, completions.

# Consecutive connection failures after which workers stop asking Ollama.
OLLAMA_DOWN_AFTER = 3
# With --forever, how long workers wait before asking an unreachable Ollama again.
OLLAMA_PAUSE = 60
# How often workers leave a sign of life for the page (meta 'worker_seen').
HEARTBEAT = 10
# A worker whose posts classify fast (keywords alone) claims them in batches
# and writes their verdicts with the next claim, one transaction for many
# posts: the batch doubles while a whole batch takes less than BATCH_WINDOW
# seconds, up to MAX_BATCH, halves when it takes longer, and is one post
# again as soon as one is slow (an article, the LLM) or fails. Claims are
# never held long for nothing. Big batches matter with stories: a commit
# writes each index page its posts' story keys touched, once per batch
# (measured with 50,000 posts: about 2,300 posts/s with batches of 128,
# 3,900 with 1,024; no more with bigger ones).
BATCH_WINDOW = 0.25
MAX_BATCH = 1024


# How often workers look whether the stories their waiting copies wait for
# have their verdict (see WorkerPool.wake_copies).
STORY_POLL = 0.2
# A worker that found nothing to claim looks again after WorkerPool.idle_wait
# seconds, or within IDLE_LOOK of a crawl of its own process queueing posts.
IDLE_LOOK = 0.1


def usable_cores():
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class ClassifyStep:
    """What a worker pool asks of the step that classifies its posts: to
    prepare each, and what more a step may do for the pool, answered here
    for a step that does no more (each post is quick, and all its work
    holds the worker)."""

    def __call__(self, post):
        """The post's Verdict, the LLM asked when it must be."""
        verdict = self.prepare(post)
        return verdict() if callable(verdict) else verdict

    def prepare(self, post):
        """The post's Verdict, or a function that asks the LLM for it (the
        worker asks it while it writes and claims)."""
        raise NotImplementedError

    def quick(self, post):
        """True when the post's verdict needs no network: its batch may grow."""
        return True

    def holds(self, post):
        """True when preparing the post waits on the network: the rest of
        its batch goes back to the queue rather than wait."""
        return True

    def busy_hosts(self):
        """Tiers of article hosts a claim passes over now (pass_over_busy_hosts)."""
        return ()

    def look_ahead(self, posts):
        """A batch was claimed: its posts are prepared one by one next."""

    def forget(self, posts):
        """Posts given back before they were classified."""

    def close(self):
        """The workers are done."""


class ClassifyFunction(ClassifyStep):
    """A function of a post to what prepare returns, as a ClassifyStep."""

    def __init__(self, function):
        self.function = function

    def prepare(self, post):
        return self.function(post)


class Classifier(ClassifyStep):
    """classify_text for a claimed post, with the article fetched first for
    summary-only posts. Workers call it in two steps: prepare (the article,
    the keywords, the post's story), then, for a post the LLM decides, the
    question it returns, asked while the worker writes and claims."""

    def __init__(self, registry, settings, gate=None, db=None):
        self.settings = settings
        self.gate = gate or HostGate(settings.host_delay)
        self.db = db        # with a database, posts are looked up in their stories
        self.process = db.process if db is not None else None
        self.use(registry)
        self.helper, self.cores = KeyHelper(), usable_cores()
        self.ahead = {}     # post id: (the Future of its keys, its place in the answer)
        self.learners = Learners(settings.learn_min)

    def use(self, registry):
        """Classify with these directions from now on (sources.yaml changed)."""
        self.vocabulary = (registry.directions, KeywordIndex(registry.directions))

    def prepare(self, post):
        """The post's Verdict, or a function that asks the LLM for it."""
        directions, keywords = self.vocabulary
        # Its story keys, when they were asked for ahead.
        asked = self.ahead.pop(post.id, None) if self.ahead else None
        full_text = self.article(post)
        text = full_text or post.text
        matches = keywords.matches(f"{post.title}\n{text}")
        learners = self.learned()
        features = post_features(post.title, text, post.source_id, post.id) if learners else None
        if not matches and learners:
            # A post the keywords missed but a direction's model wants is
            # classified as that direction's keyword hit would be.
            wanted = learners.wanted(features)
            if wanted:
                matches = {wanted[0]: []}
        entry, leads = None, None
        # No story for a post that is not relevant (no LLM call to save, no
        # card on the desk to merge), nor with stories off, nor for one
        # edited after a decision: it is a card of its own until decided again.
        if matches and self.db is not None and self.settings.story_hours and \
                not post.old_decision:
            story = StoryEntry(post.id, post.title, text, self.keys_of(post, full_text, asked),
                               story_since(self.settings.story_hours))
            if not self.settings.ollama_url:
                # Keywords alone decide: the story is entered as the verdict is written.
                entry = story
            else:
                copied = self.story_verdict(post, full_text, story)
                if copied is not None:
                    return copied
                leads = post.id

        def verdict():
            examples = learners.examples(self.db.conn(), next(iter(matches)), features) \
                if learners and matches and self.settings.ollama_url else ()
            found = classify_text(text, directions, self.settings, post.title, matches=matches,
                                  examples=examples, process=self.process)
            return dataclasses.replace(
                found, text=full_text, story_entry=entry, story=leads,
                likely=learners.likely(found.direction, features, keyword_count(found.keywords))
                if learners else None)
        return verdict if matches and self.settings.ollama_url else verdict()

    def learned(self):
        """The directions' learned models, when any direction has one."""
        if self.db is None:
            return None
        learners = self.learners.refresh(self.db.conn())
        return learners if learners.models else None

    def look_ahead(self, posts):
        """Have the helper work out the story keys of a batch of quick posts
        while the worker classifies them (see KeyHelper.batch): of every
        one of them, since telling the relevant ones would cost the worker
        the keyword matching twice, and the helper's core is otherwise idle."""
        if self.db is None or not self.settings.story_hours or self.settings.ollama_url:
            return
        posts = [post for post in posts if not article_link(post)]
        if len(posts) < KeyHelper.batch or self.cores < 2:
            return
        for first in range(0, len(posts), KEY_HELPER_CHUNK):
            chunk = posts[first:first + KEY_HELPER_CHUNK]
            future = self.helper.ask([(post.title, post.text) for post in chunk])
            self.ahead.update((post.id, (future, place)) for place, post in enumerate(chunk))

    def keys_of(self, post, full_text, asked):
        """The story keys of the post: the helper's, when they were `asked`
        for ahead (of its own text: no article was fetched for it since)."""
        if asked is not None and full_text is None:
            future, place = asked
            try:
                return future.result(timeout=KEY_HELPER_WAIT)[place]
            except HelperGone:
                pass
            except FutureTimeout:
                self.helper.give_up(f"the helper process for story keys did not answer "
                                    f"in {KEY_HELPER_WAIT} s")
                self.helper.close()
        return story_keys(story_words(post.title, full_text or post.text))

    def forget(self, posts):
        """Posts given back before they were classified."""
        for post in posts:
            self.ahead.pop(post.id, None)

    def close(self):
        """Stop the helper; a later batch starts another."""
        helper, self.helper = self.helper, KeyHelper()
        helper.close()
        self.ahead.clear()

    def article(self, post):
        """The full text of a summary-only post's article, or None."""
        link = article_link(post)
        if not link:
            return None
        home = post.source_url
        return without_bidi_controls(fetch_full_text(link, post.text, self.settings, self.gate,
                                                     home or "", self.process))

    def story_verdict(self, post, full_text, story):
        """Before an LLM call: the post enters its story at once (a copy met
        at the same moment finds it), and takes the story's verdict when there
        is one; StoryPending while the story's first post is classified."""
        conn = self.db.conn()
        joined = enter_now(conn, story)
        if joined == post.id:
            return None
        try:
            found = story_verdict(conn, joined)
            lead_now(conn, joined, post.id, found)
        except StoryPending as e:
            e.text = full_text          # kept, so the article is not fetched again
            raise
        if found is None:
            return None
        # No story to write with it: the copy's row names the story's lead
        # (see enter_stories), whoever leads it by then.
        return dataclasses.replace(found, text=full_text, joined=True, llm_saved=True)

    def quick(self, post):
        """True when the post's verdict needs no network: no article to
        fetch, and the keywords alone decide."""
        if article_link(post):
            return False
        directions, keywords = self.vocabulary
        return not self.settings.ollama_url or not keywords.matches(f"{post.title}\n{post.text}")

    def holds(self, post):
        """True when preparing the post waits on the network (its article)."""
        return article_link(post) is not None

    def busy_hosts(self):
        """The hosts an article fetch would wait for now (one request at a
        time per host, RSS_HOST_DELAY apart), for claim_posts: those resting
        are passed over while other posts can be had, those taken by another
        worker even longer."""
        taken, resting = self.gate.unavailable()
        return [taken | resting, taken]


def article_link(post):
    """The page whose full text a summary-only post is classified on, or None."""
    if post.content_type != "summary":
        return None
    return post.article_url or post.url


@dataclasses.dataclass
class WorkerStats:
    done: int = 0
    returned: int = 0
    failed: int = 0
    lost: int = 0           # claims taken back by a lease before we could write
    ollama_down: str = None

    @property
    def processed(self):
        return self.done + self.returned + self.failed + self.lost

    def since(self, earlier):
        """What was done after `earlier` (a copy of these figures)."""
        return WorkerStats(self.done - earlier.done, self.returned - earlier.returned,
                           self.failed - earlier.failed, self.lost - earlier.lost)

    def line(self):
        lost = f", {self.lost} taken back by the lease or an edit" if self.lost else ""
        return (f"{self.processed} processed ({self.done} done, {self.returned} returned "
                f"to the queue, {self.failed} failed{lost})")


class WorkerPool:
    """Phase 3: N workers (see Worker) and what they share: the tickets of
    --limit, the figures, what they know of Ollama, the LLM questions asked
    in the background. Posts are classified outside any transaction, and a
    verdict is written only if its claim holds."""
    # Workers that run on (`run`, `worker --forever`) say on the console what
    # they did: when nothing is left to claim after some work, and every
    # `report_every` seconds while they keep working.
    report_every = 60
    idle_wait = 1.0             # seconds an idle worker waits (see IDLE_LOOK)

    def __init__(self, db, settings, classify, stop=None, progress=None, report=False):
        self.db, self.settings = db, settings
        self.classify = (classify if isinstance(classify, ClassifyStep)
                         else ClassifyFunction(classify))
        self.stop = stop or threading.Event()
        self.progress = progress
        self.stats = WorkerStats()
        self.report = report        # say on the console what was done (report_every)
        self.said, self.said_at = WorkerStats(), time.monotonic()
        self.lock = threading.Lock()
        self.tickets = None
        self.held = 0
        self.said_dry = True        # no spell of work under way: none yet, or the last line
        #                             said nothing was left to claim
        self.claiming = 0
        self.connection_failures = 0
        self.paused_until = 0.0
        self.last_expiry = 0.0
        self.last_heartbeat = -math.inf
        self.down_noted = True      # the page may say Ollama is down (see note_written)
        self.story_waits = {}       # copy put back to wait for its story: until when
        self.next_wake = 0.0

    def run(self, workers, limit=None, forever=False):
        self.tickets = limit
        self.housekeeping()
        try:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="worker") as pool:
                futures = [pool.submit(self.work, forever) for _ in range(workers)]
                for future in futures:
                    future.result()
        finally:
            self.classify.close()
        return self.stats

    def housekeeping(self):
        """Take back expired leases, and count and index the posts stored
        since last time, so completions are counted as they happen."""
        catch_up_index(self.db.conn())
        pending, failed = expire_leases(self.db.conn(), self.settings.lease_seconds,
                                        self.settings.max_attempts)
        self.last_expiry = time.monotonic()
        if pending or failed:
            log.warning("took back %d posts whose worker died (%d of them out of attempts)",
                        pending + failed, failed)

    def take_tickets(self, wanted):
        """How many of `wanted` posts may still be claimed (--limit)."""
        with self.lock:
            if self.tickets is None:
                return wanted
            granted = min(wanted, self.tickets)
            self.tickets -= granted
            return granted

    def give_back_tickets(self, unused):
        with self.lock:
            if self.tickets is not None:
                self.tickets += unused

    def work(self, forever):
        with self.db.closing():
            try:
                Worker(self, self.db.conn()).run(forever)
            except StorageError:
                self.stop.set()     # no other worker can write either
                raise

    def choose_claims(self):
        """How a claim chooses its posts now (see pass_over_busy_hosts), or
        None to take the oldest: no article host is busy."""
        tiers = self.classify.busy_hosts()
        return functools.partial(pass_over_busy_hosts, tiers) if any(tiers) else None

    def hold(self, in_hand, posts):
        """Take claimed posts in hand; self.held counts the posts held by
        every worker and not yet begun, which may still go back to the queue."""
        with self.lock:
            self.held += len(posts)
            in_hand.extend(posts)

    def next_post(self, in_hand):
        with self.lock:
            self.held -= 1
            return in_hand.popleft()

    def put_down(self, conn, finished, in_hand):
        """Write the verdicts in hand and give back the posts not yet
        classified (their attempt uncounted)."""
        if finished:
            self.take_turn(conn, finished, 0)
        if in_hand:
            give_back_posts(conn, [post.claim_token for post in in_hand])
            self.classify.forget(in_hand)
            with self.lock:
                self.held -= len(in_hand)
            in_hand.clear()

    def take_turn(self, conn, finished, wanted):
        """Write the finished verdicts and claim up to `wanted` posts, in one
        transaction; counted while it runs, so a stop can wait for claims
        still blocked on the database. Posts that land after a stop are
        given back at once."""
        with self.lock:
            if self.stop.is_set():
                wanted = 0
            self.claiming += 1
        try:
            written, posts = complete_and_claim(conn, finished, wanted,
                                                token=conn.process.claim_token(),
                                                choose=self.choose_claims() if wanted else None)
        finally:
            with self.lock:
                self.claiming -= 1
        for (post, verdict), ok in zip(finished, written):
            self.note_written(conn, post, verdict, ok)
        if posts:
            self.spell_begins()
        if posts and self.stop.is_set():
            give_back_posts(conn, [post.claim_token for post in posts])
            return []
        return posts

    def may_claim(self, forever):
        """False once Ollama is down (for a one-off run); with --forever, wait
        and try again, and take back expired leases now and then."""
        if forever and self.lease_check_due():
            self.housekeeping()
        self.heartbeat()
        self.say_done(dry=False)
        while self.stats.ollama_down:
            if not forever:
                return False
            wait = self.paused_until - time.monotonic()
            if wait <= 0:
                with self.lock:
                    self.stats.ollama_down, self.connection_failures = None, 0
                break
            if self.stop.wait(min(wait, 1.0)):
                return False
        return True

    def wake_copies(self, conn):
        """Copies this pool put back to wait for their story's verdict are
        claimable as soon as it is there, not STORY_WAIT seconds later;
        looked at every STORY_POLL seconds while some wait."""
        if not self.copies_waiting() or time.monotonic() < self.next_wake:
            return
        with self.lock:
            self.next_wake = time.monotonic() + STORY_POLL
            waiting = list(self.story_waits)
        woken = wake_story_copies(conn, waiting)
        with self.lock:
            for post_id in woken:
                self.story_waits.pop(post_id, None)

    def copies_waiting(self):
        """True while a copy this pool put back still waits for its story
        (at most as long as one LLM call may take; one that another process
        took meanwhile is forgotten then): a one-off run finishes them
        before it exits."""
        now = time.monotonic()
        with self.lock:
            self.story_waits = {post_id: until for post_id, until in self.story_waits.items()
                                if until > now}
            return bool(self.story_waits)

    def say_done(self, dry, stopping=False):
        """With `report`: a console line of what the workers did since the
        last one, once nothing is left to claim (`dry`), after report_every
        seconds of work, or as they stop (`stopping`): the console accounts
        for every post. The queue is looked up before the posts are taken
        into a line, and the line is said as they are: a worker that a stop
        leaves behind in the look-up (past the grace, `run` exits without
        it) has taken none, and the stop's line says them."""
        if dry:
            with self.lock:
                if not self.stats.since(self.said).processed:
                    self.said_dry = True        # idle, with nothing to say (see spell_begins)
        if not self.spell_due(dry or stopping):
            return
        waiting = 0 if dry else pending_count(self.db.conn())
        with self.lock:
            done = self.stats.since(self.said)
            if not done.processed:
                return              # another worker said them meanwhile
            now = time.monotonic()
            seconds, self.said, self.said_at = now - self.said_at, dataclasses.replace(self.stats), now
            left = f"{waiting} waiting" if waiting else "nothing left to claim"
            self.said_dry = not waiting
            print(f"worker: {done.line()} in {seconds:.1f} s; {left}", flush=True)

    def spell_begins(self):
        """Posts were claimed: after a line that said nothing was left to
        claim, a spell of work begins now, so that its line counts the
        work's seconds, not the idle ones before it."""
        with self.lock:
            if self.said_dry:
                self.said_at, self.said_dry = time.monotonic(), False

    def spell_due(self, at_once):
        """Whether posts done are to be said now: `at_once`, or after
        report_every seconds of work."""
        with self.lock:
            return self.report and self.stats.since(self.said).processed > 0 and (
                at_once or time.monotonic() - self.said_at >= self.report_every)

    def heartbeat(self):
        """Tell the page, every HEARTBEAT seconds, that workers are running and
        how they classify."""
        with self.lock:
            if time.monotonic() - self.last_heartbeat < HEARTBEAT:
                return
            self.last_heartbeat = time.monotonic()
            self.down_noted = True      # by another machine's workers, maybe
        conn = self.db.conn()
        set_meta(conn, "worker_seen", utc_text())
        set_meta(conn, "classify_mode", "ollama" if self.settings.ollama_url else "keywords")

    def lease_check_due(self):
        """True for one worker at a time, every min(60 s, lease / 4)."""
        with self.lock:
            if time.monotonic() - self.last_expiry < min(60, self.settings.lease_seconds / 4):
                return False
            self.last_expiry = time.monotonic()
            return True

    def idle(self):
        """Wait for posts to come: idle_wait at most, less when a crawl of
        this process queues some, and not at all once the pool stops."""
        queued = self.db.process.posts_queued
        queued.clear()
        waited_until = time.monotonic() + self.idle_wait
        while not self.stop.wait(IDLE_LOOK):
            if queued.is_set() or time.monotonic() >= waited_until:
                return

    def note_written(self, conn, post, verdict, written):
        if verdict.llm_seconds is not None:
            # An answer clears what the page says of Ollama: looked up once
            # after it may have been said, not once a post.
            if self.down_noted and self.stats.ollama_down is None:
                self.down_noted = False
                if get_meta(conn, "ollama_down")[0] is not None:
                    delete_meta(conn, "ollama_down")
                    log.warning("Ollama answers again")
        log.info("post %s: %s, relevance %s, interest %s%s", post.id,
                 verdict.direction or "no direction", verdict.relevance, verdict.interest,
                 "" if written else " (taken back by the lease or an edit; not written)")
        with self.lock:
            self.connection_failures = 0
            self.story_waits.pop(post.id, None)
            if written:
                self.stats.done += 1
            else:
                self.stats.lost += 1
        if self.progress:
            self.progress.step()

    def fail(self, conn, post, error):
        message = str(error) if isinstance(error, VestiError) else f"{type(error).__name__}: {error}"
        if isinstance(error, VestiError):
            log.info("post %s: %s", post.id, message)
        else:
            log.exception("post %s: classification failed", post.id)
        unreachable = isinstance(error, OllamaUnreachable)
        if isinstance(error, ClassifyError):
            add_counts(conn, {("llm_failures", f'reason="{"unreachable" if unreachable else "answer"}"'): 1})
        if unreachable:
            state = defer_post(conn, post.id, post.claim_token, message,
                               self.settings.retry_delay)
        elif isinstance(error, StoryPending):
            state = defer_post(conn, post.id, post.claim_token, message, STORY_WAIT,
                               text=getattr(error, "text", None))
            if state == PENDING:
                return self.wait_for_story(post)
        else:
            state = release_post(conn, post.id, post.claim_token, message,
                                 self.settings.max_attempts, self.settings.retry_delay)
        with self.lock:
            self.story_waits.pop(post.id, None)
            self.stats.failed += state == FAILED
            self.stats.returned += state == PENDING
            self.stats.lost += state is None
            # A copy waiting for its story says nothing about Ollama.
            down = not isinstance(error, StoryPending) and self.note_connection(unreachable, message)
        if down:
            note_ollama_down(conn, message)
            self.down_noted = True
        if self.progress:
            self.progress.step()

    def wait_for_story(self, post):
        """A copy put back until its story's first post has a verdict: not
        a post done (its --limit ticket comes back), and a one-off run
        waits for it (see copies_waiting)."""
        until = time.monotonic() + STORY_WAIT + self.settings.ollama_timeout
        with self.lock:
            self.story_waits.setdefault(post.id, until)
        self.give_back_tickets(1)

    def note_connection(self, unreachable, message):
        """Count connection failures in a row; after OLLAMA_DOWN_AFTER, stop
        claiming (for OLLAMA_PAUSE seconds with --forever). Under self.lock."""
        self.connection_failures = self.connection_failures + 1 if unreachable else 0
        if self.connection_failures >= OLLAMA_DOWN_AFTER and not self.stats.ollama_down:
            self.stats.ollama_down = message
            self.paused_until = time.monotonic() + OLLAMA_PAUSE
            log.warning("%s; stopped claiming after %d connection failures",
                        message, self.connection_failures)
            return True
        return False

    def release_unfinished(self, wait=35):
        """After a stop: wait for claims still blocked on the database (at
        most the busy timeout), then put back every post this process holds."""
        deadline = time.monotonic() + wait
        while self.claiming and time.monotonic() < deadline:
            time.sleep(0.05)
        return release_claims(self.db.conn(), process_claims())


class Worker:
    """One worker of a pool, in its own thread: it claims a batch, classifies
    its posts one by one and writes their verdicts with the next claim; the
    batch grows while posts are fast. A post the LLM decides is asked by the
    worker's asking thread, one question at a time, while the worker writes
    what is done, claims and prepares the next; the next question waits in
    line there, so it is asked the moment the one under way is answered."""

    QUESTIONS = 2       # under way and waiting in line

    def __init__(self, pool, conn):
        self.pool, self.conn = pool, conn
        self.in_hand = collections.deque()  # claimed, not begun
        self.finished = []                  # (post, verdict) not written yet
        self.asking = collections.deque()   # (post, future) of the questions asked, oldest first
        self.asker = None                   # the thread that asks, from the first question
        self.size, self.started = 1, 0.0

    def run(self, forever):
        try:
            while not self.pool.stop.is_set():
                if self.in_hand:
                    self.take_next()
                elif not self.refill(forever):
                    return
        except BaseException:
            self.asking.clear()     # not waited for: their posts are put back with the rest
            raise
        finally:
            try:
                for _, question in self.asking:
                    question.cancel()   # one waiting in line is not asked: its post goes back
                self.hear_answers()
                self.put_down()
            finally:
                if self.asker is not None:
                    self.asker.submit(close_ollama_connection, self.conn.process.ollama_lines)
                    self.asker.shutdown(wait=False)

    def refill(self, forever):
        """Write what is done and claim the next batch; False once there is
        nothing more to do."""
        pool = self.pool
        while self.asking and (self.asking[0][1].done() or len(self.asking) >= self.QUESTIONS):
            self.hear_answer()      # a full line: the next claim waits for an answer
        if self.finished and pool.stats.ollama_down:
            self.turn(0)                    # may_claim may wait a while
        pool.wake_copies(self.conn)
        wanted = pool.take_tickets(self.size) if pool.may_claim(forever) else 0
        posts = self.turn(wanted)
        pool.give_back_tickets(wanted - len(posts))
        if posts:
            pool.hold(self.in_hand, posts)
            pool.classify.look_ahead(posts)
            self.started = time.monotonic()
        elif self.asking:
            self.hear_answer()              # written by the next turn
        elif wanted and pool.held and not forever:
            pool.stop.wait(BATCH_WINDOW / 5)    # another batch may come back
        elif wanted and not forever and pool.copies_waiting():
            pool.stop.wait(STORY_POLL)          # copies wait for their story's verdict
        elif not wanted or pool.stop.is_set() or not forever:
            return False
        else:
            pool.say_done(dry=True)
            pool.idle()
        return True

    def take_next(self):
        """Prepare the next post in hand: its verdict joins those to write,
        or its question is asked."""
        post = self.pool.next_post(self.in_hand)
        slow = not self.pool.classify.quick(post)
        if slow and self.pool.classify.holds(post) and (self.in_hand or self.finished):
            # Slow work ahead (an article): the verdicts in hand are written
            # and the rest of the batch goes back to the queue rather than
            # wait for it.
            self.put_down()
            self.size = 1
        verdict = self.prepare(post)
        if verdict is None or callable(verdict):
            self.size = 1
            if verdict is not None:
                self.ask(post, verdict)
            return
        self.finished.append((post, verdict))
        if not self.in_hand:
            # One slow post at a time: a second would wait in hand.
            fast = not slow and time.monotonic() - self.started < BATCH_WINDOW
            self.size = min(self.size * 2, MAX_BATCH) if fast else max(1, self.size // 2)

    def prepare(self, post):
        """The post's verdict, a function that asks the LLM for it, or None
        when it failed (already written back)."""
        try:
            return self.pool.classify.prepare(post)
        except StoryPending as e:
            if e.story not in (asked.id for asked, _ in self.asking):
                return self.fail(post, e)
        except Exception as e:
            return self.fail(post, e)
        # Its story waits for a post this worker asks about: that verdict
        # is written first, then the post is prepared again.
        self.hear_answers()
        self.turn(0)
        try:
            return self.pool.classify.prepare(post)
        except Exception as e:
            return self.fail(post, e)

    def fail(self, post, error):
        self.pool.fail(self.conn, post, error)

    def ask(self, post, question):
        """Ask the LLM in the background, behind the question under way
        (once a question waiting in line is asked); not while Ollama is down
        (the post goes back)."""
        if len(self.asking) >= self.QUESTIONS:
            self.hear_answer()
        if self.pool.stats.ollama_down:
            give_back_posts(self.conn, [post.claim_token])
        else:
            if self.asker is None:
                self.asker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ask")
            ahead = self.asking[-1][1] if self.asking else None
            self.asking.append((post, self.asker.submit(self.put, question, ahead)))

    def put(self, question, ahead):
        """In the asking thread: the question, unless the one ahead of it
        could not reach Ollama (or Ollama is down)."""
        if self.pool.stats.ollama_down or (
                ahead is not None and isinstance(ahead.exception(), OllamaUnreachable)):
            raise NotAsked()
        return question()

    def hear_answer(self):
        """Wait for the answer to the oldest question: its verdict joins
        those to write (a failure is written back at once; a question never
        asked goes back to the queue)."""
        if not self.asking:
            return
        post, question = self.asking.popleft()
        try:
            self.finished.append((post, question.result()))
        except (CancelledError, NotAsked):
            give_back_posts(self.conn, [post.claim_token])
        except Exception as e:
            self.fail(post, e)

    def hear_answers(self):
        while self.asking:
            self.hear_answer()

    def turn(self, wanted):
        """Write the verdicts in hand and claim up to `wanted` posts."""
        finished, self.finished = self.finished, []
        return self.pool.take_turn(self.conn, finished, wanted)

    def put_down(self):
        finished, self.finished = self.finished, []
        self.pool.put_down(self.conn, finished, self.in_hand)


def pass_over_busy_hosts(tiers, window):
    """The ids of a window of claimable posts (see claim_posts) to claim:
    teasers whose article host is in the first of `tiers` (sets of hosts)
    are passed over while other posts can be had, then those of the next;
    so the workers fetch several hosts' articles side by side."""
    for hosts in tiers:
        chosen = [post_id for post_id, kind, link in window
                  if kind != "summary" or host_of(link or "") not in hosts]
        if chosen:
            return chosen
    return [post_id for post_id, _, _ in window]


def warn_short_lease(settings):
    """A lease shorter than one classification may take hands live posts to
    other workers and burns their attempts."""
    longest = (settings.ollama_timeout if settings.ollama_url else 0) + 3 * settings.timeout
    if settings.lease_seconds < longest:
        log.warning("VESTI_LEASE_SECONDS=%g is shorter than one post may take "
                    "(OLLAMA_TIMEOUT + 3 x RSS_TIMEOUT = %g s): live posts may be taken back",
                    settings.lease_seconds, longest)


def run_workers(db, settings, registry, workers=None, limit=None, forever=False,
                classify=None, stop=None, quiet=False, gate=None):
    """Run a worker pool until the queue is empty (or `stop` is set). On stop,
    posts in hand get VESTI_STOP_GRACE seconds, then go back to the queue.
    Returns (stats, finished): finished is False when some worker is still
    stuck in a call, so the caller knows threads are left behind."""
    workers = workers or settings.workers
    warn_short_lease(settings)
    ready_counts(db.conn(), registry.directions)
    if time.time() - (parse_utc(get_meta(db.conn(), "story_keys_pruned")[0]) or 0) > 86400:
        prune_story_keys(db.conn(), settings.story_hours)
        set_meta(db.conn(), "story_keys_pruned", utc_text())
    pending = pending_count(db.conn())
    total = pending if limit is None else min(limit, pending)
    progress = Progress("worker", total, "posts", quiet)
    stop = stop or threading.Event()
    pool = WorkerPool(db, settings, classify or Classifier(registry, settings, gate, db), stop,
                      progress, report=forever)
    try:
        finished, _ = run_until_stopped(lambda: pool.run(workers, limit, forever), stop,
                                        settings.stop_grace)
    except StorageError:
        with contextlib.suppress(StorageError, sqlite3.Error):
            pool.release_unfinished(wait=0)
        raise
    released = 0 if finished else pool.release_unfinished()
    with contextlib.suppress(StorageError, sqlite3.Error):
        refresh_every_figure(db.conn(), settings.min_relevance)
    pool.say_done(dry=False, stopping=True)
    progress.finish(pool.stats.line() + (f", {released} put back unfinished" if released else ""))
    return pool.stats, finished


###############################################################################
# Publishing ##################################################################
###############################################################################
# Sending the outbox (see Publications for a publication's states and
# transitions): the Telegram Bot API and webhooks. Each target has one sender
# at a time, whatever the number of processes and machines: a lease on the
# target's row (its owner and until when), taken only where it is free or
# ran out, and renewed before each call, whose deadline keeps it shorter than
# the lease. Targets send side by side, each in a thread of its own, so that
# one slow or dead receiver delays no other. A call is made between two
# transitions, never inside a transaction. A Telegram send that may have
# arrived (no answer, a 5xx) is uncertain and never repeated on its own
# (sendMessage is not idempotent); a webhook carries an Idempotency-Key and
# is tried again.

SENDER_MARGIN = 30              # seconds a sender's lease outlasts its longest call
PUBLISH_LOOK = 0.25             # seconds between two looks for what is due
PUBLISH_AFTER_ERROR = 5
PUBLISH_BACKOFF = 10            # seconds before the second try; doubled for each next
PUBLISH_BACKOFF_MAX = 3600
PAUSE_DEFAULT = 30              # a 429 that does not say for how long
PAUSE_MAX = 86400
# A target Telegram refuses as a whole (the token, the bot's place in the
# chat, the chat itself) waits this long between tries, its posts queued:
# once the chat is mended they go, and none is failed meanwhile.
TARGET_PAUSE = 300
ANSWER_BYTES = 1 << 20
ANSWER_CHARS = 200              # of a webhook's answer, kept as its message id
ALERT_SCAN = 5000               # posts an alert target looks at in one go
ALERT_WAIT = 6 * 3600           # seconds its look waits for a post the workers have not done


def next_try(stop):
    """What a publisher's error line says of its next try: nothing once the
    process stops (the error may be the stop's: a database not waited for)."""
    return "" if stop.is_set() else f"; trying again in {PUBLISH_AFTER_ERROR} s"


def seconds_to_wait(value, default=PAUSE_DEFAULT):
    """Retry-After or retry_after: seconds, or an HTTP date."""
    if value is None:
        return default
    text = str(value).strip()
    if re.fullmatch(r"[0-9]{1,9}(?:\.[0-9]+)?", text):
        return min(float(text), PAUSE_MAX)
    with contextlib.suppress(TypeError, ValueError, IndexError):
        return min(max(0.0, email.utils.parsedate_to_datetime(text).timestamp() - time.time()),
                   PAUSE_MAX)
    return default


def send_post(url, body, headers, settings, deadline):
    """Connect, send the whole POST and read the answer's status line and
    headers; (socket, HTTPResponse). `sent` of the returned socket's
    request is known to the caller by where an error came from."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    host, port = host_of(url), parts.port or DEFAULT_PORTS[scheme]
    timeout = max(0.001, min(settings.timeout, deadline - time.monotonic()))
    sock = connect_to(host, port, Policy(host, True), timeout)
    if scheme == "https":
        sock = tls_context().wrap_socket(sock, server_hostname=host)
    name = f"[{host}]" if ":" in host else host
    if port != DEFAULT_PORTS[scheme]:
        name = f"{name}:{port}"
    head = (f"POST {request_target(parts)} HTTP/1.1\r\nHost: {name}\r\n"
            f"{header_lines({**headers, 'Content-Length': len(body)})}Connection: close\r\n\r\n")
    return sock, head.encode("latin-1", "replace") + body


def post_request(url, body, headers, settings):
    """POST `body` within one deadline, 3 x RSS_TIMEOUT from the connection
    to the answer's last byte (a receiver dripping its answer cannot hold a
    sender); (status, headers, answer bytes). Trouble before the whole
    request went out is SendFailed to retry; after it, SendFailed `unsure`:
    the receiver may have acted on it. No message names the URL (a
    webhook's path is often its secret)."""
    limit = 3 * settings.timeout
    deadline = time.monotonic() + limit
    sock, sent = None, False
    try:
        sock, request = send_post(url, body, headers, settings, deadline)
        sock.settimeout(max(0.001, min(settings.timeout, deadline - time.monotonic())))
        sock.sendall(request)
        sent = True
        response = http.client.HTTPResponse(_DeadlineSocket(sock, deadline, settings.timeout),
                                            method="POST")
        response.begin()
        return response.status, response.headers, response.read(ANSWER_BYTES)
    except DeadlinePassed:
        failure = f"no whole answer within {limit:g} s"
    except FetchError as e:
        failure = str(e)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        failure = describe_error(e)
    finally:
        if sock is not None:
            sock.close()
    if sent:
        raise SendFailed(f"no answer: {failure}", unsure=True)
    raise SendFailed(f"not sent: {failure}", retry=True)


def bot_api(settings, method, payload):
    """Call one Bot API method; its `result`, or SendFailed as the answer
    says: a 429 pauses; a 5xx, or an answer that is not the Bot API's, may
    have come after the call was done (unsure); any other error is a
    refusal, not done. No message holds the token, however an answer
    echoes it."""
    token = settings.tg_bot_token
    try:
        status, headers, answer = post_request(
            f"{settings.tg_bot_api}/bot{token}/{method}",
            json.dumps(payload, ensure_ascii=False).encode(),
            {"Content-Type": "application/json", "User-Agent": settings.user_agent}, settings)
    except SendFailed as e:
        raise SendFailed(f"Bot API {method}: {masked(str(e), token)}", retry=e.retry,
                         unsure=e.unsure) from None
    try:
        data = json.loads(answer)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise SendFailed(f"Bot API {method}: HTTP {status}, not the Bot API's JSON",
                         unsure=status >= 500 or 200 <= status < 300)
    if data.get("ok") is True:
        return data.get("result")
    code = data.get("error_code") if isinstance(data.get("error_code"), int) else status
    described = masked(shorten(str(data.get("description") or f"HTTP {status}"), 300), token)
    parameters = data.get("parameters") if isinstance(data.get("parameters"), dict) else {}
    if code == 429:
        wait = seconds_to_wait(parameters.get("retry_after", headers.get("Retry-After")))
        raise SendFailed(f"Bot API {method}: {code} {described}", pause=wait)
    if "migrate_to_chat_id" in parameters:
        described += f" (the chat is now {parameters['migrate_to_chat_id']}: put that id in sources.yaml)"
    if code in (401, 403) or (code == 400 and re.search(r"chat not found|migrate", described, re.I)):
        raise SendFailed(f"Bot API {method}: {code} {described}; every post to this target waits "
                         f"until it is mended", pause=TARGET_PAUSE)
    raise SendFailed(f"Bot API {method}: {code} {described}", unsure=code >= 500)


def signature(secret, body):
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def post_webhook(settings, url, item, key):
    """POST one JSON body, signed, with its Idempotency-Key; the answer (cut).
    A 5xx or 408 is worth trying again; a 429 pauses; any other refusal is
    final."""
    body = json.dumps(item, ensure_ascii=False).encode()
    status, headers, answer = post_request(url, body, {
        "Content-Type": "application/json", "User-Agent": settings.user_agent,
        "X-Vesti-Signature": signature(settings.webhook_secret, body),
        "Idempotency-Key": key}, settings)
    said = masked(shorten(" ".join(answer.decode("utf-8", "replace").split()), ANSWER_CHARS),
                  *webhook_secrets(url))
    if 200 <= status < 300:
        return said or f"HTTP {status}"
    described = f"webhook: HTTP {status}" + (f": {said}" if said else "")
    if status == 429:
        raise SendFailed(described, pause=seconds_to_wait(headers.get("Retry-After")))
    if 300 <= status < 400:
        described += f" (redirected to {shorten(host_of(headers.get('Location') or '') or '?', 100)}: " \
                     f"give the webhook's final address)"
    raise SendFailed(described, retry=status >= 500 or status == 408)


def webhook_item(item, text):
    """A post (as it was approved) as a webhook carries it: a JSON Feed
    item with the editor's text, and who decided it when."""
    sent = {"id": str(item["id"]), "title": item.get("title") or "(untitled)", "content_text": text,
            "date_published": iso_time(item.get("published_at")),
            "tags": [item["direction"]] if item.get("direction") else [],
            "direction": item.get("direction"), "source": item.get("source"),
            "decided_by": item.get("decided_by"),
            "decided_at": item.get("decided_at") and iso_time(item["decided_at"])}
    if (item.get("url") or "").startswith(("http://", "https://")):
        sent["url"] = item["url"]
    if item.get("summary"):
        sent["summary"] = item["summary"]
    return sent


def queue_alerts(conn, target, settings):
    """Alerts for the posts classified since the target last looked: a post
    published within VESTI_STORY_HOURS (not a new source's old backlog)
    whose relevance (and, where a model judged it, likely) passes the
    target's thresholds queues one alert for its story, as it reads now.
    The look moves on to the first post still waiting for the workers (one
    fetched more than ALERT_WAIT ago is not waited for). Returns how many."""
    mark = target.alerts_from
    if mark is None:        # a new target: from the posts still waiting of the last ALERT_WAIT
        mark = conn.execute(f"SELECT coalesce(min(id), (SELECT coalesce(max(id), 0) + 1 FROM posts)) "
                            f"FROM posts WHERE ({IS_PENDING} OR classified = {PROCESSING}) "
                            f"AND fetched_at >= ?", (utc_text(time.time() - ALERT_WAIT),)).fetchone()[0]
    rows = conn.execute(f"""SELECT id, classified, relevance, likely, direction, fetched_at,
                                   published_at FROM posts
                            WHERE id >= ? ORDER BY id LIMIT ?""", (mark, ALERT_SCAN)).fetchall()
    recent = utc_text(time.time() - ALERT_WAIT)
    fresh = utc_text(time.time() - settings.story_hours * HOUR)
    waiting = next((row["id"] for row in rows if row["classified"] not in (DONE, FAILED)
                    and (row["fetched_at"] or "") >= recent), None)
    passing = [row["id"] for row in rows if row["classified"] == DONE and row["direction"]
               and (row["published_at"] or row["fetched_at"] or "") >= fresh
               and (row["relevance"] or 0) >= target.min_relevance
               and (target.min_likely is None or row["likely"] is None
                    or row["likely"] >= target.min_likely)
               and target.takes(row["direction"])]
    queued = 0
    with transaction(conn):
        for post_id in passing:
            lead = conn.execute("SELECT coalesce(story_id, id) FROM posts WHERE id = ?",
                                (post_id,)).fetchone()[0]
            post = conn.execute(f"{PUBLISHED_POST} WHERE p.id = ?", (lead,)).fetchone()
            queued += conn.execute("""
                INSERT INTO publications (post_id, target, state, item, queued_at, idempotency_key)
                VALUES (?, ?, 'queued', ?, ?, ?) ON CONFLICT (post_id, target) DO NOTHING""",
                (lead, target.name, item_of(post), utc_text(), secrets.token_hex(16))).rowcount
        mark = waiting if waiting is not None else (rows[-1]["id"] + 1 if rows else mark)
        conn.execute("UPDATE targets SET alerts_from = ? WHERE name = ?", (mark, target.name))
    return queued


def failed_send(failure, telegram, attempts, max_attempts):
    """What a failed send does to one of its publications, decided from the
    failure, the kind of target and the attempts made alone: ("pause", None)
    puts it back uncounted (429: the whole target waits); ("doubt", None):
    a Telegram message that may have arrived is uncertain, never sent again
    on its own; ("retry", seconds): one not done, or a webhook's (whose key
    makes a retry safe), waits its doubling backoff until its attempts run
    out; ("fail", None): refused, or out of attempts."""
    if failure.pause is not None:
        return "pause", None
    if failure.unsure and telegram:
        return "doubt", None
    if (failure.retry or failure.unsure) and attempts < max_attempts:
        return "retry", min(PUBLISH_BACKOFF_MAX, PUBLISH_BACKOFF * 2 ** (attempts - 1))
    return "fail", None


def failed_deletion(failure):
    """What a failed deletion does to a sent publication: ("gone", None) when
    the message is no longer there (as good as deleted); ("again", seconds)
    after trouble on the way (a deletion done twice does no harm); ("kept",
    None) when the receiver refuses: it stays published, with the reason."""
    if "message to delete not found" in str(failure):
        return "gone", None
    if failure.retry or failure.unsure or failure.pause is not None:
        return "again", failure.pause or PUBLISH_BACKOFF
    return "kept", None


class Publisher:
    """Sends what is due, each target as its one sender (see take), the
    targets side by side; `clock` is the wall clock."""

    def __init__(self, db, settings, clock=time.time):
        self.db, self.settings, self.clock = db, settings, clock
        # Names the sender on /outbox; whether it still sends is told by its lease alone.
        self.me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.lease = 3 * settings.timeout + SENDER_MARGIN
        self.sent = self.failed = self.uncertain = 0
        self.held = {}          # target: (sender, until) of the targets another sender held
        self._counted = threading.Lock()
        self._sends = itertools.count(1)

    def count(self, outcome, n=1):
        with self._counted:
            setattr(self, outcome, getattr(self, outcome) + n)

    # -- looking for work -----------------------------------------------------

    def look(self, stop=None):
        """Send everything due now, the targets side by side; returns the
        seconds until something is due again, or None when nothing waits."""
        names = self.prepare()
        waits = dict.fromkeys(names)

        failures = []

        def turn(name):
            try:
                waits[name] = self.turn(name, stop)
            except Exception as e:
                failures.append(e)
        turns = [threading.Thread(target=turn, args=(name,), name=f"publish {name}")
                 for name in names]
        for thread in turns:
            thread.start()
        for thread in turns:
            thread.join()
        if failures:
            raise failures[0]
        waits = [wait for wait in waits.values() if wait is not None]
        return min(waits) if waits else None

    def run(self, stop):
        """Until `stop`: look for work when something is queued
        (Process.publish_wake) or every PUBLISH_LOOK; each target that has
        some is served by a thread of its own until it has none."""
        senders, wake = {}, self.db.process.publish_wake
        while not stop.is_set():
            wake.clear()
            try:
                names = self.prepare()
            except StorageError as e:
                log.error("publish: %s%s", e, next_try(stop))
                stop.wait(PUBLISH_AFTER_ERROR)
                continue
            except Exception:
                log.exception("publish: unexpected error%s", next_try(stop))
                stop.wait(PUBLISH_AFTER_ERROR)
                continue
            for name in names:
                if name not in senders or not senders[name].is_alive():
                    senders[name] = threading.Thread(target=self.keep_sending, args=(name, stop),
                                                     name=f"publish {name}", daemon=True)
                    senders[name].start()
            wake.wait(PUBLISH_LOOK)
        grace = time.monotonic() + self.settings.stop_grace      # for them all, not each
        for sender in senders.values():
            sender.join(max(0.0, grace - time.monotonic()))
        self.let_go([name for name, sender in senders.items() if sender.is_alive()])

    def let_go(self, names):
        """At a stop, the targets whose sender still waits for an answer the
        process will not live to read: that send is uncertain now (as a
        killed sender's would be once its lease ran out), and the target is
        free for the next sender at once, not only when the lease ends."""
        if not names:
            return
        conn = self.db.conn()
        for name in names:
            try:
                with transaction(conn):
                    lost = doubt_lost_sends(conn, name, self.me, "VESTI stopped before the "
                                            "answer came: it may or may not have arrived",
                                            self.clock())
                    conn.execute("UPDATE targets SET sender = NULL, sender_until = NULL "
                                 "WHERE name = ? AND sender = ?", (name, self.me))
            except StorageError as e:       # its lease then runs out, as a killed sender's
                log.error("publish: %s: %s", name, e)
                continue
            if lost:
                self.count("uncertain", lost)
                log.warning("publish: %s: stopped during a send; it is uncertain, see /outbox",
                            name)

    def keep_sending(self, name, stop):
        """One target's sends, as they fall due, until it has none."""
        while not stop.is_set():
            try:
                wait = self.turn(name, stop)
            except StorageError as e:
                log.error("publish: %s: %s%s", name, e, next_try(stop))
                wait = PUBLISH_AFTER_ERROR
            except Exception:
                # The sender goes on: a send it was making is uncertain
                # (see release), never sent twice.
                log.exception("publish: %s: unexpected error%s", name, next_try(stop))
                wait = PUBLISH_AFTER_ERROR
            if wait is None:
                return
            stop.wait(min(wait, PUBLISH_LOOK) if wait != PUBLISH_AFTER_ERROR else wait)

    def prepare(self):
        """Alerts queued and texts composed; the names of the enabled
        targets that have work."""
        conn = self.db.conn()
        names = []
        for target in read_targets(conn, "enabled = 1"):
            if target.kind == "alert":
                queue_alerts(conn, target, self.settings)
            if self.has_work(conn, target.name):
                names.append(target.name)
        if names:
            compose_texts(conn, self.settings)
        return names

    @staticmethod
    def has_work(conn, name):
        return conn.execute(f"""SELECT 1 FROM publications WHERE target = ?
                                    AND (state IN ('queued', 'sending') OR ({TO_DELETE}))
                                LIMIT 1""", (name,)).fetchone() is not None

    def problem(self, target):
        if target.kind in ("telegram", "alert") and not self.settings.tg_bot_token:
            return "TG_BOT_TOKEN is not set: nothing is sent to this target"
        if target.kind == "webhook" and not self.settings.webhook_secret:
            return "VESTI_WEBHOOK_SECRET is not set: webhooks are sent only signed"
        return None

    def note_problem(self, conn, target, problem):
        if target.error != problem:
            log.error("publish: %s: %s", target.name, problem)
            with transaction(conn):
                conn.execute("UPDATE targets SET error = ? WHERE name = ?", (problem, target.name))

    # -- one target -----------------------------------------------------------

    def turn(self, name, stop=None):
        """The target's due sends, as its sender; the seconds until its next
        is due, or None when nothing waits."""
        conn = self.db.conn()
        target = read_target(conn, name)
        problem = self.problem(target)
        if problem:
            self.note_problem(conn, target, problem)
            return None
        due = self.due_in(conn, target)
        if due != 0:
            return due
        if not self.take(conn, name):
            return PUBLISH_LOOK
        try:
            return self.serve(name, stop)
        finally:
            self.release(conn, name)

    def due_in(self, conn, target):
        """0 when something of the target is due now (a deletion, a send, a
        send left by a sender gone); else the seconds until one is (a
        pause, a backoff, the pace, the hour's alerts), or None. Reads only."""
        name, now = target.name, self.clock()
        if self.deletion_due(conn, name) is not None or conn.execute(
                "SELECT 1 FROM publications WHERE target = ? AND state = 'sending' LIMIT 1",
                (name,)).fetchone():
            return 0
        paused = (parse_utc(target.paused_until) or 0) - now
        head = Publication.of(conn.execute(
            """SELECT * FROM publications WHERE target = ? AND state = 'queued'
               ORDER BY hurry DESC, queued_at, id LIMIT 1""", (name,)).fetchone())
        later = [when - now for when in (parse_utc(row[0]) for row in conn.execute(
            f"SELECT min(next_attempt_at) FROM publications WHERE target = ? AND {TO_DELETE}",
            (name,))) if when]
        if head is None:
            return max(PUBLISH_LOOK, min(later)) if later else None
        if paused > 0:
            return paused
        backoff = (parse_utc(head.next_attempt_at) or 0) - now
        if backoff > 0:
            return min([backoff, *later])
        if target.kind == "alert":
            return self.hour_left(conn, target, now)
        paced = (parse_utc(target.last_sent_at) or 0) + target.every - now
        return paced if paced > 0 and not head.hurry else 0

    def deletion_due(self, conn, name):
        return Publication.of(conn.execute(
            f"""SELECT * FROM publications WHERE target = ? AND {TO_DELETE}
                    AND (next_attempt_at IS NULL OR next_attempt_at <= ?)
                ORDER BY id LIMIT 1""", (name, utc_text(self.clock()))).fetchone())

    def hour_left(self, conn, target, now):
        """0 when the alert target may send a message now, else the seconds
        until its hour allows one more."""
        sent = conn.execute("""SELECT count(DISTINCT message_id), min(sent_at) FROM publications
                               WHERE target = ? AND state IN ('published', 'cancelled')
                                 AND sent_at >= ?""", (target.name, utc_text(now - HOUR))).fetchone()
        if target.per_hour - sent[0] > 0:
            return 0
        return max(1.0, (parse_utc(sent[1]) or now) + HOUR - now)

    def take(self, conn, name):
        """Become the target's sender where no other holds it: its lease is
        free, this sender's, or ran out. Sends left `sending` by a sender
        before are uncertain: they may have arrived."""
        now = self.clock()
        with transaction(conn):
            taken = conn.execute("""UPDATE targets SET sender = ?, sender_until = ? WHERE name = ?
                                        AND (sender IS NULL OR sender = ?
                                             OR coalesce(sender_until, '') <= ?)""",
                                 (self.me, utc_text(now + self.lease), name, self.me,
                                  utc_text(now))).rowcount
            if not taken:
                held = conn.execute("SELECT sender, sender_until FROM targets WHERE name = ?",
                                    (name,)).fetchone()
                self.held[name] = (held["sender"], held["sender_until"])
                return False
            lost = doubt_lost_sends(conn, name, now=now)
        self.held.pop(name, None)
        if lost:
            self.count("uncertain", lost)
            log.warning("publish: %s: %d sends interrupted before they were recorded are "
                        "uncertain; see /outbox", name, lost)
        return True

    def release(self, conn, name):
        """The target is free again; a send of this sender that did not get
        as far as its record (an error) is uncertain."""
        with transaction(conn):
            doubt_lost_sends(conn, name, self.me, "the send stopped before it was recorded",
                             self.clock())
            conn.execute("UPDATE targets SET sender = NULL, sender_until = NULL "
                         "WHERE name = ? AND sender = ?", (name, self.me))

    def serve(self, name, stop=None):
        """Send the target's due publications one after another (deletions
        first); returns the seconds until the next is due, or None."""
        conn = self.db.conn()
        while stop is None or not stop.is_set():
            target = read_target(conn, name)
            due = self.due_in(conn, target)
            if due != 0:
                return due
            deletion = self.deletion_due(conn, name)
            if deletion is not None:
                with transaction(conn):
                    kept = self.renew(conn, name)
                if not kept:
                    return PUBLISH_LOOK     # the lease was lost
                self.delete(target, deletion)
                continue
            rows = self.due_rows(conn, target)
            if any(row.text is None for row in rows):
                compose_texts(conn, self.settings, name)
                continue
            claimed = self.claim(conn, name, rows)
            if claimed is None:
                return PUBLISH_LOOK         # the lease was lost
            if claimed:
                self.send(target, claimed)
        return None

    def due_rows(self, conn, target):
        """What goes in the next message: the head of the queue; for an
        alert target whose hour has one message left while more wait, all
        of them (one digest)."""
        single = """SELECT * FROM publications WHERE target = ? AND state = 'queued'
                    ORDER BY hurry DESC, queued_at, id LIMIT ?"""
        if target.kind != "alert":
            return [Publication.of(row) for row in conn.execute(single, (target.name, 1))]
        sent = conn.execute("""SELECT count(DISTINCT message_id) FROM publications
                               WHERE target = ? AND state IN ('published', 'cancelled')
                                 AND sent_at >= ?""",
                            (target.name, utc_text(self.clock() - HOUR))).fetchone()[0]
        return [Publication.of(row) for row in conn.execute(
            single, (target.name, 1 if target.per_hour - sent > 1 else 1000))]

    def renew(self, conn, name):
        """The lease renewed before a call (whose deadline it outlasts), in
        the caller's transaction; False when it is no longer this sender's."""
        return bool(conn.execute("UPDATE targets SET sender_until = ? WHERE name = ? AND sender = ?",
                                 (utc_text(self.clock() + self.lease), name, self.me)).rowcount)

    def claim(self, conn, name, rows):
        """Renew the lease and mark the rows `sending` under one new token;
        None when the lease is no longer this sender's."""
        token = f"{self.me}:{next(self._sends)}"
        with transaction(conn):
            if not self.renew(conn, name):
                return None
            return claim_publications(conn, [row.id for row in rows], token)

    def send(self, target, rows):
        """Make the call, then record what came of it."""
        conn = self.db.conn()
        try:
            message_id, chat = self.call(conn, target, rows)
        except SendFailed as e:
            self.record_failure(conn, target, rows, e)
            return
        now = utc_text(self.clock())
        with transaction(conn):
            delivered = sum(deliver_publication(conn, row.id, row.token, message_id, chat, now)
                            for row in rows)
            conn.execute("UPDATE targets SET last_sent_at = ?, error = NULL, paused_until = NULL "
                         "WHERE name = ?", (now, target.name))
        self.count("sent", len(rows))
        posts = ", ".join(str(row.post_id) for row in rows)
        if delivered < len(rows):
            log.error("publish: %s: post %s arrived (message %s) after its send was given up and "
                      "sent again by an editor; see /outbox", target.name, posts, message_id)
        log.info("publish: %s: sent post %s", target.name, posts)

    def call(self, conn, target, rows):
        """The one call of a send: (its message id or the webhook's answer,
        where it went)."""
        if target.kind == "webhook":
            row = rows[0]
            item = publication_item(conn, row.item, row.post_id)
            if item is None:
                raise SendFailed("the post is no longer stored")
            return post_webhook(self.settings, target.address, webhook_item(item, row.text),
                                row.idempotency_key), target.address
        if len(rows) == 1:
            text = message_html(cut_message(rows[0].text))
        else:
            text = digest_html([item for item in (publication_item(conn, row.item, row.post_id) for row in rows)
                                if item], self.settings)
        result = bot_api(self.settings, "sendMessage", {
            "chat_id": target.address, "text": text, "parse_mode": "HTML",
            "link_preview_options": {"is_disabled": target.kind == "alert"}})
        if not isinstance(result, dict) or "message_id" not in result:
            raise SendFailed("Bot API sendMessage: an answer without message_id", unsure=True)
        return str(result["message_id"]), target.address

    def record_failure(self, conn, target, rows, failure):
        """Carry out what the failure does to each row (see failed_send), and
        a 429's pause of the whole target. Each transition reads the row as
        it is now: one taken back meanwhile is cancelled instead."""
        now = self.clock()
        error = str(failure)
        telegram = target.kind != "webhook"
        kept = failure.unsure and not telegram     # a webhook's receiver may have it
        with transaction(conn):
            conn.execute("UPDATE targets SET error = ?, paused_until = ? WHERE name = ?",
                         (error, not_before(now + failure.pause) if failure.pause is not None
                          else target.paused_until, target.name))
            if failure.pause is None and failure.unsure and telegram:
                count_doubtful_send(conn, target.name, now)
            for row in rows:
                verdict, wait = failed_send(failure, telegram, row.attempts,
                                            self.settings.publish_attempts)
                if verdict == "pause":
                    retry_publication(conn, row.id, row.token, error, counted=False)
                elif verdict == "doubt":
                    if doubt_publication(conn, row.id, row.token,
                                         f"{error}: it may or may not have arrived"):
                        self.count("uncertain")
                elif verdict == "retry":
                    retry_publication(conn, row.id, row.token, error, not_before(now + wait),
                                      kept=kept)
                elif fail_publication(conn, row.id, row.token, error, kept=kept):
                    self.count("failed")
        level = logging.WARNING if failure.pause is not None or failure.retry else logging.ERROR
        log.log(level, "publish: %s: post %s: %s", target.name, rows[0].post_id, error)

    def delete(self, target, row):
        """Take a sent post back where it went (the chat it was sent to):
        deleteMessage, or the webhook's `deleted` event. What cannot be
        deleted stays published, with the reason; trouble on the way is
        tried again (a deletion done twice does no harm)."""
        conn = self.db.conn()
        now = self.clock()
        where = row.chat or target.address
        try:
            if target.kind == "webhook":
                post_webhook(self.settings, where, {"event": "deleted", "id": str(row.post_id)},
                             f"{row.idempotency_key}-deleted")
            else:
                bot_api(self.settings, "deleteMessage",
                        {"chat_id": where, "message_id": int(row.message_id)})
        except SendFailed as e:
            verdict, wait = failed_deletion(e)
            with transaction(conn):
                if verdict == "gone":
                    deleted_publication(conn, row.id, utc_text(now), "it was no longer there")
                else:
                    undeleted_publication(conn, row.id, f"not deleted: {e}",
                                          not_before(now + wait) if verdict == "again" else None)
            if verdict != "gone":
                log.warning("publish: %s: post %s not deleted: %s", target.name, row.post_id, e)
            return
        except (ValueError, TypeError):
            with transaction(conn):
                undeleted_publication(conn, row.id, "not deleted: no message id was recorded")
            return
        with transaction(conn):
            deleted_publication(conn, row.id, utc_text(now))
        log.info("publish: %s: post %s deleted", target.name, row.post_id)


###############################################################################
# Page assets #################################################################
###############################################################################
# What every page is made of besides its data: the style, the words of
# each language (STRINGS, phrase) and the scripts the pages run.
STYLE = """
:root{--fg:#1d2330;--muted:#667085;--line:#e4e7ec;--bg:#f7f8fa;--ok:#127a3d;--bad:#b42318;--warn:#b54708;--accent:#2554c7}
*{box-sizing:border-box}
body{margin:0;font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
header{display:flex;gap:1.2em;align-items:baseline;flex-wrap:wrap;padding:.8em 1.2em;background:#fff;border-bottom:1px solid var(--line)}
header h1{font-size:1.15em;margin:0}
header a{color:var(--muted);text-decoration:none}header a.here{color:var(--fg);font-weight:600}
header .lang{margin-left:auto;font-size:.85em}
header form.signout{display:inline;margin-left:.6em}
main{padding:1em 1.2em;max-width:1400px}
.banner{background:#fffaeb;border:1px solid #fedf89;color:var(--warn);border-radius:8px;padding:.6em 1em;margin-bottom:.8em}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(130px,1fr));gap:.8em;margin-bottom:1.2em}
.card{background:#fff;border:1px solid var(--line);border-radius:8px;padding:.7em 1em}
.card span{display:block;color:var(--muted);font-size:.85em}.card b{font-size:1.8em}
.table{overflow-x:auto;background:#fff;border:1px solid var(--line);border-radius:8px}
table{border-collapse:collapse;width:100%;font-size:.9em}
th,td{text-align:left;padding:.45em .6em;border-bottom:1px solid var(--line);vertical-align:top}
th{background:#fafbfc;font-weight:600}table.sources{font-size:.85em}table.sources th{font-size:.9em}
table.sources th,table.sources td{padding:.45em .5em}
td.error{min-width:21em;max-width:28em;overflow-wrap:anywhere;color:var(--bad)}
td.when{min-width:7.5em}.moved{overflow-wrap:anywhere}td.run{min-width:11em}.validator{overflow-wrap:anywhere}
.alive{color:var(--ok);font-weight:600}.dead{color:var(--bad);font-weight:600}.disabled{color:var(--muted)}
.failing,.silent{color:var(--warn);font-weight:600}
.muted{color:var(--muted)}.small{font-size:.85em}
table.outbox td{vertical-align:top}table.outbox textarea{width:100%;min-width:18em;font:inherit}
table.outbox td.error{min-width:12em}.counter.over{color:var(--bad);font-weight:600}
table.outbox .text{white-space:pre-wrap;font-size:.9em;max-height:16em;overflow:auto}
section p{overflow-wrap:anywhere}
tr.pub-uncertain,tr.pub-failed{background:#fef3f2}
section.quality{background:#fff;border:1px solid var(--line);border-radius:8px;padding:.2em 1.2em 1em;margin-bottom:1.2em}
section.quality table{width:auto;min-width:min(26em,100%);margin:.3em 0 .6em}
section.quality h3{font-size:1em;margin:1.3em 0 .3em}section.quality figure{margin:.4em 0}
svg.calibration{display:block;max-width:100%;height:auto}figcaption{max-width:46em;margin-top:.3em}
button{font:inherit;padding:.35em .9em;border-radius:6px;border:1px solid var(--line);background:#fff;cursor:pointer}
button:disabled{opacity:.45;cursor:default}
button.primary{background:var(--accent);border-color:var(--accent);color:#fff}
.actions{display:flex;gap:.6em;align-items:center;margin:.4em 0 1em;flex-wrap:wrap}
form.filters{display:flex;gap:.5em;flex-wrap:wrap;align-items:center;margin-bottom:.6em}
form.filters input[type=search]{min-width:16em}
input,select{font:inherit;padding:.3em .4em;border:1px solid var(--line);border-radius:6px;background:#fff}
.facets{margin:.2em 0 .6em}.facet{margin-right:1.1em;white-space:nowrap;display:inline-block}.facets a.here{font-weight:600;color:var(--fg)}
.post{background:#fff;border:1px solid var(--line);border-radius:8px;padding:.8em 1em;margin-bottom:.7em;scroll-margin-top:1em}
.post.current{outline:2px solid var(--accent)}
.post[data-status=approved]{border-left:4px solid var(--ok)}.post[data-status=rejected]{border-left:4px solid var(--bad);opacity:.7}
.post.not-saved{border-left:4px solid var(--warn)}.post .unsaved{color:var(--bad);font-weight:600}
.post h2{font-size:1.05em;margin:0 0 .3em}.post h2 a{color:var(--fg)}
.post p{margin:.3em 0}.post form{display:flex;gap:.5em;align-items:center}
.post details{margin:.3em 0}.post .text{white-space:pre-wrap;font-size:.9em;max-height:24em;overflow:auto}
.post p.edited{color:var(--warn);font-weight:600}
.versions{display:grid;grid-template-columns:1fr 1fr;gap:1em}
.versions>div{white-space:pre-wrap;font-size:.9em;max-height:24em;overflow:auto}
.badge{display:inline-block;padding:0 .5em;border-radius:10px;background:#eef2ff;font-size:.8em}
nav.pages{margin:1em 0;display:flex;gap:1em}
.bulk [hidden]{display:none}.bulk .unsaved{color:var(--bad);font-weight:600}
.keys-hint{float:right;margin:.2em 0 0 1em}
details.filters>summary{cursor:pointer;font-weight:600;margin-bottom:.5em}
@media (min-width:601px){details.filters>summary{display:none}}
@media (max-width:600px),(hover:none) and (pointer:coarse){.keys-hint{display:none}}
#keys{position:fixed;right:1em;bottom:1em;background:#fff;border:1px solid var(--line);border-radius:8px;padding:.8em 1.2em;box-shadow:0 4px 16px #0002}
#keys[hidden]{display:none}#keys kbd{display:inline-block;min-width:1.4em;font-weight:600}
@media (max-width:600px){
 main{padding:.6em}.card b{font-size:1.4em}.versions{grid-template-columns:1fr}
 .table{border:0;background:none}
 table.sources,table.sources tbody{display:block;width:100%}
 table.sources thead{display:none}
 table.sources tr{display:flex;flex-wrap:wrap;background:#fff;border:1px solid var(--line);border-radius:8px;margin-bottom:.6em;padding:.3em .2em}
 table.sources td{display:block;border:0;padding:.15em .6em;min-width:0;max-width:none}
 table.sources td.source,table.sources td.error{flex-basis:100%}
 table.sources td:empty{display:none}
 table.sources td::before{color:var(--muted);font-weight:400}
 table.sources td.wide{display:none}
 table.stack,table.stack tbody,table.stack tr,table.stack td{display:block;width:100%}
 table.stack tr:first-child{display:none}
 table.stack tr{background:#fff;border:1px solid var(--line);border-radius:8px;margin-bottom:.6em;padding:.3em 0}
 table.stack td{border:0;padding:.15em .6em;overflow-wrap:anywhere;min-width:0}
 table.stack td:empty{display:none}table.stack textarea{min-width:0}
 form.actions input,form.actions select{min-width:0;max-width:100%}
}
"""

# Every string a page shows, in English and Russian. A phrase with a count
# is a tuple of its plural forms (see plural_form).
STRINGS = {
    "en": {
        "desk": "Desk", "crawlers": "Crawlers", "pending": "pending", "processing": "processing",
        "done_today": "done today", "failed": "failed", "reset_dead": "Reset dead sources",
        "dead_count": "{n} dead", "status.new": "to decide", "status.approved": "approved",
        "status.rejected": "rejected", "status.any": "any status",
        "all_directions": "all directions", "no_direction": "no direction",
        "all_sources": "all sources", "sort.newest": "newest first",
        "sort.relevance": "most relevant first", "sort.interest": "most interesting first",
        "sort.likely": "most likely approved first",
        "min": "relevance at least", "search": "Search title and text",
        "show": "Show", "approve": "Approve", "reject": "Reject", "undo": "Undo",
        "reject_shown": ("Reject the {n} post shown", "Reject all {n} shown"),
        "relevance": "relevance", "interest": "interest", "likely": "likely approved",
        "weighed": "weighed most", "let_in": "no keyword matched: the model let it in",
        "keywords": "keywords", "keywords_other": "other directions' keywords",
        "reason": "why", "stored_text": "Stored text",
        "more_sources": ("+{count} source", "+{count} sources"), "every_copy": "every copy",
        "adds": "its own: {sites}",
        "unsure": "the model is unsure of this one: your decision teaches it most",
        "more_copies": ("and {count} more", "and {count} more"),
        "older": "older →", "first": "← newest", "next": "next →", "to_first": "← first",
        "untitled": "(untitled)",
        "empty_filtered": "No posts match these filters.",
        "empty_none": "No classified posts yet: they appear here as the workers classify "
                      "the queue.",
        "hidden_low": ("{n} less relevant post is hidden.", "{n} less relevant posts are hidden."),
        "hidden_floor": ("{n} post is hidden: less relevant, or unlikely to be approved.",
                         "{n} posts are hidden: less relevant, or unlikely to be approved."),
        "show_all": "Show them",
        "many_matches": ("more than {n} match", "more than {n} matches"), "utc": "UTC",
        "undated": "undated · fetched",
        "banner_ollama": "Classification is stopped: Ollama has been unreachable since {since} "
                         "UTC ({error}). Posts wait in the queue until it answers; to classify "
                         "by keywords alone, set OLLAMA_URL= (empty).",
        "banner_no_worker": tuple(
            f"{{n}} {waits} and no worker has run {{when}}: start "
            "`python vesti.py worker --forever` or `python vesti.py run`."
            for waits in ("post waits", "posts wait")),
        "never": "yet", "for_minutes": ("for {n} minute", "for {n} minutes"),
        "banner_keywords": "Keyword-only mode: OLLAMA_URL is empty, so relevance comes from "
                           "keyword hits alone.",
        "banner_sources": "{file} was changed but could not be loaded ({since} UTC): {error}. "
                          "The sources are as they were; the file is read again when it "
                          "changes.",
        "classifying": ("{count} post is still being classified.",
                        "{count} posts are still being classified."),
        "ollama_waits": ("Ollama cannot be reached, so {count} post waits to be classified; it "
                         "appears here once Ollama answers.",
                         "Ollama cannot be reached, so {count} posts wait to be classified; they "
                         "appear here once Ollama answers."),
        "keys_title": "Keyboard", "key.j": "next card", "key.k": "previous card",
        "key.a": "approve", "key.r": "reject", "key.u": "undo the last decision",
        "key.o": "open the article", "key./": "search", "key.?": "this list",
        "keys_hint": "Press ? for keys", "filters": "Filters",
        "not_saved": "Not saved: {why}. {retry}",
        "unreachable": "the server could not be reached",
        "answered": "the server answered {status} ({answer})",
        "changed": "the post changed since this page was loaded; reload it to see the post",
        "retry.approved": "Press a to try again.", "retry.rejected": "Press r to try again.",
        "retry.new": "Press Undo to try again.", "retry.bulk": "Press the button to try again.",
        "bulk_ask.rejected": ("Reject this {n} post?", "Reject these {n} posts?"),
        "bulk_ask.approved": ("Approve this {n} post?", "Approve these {n} posts?"),
        "bulk_ask.new": ("Set this {n} post back to decide?",
                         "Set these {n} posts back to decide?"),
        "bulk_done": ("{n} post rejected.", "{n} posts rejected."),
        "yes": "Yes", "cancel": "Cancel",
        "col.source": "source", "col.crawler": "crawler", "col.status": "status",
        "col.priority": "priority", "col.last_fetch": "last fetch (UTC)", "col.errors": "errors",
        "col.last_error": "last error", "col.posts": "posts", "col.last_run": "last run (UTC)",
        "col.etag": "ETag", "col.modified": "Last-Modified", "col.last_build_date": "lastBuildDate",
        "never_fetched": "never", "moved": "moved permanently to {url}; update sources.yaml",
        "col.week": "new posts, 7 days", "col.last_new": "last new post (UTC)",
        "col.relevant": "relevant", "col.approved": "approved",
        "silent_for": "no new post for {d}",
        "failing": "failing",
        "edited": "Edited after your decision ({decision} by {who}, {when} UTC): decide again.",
        "edit_texts": "Before and after the edit", "before_edit": "Before the edit",
        "after_edit": "Now",
        "outbox": "Outbox", "o.none": "No publish targets: add a publish: list to sources.yaml "
        "(a Telegram channel, a webhook, an alert chat) and approved posts queue here.",
        "o.empty": "Nothing yet: approved posts of its directions queue here.",
        "o.kind.telegram": "Telegram", "o.kind.webhook": "webhook", "o.kind.alert": "alerts",
        "o.all": "every direction", "o.every": "at most one post every {every}",
        "o.now": "no pace", "o.per_hour": "at most {n} a hour, relevance {min}+",
        "o.paused": "paused until {when} UTC",
        "o.disabled": "not in sources.yaml any more: nothing is sent",
        "o.last_sent": "last sent {when} UTC",
        "o.col.post": "post", "o.col.state": "state", "o.col.queued": "queued (UTC)",
        "o.col.sent": "sent (UTC)", "o.col.tries": "tries", "o.col.message": "message",
        "o.col.error": "error",
        "o.state.queued": "queued", "o.state.sending": "sending", "o.state.published": "published",
        "o.state.failed": "failed", "o.state.uncertain": "uncertain",
        "o.state.cancelled": "cancelled",
        "o.deleting": "taken back: being deleted", "o.deleted": "deleted {when} UTC",
        "o.uncertain": "No answer said what became of this send: it may or may not have "
        "arrived. Look at the channel, then mark it published or send it again.",
        "o.taken_back_uncertain": "Taken back, but this send may have arrived in {chat}: no "
        "answer named its message, so it cannot be deleted from here. Look in the channel, "
        "delete it there if it is, then press the button.",
        "o.checked": "Checked the channel", "o.text": "text sent",
        "o.plain_hint": "Plain text: the first line goes in bold, links stay links.",
        "o.empty_text": "The text to send must not be empty. Nothing was saved.",
        "o.too_long": "This text is {n} characters as Telegram counts them (a link by its "
        "label); at most {limit} fit. Nothing was saved: shorten it and save again.",
        "o.sender": "sent by {who} until {until} UTC",
        "banner_target": "Publishing to", "banner_paused": "paused until {when} UTC: {error}.",
        "banner_failing": "failing: {error}.",
        "banner_needs": ("{n} send needs an editor (failed, or may not have arrived).",
                         "{n} sends need an editor (failed, or may not have arrived)."),
        "banner_waiting": ("{n} post waits.", "{n} posts wait."),
        "deletes": "This deletes the message in {where}. Take the decision back?",
        "state.alive": "alive", "state.dead": "dead", "state.silent": "silent",
        "state.disabled": "disabled",
        "signed_out": "You are signed out (the session ended): nothing more is saved from this "
        "page.", "sign_in_again": "Sign in again",
        "set_by": "Set to {status} by {who} meanwhile.",
        "o.save": "Save text", "o.now_button": "Publish now", "o.cancel": "Cancel",
        "o.published_button": "Mark published", "o.again": "Send again",
        "o.hurry": "next, ahead of the pace",
        "users": "Users", "sign_out": "Sign out", "sign_in": "Sign in",
        "role.viewer": "viewer", "role.editor": "editor", "role.admin": "admin",
        "login.title": "Sign in to VESTI", "login.user": "Name", "login.password": "Password",
        "conflict.title": "Not decided", "conflict.back": "Back to the desk, as it is now",
        "login.wrong": "Wrong name or password.",
        "login.busy": "Signing in waits for a moment: another sign-in is being checked. "
                      "Try again in a few seconds.",
        "login.locked.name": "Too many wrong passwords for this name: every try is refused "
        "until {when} UTC (in {minutes} min), the right password too. Ask an admin if it "
        "was not you.",
        "login.locked.address": "Too many wrong passwords from this address: every try from "
        "it is refused until {when} UTC (in {minutes} min).",
        "u.name": "name", "u.role": "role", "u.state": "state", "u.created": "created (UTC)",
        "u.sessions": "sessions", "u.disabled": "disabled", "u.enabled": "active",
        "u.add": "Add user", "u.password": "new password (8 characters or more)",
        "u.set_role": "Change role", "u.set_password": "Set password",
        "u.disable": "Disable", "u.enable": "Enable",
        "u.env": "{name} (the account VESTI_WEB_USER names, admin unless set) is always an "
        "admin: its password is VESTI_WEB_PASSWORD (or the one printed at the first start).",
        "u.by_settings": "by the settings (VESTI_WEB_USER)",
        "u.locks": "Sign-ins refused now", "u.no_locks": "Nobody: no name or address gave too "
        "many wrong passwords in the last 15 minutes.",
        "u.locked": "locked", "u.until": "until (UTC)", "u.lock.name": "name",
        "u.lock.address": "address",
        "event.decide": "decided", "event.sign in": "signed in", "event.sign out": "signed out",
        "event.sign-in failed": "wrong password", "event.sign-in locked": "sign-ins locked",
        "event.user add": "added a user", "event.user change": "changed a user",
        "event.reset dead": "reset dead sources",
        "event.publication text": "edited a publication's text",
        "event.publication now": "published now", "event.publication cancel": "cancelled a publication",
        "event.publication published": "marked published", "event.publication again": "sent again",
        "u.events": "What was done lately", "u.when": "when (UTC)", "u.who": "who",
        "u.from": "from", "u.what": "what",
        "decided_by": "{decision} by {who}, {when} UTC", "looking": "· {names} looking",
        "quality": "Report card", "q.none": "No direction to report on.",
        "q.no_decisions": "No decisions yet: {titles}.",
        "q.approved_of": ("Editors approved {approved} of {n} decision ({rate} %).",
                          "Editors approved {approved} of {n} decisions ({rate} %)."),
        "q.used": "Its learned model is used: each card's chance (likely approved) and the "
                  "desk's floor come from it.",
        "q.unused": "No model yet: one is learned from {min} decisions, at least {each} approved "
                    "and {each} rejected; until then the desk is as keywords make it.",
        "q.no_signal": "A model is learned from these decisions, but they do not tell posts apart "
                       "beyond chance: no card's chance comes from it, and the desk is as keywords "
                       "make it. This is checked again every {every} decisions.",
        "q.agrees": ("The desk agrees with the editors on {share} % of {n} decision, {kappa} "
                     "beyond chance (Cohen's κ).",
                     "The desk agrees with the editors on {share} % of {n} decisions, {kappa} "
                     "beyond chance (Cohen's κ)."),
        "q.agrees_alike": ("The desk agrees with the editors on {share} % of {n} decision; how far "
                           "beyond chance cannot be told, as the desk or the editors said the same "
                           "of every post.",
                           "The desk agrees with the editors on {share} % of {n} decisions; how far "
                           "beyond chance cannot be told, as the desk or the editors said the same "
                           "of every post."),
        "q.agree_few": ("Agreement with the editors: too few to say ({n} decision; {min} needed).",
                        "Agreement with the editors: too few to say ({n} decisions; {min} needed)."),
        "q.kappa_means": "The desk agrees when it shows a post the editors approve or hides one "
                         "they reject. Cohen's κ takes away the agreement chance alone would give: "
                         "0 is no better than chance, 1 is agreeing on every post, below 0 is worse "
                         "than chance.",
        "q.misses": ("The model let in {n} post no keyword matched, {shown} of them on the "
                     "desk as it opens (the rest wait under its floor); the editors approved "
                     "{approved} of the {decided} they decided.",
                     "The model let in {n} posts no keyword matched, {shown} of them on the "
                     "desk as it opens (the rest wait under its floor); the editors approved "
                     "{approved} of the {decided} they decided."),
        "q.week": "What learning changed on the desk among the posts published in the last 7 days",
        "q.week_none": "Nothing: no post published in the last 7 days was shown or hidden "
                        "because of the model.",
        "q.change": "change", "q.posts": "posts", "q.decided": "decided",
        "q.approved": "approved of decided", "q.share": "share approved",
        "q.raised": "shown by the model: relevance under {floor}, chance {high} or more",
        "q.lowered": "hidden by the model: relevance {floor} or more, chance under {low}",
        "q.precision": "The first 20 and 50 posts of each order, approved",
        "q.precision_few": ("The first 20 and 50 of each order: too few to say ({n} decision held "
                            "out; {min} needed).",
                            "The first 20 and 50 of each order: too few to say ({n} decisions held "
                            "out; {min} needed)."),
        "q.order": "order", "q.first": "first {k}",
        "q.learned": "by the learned model", "q.by_relevance": "by relevance alone",
        "q.cell": "{approved} of {n}: {rate} (95 %: {low}–{high})",
        "q.held_out": ("Held out: the newest {n} decision, ranked as a model learned from the "
                       "{older} before it ranks it. In brackets: where the share likely lies.",
                       "Held out: the newest {n} decisions, ranked as a model learned from the "
                       "{older} before them ranks them. In brackets: where each share likely lies."),
        "q.fewer": "Only {n} are held out, so the first {k} are all of them: the range in brackets "
                   "says how loose that is.",
        "q.calibration": "Does the model's chance come true?",
        "q.calibration_label": "Chart: for each tenth of the chance the model gave, the share of "
                               "those posts the editors approved, beside the diagonal where a "
                               "chance comes true as often as it says",
        "q.axis_likely": "the chance the model gave (likely approved)",
        "q.axis_approved": "approved by the editors",
        "q.bars": ("Bars: what the editors did with the {n} post decided while the model gave a "
                   "chance, the number over a bar how many it rests on",
                   "Bars: what the editors did with the {n} posts decided while the model gave a "
                   "chance, the number over a bar how many it rests on"),
        "q.diagonal": "the dashed diagonal: a chance that comes true, a chance of 0.7 approved "
                      "7 times in 10",
        "q.reading": "A bar under the diagonal: the model promised more than the editors approved; "
                     "over it, less.",
        "q.calibration_none": "No decided post had a chance from the model yet: this waits for "
                              "decisions made while the model is used.",
        "q.tenth": "chance", "q.by_relevance_title": "Approved per relevance",
        "q.sources": "Approved per source", "q.source": "source", "q.range": "95 % range",
        "q.interval_means": "The 95 % range is where a source's share likely lies: the fewer its "
                            "decisions, the wider it is.",
        "q.worst": "Where the model and the editors disagree most",
        "q.editors": "Each editor's decisions", "q.editor": "editor",
        "q.decisions_col": "decisions", "q.per_day": "a day",
        "q.pairs": "Editors who decided the same story", "q.editor_pair": "editors",
        "q.agreed": "agreed",
        "q.agreement": "{agreed} of {pairs} agreed",
        "q.no_pairs": "No story was decided by two editors yet.",
    },
    "ru": {
        "desk": "Отбор", "crawlers": "Источники", "pending": "в очереди",
        "processing": "в работе", "done_today": "готово сегодня", "failed": "ошибки",
        "reset_dead": "Сбросить dead", "dead_count": "мёртвых: {n}",
        "status.new": "к решению", "status.approved": "одобрено", "status.rejected": "отклонено",
        "status.any": "все решения", "all_directions": "все направления",
        "no_direction": "без направления", "all_sources": "все источники",
        "sort.newest": "сначала новые", "sort.relevance": "сначала релевантные",
        "sort.interest": "сначала интересные", "sort.likely": "сначала вероятно одобряемые",
        "min": "релевантность не ниже",
        "search": "Поиск по заголовку и тексту", "show": "Показать", "approve": "Одобрить",
        "reject": "Отклонить", "undo": "Вернуть",
        "reject_shown": ("Отклонить {n} показанный пост", "Отклонить все {n} показанных поста",
                         "Отклонить все {n} показанных постов"),
        "relevance": "релевантность", "interest": "интерес", "keywords": "ключевые слова",
        "keywords_other": "ключевые слова других направлений",
        "likely": "вероятность одобрения", "weighed": "больше всего весили",
        "let_in": "ключевых слов нет: пост добавила модель",
        "reason": "почему", "stored_text": "Сохранённый текст", "older": "старше →",
        "next": "дальше →", "to_first": "← в начало",
        "adds": "от себя: {sites}",
        "unsure": "модель не уверена в этом посте: ваше решение научит её больше всего",
        "more_sources": ("ещё {count} источник", "ещё {count} источника",
                         "ещё {count} источников"),
        "every_copy": "все копии",
        "more_copies": ("и ещё {count}", "и ещё {count}", "и ещё {count}"),
        "first": "← новые", "untitled": "(без заголовка)",
        "empty_filtered": "Под эти фильтры ничего не подходит.",
        "empty_none": "Классифицированных постов пока нет: они появятся здесь, когда воркеры "
                      "разберут очередь.",
        "hidden_low": ("{n} менее релевантный пост скрыт.", "{n} менее релевантных поста скрыты.",
                       "{n} менее релевантных постов скрыто."),
        "hidden_floor": ("{n} пост скрыт: менее релевантный или вряд ли будет одобрен.",
                         "{n} поста скрыты: менее релевантные или вряд ли будут одобрены.",
                         "{n} постов скрыто: менее релевантные или вряд ли будут одобрены."),
        "show_all": "Показать их",
        "many_matches": ("больше {n} совпадения", "больше {n} совпадений", "больше {n} совпадений"),
        "utc": "UTC",
        "undated": "без даты · получен",
        "banner_ollama": "Классификация остановлена: Ollama недоступна с {since} UTC ({error}). "
                         "Посты ждут в очереди, пока она не ответит; чтобы классифицировать "
                         "только по ключевым словам, задайте пустой OLLAMA_URL=.",
        "banner_no_worker": tuple(
            f"В очереди {{n}} {posts}, а воркер не работал {{when}}: запустите "
            "`python vesti.py worker --forever` или `python vesti.py run`."
            for posts in ("пост", "поста", "постов")),
        "never": "ни разу", "for_minutes": ("уже {n} минуту", "уже {n} минуты", "уже {n} минут"),
        "banner_keywords": "Режим ключевых слов: OLLAMA_URL пуст, релевантность считается "
                           "только по совпадениям ключевых слов.",
        "banner_sources": "{file} изменён, но не загружен ({since} UTC): {error}. Источники "
                          "остались прежними; файл будет прочитан снова, когда изменится.",
        "classifying": ("{count} пост ещё классифицируется.", "{count} поста ещё классифицируются.",
                        "{count} постов ещё классифицируются."),
        "ollama_waits": tuple(
            f"Ollama недоступна, поэтому {{count}} {posts} классификации; {they} здесь, когда "
            "она ответит." for posts, they in (("пост ждёт", "он появится"),
                                               ("поста ждут", "они появятся"),
                                               ("постов ждут", "они появятся"))),
        "keys_title": "Клавиши", "key.j": "следующая карточка", "key.k": "предыдущая карточка",
        "key.a": "одобрить", "key.r": "отклонить", "key.u": "отменить последнее решение",
        "key.o": "открыть статью", "key./": "поиск", "key.?": "этот список",
        "keys_hint": "? — список клавиш", "filters": "Фильтры",
        "not_saved": "Не сохранено: {why}. {retry}",
        "unreachable": "не удалось связаться с сервером",
        "answered": "сервер ответил {status} ({answer})",
        "changed": "пост изменился после загрузки страницы; обновите её, чтобы его увидеть",
        "retry.approved": "Нажмите a, чтобы попробовать ещё раз.",
        "retry.rejected": "Нажмите r, чтобы попробовать ещё раз.",
        "retry.new": "Нажмите «Вернуть», чтобы попробовать ещё раз.",
        "retry.bulk": "Нажмите кнопку, чтобы попробовать ещё раз.",
        "bulk_ask.rejected": ("Отклонить {n} пост?", "Отклонить {n} поста?",
                              "Отклонить {n} постов?"),
        "bulk_ask.approved": ("Одобрить {n} пост?", "Одобрить {n} поста?", "Одобрить {n} постов?"),
        "bulk_ask.new": ("Вернуть к решению {n} пост?", "Вернуть к решению {n} поста?",
                         "Вернуть к решению {n} постов?"),
        "bulk_done": ("{n} пост отклонён.", "{n} поста отклонены.", "{n} постов отклонено."),
        "yes": "Да", "cancel": "Отмена",
        "col.source": "источник", "col.crawler": "тип", "col.status": "статус",
        "col.priority": "приоритет", "col.last_fetch": "последний запрос (UTC)",
        "col.errors": "ошибок", "col.last_error": "последняя ошибка", "col.posts": "постов",
        "col.last_run": "последний запуск (UTC)", "col.etag": "ETag",
        "col.modified": "Last-Modified", "col.last_build_date": "lastBuildDate",
        "never_fetched": "ни разу", "moved": "переехал насовсем на {url}; поправьте sources.yaml",
        "col.week": "новых постов за 7 дней", "col.last_new": "последний новый пост (UTC)",
        "col.relevant": "релевантных", "col.approved": "одобрено",
        "silent_for": "нет новых постов {d}",
        "failing": "сбоит",
        "edited": "Изменён после вашего решения ({decision}, {who}, {when} UTC): решите снова.",
        "edit_texts": "До и после правки", "before_edit": "До правки", "after_edit": "Сейчас",
        "outbox": "Публикация", "o.none": "Нет адресов публикации: добавьте список publish: в "
        "sources.yaml (канал Telegram, вебхук, чат для оповещений), и одобренные посты встанут здесь в очередь.",
        "o.empty": "Пока пусто: сюда встают одобренные посты его направлений.",
        "o.kind.telegram": "Telegram", "o.kind.webhook": "вебхук", "o.kind.alert": "оповещения",
        "o.all": "все направления", "o.every": "не чаще одного поста в {every}",
        "o.now": "без темпа", "o.per_hour": "не больше {n} в час, релевантность от {min}",
        "o.paused": "на паузе до {when} UTC",
        "o.disabled": "больше нет в sources.yaml: ничего не отправляется",
        "o.last_sent": "последняя отправка {when} UTC",
        "o.col.post": "пост", "o.col.state": "состояние", "o.col.queued": "в очереди с (UTC)",
        "o.col.sent": "отправлен (UTC)", "o.col.tries": "попыток", "o.col.message": "сообщение",
        "o.col.error": "ошибка",
        "o.state.queued": "в очереди", "o.state.sending": "отправляется",
        "o.state.published": "опубликован", "o.state.failed": "не отправлен",
        "o.state.uncertain": "неизвестно", "o.state.cancelled": "отменён",
        "o.deleting": "отозван: удаляется", "o.deleted": "удалён {when} UTC",
        "o.uncertain": "Ответа не было: сообщение могло дойти, а могло и нет. "
        "Посмотрите в канал, затем отметьте его опубликованным или отправьте снова.",
        "o.taken_back_uncertain": "Отозвано, но сообщение могло дойти в {chat}: ответ не назвал "
        "его номер, поэтому удалить его отсюда нельзя. Посмотрите в канал, удалите его там, "
        "если оно есть, затем нажмите кнопку.",
        "o.checked": "Канал проверен", "o.text": "отправленный текст",
        "o.plain_hint": "Простой текст: первая строка жирным, ссылки остаются ссылками.",
        "o.empty_text": "Текст не может быть пустым. Ничего не сохранено.",
        "o.too_long": "В этом тексте {n} знаков по счёту Telegram (ссылка — по её подписи); "
        "помещается не больше {limit}. Ничего не сохранено: сократите текст и сохраните снова.",
        "o.sender": "отправляет {who} до {until} UTC",
        "banner_target": "Публикация в", "banner_paused": "на паузе до {when} UTC: {error}.",
        "banner_failing": "сбой: {error}.",
        "banner_needs": ("{n} отправка ждёт редактора (не отправлена или могла не дойти).",
                         "{n} отправки ждут редактора (не отправлены или могли не дойти).",
                         "{n} отправок ждут редактора (не отправлены или могли не дойти)."),
        "banner_waiting": ("ждёт {n} пост.", "ждут {n} поста.", "ждут {n} постов."),
        "deletes": "Это удалит сообщение в {where}. Отменить решение?",
        "state.alive": "работает", "state.dead": "dead (не отвечает)", "state.silent": "молчит",
        "state.disabled": "отключён", "trigger.schedule": "по расписанию", "trigger.cli": "вручную",
        "trigger.cron": "cron", "trigger.web": "со страницы", "run.ok": "успешно",
        "run.error": "ошибка", "run.deferred": "отложено", "run.running": "идёт",
        "run.interrupted": "прервано",
        "signed_out": "Вы вышли (сеанс закончился): с этой страницы больше ничего не "
        "сохраняется.", "sign_in_again": "Войти снова",
        "set_by": "Тем временем {who}: {status}.",
        "o.save": "Сохранить текст", "o.now_button": "Опубликовать сейчас", "o.cancel": "Отменить",
        "o.published_button": "Отметить опубликованным", "o.again": "Отправить снова",
        "o.hurry": "следующий, вне темпа",
        "users": "Пользователи", "sign_out": "Выйти", "sign_in": "Войти",
        "role.viewer": "читатель", "role.editor": "редактор", "role.admin": "администратор",
        "login.title": "Вход в VESTI", "login.user": "Имя", "login.password": "Пароль",
        "conflict.title": "Решение не принято", "conflict.back": "Назад к отбору, каким он стал",
        "login.wrong": "Неверное имя или пароль.",
        "login.busy": "Вход подождёт немного: сейчас проверяется другой вход. Попробуйте ещё "
                      "раз через несколько секунд.",
        "login.locked.name": "Слишком много неверных паролей для этого имени: до {when} UTC "
        "(ещё {minutes} мин) отказ на любую попытку, и с верным паролем тоже. Если это были "
        "не вы, скажите администратору.",
        "login.locked.address": "Слишком много неверных паролей с этого адреса: до {when} UTC "
        "(ещё {minutes} мин) отказ на любую попытку с него.",
        "u.name": "имя", "u.role": "роль", "u.state": "состояние", "u.created": "создан (UTC)",
        "u.sessions": "сеансы", "u.disabled": "отключён", "u.enabled": "активен",
        "u.add": "Добавить", "u.password": "новый пароль (от 8 символов)",
        "u.set_role": "Сменить роль", "u.set_password": "Задать пароль",
        "u.disable": "Отключить", "u.enable": "Включить",
        "u.env": "{name} (учётная запись, которую называет VESTI_WEB_USER, по умолчанию admin) "
        "— всегда администратор: её пароль — VESTI_WEB_PASSWORD (или напечатанный при первом "
        "запуске).",
        "u.by_settings": "задан настройками (VESTI_WEB_USER)",
        "u.locks": "Кому сейчас отказано во входе", "u.no_locks": "Никому: за последние 15 минут "
        "ни одно имя и ни один адрес не дали слишком много неверных паролей.",
        "u.locked": "заблокировано", "u.until": "до (UTC)", "u.lock.name": "имя",
        "u.lock.address": "адрес",
        "event.decide": "решение", "event.sign in": "вход", "event.sign out": "выход",
        "event.sign-in failed": "неверный пароль", "event.sign-in locked": "вход заблокирован",
        "event.user add": "добавлен пользователь", "event.user change": "изменён пользователь",
        "event.reset dead": "сброс dead-источников",
        "event.publication text": "изменён текст публикации",
        "event.publication now": "опубликовать сейчас", "event.publication cancel": "публикация отменена",
        "event.publication published": "отмечено опубликованным",
        "event.publication again": "отправить снова",
        "u.events": "Последние действия", "u.when": "когда (UTC)", "u.who": "кто",
        "u.from": "откуда", "u.what": "что",
        "decided_by": "{decision}: {who}, {when} UTC", "looking": "· смотрит: {names}",
        "quality": "Качество", "q.none": "Нет направлений для отчёта.",
        "q.no_decisions": "Пока без решений: {titles}.",
        "q.approved_of": ("Редакторы одобрили {approved} из {n} решения ({rate} %).",
                          "Редакторы одобрили {approved} из {n} решений ({rate} %).",
                          "Редакторы одобрили {approved} из {n} решений ({rate} %)."),
        "q.used": "Обученная модель используется: от неё вероятность одобрения на каждой "
                  "карточке и порог отбора.",
        "q.unused": "Модели пока нет: она обучается с {min} решений, среди них не меньше {each} "
                    "одобренных и {each} отклонённых; до тех пор отбор идёт по ключевым словам.",
        "q.no_signal": "Модель обучена на этих решениях, но они не отличают одни посты от других "
                       "надёжнее случая: вероятности на карточках не от неё, отбор идёт по "
                       "ключевым словам. Это проверяется снова каждые {every} решений.",
        "q.agrees": ("Отбор согласен с редакторами в {share} % из {n} решения, на {kappa} лучше "
                     "случайного (каппа Коэна, κ).",
                     "Отбор согласен с редакторами в {share} % из {n} решений, на {kappa} лучше "
                     "случайного (каппа Коэна, κ).",
                     "Отбор согласен с редакторами в {share} % из {n} решений, на {kappa} лучше "
                     "случайного (каппа Коэна, κ)."),
        "q.agrees_alike": ("Отбор согласен с редакторами в {share} % из {n} решения; насколько "
                           "это лучше случайного, не сказать: отбор или редакторы решили обо всех "
                           "постах одно и то же.",
                           "Отбор согласен с редакторами в {share} % из {n} решений; насколько "
                           "это лучше случайного, не сказать: отбор или редакторы решили обо всех "
                           "постах одно и то же.",
                           "Отбор согласен с редакторами в {share} % из {n} решений; насколько "
                           "это лучше случайного, не сказать: отбор или редакторы решили обо всех "
                           "постах одно и то же."),
        "q.agree_few": ("Согласие с редакторами: слишком мало, чтобы судить ({n} решение; "
                        "нужно {min}).",
                        "Согласие с редакторами: слишком мало, чтобы судить ({n} решения; "
                        "нужно {min}).",
                        "Согласие с редакторами: слишком мало, чтобы судить ({n} решений; "
                        "нужно {min})."),
        "q.kappa_means": "Отбор согласен, когда показывает пост, который редакторы одобряют, или "
                         "скрывает тот, что они отклоняют. Каппа Коэна вычитает согласие, которое "
                         "дал бы один случай: 0 — не лучше случая, 1 — согласие во всём, меньше 0 "
                         "— хуже случая.",
        "q.misses": ("Модель приняла {n} пост, в котором не нашлось ключевых слов; отбор "
                     "сразу показывает {shown} из них (остальные ждут ниже порога); редакторы одобрили "
                     "{approved} из {decided} решённых.",
                     "Модель приняла {n} поста, в которых не нашлось ключевых слов; отбор "
                     "сразу показывает {shown} из них (остальные ждут ниже порога); редакторы одобрили "
                     "{approved} из {decided} решённых.",
                     "Модель приняла {n} постов, в которых не нашлось ключевых слов; отбор "
                     "сразу показывает {shown} из них (остальные ждут ниже порога); редакторы одобрили "
                     "{approved} из {decided} решённых."),
        "q.week": "Что обучение изменило в отборе среди постов, опубликованных за последние 7 дней",
        "q.week_none": "Ничего: ни один пост, опубликованный за последние 7 дней, не показан и "
                        "не скрыт из-за модели.",
        "q.change": "изменение", "q.posts": "постов", "q.decided": "решено",
        "q.approved": "одобрено из решённых", "q.share": "доля одобренных",
        "q.raised": "показаны моделью: релевантность ниже {floor}, вероятность {high} и выше",
        "q.lowered": "скрыты моделью: релевантность {floor} и выше, вероятность ниже {low}",
        "q.precision": "Одобрено из первых 20 и 50 постов каждого порядка",
        "q.precision_few": ("Первые 20 и 50 каждого порядка: слишком мало, чтобы судить "
                            "(отложено {n} решение; нужно {min}).",
                            "Первые 20 и 50 каждого порядка: слишком мало, чтобы судить "
                            "(отложено {n} решения; нужно {min}).",
                            "Первые 20 и 50 каждого порядка: слишком мало, чтобы судить "
                            "(отложено {n} решений; нужно {min})."),
        "q.order": "порядок", "q.first": "первые {k}",
        "q.learned": "по обученной модели", "q.by_relevance": "только по релевантности",
        "q.cell": "{approved} из {n}: {rate} (95 %: {low}–{high})",
        "q.held_out": ("Отложено последнее {n} решение; порядок — как у модели, обученной на "
                       "более ранних ({older}). В скобках — где вероятно лежит доля.",
                       "Отложены последние {n} решения; порядок — как у модели, обученной на "
                       "более ранних ({older}). В скобках — где вероятно лежит каждая доля.",
                       "Отложены последние {n} решений; порядок — как у модели, обученной на "
                       "более ранних ({older}). В скобках — где вероятно лежит каждая доля."),
        "q.fewer": "Отложено всего {n}, и первые {k} — это все они: насколько цифра нетвёрдая, "
                   "показывает диапазон в скобках.",
        "q.calibration": "Сбывается ли вероятность модели?",
        "q.calibration_label": "График: для каждой десятой доли вероятности, которую дала модель, "
                               "доля таких постов, одобренных редакторами, рядом с диагональю, где "
                               "вероятность сбывается так часто, как обещает",
        "q.axis_likely": "вероятность одобрения по модели",
        "q.axis_approved": "одобрено редакторами",
        "q.bars": ("Столбцы: что редакторы решили о {n} посте, решённом, пока модель давала "
                   "вероятность; число над столбцом — на скольких он основан",
                   "Столбцы: что редакторы решили о {n} постах, решённых, пока модель давала "
                   "вероятность; число над столбцом — на скольких он основан",
                   "Столбцы: что редакторы решили о {n} постах, решённых, пока модель давала "
                   "вероятность; число над столбцом — на скольких он основан"),
        "q.diagonal": "пунктирная диагональ — вероятность, которая сбывается: из постов с "
                      "вероятностью 0,7 одобрены 7 из 10",
        "q.reading": "Столбец ниже диагонали: модель обещала больше, чем одобрили редакторы; "
                     "выше — меньше.",
        "q.calibration_none": "Ещё ни один решённый пост не получил вероятность от модели: "
                              "график ждёт решений, принятых, пока модель используется.",
        "q.tenth": "вероятность", "q.by_relevance_title": "Одобрено по релевантности",
        "q.sources": "Одобрено по источникам", "q.source": "источник", "q.range": "диапазон 95 %",
        "q.interval_means": "Диапазон 95 % — где вероятно лежит доля источника: чем меньше у него "
                            "решений, тем диапазон шире.",
        "q.worst": "Где модель и редакторы расходятся сильнее всего",
        "q.editors": "Решения каждого редактора", "q.editor": "редактор",
        "q.decisions_col": "решений", "q.per_day": "в день",
        "q.pairs": "Редакторы, решавшие одну историю", "q.editor_pair": "редакторы",
        "q.agreed": "согласие",
        "q.agreement": "согласились {agreed} из {pairs}",
        "q.no_pairs": "Пока ни одну историю не решали два редактора.",
    },
}
LANGUAGES = tuple(STRINGS)


def esc(value):
    """Everything shown on a page goes through here."""
    if value is None:
        return ""
    if type(value) is int:      # nothing to escape in a number: the long tables have many
        return str(value)
    return html.escape(str(value), quote=True)


def choose_language(setting, asked=None, accept=None):
    """?lang= first, then VESTI_LANG, then (for auto) the browser's
    Accept-Language; English when nothing matches."""
    if asked in LANGUAGES:
        return asked
    if setting in LANGUAGES:
        return setting
    ranked = []
    for part in (accept or "").split(","):
        tag, _, weight = part.strip().partition(";q=")
        try:
            ranked.append((float(weight or 1), tag.split("-")[0].strip().lower()))
        except ValueError:
            continue
    for _, tag in sorted(ranked, reverse=True):
        if tag in LANGUAGES:
            return tag
    return "en"


class Page:
    """What every page needs to speak: the language, the form token and the
    query it was asked with."""

    def __init__(self, lang, token, query, account=None, trouble=()):
        self.lang, self.token, self.query, self.account = lang, token, query, account
        self.strings = STRINGS[lang]
        self.trouble = trouble      # outbox_trouble: the targets to name in a banner

    def may(self, role):
        """Whether the page's reader has this role (or a higher one)."""
        return self.account is None or role_allows(self.account.role, role)

    def t(self, key, **values):
        if values:
            return esc(phrase(self.lang, key, **values))
        return said(self.lang, key)

    def link(self, path, **query):
        """A link on this site that keeps the chosen language."""
        query = {k: v for k, v in query.items() if v not in (None, "")}
        if "lang" in self.query:
            query["lang"] = self.lang
        return path + ("?" + urllib.parse.urlencode(query) if query else "")


def plural_form(lang, n):
    """Which form of a counted phrase fits n: English has one and many;
    Russian one (1, 21, 101), few (2-4, 22-24) and many (5-20, 11-14, 25…)."""
    if lang != "ru":
        return 0 if n == 1 else 1
    if n % 10 == 1 and n % 100 != 11:
        return 0
    return 1 if 2 <= n % 10 <= 4 and not 12 <= n % 100 <= 14 else 2


def phrase(lang, key, **values):
    """A string of the page's language with its values, not escaped; a
    counted phrase in the form its n needs."""
    text = STRINGS[lang][key]
    if isinstance(text, tuple):
        text = text[plural_form(lang, values["n"])]
    return text.format(**values)


@functools.lru_cache(maxsize=1024)
def said(lang, key):
    """A string of the page's language, escaped: a card says the same words
    as the next."""
    return esc(STRINGS[lang][key].format())


# Run right after the filters (not with the desk's script at the end), so a
# phone never shows them unfolded first.
FOLD_FILTERS = ("(function(d){if(d.hasAttribute('data-fold')&&matchMedia('(max-width:600px)')"
                ".matches)d.open=false})(document.querySelector('details.filters'));")


DESK_SCRIPT = r"""
(function(){
var cards=[].slice.call(document.querySelectorAll('article.post')),cur=-1,last=null;
var words=JSON.parse(document.getElementById('words').textContent);
function fill(text,values){return text.replace(/\{(\w+)\}/g,function(m,k){return k in values?values[k]:m})}
function focus(i){if(!cards.length)return;cur=Math.max(0,Math.min(i,cards.length-1));
 cards.forEach(function(c,k){c.classList.toggle('current',k===cur)});
 cards[cur].scrollIntoView({block:'nearest'});look(cards[cur]);}
/* The others see which card an editor is on; the editor sees theirs. */
var looker=document.getElementById('look'),looked=null;
/* A session that ended says so once, with a link to sign in again: never a
   password pop-up over the desk (the server sends no challenge to it). */
var out=false;
function signedOut(){if(out)return;out=true;
 var p=document.createElement('p'),a=document.createElement('a');
 p.id='signed-out';p.className='banner';p.setAttribute('role','alert');
 p.textContent=words.signed_out+' ';a.textContent=words.sign_in_again;
 a.href='/login?'+new URLSearchParams({next:location.pathname+location.search});
 p.appendChild(a);document.querySelector('main').prepend(p);}
function look(card){if(!looker||!card||out)return;looked=card;
 fetch('/posts/'+card.dataset.id+'/look',{method:'POST',credentials:'same-origin',
  body:new URLSearchParams({token:looker.dataset.token}),
  headers:{'Accept':'application/json','Content-Type':'application/x-www-form-urlencoded'}})
 .then(function(r){if(r.status===401)signedOut()}).catch(function(){});}
function lookers(){if(!cards.length||out)return;
 fetch('/api/looks?ids='+cards.map(function(c){return c.dataset.id}).join(','),
  {credentials:'same-origin',headers:{'Accept':'application/json'}})
 .then(function(r){if(r.status===401)signedOut();return r.ok?r.json():{}})
 .then(function(found){cards.forEach(function(c){
  var s=c.querySelector('.looking'),names=found[c.dataset.id];if(!s)return;
  s.hidden=!names;s.textContent=names?' '+fill(words.looking,{names:names.join(', ')}):'';})})
 .catch(function(){});}
if(looker){lookers();setInterval(lookers,4000);
 setInterval(function(){if(looked)look(looked)},10000);}
function show(card,status){card.dataset.status=status;
 card.querySelector('.state').textContent=words.status[status];
 [].forEach.call(card.querySelectorAll('form.decide button'),function(b){b.disabled=b.value===status});}
/* A decision saved is made on the post as it reads now: no longer edited after one. */
function saved(card,status){card.saved=status;var mark=card.querySelector('p.edited');if(mark)mark.remove();}
function note(card,text){var p=card.querySelector('.unsaved');
 if(!p&&text){p=document.createElement('p');p.className='unsaved';p.setAttribute('role','alert');
  card.querySelector('form.decide').before(p);}
 if(p){p.textContent=text;p.hidden=!text;}
 card.classList.toggle('not-saved',!!text);}
/* Rejects with the reason in words: the server unreachable, or its answer. */
function post(action,fields){
 return fetch(action,{method:'POST',credentials:'same-origin',body:new URLSearchParams(fields),
  headers:{'Accept':'application/json','Content-Type':'application/x-www-form-urlencoded'}})
 .catch(function(){throw words.unreachable})
 .then(function(r){if(r.ok)return r.json();
  if(r.status===401){signedOut();throw words.signed_out}
  if(r.status===409&&r.headers.get('X-Vesti-Conflict')==='decided')
   throw {decided:r.headers.get('X-Vesti-Status'),
          by:decodeURIComponent(r.headers.get('X-Vesti-Decided-By')||'')};
  if(r.status===409)throw words.changed;
  return r.text().catch(function(){return ''}).then(function(t){
   throw fill(words.answered,{status:r.status,answer:t.trim().split('\n')[0].slice(0,200)})})});}
/* A decision names the words the card shows: a post edited since is refused (409). */
function send(card,status){var form=card.querySelector('form.decide');
 return post(form.action,{token:form.token.value,status:status,wording:form.wording.value,
  seen:card.saved===undefined?card.dataset.status:card.saved});}
/* A decision is shown at once; one that did not save shows the decision
   saved before it, says why, and keeps the card in focus to try again. */
function decide(card,status,move){
 if(!card.querySelector('form.decide'))return;
 /* Taking back what went out deletes it there: asked first. */
 if(status!=='approved'&&card.dataset.published&&
    (card.saved===undefined?card.dataset.status:card.saved)==='approved'&&
    !window.confirm(fill(words.deletes,{where:card.dataset.published})))return;
 last={card:card,previous:card.dataset.status};
 if(card.saved===undefined)card.saved=card.dataset.status;
 show(card,status);note(card,'');card.dataset.busy=(+card.dataset.busy||0)+1;
 /* One card's decisions reach the server in the order they were made. */
 card.chain=(card.chain||Promise.resolve()).then(function(){return send(card,status)})
 .then(function(j){saved(card,j.status);if(+card.dataset.busy===1){show(card,j.status);note(card,'')}},
  function(why){if(why&&why.decided){decidedElsewhere(card,why);return}
   if(+card.dataset.busy===1)show(card,card.saved);
   note(card,fill(words.not_saved,{why:String(why),retry:words.retry[status]}));
   focus(cards.indexOf(card));})
 .then(function(){card.dataset.busy=+card.dataset.busy-1});
 if(move)focus(cards.indexOf(card)+1);}
/* Another editor decided the card meanwhile: it shows what they decided,
   and the next key press decides knowing it. */
function decidedElsewhere(card,why){saved(card,why.decided);show(card,why.decided);
 var line=card.querySelector('p.decided'),looking=line&&line.querySelector('.looking');
 if(line){line.textContent=fill(words.set_by,{status:words.status[why.decided]||why.decided,
  who:why.by||'?'})+' ';if(looking){looking.hidden=true;line.appendChild(looking)}}
 note(card,'');}
/* "Reject all shown" asks in place first, then offers to undo for a while:
   each post goes back to the decision it had. */
var bulk=document.querySelector('form.bulk'),undoTimer=null,UNDO_MS=10000;
function bulkStep(step){['ask','confirm','done'].forEach(function(s){
 bulk.querySelector('.'+s).hidden=s!==step})}
function bulkNote(text){var p=bulk.querySelector('.unsaved');p.textContent=text;p.hidden=!text}
function bulkFailed(why){bulkNote(fill(words.not_saved,{why:String(why),retry:words.retry.bulk}))}
function bulkSend(shown,status){return post(bulk.action,{token:bulk.token.value,status:status,
 confirmed:'1',ids:shown.map(function(c){return c.dataset.id}).join(','),
 wording:bulk.wording.value})}
function settle(shown,status){shown.forEach(function(c){saved(c,status);show(c,status);note(c,'')})}
function rejectShown(){
 var shown=bulk.ids.value.split(',').map(function(id){return document.getElementById('post-'+id)})
  .filter(Boolean),before=shown.map(function(c){return c.dataset.status});
 bulkNote('');
 bulkSend(shown,'rejected').then(function(){settle(shown,'rejected');bulkStep('done');
  bulk.undo=function(){undoShown(shown,before)};
  clearTimeout(undoTimer);undoTimer=setTimeout(function(){bulkStep('ask')},UNDO_MS);},
  function(why){bulkStep('ask');bulkFailed(why)});}
function undoShown(shown,before){clearTimeout(undoTimer);bulkNote('');
 var groups={};shown.forEach(function(c,i){(groups[before[i]]=groups[before[i]]||[]).push(c)});
 Promise.all(Object.keys(groups).map(function(status){
  return bulkSend(groups[status],status).then(function(){settle(groups[status],status)})}))
 .then(function(){bulkStep('ask')},bulkFailed);}
if(bulk){
 bulk.addEventListener('submit',function(e){e.preventDefault();bulkNote('');bulkStep('confirm');
  bulk.querySelector('.yes').focus()});
 bulk.querySelector('.no').addEventListener('click',function(){bulkStep('ask')});
 bulk.querySelector('.yes').addEventListener('click',rejectShown);
 bulk.querySelector('.undo').addEventListener('click',function(){bulk.undo()});}
document.addEventListener('submit',function(e){var form=e.target;
 if(!form.classList.contains('decide')||!e.submitter)return;
 e.preventDefault();var card=form.closest('article.post');cur=cards.indexOf(card);
 decide(card,e.submitter.value,e.submitter.value!=='new');});
document.addEventListener('keydown',function(e){
 if(e.ctrlKey||e.metaKey||e.altKey||/^(INPUT|SELECT|TEXTAREA)$/.test(e.target.tagName))return;
 var card=cards[cur],keys=document.getElementById('keys');
 if(e.key==='j')focus(cur+1);else if(e.key==='k')focus(cur-1);
 else if(e.key==='a'&&card)decide(card,'approved',true);
 else if(e.key==='r'&&card)decide(card,'rejected',true);
 else if(e.key==='u'&&last)decide(last.card,last.previous,false);
 else if(e.key==='o'&&card){var a=card.querySelector('h2 a');if(a)window.open(a.href,'_blank','noopener');}
 else if(e.key==='/'){e.preventDefault();document.querySelector('input[name=q]').focus();}
 else if(e.key==='?')keys.hidden=!keys.hidden;
 else if(e.key==='Escape')keys.hidden=true;
 else return;});
})();
"""


# The outbox's script: what is left of a text's limit, counted as
# shown_length counts (JavaScript's strings count UTF-16 code units, as
# Telegram does; a link by its label).
OUTBOX_SCRIPT = r"""
(function(){
var LINK=/https?:\/\/[^\s<>"]+/gi;
function shown(text,kind){if(kind!=='telegram')return Array.from(text).length;
 return text.replace(LINK,function(url){return url.length<=%(link_max)d?url.slice(0,%(label)d):url}).length}
function count(area){var limit=+area.dataset.limit,used=shown(area.value,area.dataset.count),
 out=area.parentNode.querySelector('.counter');out.textContent=used+' / '+limit;
 out.classList.toggle('over',used>limit);}
[].forEach.call(document.querySelectorAll('textarea[data-limit]'),function(area){
 count(area);area.addEventListener('input',function(){count(area)});});
})();
""" % {"link_max": LINK_MAX, "label": LABEL_CHARS}


def script_source(script):
    """The Content-Security-Policy source that lets exactly this inline
    script run: its sha256."""
    return f"'sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}'"


# What a page may run and load (its Content-Security-Policy): its own
# scripts, by their hashes, so that a script a hostile feed smuggled past
# the escaping would not run; its styles; requests to itself. No frame, no
# plug-in, no form posting to another site.
PAGE_POLICY = ("default-src 'none'; script-src "
               + " ".join(script_source(s) for s in (FOLD_FILTERS, DESK_SCRIPT, OUTBOX_SCRIPT))
               + "; style-src 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
                 "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


###############################################################################
# Web pages ###################################################################
###############################################################################
# What every page shares (its frame, the menu, the banners, a source's state
# in words) and the crawlers page.

PAGE_SIZE = 50
# The body of a request a page reads; but for the outbox's text form, which
# may carry a webhook's text of WEBHOOK_TEXT_LIMIT characters, each up to 12
# bytes once percent-encoded (4 of UTF-8). Only an editor's is read (a
# route's role is checked first).
MAX_REQUEST_BODY = 64 * 1024
LARGE_FORMS = re.compile(r"/publications/[0-9]+")
MAX_LARGE_FORM = 12 * WEBHOOK_TEXT_LIMIT + MAX_REQUEST_BODY


def body_limit(path):
    """The largest body a request to this path may send."""
    return MAX_LARGE_FORM if LARGE_FORMS.fullmatch(path.partition("?")[0]) else MAX_REQUEST_BODY
REFRESH_SECONDS = 5
DECISIONS = ("new", "approved", "rejected")
SORTS = ("newest", "relevance", "interest", "likely")
# Each order's score (newest first has none). By likely, a post of a direction
# with no learned model yet stands as its relevance says (a tenth of it).
SCORES = {"newest": None, "relevance": "p.relevance", "interest": "p.interest",
          "likely": "coalesce(p.likely, p.relevance / 10.0)"}
# A bulk decision takes at most this many posts (a page shows 50).
MAX_BULK = 500
# Posts waiting and no worker seen for this long: the page says so.
WORKER_SILENT_AFTER = 120
# Searches matching more posts than this show no counts (counting them would
# cost more than the page).
SEARCH_COUNT_CAP = 2000
# The stored text behind a card's disclosure is cut to this many characters,
# those whose words its decision names (see wording).
CARD_TEXT = WORDED_TEXT
FEED_POSTS = 100
# How long the desk's list of sources may be reused before it is read again.
SOURCES_FRESH = 60
# Where a form may send the browser back to: a path on this site, nothing else.
LOCAL_PATH = re.compile(r"/(?![/\\])[A-Za-z0-9\-._~/?=&%+]*")
# A post's id as a form names it.
POST_ID = re.compile(r"[1-9][0-9]{0,17}")


def layout(page, title, body, here, refresh=False):
    places = [] if page.account is None else \
        [("/", "desk"), ("/crawlers", "crawlers"), ("/quality", "quality"), ("/outbox", "outbox")]
    if page.account is not None and page.may("admin"):
        places.append(("/users", "users"))
    nav = "".join(f'<a href="{esc(page.link(href))}"{" class=here" if href == here else ""}>'
                  f'{page.t(label)}</a>' for href, label in places) + signed_in(page)
    langs = " · ".join(
        f'<a href="{esc(here + "?" + urllib.parse.urlencode({**page.query, "lang": code}))}"'
        f'{" class=here" if code == page.lang else ""}>{code.upper()}</a>' for code in LANGUAGES)
    meta = f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">' if refresh else ""
    return (f'<!doctype html><html lang="{page.lang}"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">{meta}'
            f"<title>{esc(title)} · VESTI</title><style>{STYLE}</style></head>"
            f'<body><header><h1>VESTI</h1>{nav}<span class="lang">{langs}</span></header>'
            f"<main>{outbox_banners(page)}{body}</main></body></html>")


def outbox_banners(page):
    """A banner for every publish target that is failing, paused or has
    sends an editor must look at, on every page: approvals pile up
    unseen otherwise."""
    shown = []
    for target, stuck in page.trouble:
        name = f'<a href="{esc(page.link("/outbox"))}#target-{esc(target.name)}">' \
               f'{esc(target.name)}</a>'
        error = shorten(target.error or "", 200)
        if (target.paused_until or "") > utc_text():
            text = page.t("banner_paused", when=target.paused_until, error=error)
        elif target.error:
            text = page.t("banner_failing", error=error)
        else:
            text = ""
        needs = stuck.get("failed", 0) + stuck.get("uncertain", 0)
        if needs:
            text += " " + page.t("banner_needs", n=needs)
        waiting = stuck.get("queued", 0)
        if waiting:
            text += " " + page.t("banner_waiting", n=waiting)
        shown.append(f'<p class="banner outbox-trouble" role="alert">'
                     f'{page.t("banner_target")} {name}: {text.strip()}</p>')
    return "".join(shown)


def signed_in(page):
    """Who reads the page, and, for a session signed in on /login, its sign-out."""
    account = page.account
    if account is None:
        return ""
    out = (f'<form method="post" action="/logout" class="signout">'
           f'<input type="hidden" name="token" value="{esc(page.token)}">'
           f'<button>{page.t("sign_out")}</button></form>') if account.session else ""
    return (f'<span class="account small muted">{esc(account.name)} '
            f'({page.t("role." + account.role)}){out}</span>')


def minutes_since(stamp, now=None):
    then = parse_utc(stamp)
    return None if then is None else max(0, int(((time.time() if now is None else now) - then) // 60))


def banners(conn, settings, page):
    """Why classification is not happening, when it is not: Ollama down,
    no worker running while posts wait, or keyword-only mode; and a
    sources.yaml edit that was not loaded."""
    state = classification_state(conn)
    shown = []
    if ollama_down(state, settings):
        shown.append(page.t("banner_ollama", since=state["ollama_down_since"],
                            error=shorten(state["ollama_error"], 200)))
    silent = minutes_since(state["worker_seen"])
    pending = (silent is None or silent * 60 >= WORKER_SILENT_AFTER) and pending_count(conn)
    if pending:
        when = page.strings["never"] if silent is None else \
            phrase(page.lang, "for_minutes", n=silent)
        shown.append(page.t("banner_no_worker", n=pending, when=when))
    if (state["classify_mode"] or ("ollama" if settings.ollama_url else "keywords")) == "keywords":
        shown.append(page.t("banner_keywords"))
    rejected = sources_rejected(conn)
    if rejected:
        shown.append(page.t("banner_sources", file=rejected[0], since=rejected[2],
                            error=shorten(rejected[1].splitlines()[0], 300)))
    return "".join(f'<p class="banner" role="status">{text}</p>' for text in shown)


def queue_cards(queue, page):
    return '<section class="cards">' + "".join(
        f'<div class="card" id="queue-{key}"><span>{page.t(key)}</span><b>{int(queue[key])}</b></div>'
        for key in ("pending", "processing", "done_today", "failed")) + "</section>"


def last_error_html(s):
    """The last error, cut to 200 characters; for a feed that worked but is
    malformed, the parser's warning instead, in grey."""
    if s["last_error"]:
        return esc(shorten(s["last_error"], 200))
    if s["crawler"] == "rss" and s["feed_warning"]:
        return f'<span class="muted">{esc(shorten(s["feed_warning"], 200))}</span>'
    return ""


def source_state(s):
    """disabled, dead, silent or alive."""
    if not s["enabled"]:
        return "disabled"
    if s["status"] == "alive" and s["silent_since"]:
        return "silent"
    return s["status"]


def share_text(share):
    return "" if share is None else f"{round(share * 100)}%"


def silent_html(s, page):
    quiet = parse_utc(s["last_new_at"])
    return "" if quiet is None else \
        f'<br><span class="small">{page.t("silent_for", d=duration_text(time.time() - quiet))}</span>'


def source_row_html(s, page):
    status = source_state(s)
    return source_row(s, page.lang, silent_html(s, page) if status == "silent" else "")


@functools.lru_cache(maxsize=4096)
def source_row(s, lang, silent):
    """A source's row of /crawlers, kept while the source's row is the same:
    the page, shown again (it refreshes itself while posts are classified),
    makes again only the rows of the sources that changed."""
    status = source_state(s)
    slug, crawler = esc(s["slug"]), esc(s["crawler"])
    last_run = (f'{esc(s["run_started"])} <span class="muted">{word(lang, "trigger", s["run_trigger"])}: '
                f'{word(lang, "run", s["run_status"])}, +{esc(s["run_new_posts"])}</span>'
                if s["run_started"] else f'<span class="muted">{said(lang, "never_fetched")}</span>')
    name = f'<br><span class="small">{esc(s["name"])}</span>' if s["name"] != s["slug"] else ""
    moved = (f'<br><span class="small moved">'
             f'{esc(STRINGS[lang]["moved"].format(url=s["moved_to"]))}</span>'
             if s["moved_to"] else "")
    failing = " failing" if status in ("alive", "silent") and s["error_count"] else ""
    return (f'<tr id="source-{slug}"><td class="source"><b>{slug}</b>{name}{moved}</td>'
            f'<td>{crawler}</td>'
            f'<td class="{status}{failing}">{word(lang, "state", status)}{silent}</td>'
            f'<td>{esc(s["priority"])}</td>'
            f'<td class="small when">{esc(s["last_fetch"] or STRINGS[lang]["never_fetched"])}</td>'
            f'<td>{esc(s["error_count"])}</td>'
            f'<td class="error">{last_error_html(s)}</td>'
            f'<td>{esc(s["post_count"])}</td><td>{esc(s["week_posts"])}</td>'
            f'<td class="small when">{esc(s["last_new_at"])}</td>'
            f'<td>{share_text(s["relevant_share"])}</td><td>{esc(s["approved"])}</td>'
            f'<td class="small wide run">{last_run}{validators_html(s, lang)}</td></tr>')


def word(lang, kind, value):
    """A stored word (a source's state, a run's trigger or outcome) in the
    page's language; one it has no word for, as stored."""
    key = f"{kind}.{value}"
    return said(lang, key) if key in STRINGS[lang] else esc(value)


def validators_html(s, lang):
    """A feed's ETag, Last-Modified and lastBuildDate, a line each under its
    last run: read rarely, they would take three wide columns."""
    return "".join(f'<br><span class="muted validator">{said(lang, "col." + key)}: '
                   f'{esc(s[key])}</span>' for key in ("etag", "modified", "last_build_date")
                   if s[key])


def card_labels(page):
    """On a phone each source row is a card; its cells are labelled by
    column, in the page's language, from CSS (not an attribute per cell)."""
    rules = "".join(
        f'table.sources td:nth-child({n})::before'
        f'{{content:{css_string(page.strings["col." + c] + ": ")}}}'
        for n, c in enumerate(SOURCE_COLUMNS, 1) if c != "source")
    return f"<style>@media (max-width:600px){{{rules}}}</style>"


def css_string(text):
    """A CSS string of the text: JSON's quotes and backslashes are CSS's too,
    but its \\uXXXX escapes are not, so letters stay letters."""
    return json.dumps(text, ensure_ascii=False).replace("<", "\\3c ")


SOURCE_COLUMNS = ("source", "crawler", "status", "priority", "last_fetch", "errors",
                  "last_error", "posts", "week", "last_new", "relevant", "approved", "last_run")
# Columns a phone screen leaves out.
WIDE_COLUMNS = ("last_run",)


def crawlers_page(conn, page, settings):
    queue = queue_sizes(conn)
    rows = source_health(conn)
    dead = sum(1 for s in rows if s["status"] == "dead" and s["enabled"])
    head = "".join(f'<th{" class=wide" if c in WIDE_COLUMNS else ""}>{page.t("col." + c)}</th>'
                   for c in SOURCE_COLUMNS)
    body = "".join(source_row_html(s, page) for s in rows)
    reset = (f'<form method="post" action="/crawlers/reset" class="actions">'
             f'<input type="hidden" name="token" value="{esc(page.token)}">'
             f'<button class="primary" type="submit">{page.t("reset_dead")}</button>'
             f'<span class="muted">{page.t("dead_count", n=dead)}</span></form>') \
        if page.may("admin") else \
        f'<p class="actions muted">{page.t("dead_count", n=dead)}</p>'
    html_body = (f"{card_labels(page)}{banners(conn, settings, page)}{queue_cards(queue, page)}{reset}"
                 f"<div class=table><table class=sources><thead><tr>{head}</tr></thead>"
                 f"<tbody>{body}</tbody></table></div>")
    return layout(page, page.strings["crawlers"], html_body, "/crawlers",
                  refresh=queue["processing"] > 0)


###############################################################################
# Desk page ###################################################################
###############################################################################
# The editor's desk: its query, filters and counts, the cards, the question
# card, and the same posts as JSON (/api/posts).

@dataclasses.dataclass
class DeskQuery:
    """The desk's filters, read from the query string; anything unknown
    falls back to the default view."""
    direction: str = None        # a direction id, "none", or None for all
    status: str = "new"          # new | approved | rejected | any
    min: int = 3                 # the relevance floor
    chosen: bool = False         # min was asked for; else the default floor (see floor_clause)
    q: str = ""
    source: str = None
    sort: str = "newest"
    after: tuple = None          # the keyset cursor: the last card of the page before
    decided: int = None          # a post just decided without JavaScript: kept in view
    story: int = None            # every copy of one story, each its own card
    # Past this many matches a search is sorted whole (see search_newest).
    walk = 100_000
    # The posts still to classify are counted up to this many ("10000+").
    waiting_cap = 10_000

    @classmethod
    def read(cls, query, directions, default_min):
        direction = query.get("direction")
        status = query.get("status")
        floor = query.get("min", "")
        sort = query.get("sort")
        chosen = re.fullmatch(r"(?:10|[0-9])", floor) is not None
        desk = cls(direction=direction if direction in directions or direction == "none" else None,
                   status=status if status in (*DECISIONS, "any") else "new",
                   min=int(floor) if chosen else default_min, chosen=chosen,
                   q=search_words(query.get("q", "")), source=query.get("source") or None,
                   sort=sort if sort in SORTS else "newest")
        desk.after = desk.cursor(query.get("after", ""))
        decided, story = query.get("decided", ""), query.get("story", "")
        desk.decided = int(decided) if re.fullmatch(r"[1-9][0-9]{0,17}", decided) else None
        desk.story = int(story) if re.fullmatch(r"[1-9][0-9]{0,17}", story) else None
        return desk

    def cursor(self, text):
        """(score, published_at, id) from 'score~published~id' (its time
        written 20261101T000700: a cursor is URL-safe as it is); None if
        malformed."""
        parts = text.split("~")
        compact = re.fullmatch(r"(\d{4})(\d\d)(\d\d)T(\d\d)(\d\d)(\d\d)", parts[1]) \
            if len(parts) == 3 else None
        if compact:
            parts[1] = "{}-{}-{} {}:{}:{}".format(*compact.groups())
        if len(parts) != 3 or not re.fullmatch(r"[0-9]{1,18}", parts[2]) or \
                not re.fullmatch(r"(?:[0-9]{1,2}(?:\.[0-9]{1,20})?)?", parts[0]) or len(parts[1]) > 40:
            return None
        score = None if not parts[0] else float(parts[0]) if "." in parts[0] else int(parts[0])
        return (score, parts[1], int(parts[2]))

    def params(self, **changes):
        """The query string of this view (with changes), defaults left out."""
        values = {"direction": self.direction, "status": None if self.status == "new" else self.status,
                  "min": self.min if self.chosen else None, "q": self.q or None,
                  "source": self.source,
                  "sort": None if self.sort == "newest" else self.sort, "story": self.story}
        values.update(changes)
        return values


def search_words(text):
    """A search as typed, or "" when it has no word to look for."""
    text = " ".join(text.split())[:200]
    return text if re.search(r"\w", text) else ""


def floor_clause(desk, row="", counted=False):
    """SQL of the desk's floor and its parameters. One asked for (min) is on
    relevance. The default floor is too, but for a post still to decide that
    a direction's learned model is sure of (shown at LIKELY_HIGH or more,
    not under LIKELY_LOW), and for a decided post, shown whatever its
    relevance: an editor saw it (one the model let in has relevance 2) and
    finds it among the approved. On posts (`row` their alias and a dot), or
    on the count tables' rows (`counted`). The relevance is marked not to
    pick an index (the unary +) unless the order is by relevance."""
    if not desk.min:
        return "1 = 1", []
    relevance = f"{'' if desk.sort == 'relevance' or counted else '+'}{row}relevance >= ?"
    if desk.chosen:
        return relevance, [desk.min]
    liked, open_ = ("liked = 2", "liked IN (-1, 1)") if counted else \
        (f"{row}likely >= {LIKELY_HIGH}", f"({row}likely IS NULL OR {row}likely >= {LIKELY_LOW})")
    return (f"({row}status != 'new' OR {liked} OR {open_} AND {relevance})"), [desk.min]


def desk_filters(desk):
    """WHERE clauses and parameters of every filter but the search. The
    relevance floor is marked not to pick an index (the unary +) unless the
    order is by relevance: the page then walks the index of its own order
    instead of sorting every relevant post."""
    where, params = [f"p.classified = {DONE}"], []
    if desk.status != "any" and desk.decided:
        where.append("(p.status = ? OR p.id = ?)")
        params += [desk.status, desk.decided]
    elif desk.status != "any":
        where.append("p.status = ?")
        params.append(desk.status)
    if desk.min:
        clause, values = floor_clause(desk, "p.")
        where.append(clause)
        params += values
    if desk.direction == "none":
        where.append("p.direction IS NULL")
    elif desk.direction:
        where.append("p.direction = ?")
        params.append(desk.direction)
    if desk.source:
        where.append("p.source_id = (SELECT id FROM sources WHERE slug = ?)")
        params.append(desk.source)
    if desk.story:
        where.append(f"({copies_of('p.')} OR p.id = ?)")
        params += [desk.story, desk.story]
    elif not desk.source:
        where.append(ONE_CARD_PER_STORY)
    return where, params


DESK_COLUMNS = """p.id, p.title, p.url, p.summary, p.direction, p.relevance, p.interest,
                  p.status, p.published_at, p.undated, p.content_type, p.keywords, p.reason,
                  substr(p.text, 1, {card_text}) AS text, p.decided_at, p.decided_by,
                  p.story_id, s.name AS source, s.slug AS source_slug, p.old_decision,
                  p.likely, p.source_id,
                  p.words_sha256,
                  p.old_decided_at, p.old_decided_by, p.old_title,
                  substr(p.old_text, 1, {card_text}) AS old_text""".format(card_text=CARD_TEXT + 1)


class Card(typing.NamedTuple):
    """A post as the desk reads it (DESK_COLUMNS, in their order): what its
    card, its JSON and the desk's order and cursor are made of. A tuple: a
    page makes 50 to 150 of them."""
    id: int
    title: str
    url: str
    summary: str
    direction: str
    relevance: int
    interest: int
    status: str                 # new | approved | rejected
    published_at: str
    undated: int                # its date is when it was fetched
    content_type: str
    keywords: str               # the direction's keywords it matched, ", "-joined
    reason: str
    text: str                   # cut to CARD_TEXT + 1
    decided_at: str
    decided_by: str
    story_id: int
    source: str                 # the source's name
    source_slug: str
    old_decision: str           # the decision an edit of the source took back
    likely: float
    source_id: int
    words_sha256: str
    old_decided_at: str
    old_decided_by: str
    old_title: str
    old_text: str

    @classmethod
    def of(cls, row):
        return cls._make(row)


def desk_posts(conn, desk, limit=PAGE_SIZE + 1):
    """One page of the desk, keyset-paged: the page after `desk.after` in the
    chosen order, with or without a search."""
    if desk.status == "any" and not desk.q:
        return every_decision(conn, desk, limit)
    where, params = desk_filters(desk)
    posts = "posts p"
    if desk.q and desk.sort == "newest":
        page = search_newest(conn, desk, where, params, limit)
        if page is not None:
            return [Card.of(row) for row in page]
        posts = conn.dialect.posts_by_id        # every match sorted: faster than the index
    if desk.q:
        clause, values = conn.dialect.search_filter(desk.q)
        where.append(clause)
        params += values
    score = SCORES[desk.sort]
    keys = [score, "p.published_at", "p.id"] if score else ["p.published_at", "p.id"]
    if desk.after:
        values = list(desk.after[1:] if not score else desk.after)
        where.append(f"({', '.join(keys)}) < ({', '.join('?' * len(keys))})")
        params += values
    order = ", ".join(f"{k} DESC" for k in keys)
    return [Card.of(row) for row in conn.execute(f"""
        SELECT {DESK_COLUMNS} FROM {posts} LEFT JOIN sources s ON s.id = p.source_id
        WHERE {' AND '.join(where)} ORDER BY {order} LIMIT ?""", [*params, limit])]


# A search under newest first walks its matches newest collected first, a
# stretch at a time, keeping the best `limit` by date, and stops once no post
# collected earlier can be newer than the last of them: a post is never dated
# after it was stored (insert_new_posts), and posts are numbered as they are
# stored, each within FETCH_ORDER_SLACK seconds of its number's order. So a
# common word costs about a page, not every post it matches. A page deep
# into a common word's matches would read every match above it: past
# DeskQuery.walk matches, every match is sorted by date instead (measured at
# a million posts, a word in 85 % of them: its first page 11 ms, a page a day
# deep 60 ms, walked at about 2 µs a match; any page sorted about 760 ms).
FETCH_ORDER_SLACK = 600
SEARCH_STRETCH = 64
MAX_SEARCH_STRETCH = 500        # one `among` clause


def search_newest(conn, desk, where, params, limit):
    """The page of a search under newest first (see FETCH_ORDER_SLACK), or
    None past DeskQuery.walk matches."""
    matches, values = conn.dialect.matches_below(desk.q)
    if desk.after:
        where, params = [*where, "(p.published_at, p.id) < (?, ?)"], [*params, *desk.after[1:]]
    best, below, stretch, read = [], 2 ** 63 - 1, SEARCH_STRETCH, 0
    while True:
        ids = [row[0] for row in conn.execute(matches, [*values, below, stretch])]
        if not ids:
            break
        read += len(ids)
        if read > desk.walk:
            return None
        [(among, chosen)] = conn.dialect.among("p.id", ids)
        found = conn.execute(f"""
            SELECT {DESK_COLUMNS} FROM {conn.dialect.posts_by_id}
            LEFT JOIN sources s ON s.id = p.source_id
            WHERE {' AND '.join(where)} AND {among}""", [*params, *chosen]).fetchall()
        best = heapq.nlargest(limit, best + found,
                              key=lambda post: (post["published_at"] or "", post["id"]))
        if len(ids) < stretch or (len(best) == limit and newer_than_any_below(conn, ids[-1], best[-1])):
            break
        below, stretch = ids[-1], min(stretch * 2, MAX_SEARCH_STRETCH)
    return best


def newer_than_any_below(conn, post_id, post):
    """True when `post` is dated after every post stored before `post_id`
    could be (see FETCH_ORDER_SLACK)."""
    row = conn.execute("SELECT fetched_at FROM posts WHERE id = ?", (post_id,)).fetchone()
    stored = parse_utc(row[0]) if row else None
    return stored is not None and post["published_at"] is not None and \
        utc_text(stored + FETCH_ORDER_SLACK) < post["published_at"]


def every_decision(conn, desk, limit):
    """The page of status=any: the pages of each decision (each on its own
    index), merged in the chosen order."""
    posts = [post for decision in DECISIONS for post in
             desk_posts(conn, dataclasses.replace(desk, status=decision, decided=None), limit)]
    def order(post):  # descending, NULLs last, as ORDER BY … DESC has them
        value = desk_score(desk, post)
        return -1 if value is None else value, post.published_at or "", post.id
    return sorted(posts, key=order, reverse=True)[:limit]


def desk_score(desk, post):
    """The post's score in the desk's order (SCORES), or None."""
    if desk.sort == "likely":
        return post.likely if post.likely is not None else \
            None if post.relevance is None else post.relevance / 10.0
    return None if desk.sort == "newest" else getattr(post, desk.sort)


def next_cursor(desk, post):
    score = desk_score(desk, post)
    published = re.sub(r"[-:]", "", (post.published_at or "")).replace(" ", "T")
    return f"{'' if score is None else repr(score)}~{published}~{post.id}"


def desk_counts(conn, desk):
    """Posts per direction and per decision, each under the other filters,
    and the number hidden by the relevance floor. From post_counts (kept by
    triggers); a search counts its matches when there are few enough, a
    story its posts."""
    if desk.q or desk.story:
        return search_counts(conn, desk)
    table, where, params = "post_counts", [], []
    if desk.source:
        table = "source_post_counts"
        where.append("source_id = (SELECT id FROM sources WHERE slug = ?)")
        params.append(desk.source)

    def counted(group, conditions, values):
        clause = " AND ".join([*where, *conditions, "n > 0"])
        return {row[0]: row[1] for row in conn.execute(
            f"SELECT {group}, sum(n) FROM {table} WHERE {clause} GROUP BY {group}",
            [*params, *values])}
    direction = [] if not desk.direction else \
        (["direction = ''"] if desk.direction == "none" else ["direction = ?"])
    direction_value = [desk.direction] if desk.direction not in (None, "none") else []
    status = [] if desk.status == "any" else ["status = ?"]
    status_value = [] if desk.status == "any" else [desk.status]
    floor, floor_values = floor_clause(desk, counted=True)
    by_direction = counted("direction", [*status, floor], [*status_value, *floor_values])
    by_status = counted("status", [*direction, floor], [*direction_value, *floor_values])
    below = sum(counted("status", [*direction, *status, f"NOT {floor}"],
                        [*direction_value, *status_value, *floor_values]).values())
    return {"direction": {k or None: v for k, v in by_direction.items()},
            "status": by_status, "hidden": below, "capped": False}


def search_counts(conn, desk):
    """Counts over a search's matches (or a story's posts), when at most
    SEARCH_COUNT_CAP."""
    if not desk.q:
        matches = f"SELECT id FROM posts WHERE {copies_of()} OR id = ? LIMIT ?"
        values = [desk.story, desk.story, SEARCH_COUNT_CAP + 1]
    else:
        matches, values = conn.dialect.search_matches(desk.q)
        matches += " LIMIT ?"
        values = [*values, SEARCH_COUNT_CAP + 1]
    ids = [row[0] for row in conn.execute(matches, values)]
    if len(ids) > SEARCH_COUNT_CAP:
        return {"direction": {}, "status": {}, "hidden": 0, "capped": True}
    marks = ",".join("?" * len(ids)) or "NULL"
    floor, floor_values = floor_clause(desk, "p.")
    rows = conn.execute(f"""SELECT direction, status, {floor} AS shown, count(*)
                            FROM posts p WHERE id IN ({marks}) AND +classified = {DONE}
                            {"" if desk.source or desk.story else "AND " + ONE_CARD_PER_STORY}
                            {"AND p.source_id = (SELECT id FROM sources WHERE slug = ?)"
                             if desk.source else ""}
                            GROUP BY 1, 2, 3""",
                        [*floor_values, *ids, *([desk.source] if desk.source else [])]).fetchall()
    counts = {"direction": {}, "status": {}, "hidden": 0, "capped": False}
    for direction, status, shown, n in rows:
        wanted_direction = desk.direction is None or direction == desk.direction or \
            (desk.direction == "none" and direction is None)
        if shown and (desk.status in ("any", status)):
            counts["direction"][direction] = counts["direction"].get(direction, 0) + n
        if shown and wanted_direction:
            counts["status"][status] = counts["status"].get(status, 0) + n
        if not shown and wanted_direction and desk.status in ("any", status):
            counts["hidden"] += n
    return counts


def facet_links(page, desk, directions, counts):
    def count(number):
        shown = "" if counts["capped"] else f' <span class="muted">{int(number or 0)}</span>'
        return shown + "</span>"

    def link(label, here, **change):
        return (f'<span class="facet"><a href="{esc(page.link("/", **desk.params(**change)))}"'
                f'{" class=here" if here else ""}>{esc(label)}</a>')
    by_direction = counts["direction"]
    direction_links = [link(page.strings["all_directions"], desk.direction is None, direction=None)
                       + count(sum(by_direction.values()))]
    direction_links += [link(d.title, desk.direction == d.id, direction=d.id)
                        + count(by_direction.get(d.id)) for d in directions.values()]
    direction_links.append(link(page.strings["no_direction"], desk.direction == "none",
                                direction="none") + count(by_direction.get(None)))
    by_status = counts["status"]
    status_links = [link(page.strings[f"status.{s}"], desk.status == s,
                         status=None if s == "new" else s) + count(by_status.get(s))
                    for s in DECISIONS]
    status_links.append(link(page.strings["status.any"], desk.status == "any", status="any")
                        + count(sum(by_status.values())))
    note = f' <span class="muted">({page.t("many_matches", n=SEARCH_COUNT_CAP)})</span>' \
        if counts["capped"] else ""
    return (f'<p class="facets" id="directions">{"".join(direction_links)}</p>'
            f'<p class="facets small" id="statuses">{"".join(status_links)}{note}</p>')


def filter_form(page, desk, sources):
    def options(values, chosen):
        return "".join(f'<option value="{esc(v)}"{" selected" if v == chosen else ""}>'
                       f'{esc(label)}</option>' for v, label in values)
    hidden = "".join(f'<input type="hidden" name="{k}" value="{esc(v)}">'
                     for k, v in (("direction", desk.direction),
                                  ("status", None if desk.status == "new" else desk.status),
                                  ("lang", page.lang if "lang" in page.query else None)) if v)
    source_options = options([("", page.strings["all_sources"])], "") + sources
    if desk.source:
        chosen = f'value="{esc(desk.source)}">'
        source_options = source_options.replace(chosen, chosen[:-1] + " selected>", 1)
    sort_options = options([(s, page.strings[f"sort.{s}"]) for s in SORTS], desk.sort)
    return (f'<form class="filters" method="get" action="/" role="search">{hidden}'
            f'<input type="search" name="q" value="{esc(desk.q)}" '
            f'placeholder="{page.t("search")}" aria-label="{page.t("search")}">'
            f'<select name="source" aria-label="{page.t("all_sources")}">{source_options}</select>'
            f'<label class="small">{page.t("min")} <input type="number" name="min" min="0" '
            f'max="10" value="{desk.min if desk.chosen else ""}" placeholder="{desk.min}" '
            f'style="width:4em"></label>'
            f'<select name="sort" aria-label="sort">{sort_options}</select>'
            f'<button type="submit">{page.t("show")}</button></form>')


def filters_html(page, desk, directions, counts, sources, default_min):
    """The filters and their counts under "Filters": open on a wide screen;
    on a phone folded away by the script (they would fill the first screen)
    unless one is in use."""
    in_use = desk.q or desk.source or desk.direction or desk.status != "new" or \
        desk.sort != "newest" or desk.min != default_min
    return (f'<details class="filters" open{"" if in_use else " data-fold"}>'
            f'<summary>{page.t("filters")}</summary>{filter_form(page, desk, sources)}'
            f'<p class="keys-hint small muted">{page.t("keys_hint")}</p>'
            f'{facet_links(page, desk, directions, counts)}</details>'
            f'<script>{FOLD_FILTERS}</script>')


@functools.lru_cache(maxsize=1024)      # a page asks again for the links it showed
def is_web_link(url):
    return bool(url) and urllib.parse.urlsplit(url).scheme in WEB_SCHEMES


def decision_form(post, page, back):
    if not page.may("editor"):
        return f'<p class="small"><span class="badge state">{said(page.lang, "status." + post.status)}</span></p>'
    return (f'<form class="decide" method="post" action="/posts/{post.id}/status">'
            f'{form_fields(page.token, back)}'
            f'<input type="hidden" name="wording" value="{esc(wording(post.title, post.text, post.words_sha256))}">'
            f'<input type="hidden" name="seen" value="{esc(post.status)}">'
            f'{decision_buttons(page.lang, post.status)}</form>')


def decided_line(post, page):
    """Who decided the post, and when; and who else is looking at it now
    (filled in by the desk's script)."""
    said_by = ""
    if post.status != "new" and post.decided_by:
        said_by = page.t("decided_by", decision=phrase(page.lang, "status." + post.status),
                         who=post.decided_by, when=post.decided_at or "?")
    return (f'<p class="small muted decided">{said_by}'
            f'<span class="looking" hidden></span></p>')


@functools.lru_cache(maxsize=64)
def form_fields(token, back):
    """The hidden fields of a decision: every card of a page has the same."""
    return (f'<input type="hidden" name="token" value="{esc(token)}">'
            f'<input type="hidden" name="back" value="{esc(back)}">')


@functools.lru_cache(maxsize=64)
def decision_buttons(lang, status):
    """A card's buttons, the one of its status disabled, and its status."""
    buttons = "".join(
        f'<button name="status" value="{value}" class="{value}"'
        f'{" disabled" if status == value else ""}>{said(lang, label)}</button>'
        for value, label in (("approved", "approve"), ("rejected", "reject"), ("new", "undo")))
    return f'{buttons}<span class="badge state">{said(lang, "status." + status)}</span>'


def story_line(post, story, page):
    """'+N sources: A, B, C and M more · every copy' under a story's card."""
    if not story:
        return ""
    def name(copy):
        return copy["source"] or urllib.parse.urlsplit(copy["url"] or "").hostname or f'#{copy["id"]}'
    def adds(copy):
        return f' <span class="adds">({page.t("adds", sites=copy["adds"].replace(" ", ", "))})</span>' \
            if copy["adds"] else ""
    links = ", ".join(
        (f'<a href="{esc(c["url"])}" rel="noopener noreferrer" target="_blank">{esc(name(c))}</a>'
         if is_web_link(c["url"]) else esc(name(c))) + adds(c) for c in story.named)
    capped = story.count >= STORY_COUNTED       # counted no further (see story_leads)

    def counted(n):
        return {"n": n, "count": f"{n}+" if capped else str(n)}
    unnamed = story.count - len(story.named)
    more = f' {page.t("more_copies", **counted(unnamed))}' if unnamed > 0 else ""
    every = page.link("/", story=post.story_id, status="any", min=0)
    return (f'<p class="small story">{page.t("more_sources", **counted(story.count))}: {links}'
            f'{more} · <a href="{esc(every)}">{page.t("every_copy")}</a></p>')


@functools.lru_cache(maxsize=8)
def card_words(lang):
    """The fixed words of a card, escaped, looked up once per language."""
    return {key: said(lang, key) for key in ("untitled", "no_direction", "keywords", "reason",
                                             "stored_text", "utc", "relevance", "interest",
                                             "undated", "edit_texts", "before_edit",
                                             "after_edit", "likely", "weighed", "let_in",
                                             "keywords_other")}


def card_time(post, words):
    """When the post was published; for an undated one, that it has no date
    and when it was fetched (what its published_at then holds)."""
    stamp = f'{esc(post.published_at)} {words["utc"]}'
    return f'{words["undated"]} {stamp}' if post.undated else stamp


def edited_mark(post, page):
    """What an edit of its words after a decision took back (see reword_post)."""
    if not post.old_decision:
        return ""
    decision = page.strings.get(f'status.{post.old_decision}', post.old_decision)
    said_then = page.t("edited", decision=decision, who=post.old_decided_by or "—",
                       when=post.old_decided_at or "—")
    return f'<p class="edited">{said_then}</p>'


def edited_texts(post, words, text):
    """The title and text a decision was made on, beside the post's now."""
    def version(kind, label, title, body):
        return (f'<div class="{kind}"><span class="small muted">{words[label]}</span>\n'
                f'<b>{esc(title)}</b>\n{esc(body)}</div>')
    return (f'<details class="edit"><summary class="small">{words["edit_texts"]}</summary>'
            f'<div class="versions">'
            f'{version("before", "before_edit", post.old_title, shorten(post.old_text, CARD_TEXT))}'
            f'{version("now", "after_edit", post.title, text)}</div></details>')


def sent_to(conn, post_ids):
    """{post id: [publication rows]} of these posts: where each goes or went."""
    found = collections.defaultdict(list)
    for among, values in conn.dialect.among("u.post_id", post_ids):
        for row in conn.execute(f"""SELECT u.id, u.post_id, u.target, u.state, u.retract,
                                           coalesce(u.chat, t.address) AS chat, t.kind
                                    FROM publications u LEFT JOIN targets t ON t.name = u.target
                                    WHERE {among}
                                    ORDER BY u.target""", values):
            found[row["post_id"]].append(row)
    return found


def outbox_line(publications, page):
    """Where an approved card goes or went, each linked to its outbox row."""
    if not publications:
        return ""
    shown = ", ".join(
        f'<a href="{esc(page.link("/outbox"))}#publication-{row["id"]}">{esc(row["target"])}</a> '
        f'{page.t("o.deleting") if row["retract"] else page.t("o.state." + row["state"])}'
        for row in publications)
    return f'<p class="small muted outbox-line">{page.t("outbox")}: {shown}</p>'


def published_where(publications):
    """Where a card's post is out (or going out) to be deleted from if its
    decision is taken back: a chat, or a webhook's name (its address is
    its receiver's secret)."""
    return ", ".join(row["chat"] if row["kind"] == "telegram" else row["target"]
                     for row in publications if row["state"] in ("sending", "published")
                     and not row["retract"] and row["kind"] in ("telegram", "webhook"))


def card_html(post, page, back, story=None, weighed=(), publications=(), unsure=False,
              directions=None, keywords=None):
    """A post's card; `weighed`: what weighed most in its likely (see
    Model.reasons); `publications`: where it goes or went (see sent_to);
    `unsure`: the card the desk asks about (see question_card);
    `directions`: the registry's, for their titles, and `keywords` their
    KeywordIndex (see keywords_line)."""
    words = card_words(page.lang)
    title = esc(post.title) or words["untitled"]
    link = (f'<a href="{esc(post.url)}" rel="noopener noreferrer" target="_blank">{title}</a>'
            if is_web_link(post.url) else title)
    why = []
    if post.keywords:
        why.append(keywords_line(post, words, keywords))
    elif post.direction and post.likely is not None:
        why.append(words["let_in"])
    if post.reason:
        why.append(f'{words["reason"]}: {esc(post.reason)}')
    if weighed:
        why.append(f'{words["weighed"]}: {esc(", ".join(weighed))}')
    likely = "" if post.likely is None else \
        f' · {words["likely"]} <b class="likely">{post.likely:.2f}</b>'
    if unsure:
        likely += f' <span class="badge unsure">{page.t("unsure")}</span>'
    why_html = f'<p class="why small muted">{" · ".join(why)}</p>' if why else ""
    text = shorten(post.text, CARD_TEXT)
    if post.old_decision:
        stored = edited_texts(post, words, text)
    else:
        stored = (f'<details><summary class="small">{words["stored_text"]}</summary>'
                  f'<div class="text">{esc(text)}</div></details>' if text else "")
    known = (directions or {}).get(post.direction)
    direction = esc(known.title if known else post.direction) or words["no_direction"]
    published = published_where(publications)
    published = f' data-published="{esc(published)}"' if published else ""
    return (f'<article class="post" id="post-{post.id}" data-id="{post.id}" '
            f'data-status="{esc(post.status)}"{published}><h2>{link}</h2>'
            f'<p class="small muted">{esc(post.source)} · {card_time(post, words)} · '
            f'<span class="badge">{direction}</span> '
            f'{words["relevance"]} <b>{esc(post.relevance)}</b> · '
            f'{words["interest"]} <b>{esc(post.interest)}</b>{likely}</p>{edited_mark(post, page)}'
            f'<p>{esc(post.summary)}</p>{story_line(post, story, page)}{why_html}{stored}'
            f'{outbox_line(publications, page)}{decided_line(post, page)}'
            f'{decision_form(post, page, back)}</article>')


def keywords_line(post, words, keywords):
    """The keywords a post matched, its direction's first and those of
    other directions apart (posts.keywords keeps them all, as one list),
    told by the directions' KeywordIndex `keywords`."""
    pattern = keywords.patterns.get(post.direction) if keywords else None
    found = post.keywords.split(", ")
    own = [w for w in found if pattern is None or pattern.fullmatch(w)]
    other = [w for w in found if w not in own]
    line = f'{words["keywords"]}: {esc(", ".join(own))}' if own else ""
    if other:
        line += f'{" · " if line else ""}{words["keywords_other"]}: {esc(", ".join(other))}'
    return line


def bulk_form(page, posts, back):
    """"Reject all shown", under the cards of posts still to decide. The
    script asks in place, then offers an undo (back to new, as they were);
    without it the server asks on a page of its own."""
    if not posts:
        return ""
    ids, n = ",".join(str(p.id) for p in posts), len(posts)
    words = ",".join(f'{p.id}:{wording(p.title, p.text, p.words_sha256)}' for p in posts)
    return (f'<form class="actions bulk" method="post" action="{esc(page.link("/posts/status"))}">'
            f'{form_fields(page.token, back)}<input type="hidden" name="ids" value="{ids}">'
            f'<input type="hidden" name="wording" value="{esc(words)}">'
            f'<input type="hidden" name="ask" value="1"><span class="ask"><button name="status" value="rejected">'
            f'{page.t("reject_shown", n=n)}</button></span>'
            f'<span class="confirm" hidden>{page.t("bulk_ask.rejected", n=n)} '
            f'<button type="button" class="yes primary">{page.t("yes")}</button> '
            f'<button type="button" class="no">{page.t("cancel")}</button></span>'
            f'<span class="done" hidden role="status">{page.t("bulk_done", n=n)} '
            f'<button type="button" class="undo">{page.t("undo")}</button></span>'
            f'<span class="unsaved" hidden role="alert"></span></form>')


def bulk_confirmation(page, posts, status, fields, back):
    """The page that asks, without JavaScript, before a decision on many
    posts: what it decides, and the same form, confirmed."""
    untitled = said(page.lang, "untitled")
    listed = "".join(f'<li>{esc(p["title"]) or untitled} <span class="small muted">'
                     f'{esc(p["source"])}</span></li>' for p in posts)
    hidden = "".join(f'<input type="hidden" name="{name}" value="{esc(value)}">'
                     for name, value in (*fields, ("confirmed", "1")))
    question = phrase(page.lang, f"bulk_ask.{status}", n=len(posts))
    body = (f'<h2>{esc(question)}</h2><ol>{listed}</ol>'
            f'<form class="actions" method="post" action="{esc(page.link("/posts/status"))}">'
            f'{hidden}<button class="primary" type="submit">{page.t("yes")}</button> '
            f'<a href="{esc(back)}">{page.t("cancel")}</a></form>')
    return layout(page, question, body, "/")


def keys_overlay(page):
    keys = "".join(f"<li><kbd>{esc(k)}</kbd> {page.t('key.' + k)}</li>" for k in "jkaruo/?")
    return (f'<aside id="keys" hidden><b>{page.t("keys_title")}</b>'
            f'<ul style="list-style:none;padding:0;margin:.4em 0 0">{keys}</ul></aside>')


def waiting_note(conn, page, settings):
    """How many posts are still to classify, above the cards (or in place of
    them): the desk fills up while the workers go through the queue, or
    waits for Ollama."""
    cap = DeskQuery.waiting_cap
    waiting = min(waiting_count(conn, cap), cap)
    if not waiting:
        return ""
    count = f"{waiting}+" if waiting == cap else str(waiting)
    key = "ollama_waits" if ollama_down(classification_state(conn), settings) else "classifying"
    return f'<p class="small muted" id="waiting">{page.t(key, n=waiting, count=count)}</p>'


def source_options(conn):
    """The <option>s of every enabled source, for the desk's source filter."""
    return "".join(f'<option value="{esc(s["slug"])}">{esc(s["name"])}</option>' for s in
                   conn.execute("SELECT slug, name FROM sources WHERE enabled = 1 ORDER BY name"))


def weighed_most(post, learners):
    """What weighed most in a card's likely, as a card names it: words, and
    its source by name."""
    model = learners.model(post.direction) if learners and post.likely is not None else None
    if model is None:
        return ()
    features = post_features(post.title, post.text, post.source_id, post.id)
    return tuple(reason_words(model.reasons(features, post.likely), post.title, post.text,
                              post.source or f'@{post.source_id}'))


# GET /api/posts: this many posts a page unless `limit` says otherwise, and at most this many.
API_POSTS = 50
MAX_API_POSTS = 500


# Every QUESTION_EVERY-th decision of a direction, its default desk opens on
# the card its model is least sure of (the chance nearest LIKELY_FLOOR,
# between LIKELY_LOW and LIKELY_HIGH), marked as such: an editor who decides
# the top card teaches the model where it is unsure, not only where it is
# right, and sees such a card at most once in three.
QUESTION_EVERY = 3


def question_card(conn, desk):
    """The card the desk opens on to ask the editor (see QUESTION_EVERY), or
    None: only on the first page of a direction's default desk, once its
    model judged its cards."""
    if not desk.direction or desk.direction == "none" or desk.status != "new" or desk.chosen \
            or desk.sort != "newest" or desk.q or desk.source or desk.story or desk.after:
        return None
    decided = conn.execute("""SELECT coalesce(sum(n), 0) FROM post_counts WHERE direction = ?
                                  AND status IN ('approved', 'rejected')""",
                           (desk.direction,)).fetchone()[0]
    if decided % QUESTION_EVERY != QUESTION_EVERY - 1:
        return None
    chance = "coalesce(p.likely, p.relevance / 10.0)"
    nearest = []
    for side, order, bound in ((">=", "ASC", LIKELY_HIGH), ("<", "DESC", LIKELY_LOW)):
        nearest += conn.execute(f"""
            SELECT {DESK_COLUMNS} FROM posts p LEFT JOIN sources s ON s.id = p.source_id
            WHERE p.classified = {DONE} AND p.status = 'new' AND {chance} {side} ?
              AND {chance} {'<' if side == '>=' else '>='} ? AND p.likely IS NOT NULL
              AND p.direction = ? AND {card('p.')}
            ORDER BY {chance} {order} LIMIT 1""",
                                (LIKELY_FLOOR, bound, desk.direction)).fetchall()
    return min((Card.of(row) for row in nearest), key=lambda post: abs(post.likely - LIKELY_FLOOR),
               default=None)


def asked_first(conn, desk, posts):
    """The page's posts with the question card first, when it has one (see
    question_card), and its id (or None)."""
    asked = question_card(conn, desk)
    if asked is None:
        return posts, None
    return [asked, *[post for post in posts if post.id != asked.id]], asked.id


def desk_answer(conn, desk, limit):
    """The desk as JSON (GET /api/posts): a page of posts in the desk's
    order, one per story with its copies, and the cursor of the next page
    when there is one. A question card (see question_card) comes first,
    marked `unsure`."""
    catch_up_index(conn)
    posts = desk_posts(conn, desk, limit + 1)
    more, posts = len(posts) > limit, posts[:limit]
    cursor = next_cursor(desk, posts[-1]) if more else None
    posts, asked = asked_first(conn, desk, posts)
    posts = posts[:limit]
    stories = {} if desk.story else story_copies(conn, posts)
    answer = {"posts": [api_post(post, stories.get(post.id), post.id == asked)
                        for post in posts]}
    if cursor:
        answer["next"] = cursor
    return answer


def api_post(post, story, unsure=False):
    fields = ("id", "url", "title", "source", "published_at", "direction", "relevance",
              "interest", "likely", "status", "decided_by", "decided_at")
    answer = {field: getattr(post, field) for field in fields}
    answer["unsure"] = unsure
    answer["story"] = [{"id": c["id"], "url": c["url"], "source": c["source"]}
                       for c in (story.named if story else ())]
    answer["story_count"] = story.count if story else 0
    return answer


@functools.lru_cache(maxsize=8)
def script_words(lang):
    """What the desk's script may say, in the page's language, as JSON safe
    inside a <script> element."""
    strings = STRINGS[lang]
    words = {"status": {s: strings[f"status.{s}"] for s in DECISIONS},
             "retry": {s: strings[f"retry.{s}"] for s in (*DECISIONS, "bulk")},
             **{key: strings[key] for key in ("not_saved", "unreachable", "answered", "changed",
                                              "looking", "deletes", "signed_out",
                                              "sign_in_again", "set_by")}}
    return json.dumps(words, ensure_ascii=False).replace("<", "\\u003c")


def desk_page(conn, desk, page, directions, settings, sources=None, learners=None):
    catch_up_index(conn)
    posts = desk_posts(conn, desk)
    more, posts = len(posts) > PAGE_SIZE, posts[:PAGE_SIZE]
    following = next_cursor(desk, posts[-1]) if more else None
    posts, asked = asked_first(conn, desk, posts)
    posts = posts[:PAGE_SIZE]
    counts = desk_counts(conn, desk)
    here = page.link("/", **desk.params(after="~".join(
        "" if v is None else str(v) for v in desk.after) if desk.after else None))
    stories = {} if desk.story else story_copies(conn, posts)
    sent = sent_to(conn, [p.id for p in posts if p.status == "approved"])
    keywords = KeywordIndex(directions) if directions else None
    cards = "".join(card_html(p, page, here, stories.get(p.id), weighed_most(p, learners),
                              sent.get(p.id, ()), p.id == asked, directions, keywords)
                    for p in posts)
    if not cards:
        empty = "empty_filtered" if desk.direction or desk.q or desk.source or \
            desk.status != "new" or counts["hidden"] else "empty_none"
        cards = f'<p class="muted">{page.t(empty)}</p>'
    # Under the default floor, once a model judges, a post may be hidden by its chance too.
    judged = not desk.chosen and learners is not None and any(map(learners.model, learners.models))
    says = "hidden_floor" if judged else "hidden_low"
    hidden = (f'<p class="small muted">{page.t(says, n=counts["hidden"])} '
              f'<a href="{esc(page.link("/", **desk.params(min=0)))}">{page.t("show_all")}</a></p>'
              if counts["hidden"] and desk.min else "")
    # Only newest first leads to older posts; another order leads to the next ones.
    first, further = ("first", "older") if desk.sort == "newest" else ("to_first", "next")
    pager = "".join([
        f'<a href="{esc(page.link("/", **desk.params()))}">{page.t(first)}</a>'
        if desk.after else "",
        f'<a href="{esc(page.link("/", **desk.params(after=following)))}" '
        f'rel="next">{page.t(further)}</a>' if more else ""])
    sources = source_options(conn) if sources is None else sources
    filters = filters_html(page, desk, directions, counts, sources, settings.min_relevance)
    body = (f"{banners(conn, settings, page)}{filters}{hidden}{waiting_note(conn, page, settings)}"
            f"{cards}{bulk_form(page, posts, here) if desk.status == 'new' and page.may('editor') else ''}"
            f"<nav class=pages>{pager}</nav>"
            f"{keys_overlay(page)}"
            f'<span id="look" data-token="{esc(page.token)}" hidden></span>'
            f'<script type="application/json" id="words">{script_words(page.lang)}</script>'
            f"<script>{DESK_SCRIPT}</script>")
    return layout(page, page.strings["desk"], body, "/")


###############################################################################
# Report card page ############################################################
###############################################################################
# /quality: how the classifier and the learned models agree with the
# editors, in words, tables and a calibration chart.

def percent(share):
    return round(share * 100)


def card_sentences(card, say):
    """A direction's figures in plain words, each with the decisions it
    rests on: [approved, model, agreement, posts let in]. `say(key,
    **values)` speaks the page's language (Page.t) or the terminal's."""
    n = card["decisions"]
    if n < card["minimum"]["decisions"]:
        agrees = say("q.agree_few", n=n, min=card["minimum"]["decisions"])
    elif card["kappa"] is None:
        agrees = say("q.agrees_alike", n=n, share=percent(card["agreed"] / n))
    else:
        agrees = say("q.agrees", n=n, share=percent(card["agreed"] / n), kappa=f"{card['kappa']:.2f}")
    model = say("q.used") if card["model_used"] else \
        say("q.no_signal", every=RECALIBRATE) if card["model_ready"] else \
        say("q.unused", min=card["learn_min"], each=LEARN_EACH)
    misses = say("q.misses", n=card["keyword_misses"], decided=card["keyword_misses_decided"],
                 approved=card["keyword_misses_approved"], shown=card["keyword_misses_shown"])
    return [say("q.approved_of", n=n, approved=card["approved"], rate=percent(card["approval_rate"])),
            model, agrees, misses]


def change_label(change, week, say):
    """What a row of changed_this_week counts, in words."""
    return say(f"q.{change}", floor=week["floor"], high=LIKELY_HIGH, low=LIKELY_LOW)


def share_of(figures):
    """'3/4 (75 %)' approved of decided, or '—' with none decided."""
    if not figures["decided"]:
        return "—"
    approved, decided = figures["approved"], figures["decided"]
    return f"{approved}/{decided} ({percent(approved / decided)} %)"


def precision_cell(rate, n, say):
    """A precision with the decisions it rests on and its 95 % range."""
    if rate is None:
        return "—"
    approved = round(rate * n)
    low, high = wilson(approved, n)
    return say("q.cell", approved=approved, n=n, rate=f"{rate:.2f}", low=f"{low:.2f}",
               high=f"{high:.2f}")


# The calibration chart's frame: the plot's left, right, top and bottom
# edges in the SVG's units, with room outside them for ticks and labels.
CHART = {"width": 440, "height": 270, "left": 56, "right": 426, "top": 16, "bottom": 206}


def chart_x(share):
    return round(CHART["left"] + share * (CHART["right"] - CHART["left"]), 1)


def chart_y(share):
    return round(CHART["bottom"] - share * (CHART["bottom"] - CHART["top"]), 1)


def chart_axes(page):
    """Both axes with their ticks, tick labels and titles."""
    left, right, top, bottom = CHART["left"], CHART["right"], CHART["top"], CHART["bottom"]
    parts = [f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#333"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#333"/>']
    for k in range(11):
        x = chart_x(k / 10)
        parts.append(f'<line x1="{x}" y1="{bottom}" x2="{x}" y2="{bottom + (6 if k % 2 == 0 else 3)}" '
                     f'stroke="#333"/>')
        if k % 2 == 0:
            parts.append(f'<text x="{x}" y="{bottom + 19}" text-anchor="middle">{k / 10:g}</text>')
    for k in range(5):
        y = chart_y(k / 4)
        parts.append(f'<line x1="{left - 5}" y1="{y}" x2="{left}" y2="{y}" stroke="#333"/>'
                     f'<text x="{left - 8}" y="{y + 4}" text-anchor="end">{k * 25} %</text>')
    parts.append(f'<text x="{(left + right) / 2}" y="{bottom + 40}" text-anchor="middle">'
                 f'{page.t("q.axis_likely")}</text>'
                 f'<text transform="translate(14 {(top + bottom) / 2}) rotate(-90)" '
                 f'text-anchor="middle">{page.t("q.axis_approved")}</text>')
    return "".join(parts)


def chart_bar(tenth, figures):
    """One tenth's bar: the share approved, how many decided above it."""
    x, width = chart_x(tenth) + 4, chart_x(0.1) - chart_x(0) - 8
    y = chart_y(figures["rate"])
    return (f'<rect x="{x}" y="{y}" width="{width}" height="{round(CHART["bottom"] - y, 1)}" '
            f'fill="#4a7"><title>{tenth:.1f}–{tenth + 0.1:.1f}: {figures["approved"]}/'
            f'{figures["decided"]}</title></rect>'
            f'<text x="{x + width / 2}" y="{y - 3}" text-anchor="middle">{figures["decided"]}</text>')


def calibration_svg(by_likely, page):
    """Approval rate per tenth of likely as bars beside the honest line (a
    chance of 0.7 approved 7 times in 10), on labelled axes, in plain SVG."""
    bars = "".join(chart_bar(tenth, figures) for tenth, figures in sorted(by_likely.items()))
    return (f'<svg class="calibration" viewBox="0 0 {CHART["width"]} {CHART["height"]}" '
            f'width="{CHART["width"]}" height="{CHART["height"]}" role="img" '
            f'aria-label="{page.t("q.calibration_label")}" font-size="11" fill="#1d2330">'
            f'{bars}<line x1="{chart_x(0)}" y1="{chart_y(0)}" x2="{chart_x(1)}" y2="{chart_y(1)}" '
            f'stroke="#999" stroke-dasharray="5 4"/>{chart_axes(page)}</svg>')


def calibration_figure(by_likely, page):
    """The chart with what it shows in words, or why there is none yet."""
    if not by_likely:
        return f'<p class="muted">{page.t("q.calibration_none")}</p>'
    decided = sum(f["decided"] for f in by_likely.values())
    return (f'<figure>{calibration_svg(by_likely, page)}<figcaption class="small muted">'
            f'{page.t("q.bars", n=decided)}; {page.t("q.diagonal")}. {page.t("q.reading")}'
            f'</figcaption></figure>')


def header_row(page, *keys):
    return "<tr>" + "".join(f"<th>{page.t(key)}</th>" for key in keys) + "</tr>"


def rate_rows(rates, label):
    return "".join(f'<tr><td>{label(k)}</td><td>{f["approved"]}/{f["decided"]}</td>'
                   f'<td>{percent(f["rate"])} %</td></tr>' for k, f in rates.items())


def worst_item(worst, page):
    """One of the worst disagreements: the decision, the score, the post, why."""
    title = esc(worst["title"]) or "—"
    if is_web_link(worst["url"]):
        title = f'<a href="{esc(worst["url"])}" rel="noopener noreferrer" target="_blank">{title}</a>'
    weighed = (f' <span class="small muted">({page.t("weighed")}: {esc(", ".join(worst["weighed"]))})'
               f'</span>' if worst["weighed"] else "")
    return (f'<li>{page.t("status." + worst["decision"])} · {page.t("likely")} '
            f'{worst["likely"]:.2f} · {title}{weighed}</li>')


def week_part(card, page):
    """What learning changed on the desk in the last 7 days (nothing to say
    while the direction has no model and nothing changed)."""
    week = card["changed_this_week"]
    if not week["raised"]["posts"] and not week["lowered"]["posts"]:
        return "" if not card["model_used"] else \
            f'<h3>{page.t("q.week")}</h3><p class="muted">{page.t("q.week_none")}</p>'
    rows = "".join(f'<tr><td>{change_label(change, week, page.t)}</td><td>{week[change]["posts"]}</td>'
                   f'<td>{week[change]["decided"]}</td><td>{share_of(week[change])}</td></tr>'
                   for change in ("raised", "lowered"))
    return (f'<h3>{page.t("q.week")}</h3><table>'
            f'{header_row(page, "q.change", "q.posts", "q.decided", "q.approved")}{rows}</table>')


def precision_part(card, page):
    """The first 20 and 50 of each order on the held-out decisions."""
    precision = card["precision"]
    held_out = precision["held_out"] if precision else 0
    if held_out < card["minimum"]["held_out"]:
        return (f'<h3>{page.t("q.precision")}</h3><p class="muted">'
                f'{page.t("q.precision_few", n=held_out, min=card["minimum"]["held_out"])}</p>')
    rests_on = precision["rests_on"]
    rows = "".join(f'<tr><td>{page.t(label)}</td>'
                   f'<td>{precision_cell(precision[order]["p20"], rests_on["p20"], page.t)}</td>'
                   f'<td>{precision_cell(precision[order]["p50"], rests_on["p50"], page.t)}</td></tr>'
                   for order, label in (("learned", "q.learned"), ("relevance", "q.by_relevance")))
    fewer = "" if held_out >= 50 else f' {page.t("q.fewer", n=held_out, k=20 if held_out < 20 else 50)}'
    return (f'<h3>{page.t("q.precision")}</h3><table><tr><th>{page.t("q.order")}</th>'
            f'<th>{page.t("q.first", k=20)}</th><th>{page.t("q.first", k=50)}</th></tr>{rows}</table>'
            f'<p class="small muted">{page.t("q.held_out", n=held_out, older=precision["learned_from"])}'
            f'{fewer}</p>')


def sources_part(card, page):
    rows = "".join(f'<tr><td>{esc(name)}</td><td>{f["approved"]}/{f["decided"]}</td>'
                   f'<td>{percent(f["rate"])} %</td>'
                   f'<td>{percent(f["interval"][0])}–{percent(f["interval"][1])} %</td></tr>'
                   for name, f in card["sources"].items())
    return (f'<h3>{page.t("q.sources")}</h3><table>'
            f'{header_row(page, "q.source", "q.approved", "q.share", "q.range")}{rows}</table>'
            f'<p class="small muted">{page.t("q.interval_means")}</p>')


def editors_part(card, page):
    rows = "".join(f'<tr><td>{esc(name)}</td><td>{e["decisions"]}</td><td>{e["per_day"]}</td>'
                   f'<td>{percent(e["approval_rate"])} %</td></tr>' for name, e in card["editors"].items())
    return (f'<h3>{page.t("q.editors")}</h3><table>'
            f'{header_row(page, "q.editor", "q.decisions_col", "q.per_day", "q.share")}{rows}</table>')


def quality_section(card, page):
    """One direction's report card (one with decisions)."""
    approved, model, agrees, misses = card_sentences(card, page.t)
    worst = "".join(worst_item(w, page) for w in card["worst"])
    kappa_means = f'<p class="small muted">{page.t("q.kappa_means")}</p>' \
        if card["decisions"] >= card["minimum"]["decisions"] else ""
    return (f'<section class="quality" id="direction-{esc(card["direction"])}">'
            f'<h2>{esc(card["title"])}</h2><p>{approved} {model}</p><p>{agrees}</p>{kappa_means}'
            f'<p>{misses}</p>{week_part(card, page)}{precision_part(card, page)}'
            f'<h3>{page.t("q.calibration")}</h3>{calibration_figure(card["by_likely"], page)}'
            + (f'<table>{header_row(page, "q.tenth", "q.approved", "q.share")}'
               f'{rate_rows(card["by_likely"], lambda k: f"{k:.1f}–{k + 0.1:.1f}")}</table>'
               if card["by_likely"] else "") +
            f'<h3>{page.t("q.by_relevance_title")}</h3><table>'
            f'{header_row(page, "relevance", "q.approved", "q.share")}'
            f'{rate_rows(card["by_relevance"], str)}</table>{sources_part(card, page)}'
            + (f'<h3>{page.t("q.worst")}</h3><ol>{worst}</ol>' if worst else "") +
            f'{editors_part(card, page)}</section>')


def agreement_section(agreement, page):
    if not agreement["pairs"]:
        return f'<section id="agreement"><p class="muted">{page.t("q.no_pairs")}</p></section>'
    rows = "".join(f'<tr><td>{esc(pair)}</td><td>{page.t("q.agreement", **f)}</td></tr>'
                   for pair, f in agreement["by_pair"].items())
    return (f'<section id="agreement"><h2>{page.t("q.pairs")}</h2>'
            f'<p>{page.t("q.agreement", pairs=agreement["pairs"], agreed=agreement["agreed"])}</p>'
            f'<table>{header_row(page, "q.editor_pair", "q.agreed")}{rows}</table></section>')


def quality_page(report, page, agreement=None):
    """Every direction with decisions in full; those without, in one line."""
    body = "".join(quality_section(card, page) for card in report if card["decisions"])
    idle = [card["title"] for card in report if not card["decisions"]]
    if idle:
        body += (f'<p class="muted" id="no-decisions">'
                 f'{page.t("q.no_decisions", titles=", ".join(idle))}</p>')
    if not report:
        body = f'<p class="muted">{page.t("q.none")}</p>'
    if agreement is not None:
        body += agreement_section(agreement, page)
    return layout(page, page.strings["quality"], body, "/quality")


###############################################################################
# Outbox page #################################################################
###############################################################################
# /outbox and the editors' actions on what it shows.

# The outbox (/outbox): every publish target with its publications, the ones
# that need an editor first (uncertain, failed), then the queue in the order
# it is sent, then the latest sent or cancelled.
OUTBOX_DONE = 50
OUTBOX_ORDER = {"uncertain": 0, "failed": 1, "sending": 2, "queued": 3}


def pace_words(seconds):
    for unit, size in (("h", HOUR), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)} {unit}"
    return f"{seconds:g} s"


def outbox_rows(conn, name):
    waiting = conn.execute(f"""SELECT u.*, p.title, p.url FROM publications u
                               LEFT JOIN posts p ON p.id = u.post_id
                               WHERE u.target = ? AND u.state IN ('uncertain', 'failed', 'sending', 'queued')
                               ORDER BY u.hurry DESC, u.queued_at, u.id""", (name,)).fetchall()
    done = conn.execute(f"""SELECT u.*, p.title, p.url FROM publications u
                            LEFT JOIN posts p ON p.id = u.post_id
                            WHERE u.target = ? AND u.state IN ('published', 'cancelled')
                            ORDER BY coalesce(u.deleted_at, u.sent_at, u.queued_at) DESC, u.id DESC
                            LIMIT ?""", (name, OUTBOX_DONE)).fetchall()
    return [Publication.of(row) for row in
            sorted(waiting, key=lambda row: OUTBOX_ORDER[row["state"]]) + done]


def text_limit(kind):
    """How long a text a target of this kind takes, as shown_length counts."""
    return WEBHOOK_TEXT_LIMIT if kind == "webhook" else TELEGRAM_LIMIT


def text_problem(kind, text, page):
    """Why an editor's text cannot be sent, in the page's words; or None."""
    if not text.strip():
        return page.t("o.empty_text")
    length = shown_length(text) if kind != "webhook" else len(text)
    if length > text_limit(kind):
        return page.t("o.too_long", n=length, limit=text_limit(kind))
    return None


def text_form(row, kind, page, draft=None):
    """The text to send, as plain text, with what is left of the limit
    (counted by the outbox's script as shown_length counts) and, for a text
    refused, the editor's words and why."""
    text, problem = draft or (row.text, None)
    counted = "telegram" if kind != "webhook" else "plain"
    note = f'<p class="banner" role="alert">{problem}</p>' if problem else ""
    hint = page.t("o.plain_hint") if kind != "webhook" else ""
    return (f'{note}<textarea name="text" rows="6" data-limit="{text_limit(kind)}" '
            f'data-count="{counted}">{esc(text if text is not None else "")}</textarea>'
            f'<span class="small muted counter"></span> <span class="small muted">{hint}</span>')


def publication_actions(row, kind, page, draft=None):
    """The forms of what an editor may do to a publication in its state
    (none for a reader who may not publish)."""
    if not page.may("editor"):
        return ""

    def form(action, label, extra=""):
        return (f'<form method="post" action="/publications/{row.id}" class="actions">'
                f'<input type="hidden" name="token" value="{esc(page.token)}">'
                f'<input type="hidden" name="back" value="/outbox">'
                f'<input type="hidden" name="seen" value="{esc(row.state)}">'
                f'<input type="hidden" name="version" value="{row.version}">{extra}'
                f'<button name="action" value="{action}">{page.t(label)}</button></form>')
    if row.retract and row.state == "uncertain":
        return form("cancel", "o.checked")
    parts = []
    if row.state in PUBLICATION_ACTIONS["text"]:
        parts.append(form("text", "o.save", text_form(row, kind, page, draft)))
    for action, label in (("now", "o.now_button"), ("published", "o.published_button"),
                          ("again", "o.again"), ("cancel", "o.cancel")):
        if row.state in PUBLICATION_ACTIONS[action] and not (action == "now" and row.hurry):
            parts.append(form(action, label))
    return "".join(parts)


def publication_note(row, target, page):
    """What an editor should know of an uncertain send."""
    if row.state != "uncertain":
        return ""
    if row.retract:
        return f'<p class="banner">{page.t("o.taken_back_uncertain", chat=shown_address(target))}</p>'
    return f'<p class="muted">{page.t("o.uncertain")}</p>'


def publication_row(row, target, page, draft=None):
    state = page.t(f"o.state.{row.state}")
    if row.retract and row.state in ("sending", "published", "cancelled"):
        state += f'<br><small>{page.t("o.deleting")}</small>'
    if row.deleted_at:
        state += f'<br><small>{page.t("o.deleted", when=row.deleted_at)}</small>'
    if row.hurry and row.state == "queued":
        state += f'<br><small>{page.t("o.hurry")}</small>'
    title = esc(row.title or f"post {row.post_id}")
    if row.url and row.url.startswith(("http://", "https://")):
        title = f'<a href="{esc(row.url)}" rel="noreferrer">{title}</a>'
    sent = row.text if row.state not in PUBLICATION_ACTIONS["text"] or not page.may("editor") \
        else None
    shown = f'<details><summary class="small">{page.t("o.text")}</summary>' \
            f'<div class="text">{esc(sent)}</div></details>' if sent else ""
    return (f'<tr id="publication-{row.id}" class="pub-{esc(row.state)}"><td>{title}{shown}</td>'
            f'<td>{state}</td><td>{esc(row.queued_at)}</td><td>{esc(row.sent_at)}</td>'
            f'<td>{row.attempts}</td><td>{esc(shorten(row.message_id or "", 80))}</td>'
            f'<td class="error">{esc(shorten(row.error or "", 300))}</td>'
            f'<td>{publication_note(row, target, page)}'
            f'{publication_actions(row, target.kind, page, draft)}</td></tr>')


def shown_address(target):
    """Where a target sends, fit for a page: a webhook's host only (its path,
    query or user part often holds the receiver's secret)."""
    if target.kind != "webhook":
        return target.address
    parts = urllib.parse.urlsplit(target.address)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}/…"


def outbox_section(conn, target, page, drafts=None):
    kind = page.t(f"o.kind.{target.kind}")
    directions = ", ".join(target.directions) if target.directions else \
        page.strings["o.all"]
    if target.kind == "alert":
        pace = page.t("o.per_hour", n=target.per_hour, min=target.min_relevance)
    else:
        pace = page.t("o.every", every=pace_words(target.every)) if target.every else \
            page.t("o.now")
    facts = [f"{kind} {esc(shown_address(target))}", esc(directions), pace]
    if target.last_sent_at:
        facts.append(page.t("o.last_sent", when=target.last_sent_at))
    warnings = []
    if not target.enabled:
        warnings.append(page.t("o.disabled"))
    if (parse_utc(target.paused_until) or 0) > time.time():
        warnings.append(page.t("o.paused", when=target.paused_until))
    if target.error:
        warnings.append(esc(target.error))
    if target.sender and (target.sender_until or "") > utc_text():
        facts.append(page.t("o.sender", who=target.sender, until=target.sender_until))
    rows = outbox_rows(conn, target.name)
    table = (f'<table class="outbox stack"><tr><th>{page.t("o.col.post")}</th>'
             f'<th>{page.t("o.col.state")}</th><th>{page.t("o.col.queued")}</th>'
             f'<th>{page.t("o.col.sent")}</th><th>{page.t("o.col.tries")}</th>'
             f'<th>{page.t("o.col.message")}</th><th>{page.t("o.col.error")}</th><th></th></tr>'
             + "".join(publication_row(row, target, page, (drafts or {}).get(row.id))
                       for row in rows) + "</table>") if rows else \
        f'<p class="muted">{page.t("o.empty")}</p>'
    return (f'<section id="target-{esc(target.name)}"><h2>{esc(target.name)}</h2>'
            f'<p class="muted">{" · ".join(facts)}</p>'
            + "".join(f'<p class="banner">{w}</p>' for w in warnings) + table + "</section>")


def outbox_page(conn, page, drafts=None):
    """Every target and its publications; `drafts`: {publication id: (text,
    why it was refused)} of texts an editor's save did not store."""
    targets = sorted(read_targets(conn), key=lambda target: not target.enabled)
    body = "".join(outbox_section(conn, target, page, drafts) for target in targets) or \
        f'<p class="muted">{page.t("o.none")}</p>'
    return layout(page, page.strings["outbox"], body + f"<script>{OUTBOX_SCRIPT}</script>", "/outbox")


###############################################################################
# Users and sign-in pages #####################################################
###############################################################################
# /users (accounts, roles, locks and the audit) and /login.

def login_problem(page, problem):
    """Why the last try did not sign in, in the page's words."""
    if problem is None:
        return ""
    if problem[0] == "locked":
        text = page.t(f"login.locked.{problem[1]}", when=utc_text(problem[2]),
                      minutes=max(1, math.ceil((problem[2] - time.time()) / 60)))
    else:
        text = page.t(f"login.{problem[0]}")
    return f'<p class="banner" role="alert">{text}</p>'


def login_form(page, token, after, problem=None, name=""):
    """The sign-in form: name, password, and its hidden fields; `problem`:
    why the last try did not sign in (see login_problem)."""
    return (f'<h2>{page.t("login.title")}</h2>{login_problem(page, problem)}'
            f'<form method="post" action="/login" class="login">'
            f'<input type="hidden" name="token" value="{esc(token)}">'
            f'<input type="hidden" name="next" value="{esc(after)}">'
            f'<p><label>{page.t("login.user")}<br><input name="user" autocomplete="username" '
            f'value="{esc(name)}" required autofocus></label></p>'
            f'<p><label>{page.t("login.password")}<br><input name="password" type="password" '
            f'autocomplete="current-password" required></label></p>'
            f'<p><button class="primary">{page.t("sign_in")}</button></p></form>')


def role_options(page, chosen):
    return "".join(f'<option value="{role}"{" selected" if role == chosen else ""}>'
                   f'{page.t("role." + role)}</option>' for role in ROLES)


def user_row(user, page):
    def form(action, label, extra=""):
        return (f'<form method="post" action="/users/{esc(urllib.parse.quote(user["name"]))}" '
                f'class="actions"><input type="hidden" name="token" value="{esc(page.token)}">'
                f'{extra}<button name="action" value="{action}">{page.t(label)}</button></form>')
    own = page.account is not None and page.account.name == user["name"]
    if user["settings"]:
        actions = [f'<span class="small muted">{page.t("u.by_settings")}</span>']
    else:
        actions = [form("password", "u.set_password",
                        f'<input type="password" name="password" autocomplete="new-password" '
                        f'minlength="{MIN_PASSWORD}" placeholder="{page.t("u.password")}">')]
    if not own and not user["settings"]:
        actions.append(form("role", "u.set_role",
                            f'<select name="role">{role_options(page, user["role"])}</select>'))
        actions.append(form("enable", "u.enable") if user["disabled"] else
                       form("disable", "u.disable"))
    state = page.t("u.disabled") if user["disabled"] else page.t("u.enabled")
    return (f'<tr id="user-{esc(user["name"])}"><td>{esc(user["name"])}</td>'
            f'<td>{page.t("role." + user["role"]) if user["role"] in ROLES else esc(user["role"])}</td>'
            f'<td>{state}</td><td>{esc(user["created_at"])}</td><td>{user["sessions"]}</td>'
            f'<td>{"".join(actions)}</td></tr>')


def event_words(event, page):
    """An event's action in the page's language (an older or unknown one as kept)."""
    key = "event." + (event["action"] or "")
    return page.t(key) if key in page.strings else esc(event["action"])


def locks_table(conn, page):
    """The names and addresses whose sign-ins are refused now, and until when."""
    locks = sign_in_locks(conn)
    if not locks:
        return f'<p class="muted">{page.t("u.no_locks")}</p>'
    rows = "".join(f'<tr><td>{page.t("u.lock." + kind)}</td><td>{esc(key)}</td>'
                   f'<td>{esc(utc_text(until))}</td></tr>' for kind, key, until in locks)
    return (f'<table class="locks stack"><tr><th>{page.t("u.locked")}</th><th></th>'
            f'<th>{page.t("u.until")}</th></tr>{rows}</table>')


def users_page(conn, page, settings_user):
    """The accounts, a form to add one, the sign-ins refused now, and the
    latest events."""
    users = "".join(user_row(user, page) for user in list_users(conn))
    add = (f'<form method="post" action="/users" class="actions">'
           f'<input type="hidden" name="token" value="{esc(page.token)}">'
           f'<input name="name" required maxlength="64" placeholder="{page.t("u.name")}"> '
           f'<select name="role">{role_options(page, "editor")}'
           f'</select> <input type="password" name="password" autocomplete="new-password" '
           f'minlength="{MIN_PASSWORD}" required placeholder="{page.t("u.password")}"> '
           f'<button class="primary">{page.t("u.add")}</button></form>')
    events = "".join(f'<tr><td>{esc(e["at"])}</td><td>{esc(e["user_name"])}</td>'
                     f'<td>{esc(e["address"])}</td><td>{event_words(e, page)}</td>'
                     f'<td>{esc(e["subject"])}</td><td>{esc(e["detail"])}</td></tr>'
                     for e in recent_events(conn))
    body = (f'<h2>{page.t("users")}</h2><p class="muted">{page.t("u.env", name=settings_user)}</p>'
            f'<table class="users stack"><tr><th>{page.t("u.name")}</th><th>{page.t("u.role")}</th>'
            f'<th>{page.t("u.state")}</th><th>{page.t("u.created")}</th>'
            f'<th>{page.t("u.sessions")}</th><th></th></tr>{users}</table>{add}'
            f'<h2>{page.t("u.locks")}</h2>{locks_table(conn, page)}'
            f'<h2>{page.t("u.events")}</h2><table class="events stack"><tr><th>{page.t("u.when")}</th>'
            f'<th>{page.t("u.who")}</th><th>{page.t("u.from")}</th><th>{page.t("u.what")}</th>'
            f'<th></th><th></th></tr>{events}</table>')
    return layout(page, page.strings["users"], body, "/users")


###############################################################################
# Exports and metrics #########################################################
###############################################################################
# Atom, JSON Feed, CSV and /metrics.

# What XML 1.0 cannot hold even escaped (outside its Char production): control
# characters other than tab and line breaks, surrogates, U+FFFE and U+FFFF.
# One of them in a stranger's title would make a whole feed unreadable to
# every subscriber, so every XML document VESTI writes drops them.
NOT_XML_CHARS = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(value):
    """`value` as text an XML document can hold."""
    return NOT_XML_CHARS.sub("", str(value))


def xml_esc(value):
    """`value` for an element or attribute of XML written by hand."""
    return "" if value is None else esc(xml_text(value))


def post_link(post):
    return post["url"] if is_web_link(post["url"]) else None


def published_date(post):
    """When the post was published, or None for an undated one: its
    published_at is then only when it was fetched, which an export does not
    pass off as a publication date."""
    return None if post["undated"] else post["published_at"]


# Atom has no element for an editor's decision: who decided is the entry's
# contributor, and both who and when are said in VESTI's own namespace (a
# reader cannot tell an <updated> that is a decision from one that is not).
ATOM_VESTI = "urn:vesti"


def atom_decision(post):
    """The elements of an entry that say who decided it and when."""
    by, at = post["decided_by"], post["decided_at"]
    return ((f"<contributor><name>{xml_esc(by)}</name></contributor>"
             f"<vesti:decided_by>{xml_esc(by)}</vesti:decided_by>" if by else "")
            + (f"<vesti:decided_at>{iso_time(at)}</vesti:decided_at>" if at else ""))


def atom_feed(posts, title, self_url=None):
    """Atom 1.0 of decided posts, newest decision first."""
    updated = iso_time(max((p["decided_at"] or p["published_at"] for p in posts), default=None))
    entries = []
    for p in posts:
        link, published = post_link(p), published_date(p)
        entries.append(
            f"<entry><id>urn:vesti:post:{p['id']}</id><title>{xml_esc(p['title'] or '(untitled)')}</title>"
            + (f'<link rel="alternate" href="{xml_esc(link)}"/>' if link else "")
            + (f"<published>{iso_time(published)}</published>" if published else "")
            + f"<updated>{iso_time(p['decided_at'] or p['published_at'])}</updated>"
            f"<author><name>{xml_esc(p['source'] or 'VESTI')}</name></author>"
            + atom_decision(p)
            + (f'<category term="{xml_esc(p["direction"])}"/>' if p["direction"] else "")
            + f"<summary>{xml_esc(p['summary'] or '')}</summary></entry>")
    self_link = f'<link rel="self" href="{xml_esc(self_url)}"/>' if self_url else ""
    return ('<?xml version="1.0" encoding="utf-8"?>\n'
            f'<feed xmlns="http://www.w3.org/2005/Atom" xmlns:vesti="{ATOM_VESTI}">'
            f"<id>urn:vesti:{urllib.parse.quote(title.lower(), safe='')}</id><title>{xml_esc(title)}</title><updated>{updated}</updated>"
            f"{self_link}<generator>VESTI {__version__}</generator>{''.join(entries)}</feed>\n")


def json_feed(posts, title, self_url=None):
    """JSON Feed 1.1 of decided posts, newest decision first."""
    items = []
    for p in posts:
        published = published_date(p)
        item = {"id": str(p["id"]), "title": p["title"] or "(untitled)",
                "content_text": p["summary"] or p["title"] or "",
                **({"date_published": iso_time(published)} if published else {}),
                "date_modified": iso_time(p["decided_at"] or p["published_at"]),
                "authors": [{"name": p["source"] or "VESTI"}],
                "tags": [p["direction"]] if p["direction"] else [],
                "_vesti": {"status": p["status"], "relevance": p["relevance"],
                           "interest": p["interest"], "decided_by": p["decided_by"],
                           "decided_at": p["decided_at"] and iso_time(p["decided_at"])}}
        if post_link(p):
            item["url"] = post_link(p)
        items.append(item)
    feed = {"version": "https://jsonfeed.org/version/1.1", "title": title, "items": items}
    if self_url:
        feed["feed_url"] = self_url
    return json.dumps(feed, ensure_ascii=False, indent=1)


EXPORT_FIELDS = ("id", "status", "decided_at", "decided_by", "direction", "relevance",
                 "interest", "title", "url", "source", "published_at", "summary", "keywords",
                 "reason")


# A cell starting with one of these is a formula to a spreadsheet (Excel,
# LibreOffice), which runs it when the export is opened. As OWASP advises
# against CSV injection, such a cell starts with a ' instead, and every cell
# is quoted, so that a ; (the separator in many locales) starts no cell.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_cell(value):
    """A CSV cell's value, never read as a formula."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value


def csv_export(posts):
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(EXPORT_FIELDS)
    for p in posts:
        writer.writerow([spreadsheet_cell(published_date(p) if f == "published_at" else p[f])
                         for f in EXPORT_FIELDS])
    return out.getvalue()


def metric_lines(name, kind, help_text, samples):
    """One metric family in Prometheus' text exposition format."""
    lines = [f"# HELP vesti_{name} {help_text}", f"# TYPE vesti_{name} {kind}"]
    for suffix, labels, value in samples:
        lines.append(f"vesti_{name}{suffix}{{{labels}}} {value:g}" if labels
                     else f"vesti_{name}{suffix} {value:g}")
    return lines


def metrics_text(conn):
    """Queue sizes, sources by status, fetch outcomes and new posts by
    crawler kind, LLM calls, failures and latency, and decisions."""
    catch_up_index(conn)
    queue = queue_sizes(conn)
    counted = counters(conn)
    sources = {(crawler, status): n for crawler, status, n in sources_by_status(conn)}
    decisions = dict(conn.execute("SELECT status, sum(n) FROM post_counts GROUP BY status"))
    fetches = counted.get("fetches", {})
    buckets, cumulative = counted.get("llm_seconds_bucket", {}), 0
    histogram = []
    for bound in [*LLM_BUCKETS, "+Inf"]:
        cumulative += buckets.get(f'le="{bound}"', 0)
        histogram.append(("_bucket", f'le="{bound}"', cumulative))
    histogram += [("_sum", "", counted.get("llm_seconds_sum", {}).get("", 0)),
                  ("_count", "", cumulative)]
    lines = [
        *metric_lines("queue_posts", "gauge", "Posts in the queue by state.",
                      [("", f'state="{k}"', v) for k, v in queue.items()]),
        *metric_lines("sources", "gauge", "Sources by crawler kind and status.",
                      [("", f'crawler="{c}",status="{st}"', sources.get((c, st), 0))
                       for c in CRAWLERS for st in ("alive", "dead", "silent", "disabled")]),
        *metric_lines("fetches_total", "counter", "Source fetches by crawler kind and outcome.",
                      [("", labels, fetches.get(labels, 0)) for labels in
                       (f'crawler="{c}",outcome="{o}"' for c in CRAWLERS
                        for o in ("ok", "not_modified", "error", "deferred"))]),
        *metric_lines("new_posts_total", "counter", "New posts stored, by crawler kind.",
                      [("", f'crawler="{c}"', counted.get("new_posts", {}).get(f'crawler="{c}"', 0))
                       for c in CRAWLERS]),
        *metric_lines("llm_calls_total", "counter", "Classifications answered by the LLM.",
                      [("", "", counted.get("llm_calls", {}).get("", 0))]),
        *metric_lines("llm_failures_total", "counter", "LLM calls that failed, by reason.",
                      [("", f'reason="{r}"', counted.get("llm_failures", {}).get(f'reason="{r}"', 0))
                       for r in ("unreachable", "answer")]),
        *metric_lines("llm_seconds", "histogram", "Seconds per LLM classification.", histogram),
        *metric_lines("classified_posts", "gauge", "Classified posts by the editor's decision, a story once.",
                      [("", f'status="{d}"', decisions.get(d) or 0) for d in DECISIONS]),
        *metric_lines("stories_joined_total", "counter",
                      "Posts that joined the story of an earlier post and took its verdict.",
                      [("", "", counted.get("stories_joined", {}).get("", 0))]),
        *metric_lines("llm_calls_saved_total", "counter",
                      "LLM calls not made because the post's story had a verdict.",
                      [("", "", counted.get("llm_calls_saved", {}).get("", 0))]),
        *metric_lines("stories", "gauge", "Stories with more than one post.",
                      [("", "", story_figures(conn)["stories"])]),
        *metric_lines("publications", "gauge", "Publications by target and state.",
                      [("", f'target="{target}",state="{state}"', states.get(state, 0))
                       for target, states in publication_counts(conn).items()
                       for state in PUBLICATION_STATES]),
    ]
    return "\n".join(lines) + "\n"


###############################################################################
# HTTP front ##################################################################
###############################################################################
# One thread (the front) accepts connections and reads each request whole,
# without a thread per connection; a pool of threads answers whole requests
# only. A client that drips its request, or many of them reconnecting as soon
# as they are dropped, then costs a socket and a few bytes, never a thread
# the editors' requests wait for.

# A request's head (request line and headers) may take this many bytes, the
# longest line http.server reads.
MAX_REQUEST_HEAD = 65536
# The end of a request's head: an empty line (http.server takes LF for CRLF).
HEAD_END = re.compile(rb"\n\r?\n")
HEAD_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
                  b"Content-Type: text/plain\r\nContent-Length: 23\r\n\r\nRequest head too large\n")
# accept() failing for want of a file: the oldest unfinished request makes
# room, or accepting pauses this many seconds.
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_PAUSE = 0.1
# The log tells of one client address's dropped requests at most once in
# this many seconds.
DROPS_TOLD_EVERY = 60


def readable_body_length(headers, limit):
    """The Content-Length of a request body the page reads, or None for one
    it refuses unread (not a number, or over `limit`, see body_limit)."""
    length = headers.get("Content-Length", "0")
    if not digits_only(length):
        return None
    # Its digits are counted before they make a number: Python refuses a
    # number of over 4,300 digits, which a client may well send.
    digits = length.lstrip("0") or "0"
    if len(digits) > len(str(limit)) or int(digits) > limit:
        return None
    return int(digits)


def body_to_read(head):
    """Bytes of body to wait for after a request's head: its Content-Length
    when the page would read it (a larger one is refused unread)."""
    line, _, lines = bytes(head).partition(b"\n")
    try:
        headers = http.client.parse_headers(io.BytesIO(lines))
    except http.client.HTTPException:
        return 0            # http.server refuses it again, with its reason
    words = line.split()
    path = words[1].decode("latin-1") if len(words) == 3 else "/"
    return readable_body_length(headers, body_limit(path)) or 0


def connection_limit():
    """Connections the front holds at most: a few thousand, and no more than
    half the files this process may open (the rest are the answered
    connections, the database and the crawls')."""
    try:
        import resource
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError):
        return 512
    return 4096 if files == resource.RLIM_INFINITY else max(64, min(4096, files // 2))


class WebConnection:
    """A client's connection as the front holds it: what it sent of its next
    request, and by when that request must be whole."""

    def __init__(self, sock, address):
        self.sock, self.address = sock, address
        # Counted per client: an IPv6 client is its whole /64.
        self.client = address_key(address[0])
        self.received = bytearray()
        self.scanned, self.head_end, self.body = 0, None, 0
        self.deadline = math.inf
        self.taken = b""            # the request a worker answers

    def request_size(self):
        """Bytes of the next request (head and body), once its head is in."""
        if self.head_end is None:
            found = HEAD_END.search(self.received, max(0, self.scanned - 2))
            self.scanned = len(self.received)
            if found is None:
                return None
            self.head_end = found.end()
            self.body = body_to_read(self.received[:self.head_end])
        return self.head_end + self.body

    def head_too_large(self):
        return (self.head_end or len(self.received)) > MAX_REQUEST_HEAD

    def room(self):
        """Bytes to receive at most: the rest of the request once its head
        is in, else one past the longest head (enough to refuse it)."""
        size = self.request_size()
        return (MAX_REQUEST_HEAD + 1 if size is None else size) - len(self.received)

    def take_request(self):
        """The next request once it is whole (the bytes after it stay for
        the one after), else None."""
        size = self.request_size()
        if size is None or len(self.received) < size:
            return None
        request = bytes(self.received[:size])
        del self.received[:size]
        self.scanned, self.head_end, self.body = 0, None, 0
        return request


class WaitingConnections:
    """The connections the front waits on for a whole request, oldest first
    (the first to pass their deadline), in all and per client, and the bytes
    of their requests it holds."""

    def __init__(self):
        self.all = collections.OrderedDict()     # connection: its bytes in `buffered`
        self.of_client = {}
        self.buffered = 0

    def __len__(self):
        return len(self.all)

    def __iter__(self):
        return iter(self.all)

    def __contains__(self, conn):
        return conn in self.all

    def add(self, conn):
        self.all[conn] = 0
        self.recount(conn)
        self.of_client.setdefault(conn.client, collections.OrderedDict())[conn] = None

    def recount(self, conn):
        """`conn` received more of its request."""
        self.buffered += len(conn.received) - self.all[conn]
        self.all[conn] = len(conn.received)

    def remove(self, conn):
        self.buffered -= self.all.pop(conn)
        mine = self.of_client[conn.client]
        del mine[conn]
        if not mine:
            del self.of_client[conn.client]

    def count(self, client):
        return len(self.of_client.get(client, ()))

    def oldest(self, client=None):
        return next(iter(self.all if client is None else self.of_client.get(client, ())), None)

    def oldest_holding(self):
        """The oldest that sent part of a request (an idle one holds nothing)."""
        return next((conn for conn, held in self.all.items() if held), None)


class DroppedRequests:
    """Requests the front dropped, told in the log once per client and
    reason at most every DROPS_TOLD_EVERY seconds: a client that comes back
    as soon as it is dropped makes a line a minute, not one a connection."""

    TOLD = {"slow": "web: {client} sent {n} request{s} too slowly; dropped",
            "crowded": "web: {client} had more than {per_client} requests coming at once; "
                       "{n} dropped, the oldest first",
            "full": "web: {connections} connections at once; {n} unfinished request{s} of "
                    "{client} dropped, the oldest first",
            "no_files": "web: no file left for another connection ({n} time{s}); "
                        "accepting paused a moment",
            "heavy": "web: requests coming in held over {buffered_mib} MiB; {n} unfinished "
                     "request{s} of {client} dropped, the oldest first"}

    def __init__(self, per_client, connections, buffered=0, clock=time.monotonic):
        self.limits = {"per_client": per_client, "connections": connections,
                       "buffered_mib": buffered // 2**20}
        self.clock = clock
        self.pending = collections.Counter()     # (client, reason): requests not told yet
        self.told = {}                           # (client, reason): when last told

    def count(self, client, reason):
        self.pending[client, reason] += 1
        if self.clock() - self.told.get((client, reason), -math.inf) >= DROPS_TOLD_EVERY:
            self.tell(client, reason)

    def tell_due(self):
        """Tell what waited for its minute; forget clients told long ago."""
        now = self.clock()
        for key, when in list(self.told.items()):
            if now - when >= DROPS_TOLD_EVERY:
                if key in self.pending:
                    self.tell(*key)
                else:
                    del self.told[key]

    def tell(self, client, reason):
        n = self.pending.pop((client, reason))
        self.told[client, reason] = self.clock()
        log.warning(self.TOLD[reason].format(client=client, n=n, s="" if n == 1 else "s",
                                             **self.limits))


class WebWorkers:
    """At most `size` threads answering whole requests, started as they are
    needed and kept; requests beyond them wait their turn. A thread counts
    as free before `answered` gives the connection back, so the next
    request on it finds it free instead of starting another."""

    def __init__(self, size, answer, answered):
        self.size, self.answer, self.answered = size, answer, answered
        self.jobs = queue.SimpleQueue()
        self.idle = threading.Semaphore(0)
        self.threads = []

    def give(self, job):
        """Raises, the job not given, when a thread it needs cannot start."""
        if not self.idle.acquire(blocking=False) and len(self.threads) < self.size:
            thread = threading.Thread(target=self.work, name="web", daemon=True)
            thread.start()
            self.threads.append(thread)
        self.jobs.put(job)

    def work(self):
        while (job := self.jobs.get()) is not None:
            kept_open = self.answer(job)
            self.idle.release()
            self.answered(job, kept_open)

    def stop(self):
        for _ in self.threads:
            self.jobs.put(None)


def forwarded_client(peer, forwarded):
    """The address of the client a request is from: the connection's, or,
    where that is this machine (a reverse proxy in front, as the README
    sets it up), the last address the proxy added to X-Forwarded-For
    (`forwarded`: the header's values, each occurrence; a proxy adds its
    own at the end, after anything the client sent), without a port. So
    sign-in locks, events and the log name each editor's address, not the
    proxy's one for everyone. From another machine the header is not
    believed: anyone may send it."""
    connected = plain_address(peer)
    if connected is None or not connected.is_loopback or not forwarded:
        return str(connected or peer)
    last = forwarded[-1].split(",")[-1].strip()
    if last.startswith("["):                        # [2001:db8::1]:443
        last = last[1:].partition("]")[0]
    elif last.count(":") == 1:                      # 203.0.113.5:51234
        last = last.partition(":")[0]
    client = plain_address(last)
    return str(client or connected)


# Control characters of a request line (C0, DEL, C1) are written to the log
# escaped, and so is the backslash, so an escape cannot be forged.
LOG_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)]}
LOG_ESCAPES[ord("\\")] = "\\\\"


class WebHandler(http.server.BaseHTTPRequestHandler):
    """One whole request (`request`: the WebConnection the front read it
    from) answered on a worker thread."""
    server_version = f"VESTI/{__version__}"
    access_log = logging.getLogger("vesti.access")
    # The whole request (line, headers, body) must arrive within this many
    # seconds, however slowly it trickles in; a slower client is dropped.
    request_deadline = 10
    # Each write of the answer waits at most this long for the client.
    timeout = request_deadline
    # A connection is kept open after a page (HTTP/1.1), for the next request
    # to arrive, whole, within request_deadline; it is closed after anything
    # else (an error, a refusal, a form posted).
    protocol_version = "HTTP/1.1"
    # An answer's headers and a long body are several writes: with Nagle's
    # algorithm on a kept-open connection, the last would wait for the
    # client's delayed acknowledgement (40 ms).
    disable_nagle_algorithm = True

    def setup(self):
        self.connection = self.request.sock
        self.connection.settimeout(self.timeout)
        if self.disable_nagle_algorithm:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        self.rfile = io.BytesIO(self.request.taken)
        self.wfile = self.connection.makefile("wb")

    def handle(self):
        """One request: the front reads the next one, if the connection stays open."""
        self.close_connection = True
        self.handle_one_request()

    def __getattr__(self, name):
        """do_GET, do_POST, … do_TRACE: every method a client names is
        answered by the routes (401 without a login, then 404, or 405 naming
        the methods a path has), not only those http.server was told of."""
        if name.startswith("do_"):
            return functools.partial(self.guard, name[3:])
        raise AttributeError(name)

    def guard(self, method):
        self.client_address = (forwarded_client(self.client_address[0],
                                                self.headers.get_all("X-Forwarded-For")),
                               *self.client_address[1:])
        try:
            with self.server.app.db.lent():
                self.server.app.handle(self, method)
        except (BrokenPipeError, ConnectionResetError):
            log.debug("web: %s %s: the client went away", method, self.path)
        except TimeoutError:
            self.close_connection = True
            log.info("web: %s took its answer too slowly; dropped", self.address_string())
        except StorageError as e:
            log.error("web: %s", e)
            with contextlib.suppress(OSError):
                self.reply(503, "text/plain", b"The database is unavailable; see the server log\n")
        except Exception:
            log.exception("web: %s %s failed", method, self.path)
            with contextlib.suppress(OSError):
                self.reply(500, "text/plain", b"Internal error; see the server log\n")

    def reply(self, status, content_type, body, headers=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status >= 400 or self.command not in ("GET", "HEAD") or self.has_body():
            self.send_header("Connection", "close")
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Referrer-Policy", "same-origin")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def has_body(self):
        return "Content-Length" in self.headers or "Transfer-Encoding" in self.headers

    def log_message(self, format, *args):
        self.access_log.info("%s %s", self.address_string(),
                             (format % args).translate(LOG_ESCAPES))


class WebServer(http.server.HTTPServer):
    """The front: accepts connections and reads each request whole on one
    thread (serve_forever's), then hands it to WebWorkers; a connection kept
    open comes back to it between requests. It holds at most
    `max_connections`, at most `max_per_client` still sending a request per
    client address, and at most `max_buffered` bytes of the requests coming
    in: past any, the oldest unfinished one is dropped."""
    max_threads = 64
    max_per_client = 32
    # Bytes of requests coming in the front holds at most (a connection may
    # hold a 64 KiB head and a body of body_limit): past them, the oldest
    # unfinished request is dropped.
    max_buffered = 32 * 2**20
    # Connections the kernel keeps waiting for accept() (socketserver's 5
    # turns away a burst of clients).
    request_queue_size = 128

    def __init__(self, address, handler):
        # Before the socket is bound: a port in use closes the server at once.
        self.max_connections = connection_limit()
        self.waiting = WaitingConnections()
        self.answering = 0                       # connections the workers have
        self.returned = queue.SimpleQueue()      # (connection, kept open) from the workers
        self.workers = WebWorkers(self.max_threads, self.answer, self.give_back)
        self.dropped = DroppedRequests(self.max_per_client, self.max_connections,
                                       self.max_buffered)
        self.stopping, self.stopped, self.closed = (threading.Event() for _ in range(3))
        self.wake_reader, self.wake_writer = socket.socketpair()
        self.wake_reader.setblocking(False)
        self.wake_writer.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.wake_reader, selectors.EVENT_READ, self.take_back)
        self.next_tell, self.accepting_again = 0.0, math.inf
        if ":" in address[0]:           # an IPv6 address: "::" takes IPv4 clients too
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def server_activate(self):
        super().server_activate()
        self.socket.setblocking(False)
        self.selector.register(self.socket, selectors.EVENT_READ, self.accept_clients)

    def serve_forever(self, poll_interval=0.5):
        self.stopped.clear()
        try:
            while not self.stopping.is_set():
                for key, _ in self.selector.select(self.next_wait(poll_interval)):
                    key.data()
                self.drop_late()
                self.tell_drops()
                self.resume_accepting()
        finally:
            self.stopping.clear()
            self.stopped.set()

    def shutdown(self):
        """Stop serve_forever and wait until it has."""
        self.stopping.set()
        self.wake()
        self.stopped.wait()

    def server_close(self):
        self.closed.set()
        super().server_close()
        for conn in list(self.waiting):
            self.close(conn)
        self.close_returned()
        self.workers.stop()
        self.selector.close()
        self.wake_reader.close()
        self.wake_writer.close()

    def next_wait(self, poll_interval):
        oldest = self.waiting.oldest()
        until = min(oldest.deadline if oldest else math.inf, self.accepting_again)
        return max(0.0, min(poll_interval, until - time.monotonic()))

    def wake(self):
        with contextlib.suppress(OSError):         # full: it is being woken already
            self.wake_writer.send(b"\0")

    def accept_clients(self):
        for _ in range(self.request_queue_size):
            try:
                sock, address = self.socket.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in OUT_OF_FILES:
                    return self.make_room()
                continue                # a client that left before it was accepted
            self.guarded(self.welcome, WebConnection(sock, address))

    def make_room(self):
        """No file left for a connection: the oldest unfinished request makes
        room, or, with none, accepting waits a moment (the listening socket
        stays ready, and would be asked again at once)."""
        oldest = self.waiting.oldest()
        if oldest is not None:
            return self.drop(oldest, "full")
        self.dropped.count("", "no_files")
        self.selector.unregister(self.socket)
        self.accepting_again = time.monotonic() + ACCEPT_PAUSE

    def resume_accepting(self):
        if self.accepting_again <= time.monotonic():
            self.accepting_again = math.inf
            self.selector.register(self.socket, selectors.EVENT_READ, self.accept_clients)

    def welcome(self, conn):
        if len(self.waiting) + self.answering >= self.max_connections:
            oldest = self.waiting.oldest()
            if oldest is None:
                return self.shutdown_request(conn.sock)
            self.drop(oldest, "full")
        if self.waiting.count(conn.client) >= self.max_per_client:
            self.drop(self.waiting.oldest(conn.client), "crowded")
        self.wait_for_request(conn)

    def wait_for_request(self, conn):
        conn.sock.setblocking(False)
        conn.deadline = time.monotonic() + self.RequestHandlerClass.request_deadline
        self.waiting.add(conn)
        self.selector.register(conn.sock, selectors.EVENT_READ,
                               functools.partial(self.guarded, self.read, conn))
        self.look_for_request(conn)
        self.keep_within_budget()

    def guarded(self, step, conn):
        """step(conn) on the front. Its failure (a bug, no thread left to
        start) closes that connection, not the front every client needs."""
        try:
            step(conn)
        except Exception:
            log.exception("web: reading the request of %s failed; its connection closed",
                          conn.address[0])
            self.abandon(conn)

    def abandon(self, conn):
        """Close a connection wherever the front had got to with it."""
        if conn in self.waiting:
            self.waiting.remove(conn)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        self.shutdown_request(conn.sock)

    def read(self, conn):
        try:
            data = conn.sock.recv(conn.room())
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:                               # the client went away
            return self.close(conn)
        conn.received += data
        self.waiting.recount(conn)
        self.look_for_request(conn)
        self.keep_within_budget()

    def look_for_request(self, conn):
        if not conn.received:
            return
        conn.request_size()
        if conn.head_too_large():
            with contextlib.suppress(OSError):
                conn.sock.send(HEAD_TOO_LARGE)
            self.RequestHandlerClass.access_log.info(
                "%s sent a request head over %d bytes; refused", conn.address[0], MAX_REQUEST_HEAD)
            return self.close(conn)
        request = conn.take_request()
        if request is not None:
            self.hand_over(conn, request)

    def hand_over(self, conn, request):
        self.stop_waiting(conn)
        conn.taken = request
        self.workers.give(conn)
        self.answering += 1

    def answer(self, conn):
        """On a worker thread: answer the request; whether the connection stays open."""
        try:
            return not self.RequestHandlerClass(conn, conn.address, self).close_connection
        except OSError as e:
            log.debug("web: %s: %s", conn.address[0], e)
        except Exception:
            log.exception("web: answering %s failed", conn.address[0])
        return False

    def give_back(self, conn, keep):
        """On a worker thread: the connection back to the front (to be read
        or closed there). It is put back before `closed` is looked at, as
        server_close sets `closed` before it closes what was put back: one
        of the two closes it, whichever comes second."""
        self.returned.put((conn, keep))
        if self.closed.is_set():
            self.close_returned()
        else:
            self.wake()

    def close_returned(self):
        with contextlib.suppress(queue.Empty):
            while True:
                self.shutdown_request(self.returned.get_nowait()[0].sock)

    def take_back(self):
        with contextlib.suppress(OSError):
            while self.wake_reader.recv(4096):
                pass
        with contextlib.suppress(queue.Empty):
            while True:
                conn, keep = self.returned.get_nowait()
                self.answering -= 1
                if keep:
                    self.guarded(self.wait_for_request, conn)
                else:
                    self.shutdown_request(conn.sock)

    def drop_late(self):
        """Drop the connections whose request is not whole by its deadline
        (quietly one that sent nothing: a kept-open connection left idle)."""
        now = time.monotonic()
        while (oldest := self.waiting.oldest()) is not None and oldest.deadline <= now:
            self.drop(oldest, "slow")

    def keep_within_budget(self):
        while self.waiting.buffered > self.max_buffered:
            self.drop(self.waiting.oldest_holding(), "heavy")

    def drop(self, conn, reason):
        if conn.received:
            self.dropped.count(conn.client, reason)
        self.close(conn)

    def close(self, conn):
        if conn in self.waiting:
            self.stop_waiting(conn)
        self.shutdown_request(conn.sock)

    def stop_waiting(self, conn):
        self.waiting.remove(conn)
        self.selector.unregister(conn.sock)

    def tell_drops(self):
        if time.monotonic() >= self.next_tell:
            self.next_tell = time.monotonic() + 1
            self.dropped.tell_due()


def make_web_server(app, host, port):
    """The web server for `app`; port 0 picks a free port."""
    try:
        server = WebServer((host, port), WebHandler)
    except (OSError, OverflowError) as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    server.app = app
    return server


###############################################################################
# Web server ##################################################################
###############################################################################
# Sign-in (Basic auth and sessions), the routes and the roles they need.

def generated_web_password(conn):
    """With no VESTI_WEB_PASSWORD: a password made at the first start and
    kept, hashed, in the database, so open pages, feed readers and metrics
    scrapers keep working across restarts. Returns it the one time it is
    made (to be printed), else None."""
    if get_meta(conn, "web_password")[0] is not None:
        return None
    password = secrets.token_urlsafe(12)
    kept = password_hash(password, conn.process.password_cost)
    conn.execute("INSERT INTO meta (key, value, updated_at) VALUES ('web_password', ?, ?) "
                 "ON CONFLICT DO NOTHING", (kept, utc_text()))
    # Another process starting at the same moment may have made its own.
    return password if get_meta(conn, "web_password")[0] == kept else None


# Password checks (scrypt) that may wait for the one under way at a time;
# a sign-in beyond them is refused at once (503): guessers from many
# addresses cannot take every thread of the page from signed-in editors.
# One address has one check under way or waiting at a time, so that a
# guesser's flood from one address takes no other's turn.
CHECKS_WAITING = 4


@dataclasses.dataclass(frozen=True)
class Account:
    """Who a request comes from: the name, the role, the token its forms
    carry, and the session's cookie when signed in on /login."""
    name: str
    role: str
    token: str
    session: str = None


SESSION_COOKIE = "vesti_session"
LOGIN_COOKIE = "vesti_login"


def cookies_of(headers):
    jar = http.cookies.SimpleCookie()
    with contextlib.suppress(http.cookies.CookieError):
        jar.load(headers.get("Cookie") or "")
    return {name: morsel.value for name, morsel in jar.items()}


def session_cookie(headers):
    return cookies_of(headers).get(SESSION_COOKIE)


def behind_https(headers):
    """The request came over HTTPS through a proxy that says so."""
    return (headers.get("X-Forwarded-Proto") or "").split(",")[0].strip().lower() == "https"


def cookie(headers, name, value, max_age=None):
    """A Set-Cookie value: HttpOnly, SameSite=Lax, Secure behind HTTPS."""
    parts = [f"{name}={value}", "Path=/", "HttpOnly", "SameSite=Lax"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    if behind_https(headers):
        parts.append("Secure")
    return "; ".join(parts)


def ended_cookie(headers):
    return cookie(headers, SESSION_COOKIE, "", max_age=0)


def basic_credentials(header):
    """(user, password) of a Basic Authorization header, or None."""
    scheme, _, encoded = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(encoded.strip(), validate=True) \
            .decode("utf-8").partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return user, password


def abort(status, text, headers=None):
    """Reply at once with `status` and a one-line text (bottle's abort)."""
    raise EarlyReply(status, text, headers)


def named_wordings(form, ids):
    """{post id: wording} of these posts, as a page's form names the words
    it showed of them ("id:wording,…", see wording); none from a script."""
    named = (part.strip().partition(":") for value in form.get("wording", [])
             for part in value.split(","))
    return {int(i): words for i, _, words in named if POST_ID.fullmatch(i) and int(i) in ids}


class DeskRoutes:
    """The desk (/), the same posts as JSON, the editors' decisions and who
    is looking at which card."""

    # (method, path, handler, the role it needs; None: no sign-in)
    ROUTES = (
        ("GET", r"/", "desk", "viewer"),
        ("GET", r"/api/posts", "api_posts", "viewer"),
        ("POST", r"/posts/([1-9][0-9]{0,17})/status", "decide", "editor"),
        ("POST", r"/posts/status", "decide_many", "editor"),
        ("POST", r"/posts/([1-9][0-9]{0,17})/look", "look", "viewer"),
        ("GET", r"/api/looks", "api_looks", "viewer"),
    )

    def desk(self, request, query, form):
        desk = DeskQuery.read(query, self.registry.directions, self.settings.min_relevance)
        page = self.page(request, query)
        self.rescorer.wait(desk.direction)
        learners = self.learners.refresh(self.db.conn(), owed=self.rescorer.owed)
        self.html(request, desk_page(self.db.conn(), desk, page, self.registry.directions,
                                     self.settings, self.source_options(), learners))

    def api_posts(self, request, query, form):
        """The desk as JSON (see desk_answer); a parameter it cannot read is
        400 naming it, rather than a page of something else."""
        desk = DeskQuery.read(query, self.registry.directions, self.settings.min_relevance)
        limit = query.get("limit", str(API_POSTS))
        wrong = [f"after: not a cursor this answer gave ({shorten(query['after'], 40)!r})"
                 if "after" in query and desk.after is None else None,
                 f"limit: a number from 1 (at most {MAX_API_POSTS} are given) ({shorten(limit, 20)!r})"
                 if not re.fullmatch(r"[1-9][0-9]{0,17}", limit) else None,
                 f"direction: none of {', '.join(self.registry.directions) or 'no direction'} "
                 f"nor 'none' ({shorten(query['direction'], 40)!r})"
                 if query.get("direction") and desk.direction is None else None,
                 f"status: one of new, approved, rejected, any ({shorten(query['status'], 20)!r})"
                 if query.get("status") and query["status"] not in (*DECISIONS, "any") else None,
                 f"sort: one of {', '.join(SORTS)} ({shorten(query['sort'], 20)!r})"
                 if query.get("sort") and query["sort"] not in SORTS else None,
                 f"min: a relevance from 0 to 10 ({shorten(query['min'], 20)!r})"
                 if query.get("min") and not desk.chosen else None]
        wrong = [problem for problem in wrong if problem]
        if wrong:
            abort(400, "; ".join(wrong))
        limit = min(int(limit), MAX_API_POSTS)
        self.rescorer.wait(desk.direction)
        self.json(request, desk_answer(self.db.conn(), desk, limit))

    def source_options(self):
        """The source filter's options, built at most once a minute: with
        thousands of sources they cost more than the rest of the page."""
        built, options = self._sources
        if time.monotonic() - built > SOURCES_FRESH:
            options = source_options(self.db.conn())
            self._sources = (time.monotonic(), options)
        return options

    def decision(self, form):
        status = (form.get("status") or [""])[-1]
        if status not in DECISIONS:
            abort(400, "status must be new, approved or rejected")
        return status

    def decide(self, request, query, form, post_id):
        self.check_forgery(request, form)
        status = self.decision(form)
        seen = (form.get("wording") or [""])[-1]
        saw = (form.get("seen") or [""])[-1]
        if saw and saw not in DECISIONS:
            abort(400, "seen must be new, approved or rejected")
        if not self.decide_posts(request, [int(post_id)], status,
                                 {int(post_id): seen} if seen else None,
                                 {int(post_id): saw} if saw else None, form):
            abort(404, "No such post")
        if "application/json" in request.headers.get("Accept", ""):
            return self.json(request, {"id": int(post_id), "status": status})
        self.back(request, form, int(post_id))

    def decide_many(self, request, query, form):
        self.check_forgery(request, form)
        status = self.decision(form)
        ids = [int(i) for value in form.get("ids", []) for i in value.split(",")
               if POST_ID.fullmatch(i.strip())]
        if not ids or len(ids) > MAX_BULK:
            abort(400, f"ids must name 1 to {MAX_BULK} posts")
        wants_json = "application/json" in request.headers.get("Accept", "")
        # The page's own form asks first; a script's post decides at once.
        if not wants_json and form.get("ask") and (form.get("confirmed") or [""])[-1] != "1":
            return self.confirm_many(request, query, form, ids, status)
        changed = self.decide_posts(request, ids, status, named_wordings(form, ids), form=form)
        if wants_json:
            return self.json(request, {"ids": ids, "status": status, "changed": changed})
        self.back(request, form)

    def confirm_many(self, request, query, form, ids, status):
        """A form's decision on many posts is asked again first (the page's
        script asks in place and sends it confirmed)."""
        back = (form.get("back") or ["/"])[-1]
        fields = (("token", request.account.token), ("ids", ",".join(map(str, ids))),
                  ("status", status),
                  ("back", back), *(("wording", words) for words in form.get("wording", [])))
        self.html(request, bulk_confirmation(self.page(request, query),
                                             titled_posts(self.db.conn(), ids), status, fields,
                                             back if LOCAL_PATH.fullmatch(back) else "/"))

    def decide_posts(self, request, ids, status, seen, saw=None, form=None):
        """set_decisions by the signed-in editor, refused (409, nothing
        decided) when a post changed since the page naming its words was
        loaded, or another editor decided it meanwhile (naming who): to a
        page's own form (a browser without the page's script) as a page
        that leads back to the desk."""
        try:
            found = set_decisions(self.db.conn(), ids, status, request.account.name, seen, saw,
                                  address=request.client_address[0])
        except Reworded as e:
            post = "this post" if len(ids) == 1 else f"post {e.post_id}"
            self.conflict(request, form, f"{post} changed since your page was loaded; "
                                         f"reload to see it")
        except Redecided as e:
            self.conflict(request, form, str(e), {
                "X-Vesti-Conflict": "decided", "X-Vesti-Status": e.status,
                "X-Vesti-Decided-By": urllib.parse.quote(e.by or "")})
        self.rescorer.ask(decided_directions(self.db.conn(), ids), len(ids))
        return found

    def conflict(self, request, form, text, headers=None):
        """409: as a page to a browser's form (back to where it came from),
        else as a line."""
        accepts = request.headers.get("Accept", "")
        if form is None or "text/html" not in accepts or "application/json" in accepts:
            abort(409, text, headers)
        page = self.page(request, {})
        back = (form.get("back") or ["/"])[-1]
        body = (f'<h2>{page.t("conflict.title")}</h2><p class="banner" role="alert">{esc(text)}'
                f'</p><p><a href="{esc(back if LOCAL_PATH.fullmatch(back) else "/")}">'
                f'{page.t("conflict.back")}</a></p>')
        raise EarlyReply(409, layout(page, page.t("conflict.title"), body, "/"), headers,
                         page=True)

    def back(self, request, form, post_id=None):
        """To the page the form came from; after one post's decision, to its
        card, kept in view even when the page's filter no longer matches it."""
        back = (form.get("back") or ["/"])[-1]
        back = back if LOCAL_PATH.fullmatch(back) else "/"
        if post_id:
            path, _, query = back.partition("?")
            query = [(k, v) for k, v in urllib.parse.parse_qsl(query) if k != "decided"]
            back = f"{path}?{urllib.parse.urlencode([*query, ('decided', post_id)])}#post-{post_id}"
        request.reply(303, "text/plain", b"", {"Location": back})

    def look(self, request, query, form, post_id):
        """The signed-in editor looks at this card now (the desk says so)."""
        self.check_forgery(request, form)
        note_look(self.db.conn(), int(post_id), request.account.name)
        self.json(request, {"id": int(post_id)})

    def api_looks(self, request, query, form):
        """{post id: [names]} of the others looking at the cards `ids` names."""
        ids = [int(i) for i in query.get("ids", "").split(",")[:MAX_BULK] if POST_ID.fullmatch(i)]
        self.json(request, {str(k): v for k, v in
                            lookers(self.db.conn(), ids, request.account.name).items()})


class ReportCardRoutes:
    """The report card (/quality)."""

    # (method, path, handler, the role it needs; None: no sign-in)
    ROUTES = (
        ("GET", r"/quality", "quality", "viewer"),
    )

    def quality(self, request, query, form):
        report = quality_report(self.db.conn(), self.registry.directions, self.settings,
                                owed=self.rescorer.owed)
        self.html(request, quality_page(report, self.page(request, query),
                                        editor_agreement(self.db.conn())))


class OutboxRoutes:
    """The outbox (/outbox) and an editor's action on a publication."""

    # (method, path, handler, the role it needs; None: no sign-in)
    ROUTES = (
        ("GET", r"/outbox", "outbox", "viewer"),
        ("POST", r"/publications/([1-9][0-9]{0,17})", "publication", "editor"),
    )

    def outbox(self, request, query, form):
        self.html(request, outbox_page(self.db.conn(), self.page(request, query)))

    def publication(self, request, query, form, publication_id):
        """An editor's action on a publication (see act_on_publication); 409
        when its state changed since the page showed it (`seen`)."""
        self.check_forgery(request, form)
        action = (form.get("action") or [""])[-1]
        if action not in PUBLICATION_ACTIONS:
            abort(400, f"action must be one of {', '.join(PUBLICATION_ACTIONS)}")
        text = (form.get("text") or [""])[-1].replace("\r\n", "\n")
        if action == "text":
            self.check_text(request, query, int(publication_id), text)
        seen = (form.get("seen") or [""])[-1]
        version = (form.get("version") or [""])[-1]
        if version and not digits_only(version):
            abort(400, f"version: the number the page gave ({shorten(version, 20)!r})")
        try:
            row = act_on_publication(self.db.conn(), int(publication_id), action,
                                     request.account.name, text, seen=seen or None,
                                     address=request.client_address[0],
                                     version=int(version) if digits_only(version) else None)
        except Conflict as e:
            abort(409, str(e))
        if row is None:
            abort(404, "No such publication")
        log.info("web: publication %s (post %s to %s): %s", row.id, row.post_id,
                 row.target, action)
        if "application/json" in request.headers.get("Accept", ""):
            return self.json(request, {"id": row.id, "state": row.state,
                                       "hurry": bool(row.hurry)})
        back = (form.get("back") or ["/outbox"])[-1]
        back = back if LOCAL_PATH.fullmatch(back) else "/outbox"
        request.reply(303, "text/plain", b"", {"Location": f"{back}#publication-{row.id}"})

    def check_text(self, request, query, publication_id, text):
        """An editor's text that cannot be sent is refused (400) on the
        outbox itself, the words kept in its form with the reason."""
        conn = self.db.conn()
        kind = conn.execute("SELECT t.kind FROM publications u JOIN targets t ON t.name = u.target "
                            "WHERE u.id = ?", (publication_id,)).fetchone()
        if kind is None:
            abort(404, "No such publication")
        page = self.page(request, query)
        problem = text_problem(kind[0], text, page)
        if problem is None:
            return
        if "application/json" in request.headers.get("Accept", ""):
            abort(400, html.unescape(problem))
        raise EarlyReply(400, outbox_page(conn, page, {publication_id: (text, problem)}), page=True)


class UserRoutes:
    """The users (/users), signing in and out."""

    # (method, path, handler, the role it needs; None: no sign-in)
    ROUTES = (
        ("GET", r"/users", "users", "admin"),
        ("POST", r"/users", "add_account", "admin"),
        ("POST", r"/users/([^/?#]{1,200})", "change_account", "admin"),
        ("GET", r"/login", "login_page", None),
        ("POST", r"/login", "login", None),
        ("POST", r"/logout", "logout", "viewer"),
    )

    def users(self, request, query, form):
        self.html(request, users_page(self.db.conn(), self.page(request, query), self.user))

    def add_account(self, request, query, form):
        self.check_forgery(request, form)
        name, role = (form.get("name") or [""])[-1].strip(), (form.get("role") or [""])[-1]
        try:
            add_user(self.db.conn(), name, role, (form.get("password") or [""])[-1],
                     request.account.name, request.client_address[0])
        except ConfigError as e:
            abort(400, str(e))
        log.info("web: user %s added by %s", name, request.account.name)
        request.reply(303, "text/plain", b"", {"Location": "/users"})

    def change_account(self, request, query, form, name):
        self.check_forgery(request, form)
        name = urllib.parse.unquote(name)
        action = (form.get("action") or [""])[-1]
        changes = {"role": {"role": (form.get("role") or [""])[-1]},
                   "password": {"password": (form.get("password") or [""])[-1]},
                   "disable": {"disabled": True}, "enable": {"disabled": False}}
        if action not in changes:
            abort(400, f"action must be one of {', '.join(changes)}")
        if user_key(name) == user_key(request.account.name) and action in ("disable", "role"):
            abort(400, "an admin does not disable or demote their own account here "
                       "(another admin, or `vesti.py user`, can)")
        try:
            change_user(self.db.conn(), name, request.account.name, request.client_address[0],
                        **changes[action])
        except ConfigError as e:
            abort(404 if "no user" in str(e) else 400, str(e))
        log.info("web: user %s: %s by %s", name, action, request.account.name)
        request.reply(303, "text/plain", b"", {"Location": f"/users#user-{urllib.parse.quote(name)}"})

    def login_nonce(self, request):
        """The sign-in form's token, tied to a cookie of this browser (a page
        of another site cannot sign a browser in under its own account)."""
        nonce = cookies_of(request.headers).get(LOGIN_COOKIE)
        made = nonce is None or not re.fullmatch(r"[A-Za-z0-9_-]{20,64}", nonce)
        if made:
            nonce = secrets.token_urlsafe(24)
        token = hmac.new(self.secret, f"login\0{nonce}".encode(), hashlib.sha256).hexdigest()
        return token, (cookie(request.headers, LOGIN_COOKIE, nonce) if made else None)

    def login_page(self, request, query, form, problem=None, status=200):
        """The sign-in form; `problem`: why the last try did not sign in
        (a wrong password, a lock and when it ends)."""
        token, made = self.login_nonce(request)
        after = query.get("next") or (form.get("next") or ["/"])[-1]
        page = self.page(request, query)
        name = (form.get("user") or [""])[-1]
        body = login_form(page, token, after if LOCAL_PATH.fullmatch(after) else "/", problem, name)
        headers = {"Content-Security-Policy": PAGE_POLICY, **({"Set-Cookie": made} if made else {})}
        if status == 429:
            headers["Retry-After"] = str(max(1, math.ceil(problem[2] - time.time())))
        elif status == 503:
            headers["Retry-After"] = "5"
        request.reply(status, "text/html; charset=utf-8",
                      layout(page, page.strings["login.title"], body, "/login").encode(),
                      headers)

    def login(self, request, query, form):
        """Sign in: a session for the account, its cookie in the answer."""
        token, _ = self.login_nonce(request)
        self.check_forgery(request, form, token)
        name, password = (form.get("user") or [""])[-1], (form.get("password") or [""])[-1]
        address = request.client_address[0]
        try:
            found = self.sign_in(address, name, password, how="sign-in page")
        except SignInLocked as e:
            return self.login_page(request, query, form, ("locked", e.kind, e.until), 429)
        except EarlyReply as e:
            if e.status != 503:
                raise
            return self.login_page(request, query, form, ("busy",), 503)
        if found is None:
            log.warning("web: sign-in refused for %r from %s", shorten(name, 64), address)
            return self.login_page(request, query, form, ("wrong",), 401)
        session, _ = start_session(self.db.conn(), found.name, address)
        after = (form.get("next") or ["/"])[-1]
        request.reply(303, "text/plain", b"", {
            "Location": after if LOCAL_PATH.fullmatch(after) else "/",
            "Set-Cookie": cookie(request.headers, SESSION_COOKIE, session)})

    def logout(self, request, query, form):
        self.check_forgery(request, form)
        if request.account.session:
            end_session(self.db.conn(), request.account.session, request.client_address[0])
        request.reply(303, "text/plain", b"", {"Location": "/login",
                                               "Set-Cookie": ended_cookie(request.headers)})


class CrawlerRoutes:
    """The crawlers (/crawlers) and the queue's sizes."""

    # (method, path, handler, the role it needs; None: no sign-in)
    ROUTES = (
        ("GET", r"/crawlers", "crawlers", "viewer"),
        ("POST", r"/crawlers/reset", "reset", "admin"),
        ("GET", r"/api/queue", "api_queue", "viewer"),
    )

    def crawlers(self, request, query, form):
        self.html(request, crawlers_page(self.db.conn(), self.page(request, query), self.settings))

    def reset(self, request, query, form):
        self.check_forgery(request, form)
        conn = self.db.conn()
        with transaction(conn):
            count = reset_dead(conn)
            record_event(conn, request.account.name, request.client_address[0], "reset dead",
                         None, f"{count} sources")
        log.info("web: %d dead sources reset by %s", count, request.account.name)
        request.reply(303, "text/plain", b"", {"Location": "/crawlers"})

    def api_queue(self, request, query, form):
        request.reply(200, "application/json", json.dumps(queue_sizes(self.db.conn())).encode())


class ExportRoutes:
    """The approved posts as feeds, /metrics and /healthz."""

    # (method, path, handler, the role it needs; None: no sign-in)
    ROUTES = (
        ("GET", r"/approved\.atom", "approved_atom", "viewer"),
        ("GET", r"/approved\.json", "approved_json", "viewer"),
        ("GET", r"/metrics", "metrics", "viewer"),
        ("GET", r"/healthz", "healthz", None),
    )

    def exported(self, request, query):
        """The approved posts a feed gives (of one direction when asked; an
        unknown one is 400 naming it, not every direction's posts)."""
        direction = query.get("direction") or None
        if direction is not None and direction not in self.registry.directions:
            abort(400, f"direction: none of {', '.join(self.registry.directions) or 'no direction'} "
                       f"({shorten(direction, 40)!r})")
        posts = decided_posts(self.db.conn(), "approved", direction, FEED_POSTS)
        title = "VESTI: approved" + (f" ({direction})" if direction else "")
        host = request.headers.get("Host")
        return posts, title, (f"http://{host}{request.path}" if host else None)

    def approved_atom(self, request, query, form):
        request.reply(200, "application/atom+xml; charset=utf-8",
                      atom_feed(*self.exported(request, query)).encode("utf-8"))

    def approved_json(self, request, query, form):
        request.reply(200, "application/feed+json; charset=utf-8",
                      json_feed(*self.exported(request, query)).encode("utf-8"))

    def metrics(self, request, query, form):
        request.reply(200, "text/plain; version=0.0.4; charset=utf-8",
                      metrics_text(self.db.conn()).encode("utf-8"))

    def healthz(self, request, query, form):
        self.db.conn().execute("SELECT 1").fetchone()
        request.reply(200, "text/plain", b"ok\n")


class WebApp(DeskRoutes, ReportCardRoutes, OutboxRoutes, UserRoutes, CrawlerRoutes,
             ExportRoutes):
    """The page's routes (each page's in a class of its own above), sign-in
    (Basic auth and sessions) and cross-site protection."""

    def __init__(self, db, settings, registry, password=None):
        self.db, self.settings, self.registry = db, settings, registry
        # VESTI_WEB_PASSWORD, or None for the one kept hashed in the database.
        self.user, self.password = settings.web_user, password or None
        self.matched = set()        # sha256 of each hash and the password that matched it
        # One scrypt check at a time: guesses from many addresses at once cost
        # one core and 16 MB, not one of each per thread; at most
        # CHECKS_WAITING more wait for it.
        self.hashing = threading.Lock()
        self.checks = threading.BoundedSemaphore(1 + CHECKS_WAITING)
        self.checking, self.checking_lock = set(), threading.Lock()     # addresses' keys
        # A hash no password is known to match, checked for a name no account
        # has: made now, so that even the first such check costs no more.
        self.decoy = password_hash(secrets.token_urlsafe(16), db.process.password_cost)
        self._sources = (-math.inf, "")
        # Kept in the database: pages left open across a restart still post.
        self.secret = lasting_secret(db.conn(), "web_secret").encode()
        if db.conn().dialect is SQLITE and not FTS5:
            log.warning("this Python's SQLite has no FTS5: the desk searches with LIKE "
                        "(slower on a big database)")
        self.learners = Learners(settings.learn_min)
        self.rescorer = Rescorer(db, self.learners)
        self.keep_settings_account()
        self.routes = [(method, re.compile(path), getattr(self, handler), role)
                       for group in type(self).__mro__
                       for method, path, handler, role in vars(group).get("ROUTES", ())]

    def use(self, registry):
        """Show these directions and sources from now on (sources.yaml changed)."""
        self.registry = registry
        self._sources = (-math.inf, "")

    def keep_settings_account(self):
        """The VESTI_WEB_USER account's row, with the hash of
        VESTI_WEB_PASSWORD or of the generated password kept in the
        database (see keep_settings_account); none yet while there is no
        password at all (make_password makes one)."""
        kept = None if self.password else get_meta(self.db.conn(), "web_password")[0]
        if self.password or kept:
            keep_settings_account(self.db.conn(), self.user, self.password, kept)

    def token(self):
        """The forms' token of the VESTI_WEB_USER account (see user_token)."""
        return self.user_token(find_user(self.db.conn(), self.user))

    def user_token(self, user):
        """The forms' token of an account signing in with Basic auth: the
        same across restarts (a page left open overnight still posts),
        another once the password changes."""
        signed = f"user\0{user['name']}\0{user['password_hash']}"
        return hmac.new(self.secret, signed.encode(), hashlib.sha256).hexdigest()

    def make_password(self):
        """With no VESTI_WEB_PASSWORD, the kept password, made now if there
        is none yet (see generated_web_password): returned when just made."""
        if self.password is not None:
            return None
        made = generated_web_password(self.db.conn())
        self.keep_settings_account()
        return made

    def matches(self, password, kept, slow=True):
        """password_matches, remembered once it did: a client sends its
        password with every request. Without `slow`, a password that would
        need a scrypt check is taken as wrong (see check_login)."""
        seen = hashlib.sha256(f"{kept}\0{password}".encode()).digest()
        if seen in self.matched:
            return True
        if not slow:
            return False
        with self.hashing:
            if not password_matches(password, kept):
                return False
        self.matched.add(seen)
        return True

    def account(self, name, password, slow=True):
        """The Account these credentials sign in as, or None. A name no
        enabled account has costs a check as long as a real one: the time
        tells no name."""
        user = find_user(self.db.conn(), name) if len(name) <= 200 else None
        if user is None or user["disabled"]:
            if slow:
                self.matches(password, self.decoy, slow)
            return None
        if not self.matches(password, user["password_hash"], slow):
            return None
        return Account(user["name"], user["role"], self.user_token(user))


    def check_login(self, request):
        """Who is asking: a signed-in session's cookie, or Basic auth (see
        sign_in). A request with no credentials (a browser's first) is no
        wrong password: it is asked to sign in (ask_for_login)."""
        cookie = session_cookie(request.headers)
        if cookie:
            row = session_of(self.db.conn(), cookie, self.settings.session_hours)
            if row is not None:
                return Account(row["user_name"], row["role"], row["form_token"], cookie)
        header = request.headers.get("Authorization")
        credentials = basic_credentials(header) if header else None
        if credentials is None:
            self.ask_for_login(request, stale=bool(cookie) and not header)
        try:
            found = self.sign_in(request.client_address[0], *credentials, how="basic auth")
        except SignInLocked as e:
            wait = max(1, math.ceil(e.until - time.time()))
            abort(429, f"Too many wrong passwords for this {e.kind}; every try is refused "
                       f"until {utc_text(e.until)} UTC", {"Retry-After": str(wait)})
        if found is None:
            self.ask_for_login(request)
        return found

    def sign_in(self, address, name, password, how):
        """The account these credentials sign in as, or None for a wrong
        password (kept: see note_wrong_password). A locked name or address
        is answered 429 before any password is looked at, right or not; a
        password given right before passes without scrypt; a check beyond
        the ones that may wait, or while one from the same address is under
        way, is refused at once (503)."""
        conn = self.db.conn()
        lock = sign_in_lock(conn, address, name)
        if lock is not None:
            raise SignInLocked(*lock)
        found = self.account(name, password, slow=False)
        if found is not None:
            return found
        with self.one_check_per_address(address):
            if not self.checks.acquire(blocking=False):
                abort(503, "Too many sign-ins at once; try again in a few seconds",
                      {"Retry-After": "5"})
            try:
                found = self.account(name, password)
            finally:
                self.checks.release()
        if found is None:
            lock = note_wrong_password(conn, address, name, how)
            if lock is not None:
                log.warning("web: %d wrong passwords %s in %d minutes; its tries are refused "
                            "until %s UTC", LOGIN_FAILURES if lock[0] == "name" else ADDRESS_FAILURES,
                            f"for user {shorten(name, 64)!r}" if lock[0] == "name" else
                            f"from {address_key(address)}", LOGIN_WINDOW // 60, utc_text(lock[1]))
        return found

    @contextlib.contextmanager
    def one_check_per_address(self, address):
        """While one password from an address is checked, another from it is
        refused at once (503)."""
        key = address_key(address)
        with self.checking_lock:
            busy = key in self.checking
            self.checking.add(key)
        if busy:
            abort(503, "A sign-in from this address is being checked; try again in a few "
                       "seconds", {"Retry-After": "5"})
        try:
            yield
        finally:
            with self.checking_lock:
                self.checking.discard(key)

    def ask_for_login(self, request, stale=False):
        """No (or wrong) credentials: a browser (a page, accepting HTML) goes
        to the sign-in page; a script, a feed reader or a metrics scraper
        gets 401 with the Basic challenge; a page's own background request
        (a browser says so in Sec-Fetch-Mode), or one whose session ended,
        gets 401 without it: no password pop-up over the desk."""
        headers = request.headers
        wants_page = "text/html" in headers.get("Accept", "") and \
            request.command in ("GET", "HEAD") and not headers.get("Authorization") and \
            headers.get("Sec-Fetch-Mode", "navigate") == "navigate"
        if wants_page:
            after = request.path if LOCAL_PATH.fullmatch(request.path) else "/"
            abort(303, "Sign in at /login", {
                "Location": "/login?" + urllib.parse.urlencode({"next": after}),
                **({"Set-Cookie": ended_cookie(headers)} if stale else {})})
        if stale or headers.get("Sec-Fetch-Mode", "navigate") != "navigate":
            abort(401, "Signed out: sign in again at /login", {"X-Vesti-Signed-Out": "1"})
        abort(401, "Authentication required (browsers: sign in at /login)",
              {"WWW-Authenticate": 'Basic realm="VESTI", charset="UTF-8"'})

    def same_origin(self, request):
        """A POST must come from this page: its Origin (or Referer) names this host."""
        host = request.headers.get("Host", "")
        origin = request.headers.get("Origin") or request.headers.get("Referer")
        if not origin:
            return True
        return urllib.parse.urlsplit(origin).netloc == host

    def handle(self, request, method):
        try:
            self.route(request, method)
        except EarlyReply as e:
            if e.page:
                request.reply(e.status, "text/html; charset=utf-8", e.text.encode(),
                              {"Content-Security-Policy": PAGE_POLICY, **(e.headers or {})})
            else:
                request.reply(e.status, "text/plain; charset=utf-8", f"{e.text}\n".encode(),
                              e.headers)

    def route(self, request, method):
        path, _, query = request.path.partition("?")
        public = any(r.fullmatch(path) and (m == method or (method == "HEAD" and m == "GET"))
                     and role is None for m, r, _, role in self.routes)
        request.account = None if public else self.check_login(request)
        matches = [(m, r.fullmatch(path), h, role) for m, r, h, role in self.routes
                   if r.fullmatch(path)]
        if not matches:
            abort(404, "Not found")
        for route_method, match, handler, role in matches:
            if route_method == method or (method == "HEAD" and route_method == "GET"):
                account = request.account
                if role is not None and not role_allows(account.role, role):
                    abort(403, f"This needs the {role} role; {account.name} is {account.role}")
                form = self.read_form(request) if method == "POST" else {}
                flat = {k: v[-1] for k, v in urllib.parse.parse_qs(query).items()}
                return handler(request, flat, form, *match.groups())
        methods = {m for m, _, _, _ in matches}
        allowed = ", ".join(sorted(methods | ({"HEAD"} if "GET" in methods else set())))
        abort(405, "Method not allowed", {"Allow": allowed})

    def read_form(self, request):
        """A POST's form: a body only as a form sends it (urlencoded), so that
        no other kind of body (text/plain, which a page of another site may
        send without asking) is read as one; and only of a Content-Length
        (the front reads no body sent in chunks)."""
        if "Transfer-Encoding" in request.headers:
            abort(411, "Send the form with a Content-Length, not in chunks")
        length = readable_body_length(request.headers, body_limit(request.path))
        if length is None:
            abort(413, "Request body too large")
        body = request.rfile.read(length).decode("utf-8", "replace")
        kind = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if body and kind != "application/x-www-form-urlencoded":
            abort(415, "Send the form as application/x-www-form-urlencoded")
        return urllib.parse.parse_qs(body)

    def check_forgery(self, request, form, expected=None):
        token = (form.get("token") or [""])[-1]
        expected = expected or request.account.token
        if not hmac.compare_digest(token.encode(), expected.encode()) or \
                not self.same_origin(request):
            abort(403, "Cross-site request refused")

    def page(self, request, query):
        lang = choose_language(self.settings.lang, query.get("lang"),
                               request.headers.get("Accept-Language"))
        account = request.account
        trouble = outbox_trouble(self.db.conn()) if account is not None else ()
        return Page(lang, account.token if account else "", {k: v for k, v in query.items()
                                                             if k == "lang"}, account, trouble)

    def html(self, request, text):
        request.reply(200, "text/html; charset=utf-8", text.encode("utf-8"),
                      {"Content-Security-Policy": PAGE_POLICY})

    def json(self, request, data):
        request.reply(200, "application/json", json.dumps(data, ensure_ascii=False).encode())


def announce_web(server, settings, generated):
    """Where the page is, and the password when it was just made."""
    host, port = server.server_address[:2]
    host = f"[{host}]" if ":" in host else host
    print(f"web: http://{host}:{port}/ (user {settings.web_user})", flush=True)
    if generated:
        print(f"web: generated password {generated}, kept (hashed) in the database: it stays "
              f"the same after a restart, and is not shown again. To choose another, set "
              f"VESTI_WEB_PASSWORD (e.g. in .env)", flush=True)
    elif not settings.web_password:
        print("web: the password is the one printed at the first start; forgot it? set "
              "VESTI_WEB_PASSWORD (e.g. in .env)", flush=True)


###############################################################################
# Scheduler ###################################################################
###############################################################################
# Run: crawls on their schedule beside the workers and the page.

# runs rows older than this are deleted by `run` once a day.
KEEP_RUNS_DAYS = 30
# Seconds between two refreshes of every source's figures (the share of its
# posts the workers found relevant) by `run`.
FIGURES_EVERY = 60


def source_slot(slug, interval):
    """A source's second within its priority's interval, the same in every run."""
    return int.from_bytes(hashlib.sha256(slug.encode()).digest()[:8], "big") % int(interval)


def next_slot(last_fetch, slot, interval):
    """The first time at the source's slot (time % interval == slot) that is
    at least half an interval after its last fetch."""
    earliest = last_fetch + interval / 2
    return earliest + (slot - earliest) % interval


class Scheduler:
    """`run`'s crawls: each priority on its own interval (VESTI_CRAWL_EVERY,
    the last interval for every higher priority), sources.yaml re-read when
    it changes. A priority's sources are spread over its interval: each has
    its own slot in it (from its slug, the same in every run), so they are
    not all fetched in the same second. `clock` is the wall clock."""

    def __init__(self, db, settings, registry, stop, clock=time.time, gate=None,
                 listeners=()):
        self.db, self.settings, self.registry, self.stop = db, settings, registry, stop
        self.gate = gate
        self.listeners = listeners
        self.clock = clock
        self.due_at = {}        # source id -> ((last fetch, interval), when it is due)
        self.crawls = {}
        self.failure = None
        self.sources_mtime = self.mtime()
        self.next_prune = self.next_figures = 0.0

    def interval(self, priority):
        every = self.settings.crawl_every
        return every[min(priority, len(every) - 1)]

    def mtime(self):
        with contextlib.suppress(OSError):
            return os.stat(self.settings.sources).st_mtime
        return None

    def reload_sources(self):
        mtime = self.mtime()
        if mtime == self.sources_mtime:
            return
        self.sources_mtime = mtime
        try:
            self.registry = load_registry(self.settings.sources)
            self.db.process.log_mask.keep_out(*self.registry.secrets())
            sync_sources(self.db.conn(), self.registry)
            for listener in self.listeners:
                listener(self.registry)
            print(f"{self.settings.sources} changed: {len(self.registry.sources)} sources synced",
                  flush=True)
            forget_sources_rejected(self.db.conn(), self.settings.sources)
        except ConfigError as e:
            log.error("%s; keeping the sources as they were", e)
            note_sources_rejected(self.db.conn(), self.settings.sources, str(e))

    def priorities(self):
        return enabled_priorities(self.db.conn())

    def tick(self):
        """Start, for every priority whose crawl is not still running, the
        crawl of its sources that are due, in a thread of its own, so a slow
        feed of one priority never holds the others. Returns the priorities
        started."""
        self.reload_sources()
        started = []
        for priority in self.priorities():
            if self.stop.is_set():
                break
            running = self.crawls.get(priority)
            if running is not None and running.is_alive():
                continue
            due = self.due_sources(priority, self.clock())
            if due:
                self.crawls[priority] = threading.Thread(
                    target=self.crawl, args=(priority, due), name=f"crawl-{priority}", daemon=True)
                self.crawls[priority].start()
                started.append(priority)
        if self.clock() >= self.next_figures:
            refresh_every_figure(self.db.conn(), self.settings.min_relevance)
            self.next_figures = self.clock() + FIGURES_EVERY
        if self.clock() >= self.next_prune:
            prune_runs(self.db.conn(), KEEP_RUNS_DAYS)
            if self.next_prune:
                recount_posts(self.db.conn())
            prune_story_keys(self.db.conn(), self.settings.story_hours)
            # Fresh statistics keep the desk's queries on their indexes as posts grow.
            self.db.conn().execute(self.db.conn().dialect.refresh_statistics)
            self.next_prune = self.clock() + 86400
        return started

    def due_sources(self, priority, now):
        """Ids of the sources of a priority to fetch now: those never fetched,
        and those whose slot has come at least half an interval after their
        last fetch (so after the first round each keeps its own slot). Never
        one that asked to wait (cache headers, Retry-After, dead-probe backoff)."""
        interval = self.interval(priority)
        return [source["id"] for source in self.db.conn().execute(
                    """SELECT id, slug, last_fetch FROM sources WHERE enabled = 1 AND priority = ?
                       AND (next_fetch_at IS NULL OR next_fetch_at <= ?) ORDER BY id""",
                    (priority, utc_text(now)))
                if now >= self.due_time(source, interval)]

    def due_time(self, source, interval):
        """When a source is due; worked out again only after it was fetched
        (the tick runs every second over every source)."""
        key = (source["last_fetch"], interval)
        known = self.due_at.get(source["id"])
        if known is None or known[0] != key:
            last = parse_utc(source["last_fetch"])
            due = 0 if last is None or interval <= 0 else \
                next_slot(last, source_slot(source["slug"], interval), interval)
            self.due_at[source["id"]] = known = (key, due)
        return known[1]

    def crawl(self, priority, source_ids):
        try:
            started = time.monotonic()
            with self.db.closing():
                summary = crawl_everything(self.db, self.settings, ("ids", source_ids),
                                           "schedule", quiet=True, gate=self.gate, stop=self.stop)
            print(f"crawl: priority {priority}: {summary.line(self.stop)} "
                  f"in {time.monotonic() - started:.1f} s", flush=True)
        except StorageError as e:
            self.failure = e
            self.stop.set()
        except Exception:
            log.exception("scheduled crawl of priority %d failed", priority)

    def join(self, timeout=None):
        """Wait for the crawls in flight; True when none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in list(self.crawls.values()):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.crawls.values())

    def run(self):
        while not self.stop.is_set():
            try:
                self.tick()
            except StorageError as e:
                self.failure = e
                self.stop.set()
            except Exception:
                log.exception("scheduled crawl failed")
            self.stop.wait(1.0)


###############################################################################
# OPML and discovery ##########################################################
###############################################################################
# Importing and exporting OPML, finding a site's feeds.

MAX_OPML_BYTES = 10 * 1024 * 1024
# Feed readers nest folders a level or two; far deeper is not a reader's export.
MAX_OPML_DEPTH = 100


@dataclasses.dataclass
class OpmlFeed:
    title: str
    url: str
    folders: tuple      # the names of the folders it is in, outermost first


def read_opml(path):
    """The <body> of an OPML file; a ConfigError for anything that is not one."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_OPML_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > MAX_OPML_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_OPML_BYTES} bytes; not an OPML file")
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise ConfigError(f"{path}: OPML with a DOCTYPE or entities is not accepted")
    try:
        root = ElementTree.fromstring(data)
    except ElementTree.ParseError as e:
        raise ConfigError(f"{path}: not valid OPML ({e})") from None
    if root.tag.lower() != "opml" or root.find("body") is None:
        raise ConfigError(f"{path}: not OPML (no <opml> with a <body>)")
    return root.find("body")


def outline_name(outline):
    return " ".join((outline.get("title") or outline.get("text") or "").split())


def outline_feed_url(outline):
    return (outline.get("xmlUrl") or outline.get("xmlurl") or "").strip()


def opml_feeds(path):
    """Every outline with an xmlUrl, nested ones too, in the file's order,
    with the folders (named outlines without one) it is in."""
    feeds, walk = [], [(iter(read_opml(path)), ())]
    while walk:
        children, folders = walk[-1]
        outline = next(children, None)
        if outline is None:
            walk.pop()
        elif outline.tag == "outline":
            if len(walk) > MAX_OPML_DEPTH:
                raise ConfigError(f"{path}: outlines nested deeper than {MAX_OPML_DEPTH} "
                                  f"levels; not a feed reader's export")
            url, name = outline_feed_url(outline), outline_name(outline)
            if url:
                feeds.append(OpmlFeed(name, url, folders))
            walk.append((iter(outline), folders if url or not name else folders + (name,)))
    return feeds


def direction_names(registry):
    """Each direction's id, by its id and by its title, in any case."""
    return {name.strip().casefold(): d.id for d in registry.directions.values()
            for name in (d.id, d.title)}


def folder_direction(names, folders):
    """The direction the nearest of these folders is named after, or None."""
    return next((names[f.casefold()] for f in reversed(folders) if f.casefold() in names), None)


# Cyrillic in Latin letters, as a slug spells it (Russian, Ukrainian, Belarusian).
CYRILLIC_LATIN = str.maketrans({
    "а": "a", "б": "b", "в": "v", "г": "g", "д": "d", "е": "e", "ё": "e", "ж": "zh", "з": "z",
    "и": "i", "й": "y", "к": "k", "л": "l", "м": "m", "н": "n", "о": "o", "п": "p", "р": "r",
    "с": "s", "т": "t", "у": "u", "ф": "f", "х": "kh", "ц": "ts", "ч": "ch", "ш": "sh",
    "щ": "shch", "ъ": "", "ы": "y", "ь": "", "э": "e", "ю": "yu", "я": "ya",
    "і": "i", "ї": "yi", "є": "ye", "ґ": "g", "ў": "u"})


def slug_words(text):
    """`text` as a slug: lower-case Latin letters, digits, _ and -; accents
    dropped, Cyrillic transliterated, anything else a separator."""
    latin = unicodedata.normalize("NFKD", text.lower().translate(CYRILLIC_LATIN))
    latin = "".join(ch for ch in latin if not unicodedata.combining(ch))
    return re.sub(r"[^a-z0-9_]+", "-", latin).strip("-")[:40].strip("-")


def site_name(url):
    """A feed's host without www. and its top-level domain (lwn.net -> lwn)."""
    host = host_of(url).removeprefix("www.")
    return host if re.fullmatch(r"[0-9.:\[\]]*", host) else host.rsplit(".", 1)[0]


def slug_for(title, url, taken):
    """A slug from the feed's title (or, when that gives nothing, its
    site's host), unique among `taken`."""
    base = slug_words(title) or slug_words(site_name(url)) or "feed"
    slug = f"{base}-{free_number(base, taken)}" if base in taken else base
    taken.add(slug)
    return slug


def free_number(base, taken):
    """A number n from 2 on with base-n not taken: the first after a run of
    taken ones, found in steps that double and then halve, so that each of
    20,000 feeds of one title costs some 30 look-ups, not one per feed before
    it (an OPML file of them took 45 s)."""
    low, high = 1, 2            # base-low is taken (1 stands for base itself)
    while f"{base}-{high}" in taken:
        low, high = high, 2 * high
    while high - low > 1:       # base-low taken, base-high free
        middle = (low + high) // 2
        low, high = (middle, high) if f"{base}-{middle}" in taken else (low, middle)
    return high


# Characters JSON leaves as they are but YAML does not: line breaks (NEL,
# U+2028, U+2029) that would end a comment or fold a value, and characters a
# YAML file may not hold at all (DEL, C1 controls, surrogates, U+FEFF, U+FFFE,
# U+FFFF). Written as \u escapes, which YAML's double quotes read back.
YAML_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufeff\ufffe\uffff]")


def yaml_text(value):
    """`value` as one line of YAML: a double-quoted (JSON) string, so that a
    stranger's feed title can only ever be that string."""
    return YAML_UNSAFE.sub(lambda ch: f"\\u{ord(ch[0]):04x}", json.dumps(value, ensure_ascii=False))


def source_entries(feeds, indent, priority):
    """sources.yaml lines of new feeds: (slug, title, URL, direction or None)."""
    lines = []
    for slug, title, url, direction in feeds:
        lines += [f"{indent}- slug: {slug}", f"{indent}  name: {yaml_text(title or slug)}",
                  f"{indent}  crawler: rss", f"{indent}  url: {yaml_text(url)}"]
        if direction:
            lines.append(f"{indent}  direction: {yaml_text(direction)}")
        lines += [f"{indent}  priority: {priority}", ""]
    return lines


def append_sources(text, entries):
    """sources.yaml with the entries added at the end of its sources list;
    every other line (comments included) stays as it was."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"sources:\s*(#.*)?$", line)
                  or re.match(r"sources:\s*\[\s*\]\s*$", line)), None)
    if start is None:
        return text.rstrip("\n") + "\n\nsources:\n" + "\n".join(entries) + "\n"
    if "[" in lines[start]:
        lines[start] = "sources:"
    end = start + 1
    for i in range(start + 1, len(lines)):  # past the last item; comments after it stay after
        if lines[i].strip() and not lines[i].startswith((" ", "#", "-")):
            break
        if lines[i].strip() and not lines[i].lstrip().startswith("#"):
            end = i + 1
    if end < len(lines) and not lines[end].strip():
        entries = entries[:-1]          # the blank line that follows is kept instead
    return "\n".join(lines[:end] + [""] * (end > start + 1) + entries + lines[end:]).rstrip("\n") + "\n"


def sources_by_url(registry):
    """The slug of every source, by its canonical URL."""
    return {canonical_url(s.url): s.slug for s in registry.sources}


def import_opml(registry, path, direction=None, priority=0):
    """Add an OPML file's feeds to sources.yaml (checked before it is
    written), each in `direction`, else in the direction its folder is named
    after. Returns (added, skipped, the folders that name no direction)."""
    feeds = opml_feeds(path)
    if not feeds:
        raise ConfigError(f"{path}: no feeds (no outline with an xmlUrl)")
    known, taken = set(sources_by_url(registry)), {s.slug for s in registry.sources}
    names = direction_names(registry)
    added, skipped, unmatched = [], 0, {}
    for feed in feeds:
        url = canonical_url(feed.url)
        if url in known or not usable_feed_url(path, feed):
            skipped += 1
            continue
        known.add(url)
        chosen = direction or folder_direction(names, feed.folders)
        if feed.folders and not chosen:
            unmatched[" / ".join(feed.folders)] = True
        added.append((slug_for(feed.title, feed.url, taken), feed.title, feed.url, chosen))
    if added:
        add_sources(registry, path, added, priority)
    return len(added), skipped, list(unmatched)


def usable_feed_url(path, feed):
    """Whether a feed's URL is one sources.yaml takes; one it would refuse
    (not http, not a URL at all) is skipped with a note, and the rest of the
    file imported."""
    try:
        check_feed_url(f"{path}: feed {feed.title or feed.url!r}", feed.url)
    except ConfigError as e:
        log.warning("%s; skipped", e)
        return False
    return True


@dataclasses.dataclass
class TextFile:
    """A text file's text (each line ending in a line feed) and how it is
    written: UTF-8 with a BOM or without, lines ending in CR LF or in LF."""
    text: str
    encoding: str
    newline: str


def read_text_file(path):
    """The file as a TextFile, written back with the line ending most of its
    lines have."""
    with open(path, "rb") as f:
        data = f.read()
    encoding = "utf-8-sig" if data.startswith(codecs.BOM_UTF8) else "utf-8"
    text = data.decode(encoding)
    newline = "\r\n" if 2 * text.count("\r\n") > text.count("\n") else "\n"
    return TextFile(text.replace("\r\n", "\n"), encoding, newline)


def add_sources(registry, path, feeds, priority):
    """Append feeds to sources.yaml, only if the file still loads after;
    its encoding and line endings stay as they were."""
    original = read_text_file(registry.path)
    item = re.search(r"^( *)- slug:", original.text, re.MULTILINE)
    updated = append_sources(original.text,
                             source_entries(feeds, item[1] if item else "  ", priority))
    scratch = f"{registry.path}.importing"
    with open(scratch, "w", encoding=original.encoding, newline=original.newline) as f:
        f.write(updated)
    try:
        load_registry(scratch)
    except ConfigError as e:
        os.unlink(scratch)
        raise ConfigError(f"{path}: the import would break {registry.path} ({e}); "
                          f"nothing was changed") from None
    os.replace(scratch, registry.path)


def opml_document(sources):
    """OPML 2.0 of the RSS sources, grouped by direction."""
    root = ElementTree.Element("opml", version="2.0")
    head = ElementTree.SubElement(root, "head")
    ElementTree.SubElement(head, "title").text = "VESTI sources"
    ElementTree.SubElement(head, "dateCreated").text = email.utils.formatdate(usegmt=True)
    body = ElementTree.SubElement(root, "body")
    folders = {}
    for source in sources:
        if source["crawler"] != "rss":
            continue
        parent = body
        if source["direction"]:
            parent = folders.get(source["direction"])
            if parent is None:
                parent = folders[source["direction"]] = ElementTree.SubElement(
                    body, "outline", text=xml_text(source["direction"]),
                    title=xml_text(source["direction"]))
        ElementTree.SubElement(parent, "outline", type="rss", text=xml_text(source["name"]),
                               title=xml_text(source["name"]), xmlUrl=xml_text(source["url"]))
    ElementTree.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + \
        ElementTree.tostring(root, encoding="unicode") + "\n"


def terminal_text(text):
    """A stranger's words (a folder's name, a page's link) said on the
    terminal: control characters escaped, as in the log, so they cannot
    move the cursor, recolour the screen or forge a line."""
    return str(text).translate(LOG_ESCAPES)


FEED_TYPES = ("application/rss+xml", "application/atom+xml", "application/rdf+xml",
              "application/feed+json", "application/json", "text/xml", "application/xml")
# Where sites usually keep their feed, tried when the page names none.
COMMON_FEED_PATHS = ("/feed", "/rss", "/atom.xml", "/rss.xml", "/feed.xml", "/index.xml",
                     "/feeds/posts/default")
# A page may name thousands of feeds, each fetched at the host's pace: only
# the first of them are checked. Its links are looked for in its first
# megabyte, and whether a response is a feed is told from its head (a feed
# says its title and first entry there; feedparser spends seconds on every
# megabyte of a page that is none).
MAX_DISCOVER_CANDIDATES = 20
DISCOVER_PAGE_BYTES = 1_000_000
FEED_HEAD_BYTES = 65536


class _AlternateLinks(html.parser.HTMLParser):
    """The <link rel="alternate"> feeds a page names: (title, href)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found = []

    def handle_starttag(self, tag, attrs):
        attrs = {k.lower(): (v or "") for k, v in attrs}
        rel = attrs.get("rel", "").lower().split()
        kind = attrs.get("type", "").lower().split(";")[0].strip()
        if tag == "link" and "alternate" in rel and kind in FEED_TYPES and attrs.get("href"):
            self.found.append((" ".join(attrs.get("title", "").split()), attrs["href"].strip()))


def feed_title(response):
    """The title of a response that is a feed (RSS, Atom, RDF or JSON Feed),
    or None when it is not one."""
    kind = response.headers.get("content-type", "").lower()
    if "json" in kind or response.body.lstrip()[:1] == b"{":
        try:
            data = json.loads(response.body)
        except ValueError:
            return None
        is_feed = isinstance(data, dict) and "jsonfeed.org" in str(data.get("version", ""))
        return (str(data.get("title") or "") or response.url) if is_feed else None
    parsed = run_feedparser(response.body[:FEED_HEAD_BYTES], response.url, kind or None)
    if not parsed.get("version") or not (parsed.get("entries") or parsed.feed.get("title")):
        return None
    return dict.get(parsed.feed, "title") or response.url


@dataclasses.dataclass
class Discovery:
    """What discover found at a site: its feeds [(title, feed URL, URL
    asked)], the candidates it could not read [(URL, FetchError)], and how
    many more it did not check."""
    feeds: list = dataclasses.field(default_factory=list)
    unread: list = dataclasses.field(default_factory=list)
    unchecked: int = 0

    def unchecked_note(self):
        return f"… and {self.unchecked:,} more links not checked" if self.unchecked else ""


def discover_feeds(url, settings):
    """The feeds a site offers, checked to be feeds, as a Discovery."""
    gate = HostGate(settings.host_delay)
    page = http_get(url, settings, {"Accept": "text/html,application/xhtml+xml,*/*;q=0.5"}, gate)
    if page.status != 200:
        raise FetchError(status_text(page.status))
    title = feed_title(page)
    if title is not None:
        return Discovery([(title, page.url, url)])
    links = _AlternateLinks()
    links.feed(page.body[:DISCOVER_PAGE_BYTES].decode("utf-8", "replace"))
    named = [urllib.parse.urljoin(page.url, href) for _, href in links.found]
    if named:
        return read_candidates(named, url, settings, gate, guessed=False)
    guessed = [urllib.parse.urljoin(page.url, path) for path in COMMON_FEED_PATHS]
    return read_candidates(guessed, url, settings, gate, guessed=True)


def read_candidates(candidates, site, settings, gate, guessed):
    """A Discovery of the URLs that may be feeds. A guessed path that is not
    there is no news; a named feed that cannot be read, or any fetch that
    failed, is said. Only the first MAX_DISCOVER_CANDIDATES are fetched."""
    candidates = [c for c in dict.fromkeys(candidates)
                  if urllib.parse.urlsplit(c).scheme in WEB_SCHEMES]
    found = Discovery(unchecked=max(0, len(candidates) - MAX_DISCOVER_CANDIDATES))
    for candidate in candidates[:MAX_DISCOVER_CANDIDATES]:
        try:
            response = http_get(candidate, settings, None, gate, home=site)
        except FetchError as e:
            log.info("discover: %s: %s", candidate, e)
            found.unread.append((candidate, e))
            continue
        title = feed_title(response) if response.status == 200 else None
        if title is not None:
            found.feeds.append((title, response.url, candidate))
        elif not guessed:
            why = status_text(response.status) if response.status != 200 else "not a feed"
            found.unread.append((candidate, FetchError(why)))
    return found


def no_feed_read(url, found):
    """Why discover lists no feed, in one line: a refusal first (it names
    the setting that allows it), else the first failure; and what it did
    not check."""
    unchecked = f"; {found.unchecked_note()}" if found.unchecked else ""
    if not found.unread:
        return f"no feed found at {url}{unchecked}"
    candidate, error = next(((c, e) for c, e in found.unread
                             if isinstance(e, RefusedDestination)), found.unread[0])
    more = f" (and {len(found.unread) - 1} more not read)" if len(found.unread) > 1 else ""
    return f"no feed read at {url}: {candidate}: {error}{more}{unchecked}"


###############################################################################
# Command line ################################################################
###############################################################################
# The commands, their arguments, main().

def open_intake(settings, process=None):
    """The registry and the database, with sources.yaml synced in: what every
    command does first."""
    registry = load_registry(settings.sources)
    db = Database(settings.db, settings.busy_timeout, process)
    db.process.log_mask.keep_out(*registry.secrets())
    sync_sources(db.conn(), registry)
    forget_sources_rejected(db.conn(), settings.sources)
    close_orphan_runs(db.conn())
    return registry, db


def selection_of(args):
    for kind in ("source", "direction", "priority"):
        value = getattr(args, kind, None)
        if value is not None:
            return kind, value
    return "all", None


def check_direction(registry, direction):
    """A --direction that names no direction of sources.yaml is a usage error."""
    if direction is not None and direction not in registry.directions:
        raise ConfigError(f"unknown direction {direction!r} (defined: "
                          f"{', '.join(registry.directions) or 'none'})")


def check_selection(conn, registry, selection, crawler):
    """A --source or --direction that names nothing is a usage error."""
    kind, value = selection
    if kind == "direction":
        check_direction(registry, value)
    if kind == "source":
        row = find_source(conn, value)
        if row is None:
            raise ConfigError(f"unknown source {value!r}: not in {registry.path}")
        if not row["enabled"]:
            raise ConfigError(f"source {value!r} is disabled in {registry.path}")
        if crawler and row["crawler"] != crawler:
            raise ConfigError(f"source {value!r} is a {row['crawler']} source, not {crawler}")
    if kind == "priority" and value not in enabled_priorities(conn):
        # Not an error: a cron line may outlive the sources of its priority.
        log.warning("no enabled source has priority %d", value)


def cmd_init(args, settings, process):
    registry, db = open_intake(settings, process)
    count = count_enabled_sources(db.conn())
    print(f"{redacted(settings.db)}: ready, {count} enabled sources from {registry.path}")
    return 0


# A command cut short by a signal exits with 128 + its number, as shells
# say of a program a signal ended: 130 for Ctrl-C (SIGINT), 143 for SIGTERM.
INTERRUPTED = 128 + signal.SIGINT


def crawl_command(db, settings, crawl):
    """Run crawl(stop) for a command: SIGTERM/SIGINT stop it starting more
    sources; fetches in flight get VESTI_STOP_GRACE seconds, then their runs
    are closed as interrupted. Exit code 128 + the signal after a stop."""
    stop = threading.Event()
    with stop_on_signals(stop, db.process) as caught:
        finished, _ = run_until_stopped(lambda: crawl(stop), stop, settings.stop_grace)
    if not stop.is_set():
        return 0
    code = 128 + caught[0] if caught else INTERRUPTED
    if finished:
        print("vesti: interrupted", file=sys.stderr)
        return code
    count = interrupt_runs(db.conn())
    print(f"vesti: interrupted; {count} unfinished runs recorded as interrupted", file=sys.stderr)
    leave_now(code)


def cmd_rss(args, settings, process):
    registry, db = open_intake(settings, process)
    selection = selection_of(args)
    check_selection(db.conn(), registry, selection, "rss")
    return crawl_command(db, settings, lambda stop: crawl_rss(db, settings, selection, args.trigger,
                                                    stop=stop))


@contextlib.contextmanager
def stop_on_signals(stop, process):
    """SIGTERM and SIGINT set `stop` (and the process's stopping) instead of
    killing the process; yields the list of the signals caught."""
    caught = []

    def handler(signum, _):
        caught.append(signum)
        stop.set()
        process.stopping.set()
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def tell_stacks_on_sigusr1():
    """`kill -USR1 <pid>` writes where every thread of the process is to
    its stderr, and the process goes on: what one that seems stuck is
    doing (file, line and function of each frame; no value in them)."""
    if hasattr(signal, "SIGUSR1"):
        with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def leave_now(code):
    """Exit without waiting for threads stuck in a network call: their posts
    are already back in the queue, and Python would join them forever."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def cmd_worker(args, settings, process):
    stop = threading.Event()
    with stop_on_signals(stop, process):
        registry, db = open_intake(settings, process)
        _, finished = run_workers(db, settings, registry, args.workers, args.limit,
                                  args.forever, stop=stop)
    if not finished:
        leave_now(0)
    return 0


def cmd_telegram(args, settings, process):
    if args.login:
        telegram_login(settings)
        return 0
    registry, db = open_intake(settings, process)
    selection = selection_of(args)
    check_selection(db.conn(), registry, selection, "telegram")
    return crawl_command(db, settings, lambda stop: crawl_telegram(db, settings, selection, args.trigger,
                                                         stop=stop))


def cmd_crawl(args, settings, process):
    registry, db = open_intake(settings, process)
    selection = selection_of(args)
    check_selection(db.conn(), registry, selection, None)
    return crawl_command(db, settings, lambda stop: crawl_everything(db, settings, selection, args.trigger,
                                                           stop=stop))


def start_web(db, settings, registry, host=None, port=None):
    app = WebApp(db, settings, registry, settings.web_password)
    server = make_web_server(app, host or settings.web_host,
                             settings.web_port if port is None else port)
    # Made once the page can be served: a port in use makes no password unseen.
    generated = app.make_password()
    threading.Thread(target=server.serve_forever, name="web", daemon=True).start()
    app.rescorer.catch_up()
    announce_web(server, settings, generated)
    return server


def stop_web(server):
    """The page stops answering and judging (see Rescorer.stop)."""
    server.shutdown()
    server.app.rescorer.stop()
    server.server_close()


def cmd_serve(args, settings, process):
    stop = threading.Event()
    with stop_on_signals(stop, process):
        registry, db = open_intake(settings, process)
        server = start_web(db, settings, registry, args.host, args.port)
        stop.wait()
    stop_web(server)
    return 0


def cmd_run(args, settings, process):
    """Crawls on a schedule, the worker pool and the web page in one process."""
    stop = threading.Event()
    with stop_on_signals(stop, process):
        registry, db = open_intake(settings, process)
        server = start_web(db, settings, registry)
        # One gate for crawls and article fetches: a host sees one request at a time.
        gate = HostGate(settings.host_delay)
        classifier = Classifier(registry, settings, gate, db)
        scheduler = Scheduler(db, settings, registry, stop, gate=gate,
                              listeners=(classifier.use, server.app.use))
        crawls = threading.Thread(target=scheduler.run, name="scheduler", daemon=True)
        crawls.start()
        publishing = threading.Thread(target=Publisher(db, settings).run, args=(stop,),
                                      name="publish", daemon=True)
        publishing.start()
        try:
            if args.workers == 0:
                # Crawls and the page only: the workers run on other machines.
                stop.wait()
                stats, finished = None, True
            else:
                stats, finished = run_workers(db, settings, registry, workers=args.workers,
                                              forever=True, classify=classifier, stop=stop,
                                              quiet=True)
        finally:
            stop.set()
            stop_web(server)
    if stats is not None:
        print(f"worker: {stats.line()}", flush=True)
    crawls.join(settings.stop_grace)
    publishing.join(settings.stop_grace + 2)    # its senders' grace, then what they leave
    crawled = scheduler.join(settings.stop_grace)
    if scheduler.failure is not None:
        raise scheduler.failure
    if not finished or not crawled:
        interrupt_runs(db.conn())
        leave_now(0)
    return 0


def cmd_copy_db(args, settings, process):
    """Everything of the database into another one; run again, it brings the
    other one up to date (rows are matched by their keys)."""
    to = _database("--to", args.to)
    if to == settings.db:
        raise ConfigError(f"copy-db: {redacted(to)} is the database itself; "
                          f"--to names the other one")
    _, db = open_intake(settings, process)
    learn_owed(db.conn())           # the copy's models as its decisions say
    target = Database(to, settings.busy_timeout, process)
    copy_database(db.conn(), target.conn())
    return 0


def cmd_reset_dead(args, settings, process):
    _, db = open_intake(settings, process)
    print(f"{reset_dead(db.conn())} dead sources reset to alive")
    return 0


def learning_report(conn, learners):
    """Each direction's model as `learn` shows it: `ready` once it has the
    decisions a model needs, `used` once it also tells them apart (see
    Model.used)."""
    learners.refresh(conn, now=True)
    return [{"direction": row["direction"], "approved": row["approved"],
             "rejected": row["rejected"], "since": row["since"], "updated_at": row["updated_at"],
             "features": row["features"],
             "ready": learners.ready(row["direction"]),
             "used": learners.model(row["direction"]) is not None}
            for row in conn.execute("""SELECT l.*, (SELECT count(*) FROM learned_words w
                                           WHERE w.direction = l.direction
                                             AND (w.approved != 0 OR w.rejected != 0)) AS features
                                       FROM learners l ORDER BY l.direction""")]


def undecided_cards(conn, direction):
    """How many undecided cards of a direction there are: what judge_every_card judges."""
    return conn.execute(f"""SELECT count(*) FROM posts p WHERE p.status = 'new'
                            AND p.classified = {DONE} AND p.direction = ? AND {card('p.')}""",
                        (direction,)).fetchone()[0]


def many(n, word):
    """'1 direction', '2 directions': a count in the terminal's words."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def rebuild_models(conn, settings):
    """learn --rebuild: every model counted again from the decisions, then
    every undecided card of a direction with a model judged again by it (and
    the posts no keyword matched offered to the models). It says how many it
    judged, not only how many changed: a model rebuilt from the same
    decisions judges as the one it replaces."""
    decided = conn.execute("SELECT count(*) FROM posts WHERE status IN ('approved', 'rejected')"
                           ).fetchone()[0]
    progress = Progress("learn --rebuild", decided, "decisions")
    learned = rebuild_learning(conn, progress)
    learners = Learners(settings.learn_min).refresh(conn, now=True)
    judged = sum(undecided_cards(conn, d) for d in learned)
    changed = sum(judge_every_card(conn, learners, direction) for direction in learned)
    joined = take_in_missed(conn, learners)
    progress.finish(f"{many(sum(a + r for a, r in learned.values()), 'decision')} counted in "
                    f"{many(len(learned), 'direction')}; {many(judged, 'undecided post')} judged "
                    f"again ({changed} changed); {many(joined, 'post')} no keyword matched "
                    f"joined a direction")


def cmd_learn(args, settings, process):
    registry, db = open_intake(settings, process)
    conn = db.conn()
    learn_owed(conn)
    if args.rebuild:
        rebuild_models(conn, settings)
    report = learning_report(conn, Learners(settings.learn_min))
    if not report:
        print("no decisions learned yet: approve and reject posts on the desk")
    for model in report:
        state = "used" if model["used"] else \
            f"not used: its decisions do not tell posts apart beyond chance (checked every " \
            f"{RECALIBRATE} decisions)" if model["ready"] else \
            f"no model yet (needs {settings.learn_min} decisions, {LEARN_EACH} of each)"
        since = f", since {model['since']} UTC" if model["since"] else ""
        print(f"{model['direction']}: {model['approved']} approved, {model['rejected']} rejected, "
              f"{model['features']} features{since}; {state}")
    return 0


def say_en(key, **values):
    """A report card's phrase as the terminal says it (English, unescaped)."""
    return phrase("en", key, **values)


def rates_text(rates, label):
    """'0.9: 1/2 (50 %), …' of approval_rates, or '—'."""
    return ", ".join(f"{label(k)}: {f['approved']}/{f['decided']} ({percent(f['rate'])} %)"
                     for k, f in rates.items()) or "—"


def precision_lines(card):
    """The first 20 and 50 of each order (see precision_part)."""
    precision = card["precision"]
    held_out = precision["held_out"] if precision else 0
    if held_out < card["minimum"]["held_out"]:
        return [f"  {say_en('q.precision_few', n=held_out, min=card['minimum']['held_out'])}"]
    rests_on = precision["rests_on"]
    return [f"  {say_en('q.precision')}. "
            f"{say_en('q.held_out', n=held_out, older=precision['learned_from'])}"] + [
        f"    {say_en(label)}: " + "; ".join(
            f"{say_en('q.first', k=k)} — "
            f"{precision_cell(precision[order][f'p{k}'], rests_on[f'p{k}'], say_en)}"
            for k in (20, 50))
        for order, label in (("learned", "q.learned"), ("relevance", "q.by_relevance"))]


def week_lines(card):
    """What learning changed on the desk in the last 7 days (see week_part)."""
    week = card["changed_this_week"]
    if not week["raised"]["posts"] and not week["lowered"]["posts"]:
        return [f"  {say_en('q.week')}: {say_en('q.week_none')}"] if card["model_used"] else []
    return [f"  {say_en('q.week')}:"] + [
        f"    {change_label(change, week, say_en)}: {many(week[change]['posts'], 'post')}, "
        f"{week[change]['decided']} decided, approved {share_of(week[change])}"
        for change in ("raised", "lowered")]


def quality_text(report):
    """The report card as the terminal shows it: every direction with
    decisions in full (quality_lines), those without in one line."""
    lines = [line for card in report if card["decisions"] for line in quality_lines(card)]
    idle = [f"{card['direction']} ({card['title']})" for card in report if not card["decisions"]]
    if idle:
        lines.append(say_en("q.no_decisions", titles=", ".join(idle)))
    return "\n".join(lines)


def quality_lines(card):
    """A direction's report card as the terminal shows it: the page's words
    and figures, never a None."""
    head = f"{card['direction']} ({card['title']})"
    approved, model, agrees, misses = card_sentences(card, say_en)
    calibration = rates_text(card["by_likely"], lambda k: f"{k:.1f}") if card["by_likely"] else \
        say_en("q.calibration_none")
    return [f"{head}: {approved}", f"  {model}", f"  {agrees}", f"  {misses}",
            *week_lines(card), *precision_lines(card),
            f"  approved per tenth of the chance (likely): {calibration}",
            f"  approved per relevance: {rates_text(card['by_relevance'], str)}",
            *(f"  source {name}: {f['approved']}/{f['decided']} approved ({percent(f['rate'])} %, "
              f"95 % range {percent(f['interval'][0])}–{percent(f['interval'][1])} %)"
              for name, f in card["sources"].items()),
            *(f"  disagreement: {w['decision']} at likely {w['likely']:.2f}: "
              f"{shorten(w['title'] or '', 80)} {w['url'] or ''}".rstrip() for w in card["worst"]),
            *(f"  editor {name}: {e['decisions']} decisions, {e['per_day']} a day, "
              f"{percent(e['approval_rate'])} % approved" for name, e in card["editors"].items())]


def cmd_quality(args, settings, process):
    registry, db = open_intake(settings, process)
    check_direction(registry, args.direction)
    report = quality_report(db.conn(), registry.directions, settings, args.direction)
    if args.json:
        print(json.dumps(report, ensure_ascii=False, indent=2))
        return 0
    if report:
        print(quality_text(report))
    agreement = editor_agreement(db.conn())
    if agreement["pairs"]:
        print(f"editors who decided the same post: {agreement['agreed']} of "
              f"{agreement['pairs']} agreed; " + ", ".join(
                  f"{pair} {f['agreed']}/{f['pairs']}" for pair, f in agreement["by_pair"].items()))
    return 0


def status_report(conn):
    """Queue sizes and every source's health, as `status --json` prints them."""
    fields = ("slug", "name", "crawler", "status", "enabled", "priority", "last_fetch",
              "last_error", "error_count", "post_count", "next_fetch_at", "etag", "modified",
              "last_build_date", "moved_to", "run_started", "run_status", "run_new_posts",
              "last_new_at", "silent_since", "week_posts", "relevant_share", "approved")
    sources = [{field: row[field] for field in fields} | {"state": source_state(row)}
               for row in source_health(conn)]
    trouble = [{"target": target.name, "paused_until": target.paused_until,
                "error": target.error, "failed": stuck.get("failed", 0),
                "uncertain": stuck.get("uncertain", 0), "queued": stuck.get("queued", 0)}
               for target, stuck in outbox_trouble(conn)]
    return {"queue": queue_sizes(conn), "stories": story_figures(conn),
            "publications": publication_counts(conn), "publishing_trouble": trouble,
            "sources": sources}


def print_status(report):
    queue = report["queue"]
    print("queue: " + ", ".join(f"{name.replace('_', ' ')} {count}"
                                for name, count in queue.items()))
    stories = report["stories"]
    print(f"stories: {stories['stories']} with copies, {stories['joined']} posts joined one, "
          f"{stories['llm_calls_saved']} LLM calls saved")
    for target, states in report["publications"].items():
        print(f"publish {target}: " + ", ".join(f"{state} {states[state]}"
                                                for state in PUBLICATION_STATES if state in states))
    for trouble in report["publishing_trouble"]:
        print(f"publish {trouble['target']}: NEEDS AN EDITOR: " + "; ".join(filter(None, (
            trouble["paused_until"] and trouble["paused_until"] > utc_text()
            and f"paused until {trouble['paused_until']} UTC",
            trouble["error"] and shorten(trouble["error"], 200),
            trouble["failed"] and f"{trouble['failed']} failed",
            trouble["uncertain"] and f"{trouble['uncertain']} uncertain"))) + " (see /outbox)")
    rows = [("source", "crawler", "prio", "status", "errors", "posts", "7 days", "last new post",
             "last fetch", "last error")]
    for s in report["sources"]:
        rows.append((s["slug"], s["crawler"], str(s["priority"]), s["state"], str(s["error_count"]),
                     str(s["post_count"]), str(s["week_posts"]), s["last_new_at"] or "never",
                     s["last_fetch"] or "never",
                     shorten((s["last_error"] or "").replace("\n", " "), 60)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])


def cmd_publish(args, settings, process):
    """Send what is due for publication, once or (--forever) until stopped."""
    registry, db = open_intake(settings, process)
    if not registry.targets:
        print(f"vesti: {settings.sources} names no publish targets: nothing to send",
              file=sys.stderr)
    publisher = Publisher(db, settings)
    started = time.monotonic()
    if args.forever:
        stop = threading.Event()
        with stop_on_signals(stop, process):
            publisher.run(stop)
    else:
        publisher.look()
    waiting = db.conn().execute("SELECT count(*) FROM publications p JOIN targets t "
                                "ON t.name = p.target AND t.enabled = 1 "
                                "WHERE p.state = 'queued'").fetchone()[0]
    for name, (sender, until) in sorted(publisher.held.items()):
        print(f"publish: {name} is being sent by {sender} until {until} UTC (its lease); "
              f"that sender sends its posts", flush=True)
    print(f"publish: {publisher.sent} sent, {publisher.failed} failed, "
          f"{publisher.uncertain} uncertain, {waiting} waiting in "
          f"{time.monotonic() - started:.1f} s", flush=True)
    return 0


def new_password(name):
    """A new password: asked twice on a terminal, else one line of stdin
    (never from the command line, where `ps` and the shell's history show it)."""
    if sys.stdin.isatty():
        first = getpass.getpass(f"new password for {name}: ")
        if getpass.getpass("the same again: ") != first:
            raise ConfigError("the two passwords differ; nothing changed")
        return first
    line = sys.stdin.readline()
    if not line:
        raise ConfigError("no password on stdin (one line), and stdin is no terminal to ask on")
    return line.rstrip("\r\n")


def system_user():
    """Who runs a command on the server, for its events ("cli:anna")."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):         # no such variable, and no entry for the uid
        return f"uid {os.getuid()}" if hasattr(os, "getuid") else "?"


def cmd_user(args, settings, process):
    """Accounts of the newsroom: add, passwd, disable, enable, list."""
    _, db = open_intake(settings, process)
    conn = db.conn()
    who = "cli:" + system_user()
    if args.action == "list":
        users = list_users(conn)
        if not any(user["settings"] and not user["disabled"] for user in users):
            password = "VESTI_WEB_PASSWORD's, taken in by the next serve or run" \
                if settings.web_password else "none yet: serve or run makes one"
            print(f"{settings.web_user}: admin (VESTI_WEB_USER, by the settings; "
                  f"password: {password})")
        for user in users:
            print(f"{user['name']}: {user['role']}{', disabled' if user['disabled'] else ''}"
                  f"{' (VESTI_WEB_USER, by the settings)' if user['settings'] else ''}, "
                  f"{user['sessions']} session{'' if user['sessions'] == 1 else 's'}, "
                  f"since {user['created_at'] or '-'} UTC")
        for names in same_name_keys(conn):
            print(same_names_said(names))
        for kind, key, until in sign_in_locks(conn):
            print(f"sign-ins refused for the {kind} {key} until {utc_text(until)} UTC "
                  f"(too many wrong passwords)")
        return 0
    if not args.name:
        raise ConfigError(f"user {args.action}: name the user (user {args.action} NAME)")
    if args.action == "add":
        password = new_password(args.name)
        add_user(conn, args.name, args.role or "editor", password, who, "local")
        print(f"user {args.name} added as {args.role or 'editor'}")
    elif args.action == "passwd":
        change_user(conn, args.name, who, "local", password=new_password(args.name))
        print(f"password of {args.name} changed; its sessions ended")
    elif args.role and args.action == "role":
        change_user(conn, args.name, who, "local", role=args.role)
        print(f"{args.name} is {args.role} now")
    elif args.action in ("disable", "enable"):
        change_user(conn, args.name, who, "local", disabled=args.action == "disable")
        print(f"{args.name} {args.action}d" + ("; its sessions ended" if args.action == "disable" else ""))
    else:
        raise ConfigError("user role: say which with --role viewer|editor|admin")
    return 0


def cmd_status(args, settings, process):
    _, db = open_intake(settings, process)
    report = status_report(db.conn())
    if args.json:
        print(json.dumps(report, ensure_ascii=False, indent=2))
    else:
        print_status(report)
    return 0


def cmd_export(args, settings, process):
    registry, db = open_intake(settings, process)
    check_direction(registry, args.direction)
    posts = decided_posts(db.conn(), args.status, args.direction, since=args.since)
    title = f"VESTI: {args.status}" + (f" ({args.direction})" if args.direction else "")
    if args.format == "csv":
        sys.stdout.write(csv_export(posts))
    elif args.format == "json":
        sys.stdout.write(json_feed(posts, title) + "\n")
    else:
        sys.stdout.write(atom_feed(posts, title))
    print(f"export: {len(posts)} posts", file=sys.stderr)
    return 0


def cmd_opml_import(args, settings, process):
    registry = load_registry(settings.sources)
    process.log_mask.keep_out(*registry.secrets())
    check_direction(registry, args.direction)
    added, skipped, unmatched = import_opml(registry, args.file, args.direction, args.priority)
    print(f"opml-import: {added} feeds added to {registry.path}, {skipped} skipped "
          f"(already there or not http)")
    if unmatched:
        print(f"opml-import: folders matching no direction: "
              f"{terminal_text(', '.join(unmatched))}; "
              f"their feeds were added without a direction")
    open_intake(settings, process)
    return 0


def cmd_opml_export(args, settings, process):
    _, db = open_intake(settings, process)
    sources = db.conn().execute("SELECT * FROM sources WHERE enabled = 1 ORDER BY priority, slug")
    sys.stdout.write(opml_document(sources.fetchall()))
    return 0


def cmd_discover(args, settings, process):
    registry = load_registry(settings.sources)
    process.log_mask.keep_out(*registry.secrets())
    url = args.url if "://" in args.url else f"https://{args.url}"
    check_feed_url("discover", url)
    try:
        found = discover_feeds(url, settings)
    except FetchError as e:
        print(f"vesti: discover: {terminal_text(f'{url}: {e}')}", file=sys.stderr)
        return 1
    if not found.feeds:
        print(f"vesti: discover: {terminal_text(no_feed_read(url, found))}", file=sys.stderr)
        return 1
    print_discovered(found.feeds, registry)
    if found.unchecked:
        print(f"# {found.unchecked_note()}")
    return 0


def print_discovered(feeds, registry):
    """Each feed with a sources.yaml entry to paste, or the slug of the
    source it already is (by its URL or the URL the site named)."""
    known, taken = sources_by_url(registry), {s.slug for s in registry.sources}
    for title, feed, asked in feeds:
        slug = known.get(canonical_url(feed)) or known.get(canonical_url(asked))
        if slug:
            print(f"# {yaml_text(title)}: {yaml_text(feed)} (already a source: {slug})\n")
            continue
        entry = (slug_for(title, feed, taken), title, feed, None)
        print(f"# {yaml_text(title)}: {yaml_text(feed)}")
        print("\n".join(source_entries([entry], "  ", 1)))


def since_date(text):
    """--since: a UTC date or date and time, as stored (YYYY-MM-DD[ HH:MM:SS])."""
    text = text.strip().replace("T", " ").rstrip("Z")
    for layout in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d"):
        try:
            return datetime.datetime.strptime(text, layout).strftime("%Y-%m-%d %H:%M:%S")
        except ValueError:
            continue
    raise argparse.ArgumentTypeError(f"expected a date like 2026-11-30 or "
                                     f"'2026-11-30 08:00', got {text!r}")


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return value


def port_number(text):
    if not digits_only(text) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, got {text!r}")
    return int(text)


def whole_number(text):
    if not digits_only(text):
        raise argparse.ArgumentTypeError(f"expected a whole number 0 or more, got {text!r}")
    return int(text)


def _selection_arguments(parser, priority=False, login=False):
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--all", action="store_true", help="every enabled source")
    group.add_argument("--direction", metavar="D", help="sources of one direction")
    group.add_argument("--source", metavar="SLUG", help="one source, fetched at once")
    if priority:
        group.add_argument("--priority", metavar="N", type=whole_number,
                           help="sources of exactly priority N")
    if login:
        group.add_argument("--login", action="store_true",
                           help="interactive Telegram login that writes TG_SESSION")
    parser.add_argument("--trigger", choices=("cli", "cron", "web", "schedule"), default="cli",
                        help="recorded in runs (default: cli)")


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", metavar="PATH", default=argparse.SUPPRESS,
                        help="SQLite file or postgresql:// URL (VESTI_DB, default vesti.db)")
    common.add_argument("--sources", metavar="PATH", default=argparse.SUPPRESS,
                        help="source registry (VESTI_SOURCES, default sources.yaml)")
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="log every fetch and post; -vv: and every SQL statement")
    parser = argparse.ArgumentParser(
        prog="vesti.py", parents=[common],
        description="VESTI: news from feeds and Telegram into one classified queue.")
    parser.add_argument("--version", action="version", version=f"VESTI {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    def command(name, handler, help):
        sub = commands.add_parser(name, parents=[common], help=help, description=help)
        sub.set_defaults(handler=handler)
        return sub

    command("init", cmd_init, "create or migrate the database and sync sources.yaml")
    _selection_arguments(command("rss", cmd_rss, "fetch RSS/Atom sources into the queue"))
    _selection_arguments(command("telegram", cmd_telegram,
                                 "fetch Telegram channels into the queue"), login=True)
    _selection_arguments(command("crawl", cmd_crawl,
                                 "phase 1: every enabled source of every kind, no classification"),
                         priority=True)
    worker = command("worker", cmd_worker, "classify the queue (phase 3)")
    worker.add_argument("--workers", type=positive_int, metavar="N",
                        help="worker threads (VESTI_WORKERS, default 4)")
    worker.add_argument("--limit", type=positive_int, metavar="M", help="process at most M posts")
    worker.add_argument("--forever", action="store_true",
                        help="keep polling the queue instead of exiting when it is empty")
    serve = command("serve", cmd_serve, "the web page")
    serve.add_argument("--host", help="address to listen on (VESTI_WEB_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, help="port (VESTI_WEB_PORT, default 8080)")
    run = command("run", cmd_run, "everything at once: scheduled crawls, the workers, the web page")
    run.add_argument("--workers", type=whole_number, metavar="N",
                     help="worker threads (VESTI_WORKERS, default 4); 0: the crawls and the "
                          "page only, for workers that run on other machines")
    command("reset-dead", cmd_reset_dead, "make every dead source alive again")
    copy = command("copy-db", cmd_copy_db, "copy the whole database to another one "
                   "(a SQLite file or a postgresql:// URL), e.g. to move to PostgreSQL")
    copy.add_argument("--to", required=True, metavar="URL",
                      help="the database to copy into: a postgresql:// URL or a file")
    opml_in = command("opml-import", cmd_opml_import,
                      "add an OPML file's feeds to sources.yaml (comments kept)")
    opml_in.add_argument("file", metavar="FILE", help="an OPML file (a feed reader's export)")
    opml_in.add_argument("--direction", metavar="D",
                         help="direction of every new source (else: the one its folder names)")
    opml_in.add_argument("--priority", metavar="N", type=whole_number, default=1,
                         help="priority of the new sources (default 1)")
    command("opml-export", cmd_opml_export, "the enabled feeds as OPML 2.0 to stdout")
    discover = command("discover", cmd_discover,
                       "the feeds a site offers, each with a ready sources.yaml entry")
    discover.add_argument("url", metavar="URL", help="a site's address, e.g. https://lwn.net")
    learn = command("learn", cmd_learn, "each direction's model learned from the editors' "
                    "decisions: how many, since when, whether it is used yet")
    learn.add_argument("--rebuild", action="store_true",
                       help="learn every model again from all stored decisions")
    quality = command("quality", cmd_quality, "the classifier's report card: how well it and the "
                      "learned models agree with the editors' decisions, per direction")
    quality.add_argument("--json", action="store_true", help="machine-readable output")
    quality.add_argument("--direction", metavar="D", help="one direction only")
    publish = command("publish", cmd_publish, "send the approved posts queued for the publish "
                      "targets of sources.yaml (run does this too)")
    publish.add_argument("--forever", action="store_true",
                         help="keep sending as posts are approved, until stopped")
    user = command("user", cmd_user, "the newsroom's accounts: user add NAME [--role R], "
                   "user passwd NAME, user disable NAME, user enable NAME, "
                   "user role NAME --role R, user list")
    user.add_argument("action", choices=("add", "passwd", "disable", "enable", "role", "list"))
    user.add_argument("name", nargs="?", help="the user's name (letters, digits, . _ -)")
    user.add_argument("--role", choices=ROLES, help="viewer, editor (default) or admin")
    status = command("status", cmd_status, "queue sizes and source health")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    export = command("export", cmd_export, "classified posts to stdout (approved by default)")
    export.add_argument("--status", choices=(*DECISIONS, "any"), default="approved",
                        help="the editor's decision (default approved; any = all)")
    export.add_argument("--format", choices=("csv", "json", "atom"), default="csv",
                        help="csv (default), json (JSON Feed 1.1) or atom")
    export.add_argument("--direction", metavar="D", help="posts of one direction")
    export.add_argument("--since", metavar="DATE", type=since_date,
                        help="decided (or, undecided, published) at or after DATE, UTC")
    return parser


def configure_logging(verbose, mask):
    """-v: what the program does (INFO); -vv: VESTI's DEBUG lines too, every
    SQL statement among them. Other packages stay at INFO: their DEBUG lines
    are noise here, and psycopg's name the server it connects to."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        for old in [f for f in handler.filters if isinstance(f, SecretMask) and f is not mask]:
            handler.removeFilter(old)       # an earlier main() of this interpreter
        if mask not in handler.filters:
            handler.addFilter(mask)
    if verbose >= 2:
        log.setLevel(logging.DEBUG)


def main(argv=None):
    """Run one command; returns the exit code (0 done, 2 usage or
    configuration error, 1 anything else)."""
    args = build_parser().parse_args(argv)
    process = Process()
    configure_logging(getattr(args, "verbose", 0), process.log_mask)
    tell_stacks_on_sigusr1()
    try:
        settings = load_settings(db=getattr(args, "db", None),
                                 sources=getattr(args, "sources", None))
        process.log_mask.keep_out(settings.tg_bot_token, settings.webhook_secret,
                                  settings.web_password, *secrets_of(settings.db))
        return args.handler(args, settings, process)
    except (ConfigError, MissingPackage) as e:
        print(f"vesti: {e}", file=sys.stderr)
        return 2
    except StorageError as e:
        print(f"vesti: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vesti: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # `vesti.py status | head`: the reader has what it wanted.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception:
        log.exception("vesti %s failed", args.command)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
