//! The observer hook of the store's one door: every statement reports its latency and
//! outcome, named by its context label, to whatever the binary plugs in (its metrics
//! registry). Keeps this crate free of any metrics library.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use tokio::time::Instant;

use super::{Error, Result};

/// How a statement ended, as far as the store's health goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatementOutcome {
    /// It answered: a row, none, or a definite refusal (fenced, node not live).
    Ok,
    /// The database failed it (connection lost, pool exhausted, SQL error).
    Error,
    /// No answer within the statement timeout.
    Timeout,
}

impl StatementOutcome {
    pub fn of<T>(result: &Result<T>) -> Self {
        match result {
            Ok(_) => Self::Ok,
            Err(Error::Timeout { .. }) => Self::Timeout,
            Err(e) if e.is_unavailable() || matches!(e, Error::Migrate(_)) => Self::Error,
            Err(_) => Self::Ok,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Error => "error",
            Self::Timeout => "timeout",
        }
    }
}

/// Told of every statement the store runs, after it ends.
pub trait StatementObserver: Send + Sync + fmt::Debug {
    /// `statement` is the statement's context label (`claim`, `renew node lease`, ...).
    fn statement(&self, statement: &'static str, elapsed: Duration, outcome: StatementOutcome);
}

/// The store's observer, if one was plugged in.
#[derive(Debug, Clone, Default)]
pub(crate) struct Observer(Option<Arc<dyn StatementObserver>>);

impl Observer {
    pub(crate) fn new(observer: Arc<dyn StatementObserver>) -> Self {
        Self(Some(observer))
    }

    /// Run `operation`, then report how long it took and how it ended.
    pub(crate) async fn time<T>(
        &self,
        statement: &'static str,
        operation: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let Some(observer) = &self.0 else {
            return operation.await;
        };
        let started = Instant::now();
        let result = operation.await;
        observer.statement(statement, started.elapsed(), StatementOutcome::of(&result));
        result
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::store::{bounded, STATEMENT_TIMEOUT};

    #[derive(Debug, Default)]
    struct Recorded(Mutex<Vec<(&'static str, Duration, StatementOutcome)>>);

    impl StatementObserver for Recorded {
        fn statement(&self, statement: &'static str, elapsed: Duration, outcome: StatementOutcome) {
            self.0.lock().unwrap().push((statement, elapsed, outcome));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_door_reports_each_statement_with_its_latency_and_outcome() {
        let recorded = Arc::new(Recorded::default());
        let observer = Observer::new(recorded.clone());
        let ok = bounded(&observer, "claim", async {
            tokio::time::sleep(Duration::from_millis(40)).await;
            Ok(1)
        })
        .await;
        assert_eq!(ok.unwrap(), 1);
        let failed: Result<()> = bounded(&observer, "lookup", async {
            Err(Error::Database { context: "lookup", source: sqlx::Error::PoolTimedOut })
        })
        .await;
        assert!(failed.is_err());
        let hung: Result<()> = bounded(&observer, "put checkpoint", std::future::pending()).await;
        assert!(matches!(hung, Err(Error::Timeout { context: "put checkpoint" })));
        let fenced: Result<()> = bounded(&observer, "check fence", async {
            Err(Error::Fenced { key: crate::SessionKey::parse("s").unwrap(), epoch: crate::Epoch(1) })
        })
        .await;
        assert!(fenced.is_err());

        let got = recorded.0.lock().unwrap().clone();
        let names: Vec<_> = got.iter().map(|(s, _, o)| (*s, *o)).collect();
        assert_eq!(
            names,
            [
                ("claim", StatementOutcome::Ok),
                ("lookup", StatementOutcome::Error),
                ("put checkpoint", StatementOutcome::Timeout),
                ("check fence", StatementOutcome::Ok),
            ]
        );
        assert_eq!(got[0].1, Duration::from_millis(40));
        assert_eq!(got[2].1, STATEMENT_TIMEOUT);
    }

    #[tokio::test]
    async fn without_an_observer_the_door_only_bounds() {
        let none = Observer::default();
        assert_eq!(bounded(&none, "claim", async { Ok(7) }).await.unwrap(), 7);
    }
}
