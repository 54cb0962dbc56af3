#!/usr/bin/env bash
# Lint, type-check and test the Python SDK against real sidecars and a real Postgres.
#
#   sdk/python/run-tests.sh                 # everything
#   sdk/python/run-tests.sh -k stream -x    # arguments go to pytest
#
# The first run creates sdk/python/.venv and installs the package with its dev extras
# from PyPI; later runs reinstall only when pyproject.toml changed. The sidecar binary
# comes from $LEASEHOLD_BIN_DIR (default <repo>/target/debug: `cargo build --workspace
# --bins`). Postgres is a throwaway server from scripts/with-postgres.sh; every process
# the tests start is killed by its PID.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=$here/.venv

pick_python() {
  local candidate
  for candidate in ${PYTHON:-} python3.11 python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null &&
      "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
  echo "run-tests.sh: Python >= 3.11 is required" >&2
  exit 1
}

if [[ ! -x $venv/bin/python ]]; then
  python=$(pick_python)
  if ! "$python" -m venv "$venv" 2>/dev/null; then
    # Debian splits venv (ensurepip) out of python3.
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      rm -rf "$venv"
      "$python" -m venv "$venv"
    else
      echo "run-tests.sh: '$python -m venv' failed (install python3-venv)" >&2
      exit 1
    fi
  fi
fi
stamp=$venv/.installed
want=$(sha256sum "$here/pyproject.toml" | cut -d' ' -f1)
if [[ ! -f $stamp || $(<"$stamp") != "$want" ]]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e "$here[agent,langgraph,dev]"
  echo "$want" >"$stamp"
fi

export LEASEHOLD_BIN_DIR=${LEASEHOLD_BIN_DIR:-$repo/target/debug}
if [[ ! -x $LEASEHOLD_BIN_DIR/leasehold-sidecar ]]; then
  echo "run-tests.sh: $LEASEHOLD_BIN_DIR/leasehold-sidecar is missing:" \
    "build it (cargo build --workspace --bins) or set LEASEHOLD_BIN_DIR" >&2
  exit 1
fi

cd "$here"
echo "== ruff" >&2
"$venv/bin/ruff" check src tests examples
"$venv/bin/ruff" format --check src tests examples
echo "== mypy --strict src examples" >&2
"$venv/bin/mypy" --strict src examples
echo "== docs snippets" >&2
python3 "$repo/docs/check-snippets.py" sdk/python
echo "== pytest" >&2
# One test at a time: the cluster tests measure recovery against lease TTLs on 2 cores.
"$repo/scripts/with-postgres.sh" "$venv/bin/pytest" -rs "$@"
