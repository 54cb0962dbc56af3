//! Node leases: one row per sidecar process. Renewing it keeps every session of that
//! process live; expiring it hands them all back at once.

use std::time::Duration;

use sqlx::{PgConnection, PgExecutor, Row};

use super::{bounded, db, remaining, ttl_ms, LeaseStore, Owner, Result};

/// Register a new boot and, in the same statement, expire every earlier boot of the same
/// node id: that process is dead (a container restart), so its sessions must not wait for
/// their TTL. `$1` owner, `$2` node id, `$3` peer address, `$4` ttl in ms.
const REGISTER_SQL: &str = r#"
WITH earlier AS (
    UPDATE agent_nodes SET expires_at = now()
    WHERE node_id = $2 AND owner <> $1 AND expires_at > now()
    RETURNING owner
)
INSERT INTO agent_nodes (owner, node_id, peer_addr, started_at, renewed_at, expires_at, liveness_lock)
VALUES ($1, $2, $3, now(), now(), now() + $4 * interval '1 millisecond', $5)
RETURNING (SELECT count(*) FROM earlier) AS revoked
"#;

/// The heartbeat: extend this boot's node lease, one row whatever the number of sessions.
/// Only while it is still live: an expired node lease is never resurrected (its sessions
/// may already have been taken over). Liveness is judged on the database clock when the
/// row is reached (`clock_timestamp()`), not when the statement began (`now()`): a renewal
/// that waited behind a revocation re-checks the revoked row against the time after its
/// wait, and finds it expired. `$3`: whether the renewing connection holds the boot's
/// liveness lock (a boot whose lock went with a broken connection says so until it has
/// taken it again).
pub const RENEW_SQL: &str = r#"
UPDATE agent_nodes
SET expires_at = clock_timestamp() + $2 * interval '1 millisecond', renewed_at = clock_timestamp(),
    liveness_lock = $3
WHERE owner = $1 AND expires_at > clock_timestamp()
RETURNING (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint AS remaining_ms
"#;

/// Drain: expire this boot's node lease so every session it holds is claimable at once.
/// Returns how many sessions were attached to it.
const HAND_BACK_SQL: &str = r#"
WITH gone AS (
    UPDATE agent_nodes SET expires_at = now()
    WHERE owner = $1 AND expires_at > now()
    RETURNING owner
)
SELECT count(*) AS sessions FROM agent_leases l JOIN gone ON l.owner = gone.owner
WHERE NOT l.released
"#;

/// A dead pod: expire the node lease of every live boot of `$1`.
const REVOKE_NODE_SQL: &str = r#"
WITH gone AS (
    UPDATE agent_nodes SET expires_at = now()
    WHERE node_id = $1 AND expires_at > now()
    RETURNING owner
)
SELECT count(*) AS sessions FROM agent_leases l JOIN gone ON l.owner = gone.owner
WHERE NOT l.released
"#;

/// A live node lease as the database granted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLease {
    pub owner: Owner,
    /// Time left on the database clock when the statement ran.
    pub remaining: Duration,
}

/// Run the registration statement on any executor (a pool, a test's transaction, or the
/// heartbeat's own connection). `liveness`: that connection holds `owner`'s liveness lock
/// ([`super::liveness`]); a pool cannot, so its callers pass `false`.
pub async fn register<'e>(
    exec: impl PgExecutor<'e>,
    owner: &Owner,
    peer_addr: &str,
    ttl: Duration,
    liveness: bool,
) -> Result<u64> {
    let row = sqlx::query(REGISTER_SQL)
        .bind(owner.as_str())
        .bind(owner.node_id())
        .bind(peer_addr)
        .bind(ttl_ms(ttl))
        .bind(liveness)
        .fetch_one(exec)
        .await
        .map_err(db("register boot"))?;
    Ok(row.get::<i64, _>("revoked").unsigned_abs())
}

/// Run the renewal statement on any executor; `None` when the node lease had expired or
/// was revoked. `liveness` as for [`register`].
pub async fn renew<'e>(
    exec: impl PgExecutor<'e>,
    owner: &Owner,
    ttl: Duration,
    liveness: bool,
) -> Result<Option<NodeLease>> {
    let row = sqlx::query(RENEW_SQL)
        .bind(owner.as_str())
        .bind(ttl_ms(ttl))
        .bind(liveness)
        .fetch_optional(exec)
        .await
        .map_err(db("renew node lease"))?;
    Ok(row.map(|row| NodeLease { owner: owner.clone(), remaining: remaining(row.get("remaining_ms")) }))
}

impl LeaseStore {
    /// Register `owner` as a new live boot for `ttl`, revoking earlier boots of its node
    /// id in the same statement. Returns how many earlier boots were revoked.
    /// Without a liveness lock (a pool cannot hold one): the TTL alone decides.
    pub async fn register_boot(&self, owner: &Owner, peer_addr: &str, ttl: Duration) -> Result<u64> {
        self.observer.time("register boot", register(&self.pool, owner, peer_addr, ttl, false)).await
    }

    /// [`LeaseStore::register_boot`] on the heartbeat's own connection, which holds the
    /// boot's liveness lock when `liveness` says so.
    pub async fn register_boot_on(
        &self,
        conn: &mut PgConnection,
        owner: &Owner,
        peer_addr: &str,
        ttl: Duration,
        liveness: bool,
    ) -> Result<u64> {
        self.observer.time("register boot", register(conn, owner, peer_addr, ttl, liveness)).await
    }

    /// [`LeaseStore::renew_all`] on the heartbeat's own connection.
    pub async fn renew_on(
        &self,
        conn: &mut PgConnection,
        owner: &Owner,
        ttl: Duration,
        liveness: bool,
    ) -> Result<Option<NodeLease>> {
        self.observer.time("renew node lease", renew(conn, owner, ttl, liveness)).await
    }

    /// Renew this boot's node lease, and with it every session it holds, in one
    /// single-row statement. `None`: the node lease had expired or was revoked; every
    /// session of this boot is lost and the process must register a new boot.
    pub async fn renew_all(&self, owner: &Owner, ttl: Duration) -> Result<Option<NodeLease>> {
        // Not bounded here: the heartbeat bounds each beat by its interval.
        self.observer.time("renew node lease", renew(&self.pool, owner, ttl, false)).await
    }

    /// Hand every session of this boot back in one statement (drain). Returns how many
    /// sessions became claimable.
    pub async fn hand_back_all(&self, owner: &Owner) -> Result<u64> {
        self.expire(HAND_BACK_SQL, owner.as_str(), "hand back").await
    }

    /// Expire every live boot of `node_id` (a pod Kubernetes reports gone or failed).
    /// Returns how many sessions became claimable.
    pub async fn revoke_node(&self, node_id: &str) -> Result<u64> {
        self.expire(REVOKE_NODE_SQL, node_id, "revoke node").await
    }

    async fn expire(&self, sql: &'static str, who: &str, context: &'static str) -> Result<u64> {
        let query = sqlx::query(sql).bind(who);
        let row = bounded(&self.observer, context, async {
            query.fetch_one(&self.pool).await.map_err(db(context))
        })
        .await?;
        Ok(row.get::<i64, _>("sessions").unsigned_abs())
    }
}
