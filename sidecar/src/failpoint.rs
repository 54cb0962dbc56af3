//! Failpoints for the fault tests: a process pauses itself at an exact point, which no
//! signal sent from outside can hit. Off unless the environment names them; each fires
//! once per process.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    OnceLock,
};

use leasehold_core::SessionKey;

/// `LEASEHOLD_FAILPOINT_STOP_BEFORE_JOURNAL=<key>`: the process sends itself SIGSTOP the
/// first time a batch of published events holding one of that session's is about to be
/// journaled (the events are numbered and accepted, not yet fenced or fanned out).
const STOP_BEFORE_JOURNAL: &str = "LEASEHOLD_FAILPOINT_STOP_BEFORE_JOURNAL";
/// `LEASEHOLD_FAILPOINT_STOP_AFTER_JOURNAL=<key>`: the same, once such a batch is
/// journaled and before it is fanned out to any observer.
const STOP_AFTER_JOURNAL: &str = "LEASEHOLD_FAILPOINT_STOP_AFTER_JOURNAL";

/// Stop this process (SIGSTOP) if the failpoint names one of `keys` and has not fired yet.
pub fn stop_before_journal<'k>(keys: impl Iterator<Item = &'k SessionKey>) {
    static TARGET: OnceLock<Option<String>> = OnceLock::new();
    static FIRED: AtomicBool = AtomicBool::new(false);
    stop_at(STOP_BEFORE_JOURNAL, &TARGET, &FIRED, keys);
}

/// Stop this process (SIGSTOP) if the failpoint names one of `keys` and has not fired yet.
pub fn stop_after_journal<'k>(keys: impl Iterator<Item = &'k SessionKey>) {
    static TARGET: OnceLock<Option<String>> = OnceLock::new();
    static FIRED: AtomicBool = AtomicBool::new(false);
    stop_at(STOP_AFTER_JOURNAL, &TARGET, &FIRED, keys);
}

fn stop_at<'k>(
    name: &str,
    target: &OnceLock<Option<String>>,
    fired: &AtomicBool,
    mut keys: impl Iterator<Item = &'k SessionKey>,
) {
    let Some(target) = target.get_or_init(|| std::env::var(name).ok()) else { return };
    if keys.any(|key| key.as_str() == target) && !fired.swap(true, Ordering::SeqCst) {
        tracing::warn!(key = %target, failpoint = name, "failpoint: stopping");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
    }
}
