-- The turn journal (CONTRACT §9): every turn is recorded before it is dispatched, its
-- events as they are published and its answer before the client sees it, each under the
-- same lease fence as checkpoints (core/src/store/journal.rs). Rows of a session go with
-- the session at retention; finished turns (and their events) go after the answer
-- retention.

-- One row per turn of a session, keyed by its id (the client's Idempotency-Key, or one
-- the sidecar generated). `epoch` is the epoch of the latest attempt; a turn still
-- `running` at an epoch no longer live was interrupted and is resumed by the next owner.
CREATE TABLE agent_turns (
    agent_key    text        NOT NULL,
    turn_id      text        NOT NULL,
    kind         text        NOT NULL CHECK (kind IN ('turn', 'event')),
    digest       bytea       NOT NULL,            -- sha-256 of the content type and body
    request      bytea       NOT NULL,            -- the body, re-sent on a resume
    content_type text,
    epoch        bigint      NOT NULL,
    attempts     integer     NOT NULL DEFAULT 1,
    state        text        NOT NULL CHECK (state IN ('running', 'finished', 'cancelled')),
    status       integer,                         -- the recorded answer, once finished
    answer_type  text,
    answer       bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    PRIMARY KEY (agent_key, turn_id)
);

-- The unfinished turn of a session (at most one runs at a time), for a resume.
CREATE INDEX agent_turns_running ON agent_turns (agent_key, created_at) WHERE state = 'running';
-- Answer retention finds the oldest finished turns.
CREATE INDEX agent_turns_finished_at ON agent_turns (finished_at) WHERE state <> 'running';

-- The events the owner's agent published, in id order (`<epoch>-<seq>`), with the turn
-- that was running when each was published (null between turns).
CREATE TABLE agent_turn_events (
    agent_key  text        NOT NULL,
    epoch      bigint      NOT NULL,
    seq        bigint      NOT NULL,
    turn_id    text,
    kind       text        NOT NULL,
    data       text        NOT NULL,              -- JSON text, as published
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_key, epoch, seq)
);

-- An interrupted attempt's events, for the resuming agent.
CREATE INDEX agent_turn_events_turn ON agent_turn_events (agent_key, turn_id);
-- Events published between turns are collected by age.
CREATE INDEX agent_turn_events_created_at ON agent_turn_events (created_at) WHERE turn_id IS NULL;

-- The turn that wrote a session's checkpoint: an agent resuming a turn learns whether
-- the interrupted attempt's checkpoint already landed (its effects are in the state).
ALTER TABLE agent_checkpoints ADD COLUMN turn_id text;
