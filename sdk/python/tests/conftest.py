from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness


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


# -- features of docs/http-api.md that the server may not implement yet ----------------------

_features: dict[str, str | None] | None = None


def server_features() -> dict[str, str | None]:
    """Which server-side features the sidecar under test has: feature -> None when it
    has it, else the reason (what was checked and what came back). Probed once, on a
    one-pod cluster of its own, only when a test marked `awaits_server` is selected."""
    global _features
    if _features is None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="leasehold-probe.") as logs:
            _features = harness.probe_server_features(harness.create_database(), Path(logs))
    return _features


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "awaits_server(feature): needs a server-side feature of docs/http-api.md; fails, with "
        "the probe's finding, when the sidecar lacks it",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Every feature these tests need is in the sidecar now: one it lacks is a regression,
    # named by the probe's finding, never a skip.
    for marker in item.iter_markers("awaits_server"):
        reason = server_features()[marker.args[0]]
        if reason is not None:
            pytest.fail(f"the sidecar lacks {marker.args[0]}: {reason}")
