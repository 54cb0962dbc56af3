//! The chart grants exactly the permissions the operator code declares it uses.

use std::{collections::BTreeSet, process::Command};

use leasehold_operator::rbac::{CLUSTER_RULES, NAMESPACE_RULES};
use serde::Deserialize;

type Rules = BTreeSet<(String, String, BTreeSet<String>)>;

fn declared(rules: &[(&str, &str, &[&str])]) -> Rules {
    rules
        .iter()
        .map(|(g, r, v)| (g.to_string(), r.to_string(), v.iter().map(|v| v.to_string()).collect()))
        .collect()
}

fn granted(doc: &serde_yaml::Value) -> Rules {
    let mut out = Rules::new();
    for rule in doc["rules"].as_sequence().expect("rules") {
        let strings = |k: &str| -> Vec<String> {
            rule[k].as_sequence().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect()
        };
        let verbs: BTreeSet<String> = strings("verbs").into_iter().collect();
        for group in strings("apiGroups") {
            for resource in strings("resources") {
                out.insert((group.clone(), resource, verbs.clone()));
            }
        }
    }
    out
}

/// The chart rendered with `extra` values: (kind, namespace, rules) of every role.
fn roles(extra: &[&str]) -> Vec<(String, Option<String>, Rules)> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let helm = Command::new(format!("{root}/scripts/ensure-helm.sh")).output().expect("ensure-helm runs");
    assert!(helm.status.success(), "{}", String::from_utf8_lossy(&helm.stderr));
    let helm = String::from_utf8(helm.stdout).unwrap().trim().to_owned();
    let rendered = Command::new(helm)
        .args(["template", "lh", &format!("{root}/charts/leasehold"), "--namespace", "leasehold-system"])
        .args(extra)
        .output()
        .expect("helm template runs");
    assert!(rendered.status.success(), "{}", String::from_utf8_lossy(&rendered.stderr));
    let text = String::from_utf8(rendered.stdout).unwrap();
    let mut roles = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let doc = serde_yaml::Value::deserialize(doc).unwrap();
        if let Some(kind @ ("ClusterRole" | "Role")) = doc["kind"].as_str() {
            let namespace = doc["metadata"]["namespace"].as_str().map(str::to_owned);
            roles.push((kind.to_owned(), namespace, granted(&doc)));
        }
    }
    roles
}

#[test]
fn the_chart_grants_exactly_what_the_operator_uses() {
    let roles = roles(&[]);
    let cluster_role = roles.iter().find(|(kind, ..)| kind == "ClusterRole").expect("a ClusterRole");
    assert_eq!(cluster_role.2, declared(CLUSTER_RULES));
    let role = roles.iter().find(|(kind, ..)| kind == "Role").expect("a Role");
    assert_eq!(role.2, declared(NAMESPACE_RULES));
}

/// With `watchNamespace`, the operator's permissions (Secrets included) exist only in
/// that namespace: no ClusterRole at all.
#[test]
fn a_watched_namespace_confines_the_operator_to_it() {
    let roles = roles(&["--set", "watchNamespace=team-a"]);
    assert!(roles.iter().all(|(kind, ..)| kind == "Role"), "{roles:?}");
    let in_team_a: Vec<_> = roles.iter().filter(|(_, ns, _)| ns.as_deref() == Some("team-a")).collect();
    assert_eq!(in_team_a.len(), 1);
    assert_eq!(in_team_a[0].2, declared(CLUSTER_RULES));
    let leader: Vec<_> =
        roles.iter().filter(|(_, ns, _)| ns.as_deref() == Some("leasehold-system")).collect();
    assert_eq!(leader.len(), 1);
    assert_eq!(leader[0].2, declared(NAMESPACE_RULES));
}
