//! `make demo`: the whole system on this machine, narrated for a newcomer.
//!
//! Starts Postgres, three sidecars and three demo agents on 127.0.0.11–13, then walks
//! through single ownership and forwarding, watching a turn live from another node, an
//! event joining the conversation, a frozen owner whose late write is fenced, a drain
//! that hands the session over without waiting for a TTL, and a crash of the owner.
//! Every process is stopped (by PID) at the end or on Ctrl-C.

use std::{io::IsTerminal, net::Ipv4Addr, time::Duration};

use anyhow::Context;
use leasehold_sidecar::client::{Answer, Client};
use localcluster::{observer::Frame, Cluster, ClusterOptions, Observer, Postgres};
use serde_json::json;
use tokio::time::Instant;

const SESSION: &str = "demo-chat";
/// Short so the crash and the freeze take seconds here; the sidecar's default is 15 s.
const TTL: Duration = Duration::from_secs(4);
/// A frozen owner stays frozen this long before a turn is sent elsewhere: past its TTL.
const FREEZE: Duration = Duration::from_millis(4500);
/// How long the observer waits for the watched turn's events.
const WATCH: Duration = Duration::from_secs(5);

fn step(title: &str) {
    if std::io::stdout().is_terminal() {
        println!("\n\x1b[1m== {title}\x1b[0m");
    } else {
        println!("\n== {title}");
    }
}

fn show(entry: &str, answer: &Answer, after: Option<Duration>) {
    let after = after.map(|d| format!(" after {:.2}s", d.as_secs_f64())).unwrap_or_default();
    let retried = if answer.directives.is_empty() {
        String::new()
    } else {
        format!(" (first refused with 503 {}, retried as told)", answer.directives.join(", then "))
    };
    println!(
        "  sent to {entry}{after} -> {} | ran on {} at epoch {} | {}{retried}",
        answer.status,
        answer.owner.as_deref().unwrap_or("?"),
        answer.epoch.unwrap_or(0),
        String::from_utf8_lossy(&answer.body).trim_end(),
    );
}

async fn checkpoint_history(database_url: &str) -> anyhow::Result<serde_json::Value> {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(database_url).await?;
    let (data,): (Vec<u8>,) = sqlx::query_as("SELECT data FROM agent_checkpoints WHERE agent_key = $1")
        .bind(SESSION)
        .fetch_one(&mut conn)
        .await?;
    Ok(serde_json::from_slice::<serde_json::Value>(&data)?["history"].clone())
}

async fn owner_of(client: &Client, node: usize) -> anyhow::Result<String> {
    let view = client.session(SESSION, node).await?;
    Ok(view["owner"].as_str().context("the session has an owner")?.to_owned())
}

async fn turn(client: &Client, node: usize, body: serde_json::Value) -> anyhow::Result<Answer> {
    Ok(client.post(&format!("/v1/sessions/{SESSION}/turns"), body.to_string().into(), Some(node)).await?)
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
    println!("  (lease TTL {TTL:?} for the demo; the default is 15s)");
    let client = cluster.client();
    let names: Vec<String> = cluster.nodes.iter().map(|n| n.name.clone()).collect();
    let name = |i: usize| names[i].clone();

    step("Turns for one session, sent round-robin to all three nodes");
    println!("  Whichever node a request lands on, the turn runs on the ONE owner.");
    for (i, text) in ["hello", "what can you do?", "tell me a joke", "thanks"].iter().enumerate() {
        show(&name(i % 3), &turn(&client, i % 3, json!({ "text": text })).await?, None);
    }
    let owner = owner_of(&client, 2).await?;
    println!("  GET /v1/sessions/{SESSION} on {}: {}", name(2), client.session(SESSION, 2).await?);
    let a = cluster.index_of(&owner);
    let (b, c) = ((a + 1) % 3, (a + 2) % 3);

    step(&format!("Watching the session live from {}, which does not own it", name(c)));
    let stream = format!("{}/v1/sessions/{SESSION}/stream", cluster.nodes[c].public_url());
    let mut observer = Observer::open(&stream, None).await?;
    let watched = turn(&client, a, json!({ "text": "write a haiku", "tokens": 3, "think_ms": 300 }));
    let follow = async {
        // On connect the stream replays the current turn so far (here the previous one).
        let started = |f: &Frame| f.event.as_deref() == Some("turn_started") && f.data.contains("haiku");
        observer.until(WATCH, started).await?;
        let from = observer.seen.len() - 1;
        observer.until(WATCH, |f| f.event.as_deref() == Some("turn_finished")).await?;
        anyhow::Ok(from)
    };
    let (answer, from) = tokio::join!(watched, follow);
    show(&name(a), &answer?, None);
    for frame in observer.seen[from?..].iter().filter(|f| f.id.is_some()) {
        let id = frame.id.as_deref().unwrap_or_default();
        println!("  {} saw  id {id}  {:<13} {}", name(c), frame.event.as_deref().unwrap_or(""), frame.data);
    }
    drop(observer);

    step("An event from elsewhere in the product joins the same conversation");
    let path = format!("/v1/sessions/{SESSION}/events");
    let answer = client.post(&path, json!({ "name": "invoice-paid" }).to_string().into(), Some(b)).await?;
    show(&name(b), &answer, None);
    println!("  checkpointed history: {}", checkpoint_history(pg.url()).await?);

    step(&format!("The owner ({owner}) freezes (SIGSTOP) past its TTL; another node takes over"));
    cluster.nodes[a].pause();
    println!("  a frozen pod cannot renew its lease; {FREEZE:?} later it has expired");
    tokio::time::sleep(FREEZE).await;
    // Only the nodes that are awake: a request to a frozen process waits until it wakes.
    let awake = Client::new(vec![cluster.nodes[b].public_url(), cluster.nodes[c].public_url()]);
    show(&name(b), &turn(&awake, 0, json!({ "text": "hello? anyone?" })).await?, None);
    cluster.nodes[a].resume();
    println!("  {owner} wakes up (SIGCONT) and, as a zombie would, writes at its old epoch 1:");
    let checkpoint = format!("{}/v1/sessions/{SESSION}/checkpoint", cluster.nodes[a].agent_api_url());
    let late = reqwest::Client::new()
        .put(&checkpoint)
        .header("leasehold-epoch", 1)
        .body(r#"{"history":["a stale write"]}"#)
        .send()
        .await?;
    println!("  PUT checkpoint at epoch 1 -> {} {}", late.status().as_u16(), late.text().await?);
    println!("  the fence refused it: checkpointed history is still {}", checkpoint_history(pg.url()).await?);
    cluster.nodes[a].wait_ready().await?;
    println!("  {owner} found its node lease expired, dropped the session and rejoined with a new boot");

    let owner = owner_of(&client, b).await?;
    let d = cluster.index_of(&owner);
    step(&format!("A drain of the owner ({owner}), as in a rolling deploy: no TTL to wait for"));
    let report = cluster.nodes[d].drain().await;
    println!("  POST /drain on {owner} -> {report}");
    let started = Instant::now();
    let answer = turn(&client, d, json!({ "text": "still with me?" })).await?;
    show(&name(d), &answer, Some(started.elapsed()));

    let owner = owner_of(&client, a).await?;
    let e = cluster.index_of(&owner);
    step(&format!("kill -9 of the owner ({owner}): the session moves, from its checkpoint"));
    cluster.nodes[e].kill9();
    println!(
        "  killed {owner}; Postgres sees its connections close, so the node asked next expires its node"
    );
    println!(
        "  lease and claims the session at once (with --connection-liveness=false: after the TTL, {TTL:?})"
    );
    let survivor = (0..3).find(|&i| i != e && i != d).context("a node that is neither drained nor dead")?;
    let started = Instant::now();
    let answer = turn(&client, survivor, json!({ "text": "are you still there?" })).await?;
    show(&name(survivor), &answer, Some(started.elapsed()));
    println!("  checkpointed history: {}", checkpoint_history(pg.url()).await?);
    println!("  Every epoch change above fences the previous owner's writes.");
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    println!("Starting a throwaway Postgres (a temp dir, a free port on 127.0.0.1)...");
    let pg = Postgres::start().context("starting Postgres")?;
    let result = tokio::select! {
        result = walkthrough(&pg) => result,
        _ = tokio::signal::ctrl_c() => {
            println!("\ninterrupted");
            Ok(())
        }
    };
    drop(pg);
    println!("\nEvery process this demo started is stopped; its temp dirs are removed.");
    result
}
