from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def database_url() -> str:
    """A database of its own on the throwaway server (scripts/with-postgres.sh)."""
    return harness.create_database()


@pytest.fixture
def make_cluster(
    request: pytest.FixtureRequest, database_url: str, tmp_path: Path
) -> Iterator[Callable[..., harness.Cluster]]:
    """Start a cluster of real sidecars and agents; every process is killed by PID when
    the test ends (its logs are printed if the test failed)."""
    clusters: list[harness.Cluster] = []

    def make(**options: Any) -> harness.Cluster:
        log_dir = tmp_path / f"cluster-{len(clusters)}"
        log_dir.mkdir()
        cluster = harness.Cluster(database_url, log_dir, **options)
        clusters.append(cluster)
        return cluster

    yield make
    failed = getattr(request.node, "rep_call", None)
    for cluster in clusters:
        if failed is not None and failed.failed:
            print(cluster.dump_logs(), file=sys.stderr)
        cluster.stop()
