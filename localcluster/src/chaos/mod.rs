//! The randomized fault run (`make chaos`; a short one in `make test`): real sidecars and
//! demo agents on loopback with a private Postgres; sessions of sequential turns from
//! clients that obey retry directives; a seeded schedule of faults; afterwards, every
//! session's history checked against what its client was told, and the (session, epoch)
//! pairs every agent was sent checked for two nodes at one epoch.
//!
//! # The clients
//!
//! Keyed (the default, `keyed: true`): every turn carries its text as `Idempotency-Key`,
//! so the client re-sends it whatever happened (a lost answer, `502 owner_failed`, a
//! directive past its budget) until it has the turn's answer or [`driver::TURN_DEADLINE`]
//! passes. Every turn should end acknowledged: the binary exits 1, and the short test
//! fails, on any turn left ambiguous or in flight. A keyed turn ends refused only when
//! the deadline passes during directives and nothing of it may have run (no attempt
//! that may have been received, no `fenced`/`agent_unavailable`, which a next owner
//! may resume); the directive's budget is advice the key makes safe to exceed.
//!
//! Unkeyed (`keyed: false`, `--keyed false`): no key, so each attempt is a new turn to
//! the sidecar. The client never re-sends a turn that may have been received (a reset or
//! timeout after sending, a body cut short, `502 owner_failed`, `fenced` or
//! `agent_unavailable`): the turn ends ambiguous. It obeys other directives until their
//! budget, or [`driver::UNKEYED_DIRECTIVE_BUDGET`], would be overrun: the turn ends
//! refused, and the checker verifies it is not in the history (`refused_but_applied`).
//! Ambiguous turns are allowed; anomalies are not.
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
//! keyed sessions (about 90 s) and the checker's self-test (below, about 90 s); the
//! unkeyed run (16 faults, about 70 s) is there too, ignored while it finds a defect
//! (`-- --ignored` runs it). The schedule injects each kind once before drawing kinds at
//! random, so a run of at least 8 faults has every kind. All print the seed first; `--seed N` (the binary) or
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
//! The checker only sees what reaches a history, a client or an agent's list of the
//! (session, epoch) pairs it was sent (collected before a kill or a drain's restart loses
//! it, and at the end; a collection that fails is listed with the faults not done as
//! planned, and that agent's pairs since its last collection are lost), so a defect shows
//! only when it gets past every other defence.
//!
//! The self-test (`ChaosOptions::without_fence`, `a_chaos_run_without_the_fence_reports_anomalies`,
//! `make chaos-selftest`, `leasehold-chaos --without-fence`) turns the checkpoint fence off
//! in every sidecar (`LEASEHOLD_FAILPOINT_NO_FENCE=1`, honoured by debug builds only) and
//! runs 16 `store_partition_mid_write` faults with turns that are all store writes: it
//! must report anomalies (seed 3: 25 acknowledged turns `missing`). Defect 1 of issue 16
//! (the claim's old takeover condition) is caught by the store's stress test
//! (`core/tests/store_claim_race.rs`), not by these runs.
//!
//! Measured earlier by re-introducing defects into a scratch
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
