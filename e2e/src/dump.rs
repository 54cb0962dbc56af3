//! What a failed scenario leaves on stderr: the AgentCluster, every pod's state, every
//! container's log, the namespace's events and the operator's log.

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::{
    api::{ListParams, LogParams},
    Api, ResourceExt,
};
use leasehold_crds::AgentCluster;

use crate::install;

fn compact<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| format!("<unserialisable: {e}>"))
}

async fn print_log(api: &Api<Pod>, pod: &str, container: &str, previous: bool, tail: Option<i64>) {
    let params = LogParams {
        container: Some(container.to_owned()),
        previous,
        tail_lines: tail,
        ..LogParams::default()
    };
    let which = if previous { " (previous)" } else { "" };
    match api.logs(pod, &params).await {
        Ok(log) => {
            eprintln!("----- log {pod}/{container}{which} -----");
            eprintln!("{}", log.trim_end());
        }
        Err(e) => eprintln!("----- log {pod}/{container}{which}: unavailable: {e}"),
    }
}

async fn dump_pods(api: &Api<Pod>, ns: &str, tail: Option<i64>) {
    let pods = match api.list(&ListParams::default()).await {
        Ok(list) => list.items,
        Err(e) => return eprintln!("cannot list pods in {ns}: {e}"),
    };
    for pod in &pods {
        let name = pod.name_any();
        let status = pod.status.clone().unwrap_or_default();
        eprintln!(
            "pod {name}: phase={} deleting={} ip={} annotations={}",
            status.phase.as_deref().unwrap_or("?"),
            pod.metadata.deletion_timestamp.is_some(),
            status.pod_ip.as_deref().unwrap_or("-"),
            compact(&pod.metadata.annotations),
        );
        for c in status.conditions.iter().flatten() {
            eprintln!(
                "  condition {}={} {} {}",
                c.type_,
                c.status,
                c.reason.as_deref().unwrap_or(""),
                c.message.as_deref().unwrap_or("")
            );
        }
        // The native sidecar's status is among the init containers'.
        for cs in
            status.init_container_statuses.iter().flatten().chain(status.container_statuses.iter().flatten())
        {
            eprintln!(
                "  container {} ready={} restarts={} state={} last={}",
                cs.name,
                cs.ready,
                cs.restart_count,
                compact(&cs.state),
                compact(&cs.last_state)
            );
        }
    }
    for pod in &pods {
        let name = pod.name_any();
        let restarted: Vec<String> = pod
            .status
            .iter()
            .flat_map(|s| {
                s.init_container_statuses.iter().flatten().chain(s.container_statuses.iter().flatten())
            })
            .filter(|cs| cs.restart_count > 0)
            .map(|cs| cs.name.clone())
            .collect();
        for container in
            pod.spec.iter().flat_map(|s| s.init_containers.iter().flatten().chain(s.containers.iter()))
        {
            if restarted.contains(&container.name) {
                print_log(api, &name, &container.name, true, tail).await;
            }
            print_log(api, &name, &container.name, false, tail).await;
        }
    }
}

/// Dump the state of namespace `ns` (and the operator's log) to stderr.
pub async fn dump(client: &kube::Client, ns: &str) {
    eprintln!("===== e2e failure dump: namespace {ns} =====");
    match Api::<AgentCluster>::namespaced(client.clone(), ns).list(&ListParams::default()).await {
        Ok(list) => {
            for ac in list.items {
                eprintln!(
                    "agentcluster {}: spec={} status={}",
                    ac.name_any(),
                    compact(&ac.spec),
                    compact(&ac.status)
                );
            }
        }
        Err(e) => eprintln!("cannot list agentclusters: {e}"),
    }
    dump_pods(&Api::namespaced(client.clone(), ns), ns, None).await;
    match Api::<Event>::namespaced(client.clone(), ns).list(&ListParams::default()).await {
        Ok(list) => {
            eprintln!("----- events in {ns} -----");
            let mut events = list.items;
            events.sort_by_key(|e| e.last_timestamp.clone().or(e.first_timestamp.clone()).map(|t| t.0));
            for e in events {
                eprintln!(
                    "{} {} {}/{}: {}",
                    e.type_.as_deref().unwrap_or("?"),
                    e.reason.as_deref().unwrap_or("?"),
                    e.involved_object.kind.as_deref().unwrap_or("?"),
                    e.involved_object.name.as_deref().unwrap_or("?"),
                    e.message.as_deref().unwrap_or("")
                );
            }
        }
        Err(e) => eprintln!("cannot list events: {e}"),
    }
    eprintln!("----- operator ({}) -----", install::NAMESPACE);
    dump_pods(&Api::namespaced(client.clone(), install::NAMESPACE), install::NAMESPACE, Some(300)).await;
    eprintln!("===== end of dump: namespace {ns} =====");
}
