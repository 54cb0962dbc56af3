//! Checkpoints behind the lease-checked fence.

use sqlx::{PgExecutor, Row};

use super::{bounded, db, observe::Observer, Epoch, Error, LeaseStore, Owner, Result};
use crate::key::SessionKey;

/// The fence (CONTRACT §7). The write lands only if, in this same statement:
/// - the lease row still carries the writer's owner `$2` and epoch `$3` and is not
///   released, read `FOR SHARE` so a concurrent takeover (which updates that row) waits
///   for us, or we re-check against its committed version and change nothing; and
/// - the stored checkpoint's epoch is not ahead of ours.
///
/// Checking the lease and not only the checkpoint row is what rejects a zombie write that
/// arrives after a takeover but before the new owner's first checkpoint.
pub(crate) const PUT_CHECKPOINT_SQL: &str = r#"
WITH lease AS (
    SELECT agent_key FROM agent_leases
    WHERE agent_key = $1 AND owner = $2 AND epoch = $3 AND NOT released
    FOR SHARE
)
INSERT INTO agent_checkpoints AS c (agent_key, epoch, data, updated_at, turn_id)
SELECT agent_key, $3, $4, now(), $5 FROM lease
ON CONFLICT (agent_key) DO UPDATE
SET epoch = EXCLUDED.epoch, data = EXCLUDED.data, updated_at = now(), turn_id = EXCLUDED.turn_id
WHERE c.epoch <= EXCLUDED.epoch
"#;

/// The checkpoint write with the fence gone (no lease check, no epoch check): what
/// `LEASEHOLD_FAILPOINT_NO_FENCE=1` puts in place of [`PUT_CHECKPOINT_SQL`] in a debug
/// build, so the randomized fault run can be shown to catch the defect the fence exists
/// for. `$2` (the owner) is referenced only so that every parameter has a type.
const UNFENCED_PUT_CHECKPOINT_SQL: &str = r#"
INSERT INTO agent_checkpoints AS c (agent_key, epoch, data, updated_at, turn_id)
SELECT $1, $3, $4, now(), $5 WHERE $2::text IS NOT NULL
ON CONFLICT (agent_key) DO UPDATE
SET epoch = EXCLUDED.epoch, data = EXCLUDED.data, updated_at = now(), turn_id = EXCLUDED.turn_id
"#;

/// `LEASEHOLD_FAILPOINT_NO_FENCE=1`: checkpoint writes skip the fence. Honoured only in
/// debug builds (a release build has no way to turn the fence off); a test-only defect.
pub const NO_FENCE_FAILPOINT: &str = "LEASEHOLD_FAILPOINT_NO_FENCE";

/// The checkpoint write's statement: the fenced one, unless the failpoint removed the
/// fence (debug builds only).
fn put_checkpoint_sql() -> &'static str {
    #[cfg(debug_assertions)]
    {
        static UNFENCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let unfenced = *UNFENCED.get_or_init(|| {
            let on = std::env::var(NO_FENCE_FAILPOINT).is_ok_and(|v| v == "1");
            if on {
                tracing::warn!(failpoint = NO_FENCE_FAILPOINT, "failpoint: checkpoint writes are NOT fenced");
            }
            on
        });
        if unfenced {
            return UNFENCED_PUT_CHECKPOINT_SQL;
        }
    }
    PUT_CHECKPOINT_SQL
}

/// The same lease check without a write: the fence for event publishes.
const CHECK_FENCE_SQL: &str = r#"
SELECT 1 FROM agent_leases
WHERE agent_key = $1 AND owner = $2 AND epoch = $3 AND NOT released
"#;

/// The lease check, holding the lease row against a takeover (a claim updates that row,
/// so it waits) until the transaction ends: what a publish does while it holds it cannot
/// be overtaken by another owner's first write.
const HOLD_FENCE_SQL: &str = r#"
SELECT 1 FROM agent_leases
WHERE agent_key = $1 AND owner = $2 AND epoch = $3 AND NOT released
FOR SHARE
"#;

/// A session's lease held at one owner and epoch: no takeover can commit until it is
/// committed or dropped (a dropped hold rolls back). Hold it for as little as possible;
/// the store's connections end a transaction left idle (a frozen holder) after the
/// pool's idle-transaction timeout.
#[derive(Debug)]
pub struct FenceHold {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    observer: Observer,
}

impl FenceHold {
    /// Release the hold.
    pub async fn release(self) -> Result<()> {
        let observer = self.observer;
        bounded(&observer, "release fence", async { self.tx.commit().await.map_err(db("release fence")) })
            .await
    }
}

const GET_CHECKPOINT_SQL: &str = r#"
SELECT epoch, data, turn_id FROM agent_checkpoints WHERE agent_key = $1
"#;

/// A session's latest checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The epoch of the owner that wrote it.
    pub epoch: Epoch,
    pub data: Vec<u8>,
    /// The turn that was running when it was written (`None` between turns).
    pub turn_id: Option<String>,
}

/// Run the fenced checkpoint write on any executor (a pool, or a test's transaction).
pub async fn put_checkpoint<'e>(
    exec: impl PgExecutor<'e>,
    key: &SessionKey,
    owner: &Owner,
    epoch: Epoch,
    data: &[u8],
) -> Result<()> {
    put_turn_checkpoint(exec, key, owner, epoch, None, data).await
}

/// [`put_checkpoint`], recording the turn that was running (`turn_id`).
pub async fn put_turn_checkpoint<'e>(
    exec: impl PgExecutor<'e>,
    key: &SessionKey,
    owner: &Owner,
    epoch: Epoch,
    turn_id: Option<&str>,
    data: &[u8],
) -> Result<()> {
    let done = sqlx::query(put_checkpoint_sql())
        .bind(key.as_str())
        .bind(owner.as_str())
        .bind(epoch.0)
        .bind(data)
        .bind(turn_id)
        .execute(exec)
        .await
        .map_err(db("put checkpoint"))?;
    match done.rows_affected() {
        1 => Ok(()),
        _ => Err(Error::Fenced { key: key.clone(), epoch }),
    }
}

impl LeaseStore {
    /// Write a checkpoint through the fence; `Err(Fenced)` when this owner/epoch no
    /// longer holds the session.
    pub async fn put_checkpoint(
        &self,
        key: &SessionKey,
        owner: &Owner,
        epoch: Epoch,
        data: &[u8],
    ) -> Result<()> {
        self.put_turn_checkpoint(key, owner, epoch, None, data).await
    }

    /// [`LeaseStore::put_checkpoint`], recording the turn that was running.
    pub async fn put_turn_checkpoint(
        &self,
        key: &SessionKey,
        owner: &Owner,
        epoch: Epoch,
        turn_id: Option<&str>,
        data: &[u8],
    ) -> Result<()> {
        bounded(
            &self.observer,
            "put checkpoint",
            put_turn_checkpoint(&self.pool, key, owner, epoch, turn_id, data),
        )
        .await
    }

    /// Check the fence without writing (event publishes); `Err(Fenced)` when stale.
    pub async fn check_fence(&self, key: &SessionKey, owner: &Owner, epoch: Epoch) -> Result<()> {
        let query = sqlx::query(CHECK_FENCE_SQL).bind(key.as_str()).bind(owner.as_str()).bind(epoch.0);
        let row = bounded(&self.observer, "check fence", async {
            query.fetch_optional(&self.pool).await.map_err(db("check fence"))
        })
        .await?;
        row.map(drop).ok_or_else(|| Error::Fenced { key: key.clone(), epoch })
    }

    /// Hold the fence: `Err(Fenced)` when this owner/epoch no longer holds the session,
    /// else a [`FenceHold`] under which no other owner can take the session over.
    pub async fn hold_fence(&self, key: &SessionKey, owner: &Owner, epoch: Epoch) -> Result<FenceHold> {
        bounded(&self.observer, "hold fence", async {
            let mut tx = self.pool.begin().await.map_err(db("hold fence"))?;
            let query = sqlx::query(HOLD_FENCE_SQL).bind(key.as_str()).bind(owner.as_str()).bind(epoch.0);
            match query.fetch_optional(&mut *tx).await.map_err(db("hold fence"))? {
                Some(_) => Ok(FenceHold { tx, observer: self.observer.clone() }),
                None => Err(Error::Fenced { key: key.clone(), epoch }),
            }
        })
        .await
    }

    pub async fn get_checkpoint(&self, key: &SessionKey) -> Result<Option<Checkpoint>> {
        let query = sqlx::query(GET_CHECKPOINT_SQL).bind(key.as_str());
        let row = bounded(&self.observer, "get checkpoint", async {
            query.fetch_optional(&self.pool).await.map_err(db("get checkpoint"))
        })
        .await?;
        Ok(row.map(|row| Checkpoint {
            epoch: Epoch(row.get("epoch")),
            data: row.get("data"),
            turn_id: row.get("turn_id"),
        }))
    }
}
