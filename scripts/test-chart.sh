#!/usr/bin/env bash
# Lint and render the Helm chart charts/leasehold, then check what it renders:
# the set of objects, the exact RBAC rules, the labels, the operator Deployment,
# the --watch-namespace switch, the example AgentCluster against the CRD, that
# the values schema rejects bad values, and the monitoring objects: the PodMonitors, the
# Grafana dashboard, and the PrometheusRule, whose rules promtool checks and unit-tests
# (files/prometheus-rules.test.yaml). Needs no cluster.
# Ends with "N passed, M failed"; exits non-zero when anything failed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
chart_src="$root/charts/leasehold"
release=leasehold
namespace=leasehold-system
# Lint and render for the oldest Kubernetes the chart supports (Chart.yaml kubeVersion).
kube=(--kube-version 1.33.0)

helm=$("$root/scripts/ensure-helm.sh")
echo "helm: $helm ($("$helm" version --short))"
promtool=$("$root/scripts/ensure-promtool.sh")
echo "promtool: $promtool ($("$promtool" --version 2>&1 | head -1))"

if ! python3 -c 'import yaml' 2>/dev/null; then
  echo "installing PyYAML" >&2
  python3 -m pip install -q pyyaml >&2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Work on a copy, so that a placeholder CRD never lands in the repository.
chart="$tmp/leasehold"
cp -r "$chart_src" "$chart"
if [ -f "$chart_src/crds/agentcluster.yaml" ]; then
  crd_kind=real
else
  crd_kind=placeholder
  echo "note: charts/leasehold/crds/agentcluster.yaml is missing; testing with a placeholder CRD in $tmp"
  mkdir -p "$chart/crds"
  cat >"$chart/crds/agentcluster.yaml" <<'EOF'
# Placeholder written by scripts/test-chart.sh into a temporary copy of the chart.
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: agentclusters.leasehold.dev
spec:
  group: leasehold.dev
  scope: Namespaced
  names:
    kind: AgentCluster
    listKind: AgentClusterList
    plural: agentclusters
    singular: agentcluster
    shortNames: [ac]
  versions:
    - name: v1alpha1
      served: true
      storage: true
      subresources:
        status: {}
      schema:
        openAPIV3Schema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
EOF
fi

passed=0
failed=0
pass() { passed=$((passed + 1)); echo "PASS $*"; }
fail() { failed=$((failed + 1)); echo "FAIL $*"; }

# render NAME ARGS...: helm template into $tmp/NAME.yaml; a failure is a failed check.
render() {
  local name=$1
  shift
  if "$helm" template "$release" "$chart" --namespace "$namespace" "${kube[@]}" "$@" \
    >"$tmp/$name.yaml" 2>"$tmp/$name.err"; then
    pass "helm template ($name) $*"
  else
    fail "helm template ($name) $*: $(cat "$tmp/$name.err")"
    : >"$tmp/$name.yaml"
  fi
}

# expect_rejected ARGS...: helm template must fail, and because of the values schema.
expect_rejected() {
  if "$helm" template "$release" "$chart" --namespace "$namespace" "${kube[@]}" "$@" \
    >/dev/null 2>"$tmp/rejected.err"; then
    fail "schema rejects $*: helm template succeeded"
  elif grep -qi schema "$tmp/rejected.err"; then
    pass "schema rejects $*"
  else
    fail "schema rejects $*: failed, but not because of the schema: $(head -c 400 "$tmp/rejected.err")"
  fi
}

# --- lint ---------------------------------------------------------------------
if "$helm" lint --strict "$chart" "${kube[@]}" >"$tmp/lint.out" 2>&1; then
  pass "helm lint --strict"
else
  fail "helm lint --strict:"
  sed 's/^/    /' "$tmp/lint.out"
fi
if "$helm" lint --strict "$chart" "${kube[@]}" --set watchNamespace=team-a >"$tmp/lint.out" 2>&1; then
  pass "helm lint --strict --set watchNamespace=team-a"
else
  fail "helm lint --strict --set watchNamespace=team-a:"
  sed 's/^/    /' "$tmp/lint.out"
fi

# --- renderings the python checks read ----------------------------------------
render default
render watch --set watchNamespace=team-a
render crds --include-crds
render monitoring --set 'networkPolicy.monitoringNamespaceLabels.kubernetes\.io/metadata\.name=monitoring' \
  --set networkPolicy.monitoringPodLabels.app=prometheus
render custom --set metrics.port=9090 --set metrics.service.enabled=false \
  --set-string image.tag=1.2.3 --set-string sidecarImage.tag=4.5.6 --set logLevel=debug \
  --set serviceAccount.create=false --set serviceAccount.name=existing-sa \
  --set 'extraEnv[0].name=KUBERNETES_SERVICE_HOST' --set-string 'extraEnv[0].value=10.1.2.3'
render postgresca --set postgresCA.secretName=pg-ca --set postgresCA.key=root.pem
render monitors --set monitoring.podMonitors.enabled=true --set monitoring.prometheusRule.enabled=true \
  --set monitoring.dashboard.enabled=true --set monitoring.labels.release=kube-prometheus
render monitors-watch --set monitoring.podMonitors.enabled=true --set watchNamespace=team-a \
  --set monitoring.dashboard.enabled=true --set monitoring.dashboard.namespace=grafana
# NOTES.txt: helm renders it only on install, which needs a cluster even with
# --dry-run=client. So a second copy of the chart wraps it in a named template and
# renders it into a ConfigMap that helm template prints.
notes_chart="$tmp/notes/leasehold"
mkdir -p "$tmp/notes"
cp -r "$chart" "$notes_chart"
{
  echo '{{- define "leasehold.test.notes" -}}'
  cat "$chart/templates/NOTES.txt"
  echo '{{- end }}'
} >"$notes_chart/templates/_test_notes.tpl"
cat >"$notes_chart/templates/test-notes.yaml" <<'EOF'
apiVersion: v1
kind: ConfigMap
metadata:
  name: test-notes
data:
  NOTES.txt: {{ include "leasehold.test.notes" . | quote }}
EOF
for variant in notes notes-watch; do
  extra=()
  [ "$variant" = notes-watch ] && extra=(--set watchNamespace=team-a)
  if "$helm" template "$release" "$notes_chart" --namespace "$namespace" "${kube[@]}" "${extra[@]}" \
    --show-only templates/test-notes.yaml >"$tmp/$variant.yaml" 2>"$tmp/$variant.err"; then
    pass "NOTES.txt renders ${extra[*]}"
  else
    fail "NOTES.txt renders ${extra[*]}: $(cat "$tmp/$variant.err")"
    : >"$tmp/$variant.yaml"
  fi
done

# --- values the schema must reject --------------------------------------------
expect_rejected --set replicaCount=-1
expect_rejected --set image.pullPolicy=Sometimes
expect_rejected --set metrics.port=70000
expect_rejected --set metrics.port=0
expect_rejected --set bogus=1
expect_rejected --set logLevel=verbose
expect_rejected --set image.bogus=1
expect_rejected --set sidecarImage.bogus=1
expect_rejected --set metrics.bogus=1
expect_rejected --set replicaCount=two
expect_rejected --set postgresCA.bogus=1
expect_rejected --set postgresCA.key=
expect_rejected --set monitoring.bogus=1
expect_rejected --set monitoring.podMonitors.interval=often
expect_rejected --set monitoring.prometheusRule.enabled=yes

# --- the rendered objects -------------------------------------------------------
cat >"$tmp/verify.py" <<'PYEOF'
"""Checks on the rendered chart. Prints one "PASS <what>" or "FAIL <what>: <why>" a line."""
import copy
import re
import sys

import yaml

tmp, chart, release, namespace, crd_kind = sys.argv[1:6]
FULLNAME = "leasehold"  # release "leasehold" contains the chart name
VERSION = "0.1.0"


def load(name):
    with open(f"{tmp}/{name}.yaml") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def check(what, ok, why=""):
    print(f"PASS {what}" if ok else f"FAIL {what}: {why}")


def by_kind(objs):
    return {o["kind"]: o for o in objs}


def rule_set(rules):
    """Rules as a set, each rule order-insensitive inside (apiGroups, resources, verbs)."""
    out = set()
    for r in rules:
        extra = set(r) - {"apiGroups", "resources", "verbs"}
        out.add((frozenset(r.get("apiGroups", [])), frozenset(r.get("resources", [])),
                 frozenset(r.get("verbs", [])), frozenset(extra)))
    return out


def rule(groups, resources, verbs):
    return (frozenset(groups), frozenset(resources), frozenset(verbs), frozenset())


def show(rules):
    """Rules from rule_set, legibly, for failure messages."""
    return "; ".join(
        f"apiGroups={sorted(g)} resources={sorted(r)} verbs={sorted(v)}"
        + (f" other fields={sorted(x)}" if x else "")
        for g, r, v, x in sorted(rules, key=lambda t: (sorted(t[0]), sorted(t[1])))) or "none"


READ_CREATE_PATCH = ["list", "watch", "create", "patch"]
CLUSTER_RULES = {
    rule(["leasehold.dev"], ["agentclusters"], ["get", "list", "watch"]),
    rule(["leasehold.dev"], ["agentclusters/status"], ["patch"]),
    rule(["leasehold.dev"], ["agentclusters/finalizers"], ["update"]),
    rule(["apps"], ["deployments"], READ_CREATE_PATCH),
    rule([""], ["services"], READ_CREATE_PATCH),
    # delete: spec.disruptionBudget.enabled=false removes the budget it made
    rule(["policy"], ["poddisruptionbudgets"], READ_CREATE_PATCH + ["delete"]),
    rule(["networking.k8s.io"], ["networkpolicies"], READ_CREATE_PATCH),
    rule([""], ["secrets"], ["get", "list", "watch", "create"]),
    rule([""], ["pods"], ["list", "watch", "patch"]),
    rule(["events.k8s.io"], ["events"], ["create", "patch"]),
}
ROLE_RULES = {rule(["coordination.k8s.io"], ["leases"], ["get", "create", "update"])}

SELECTOR = {
    "app.kubernetes.io/name": "leasehold",
    "app.kubernetes.io/instance": release,
    "app.kubernetes.io/component": "operator",
}
LABELS = dict(SELECTOR, **{
    "app.kubernetes.io/version": VERSION,
    "app.kubernetes.io/managed-by": "Helm",
    "helm.sh/chart": f"leasehold-{VERSION}",
})
CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
NAMESPACED = {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}


def operator_container(objs):
    pod = by_kind(objs)["Deployment"]["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "operator")


def expected_args(port=8080, sidecar=f"leasehold/sidecar:{VERSION}", level="info"):
    return ["--metrics-listen", f"0.0.0.0:{port}", "--sidecar-image", sidecar,
            "--log-level", level]


default = load("default")
objs = by_kind(default)

# The set of objects.
kinds = sorted(o["kind"] for o in default)
want = sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
               "Deployment", "Service"])
check("default rendering is exactly ServiceAccount, ClusterRole, ClusterRoleBinding, Role, "
      "RoleBinding, Deployment, Service", kinds == want, f"got {kinds}")

# Labels and namespaces.
for o in default:
    labels = o["metadata"].get("labels", {})
    missing = {k: v for k, v in LABELS.items() if labels.get(k) != v}
    check(f"{o['kind']} carries the standard labels", not missing,
          f"wrong or missing {missing}; has {labels}")
    if o["kind"] in NAMESPACED:
        check(f"{o['kind']} is in the release namespace",
              o["metadata"].get("namespace") == namespace, o["metadata"].get("namespace"))

# RBAC.
cr, role = objs.get("ClusterRole", {}), objs.get("Role", {})
got = rule_set(cr.get("rules", []))
check("ClusterRole rules are exactly the operator's", got == CLUSTER_RULES and
      len(cr.get("rules", [])) == len(CLUSTER_RULES),
      f"extra: {show(got - CLUSTER_RULES)} | missing: {show(CLUSTER_RULES - got)}")
got = rule_set(role.get("rules", []))
check("Role rules are exactly leader election's", got == ROLE_RULES and
      len(role.get("rules", [])) == len(ROLE_RULES),
      f"extra: {show(got - ROLE_RULES)} | missing: {show(ROLE_RULES - got)}")
sa = objs["ServiceAccount"]["metadata"]["name"]
for kind, ref in [("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")]:
    b = objs[kind]
    check(f"{kind} binds the {ref} to the operator ServiceAccount",
          b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": ref,
                           "name": objs[ref]["metadata"]["name"]}
          and b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
          f"roleRef {b['roleRef']}, subjects {b['subjects']}")

# The operator Deployment.
dep = objs["Deployment"]
spec = dep["spec"]
pod = spec["template"]["spec"]
c = operator_container(default)
check("Deployment runs 2 replicas by default", spec.get("replicas") == 2, spec.get("replicas"))
check("Deployment selector is the selector labels only",
      spec["selector"] == {"matchLabels": SELECTOR}, spec["selector"])
tlabels = spec["template"]["metadata"]["labels"]
check("pod template carries the standard labels",
      all(tlabels.get(k) == v for k, v in LABELS.items()), tlabels)
check("pod uses the operator ServiceAccount", pod.get("serviceAccountName") == sa,
      pod.get("serviceAccountName"))
check("pod automounts the ServiceAccount token", pod.get("automountServiceAccountToken") is True,
      pod.get("automountServiceAccountToken"))
check("pod terminationGracePeriodSeconds is 30", pod.get("terminationGracePeriodSeconds") == 30,
      pod.get("terminationGracePeriodSeconds"))
check("pod securityContext is runAsNonRoot, fsGroup 65532",
      pod.get("securityContext") == {"runAsNonRoot": True, "fsGroup": 65532},
      pod.get("securityContext"))
check("one container, named operator", [x["name"] for x in pod["containers"]] == ["operator"],
      [x["name"] for x in pod["containers"]])
check("operator image defaults to leasehold/operator:<appVersion>",
      c["image"] == f"leasehold/operator:{VERSION}" and c.get("imagePullPolicy") == "IfNotPresent",
      f"{c['image']} {c.get('imagePullPolicy')}")
check("operator args are metrics-listen, sidecar-image, log-level",
      c["args"] == expected_args(), c["args"])
check("--watch-namespace is absent by default", "--watch-namespace" not in c["args"], c["args"])
env = {e["name"]: e for e in c.get("env", [])}
for name, field in [("POD_NAMESPACE", "metadata.namespace"), ("POD_NAME", "metadata.name")]:
    check(f"env {name} comes from {field}",
          env.get(name, {}).get("valueFrom") == {"fieldRef": {"fieldPath": field}}, env.get(name))
check("container port metrics is 8080",
      c.get("ports") == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}],
      c.get("ports"))
for probe in ("readinessProbe", "livenessProbe"):
    check(f"{probe} is GET /healthz on port metrics",
          c.get(probe, {}).get("httpGet") == {"path": "/healthz", "port": "metrics"}, c.get(probe))
check("container securityContext is locked down", c.get("securityContext") == CONTAINER_SECURITY,
      c.get("securityContext"))
check("container resources are the defaults",
      c.get("resources") == {"requests": {"cpu": "50m", "memory": "64Mi"},
                             "limits": {"memory": "256Mi"}}, c.get("resources"))

# The metrics Service.
svc = objs["Service"]["spec"]
check("Service selects the operator pods by the selector labels", svc.get("selector") == SELECTOR,
      svc.get("selector"))
check("Service exposes port metrics 8080 -> metrics",
      svc.get("ports") == [{"name": "metrics", "port": 8080, "targetPort": "metrics",
                            "protocol": "TCP"}], svc.get("ports"))

# --watch-namespace only when set; then the operator's permissions are a Role in that
# namespace, none cluster-wide.
watch = load("watch")
if watch:
    args = operator_container(watch)["args"]
    check("--set watchNamespace=team-a appends --watch-namespace team-a",
          args == expected_args() + ["--watch-namespace", "team-a"], args)
    watch_kinds = sorted(o["kind"] for o in watch)
    check("watchNamespace: no ClusterRole or ClusterRoleBinding, two Roles and RoleBindings",
          watch_kinds == sorted(["ServiceAccount", "Role", "RoleBinding", "Role", "RoleBinding",
                                 "Deployment", "Service"]), watch_kinds)
    scoped = [o for o in watch if o["kind"] == "Role" and o["metadata"].get("namespace") == "team-a"]
    check("watchNamespace: the operator's rules are a Role in team-a, exactly",
          len(scoped) == 1 and rule_set(scoped[0]["rules"]) == CLUSTER_RULES,
          [o["metadata"] for o in scoped])
    bound = [o for o in watch if o["kind"] == "RoleBinding" and o["metadata"].get("namespace") == "team-a"]
    check("watchNamespace: a RoleBinding in team-a binds it to the operator ServiceAccount",
          len(bound) == 1 and bound[0]["roleRef"]["kind"] == "Role"
          and bound[0]["subjects"][0]["namespace"] == namespace, [o.get("roleRef") for o in bound])

# The monitoring stack the admin ports admit reaches the operator's flags; the
# operator's pods carry the label the admin ports admit it by.
monitoring = load("monitoring")
if monitoring:
    args = operator_container(monitoring)["args"]
    check("networkPolicy monitoring labels become the operator's flags",
          args == expected_args() + ["--monitoring-namespace-labels", "kubernetes.io/metadata.name=monitoring",
                                     "--monitoring-pod-labels", "app=prometheus"], args)
default_pod = [o for o in load("default") if o["kind"] == "Deployment"][0]["spec"]["template"]
check("operator pods carry leasehold.dev/role=operator (admitted to admin ports)",
      default_pod["metadata"]["labels"].get("leasehold.dev/role") == "operator", default_pod["metadata"]["labels"])

# Overridden values reach the objects.
custom = load("custom")
if custom:
    cobjs = by_kind(custom)
    kinds = sorted(cobjs)
    check("metrics.service.enabled=false and serviceAccount.create=false drop Service and "
          "ServiceAccount", "Service" not in cobjs and "ServiceAccount" not in cobjs, kinds)
    cc = operator_container(custom)
    check("overrides reach the operator container",
          cc["image"] == "leasehold/operator:1.2.3"
          and cc["args"] == expected_args(9090, "leasehold/sidecar:4.5.6", "debug")
          and cc["ports"][0]["containerPort"] == 9090, f"{cc['image']} {cc['args']}")
    check("extraEnv is appended to the operator's env",
          cc["env"][-1] == {"name": "KUBERNETES_SERVICE_HOST", "value": "10.1.2.3"}
          and [e["name"] for e in cc["env"][:2]] == ["POD_NAMESPACE", "POD_NAME"], cc["env"])
    cpod = cobjs["Deployment"]["spec"]["template"]["spec"]
    subjects = cobjs["ClusterRoleBinding"]["subjects"] + cobjs["RoleBinding"]["subjects"]
    check("serviceAccount.name is used by the pod and both bindings",
          cpod["serviceAccountName"] == "existing-sa"
          and all(s["name"] == "existing-sa" for s in subjects), subjects)

# The databases' CA: nothing by default; with postgresCA.secretName, a read-only mount at
# the sidecars' path, named by PGSSLROOTCERT, and PGSSLMODE=verify-full.
default_spec = default_pod["spec"]
default_env = [e["name"] for e in default_spec["containers"][0]["env"]]
check("no CA mount and no PGSSL* env by default",
      "volumes" not in default_spec and "volumeMounts" not in default_spec["containers"][0]
      and not any(n.startswith("PGSSL") for n in default_env), default_env)
postgresca = load("postgresca")
if postgresca:
    ppod = by_kind(postgresca)["Deployment"]["spec"]["template"]["spec"]
    pc = operator_container(postgresca)
    check("postgresCA mounts its Secret's key as ca.crt",
          ppod.get("volumes") == [{"name": "postgres-ca", "secret": {
              "secretName": "pg-ca", "items": [{"key": "root.pem", "path": "ca.crt"}]}}], ppod.get("volumes"))
    check("postgresCA is mounted read-only at /etc/leasehold/postgres-ca",
          pc.get("volumeMounts") == [{"name": "postgres-ca", "mountPath": "/etc/leasehold/postgres-ca",
                                      "readOnly": True}], pc.get("volumeMounts"))
    check("postgresCA sets PGSSLROOTCERT to the file and PGSSLMODE=verify-full",
          {"name": "PGSSLROOTCERT", "value": "/etc/leasehold/postgres-ca/ca.crt"} in pc["env"]
          and {"name": "PGSSLMODE", "value": "verify-full"} in pc["env"], pc["env"])

# NOTES.txt.
def notes(name):
    docs = load(name)
    return docs[0]["data"]["NOTES.txt"] if docs else ""


text = notes("notes")
for needle in ("create secret generic leasehold-db", "DATABASE_URL=",
               "apply -f charts/leasehold/examples/agentcluster.yaml", "get ac"):
    check(f"NOTES.txt tells {needle!r}", needle in text, f"not in:\n{text}")
check("NOTES.txt creates the Secret before applying the example, then gets ac",
      0 <= text.find("create secret") < text.find("apply -f") < text.find("get ac"), text)
text = notes("notes-watch")
check("with watchNamespace=team-a, NOTES.txt works in namespace team-a",
      "-n team-a create secret" in text and "-n team-a apply -f" in text
      and "-n team-a get ac" in text, text)

# The monitoring objects: none by default (the exact default set above), all three on.
monitors = load("monitors")
if monitors:
    import json
    kinds = sorted(o["kind"] for o in monitors)
    check("monitoring on adds two PodMonitors, a PrometheusRule and a dashboard ConfigMap",
          kinds == sorted(want + ["PodMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"]), kinds)
    pms = {o["metadata"]["name"]: o for o in monitors if o["kind"] == "PodMonitor"}
    op, sc = pms.get(f"{FULLNAME}-operator", {}), pms.get(f"{FULLNAME}-sidecars", {})
    check("the operator PodMonitor selects the operator pods' metrics port in the release namespace",
          op.get("spec", {}).get("selector") == {"matchLabels": SELECTOR}
          and op["spec"].get("namespaceSelector") == {"matchNames": [namespace]}
          and [(e["port"], e["path"]) for e in op["spec"]["podMetricsEndpoints"]] == [("metrics", "/metrics")],
          op.get("spec"))
    check("the sidecar PodMonitor selects the AgentCluster pods' admin port in every namespace",
          sc.get("spec", {}).get("selector") == {"matchLabels": {"app.kubernetes.io/name": "leasehold-agent",
                                                                 "app.kubernetes.io/managed-by": "leasehold-operator"}}
          and sc["spec"].get("namespaceSelector") == {"any": True}
          and [(e["port"], e["path"]) for e in sc["spec"]["podMetricsEndpoints"]] == [("admin", "/metrics")],
          sc.get("spec"))
    for o in monitors:
        if o["kind"] in ("PodMonitor", "PrometheusRule"):
            check(f"{o['kind']} {o['metadata']['name']} carries monitoring.labels",
                  o["metadata"]["labels"].get("release") == "kube-prometheus", o["metadata"]["labels"])
    rule = next((o for o in monitors if o["kind"] == "PrometheusRule"), {})
    with open(f"{chart}/files/prometheus-rules.yaml") as f:
        source = yaml.safe_load(f)
    check("the PrometheusRule's groups are files/prometheus-rules.yaml's",
          rule.get("spec") == {"groups": source["groups"]}, rule.get("spec"))
    # The rules as Prometheus loads them, for promtool.
    with open(f"{tmp}/rules.yaml", "w") as f:
        yaml.safe_dump(rule.get("spec", {}), f, sort_keys=False)
    cm = next((o for o in monitors if o["kind"] == "ConfigMap"), {"metadata": {}, "data": {}})
    try:
        dash = json.loads(cm["data"].get("leasehold.json", ""))
    except ValueError as e:
        dash = {"error": str(e)}
    check("the dashboard ConfigMap holds files/dashboard.json, labelled grafana_dashboard=1",
          cm["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
          and dash == json.load(open(f"{chart}/files/dashboard.json")) and dash.get("panels"),
          cm["metadata"])
watched = load("monitors-watch")
if watched:
    sc = next((o for o in watched if o["kind"] == "PodMonitor" and o["metadata"]["name"].endswith("-sidecars")), {})
    check("with watchNamespace=team-a, the sidecar PodMonitor looks in team-a only",
          sc.get("spec", {}).get("namespaceSelector") == {"matchNames": ["team-a"]}, sc.get("spec"))
    cm = next((o for o in watched if o["kind"] == "ConfigMap"), {"metadata": {}})
    check("monitoring.dashboard.namespace places the dashboard ConfigMap",
          cm["metadata"].get("namespace") == "grafana", cm["metadata"])
    check("no PrometheusRule unless asked", not any(o["kind"] == "PrometheusRule" for o in watched),
          sorted(o["kind"] for o in watched))

# The CRD (generated by crdgen, or the placeholder) and the example against it.
crds = [o for o in load("crds") if o["kind"] == "CustomResourceDefinition"]
check(f"--include-crds adds exactly one CRD ({crd_kind})", len(crds) == 1, len(crds))
crd = crds[0] if crds else {"metadata": {}, "spec": {"names": {}, "versions": []}}
names = crd["spec"].get("names", {})
check(f"CRD ({crd_kind}) is agentclusters.leasehold.dev, kind AgentCluster, short name ac",
      crd["metadata"].get("name") == "agentclusters.leasehold.dev"
      and crd["spec"].get("group") == "leasehold.dev" and names.get("kind") == "AgentCluster"
      and "ac" in names.get("shortNames", []) and crd["spec"].get("scope") == "Namespaced",
      f"{crd['metadata'].get('name')} {crd['spec'].get('group')} {names}")
version = next((v for v in crd["spec"].get("versions", []) if v.get("name") == "v1alpha1"), {})
check(f"CRD ({crd_kind}) serves v1alpha1 with a status subresource",
      version.get("served") is True and "status" in version.get("subresources", {}),
      {k: version.get(k) for k in ("served", "storage", "subresources")})


def conform(value, schema, path, errors):
    """Structural check of value against a CRD openAPIV3Schema: types, required fields,
    enums, and no unknown fields (the API server would prune them)."""
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            errors.append(f"{path}: want int or string, got {value!r}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value!r} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value!r} > maximum {schema['maximum']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    kind = schema.get("type") or ("object" if "properties" in schema else None)
    if value is None:
        if not schema.get("nullable"):
            errors.append(f"{path}: null")
    elif kind == "object":
        if not isinstance(value, dict):
            errors.append(f"{path}: want object, got {value!r}")
            return
        props = schema.get("properties", {})
        for r in schema.get("required", []):
            if r not in value:
                errors.append(f"{path}.{r}: required")
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            if k in props:
                conform(v, props[k], f"{path}.{k}", errors)
            elif isinstance(extra, dict):
                conform(v, extra, f"{path}.{k}", errors)
            elif not (extra is True or schema.get("x-kubernetes-preserve-unknown-fields")
                      or (path.endswith(".metadata") and not props)):
                errors.append(f"{path}.{k}: unknown field")
    elif kind == "array":
        if not isinstance(value, list):
            errors.append(f"{path}: want array, got {value!r}")
            return
        for i, item in enumerate(value):
            conform(item, schema.get("items", {}), f"{path}[{i}]", errors)
    elif kind == "string" and not isinstance(value, str):
        errors.append(f"{path}: want string, got {value!r}")
    elif kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        errors.append(f"{path}: want integer, got {value!r}")
    elif kind == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        errors.append(f"{path}: want number, got {value!r}")
    elif kind == "boolean" and not isinstance(value, bool):
        errors.append(f"{path}: want boolean, got {value!r}")


with open(f"{chart}/examples/agentcluster.yaml") as f:
    example = [d for d in yaml.safe_load_all(f) if d]
check("examples/agentcluster.yaml is one AgentCluster leasehold.dev/v1alpha1 named demo",
      len(example) == 1 and example[0].get("apiVersion") == "leasehold.dev/v1alpha1"
      and example[0].get("kind") == "AgentCluster"
      and example[0].get("metadata", {}).get("name") == "demo",
      [(d.get("apiVersion"), d.get("kind")) for d in example])
if example:
    schema = version.get("schema", {}).get("openAPIV3Schema", {})
    body = {k: v for k, v in example[0].items() if k not in ("apiVersion", "kind", "metadata")}
    errors = []
    conform(body, schema, "AgentCluster", errors)
    check(f"examples/agentcluster.yaml conforms to the CRD schema ({crd_kind})", not errors,
          "; ".join(errors))

    def turns_errors(turns):
        """Errors of the example with `spec.turns` replaced by `turns`."""
        changed = copy.deepcopy(body)
        changed["spec"]["turns"] = turns
        found = []
        conform(changed, schema, "AgentCluster", found)
        return found

    if crd_kind == "real":
        edges = [{"multitask": "interrupt", "queueLimit": 1, "answerRetention": "5m", "maxAnswerBytes": 1},
                 {"multitask": "reject", "queueLimit": 10000, "maxAnswerBytes": 1 << 30}]
        found = [e for t in edges for e in turns_errors(t)]
        check("the CRD schema accepts spec.turns at its bounds", not found, "; ".join(found))
        for bad in [{"multitask": "parallel"}, {"queueLimit": 0}, {"queueLimit": 10001},
                    {"maxAnswerBytes": 0}, {"answerRetention": "soon"}]:
            check(f"the CRD schema refuses spec.turns {bad}", turns_errors(bad), "accepted")

# The kind walk-through's Postgres (docs/install.md): its Secret is the one the example reads.
with open(f"{chart}/examples/postgres.yaml") as f:
    pg = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(f) if d}
wanted = example[0]["spec"]["database"] if example else {}
secret = pg.get(("Secret", wanted.get("secretName")), {})
url = secret.get("stringData", {}).get(wanted.get("key"), "")
check("examples/postgres.yaml holds the Secret and key examples/agentcluster.yaml reads",
      url.startswith("postgres://") and "@postgres:5432/" in url, sorted(pg))
check("examples/postgres.yaml has a Deployment and a Service named postgres",
      ("Deployment", "postgres") in pg and ("Service", "postgres") in pg, sorted(pg))
PYEOF

if python3 "$tmp/verify.py" "$tmp" "$chart" "$release" "$namespace" "$crd_kind" >"$tmp/verify.out" 2>&1; then
  rc=0
else
  rc=$?
fi
while IFS= read -r line; do
  case $line in
    "PASS "*) pass "${line#PASS }" ;;
    "FAIL "*) fail "${line#FAIL }" ;;
    *) echo "$line" ;;
  esac
done <"$tmp/verify.out"
[ "$rc" -eq 0 ] || fail "verify.py crashed (exit $rc); see the output above"

# --- the alerts, as the chart renders them: promtool check and unit tests --------
if [ -s "$tmp/rules.yaml" ]; then
  if "$promtool" check rules "$tmp/rules.yaml" >"$tmp/promtool.out" 2>&1; then
    pass "promtool check rules (the rendered PrometheusRule: $(grep -c 'alert:' "$tmp/rules.yaml") alerts)"
  else
    fail "promtool check rules:"
    sed 's/^/    /' "$tmp/promtool.out"
  fi
  cp "$chart/files/prometheus-rules.test.yaml" "$tmp/rules.test.yaml"
  if "$promtool" test rules "$tmp/rules.test.yaml" >"$tmp/promtool.out" 2>&1; then
    pass "promtool test rules (files/prometheus-rules.test.yaml)"
  else
    fail "promtool test rules:"
    sed 's/^/    /' "$tmp/promtool.out"
  fi
else
  fail "no rendered PrometheusRule to check with promtool"
fi

[ "$failed" -eq 0 ] || echo "test-chart: $failed check(s) failed: see the lines starting with FAIL above"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
