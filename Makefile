# leasehold — the entry points. `make` alone lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

.PHONY: help test test-fast lint fmt bench deps

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

deps: ## install what the build and tests need (idempotent, fast when done)
	@scripts/ensure-deps.sh

test: deps ## the whole suite: lint, then every test against a throwaway Postgres
	@scripts/ensure-deps.sh >/dev/null
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	scripts/with-postgres.sh cargo test --workspace --locked

test-fast: ## unit tests only (no Postgres)
	cargo test --workspace --lib --bins

lint: ## rustfmt check and clippy with warnings as errors
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

fmt: ## format the code
	cargo fmt --all

bench: deps ## benchmarks with their baselines (results go into BENCHMARKS.md by hand)
	scripts/with-postgres.sh cargo bench -p leasehold-sidecar --bench store
