//! The store over TLS, against a real Postgres that accepts TLS connections only
//! (`support::tls_postgres`). Self-contained: the server is started here and stopped by
//! its PID when the test ends, pass or fail.

mod support;

use std::time::Duration;

use leasehold_core::{
    store::{Claim, LeaseStore},
    Owner, SessionKey,
};
use support::tls_postgres::TlsPostgres;

/// TTL of the node lease registered over TLS: long enough to outlast the test.
const TTL: Duration = Duration::from_secs(60);

/// A connection refused: its error says the store is unavailable and names `cause`.
async fn refused(url: &str, cause: &str) {
    let e = LeaseStore::connect(url, 1).await.expect_err(&format!("{url} must be refused"));
    assert!(e.is_unavailable(), "{e}");
    let text = e.to_string();
    assert!(text.contains(cause), "{url}: `{text}` should name `{cause}`");
}

/// The lazy pool the sidecar and the operator use reports the same cause on its first
/// statement.
async fn refused_lazily(url: &str, cause: &str) {
    let store = LeaseStore::connect_lazy(url, 1).expect("a well-formed url");
    let e = store.register_boot(&Owner::new_boot("pod-x"), "127.0.0.1:1", TTL).await.expect_err("refused");
    assert!(e.to_string().contains(cause), "{url}: `{e}` should name `{cause}`");
}

#[tokio::test]
async fn tls_modes_against_a_tls_only_server() {
    let pg = TlsPostgres::start();
    const WRONG_CA: &str = "not signed by a CA this process trusts";
    const WRONG_NAME: &str = "does not list the host name";
    const TLS_ONLY: &str = "accepts TLS connections only";

    // verify-full with the right CA: the whole store works over TLS, LISTEN included.
    let url = pg.url_with_ca("localhost", "verify-full", "ca.crt");
    let store = LeaseStore::connect_lazy_bounding_idle_transactions(&url, 4, TTL).expect("parse");
    store.migrate().await.expect("migrate over TLS");
    let mut changes = store.listen().await.expect("LISTEN over TLS");
    let owner = Owner::new_boot("pod-a");
    store.register_boot(&owner, "127.0.0.1:7000", TTL).await.expect("register over TLS");
    let key = SessionKey::parse("s-tls").unwrap();
    assert!(matches!(store.claim(&key, &owner).await.unwrap(), Claim::Claimed { .. }));
    tokio::time::timeout(TTL, changes.next()).await.expect("a notification").expect("over TLS");
    let encrypted: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(encrypted, "the pool's connection is encrypted");
    // `connect` (the `migrate` command's) takes the same options.
    LeaseStore::connect(&url, 1).await.expect("connect over TLS");

    // A CA that did not sign the server's certificate, under both verifying modes.
    refused(&pg.url_with_ca("localhost", "verify-full", "other-ca.crt"), WRONG_CA).await;
    refused(&pg.url_with_ca("localhost", "verify-ca", "other-ca.crt"), WRONG_CA).await;
    refused_lazily(&pg.url_with_ca("localhost", "verify-full", "other-ca.crt"), WRONG_CA).await;
    // No CA at all: the compiled-in public roots do not know a private CA.
    refused(&pg.url("localhost", "sslmode=verify-full"), WRONG_CA).await;

    // The right CA, a host the certificate does not name (it lists DNS:localhost only).
    refused(&pg.url_with_ca("127.0.0.1", "verify-full", "ca.crt"), WRONG_NAME).await;
    // verify-ca should accept it (libpq does); sqlx 0.8.6 (the last 0.8) with rustls >=
    // 0.23.24 checks the name anyway (sqlx issue 3793, fixed upstream after 0.8.6): pinned
    // here so an upgrade that fixes it shows up (turn this into an accepted connection
    // then). docs/install.md#tls says so.
    refused(&pg.url_with_ca("127.0.0.1", "verify-ca", "ca.crt"), WRONG_NAME).await;
    LeaseStore::connect(&pg.url_with_ca("localhost", "verify-ca", "ca.crt"), 1)
        .await
        .expect("verify-ca, right name");

    // No TLS against a TLS-only server.
    refused(&pg.url("localhost", "sslmode=disable"), TLS_ONLY).await;
    refused_lazily(&pg.url("localhost", "sslmode=disable"), TLS_ONLY).await;

    // A CA file that is not there.
    refused(&pg.url_with_ca("localhost", "verify-full", "missing.crt"), "sslrootcert").await;

    // require (and the default, prefer) encrypt without checking the certificate.
    LeaseStore::connect(&pg.url("127.0.0.1", "sslmode=require"), 1).await.expect("require: unverified TLS");
}
