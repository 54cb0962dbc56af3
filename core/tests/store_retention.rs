//! Retention: sessions nobody holds and idle past the retention go, with their
//! checkpoints, in batches; a live lease never does, however old; node rows of dead
//! boots go once no session names them; a re-created key starts a new incarnation that
//! no writer of the earlier one can write to.

mod support;

use std::time::Duration;

use leasehold_core::{
    store::{
        checkpoints::put_checkpoint, retention::Collected, Answer, Append, Begun, Claim, Error, JournalEvent,
        LeaseStore, NewTurn, TurnKind,
    },
    Epoch, EventId, Owner,
};
use support::{boot, key, store, LONG_TTL};

const SESSIONS: Duration = Duration::from_secs(30 * 24 * 3600);
const NODES: Duration = Duration::from_secs(24 * 3600);

/// Move a session's last change `days` into the past.
async fn age_lease(store: &LeaseStore, k: &str, days: i32) {
    sqlx::query(
        "UPDATE agent_leases SET updated_at = now() - make_interval(days => $2) WHERE agent_key = $1",
    )
    .bind(k)
    .bind(days)
    .execute(store.pool())
    .await
    .unwrap();
}

/// Make a boot's node lease expired `days` ago (as if it died then).
async fn died(store: &LeaseStore, owner: &Owner, days: i32) {
    sqlx::query("UPDATE agent_nodes SET expires_at = now() - make_interval(days => $2) WHERE owner = $1")
        .bind(owner.as_str())
        .bind(days)
        .execute(store.pool())
        .await
        .unwrap();
}

async fn exists(store: &LeaseStore, table: &str, column: &str, value: &str) -> bool {
    let sql = format!("SELECT EXISTS (SELECT 1 FROM {table} WHERE {column} = $1)");
    sqlx::query_scalar(&sql).bind(value).fetch_one(store.pool()).await.unwrap()
}

async fn claim_and_checkpoint(store: &LeaseStore, k: &str, owner: &Owner) -> Epoch {
    let epoch = store.claim(&key(k), owner).await.unwrap().owned_epoch().unwrap();
    store.put_checkpoint(&key(k), owner, epoch, b"state").await.unwrap();
    epoch
}

#[tokio::test]
async fn only_sessions_nobody_holds_idle_past_the_retention_are_collected() {
    let store = store().await;
    let live = boot(&store, "live", LONG_TTL).await;
    let dead_long = boot(&store, "dead-long", LONG_TTL).await;
    let dead_lately = boot(&store, "dead-lately", LONG_TTL).await;

    claim_and_checkpoint(&store, "live-old", &live).await;
    let epoch = claim_and_checkpoint(&store, "released-old", &live).await;
    store.release(&key("released-old"), &live, epoch).await.unwrap();
    let epoch = claim_and_checkpoint(&store, "released-new", &live).await;
    store.release(&key("released-new"), &live, epoch).await.unwrap();
    claim_and_checkpoint(&store, "dead-old", &dead_long).await;
    claim_and_checkpoint(&store, "dead-lately", &dead_lately).await;
    for k in ["live-old", "released-old", "dead-old", "dead-lately"] {
        age_lease(&store, k, 40).await;
    }
    died(&store, &dead_long, 40).await;
    died(&store, &dead_lately, 0).await;

    let collected = store.collect(SESSIONS, NODES, 100).await.unwrap();
    assert_eq!(collected.sessions, 2, "released-old and dead-old");
    for (k, kept) in [
        ("live-old", true),
        ("released-old", false),
        ("released-new", true),
        ("dead-old", false),
        ("dead-lately", true),
    ] {
        assert_eq!(exists(&store, "agent_leases", "agent_key", k).await, kept, "lease {k}");
        assert_eq!(exists(&store, "agent_checkpoints", "agent_key", k).await, kept, "checkpoint {k}");
    }
    // The long-dead boot's node row went with its last session; the lately dead one is
    // named by a session (its takeover needs it) and the live one is live.
    assert_eq!(collected.nodes, 1);
    assert!(!exists(&store, "agent_nodes", "owner", dead_long.as_str()).await);
    assert!(exists(&store, "agent_nodes", "owner", dead_lately.as_str()).await);
    assert!(exists(&store, "agent_nodes", "owner", live.as_str()).await);
    // The live lease, however old, is still live and its owner keeps it.
    assert!(matches!(store.claim(&key("live-old"), &live).await.unwrap(), Claim::Extended { .. }));
}

#[tokio::test]
async fn collection_runs_in_batches() {
    let store = store().await;
    let owner = boot(&store, "many", LONG_TTL).await;
    sqlx::query(
        "INSERT INTO agent_leases (agent_key, owner, epoch, released, acquired_at, updated_at) \
         SELECT 'k-' || i, $1, 1, true, now(), now() - interval '40 days' FROM generate_series(1, 2500) i",
    )
    .bind(owner.as_str())
    .execute(store.pool())
    .await
    .unwrap();
    let mut batches = Vec::new();
    loop {
        let Collected { sessions, .. } = store.collect(SESSIONS, NODES, 1000).await.unwrap();
        batches.push(sessions);
        if sessions < 1000 {
            break;
        }
    }
    assert_eq!(batches, [1000, 1000, 500]);
}

#[tokio::test]
async fn a_recreated_key_cannot_be_written_by_its_earlier_incarnation() {
    let store = store().await;
    let a = boot(&store, "a", LONG_TTL).await;
    let b = boot(&store, "b", LONG_TTL).await;
    // Three incarnation epochs, then released and collected.
    let first = claim_and_checkpoint(&store, "again", &a).await;
    store.release(&key("again"), &a, first).await.unwrap();
    let second = claim_and_checkpoint(&store, "again", &b).await;
    store.release(&key("again"), &b, second).await.unwrap();
    assert_eq!(second, Epoch(2));
    age_lease(&store, "again", 40).await;
    assert_eq!(store.collect(SESSIONS, NODES, 100).await.unwrap().sessions, 1);

    // A new incarnation, by a, above every epoch ever deleted.
    assert_eq!(store.claim(&key("again"), &a).await.unwrap(), Claim::Claimed { epoch: Epoch(3) });
    // Late writes of the earlier incarnation, by either writer: fenced, a's own too.
    for (owner, epoch) in [(&b, second), (&a, first)] {
        let late = put_checkpoint(store.pool(), &key("again"), owner, epoch, b"stale").await;
        assert!(matches!(late, Err(Error::Fenced { .. })), "{owner} at {epoch}: {late:?}");
    }
    store.put_checkpoint(&key("again"), &a, Epoch(3), b"new").await.unwrap();
    // A key never seen still starts at epoch floor + 1 too; one of a database that never
    // collected anything at 1 (every other test).
    assert_eq!(store.claim(&key("fresh"), &a).await.unwrap(), Claim::Claimed { epoch: Epoch(3) });
}

/// Journal rows for `k`: its turns and its events.
async fn journal_rows(store: &LeaseStore, k: &str) -> (i64, i64) {
    let count = |table: &str| format!("SELECT count(*) FROM {table} WHERE agent_key = $1");
    let turns = sqlx::query_scalar(&count("agent_turns")).bind(k).fetch_one(store.pool()).await.unwrap();
    let events =
        sqlx::query_scalar(&count("agent_turn_events")).bind(k).fetch_one(store.pool()).await.unwrap();
    (turns, events)
}

/// A session with a finished turn and a running one, each with an event, and an event
/// published between turns.
async fn journal(store: &LeaseStore, k: &str, owner: &Owner, epoch: Epoch) {
    let s = key(k);
    for id in ["done", "running"] {
        let turn = NewTurn { turn_id: id, kind: TurnKind::Turn, content_type: None, body: id.as_bytes() };
        assert_eq!(store.begin_turn(&s, owner, epoch, &turn).await.unwrap(), Begun::Started);
    }
    let answer = Answer { status: 200, content_type: None, body: b"{}".to_vec() };
    store.finish_turn(&s, owner, epoch, "done", &answer).await.unwrap();
    let events: Vec<Append> = [Some("done"), Some("running"), None]
        .into_iter()
        .zip(1u64..)
        .map(|(turn_id, seq)| Append {
            key: s.clone(),
            owner: owner.clone(),
            event: JournalEvent {
                id: EventId { epoch, seq },
                turn_id: turn_id.map(str::to_owned),
                kind: "token".to_owned(),
                data: "{}".to_owned(),
            },
        })
        .collect();
    assert_eq!(store.append_events(&events).await.unwrap().len(), 3);
    assert_eq!(journal_rows(store, k).await, (2, 3));
}

/// A collected session's journal goes with it: its turns (finished or still running) and
/// their events; a session that is held keeps all of its journal, however old.
#[tokio::test]
async fn a_collected_session_takes_its_journal_with_it_and_a_held_one_keeps_it() {
    let store = store().await;
    let live = boot(&store, "live", LONG_TTL).await;
    let dead = boot(&store, "dead", LONG_TTL).await;
    let held = claim_and_checkpoint(&store, "held", &live).await;
    journal(&store, "held", &live, held).await;
    let gone = claim_and_checkpoint(&store, "gone", &dead).await;
    journal(&store, "gone", &dead, gone).await;
    for k in ["held", "gone"] {
        age_lease(&store, k, 40).await;
    }
    died(&store, &dead, 40).await;

    let collected = store.collect(SESSIONS, NODES, 100).await.unwrap();
    assert_eq!(collected.sessions, 1, "only the session nobody holds");
    assert!(!exists(&store, "agent_leases", "agent_key", "gone").await);
    assert_eq!(journal_rows(&store, "gone").await, (0, 0), "its turns and events went with it");
    assert!(exists(&store, "agent_leases", "agent_key", "held").await);
    assert_eq!(journal_rows(&store, "held").await, (2, 3), "a held session keeps its journal");
}
