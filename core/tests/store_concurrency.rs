//! Many claimers racing on one key from separate connections: exactly one owner per
//! epoch, epochs strictly increasing across many expiry/takeover rounds.

mod support;

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
    time::Duration,
};

use leasehold_core::{
    store::{leases::claim_once, Claim, Error, LeaseStore},
    Epoch, Owner,
};
use rand::Rng;
use sqlx::{Connection, PgConnection};
use support::{boot, key, store_with_pool};
use tokio::sync::Barrier;

const CLAIMERS: usize = 64;

/// Run one claim on a dedicated connection, re-running the empty answer like the store does.
async fn claim_on(conn: &mut PgConnection, k: &str, owner: &Owner) -> Result<Claim, Error> {
    loop {
        if let Some(claim) = claim_once(&mut *conn, &key(k), owner).await? {
            return Ok(claim);
        }
    }
}

async fn connection(store: &LeaseStore) -> PgConnection {
    let opts = store.pool().connect_options();
    PgConnection::connect_with(&opts).await.expect("dedicated connection")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_insert_race_has_exactly_one_winner() {
    let store = store_with_pool(16).await;
    let mut owners = Vec::new();
    let mut conns = Vec::new();
    for i in 0..CLAIMERS {
        owners.push(boot(&store, &format!("racer-{i}"), Duration::from_secs(60)).await);
        conns.push(connection(&store).await);
    }
    for round in 0..10 {
        let k = format!("fresh-{round}");
        let barrier = Arc::new(Barrier::new(CLAIMERS));
        let tasks: Vec<_> = conns
            .drain(..)
            .zip(owners.iter().cloned())
            .map(|(mut conn, owner)| {
                let (barrier, k) = (barrier.clone(), k.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let claim = claim_on(&mut conn, &k, &owner).await.expect("claim");
                    (conn, owner, claim)
                })
            })
            .collect();
        let mut winners = Vec::new();
        for task in tasks {
            let (conn, owner, claim) = task.await.unwrap();
            conns.push(conn);
            match claim {
                Claim::Claimed { epoch } => winners.push((owner, epoch)),
                Claim::Held(holder) => assert_eq!(holder.epoch, Epoch(1)),
                other => panic!("unexpected {other:?} on a fresh key"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: exactly one winner, got {winners:?}");
        let holder = store.lookup(&key(&k)).await.unwrap().holder.unwrap();
        assert_eq!((holder.owner, holder.epoch), (winners[0].0.clone(), Epoch(1)));
    }
}

/// One claimer's observations: (epoch, owner, acquired-this-epoch).
type Seen = Vec<(Epoch, Owner, bool)>;

/// A claimer that keeps claiming; when it holds the lease it keeps it for a few claims,
/// then stops renewing its node lease so that it expires and another takes over.
async fn claimer(store: LeaseStore, i: usize, ttl: Duration, rounds_wanted: i64) -> Seen {
    let mut conn = connection(&store).await;
    let node = format!("claimer-{i}");
    let mut owner = boot(&store, &node, ttl).await;
    let mut seen = Seen::new();
    let mut held_for = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    while tokio::time::Instant::now() < deadline {
        match claim_on(&mut conn, "contested", &owner).await {
            Ok(Claim::Held(holder)) => {
                if holder.epoch.0 >= rounds_wanted {
                    break;
                }
                store.renew_all(&owner, ttl).await.unwrap(); // stay live while waiting
            }
            Ok(claim) => {
                let epoch = claim.owned_epoch().unwrap();
                seen.push((epoch, owner.clone(), !matches!(claim, Claim::Extended { .. })));
                held_for += 1;
                if epoch.0 >= rounds_wanted {
                    break;
                }
                if held_for < 3 {
                    store.renew_all(&owner, ttl).await.unwrap();
                } else {
                    // Stop renewing: let the node lease lapse (a crash or a pause).
                    tokio::time::sleep(ttl + Duration::from_millis(20)).await;
                }
            }
            Err(Error::NodeNotLive { .. }) => {
                owner = boot(&store, &node, ttl).await; // a restart: new boot id
                held_for = 0;
            }
            Err(e) => panic!("claim failed: {e}"),
        }
        let pause = rand::rng().random_range(2..12);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn takeover_rounds_keep_one_owner_per_epoch() {
    const ROUNDS: i64 = 25;
    let store = store_with_pool(32).await;
    let ttl = Duration::from_millis(250);
    let tasks: Vec<_> = (0..CLAIMERS).map(|i| tokio::spawn(claimer(store.clone(), i, ttl, ROUNDS))).collect();
    let mut owner_of: BTreeMap<Epoch, HashSet<Owner>> = BTreeMap::new();
    let mut acquisitions: BTreeMap<Epoch, usize> = BTreeMap::new();
    for task in tasks {
        let seen = task.await.unwrap();
        // each claimer sees epochs only grow
        assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0), "epochs went backwards: {seen:?}");
        for (epoch, owner, acquired) in seen {
            owner_of.entry(epoch).or_default().insert(owner);
            *acquisitions.entry(epoch).or_default() += usize::from(acquired);
        }
    }
    let max = *owner_of.keys().last().expect("someone won");
    assert!(max.0 >= ROUNDS, "only {max} rounds happened");
    for (epoch, owners) in &owner_of {
        assert_eq!(owners.len(), 1, "epoch {epoch} had several owners: {owners:?}");
    }
    for (epoch, n) in &acquisitions {
        assert_eq!(*n, 1, "epoch {epoch} was acquired {n} times");
    }
    // Every epoch 1..=max was granted exactly once and observed: strictly increasing.
    let expected: Vec<_> = (1..=max.0).map(Epoch).collect();
    assert_eq!(acquisitions.keys().copied().collect::<Vec<_>>(), expected);
    assert_eq!(store.lookup(&key("contested")).await.unwrap().epoch, Some(max));
}
