//! Retention: sessions nobody holds, idle past a retention, are deleted with their
//! checkpoints and journal; node rows of boots dead for a while, once no session names them. Small
//! batches, each one statement; a live lease is never touched.

use std::time::Duration;

use sqlx::Row;

use super::{bounded, db, ttl_ms, LeaseStore, Result};

/// Sessions idle past `$1` ms and not live (released, or their owner's node lease expired
/// `$1` ms ago or more), oldest first, at most `$2`, with their checkpoints; the epoch
/// floor rises to the highest epoch deleted, so a key created again never reuses one.
/// Rows a claim is changing are skipped (and a claim waiting on a row deleted here
/// inserts it anew, above the floor).
const SESSIONS_SQL: &str = r#"
WITH doomed AS (
    SELECT l.agent_key FROM agent_leases l
    LEFT JOIN agent_nodes n ON n.owner = l.owner
    WHERE l.updated_at < now() - $1 * interval '1 millisecond'
      AND (l.released OR n.expires_at < now() - $1 * interval '1 millisecond')
    ORDER BY l.updated_at
    LIMIT $2
    FOR UPDATE OF l SKIP LOCKED
),
checkpoints AS (
    DELETE FROM agent_checkpoints c USING doomed d WHERE c.agent_key = d.agent_key
),
turns AS (
    DELETE FROM agent_turns t USING doomed d WHERE t.agent_key = d.agent_key
),
events AS (
    DELETE FROM agent_turn_events e USING doomed d WHERE e.agent_key = d.agent_key
),
gone AS (
    DELETE FROM agent_leases l USING doomed d WHERE l.agent_key = d.agent_key RETURNING l.epoch
),
floor AS (
    UPDATE agent_epoch_floor SET floor = greatest(floor, (SELECT max(epoch) FROM gone))
    WHERE EXISTS (SELECT 1 FROM gone)
)
SELECT count(*) AS sessions FROM gone
"#;

/// Node rows of boots whose lease expired `$1` ms ago or more and that no session names
/// any more (a session's takeover needs its owner's node row), at most `$2`.
const NODES_SQL: &str = r#"
DELETE FROM agent_nodes WHERE owner IN (
    SELECT n.owner FROM agent_nodes n
    WHERE n.expires_at < now() - $1 * interval '1 millisecond'
      AND NOT EXISTS (SELECT 1 FROM agent_leases l WHERE l.owner = n.owner)
    ORDER BY n.expires_at
    LIMIT $2
)
"#;

/// What one retention pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Collected {
    pub sessions: u64,
    pub nodes: u64,
}

impl LeaseStore {
    /// One batch: at most `batch` sessions idle past `sessions`, then at most `batch` node
    /// rows of boots dead for `nodes`. Call again while it collects a full batch.
    pub async fn collect(&self, sessions: Duration, nodes: Duration, batch: i64) -> Result<Collected> {
        let query = sqlx::query(SESSIONS_SQL).bind(ttl_ms(sessions)).bind(batch);
        let gone = bounded(&self.observer, "collect sessions", async {
            query.fetch_one(&self.pool).await.map_err(db("collect sessions"))
        })
        .await?;
        let query = sqlx::query(NODES_SQL).bind(ttl_ms(nodes)).bind(batch);
        let dead = bounded(&self.observer, "collect nodes", async {
            query.execute(&self.pool).await.map_err(db("collect nodes"))
        })
        .await?;
        Ok(Collected { sessions: gone.get::<i64, _>("sessions").unsigned_abs(), nodes: dead.rows_affected() })
    }
}
