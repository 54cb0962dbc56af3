"""The README's complete agent, as written there, behind a real sidecar."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from harness import SDK, Cluster, Node, stored_history


def readme_agent() -> str:
    text = (SDK / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    agent = [b for b in blocks if "app = create_app(on_turn)" in b]
    assert len(agent) == 1, "the README has one complete agent"
    return agent[0]


def test_the_readme_agent_serves_turns(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    (tmp_path / "agent.py").write_text(readme_agent())

    def uvicorn(node: Node) -> tuple[list[str], dict[str, str]]:
        argv = [sys.executable, "-m", "uvicorn", "agent:app", "--app-dir", str(tmp_path)]
        argv += ["--host", node.ip, "--port", str(node.ports["agent"]), "--log-level", "warning"]
        return argv, {"LEASEHOLD_SIDECAR_URL": node.agent_api_url}

    cluster = make_cluster(nodes=2, default_agent=uvicorn)
    key = "readme"
    with cluster.client() as client:
        answers = [client.send_turn(key, {"text": t}).json() for t in ("one", "two", "three")]
        events = []
        with client.stream(key) as stream:  # the last turn's events, replayed
            for event in stream:
                events.append((event.type, event.data))
                if event.type == "turn_finished":
                    break
    assert answers == [{"history_len": n, "epoch": 1} for n in (1, 2, 3)]
    assert events == [("turn_started", {"text": "three"}), ("turn_finished", {"history_len": 3})]
    assert stored_history(cluster.database_url, key) == ["one", "two", "three"]
