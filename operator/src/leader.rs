//! Leader election on a `coordination.k8s.io` Lease: two operator replicas never both act.
//! The holder renews every `RENEW`; a lease not renewed for `LEASE_DURATION` may be taken.

use std::time::Duration;

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
        let expired = spec.renew_time.as_ref().is_none_or(|t| {
            let age = jiff::Timestamp::now().duration_since(t.0);
            let duration =
                spec.lease_duration_seconds.map_or(LEASE_DURATION, |s| Duration::from_secs(s.max(0) as u64));
            age.unsigned_abs() > duration
        });
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
