//! Leader election on a `coordination.k8s.io` Lease: two operator replicas never both act.
//! The holder renews every `RENEW`; a lease whose record has not changed for
//! `LEASE_DURATION`, measured on this replica's own monotonic clock from when it last saw
//! the record change (client-go's rule: wall clocks of two pods are never compared), may
//! be taken. A leader that stops releases the lease, so another takes over at once.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::time::Instant;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{api::PostParams, Api};

use crate::error::{kube, Result};

/// How long a leader's claim lasts without renewal (the failover time of the operator).
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// Renew well within the duration, so one slow API call does not lose leadership.
pub const RENEW: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct LeaderElection {
    pub api: Api<Lease>,
    pub name: String,
    pub identity: String,
    /// The lease record last seen and when it was first seen so (this replica's clock).
    pub observed: Arc<Mutex<Option<(Observed, Instant)>>>,
}

/// What of a lease record shows its holder is alive: any change of it is a renewal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    holder: Option<String>,
    renew_time: Option<String>,
    transitions: Option<i32>,
}

impl LeaderElection {
    pub fn new(api: Api<Lease>, name: String, identity: String) -> Self {
        LeaderElection { api, name, identity, observed: Arc::default() }
    }

    /// Whether the holder of `spec` has not renewed for its duration, by our clock: the
    /// time since the record last changed, as we saw it.
    fn lapsed(&self, spec: &LeaseSpec) -> bool {
        let record = Observed {
            holder: spec.holder_identity.clone().filter(|h| !h.is_empty()),
            renew_time: spec.renew_time.as_ref().map(|t| t.0.to_string()),
            transitions: spec.lease_transitions,
        };
        if record.holder.is_none() {
            return true; // released
        }
        let duration =
            spec.lease_duration_seconds.map_or(LEASE_DURATION, |s| Duration::from_secs(s.max(0) as u64));
        let mut observed = self.observed.lock().expect("leader observation lock");
        match observed.as_ref() {
            Some((seen, since)) if *seen == record => since.elapsed() > duration,
            _ => {
                *observed = Some((record, Instant::now()));
                false
            }
        }
    }
}

fn now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

impl LeaderElection {
    /// One attempt: true if we hold the lease afterwards.
    pub async fn try_acquire_or_renew(&self) -> Result<bool> {
        let Some(mut lease) = self.api.get_opt(&self.name).await.map_err(kube("get leader lease"))? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() },
                spec: Some(self.spec(now(), 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(kube("create leader lease")(e)),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let ours = spec.holder_identity.as_deref() == Some(&self.identity);
        let expired = self.lapsed(&spec);
        if !ours && !expired {
            return Ok(false);
        }
        let (acquired, transitions) = if ours {
            (spec.acquire_time.clone().unwrap_or_else(now), spec.lease_transitions.unwrap_or(0))
        } else {
            (now(), spec.lease_transitions.unwrap_or(0) + 1)
        };
        lease.spec = Some(LeaseSpec { acquire_time: Some(acquired), ..self.spec(now(), transitions) });
        // The resourceVersion makes this a compare-and-swap: a racing candidate gets 409.
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(kube("renew leader lease")(e)),
        }
    }

    fn spec(&self, time: MicroTime, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(LEASE_DURATION.as_secs() as i32),
            acquire_time: Some(time.clone()),
            renew_time: Some(time),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    /// Give the lease up (the process is stopping): another replica takes over at its
    /// next attempt instead of waiting out the duration. Only while we still hold it.
    pub async fn release(&self) -> Result<()> {
        let Some(mut lease) = self.api.get_opt(&self.name).await.map_err(kube("get leader lease"))? else {
            return Ok(());
        };
        let spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(&self.identity) {
            return Ok(());
        }
        lease.spec = Some(LeaseSpec { holder_identity: None, lease_duration_seconds: Some(1), ..spec });
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => {
                tracing::info!(identity = %self.identity, "released the leader lease");
                Ok(())
            }
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()), // someone else took it meanwhile
            Err(e) => Err(kube("release leader lease")(e)),
        }
    }

    /// Wait until we lead.
    pub async fn acquire(&self) {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => return tracing::info!(identity = %self.identity, "became leader"),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election attempt failed"),
            }
            tokio::time::sleep(RENEW).await;
        }
    }

    /// Keep renewing; returns when leadership is lost (the process must stop acting).
    pub async fn hold(&self) {
        let mut last_renewal = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(RENEW).await;
            match self.try_acquire_or_renew().await {
                Ok(true) => last_renewal = tokio::time::Instant::now(),
                Ok(false) => return tracing::error!("leadership taken by another replica"),
                Err(e) => tracing::warn!(error = %e, "leader lease renewal failed"),
            }
            if last_renewal.elapsed() >= LEASE_DURATION {
                return tracing::error!("could not renew the leader lease in time");
            }
        }
    }
}
