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

#[test]
fn the_chart_grants_exactly_what_the_operator_uses() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let helm = Command::new(format!("{root}/scripts/ensure-helm.sh")).output().expect("ensure-helm runs");
    assert!(helm.status.success(), "{}", String::from_utf8_lossy(&helm.stderr));
    let helm = String::from_utf8(helm.stdout).unwrap().trim().to_owned();
    let rendered = Command::new(helm)
        .args(["template", "lh", &format!("{root}/charts/leasehold"), "--namespace", "leasehold-system"])
        .output()
        .expect("helm template runs");
    assert!(rendered.status.success(), "{}", String::from_utf8_lossy(&rendered.stderr));
    let text = String::from_utf8(rendered.stdout).unwrap();
    let mut cluster_role = None;
    let mut role = None;
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let doc = serde_yaml::Value::deserialize(doc).unwrap();
        match doc["kind"].as_str() {
            Some("ClusterRole") => cluster_role = Some(granted(&doc)),
            Some("Role") => role = Some(granted(&doc)),
            _ => {}
        }
    }
    assert_eq!(cluster_role.expect("a ClusterRole"), declared(CLUSTER_RULES));
    assert_eq!(role.expect("a Role"), declared(NAMESPACE_RULES));
}
