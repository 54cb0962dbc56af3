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

    /// Admit a turn unless the node is draining. The turn is counted *before* the flag is
    /// read, so a drain that sets the flag and then waits for the count to reach zero
    /// either sees this turn (and waits for it) or this turn sees the flag (and is
    /// refused): never a turn that starts after the drain stopped waiting.
    pub fn admit(self: &Arc<Self>, draining: &watch::Receiver<bool>) -> Option<InFlightGuard> {
        let guard = self.enter();
        (!*draining.borrow()).then_some(guard)
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
    async fn a_draining_node_admits_nothing_and_leaks_no_count() {
        let inflight = InFlight::new(Arc::new(Metrics::new()));
        let (flag, draining) = watch::channel(false);
        let admitted = inflight.admit(&draining).expect("not draining");
        flag.send_replace(true);
        assert!(inflight.admit(&draining).is_none());
        assert_eq!(inflight.count(), 1, "only the admitted turn counts");
        drop(admitted);
        assert_eq!(inflight.count(), 0);
    }

    /// The drain's order (set the flag, then wait for zero) against turns admitted from
    /// other threads: no turn may be admitted once the drain has stopped waiting.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn no_turn_is_admitted_after_a_drain_stopped_waiting() {
        use std::sync::atomic::{AtomicBool, Ordering};
        for _ in 0..200 {
            let inflight = InFlight::new(Arc::new(Metrics::new()));
            let (flag, draining) = watch::channel(false);
            let drained = Arc::new(AtomicBool::new(false));
            let turns: Vec<_> = (0..3)
                .map(|_| {
                    let (inflight, draining, drained) = (inflight.clone(), draining.clone(), drained.clone());
                    tokio::spawn(async move {
                        for _ in 0..200 {
                            if let Some(guard) = inflight.admit(&draining) {
                                assert!(!drained.load(Ordering::SeqCst), "admitted after the drain");
                                tokio::task::yield_now().await;
                                drop(guard);
                            }
                        }
                    })
                })
                .collect();
            tokio::task::yield_now().await;
            flag.send_replace(true);
            assert!(inflight.wait_idle(Duration::from_secs(5)).await);
            drained.store(true, Ordering::SeqCst);
            for turn in turns {
                turn.await.unwrap();
            }
        }
    }

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
