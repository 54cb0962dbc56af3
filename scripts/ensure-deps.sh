#!/usr/bin/env bash
# Everything the build and the tests need on a fresh Debian machine. Idempotent; each
# step is a quick check when already done.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

# Rust toolchain (rustup is preinstalled on our machines; make sure cargo is on PATH).
if ! command -v cargo >/dev/null 2>&1 && [ -f "$HOME/.cargo/env" ]; then
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
command -v cargo >/dev/null || { echo "ensure-deps: cargo not found; install rustup" >&2; exit 1; }
for component in rustfmt clippy; do
  rustup component list --installed 2>/dev/null | grep -q "^$component" || rustup component add "$component" >&2
done

# PostgreSQL server binaries for the throwaway test databases.
"$here/ensure-postgres.sh" >/dev/null

# iptables for the fault test that partitions a peer port (it runs when root, as CI is);
# python3 for the fault tests' small agent; openssl for the certificates of the TLS tests.
if [ "$(id -u)" = 0 ]; then
  missing=()
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
  command -v python3 >/dev/null 2>&1 || missing+=(python3)
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "ensure-deps: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; }
  fi
fi

# promtool (pinned), for the chart test's `promtool check rules` / `promtool test rules`.
"$here/ensure-promtool.sh" >/dev/null
# Jaeger all-in-one, the real OpenTelemetry collector of the tracing test
# (localcluster/tests/tracing.rs); built once from its Go module, then cached.
"$here/ensure-jaeger.sh" >/dev/null
