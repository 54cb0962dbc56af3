//! Session leases: claim (the four cases), release, lookup, held.

use std::time::Duration;

use sqlx::{PgExecutor, Row};

use super::{bounded, db, remaining, Epoch, Error, LeaseStore, Owner, Result};
use crate::key::SessionKey;

/// How many times a claim is re-run when its answer is empty (a concurrent first insert
/// committed between our snapshot and our conflict check). One re-run settles it; a few
/// more cover pathological churn before we report the store as unusable.
const CLAIM_ATTEMPTS: u32 = 5;

/// Claim `$1` for owner `$2`, the four cases of CONTRACT §7 in one statement:
///
/// 1. no row                   → INSERT, epoch 1 (one above the epoch floor: the highest
///    epoch retention ever deleted, 0 until it deleted one);
/// 2. own row, live            → kept, epoch unchanged (`acquired` false);
/// 3. row not live (released, or its owner's node lease expired/revoked; own or another's)
///    → taken over, epoch + 1;
/// 4. another's live row       → nothing changes; the `holder` CTE reports owner, peer
///    address and remaining TTL from the same statement.
///
/// The caller's own node row must be live (`me`), else nothing is written. Under READ
/// COMMITTED a claim that lost a race against a concurrent first insert finds no holder
/// in its snapshot: the answer is then empty and the caller re-runs it (never "free").
///
/// Case 3 takes over only when the owner's node row is *visible and expired*. `ON
/// CONFLICT` re-checks the newest lease row, but the subquery on `agent_nodes` reads the
/// statement's older snapshot: a boot that registered and claimed after that snapshot has
/// a node row we cannot see, and its absence must not read as "expired" (that took over a
/// live lease). Such a claim changes nothing and finds no holder in its snapshot: the
/// empty answer, re-run with a fresh snapshot, which sees the holder.
pub const CLAIM_SQL: &str = r#"
WITH me AS (
    SELECT owner FROM agent_nodes WHERE owner = $2 AND expires_at > now()
),
won AS (
    INSERT INTO agent_leases AS l (agent_key, owner, epoch, released, acquired_at, updated_at)
    SELECT $1, me.owner, (SELECT floor FROM agent_epoch_floor) + 1, false, now(), now() FROM me
    ON CONFLICT (agent_key) DO UPDATE
    SET epoch       = CASE WHEN l.owner = EXCLUDED.owner AND NOT l.released
                           THEN l.epoch ELSE l.epoch + 1 END,
        acquired_at = CASE WHEN l.owner = EXCLUDED.owner AND NOT l.released
                           THEN l.acquired_at ELSE now() END,
        owner       = EXCLUDED.owner,
        released    = false,
        updated_at  = now()
    WHERE (l.owner = EXCLUDED.owner AND NOT l.released)
       OR l.released
       OR EXISTS (SELECT 1 FROM agent_nodes n
                  WHERE n.owner = l.owner AND n.expires_at <= now())
    RETURNING l.epoch, l.acquired_at = now() AS acquired, l.xmax = 0 AS inserted
),
holder AS (
    SELECT l.owner, l.epoch, n.peer_addr,
           (extract(epoch FROM n.expires_at - now()) * 1000)::bigint AS remaining_ms
    FROM agent_leases l JOIN agent_nodes n ON n.owner = l.owner
    WHERE l.agent_key = $1 AND NOT l.released AND n.expires_at > now()
      AND NOT EXISTS (SELECT 1 FROM won)
)
SELECT EXISTS (SELECT 1 FROM me) AS me_live,
       won.epoch AS won_epoch, won.acquired, won.inserted,
       holder.owner AS holder_owner, holder.epoch AS holder_epoch,
       holder.peer_addr, holder.remaining_ms
FROM (SELECT 1) AS one
LEFT JOIN won ON true
LEFT JOIN holder ON true
"#;

/// Release one idle session: it becomes claimable at once (next claim: epoch + 1).
/// Idempotent: a row this owner already released at this epoch answers "done" again
/// (no one has claimed it since, or the epoch would have moved on).
const RELEASE_SQL: &str = r#"
UPDATE agent_leases
SET released = true, updated_at = CASE WHEN released THEN updated_at ELSE now() END
WHERE agent_key = $1 AND owner = $2 AND epoch = $3
"#;

/// Read a session's lease and its owner's liveness; never writes.
const LOOKUP_SQL: &str = r#"
SELECT l.owner, l.epoch, l.released, n.peer_addr,
       (extract(epoch FROM n.expires_at - now()) * 1000)::bigint AS remaining_ms
FROM agent_leases l LEFT JOIN agent_nodes n ON n.owner = l.owner
WHERE l.agent_key = $1
"#;

/// Every session attached to one boot (live as long as that boot's node row is).
const HELD_SQL: &str = r#"
SELECT agent_key, epoch FROM agent_leases WHERE owner = $1 AND NOT released
ORDER BY agent_key
"#;

/// Live sessions per node id, for the given node ids (operator: status and
/// pod-deletion-cost). One statement.
const LIVE_BY_NODE_SQL: &str = r#"
SELECT n.node_id, count(*) AS leases
FROM agent_leases l JOIN agent_nodes n ON n.owner = l.owner
WHERE NOT l.released AND n.expires_at > now() AND n.node_id = ANY($1)
GROUP BY n.node_id
"#;

/// What a claim did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Case 1: there was no lease; we hold its first epoch (1, or one above the epoch
    /// floor once retention has deleted sessions).
    Claimed { epoch: Epoch },
    /// Case 2: we already held it; epoch unchanged.
    Extended { epoch: Epoch },
    /// Case 3: the previous lease was not live; we hold the next epoch.
    TookOver { epoch: Epoch },
    /// Case 4: another live owner holds it.
    Held(Holder),
}

impl Claim {
    /// The epoch we now hold, if the claim made (or kept) us owner.
    pub fn owned_epoch(&self) -> Option<Epoch> {
        match self {
            Claim::Claimed { epoch } | Claim::Extended { epoch } | Claim::TookOver { epoch } => Some(*epoch),
            Claim::Held(_) => None,
        }
    }
}

/// The live holder of a session that is not ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub owner: Owner,
    pub epoch: Epoch,
    /// `host:port` of the holder's peer listener.
    pub peer_addr: String,
    /// Time left on the holder's node lease, on the database clock.
    pub remaining: Duration,
}

/// A read of one session's lease (`GET /v1/sessions/{key}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    /// The live holder, if any.
    pub holder: Option<Holder>,
    /// The latest epoch granted for this key, live or not.
    pub epoch: Option<Epoch>,
}

impl LeaseInfo {
    pub fn claimable(&self) -> bool {
        self.holder.is_none()
    }
}

fn parse_owner(raw: String) -> Result<Owner> {
    Owner::parse(&raw).ok_or_else(|| Error::Database {
        context: "parse owner column",
        source: sqlx::Error::Decode(format!("malformed owner {raw:?}").into()),
    })
}

/// Run the claim statement once. `Ok(None)` is the empty answer: re-run it.
pub async fn claim_once<'e>(
    exec: impl PgExecutor<'e>,
    key: &SessionKey,
    owner: &Owner,
) -> Result<Option<Claim>> {
    let row = sqlx::query(CLAIM_SQL)
        .bind(key.as_str())
        .bind(owner.as_str())
        .fetch_one(exec)
        .await
        .map_err(db("claim"))?;
    if !row.get::<bool, _>("me_live") {
        return Err(Error::NodeNotLive { owner: owner.clone() });
    }
    if let Some(epoch) = row.get::<Option<i64>, _>("won_epoch") {
        let epoch = Epoch(epoch);
        let claim = match (row.get::<bool, _>("acquired"), row.get::<bool, _>("inserted")) {
            (false, _) => Claim::Extended { epoch },
            (true, true) => Claim::Claimed { epoch },
            (true, false) => Claim::TookOver { epoch },
        };
        return Ok(Some(claim));
    }
    match row.get::<Option<String>, _>("holder_owner") {
        Some(holder) => Ok(Some(Claim::Held(Holder {
            owner: parse_owner(holder)?,
            epoch: Epoch(row.get("holder_epoch")),
            peer_addr: row.get("peer_addr"),
            remaining: remaining(row.get("remaining_ms")),
        }))),
        None => Ok(None),
    }
}

impl LeaseStore {
    /// Claim `key` for `owner` (CONTRACT §7). Errors with `NodeNotLive` when the caller's
    /// own node lease is gone: it must register a new boot before claiming again.
    pub async fn claim(&self, key: &SessionKey, owner: &Owner) -> Result<Claim> {
        bounded(&self.observer, "claim", async {
            for _ in 0..CLAIM_ATTEMPTS {
                if let Some(claim) = claim_once(&self.pool, key, owner).await? {
                    return Ok(claim);
                }
            }
            Err(Error::ClaimUnsettled { key: key.clone(), attempts: CLAIM_ATTEMPTS })
        })
        .await
    }

    /// Release one idle session (again: idempotent). Returns false when the lease was
    /// no longer ours at that epoch (nothing changed).
    pub async fn release(&self, key: &SessionKey, owner: &Owner, epoch: Epoch) -> Result<bool> {
        let query = sqlx::query(RELEASE_SQL).bind(key.as_str()).bind(owner.as_str()).bind(epoch.0);
        let done = bounded(&self.observer, "release", async {
            query.execute(&self.pool).await.map_err(db("release"))
        })
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Read a session's lease; never claims.
    pub async fn lookup(&self, key: &SessionKey) -> Result<LeaseInfo> {
        let query = sqlx::query(LOOKUP_SQL).bind(key.as_str());
        let row = bounded(&self.observer, "lookup", async {
            query.fetch_optional(&self.pool).await.map_err(db("lookup"))
        })
        .await?;
        let Some(row) = row else {
            return Ok(LeaseInfo { holder: None, epoch: None });
        };
        let epoch = Epoch(row.get("epoch"));
        let remaining_ms: Option<i64> = row.get("remaining_ms");
        let live = !row.get::<bool, _>("released") && remaining_ms.is_some_and(|ms| ms > 0);
        let holder = if live {
            Some(Holder {
                owner: parse_owner(row.get("owner"))?,
                epoch,
                peer_addr: row.get("peer_addr"),
                remaining: remaining(remaining_ms.unwrap_or(0)),
            })
        } else {
            None
        };
        Ok(LeaseInfo { holder, epoch: Some(epoch) })
    }

    /// Live sessions held by each of `node_ids` (nodes holding none are absent).
    pub async fn live_leases_by_node(
        &self,
        node_ids: &[String],
    ) -> Result<std::collections::HashMap<String, i64>> {
        let query = sqlx::query(LIVE_BY_NODE_SQL).bind(node_ids);
        let rows = self
            .observer
            .time("count leases by node", async {
                query.fetch_all(&self.pool).await.map_err(db("count leases by node"))
            })
            .await?;
        Ok(rows.into_iter().map(|row| (row.get("node_id"), row.get("leases"))).collect())
    }

    /// Every session attached to `owner` that it has not released. They are live
    /// exactly as long as the owner's node lease is.
    pub async fn held(&self, owner: &Owner) -> Result<Vec<(SessionKey, Epoch)>> {
        let query = sqlx::query(HELD_SQL).bind(owner.as_str());
        let rows = self
            .observer
            .time("held", async { query.fetch_all(&self.pool).await.map_err(db("held")) })
            .await?;
        rows.into_iter()
            .map(|row| {
                let key: String = row.get("agent_key");
                let key = SessionKey::parse(&key).map_err(|e| Error::Database {
                    context: "parse agent_key column",
                    source: sqlx::Error::Decode(Box::new(e)),
                })?;
                Ok((key, Epoch(row.get("epoch"))))
            })
            .collect()
    }
}
