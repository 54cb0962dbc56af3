//! Liveness by connection: a boot holds a session-level advisory lock on the connection
//! it renews its node lease from, and Postgres releases that lock the moment the
//! connection closes. A killed process (kill -9, OOM kill, a crashed container) closes
//! its connections at once, so its peers learn from the database itself that the boot is
//! gone and expire its node row then, instead of waiting out the TTL: the way a ZooKeeper
//! ephemeral node goes with its session, or Dapr's placement drops a host whose stream
//! broke.
//!
//! What it does not change: a boot that is frozen (SIGSTOP, a long GC-like pause) or cut
//! off by a partition keeps its connection open on the server's side, so it keeps its
//! lock and the TTL still decides. Expiring a node row early is only ever a hand-back:
//! the fence keeps every write of the old boot out, so a mistaken verdict (a connection
//! that broke while its process lives on) costs that boot its sessions, never a second
//! writer.
//!
//! Only rows that say they hold a lock (`agent_nodes.liveness_lock`) are judged by it:
//! boots of earlier versions, and boots started without it, keep the TTL alone. A
//! Postgres that restarted less than a TTL ago judges nobody: every connection was closed
//! by the restart, and live boots get one TTL to reconnect and take their locks again.

use std::time::Duration;

use sqlx::{PgConnection, PgExecutor, Row};

use super::{db, ttl_ms, LeaseStore, Owner, Result};

/// First half of every liveness lock's key (the second is `hashtext(owner)`): ASCII
/// "lhlk", so the locks are recognisable in `pg_locks` and apart from other users'.
pub const LOCK_CLASS: i32 = 0x6c68_6c6b;

/// Take the boot's lock on this connection, without waiting: `false` when another
/// connection holds it (that connection's backend has not noticed yet that it is dead,
/// or two live boots' owners hash alike); the boot then says it holds none.
const TRY_LOCK_SQL: &str = "SELECT pg_try_advisory_lock($1, hashtext($2))";

/// Let go of an earlier boot's lock on this connection (a new boot after a lost one).
const UNLOCK_SQL: &str = "SELECT pg_advisory_unlock($1, hashtext($2))";

/// Expire the node row of every live boot that says it holds a liveness lock and no
/// longer does (its connection is gone), except the caller's own (`$1`); only `$2` when
/// given. Nobody is judged while Postgres has been up for less than `$3` ms (one TTL).
/// The node trigger notifies `{"node": owner}` for each, so every sidecar forgets the
/// boot at once and the next claim of its sessions takes them over.
const REAP_SQL: &str = r#"
UPDATE agent_nodes n SET expires_at = now()
WHERE n.liveness_lock AND n.expires_at > now() AND n.owner <> $1
  AND ($2::text IS NULL OR n.owner = $2)
  AND pg_postmaster_start_time() < now() - $3 * interval '1 millisecond'
  AND NOT EXISTS (
      SELECT 1 FROM pg_locks k
      WHERE k.locktype = 'advisory' AND k.granted AND k.objsubid = 2
        AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND k.classid = $4::int4::oid AND k.objid = hashtext(n.owner)::oid)
RETURNING n.owner
"#;

/// Take `owner`'s liveness lock on `conn`. Re-taking a lock this connection already
/// holds stacks it (harmless: every level goes with the connection).
pub async fn try_lock(conn: &mut PgConnection, owner: &Owner) -> Result<bool> {
    lock_function(conn, TRY_LOCK_SQL, owner, "take liveness lock").await
}

/// Release `owner`'s liveness lock on `conn` (one level).
pub async fn unlock(conn: &mut PgConnection, owner: &Owner) -> Result<bool> {
    lock_function(conn, UNLOCK_SQL, owner, "release liveness lock").await
}

/// Run one of Postgres's advisory-lock functions on `owner`'s key; its boolean answer.
async fn lock_function(
    conn: &mut PgConnection,
    sql: &'static str,
    owner: &Owner,
    context: &'static str,
) -> Result<bool> {
    let row =
        sqlx::query(sql).bind(LOCK_CLASS).bind(owner.as_str()).fetch_one(conn).await.map_err(db(context))?;
    Ok(row.get(0))
}

/// Expire the node rows of boots whose liveness lock is gone (see [`REAP_SQL`]).
pub async fn reap<'e>(
    exec: impl PgExecutor<'e>,
    me: &Owner,
    only: Option<&Owner>,
    ttl: Duration,
) -> Result<Vec<Owner>> {
    let rows = sqlx::query(REAP_SQL)
        .bind(me.as_str())
        .bind(only.map(Owner::as_str))
        .bind(ttl_ms(ttl))
        .bind(LOCK_CLASS)
        .fetch_all(exec)
        .await
        .map_err(db("reap dead boots"))?;
    Ok(rows.iter().filter_map(|row| Owner::parse(row.get::<&str, _>("owner"))).collect())
}

impl LeaseStore {
    /// A connection of its own, outside every pool: a pool may close and replace its
    /// connections whenever it likes, and the lock would go with them.
    pub async fn liveness_connection(&self) -> Result<PgConnection> {
        use sqlx::ConnectOptions;
        let options = self.pool.connect_options().as_ref().clone();
        super::bounded(&self.observer, "connect for the liveness lock", async {
            options.connect().await.map_err(db("connect for the liveness lock"))
        })
        .await
    }

    /// Expire the node rows of dead boots (every one, or only `only`), on a pooled
    /// connection; returns the boots expired. `me` is never judged.
    pub async fn reap_dead_boots(
        &self,
        me: &Owner,
        only: Option<&Owner>,
        ttl: Duration,
    ) -> Result<Vec<Owner>> {
        super::bounded(&self.observer, "reap dead boots", reap(&self.pool, me, only, ttl)).await
    }
}
