//! `make demo`: the whole system on this machine, narrated for a newcomer.
//!
//! Starts Postgres, three sidecars and three demo agents on 127.0.0.11–13, then walks
//! through single ownership, forwarding, an event joining the conversation, and a crash
//! of the owner. Every process is stopped (by PID) at the end or on Ctrl-C.

use std::{net::Ipv4Addr, time::Duration};

use anyhow::Context;
use leasehold_sidecar::client::Client;
use localcluster::{Cluster, ClusterOptions, Postgres};
use serde_json::json;

const SESSION: &str = "demo-chat";
const TTL: Duration = Duration::from_secs(4);

fn step(title: &str) {
    println!("\n\x1b[1m== {title}\x1b[0m");
}

async fn checkpoint_history(database_url: &str) -> anyhow::Result<serde_json::Value> {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(database_url).await?;
    let (data,): (Vec<u8>,) = sqlx::query_as("SELECT data FROM agent_checkpoints WHERE agent_key = $1")
        .bind(SESSION)
        .fetch_one(&mut conn)
        .await?;
    Ok(serde_json::from_slice::<serde_json::Value>(&data)?["history"].clone())
}

async fn walkthrough(pg: &Postgres) -> anyhow::Result<()> {
    step("Starting 3 nodes (sidecar + demo agent each) on 127.0.0.11-13");
    let options = ClusterOptions {
        lease_ttl: TTL,
        heartbeat: Duration::from_secs(1),
        ips: Some((11..=13).map(|i| Ipv4Addr::new(127, 0, 0, i)).collect()),
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(pg.url(), options).await.context("starting the cluster")?;
    for node in &cluster.nodes {
        println!("  {} public {}  admin {}", node.name, node.public_url(), node.admin_url());
    }

    step("Turns for one session, sent round-robin to all three nodes");
    println!("  Whichever node a request lands on, the turn runs on the ONE owner.");
    let client = cluster.client();
    for (i, text) in ["hello", "what can you do?", "tell me a joke", "thanks"].iter().enumerate() {
        let entry = i % 3;
        let answer = client
            .post(
                &format!("/v1/sessions/{SESSION}/turns"),
                json!({ "text": text }).to_string().into(),
                Some(entry),
            )
            .await?;
        println!(
            "  sent to {} -> {} | owner {} epoch {} | {}",
            cluster.nodes[entry].name,
            answer.status,
            answer.owner.as_deref().unwrap_or("?"),
            answer.epoch.unwrap_or(0),
            String::from_utf8_lossy(&answer.body)
        );
    }
    let owner = client.session(SESSION, 0).await?["owner"].as_str().unwrap_or_default().to_owned();
    println!("  GET /v1/sessions/{SESSION}: {}", client.session(SESSION, 2).await?);

    step("An event from elsewhere in the product joins the same conversation");
    let other = cluster.nodes.iter().position(|n| n.name != owner).unwrap_or(0);
    let answer = client
        .post(
            &format!("/v1/sessions/{SESSION}/events"),
            json!({ "name": "invoice-paid" }).to_string().into(),
            Some(other),
        )
        .await?;
    println!(
        "  posted to {} -> {} {}",
        cluster.nodes[other].name,
        answer.status,
        String::from_utf8_lossy(&answer.body)
    );
    println!("  checkpointed history: {}", checkpoint_history(pg.url()).await?);

    step(&format!("kill -9 of the owner ({owner}): the session moves, from its checkpoint"));
    let victim = cluster.index_of(&owner);
    cluster.nodes[victim].kill9();
    println!("  killed {owner}; its lease stays live until its TTL ({TTL:?}) runs out");
    let survivors = Client::new(cluster.nodes.iter().map(|n| n.public_url()).collect());
    let started = std::time::Instant::now();
    let answer = survivors.turn(SESSION, &json!({ "text": "are you still there?" })).await?;
    println!(
        "  after {:.1}s -> {} | owner {} epoch {} | {} (directives obeyed: {:?})",
        started.elapsed().as_secs_f64(),
        answer.status,
        answer.owner.as_deref().unwrap_or("?"),
        answer.epoch.unwrap_or(0),
        String::from_utf8_lossy(&answer.body),
        answer.directives
    );
    println!("  checkpointed history: {}", checkpoint_history(pg.url()).await?);
    println!("  (epoch 2 fences anything the old owner might still try to write)");

    step("Done: stopping every process");
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let pg = Postgres::start().context("starting Postgres")?;
    tokio::select! {
        result = walkthrough(&pg) => result,
        _ = tokio::signal::ctrl_c() => {
            println!("\ninterrupted: stopping every process");
            Ok(())
        }
    }
}
