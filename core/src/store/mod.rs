//! The lease store: session ownership and fenced checkpoints in Postgres (CONTRACT §7).
//!
//! Every operation is ONE SQL statement evaluated on the database clock (`now()`); no pod
//! clock takes part in an ownership decision. Liveness is per process (`agent_nodes`), so
//! the heartbeat costs one row whatever the number of sessions held.

pub mod checkpoints;
pub mod journal;
pub mod leases;
pub mod liveness;
pub mod nodes;
pub mod notify;
pub mod observe;
mod refusal;
pub mod retention;

use std::time::Duration;

use sqlx::{
    postgres::{PgConnectOptions, PgPoolOptions},
    PgPool,
};

use self::observe::Observer;
pub use self::{
    checkpoints::{Checkpoint, FenceHold},
    journal::{Answer, Append, Begun, JournalEvent, NewTurn, TurnKind, TurnRecord, TurnState},
    leases::{Claim, Holder, LeaseInfo},
    nodes::NodeLease,
    observe::{StatementObserver, StatementOutcome},
};
use crate::{Epoch, Owner, SessionKey};

/// The schema, embedded at compile time (`build.rs` re-runs on change).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// How long a pooled connection attempt may take before the store is reported unreachable:
/// short, so a turn gets `store_unavailable` quickly instead of hanging on a dead database.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Longest a statement of the request path may run before the store counts as
/// unreachable: a partition leaves a query hanging, not failing, and a turn must get
/// `store_unavailable` (with its directive) rather than wait on it. Generous for a
/// healthy database (statements here are single-row, indexed).
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections per sidecar: claims, fenced writes and the heartbeat run concurrently.
pub const DEFAULT_POOL_SIZE: u32 = 16;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The write was rejected by the fence: the lease no longer carries this owner and
    /// epoch, or a newer epoch already checkpointed.
    #[error("write to session {key} at epoch {epoch} was fenced")]
    Fenced { key: SessionKey, epoch: Epoch },

    /// The caller's own node lease has expired (or was revoked): it may not claim.
    #[error("node lease of {owner} is not live")]
    NodeNotLive { owner: Owner },

    /// A claim kept finding neither a winner nor a holder (pathological churn).
    #[error("claim of session {key} did not settle after {attempts} attempts")]
    ClaimUnsettled { key: SessionKey, attempts: u32 },

    /// Its text ends with a hint when the cause is a TLS setting (see `refusal`).
    #[error("lease store: {context} failed{}", refusal::suffix(source))]
    Database {
        context: &'static str,
        #[source]
        source: sqlx::Error,
    },

    /// No answer within [`STATEMENT_TIMEOUT`]: the statement may still run (and is fenced
    /// like any other if it lands late).
    #[error("lease store: {context} did not answer within {STATEMENT_TIMEOUT:?}")]
    Timeout { context: &'static str },

    #[error("applying migrations failed{}", refusal::migrate_suffix(.0))]
    Migrate(#[source] sqlx::migrate::MigrateError),
}

impl Error {
    /// True when the store itself is unreachable or failing, as opposed to a definite
    /// answer (fenced, not live). Callers map this to `store_unavailable`.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Database { .. } | Error::ClaimUnsettled { .. } | Error::Timeout { .. })
    }
}

/// Run one store operation within [`STATEMENT_TIMEOUT`], reporting its latency under
/// `context` to the store's observer (if any).
pub(crate) async fn bounded<T>(
    observer: &Observer,
    context: &'static str,
    operation: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    observer
        .time(context, async {
            tokio::time::timeout(STATEMENT_TIMEOUT, operation)
                .await
                .map_err(|_| Error::Timeout { context })?
        })
        .await
}

impl Error {
    /// Whether the write this error answers may have committed all the same: no answer
    /// in time, or a connection lost while the statement may have been on its way (the
    /// server may have run and committed it). `false` when the server refused it, the
    /// pool never handed out a connection, or the fence said no: nothing was written.
    pub fn may_have_landed(&self) -> bool {
        match self {
            Error::Timeout { .. } => true,
            Error::Database { source, .. } => !matches!(
                source,
                sqlx::Error::Database(_)
                    | sqlx::Error::PoolTimedOut
                    | sqlx::Error::PoolClosed
                    | sqlx::Error::Configuration(_)
                    | sqlx::Error::Tls(_)
                    | sqlx::Error::RowNotFound
                    | sqlx::Error::ColumnNotFound(_)
                    | sqlx::Error::ColumnDecode { .. }
                    | sqlx::Error::Decode(_)
            ),
            Error::Fenced { .. }
            | Error::NodeNotLive { .. }
            | Error::ClaimUnsettled { .. }
            | Error::Migrate(_) => false,
        }
    }
}

/// Attach a short description of the statement to a sqlx error.
pub(crate) fn db(context: &'static str) -> impl FnOnce(sqlx::Error) -> Error {
    move |source| Error::Database { context, source }
}

/// Postgres `interval` input for a TTL, with millisecond precision.
pub(crate) fn ttl_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
}

/// Convert a remaining time reported by the database (ms, may be negative) to a Duration.
pub(crate) fn remaining(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// The store's pools: `max_connections` and [`CONNECT_TIMEOUT`]. Every connection is
/// pinged before it is handed out (sqlx's default): skipping the ping for connections
/// used within the last second saved a round trip per statement (issue 20), but after a
/// Postgres restart every such connection then failed its next statement, which a
/// journal write must answer as "may have landed" (`fenced`), and the keyed fault run
/// left a turn ambiguous (seed 14623622560526787520). Correct answers over 0.3 ms.
fn pool_options(max_connections: u32) -> PgPoolOptions {
    PgPoolOptions::new().max_connections(max_connections).acquire_timeout(CONNECT_TIMEOUT)
}

/// Handle to the lease store. Cheap to clone (wraps a connection pool).
#[derive(Debug, Clone)]
pub struct LeaseStore {
    pool: PgPool,
    observer: Observer,
}

impl LeaseStore {
    /// Connect lazily: the sidecar must start (and report `store_unavailable`) even while
    /// the database is down.
    pub fn connect_lazy(database_url: &str, max_connections: u32) -> Result<Self> {
        let options: PgConnectOptions = database_url.parse().map_err(db("parse database url"))?;
        Ok(Self::lazy_with(options, max_connections))
    }

    /// [`LeaseStore::connect_lazy`], with every transaction left idle longer than
    /// `idle_transaction` ended by the server: a frozen process holding a [`FenceHold`]
    /// blocks a takeover of that session for at most this long. A holder frozen past it
    /// is frozen past this much of its node lease too, and must find it not certainly
    /// live before it acts (the sidecar gives its TTL here).
    pub fn connect_lazy_bounding_idle_transactions(
        database_url: &str,
        max_connections: u32,
        idle_transaction: Duration,
    ) -> Result<Self> {
        let options: PgConnectOptions = database_url.parse().map_err(db("parse database url"))?;
        let ms = idle_transaction.as_millis().max(1).to_string();
        Ok(Self::lazy_with(
            options.options([("idle_in_transaction_session_timeout", ms.as_str())]),
            max_connections,
        ))
    }

    fn lazy_with(options: PgConnectOptions, max_connections: u32) -> Self {
        let pool = pool_options(max_connections).connect_lazy_with(options);
        Self { pool, observer: Observer::default() }
    }

    /// The same store, reporting each statement's latency (by its context label, e.g.
    /// `claim`, `put checkpoint`) and outcome to `observer`: the binaries plug their
    /// metrics registry in here. Stores made from this one ([`LeaseStore::dedicated`])
    /// report to it too.
    pub fn observed_by(self, observer: std::sync::Arc<dyn StatementObserver>) -> Self {
        Self { observer: Observer::new(observer), ..self }
    }

    /// A store on the same database with `max_connections` connections of its own, for
    /// work that must never wait behind request traffic (the heartbeat): a pool whose
    /// every connection is busy with requests cannot starve it.
    pub fn dedicated(&self, max_connections: u32) -> Self {
        let options = self.pool.connect_options().as_ref().clone();
        let pool = pool_options(max_connections).connect_lazy_with(options);
        Self { pool, observer: self.observer.clone() }
    }

    /// Connect now, failing fast when the database is unreachable (`migrate`).
    pub async fn connect(database_url: &str, max_connections: u32) -> Result<Self> {
        let pool = pool_options(max_connections).connect(database_url).await.map_err(db("connect"))?;
        Ok(Self { pool, observer: Observer::default() })
    }

    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool, observer: Observer::default() }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Apply the embedded migrations. Safe to run twice and from several processes at
    /// once: sqlx serialises concurrent runs with a Postgres advisory lock.
    pub async fn migrate(&self) -> Result<()> {
        MIGRATOR.run(&self.pool).await.map_err(Error::Migrate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_lost_answer_or_a_timeout_may_have_landed() {
        let io = || sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(Error::Timeout { context: "begin turn" }.may_have_landed());
        assert!(Error::Database { context: "begin turn", source: io() }.may_have_landed());
        assert!(Error::Database { context: "begin turn", source: sqlx::Error::Protocol("eof".into()) }
            .may_have_landed());
        assert!(
            !Error::Database { context: "begin turn", source: sqlx::Error::PoolTimedOut }.may_have_landed()
        );
        assert!(!Error::Database { context: "begin turn", source: sqlx::Error::PoolClosed }.may_have_landed());
        let key = SessionKey::parse("k").expect("a key");
        assert!(!Error::Fenced { key, epoch: Epoch(1) }.may_have_landed());
    }
}
