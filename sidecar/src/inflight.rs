//! Counting turns running on this node's agent, so a drain can wait for them.

use std::{sync::Arc, time::Duration};

use tokio::sync::watch;

use crate::metrics::Metrics;

#[derive(Debug)]
pub struct InFlight {
    count: watch::Sender<usize>,
    metrics: Arc<Metrics>,
}

/// Held for the duration of one turn; dropping it ends the turn.
#[derive(Debug)]
pub struct InFlightGuard {
    owner: Arc<InFlight>,
}

impl InFlight {
    pub fn new(metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(InFlight { count: watch::Sender::new(0), metrics })
    }

    pub fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.count.send_modify(|n| *n += 1);
        self.metrics.set_in_flight(*self.count.borrow());
        InFlightGuard { owner: self.clone() }
    }

    pub fn count(&self) -> usize {
        *self.count.borrow()
    }

    /// Wait until no turn is running, at most `timeout`. True if it got there.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let mut rx = self.count.subscribe();
        let idle = tokio::time::timeout(timeout, rx.wait_for(|n| *n == 0)).await.is_ok();
        idle
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.owner.count.send_modify(|n| *n -= 1);
        self.owner.metrics.set_in_flight(*self.owner.count.borrow());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waits_for_the_last_guard() {
        let inflight = InFlight::new(Arc::new(Metrics::new()));
        let (a, b) = (inflight.enter(), inflight.enter());
        assert_eq!(inflight.count(), 2);
        assert!(!inflight.wait_idle(Duration::from_millis(20)).await);
        drop(a);
        let waiter = tokio::spawn({
            let inflight = inflight.clone();
            async move { inflight.wait_idle(Duration::from_secs(5)).await }
        });
        drop(b);
        assert!(waiter.await.unwrap());
        assert_eq!(inflight.count(), 0);
    }
}
