# leasehold — the entry points. `make` alone lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

.PHONY: help demo test test-unit test-sdk openapi test-fast e2e e2e-kind lint fmt bench bench-postgres deps build generate chart chaos chaos-selftest bench-centrifugo

help: ## list the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

deps: ## install what the build and tests need (idempotent, fast when done)
	@scripts/ensure-deps.sh

demo: deps build ## the whole system locally: Postgres, 3 sidecars + 3 demo agents, a narrated walk-through
	./target/debug/leasehold-demo

build: ## build every binary (sidecar, operator, demo agent, demo, crdgen)
	cargo build --workspace --bins --locked

test: ## the whole suite: test-unit, then e2e (what CI runs)
	$(MAKE) test-unit
	$(MAKE) e2e

test-unit: deps ## lint, then every test (unit, store, real processes) on a throwaway Postgres, and the chart
	python3 docs/check-links.py
	python3 docs/check-snippets.py charts
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	cargo build --workspace --bins --locked
	scripts/with-postgres.sh cargo test --workspace --locked
	scripts/test-chart.sh
	$(MAKE) test-sdk

test-sdk: ## the Python and TypeScript SDKs: lint, types, tests against real sidecars (needs `make build`)
	sdk/python/run-tests.sh
	sdk/typescript/run-tests.sh

openapi: ## only docs/openapi*.yaml against running sidecars (part of test-sdk; needs `make build`)
	sdk/python/run-tests.sh tests/test_openapi.py

e2e: deps ## end-to-end on a real local Kubernetes built from its own components (root; cached builds)
	scripts/e2e.sh

e2e-kind: ## the same e2e tests on kind, for Docker hosts (docker, kind, helm, kubectl on PATH)
	scripts/e2e-kind.sh

# The long randomized fault run (the short one is a test in `make test-unit`): 3 sidecars
# and demo agents, a private Postgres, 8 sessions, 1000 faults of every kind (the peer
# partition needs root), ~45 min on 2 cores. Prints the seed first and a report at the
# end; exits non-zero on any anomaly. Replay: make chaos CHAOS_ARGS="--seed <seed>";
# more: CHAOS_ARGS="--help".
chaos: deps build ## the long randomized fault run and history check (1000 faults, ~45 min)
	$${CARGO_TARGET_DIR:-target}/debug/leasehold-chaos --faults 1000 --sessions 8 --duration 120m $(CHAOS_ARGS)

# The checker's self-test, by hand (the short chaos tests run it too): the same run with
# every sidecar's checkpoint fence off (a debug-build failpoint) must report anomalies;
# this target fails unless the run exits 1 (anomalies).
chaos-selftest: deps build ## the chaos run with the fence off: must report anomalies (~90 s)
	@$${CARGO_TARGET_DIR:-target}/debug/leasehold-chaos --without-fence --faults 16 --sessions 6 \
		--kinds store_partition_mid_write --max-think 0ms --duration 70s $(CHAOS_ARGS); rc=$$?; \
	if [ $$rc -eq 1 ]; then echo "chaos-selftest: the checker caught the missing fence"; \
	else echo "chaos-selftest: expected anomalies (exit 1), got exit $$rc"; exit 1; fi

test-fast: ## unit tests only (no Postgres)
	cargo test --workspace --lib --bins

generate: ## regenerate the CRD yaml (crds/ and the chart's copy) from the Rust types
	cargo run -q -p leasehold-crds --bin crdgen -- --write

chart: ## lint and render the Helm chart, check its objects and RBAC
	scripts/test-chart.sh

lint: ## rustfmt check and clippy with warnings as errors
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

fmt: ## format the code
	cargo fmt --all

# The journal bench's baseline: the pre-journal sidecar (commit bbb3b87), its worktree and target dir.
BASELINE_WORKTREE ?= ../leasehold-bench-bbb3b87
BASELINE_TARGET ?= $(abspath $(BASELINE_WORKTREE))/target

bench: deps ## benchmarks with their baselines (results go into BENCHMARKS.md by hand)
	command -v nginx >/dev/null || (apt-get update -qq && apt-get install -y -qq nginx-light)
	cargo build --release --workspace --bins --locked
	scripts/with-postgres.sh cargo bench -p leasehold-core --bench store
	scripts/with-postgres.sh cargo bench -p leasehold-localcluster --bench hop
	scripts/with-postgres.sh cargo bench -p leasehold-localcluster --bench observe
	# the journal vs the previous release's sidecar (bbb3b87), built once into its own target dir
	[ -d $(BASELINE_WORKTREE) ] || git worktree add --detach $(BASELINE_WORKTREE) bbb3b87
	cd $(BASELINE_WORKTREE) && CARGO_TARGET_DIR=$(BASELINE_TARGET) cargo build --release --locked -p leasehold-sidecar
	LEASEHOLD_BENCH_BASELINE_BIN_DIR=$(BASELINE_TARGET)/release scripts/with-postgres.sh cargo bench -p leasehold-localcluster --bench journal
	# beside the real peers, and the capacity of one durable Postgres (issue 20)
	$(MAKE) bench-dapr bench-centrifugo bench-postgres

# The capacity envelope of one Postgres (issue 20): the store's statements on a durable
# server (fsync, synchronous_commit, full_page_writes on), ~5 min. Sharing the machine's
# cores with the client, so read its CPU columns together.
bench-postgres: deps ## the capacity of one Postgres, fsync on (results go into BENCHMARKS.md by hand)
	LEASEHOLD_PG_FSYNC=on scripts/with-postgres.sh cargo bench --locked -p leasehold-core --bench capacity

# Fan-out beside the real peer (issue 20): Centrifugo v6.9.1, built once from the Go module
# proxy (scripts/ensure-centrifugo.sh), started with bench/peers/centrifugo/config.json.
# Results go into BENCHMARKS.md by hand; switches in localcluster/benches/peers_centrifugo.rs.
bench-centrifugo: deps ## fan-out: leasehold vs Centrifugo v6.9.1 over SSE, same run, ~6 min
	LEASEHOLD_BENCH_CENTRIFUGO=$$(scripts/ensure-centrifugo.sh) && \
	cargo build --release --locked -p leasehold-sidecar --bins && \
	LEASEHOLD_BENCH_CENTRIFUGO=$$LEASEHOLD_BENCH_CENTRIFUGO LEASEHOLD_BIN_DIR=$${CARGO_TARGET_DIR:-$$PWD/target}/release \
	  scripts/with-postgres.sh cargo bench --locked -p leasehold-localcluster --bench peers_centrifugo

# Leasehold side by side with Dapr actors v1.14.0 (issue 20, part 1): hop latency, failover
# after kill -9, rolling restart; one run, loopback only. Dapr is built once from the Go
# module proxy (bench/peers/dapr pins it). Results go into BENCHMARKS.md by hand.
.PHONY: bench-dapr
bench-dapr: deps ## leasehold vs Dapr actors v1.14.0: hop, failover, rolling restart
	scripts/ensure-dapr.sh >/dev/null
	cargo build --release --locked -p leasehold-sidecar --bins
	scripts/with-postgres.sh cargo bench --locked -p leasehold-localcluster --bench peers_dapr
