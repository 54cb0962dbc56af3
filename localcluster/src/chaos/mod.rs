//! The randomized fault run (`make chaos`; a short one in `make test`): real sidecars and
//! demo agents on loopback with a private Postgres; sessions of sequential turns from
//! clients that obey retry directives and never re-send a request that may have been
//! received; a seeded schedule of faults; afterwards, every session's history checked
//! against what its client was told.
//!
//! - [`schedule`]: the seeded list of faults (pure).
//! - [`testbed`]: the cluster with the handles faults need (private store, store links).
//! - [`store_link`]: a node's cuttable link to the store, which can cut mid-write.
//! - [`inject`]: doing one fault, and undoing it.
//! - [`driver`]: one session's client; [`record`]: what it logs.
//! - [`checker`]: histories and logs to anomalies (pure).
//! - [`report`]: the counts and the table a run prints.
//! - [`run`]: all of it, in order.
//!
//! # Running it
//!
//! `make chaos` runs `leasehold-chaos --faults 1000 --sessions 8` (about 45 minutes on two
//! cores); `cargo test -p leasehold-localcluster --test chaos` runs 32 faults with 6
//! sessions (about 90 s). Both print the seed first; `--seed N` (the binary) or
//! `LEASEHOLD_CHAOS_SEED=N` (the test) replays the same schedule. The schedule is
//! reproducible, the interleaving of real processes is not: a replay re-creates the
//! faults, and usually the conditions, of a failing run. `--kinds a,b` draws from some
//! kinds only, `--max-think 0ms` makes turns all store writes, `--keep-logs` keeps every
//! process's log (kept anyway on an anomaly, in `$TMPDIR/leasehold-chaos-<seed>-<pid>`).
//! The peer partition needs root (iptables); without it that kind is left out and the
//! report says so.
//!
//! # Reading the report
//!
//! Faults by kind (and any that could not be done as planned); turns by final outcome:
//! acknowledged (`200`), ambiguous (may have run: a timeout or broken connection after
//! sending, `502 owner_failed`, or still in flight at the end), refused (a directive's
//! budget ran out, or no node accepted a connection), unexpected (an answer the contract
//! does not allow); directives obeyed by code; then the anomalies ([`Anomaly`]), which
//! must be none. The binary exits 1 on any anomaly, 2 when the run itself failed.
//!
//! # What it can and cannot catch
//!
//! The checker only sees what reaches a history or a client, so a defect shows only when
//! it gets past every other defence. Measured by re-introducing defects into a scratch
//! copy of the store's statements (short runs, 32 faults): with the checkpoint fence gone
//! (neither the lease nor the epoch check), a write held by a `store_partition_mid_write`
//! lands after a takeover and acknowledged turns go `missing`, in every run tried. With
//! only the lease check gone, or with the claim's old takeover condition (`NOT EXISTS` a
//! live node row), runs stay clean: the epoch check and the owner stepping back before its
//! node lease can lapse cover the first, and the fence covers the second (its race needs a
//! node row committed inside another claim's snapshot; the store's stress test catches
//! it). A random cut rarely lands on a checkpoint write (a demo-agent turn spends most of
//! its store time on fenced publishes), hence the mid-write kind; and the demo agent
//! rewrites a clobbered checkpoint at its next turn while it still holds the session, so
//! a lost write shows only if the session moves before that.

pub mod checker;
pub mod driver;
pub mod inject;
pub mod record;
pub mod report;
pub mod run;
pub mod schedule;
pub mod store_link;
pub mod testbed;

pub use checker::{check, Anomaly};
pub use report::Report;
pub use run::{run, ChaosOptions, NO_FENCE_FAILPOINT};
pub use schedule::FaultKind;
