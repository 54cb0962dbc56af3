//! One scenario's world: its own namespace, its own database, a Secret with the pods'
//! database URL and an AgentCluster of the demo agent (or of another agent container).
//! On drop: a failure (panic) dumps the namespace's state to stderr; then the namespace
//! is deleted and the database dropped (set `LEASEHOLD_E2E_KEEP=1` to keep them after a
//! failure).

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::{
    api::{DeleteParams, ObjectMeta, PostParams},
    Api, ResourceExt,
};
use leasehold_crds::AgentCluster;
use rand::distr::{Alphanumeric, SampleString};
use tokio::time::Instant;

use crate::{
    client::{Client, Pods},
    database::{self, Db},
    dump, install,
    pods::{self, ReadyPods},
    proxy::PodProxy,
    settings::Settings,
    spec,
};

/// The AgentCluster's name in every scenario.
pub const CLUSTER: &str = "agents";
/// Pods of a fresh cluster must be Ready within this.
pub const START_TIMEOUT: Duration = Duration::from_secs(240);

/// `e2e-<scenario>-<suffix>`, a valid namespace (and database) name of at most 63 bytes.
pub fn namespace_name(scenario: &str, suffix: &str) -> String {
    let scenario: String = scenario
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .collect();
    let room = 63 - "e2e--".len() - suffix.len();
    let scenario = scenario[..scenario.len().min(room)].trim_matches('-');
    format!("e2e-{scenario}-{}", suffix.to_ascii_lowercase())
}

pub struct Fixture {
    pub settings: Settings,
    pub config: kube::Config,
    pub client: kube::Client,
    /// For the pod proxy: kube's default retry of 503s (honouring `Retry-After`) is off,
    /// so every directive reaches the suite's client, and a POST is never re-sent behind
    /// its back.
    proxy_client: kube::Client,
    pub scenario: String,
    pub ns: String,
    /// The test's database (superuser URL on it), when the scenario has one.
    pub db: Option<Db>,
    db_name: Option<String>,
    pub started: Instant,
}

impl std::fmt::Debug for Fixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fixture").field("scenario", &self.scenario).field("ns", &self.ns).finish()
    }
}

impl Fixture {
    /// A namespace only (no database, no AgentCluster), with the operator installed.
    pub async fn namespace(scenario: &str) -> Fixture {
        let settings = Settings::from_env();
        install::ensure_installed(&settings).await;
        Fixture::namespace_as_is(scenario, settings).await
    }

    /// A namespace, whatever the cluster has installed (the upgrade scenario installs the
    /// previous version itself).
    async fn namespace_as_is(scenario: &str, settings: Settings) -> Fixture {
        let config = settings.kube_config().await;
        let client = kube::Client::try_from(config.clone()).expect("a kube client");
        let mut no_retry = config.clone();
        no_retry.default_retry = false;
        let proxy_client = kube::Client::try_from(no_retry).expect("a kube client");
        let suffix = Alphanumeric.sample_string(&mut rand::rng(), 5);
        let ns = namespace_name(scenario, &suffix);
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(ns.clone()),
                labels: Some(BTreeMap::from([("leasehold.dev/e2e".to_owned(), scenario.replace('_', "-"))])),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .unwrap_or_else(|e| panic!("create namespace {ns}: {e}"));
        eprintln!("e2e: scenario {scenario} in namespace {ns}");
        Fixture {
            settings,
            config,
            client,
            proxy_client,
            scenario: scenario.to_owned(),
            ns,
            db: None,
            db_name: None,
            started: Instant::now(),
        }
    }

    /// The full world: namespace, database, Secret, an AgentCluster of 3 replicas, all
    /// pods Ready.
    pub async fn start(scenario: &str) -> Fixture {
        Fixture::start_with(scenario, 3).await
    }

    /// The full world with an AgentCluster of `replicas` pods, all Ready.
    pub async fn start_with(scenario: &str, replicas: usize) -> Fixture {
        let agent = spec::agent_container(&Settings::from_env().agent_image(), &[]);
        Fixture::start_with_agent(scenario, replicas, agent).await
    }

    /// The full world with an AgentCluster of `replicas` pods whose agent container is
    /// `agent` (JSON, see `spec::agent_container`), all Ready.
    pub async fn start_with_agent(scenario: &str, replicas: usize, agent: serde_json::Value) -> Fixture {
        let f = Fixture::with_database(scenario).await;
        let count = i32::try_from(replicas).expect("a replica count");
        f.create_cluster(spec::spec_json_with(agent, count)).await;
        f.wait_ready(replicas).await;
        f
    }

    /// The AgentCluster [`CLUSTER`] from a spec in JSON.
    pub async fn create_cluster(&self, spec: serde_json::Value) {
        let ac = spec::agent_cluster(CLUSTER, spec);
        self.clusters().create(&PostParams::default(), &ac).await.expect("create the AgentCluster");
    }

    /// Wait until the cluster has `replicas` pods, all Ready (within [`START_TIMEOUT`]).
    pub async fn wait_ready(&self, replicas: usize) {
        let started = Instant::now();
        self.wait_pods(&format!("{replicas} Ready pods"), START_TIMEOUT, |pods| {
            pods.len() == replicas && pods.iter().all(pods::is_ready)
        })
        .await;
        eprintln!("e2e: {replicas} pods Ready in {:.1}s", started.elapsed().as_secs_f64());
    }

    /// Namespace, database and the database Secret; no AgentCluster yet.
    pub async fn with_database(scenario: &str) -> Fixture {
        Fixture::add_database(Fixture::namespace(scenario).await).await
    }

    /// Namespace, database and the database Secret, with the previous version's operator
    /// installed (`install::install_previous`) instead of this one's.
    pub async fn with_database_on_previous(scenario: &str) -> Fixture {
        let settings = Settings::from_env();
        let previous = settings.previous.clone().unwrap_or_else(|| {
            panic!(
                "LEASEHOLD_E2E_PREVIOUS_CHART is not set: the upgrade scenario needs the previous version's \
                 chart and images (scripts/e2e.sh builds them: e2e/images/build-previous.sh)"
            )
        });
        install::install_previous(&settings, &previous).await;
        Fixture::add_database(Fixture::namespace_as_is(scenario, settings).await).await
    }

    async fn add_database(mut f: Fixture) -> Fixture {
        let db_name = f.ns.clone();
        let owner = database::url_user(&f.settings.pod_database_url);
        database::create_database(&f.settings.database_url, &db_name, owner.as_deref())
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {db_name} (LEASEHOLD_E2E_DATABASE_URL): {e}"));
        f.db_name = Some(db_name.clone());
        let db = Db::connect(&database::with_database(&f.settings.database_url, &db_name))
            .await
            .unwrap_or_else(|e| panic!("connect to {db_name}: {e}"));
        f.db = Some(db);
        let pod_url = database::with_database(&f.settings.pod_database_url, &db_name);
        let secret = Secret {
            metadata: ObjectMeta { name: Some(spec::DB_SECRET.to_owned()), ..ObjectMeta::default() },
            string_data: Some(BTreeMap::from([(spec::DB_KEY.to_owned(), pod_url)])),
            type_: Some("Opaque".to_owned()),
            ..Secret::default()
        };
        Api::<Secret>::namespaced(f.client.clone(), &f.ns)
            .create(&PostParams::default(), &secret)
            .await
            .expect("create the database Secret");
        f
    }

    /// The name of this scenario's database.
    pub fn database_name(&self) -> &str {
        self.db_name.as_deref().expect("this fixture has a database")
    }

    pub fn db(&self) -> &Db {
        self.db.as_ref().expect("this fixture has a database")
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn clusters(&self) -> Api<AgentCluster> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn proxy(&self) -> PodProxy {
        PodProxy::new(self.proxy_client.clone(), &self.ns)
    }

    /// A directive-honouring client over the given pods.
    pub fn client_over(&self, pods: Pods) -> Client {
        Client::new(self.proxy(), pods)
    }

    /// Every pod of the cluster, sorted by name.
    pub async fn list_pods(&self) -> Vec<Pod> {
        pods::list(&self.pods(), CLUSTER).await.expect("list pods")
    }

    /// Names of the Ready pods, sorted.
    pub async fn ready_pods(&self) -> Vec<String> {
        pods::ready_names(&self.pods(), CLUSTER).await.expect("list pods")
    }

    /// Ready pods, refreshed every second.
    pub async fn watch_ready(&self) -> ReadyPods {
        ReadyPods::watch(self.pods(), CLUSTER).await
    }

    /// Poll the pods until `done` holds; panic (which dumps) after `timeout`.
    pub async fn wait_pods(&self, what: &str, timeout: Duration, done: impl Fn(&[Pod]) -> bool) -> Vec<Pod> {
        let deadline = Instant::now() + timeout;
        loop {
            let pods = self.list_pods().await;
            if done(&pods) {
                return pods;
            }
            if Instant::now() > deadline {
                let state: Vec<String> = pods
                    .iter()
                    .map(|p| {
                        format!(
                            "{}(ready={}, terminating={})",
                            p.name_any(),
                            pods::is_ready(p),
                            pods::is_terminating(p)
                        )
                    })
                    .collect();
                panic!("timed out after {timeout:?} waiting for {what}; pods: {state:?}");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

async fn cleanup(client: &kube::Client, settings: &Settings, ns: &str, db_name: Option<&str>) {
    let namespaces = Api::<Namespace>::all(client.clone());
    if let Err(e) = namespaces.delete(ns, &DeleteParams::background()).await {
        eprintln!("e2e: delete namespace {ns}: {e}");
    }
    // Wait for the pods to go, so the next scenario does not share the machine with them
    // and no sidecar still holds a connection to the database.
    let deadline = Instant::now() + Duration::from_secs(180);
    while Instant::now() < deadline {
        match namespaces.get_opt(ns).await {
            Ok(None) => break,
            Ok(Some(_)) | Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
    if let Some(db) = db_name {
        if let Err(e) = database::drop_database(&settings.database_url, db).await {
            eprintln!("e2e: drop database {db}: {e}");
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        let keep = failed && std::env::var_os("LEASEHOLD_E2E_KEEP").is_some();
        let (config, settings, ns, db_name) =
            (self.config.clone(), self.settings.clone(), self.ns.clone(), self.db_name.clone());
        let elapsed = self.started.elapsed();
        // A runtime of its own: the test's runtime may be unwinding or single-threaded.
        let worker = std::thread::spawn(move || {
            let runtime =
                tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            runtime.block_on(async move {
                let client = match kube::Client::try_from(config) {
                    Ok(client) => client,
                    Err(e) => return eprintln!("e2e: no client for the cleanup of {ns}: {e}"),
                };
                if failed {
                    dump::dump(&client, &ns).await;
                }
                if keep {
                    eprintln!("e2e: LEASEHOLD_E2E_KEEP: kept namespace and database {ns}");
                    return;
                }
                let started = Instant::now();
                cleanup(&client, &settings, &ns, db_name.as_deref()).await;
                eprintln!(
                    "e2e: {ns} {} after {:.1}s; cleaned up in {:.1}s",
                    if failed { "FAILED" } else { "passed" },
                    elapsed.as_secs_f64(),
                    started.elapsed().as_secs_f64()
                );
            });
        });
        let _ = worker.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_names_are_valid_and_bounded() {
        assert_eq!(
            namespace_name("rolling_deploy_under_load", "aB3x9"),
            "e2e-rolling-deploy-under-load-ab3x9"
        );
        let long = namespace_name(&"x".repeat(100), "abcde");
        assert_eq!(long.len(), 63);
        assert!(long.ends_with("-abcde"));
        assert!(namespace_name("a_", "z")
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
    }
}
