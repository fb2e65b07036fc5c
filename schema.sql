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
CREATE TRIGGER IF NOT EXISTS posts_completed AFTER UPDATE OF classified ON posts
WHEN (new.classified = 1 AND coalesce(old.classified, 0) != 1 AND new.status = 'new' AND old.claim_token IS NULL)
    AND old.id <= (SELECT CAST(value AS BIGINT) FROM meta WHERE key = 'indexed_to')
BEGIN
    UPDATE post_counts SET n = n + 1
    WHERE new.classified = 1 AND (new.story_id IS NULL OR new.story_id = new.id)
      AND status = new.status
      AND direction = coalesce(new.direction, '')
      AND relevance = coalesce(new.relevance, 0)
      AND liked = (CASE WHEN new.likely IS NULL THEN -1 WHEN new.likely >= 0.75 THEN 2 WHEN new.likely >= 0.35 THEN 1 ELSE 0 END);
    UPDATE source_post_counts SET n = n + 1
    WHERE new.classified = 1
      AND source_id = coalesce(new.source_id, 0)
      AND status = new.status
      AND direction = coalesce(new.direction, '')
      AND relevance = coalesce(new.relevance, 0)
      AND liked = (CASE WHEN new.likely IS NULL THEN -1 WHEN new.likely >= 0.75 THEN 2 WHEN new.likely >= 0.35 THEN 1 ELSE 0 END);
END;
CREATE TRIGGER IF NOT EXISTS posts_recounted AFTER UPDATE OF classified, status, direction, relevance, source_id, likely, story_id ON posts
WHEN ((old.classified = 1 OR new.classified = 1) AND NOT (new.classified = 1 AND coalesce(old.classified, 0) != 1 AND new.status = 'new'))
    AND old.id <= (SELECT CAST(value AS BIGINT) FROM meta WHERE key = 'indexed_to')
BEGIN
    UPDATE post_counts SET n = n - 1
    WHERE old.classified = 1 AND (old.story_id IS NULL OR old.story_id = old.id)
      AND status = old.status
      AND direction = coalesce(old.direction, '')
      AND relevance = coalesce(old.relevance, 0)
      AND liked = (CASE WHEN old.likely IS NULL THEN -1 WHEN old.likely >= 0.75 THEN 2 WHEN old.likely >= 0.35 THEN 1 ELSE 0 END);
    UPDATE source_post_counts SET n = n - 1
    WHERE old.classified = 1
      AND source_id = coalesce(old.source_id, 0)
      AND status = old.status
      AND direction = coalesce(old.direction, '')
      AND relevance = coalesce(old.relevance, 0)
      AND liked = (CASE WHEN old.likely IS NULL THEN -1 WHEN old.likely >= 0.75 THEN 2 WHEN old.likely >= 0.35 THEN 1 ELSE 0 END);
    INSERT INTO post_counts (status, direction, relevance, liked, n)
    SELECT new.status, coalesce(new.direction, ''), coalesce(new.relevance, 0), (CASE WHEN new.likely IS NULL THEN -1 WHEN new.likely >= 0.75 THEN 2 WHEN new.likely >= 0.35 THEN 1 ELSE 0 END), 1
    WHERE new.classified = 1 AND (new.story_id IS NULL OR new.story_id = new.id)
    ON CONFLICT (status, direction, relevance, liked) DO UPDATE SET n = post_counts.n + 1;
    INSERT INTO source_post_counts (source_id, status, direction, relevance, liked, n)
    SELECT coalesce(new.source_id, 0), new.status, coalesce(new.direction, ''), coalesce(new.relevance, 0), (CASE WHEN new.likely IS NULL THEN -1 WHEN new.likely >= 0.75 THEN 2 WHEN new.likely >= 0.35 THEN 1 ELSE 0 END), 1
    WHERE new.classified = 1
    ON CONFLICT (source_id, status, direction, relevance, liked) DO UPDATE SET n = source_post_counts.n + 1;
END;
CREATE TRIGGER IF NOT EXISTS posts_uncounted AFTER DELETE ON posts
WHEN (old.classified = 1)
    AND old.id <= (SELECT CAST(value AS BIGINT) FROM meta WHERE key = 'indexed_to')
BEGIN
    UPDATE post_counts SET n = n - 1
    WHERE old.classified = 1 AND (old.story_id IS NULL OR old.story_id = old.id)
      AND status = old.status
      AND direction = coalesce(old.direction, '')
      AND relevance = coalesce(old.relevance, 0)
      AND liked = (CASE WHEN old.likely IS NULL THEN -1 WHEN old.likely >= 0.75 THEN 2 WHEN old.likely >= 0.35 THEN 1 ELSE 0 END);
    UPDATE source_post_counts SET n = n - 1
    WHERE old.classified = 1
      AND source_id = coalesce(old.source_id, 0)
      AND status = old.status
      AND direction = coalesce(old.direction, '')
      AND relevance = coalesce(old.relevance, 0)
      AND liked = (CASE WHEN old.likely IS NULL THEN -1 WHEN old.likely >= 0.75 THEN 2 WHEN old.likely >= 0.35 THEN 1 ELSE 0 END);
END;

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
