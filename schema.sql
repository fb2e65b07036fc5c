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
    post_count INTEGER NOT NULL DEFAULT 0
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
    edited_at TEXT
);
-- Queue sizes: pending (NULL/0), processing (-1), failed (-2), done today (1 + fetched_at).
CREATE INDEX IF NOT EXISTS posts_queue ON posts(classified, fetched_at);
-- The claim takes the oldest pending post; this index holds only pending ones.
CREATE INDEX IF NOT EXISTS posts_pending ON posts(id) WHERE classified IS NULL OR classified = 0;
CREATE INDEX IF NOT EXISTS posts_sha256 ON posts(sha256);
CREATE INDEX IF NOT EXISTS posts_canonical_url ON posts(canonical_url);
CREATE INDEX IF NOT EXISTS posts_external_id ON posts(source_id, external_id);
CREATE INDEX IF NOT EXISTS posts_candidates ON posts(classified, published_at);

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
-- Runs still marked running: a stopped or killed crawl leaves them behind.
CREATE INDEX IF NOT EXISTS runs_running ON runs(pid) WHERE status = 'running';
