# leasehold — the entry points. `make` alone lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

.PHONY: help demo test test-fast lint fmt bench deps build generate chart

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

deps: ## install what the build and tests need (idempotent, fast when done)
	@scripts/ensure-deps.sh

demo: deps build ## the whole system locally: Postgres, 3 sidecars + 3 demo agents, a narrated walk-through
	./target/debug/leasehold-demo

build: ## build every binary (sidecar, demo agent, demo)
	cargo build --workspace --bins --locked

test: deps ## the whole suite: lint, then every test (unit, store, real processes) on a throwaway Postgres
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	cargo build --workspace --bins --locked
	scripts/with-postgres.sh cargo test --workspace --locked
	scripts/test-chart.sh

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

bench: deps ## benchmarks with their baselines (results go into BENCHMARKS.md by hand)
	command -v nginx >/dev/null || (apt-get update -qq && apt-get install -y -qq nginx-light)
	cargo build --release --workspace --bins --locked
	scripts/with-postgres.sh cargo bench -p leasehold-sidecar --bench store
	scripts/with-postgres.sh cargo bench -p leasehold-localcluster --bench hop
	scripts/with-postgres.sh cargo bench -p leasehold-localcluster --bench observe
