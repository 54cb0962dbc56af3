//! The turn journal (CONTRACT §9): turns, their published events and their answers, each
//! written under the same lease fence as checkpoints, so a stale owner's turn, event or
//! answer never lands. An acknowledged turn is durable; an unfinished one is resumed by
//! the next owner; a repeated idempotency key finds the recorded answer.

use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{postgres::PgRow, Row};

use super::{bounded, db, ttl_ms, Epoch, Error, LeaseStore, Owner, Result};
use crate::{key::SessionKey, EventId};

/// Whether a journaled request came from the session's user or from elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnKind {
    Turn,
    Event,
}

impl TurnKind {
    fn as_str(self) -> &'static str {
        match self {
            TurnKind::Turn => "turn",
            TurnKind::Event => "event",
        }
    }

    fn parse(s: &str) -> Self {
        if s == "event" {
            TurnKind::Event
        } else {
            TurnKind::Turn
        }
    }
}

/// Where a turn stands in the journal. `Running` at an epoch that is no longer live means
/// interrupted: the next owner resumes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnState {
    Running,
    Finished,
    Cancelled,
}

impl TurnState {
    pub fn as_str(self) -> &'static str {
        match self {
            TurnState::Running => "running",
            TurnState::Finished => "finished",
            TurnState::Cancelled => "cancelled",
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "finished" => TurnState::Finished,
            "cancelled" => TurnState::Cancelled,
            _ => TurnState::Running,
        }
    }
}

/// A request as it is journaled before its first dispatch.
#[derive(Debug, Clone)]
pub struct NewTurn<'a> {
    pub turn_id: &'a str,
    pub kind: TurnKind,
    pub content_type: Option<&'a str>,
    pub body: &'a [u8],
}

impl NewTurn<'_> {
    /// What "the same request" means for an idempotency key: the same kind, content type
    /// and body.
    pub fn digest(&self) -> Vec<u8> {
        request_digest(self.kind, self.content_type, self.body)
    }
}

/// The digest two attempts of one idempotency key are compared by.
pub fn request_digest(kind: TurnKind, content_type: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mut hash = Sha256::new();
    hash.update(kind.as_str());
    hash.update([0]);
    hash.update(content_type.unwrap_or(""));
    hash.update([0]);
    hash.update(body);
    hash.finalize().to_vec()
}

/// The answer a client was (or will be) given: recorded before it is sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

/// One journaled turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnRecord {
    pub turn_id: String,
    pub kind: TurnKind,
    pub digest: Vec<u8>,
    pub request: Vec<u8>,
    pub content_type: Option<String>,
    /// The epoch of the latest attempt.
    pub epoch: Epoch,
    pub attempts: i32,
    pub state: TurnState,
    /// Set once finished.
    pub answer: Option<Answer>,
}

impl TurnRecord {
    fn from_row(row: &PgRow) -> Self {
        let state = TurnState::parse(row.get("state"));
        let answer = row.get::<Option<i32>, _>("status").map(|status| Answer {
            status: u16::try_from(status).unwrap_or(500),
            content_type: row.get("answer_type"),
            body: row.get::<Option<Vec<u8>>, _>("answer").unwrap_or_default(),
        });
        TurnRecord {
            turn_id: row.get("turn_id"),
            kind: TurnKind::parse(row.get("kind")),
            digest: row.get("digest"),
            request: row.get("request"),
            content_type: row.get("content_type"),
            epoch: Epoch(row.get("epoch")),
            attempts: row.get("attempts"),
            state,
            answer,
        }
    }
}

/// What [`LeaseStore::begin_turn`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begun {
    /// Journaled now: dispatch it.
    Started,
    /// It was running (interrupted at an earlier epoch, or an attempt of ours halted
    /// without an answer): now at ours, attempt `attempts`; dispatch it as a resume. The
    /// caller runs one turn of a session at a time, so no attempt of it is under way.
    Resumed(TurnRecord),
    /// Already journaled and ended: finished or cancelled. (A turn still running that we
    /// cannot take over is `Err(Fenced)`: the session moved.)
    Existing(TurnRecord),
}

/// An event as journaled: its id, the turn that was running when it was published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEvent {
    pub id: EventId,
    pub turn_id: Option<String>,
    pub kind: String,
    /// JSON text, as published.
    pub data: String,
}

impl JournalEvent {
    fn from_row(row: &PgRow) -> Self {
        let seq: i64 = row.get("seq");
        JournalEvent {
            id: EventId { epoch: Epoch(row.get("epoch")), seq: u64::try_from(seq).unwrap_or(0) },
            turn_id: row.get("turn_id"),
            kind: row.get("kind"),
            data: row.get("data"),
        }
    }
}

/// An event to append, with the lease it was published under.
#[derive(Debug, Clone)]
pub struct Append {
    pub key: SessionKey,
    pub owner: Owner,
    pub event: JournalEvent,
}

/// The fence of every journal write, as in the checkpoint fence: the lease row still
/// carries owner `$2` and epoch `$3`, read `FOR SHARE` so a takeover waits for us.
const LEASE_CTE: &str = r#"
lease AS (
    SELECT agent_key FROM agent_leases
    WHERE agent_key = $1 AND owner = $2 AND epoch = $3 AND NOT released
    FOR SHARE
)"#;

/// Journal a new turn (`$4` id, `$5` kind, `$6` digest, `$7` body, `$8` content type)
/// under the fence. `held` says the fence passed; `inserted` that the id was new.
fn begin_sql() -> String {
    format!(
        r#"WITH {LEASE_CTE},
ins AS (
    INSERT INTO agent_turns (agent_key, turn_id, kind, digest, request, content_type, epoch, state)
    SELECT agent_key, $4, $5, $6, $7, $8, $3, 'running' FROM lease
    ON CONFLICT (agent_key, turn_id) DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM lease) AS held, EXISTS (SELECT 1 FROM ins) AS inserted"#
    )
}

/// Take over an interrupted turn: running at an epoch up to ours (at ours: an attempt of
/// this owner that was halted without an answer; the caller runs one turn of a session
/// at a time, so none of its attempts is still running).
fn resume_sql() -> String {
    format!(
        r#"WITH {LEASE_CTE}
UPDATE agent_turns t SET epoch = $3, attempts = t.attempts + 1
FROM lease
WHERE t.agent_key = lease.agent_key AND t.turn_id = $4 AND t.state = 'running' AND t.epoch <= $3
RETURNING t.turn_id, t.kind, t.digest, t.request, t.content_type, t.epoch, t.attempts,
          t.state, t.status, t.answer_type, t.answer"#
    )
}

/// Record the answer (`$5` status, `$6` content type, `$7` body) of the attempt at our epoch.
fn finish_sql() -> String {
    format!(
        r#"WITH {LEASE_CTE}
UPDATE agent_turns t SET state = 'finished', status = $5, answer_type = $6, answer = $7, finished_at = now()
FROM lease
WHERE t.agent_key = lease.agent_key AND t.turn_id = $4 AND t.state = 'running' AND t.epoch = $3"#
    )
}

/// Cancel a turn that has not finished (`DELETE …/turns/{id}`, the `interrupt` policy).
fn cancel_sql() -> String {
    format!(
        r#"WITH {LEASE_CTE}
UPDATE agent_turns t SET state = 'cancelled', epoch = $3, finished_at = now()
FROM lease
WHERE t.agent_key = lease.agent_key AND t.turn_id = $4 AND t.state = 'running'"#
    )
}

/// Append a batch of events, each under the fence of its own lease (several sessions
/// share one statement: the group commit). Returns the ids that landed; an event whose
/// lease moved is not written.
const APPEND_SQL: &str = r#"
WITH e AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::text[], $6::text[], $7::text[])
        AS e(agent_key, owner, epoch, seq, turn_id, kind, data)
),
lease AS (
    SELECT l.agent_key, l.owner, l.epoch FROM agent_leases l
    WHERE (l.agent_key, l.owner, l.epoch) IN (SELECT DISTINCT agent_key, owner, epoch FROM e)
      AND NOT l.released
    FOR SHARE
)
INSERT INTO agent_turn_events (agent_key, epoch, seq, turn_id, kind, data)
SELECT e.agent_key, e.epoch, e.seq, e.turn_id, e.kind, e.data
FROM e JOIN lease USING (agent_key, owner, epoch)
ON CONFLICT DO NOTHING
RETURNING agent_key, epoch, seq
"#;

const GET_TURN_SQL: &str = r#"
SELECT turn_id, kind, digest, request, content_type, epoch, attempts, state, status, answer_type, answer
FROM agent_turns WHERE agent_key = $1 AND turn_id = $2
"#;

const UNFINISHED_SQL: &str = r#"
SELECT turn_id, kind, digest, request, content_type, epoch, attempts, state, status, answer_type, answer
FROM agent_turns WHERE agent_key = $1 AND state = 'running' ORDER BY created_at, turn_id
"#;

const EVENTS_AFTER_SQL: &str = r#"
SELECT epoch, seq, turn_id, kind, data FROM agent_turn_events
WHERE agent_key = $1 AND (epoch, seq) > ($2, $3)
ORDER BY epoch, seq LIMIT $4
"#;

const TURN_EVENTS_SQL: &str = r#"
SELECT epoch, seq, turn_id, kind, data FROM agent_turn_events
WHERE agent_key = $1 AND turn_id = $2 AND epoch < $3
ORDER BY epoch, seq
"#;

/// Sessions with an unfinished turn and no live owner (released, or the owner's node
/// lease expired): someone must claim them and resume the turn. At most `$1`.
const ORPHANS_SQL: &str = r#"
SELECT DISTINCT t.agent_key FROM agent_turns t
JOIN agent_leases l ON l.agent_key = t.agent_key
LEFT JOIN agent_nodes n ON n.owner = l.owner
WHERE t.state = 'running' AND (l.released OR n.expires_at IS NULL OR n.expires_at <= now())
LIMIT $1
"#;

/// Finished and cancelled turns older than `$1` ms, at most `$2`, with their events;
/// and events published between turns older than that.
const COLLECT_TURNS_SQL: &str = r#"
WITH doomed AS (
    SELECT agent_key, turn_id FROM agent_turns
    WHERE state <> 'running' AND finished_at < now() - $1 * interval '1 millisecond'
    ORDER BY finished_at LIMIT $2
    FOR UPDATE SKIP LOCKED
),
events AS (
    DELETE FROM agent_turn_events e USING doomed d
    WHERE e.agent_key = d.agent_key AND e.turn_id = d.turn_id
),
loose AS (
    DELETE FROM agent_turn_events WHERE ctid IN (
        SELECT ctid FROM agent_turn_events
        WHERE turn_id IS NULL AND created_at < now() - $1 * interval '1 millisecond' LIMIT $2
    )
),
gone AS (
    DELETE FROM agent_turns t USING doomed d
    WHERE t.agent_key = d.agent_key AND t.turn_id = d.turn_id RETURNING 1
)
SELECT count(*) AS turns FROM gone
"#;

fn seq_i64(id: EventId) -> i64 {
    i64::try_from(id.seq).unwrap_or(i64::MAX)
}

impl LeaseStore {
    /// Journal a turn before its dispatch, under the fence (`Err(Fenced)` when this
    /// owner/epoch no longer holds the session). A turn id seen before is not journaled
    /// again: one still running is taken over at our epoch ([`Begun::Resumed`]), any
    /// other is returned as it stands ([`Begun::Existing`]); the caller compares digests.
    /// One still running that we cannot take over (the session moved between the
    /// statements) is `Err(Fenced)`. The caller runs one turn of a session at a time.
    pub async fn begin_turn(
        &self,
        key: &SessionKey,
        owner: &Owner,
        epoch: Epoch,
        turn: &NewTurn<'_>,
    ) -> Result<Begun> {
        let sql = begin_sql();
        let query = sqlx::query(&sql)
            .bind(key.as_str())
            .bind(owner.as_str())
            .bind(epoch.0)
            .bind(turn.turn_id)
            .bind(turn.kind.as_str())
            .bind(turn.digest())
            .bind(turn.body)
            .bind(turn.content_type);
        let row = bounded(&self.observer, "begin turn", async {
            query.fetch_one(&self.pool).await.map_err(db("begin turn"))
        })
        .await?;
        if !row.get::<bool, _>("held") {
            return Err(Error::Fenced { key: key.clone(), epoch });
        }
        if row.get::<bool, _>("inserted") {
            return Ok(Begun::Started);
        }
        // Journaled before. Only the session's owner writes its turns, so the row is
        // committed: a running attempt is ours to take over, anything else stands.
        if let Some(resumed) = self.resume_turn(key, owner, epoch, turn.turn_id).await? {
            return Ok(Begun::Resumed(resumed));
        }
        match self.get_turn(key, turn.turn_id).await? {
            // Running, yet not ours to take over: the lease moved between the two
            // statements (or the next owner took the turn over already). It is that
            // owner's to resume, not a turn that ended: fenced, like a write.
            Some(existing) if existing.state == TurnState::Running => {
                Err(Error::Fenced { key: key.clone(), epoch })
            }
            Some(existing) => Ok(Begun::Existing(existing)),
            // Collected between the two statements: journal it anew.
            None => Box::pin(self.begin_turn(key, owner, epoch, turn)).await,
        }
    }

    /// Take over a turn still running at an epoch up to ours (interrupted, or halted
    /// here) at our epoch; `None` when it is not running or we do not hold the session.
    /// The caller runs one turn of a session at a time.
    pub async fn resume_turn(
        &self,
        key: &SessionKey,
        owner: &Owner,
        epoch: Epoch,
        turn_id: &str,
    ) -> Result<Option<TurnRecord>> {
        let sql = resume_sql();
        let query = sqlx::query(&sql).bind(key.as_str()).bind(owner.as_str()).bind(epoch.0).bind(turn_id);
        let row = bounded(&self.observer, "resume turn", async {
            query.fetch_optional(&self.pool).await.map_err(db("resume turn"))
        })
        .await?;
        Ok(row.as_ref().map(TurnRecord::from_row))
    }

    /// Record a turn's answer under the fence. `Err(Fenced)` when this owner/epoch no
    /// longer holds the session or the turn is no longer ours to finish (cancelled, or
    /// taken over).
    pub async fn finish_turn(
        &self,
        key: &SessionKey,
        owner: &Owner,
        epoch: Epoch,
        turn_id: &str,
        answer: &Answer,
    ) -> Result<()> {
        let sql = finish_sql();
        let query = sqlx::query(&sql)
            .bind(key.as_str())
            .bind(owner.as_str())
            .bind(epoch.0)
            .bind(turn_id)
            .bind(i32::from(answer.status))
            .bind(answer.content_type.as_deref())
            .bind(answer.body.as_slice());
        let done = bounded(&self.observer, "finish turn", async {
            query.execute(&self.pool).await.map_err(db("finish turn"))
        })
        .await?;
        match done.rows_affected() {
            1 => Ok(()),
            _ => Err(Error::Fenced { key: key.clone(), epoch }),
        }
    }

    /// Cancel an unfinished turn under the fence; false when it was not running.
    pub async fn cancel_turn(
        &self,
        key: &SessionKey,
        owner: &Owner,
        epoch: Epoch,
        turn_id: &str,
    ) -> Result<bool> {
        let sql = cancel_sql();
        let query = sqlx::query(&sql).bind(key.as_str()).bind(owner.as_str()).bind(epoch.0).bind(turn_id);
        let done = bounded(&self.observer, "cancel turn", async {
            query.execute(&self.pool).await.map_err(db("cancel turn"))
        })
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// One turn as journaled.
    pub async fn get_turn(&self, key: &SessionKey, turn_id: &str) -> Result<Option<TurnRecord>> {
        let query = sqlx::query(GET_TURN_SQL).bind(key.as_str()).bind(turn_id);
        let row = bounded(&self.observer, "get turn", async {
            query.fetch_optional(&self.pool).await.map_err(db("get turn"))
        })
        .await?;
        Ok(row.as_ref().map(TurnRecord::from_row))
    }

    /// A session's unfinished turns, oldest first (normally at most one).
    pub async fn unfinished_turns(&self, key: &SessionKey) -> Result<Vec<TurnRecord>> {
        let query = sqlx::query(UNFINISHED_SQL).bind(key.as_str());
        let rows = bounded(&self.observer, "unfinished turns", async {
            query.fetch_all(&self.pool).await.map_err(db("unfinished turns"))
        })
        .await?;
        Ok(rows.iter().map(TurnRecord::from_row).collect())
    }

    /// Append events in one statement, each under its own lease's fence. Returns the ids
    /// that landed, in the order given; the others were fenced (or already journaled).
    pub async fn append_events(&self, batch: &[Append]) -> Result<Vec<(SessionKey, EventId)>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<&str> = batch.iter().map(|a| a.key.as_str()).collect();
        let owners: Vec<&str> = batch.iter().map(|a| a.owner.as_str()).collect();
        let epochs: Vec<i64> = batch.iter().map(|a| a.event.id.epoch.0).collect();
        let seqs: Vec<i64> = batch.iter().map(|a| seq_i64(a.event.id)).collect();
        let turns: Vec<Option<&str>> = batch.iter().map(|a| a.event.turn_id.as_deref()).collect();
        let kinds: Vec<&str> = batch.iter().map(|a| a.event.kind.as_str()).collect();
        let data: Vec<&str> = batch.iter().map(|a| a.event.data.as_str()).collect();
        let query = sqlx::query(APPEND_SQL)
            .bind(keys)
            .bind(owners)
            .bind(epochs)
            .bind(seqs)
            .bind(turns)
            .bind(kinds)
            .bind(data);
        let rows = bounded(&self.observer, "append events", async {
            query.fetch_all(&self.pool).await.map_err(db("append events"))
        })
        .await?;
        let landed: std::collections::HashSet<(String, i64, i64)> = rows
            .iter()
            .map(|row| {
                (row.get::<String, _>("agent_key"), row.get::<i64, _>("epoch"), row.get::<i64, _>("seq"))
            })
            .collect();
        Ok(batch
            .iter()
            .filter(|a| {
                landed.contains(&(a.key.as_str().to_owned(), a.event.id.epoch.0, seq_i64(a.event.id)))
            })
            .map(|a| (a.key.clone(), a.event.id))
            .collect())
    }

    /// Journaled events of a session after `after` (all when `None`), in id order, at most
    /// `limit`: the replay for an observer whose `Last-Event-ID` memory no longer holds.
    pub async fn events_after(
        &self,
        key: &SessionKey,
        after: Option<EventId>,
        limit: i64,
    ) -> Result<Vec<JournalEvent>> {
        let after = after.unwrap_or(EventId { epoch: Epoch(0), seq: 0 });
        let query = sqlx::query(EVENTS_AFTER_SQL)
            .bind(key.as_str())
            .bind(after.epoch.0)
            .bind(seq_i64(after))
            .bind(limit);
        let rows = bounded(&self.observer, "events after", async {
            query.fetch_all(&self.pool).await.map_err(db("events after"))
        })
        .await?;
        Ok(rows.iter().map(JournalEvent::from_row).collect())
    }

    /// The journaled events of a turn's attempts before `epoch`: what a resuming agent
    /// continues from.
    pub async fn turn_events(
        &self,
        key: &SessionKey,
        turn_id: &str,
        epoch: Epoch,
    ) -> Result<Vec<JournalEvent>> {
        let query = sqlx::query(TURN_EVENTS_SQL).bind(key.as_str()).bind(turn_id).bind(epoch.0);
        let rows = bounded(&self.observer, "turn events", async {
            query.fetch_all(&self.pool).await.map_err(db("turn events"))
        })
        .await?;
        Ok(rows.iter().map(JournalEvent::from_row).collect())
    }

    /// Sessions with an unfinished turn and no live owner, at most `limit`.
    pub async fn orphaned_turns(&self, limit: i64) -> Result<Vec<SessionKey>> {
        let query = sqlx::query(ORPHANS_SQL).bind(limit);
        let rows = bounded(&self.observer, "orphaned turns", async {
            query.fetch_all(&self.pool).await.map_err(db("orphaned turns"))
        })
        .await?;
        Ok(rows.iter().filter_map(|row| SessionKey::parse(row.get::<&str, _>("agent_key")).ok()).collect())
    }

    /// One batch of answer retention: at most `batch` turns finished (or cancelled) more
    /// than `retention` ago, with their events. Call again while it collects a full batch.
    pub async fn collect_turns(&self, retention: Duration, batch: i64) -> Result<u64> {
        let query = sqlx::query(COLLECT_TURNS_SQL).bind(ttl_ms(retention)).bind(batch);
        let row = bounded(&self.observer, "collect turns", async {
            query.fetch_one(&self.pool).await.map_err(db("collect turns"))
        })
        .await?;
        Ok(row.get::<i64, _>("turns").unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_tells_kind_content_type_and_body_apart() {
        let base = request_digest(TurnKind::Turn, Some("application/json"), b"{}");
        assert_eq!(base, request_digest(TurnKind::Turn, Some("application/json"), b"{}"));
        assert_ne!(base, request_digest(TurnKind::Event, Some("application/json"), b"{}"));
        assert_ne!(base, request_digest(TurnKind::Turn, Some("text/plain"), b"{}"));
        assert_ne!(base, request_digest(TurnKind::Turn, Some("application/json"), b"{ }"));
        // The separator keeps content type and body from sliding into each other.
        assert_ne!(
            request_digest(TurnKind::Turn, Some("a"), b"b"),
            request_digest(TurnKind::Turn, Some("ab"), b"")
        );
    }
}
