//! What the suite is pointed at: environment variables only.

use std::path::{Path, PathBuf};

/// Every setting of a run, read once from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Admin kubeconfig (`KUBECONFIG`).
    pub kubeconfig: PathBuf,
    /// Postgres superuser URL reachable from the test process.
    pub database_url: String,
    /// The same server as pods reach it, without a database name.
    pub pod_database_url: String,
    /// Tag of `leasehold/{operator,sidecar,demo-agent,python-agent}`, present on the
    /// nodes already.
    pub image_tag: String,
    /// The Helm chart to install.
    pub chart: PathBuf,
    /// The `helm` binary.
    pub helm: String,
    /// An extra values file passed with `-f`.
    pub helm_values: Option<PathBuf>,
    /// The operator binary (`LEASEHOLD_E2E_OPERATOR_BIN`), for the scenario that runs
    /// operator processes of its own beside the chart's (leader election).
    pub operator_bin: Option<PathBuf>,
    /// The previous version's chart (`LEASEHOLD_E2E_PREVIOUS_CHART`) and the tag of its
    /// images (`LEASEHOLD_E2E_PREVIOUS_TAG`, default `previous`), for the upgrade scenario.
    pub previous: Option<Previous>,
}

/// The version a user upgrades from: its chart (with its CRD) and its images.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Previous {
    pub chart: PathBuf,
    pub image_tag: String,
}

/// The repository root (the workspace), against which relative paths are resolved.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

impl Settings {
    /// Read the settings; on a missing variable, print one line naming it and exit.
    pub fn from_env() -> Settings {
        match Settings::from_lookup(|name| std::env::var(name).ok(), &repo_root()) {
            Ok(settings) => settings,
            Err(line) => {
                eprintln!("leasehold-e2e: {line}");
                std::process::exit(2);
            }
        }
    }

    /// Settings from any lookup (unit-tested); relative paths resolve against `root`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>, root: &Path) -> Result<Settings, String> {
        let get = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let required = |name: &str, what: &str| {
            get(name).ok_or_else(|| format!("{name} is not set ({what}); source the e2e env file first"))
        };
        let path = |value: String| {
            let p = PathBuf::from(value);
            if p.is_absolute() {
                p
            } else {
                root.join(p)
            }
        };
        Ok(Settings {
            kubeconfig: path(required("KUBECONFIG", "the admin kubeconfig")?),
            database_url: required("LEASEHOLD_E2E_DATABASE_URL", "Postgres superuser URL for the tests")?,
            pod_database_url: required(
                "LEASEHOLD_E2E_POD_DATABASE_URL",
                "the same Postgres as pods reach it, without a database name",
            )?
            .trim_end_matches('/')
            .to_owned(),
            image_tag: get("LEASEHOLD_E2E_IMAGE_TAG").unwrap_or_else(|| "e2e".to_owned()),
            chart: path(get("LEASEHOLD_E2E_CHART").unwrap_or_else(|| "charts/leasehold".to_owned())),
            helm: get("LEASEHOLD_E2E_HELM").unwrap_or_else(|| "helm".to_owned()),
            helm_values: get("LEASEHOLD_E2E_HELM_VALUES").map(path),
            operator_bin: get("LEASEHOLD_E2E_OPERATOR_BIN").map(path),
            previous: get("LEASEHOLD_E2E_PREVIOUS_CHART").map(|chart| Previous {
                chart: path(chart),
                image_tag: get("LEASEHOLD_E2E_PREVIOUS_TAG").unwrap_or_else(|| "previous".to_owned()),
            }),
        })
    }

    /// The kube client configuration of `KUBECONFIG`; panics naming the file if it is unusable.
    pub async fn kube_config(&self) -> kube::Config {
        let options = kube::config::KubeConfigOptions::default();
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.kubeconfig)
            .unwrap_or_else(|e| panic!("KUBECONFIG {}: {e}", self.kubeconfig.display()));
        kube::Config::from_custom_kubeconfig(kubeconfig, &options)
            .await
            .unwrap_or_else(|e| panic!("KUBECONFIG {}: {e}", self.kubeconfig.display()))
    }

    /// A kube client of `KUBECONFIG`.
    pub async fn kube_client(&self) -> kube::Client {
        kube::Client::try_from(self.kube_config().await).expect("a kube client")
    }

    pub fn operator_image(&self) -> String {
        format!("leasehold/operator:{}", self.image_tag)
    }

    pub fn sidecar_image(&self) -> String {
        format!("leasehold/sidecar:{}", self.image_tag)
    }

    pub fn agent_image(&self) -> String {
        format!("leasehold/demo-agent:{}", self.image_tag)
    }

    /// The Python reference agent (`sdk/python/examples/demo_agent.py`).
    pub fn python_agent_image(&self) -> String {
        format!("leasehold/python-agent:{}", self.image_tag)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| map.get(name).cloned()
    }

    const BASE: [(&str, &str); 3] = [
        ("KUBECONFIG", "/k/admin.conf"),
        ("LEASEHOLD_E2E_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
        ("LEASEHOLD_E2E_POD_DATABASE_URL", "postgres://leasehold:pw@10.88.0.1:5432/"),
    ];

    #[test]
    fn defaults_apply_and_relative_paths_resolve_against_the_root() {
        let s = Settings::from_lookup(lookup(&BASE), Path::new("/repo")).unwrap();
        assert_eq!(s.image_tag, "e2e");
        assert_eq!(s.chart, PathBuf::from("/repo/charts/leasehold"));
        assert_eq!(s.helm, "helm");
        assert_eq!(s.helm_values, None);
        assert_eq!(s.operator_bin, None);
        assert_eq!(s.previous, None);
        assert_eq!(s.pod_database_url, "postgres://leasehold:pw@10.88.0.1:5432", "trailing slash dropped");
        assert_eq!(s.sidecar_image(), "leasehold/sidecar:e2e");
        assert_eq!(s.python_agent_image(), "leasehold/python-agent:e2e");
    }

    #[test]
    fn a_missing_variable_is_named_in_one_line() {
        for missing in ["KUBECONFIG", "LEASEHOLD_E2E_DATABASE_URL", "LEASEHOLD_E2E_POD_DATABASE_URL"] {
            let vars: Vec<_> = BASE.iter().copied().filter(|(k, _)| *k != missing).collect();
            let err = Settings::from_lookup(lookup(&vars), Path::new("/repo")).unwrap_err();
            assert!(err.starts_with(missing), "{err}");
            assert!(!err.contains('\n'));
        }
        let mut vars = BASE.to_vec();
        vars[0] = ("KUBECONFIG", "  ");
        assert!(Settings::from_lookup(lookup(&vars), Path::new("/")).unwrap_err().starts_with("KUBECONFIG"));
    }

    #[test]
    fn overrides_are_taken() {
        let mut vars = BASE.to_vec();
        vars.extend([
            ("LEASEHOLD_E2E_IMAGE_TAG", "abc"),
            ("LEASEHOLD_E2E_CHART", "/c"),
            ("LEASEHOLD_E2E_HELM", "/bin/helm"),
            ("LEASEHOLD_E2E_HELM_VALUES", "v.yaml"),
            ("LEASEHOLD_E2E_OPERATOR_BIN", "/t/release/leasehold-operator"),
            ("LEASEHOLD_E2E_PREVIOUS_CHART", "prev/charts/leasehold"),
        ]);
        let s = Settings::from_lookup(lookup(&vars), Path::new("/repo")).unwrap();
        assert_eq!(s.agent_image(), "leasehold/demo-agent:abc");
        assert_eq!(s.chart, PathBuf::from("/c"));
        assert_eq!(s.helm, "/bin/helm");
        assert_eq!(s.helm_values, Some(PathBuf::from("/repo/v.yaml")));
        assert_eq!(s.operator_bin, Some(PathBuf::from("/t/release/leasehold-operator")));
        let previous = s.previous.expect("a previous version");
        assert_eq!(previous.chart, PathBuf::from("/repo/prev/charts/leasehold"));
        assert_eq!(previous.image_tag, "previous", "the default tag of the previous images");
    }
}
