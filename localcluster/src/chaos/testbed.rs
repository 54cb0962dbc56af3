//! The cluster a chaos run works on, with the handles its faults need: a private Postgres
//! (it can be stopped and started), and one cuttable [`StoreLink`] per node between that
//! node's sidecar and the store.

use std::{collections::BTreeMap, path::Path, sync::Arc, time::Duration};

use anyhow::Context;
use sqlx::{Connection, PgConnection};

use super::{checker::AgentEpochs, store_link::StoreLink};
use crate::{postgres::fresh_database, Cluster, ClusterOptions, Postgres};

/// A live agent answers `GET /session-epochs` within this (it is a read of memory); a
/// frozen or dead one does not, and its pairs since the last collection are lost.
const AGENT_ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// Fields drop in order: the processes go first, then the links, then the store.
#[derive(Debug)]
pub struct Testbed {
    pub cluster: Cluster,
    /// `links[i]` carries node `i`'s connections to the store.
    pub links: Vec<StoreLink>,
    postgres: Arc<Postgres>,
    postgres_up: bool,
    /// The store, reached directly (not through a link).
    pub database_url: String,
    /// What the agents said they were sent, collected before a restart loses it and at
    /// the end of the run ([`Testbed::collect_agent_epochs`]).
    pub agent_epochs: AgentEpochs,
    /// Collections that failed: those agents' pairs since their last collection are lost.
    pub agent_epochs_lost: Vec<String>,
}

impl Testbed {
    /// A private Postgres, a fresh database on it, a link per node and the cluster, ready.
    pub async fn start(options: ClusterOptions) -> anyhow::Result<Testbed> {
        let postgres = Arc::new(tokio::task::spawn_blocking(Postgres::start).await??);
        let database_url = fresh_database(postgres.url()).await.context("create the database")?;
        let mut links = Vec::new();
        for _ in 0..options.nodes {
            links.push(StoreLink::to_database(&database_url).await.context("start a store link")?);
        }
        let database_urls = links.iter().map(|link| Some(link.database_url(&database_url))).collect();
        let cluster = Cluster::start(&database_url, ClusterOptions { database_urls, ..options }).await?;
        Ok(Testbed {
            cluster,
            links,
            postgres,
            postgres_up: true,
            database_url,
            agent_epochs: AgentEpochs::new(),
            agent_epochs_lost: Vec::new(),
        })
    }

    pub fn public_urls(&self) -> Vec<String> {
        self.cluster.nodes.iter().map(|n| n.public_url()).collect()
    }

    /// Stop the store (fast shutdown: every connection breaks).
    pub async fn stop_postgres(&mut self) -> anyhow::Result<()> {
        let postgres = self.postgres.clone();
        self.postgres_up = false;
        tokio::task::spawn_blocking(move || postgres.stop()).await?
    }

    /// Start the store again (same port, same data).
    pub async fn start_postgres(&mut self) -> anyhow::Result<()> {
        let postgres = self.postgres.clone();
        tokio::task::spawn_blocking(move || postgres.restart()).await??;
        self.postgres_up = true;
        Ok(())
    }

    /// Undo whatever a fault may have left: the store up, every link mended, every process
    /// running and not stopped; then wait until every node is ready.
    pub async fn heal(&mut self) -> anyhow::Result<()> {
        if !self.postgres_up {
            self.start_postgres().await?;
        }
        for link in &self.links {
            link.mend();
        }
        for node in &mut self.cluster.nodes {
            node.resume();
            if !node.sidecar.is_running() {
                node.restart_sidecar();
            }
            if !node.agent.is_running() {
                node.restart_agent();
            }
        }
        for node in &mut self.cluster.nodes {
            node.wait_ready().await?;
        }
        Ok(())
    }

    /// Add node `i`'s agent's (session, epoch) pairs (`GET /session-epochs`) to
    /// [`Testbed::agent_epochs`]; a failure is noted in [`Testbed::agent_epochs_lost`].
    pub async fn collect_agent_epochs(&mut self, i: usize) {
        let node = &self.cluster.nodes[i];
        let url = format!("{}/session-epochs", node.agent_url());
        let fetched = async {
            let http = reqwest::Client::builder().timeout(AGENT_ANSWER_TIMEOUT).build()?;
            http.get(url).send().await?.error_for_status()?.json::<serde_json::Value>().await
        };
        let listed = match fetched.await {
            Ok(listed) => listed,
            Err(e) => {
                self.agent_epochs_lost.push(format!("{}: session epochs not collected: {e}", node.name));
                return;
            }
        };
        if listed["dropped"].as_u64().is_some_and(|n| n > 0) {
            self.agent_epochs_lost
                .push(format!("{}: its agent dropped {} session epochs", node.name, listed["dropped"]));
        }
        let seen = self.agent_epochs.entry(node.name.clone()).or_default();
        for pair in listed["pairs"].as_array().into_iter().flatten() {
            if let (Some(session), Some(epoch)) = (pair["session"].as_str(), pair["epoch"].as_i64()) {
                seen.insert((session.to_owned(), epoch));
            }
        }
    }

    /// Every session's history, from its checkpoint (`{"history":[...]}`).
    pub async fn histories(&self) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
        let mut conn = PgConnection::connect(&self.database_url).await?;
        let rows: Vec<(String, Vec<u8>)> =
            sqlx::query_as("SELECT agent_key, data FROM agent_checkpoints").fetch_all(&mut conn).await?;
        let mut histories = BTreeMap::new();
        for (key, data) in rows {
            let state: serde_json::Value =
                serde_json::from_slice(&data).with_context(|| format!("{key}: checkpoint is not JSON"))?;
            let history = state["history"]
                .as_array()
                .with_context(|| format!("{key}: checkpoint has no history"))?
                .iter()
                .map(|entry| entry.as_str().map(str::to_owned).unwrap_or_else(|| entry.to_string()))
                .collect();
            histories.insert(key, history);
        }
        Ok(histories)
    }

    /// Copy every process's whole log into `dir` (the cluster's own go when it drops).
    pub fn keep_logs(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        for node in &self.cluster.nodes {
            for process in [&node.sidecar, &node.agent] {
                let file = format!("{}.log", process.name().replace('/', "-"));
                std::fs::write(dir.join(file), process.log_tail(usize::MAX))?;
            }
        }
        Ok(())
    }
}
