//! Following a container's log from its start, and reading the sidecar's drain lines.
//!
//! The sidecar logs `draining` when a drain starts and `drained report=DrainReport {..}`
//! when every lease has been handed back (`sidecar/src/drain.rs`); on SIGTERM/SIGINT it
//! runs the (idempotent) drain and logs `shutting down report=..` (`sidecar/src/main.rs`,
//! `runtime.rs`).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::{AsyncBufReadExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::{api::LogParams, Api};
use tokio::sync::watch;

/// A container's log, collected line by line from the container's start until it exits.
#[derive(Debug, Clone)]
pub struct LogFollower {
    pub pod: String,
    pub container: String,
    lines: Arc<Mutex<Vec<String>>>,
    /// Set once the API server has opened the log stream.
    attached: watch::Receiver<bool>,
    ended: watch::Receiver<bool>,
}

impl LogFollower {
    pub fn start(api: Api<Pod>, pod: &str, container: &str) -> LogFollower {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (ended_tx, ended) = watch::channel(false);
        let (attached_tx, attached) = watch::channel(false);
        let (pod_name, container_name) = (pod.to_owned(), container.to_owned());
        tokio::spawn({
            let lines = lines.clone();
            async move {
                let params =
                    LogParams { container: Some(container_name), follow: true, ..LogParams::default() };
                match api.log_stream(&pod_name, &params).await {
                    Ok(stream) => {
                        attached_tx.send_replace(true);
                        let mut stream = stream.lines();
                        while let Some(line) = stream.next().await {
                            match line {
                                Ok(line) => lines.lock().expect("log lock").push(line),
                                Err(e) => {
                                    lines
                                        .lock()
                                        .expect("log lock")
                                        .push(format!("<<log stream broke: {e}>>"));
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => lines.lock().expect("log lock").push(format!("<<cannot follow the log: {e}>>")),
                }
                ended_tx.send_replace(true);
            }
        });
        LogFollower { pod: pod.to_owned(), container: container.to_owned(), lines, attached, ended }
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().expect("log lock").clone()
    }

    /// Wait until the log stream is open (from the container's start, so no line before
    /// this is missed, and the container may now exit) or `timeout` passes. False also
    /// when the stream could not be opened.
    pub async fn attached(&self, timeout: Duration) -> bool {
        let mut attached = self.attached.clone();
        let mut ended = self.ended.clone();
        tokio::select! {
            opened = tokio::time::timeout(timeout, attached.wait_for(|a| *a)) => opened.is_ok_and(|r| r.is_ok()),
            // Ended without opening (the stream could not be opened): not attached.
            _ = ended.wait_for(|e| *e) => *self.attached.borrow(),
        }
    }

    /// Wait until the log ends (the container exited) or `timeout` passes.
    pub async fn ended(&self, timeout: Duration) -> bool {
        let mut ended = self.ended.clone();
        tokio::time::timeout(timeout, ended.wait_for(|e| *e)).await.is_ok_and(|r| r.is_ok())
    }
}

/// What the drain reported, from the `drained` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drained {
    pub handed_back: u64,
    pub in_flight_finished: u64,
    pub in_flight_stood_down: u64,
}

fn field(line: &str, name: &str) -> Option<u64> {
    let start = line.find(&format!("{name}: "))? + name.len() + 2;
    let digits: String = line[start..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The message of a tracing line (`<ts>  INFO target: message fields`), for matching.
fn is_event(line: &str, message: &str) -> bool {
    line.contains(&format!(": {message} ")) || line.ends_with(&format!(": {message}"))
}

/// Check a sidecar log: the `drained` line is present and comes before any
/// `shutting down` line (the process got its SIGTERM only after handing every lease
/// back), and nothing logged a drain timeout.
pub fn drained_before_shutdown(lines: &[String]) -> Result<Drained, String> {
    let drained = lines.iter().position(|l| is_event(l, "drained"));
    let shutting_down = lines.iter().position(|l| is_event(l, "shutting down"));
    let Some(drained) = drained else {
        return Err("no `drained` line".into());
    };
    if let Some(shutdown) = shutting_down {
        if shutdown < drained {
            return Err(format!("`shutting down` (line {shutdown}) before `drained` (line {drained})"));
        }
    }
    if let Some(timeout) = lines.iter().find(|l| l.contains("drain timeout")) {
        return Err(format!("the drain timed out: {timeout}"));
    }
    let line = &lines[drained];
    let report = || -> Option<Drained> {
        Some(Drained {
            handed_back: field(line, "handed_back")?,
            in_flight_finished: field(line, "in_flight_finished")?,
            in_flight_stood_down: field(line, "in_flight_stood_down")?,
        })
    };
    report().ok_or_else(|| format!("cannot read the drain report of {line:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(raw: &[&str]) -> Vec<String> {
        raw.iter().map(|s| s.to_string()).collect()
    }

    const DRAINING: &str = "2026-01-01T00:00:01.000000Z  INFO leasehold_sidecar::drain: draining in_flight=2";
    const DRAINED: &str = "2026-01-01T00:00:01.300000Z  INFO leasehold_sidecar::drain: drained \
        report=DrainReport { handed_back: 7, in_flight_finished: 2, in_flight_stood_down: 0 }";
    const SHUTDOWN: &str = "2026-01-01T00:00:02.000000Z  INFO leasehold_sidecar: shutting down \
        report=DrainReport { handed_back: 7, in_flight_finished: 2, in_flight_stood_down: 0 }";

    #[test]
    fn drained_then_shutdown_passes_with_the_report() {
        let report =
            drained_before_shutdown(&lines(&["ready to serve", DRAINING, DRAINED, SHUTDOWN])).unwrap();
        assert_eq!(report, Drained { handed_back: 7, in_flight_finished: 2, in_flight_stood_down: 0 });
    }

    #[test]
    fn missing_or_late_drain_fails() {
        assert!(drained_before_shutdown(&lines(&[DRAINING, SHUTDOWN])).is_err());
        assert!(drained_before_shutdown(&lines(&[SHUTDOWN, DRAINED])).is_err());
        let timed_out =
            "2026-01-01T00:00:01Z  WARN leasehold_sidecar::drain: drain timeout: standing the rest down";
        assert!(drained_before_shutdown(&lines(&[DRAINING, timed_out, DRAINED])).is_err());
    }

    #[test]
    fn draining_is_not_drained() {
        assert!(!is_event(DRAINING, "drained"));
        assert!(is_event(DRAINED, "drained"));
    }
}
