//! The store's pools ping a connection before handing it out, even one used a moment ago:
//! a connection that died (a Postgres restart, a killed backend) is replaced before a
//! statement uses it, so the statement succeeds instead of failing with an answer that
//! "may have landed" (issue 20 tried skipping the ping within 1 s of use; the keyed fault
//! run then left a turn ambiguous).

mod support;

use std::time::Duration;

use leasehold_core::store::LeaseStore;
use sqlx::{Connection, PgConnection};
use support::{boot, LONG_TTL};

/// Time for the killed backend to close its socket (well under a second).
const BACKEND_EXIT: Duration = Duration::from_millis(200);

#[tokio::test]
async fn a_connection_killed_right_after_use_is_replaced_before_a_statement_uses_it() {
    let url = support::create_database().await;
    let name = format!("lh_ping_{}", uuid::Uuid::new_v4().simple());
    let sep = if url.contains('?') { '&' } else { '?' };
    // One connection, so the statement after the kill can only get that one or a new one.
    let store = LeaseStore::connect_lazy(&format!("{url}{sep}application_name={name}"), 1).unwrap();
    store.migrate().await.expect("migrate");
    boot(&store, "node-a", LONG_TTL).await;

    let mut admin = PgConnection::connect(&support::admin_url()).await.expect("connect");
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(&name)
    .fetch_all(&mut admin)
    .await
    .expect("terminate the pool's backend");
    assert_eq!(killed, [true], "the pool's one connection was killed");

    tokio::time::sleep(BACKEND_EXIT).await; // the connection was used just before the kill
    let owner = boot(&store, "node-b", LONG_TTL).await;
    let alive: Vec<String> =
        sqlx::query_scalar("SELECT application_name FROM pg_stat_activity WHERE application_name = $1")
            .bind(&name)
            .fetch_all(&mut admin)
            .await
            .expect("list the pool's backends");
    assert_eq!(alive.len(), 1, "a new connection served {owner}");
}
