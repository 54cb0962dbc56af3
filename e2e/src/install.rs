//! The operator is installed once per test process, with the chart, as a user would.

use std::{process::Command, sync::OnceLock};

use crate::settings::Settings;

/// Release and namespace of the operator.
pub const RELEASE: &str = "leasehold";
pub const NAMESPACE: &str = "leasehold-system";

static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

/// The `helm upgrade --install` arguments (pure; unit-tested).
pub fn helm_args(settings: &Settings) -> Vec<String> {
    let tag = &settings.image_tag;
    let mut args: Vec<String> = vec![
        "upgrade".into(),
        "--install".into(),
        RELEASE.into(),
        settings.chart.display().to_string(),
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

fn install(settings: &Settings) -> Result<(), String> {
    if let Some(values) = &settings.helm_values {
        if !values.exists() {
            return Err(format!("LEASEHOLD_E2E_HELM_VALUES names {} which does not exist", values.display()));
        }
    }
    let args = helm_args(settings);
    eprintln!("e2e: {} {}", settings.helm, args.join(" "));
    let started = std::time::Instant::now();
    let output = Command::new(&settings.helm)
        .args(&args)
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
    eprintln!("e2e: operator installed in {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Install (or upgrade) the chart the first time any test asks; later calls return the
/// first result. Panics if the install failed.
pub async fn ensure_installed(settings: &Settings) {
    let settings = settings.clone();
    let result = tokio::task::spawn_blocking(move || INSTALLED.get_or_init(|| install(&settings)).clone())
        .await
        .expect("install task");
    if let Err(e) = result {
        panic!("installing the operator: {e}");
    }
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
