//! Failpoints for the fault tests: a process pauses itself at an exact point, which no
//! signal sent from outside can hit. Off unless the environment names them; each fires
//! once per process.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    OnceLock,
};

use leasehold_core::SessionKey;

/// `LEASEHOLD_FAILPOINT_STOP_AFTER_FENCE=<key>`: the process sends itself SIGSTOP the first
/// time it holds the fence for a publish of that session, before it publishes.
const STOP_AFTER_FENCE: &str = "LEASEHOLD_FAILPOINT_STOP_AFTER_FENCE";

/// Stop this process (SIGSTOP) if the failpoint names `key` and has not fired yet.
pub fn stop_after_fence(key: &SessionKey) {
    static TARGET: OnceLock<Option<String>> = OnceLock::new();
    static FIRED: AtomicBool = AtomicBool::new(false);
    let target = TARGET.get_or_init(|| std::env::var(STOP_AFTER_FENCE).ok());
    if target.as_deref() == Some(key.as_str()) && !FIRED.swap(true, Ordering::SeqCst) {
        tracing::warn!(%key, "failpoint: stopping after the fence check");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
    }
}
