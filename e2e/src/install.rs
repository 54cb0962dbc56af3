//! The operator is installed once per test process, with the chart, as a user would:
//! the chart's CRD applied server-side first (Helm installs a CRD only on the first
//! install and never upgrades it), then `helm upgrade --install`. The upgrade scenario
//! installs the previous version's chart first and upgrades from it the same way.

use std::{path::Path, process::Command, sync::OnceLock};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    api::{Patch, PatchParams},
    Api, CustomResourceExt,
};
use leasehold_crds::AgentCluster;

use crate::settings::{Previous, Settings};

/// Release and namespace of the operator.
pub const RELEASE: &str = "leasehold";
pub const NAMESPACE: &str = "leasehold-system";

static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

/// The `helm upgrade --install` arguments of this version's chart and images (pure;
/// unit-tested).
pub fn helm_args(settings: &Settings) -> Vec<String> {
    chart_args(settings, &settings.chart, &settings.image_tag)
}

/// The `helm upgrade --install` arguments of `chart` with images tagged `tag`.
fn chart_args(settings: &Settings, chart: &Path, tag: &str) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "upgrade".into(),
        "--install".into(),
        RELEASE.into(),
        chart.display().to_string(),
        "-n".into(),
        NAMESPACE.into(),
        "--create-namespace".into(),
        "--set".into(),
        format!("image.tag={tag}"),
        "--set".into(),
        "image.pullPolicy=Never".into(),
        "--set".into(),
        format!("sidecarImage.tag={tag}"),
        "--set".into(),
        "replicaCount=1".into(),
    ];
    if let Some(values) = &settings.helm_values {
        args.extend(["-f".into(), values.display().to_string()]);
    }
    args.extend(["--wait".into(), "--timeout".into(), "5m".into()]);
    args
}

fn helm(settings: &Settings, args: &[String]) -> Result<(), String> {
    if let Some(values) = &settings.helm_values {
        if !values.exists() {
            return Err(format!("LEASEHOLD_E2E_HELM_VALUES names {} which does not exist", values.display()));
        }
    }
    eprintln!("e2e: {} {}", settings.helm, args.join(" "));
    let started = std::time::Instant::now();
    let output = Command::new(&settings.helm)
        .args(args)
        .env("KUBECONFIG", &settings.kubeconfig)
        .output()
        .map_err(|e| format!("cannot run {} (LEASEHOLD_E2E_HELM): {e}", settings.helm))?;
    if !output.status.success() {
        return Err(format!(
            "helm upgrade --install failed ({}):\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    eprintln!("e2e: helm done in {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// This version's CRD, applied server-side with the force a user's
/// `kubectl apply --server-side --force-conflicts -f charts/leasehold/crds/agentcluster.yaml`
/// has (the chart's file is generated from the same type; a crds test keeps them equal).
pub async fn apply_crd(client: &kube::Client) -> Result<(), String> {
    let crd = AgentCluster::crd();
    let name = crd.metadata.name.clone().unwrap_or_default();
    Api::<CustomResourceDefinition>::all(client.clone())
        .patch(&name, &PatchParams::apply("leasehold-e2e").force(), &Patch::Apply(&crd))
        .await
        .map_err(|e| format!("applying the CRD {name}: {e}"))?;
    Ok(())
}

/// The CRD first, then this version's chart.
fn install(settings: &Settings) -> Result<(), String> {
    let handle = tokio::runtime::Handle::current();
    handle.block_on(async {
        let client = settings.kube_client().await;
        apply_crd(&client).await
    })?;
    helm(settings, &helm_args(settings))
}

/// Install (or upgrade to) this version's CRD and chart the first time any test asks;
/// later calls return the first result. Panics if the install failed.
pub async fn ensure_installed(settings: &Settings) {
    let settings = settings.clone();
    let result = tokio::task::spawn_blocking(move || INSTALLED.get_or_init(|| install(&settings)).clone())
        .await
        .expect("install task");
    if let Err(e) = result {
        panic!("installing the operator: {e}");
    }
}

/// Install the previous version's chart (its CRD with it: Helm installs a chart's CRDs on
/// its first install) into a cluster that has no release yet. Panics with the reason if
/// a release is there already: the upgrade must start from the previous version alone,
/// so its scenario runs first, in a test process of its own (`scripts/e2e.sh` does).
pub async fn install_previous(settings: &Settings, previous: &Previous) {
    if INSTALLED.get().is_some() {
        panic!("this test process installed the current chart already; run the upgrade scenario on its own, first");
    }
    let client = settings.kube_client().await;
    let crds = Api::<CustomResourceDefinition>::all(client);
    let name = AgentCluster::crd().metadata.name.unwrap_or_default();
    if crds.get_opt(&name).await.expect("read the CRDs").is_some() {
        panic!(
            "the CRD {name} is installed already: the upgrade scenario needs a cluster without leasehold \
             (scripts/e2e.sh runs it first on a fresh cluster)"
        );
    }
    let (settings, previous) = (settings.clone(), previous.clone());
    let result = tokio::task::spawn_blocking(move || {
        helm(&settings, &chart_args(&settings, &previous.chart, &previous.image_tag))
    })
    .await
    .expect("install task");
    if let Err(e) = result {
        panic!("installing the previous chart: {e}");
    }
}

/// Upgrade from the previous chart as docs/operations.md says: this version's CRD first,
/// then `helm upgrade`. Later `ensure_installed` calls of this process find it done.
pub async fn upgrade_to_current(settings: &Settings) {
    let s = settings.clone();
    let result = tokio::task::spawn_blocking(move || install(&s)).await.expect("upgrade task");
    if let Err(e) = &result {
        panic!("upgrading to the current chart: {e}");
    }
    let _ = INSTALLED.set(result);
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn args_pin_images_and_pass_the_values_file() {
        let mut settings = Settings {
            kubeconfig: "/k".into(),
            database_url: String::new(),
            pod_database_url: String::new(),
            image_tag: "t1".into(),
            chart: "/repo/charts/leasehold".into(),
            helm: "helm".into(),
            helm_values: None,
            operator_bin: None,
            previous: None,
        };
        let joined = helm_args(&settings).join(" ");
        assert_eq!(
            joined,
            "upgrade --install leasehold /repo/charts/leasehold -n leasehold-system --create-namespace \
             --set image.tag=t1 --set image.pullPolicy=Never --set sidecarImage.tag=t1 \
             --set replicaCount=1 --wait --timeout 5m"
        );
        settings.helm_values = Some(PathBuf::from("/v.yaml"));
        assert!(helm_args(&settings).join(" ").contains("replicaCount=1 -f /v.yaml --wait"));
    }
}
