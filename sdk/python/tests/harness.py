"""Real processes for the tests: `leasehold-sidecar` binaries and Python agents on
loopback addresses (127.0.0.x, x >= 2, ports the kernel hands out), sharing one Postgres
database per test. Every process is started here and killed by its PID when the test ends.

The binaries come from `$LEASEHOLD_BIN_DIR` (default `<repo>/target/debug`). Postgres is the
server `scripts/with-postgres.sh` starts (`DATABASE_URL`); each test creates a database.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

import leasehold

HERE = Path(__file__).resolve().parent
SDK = HERE.parent
REPO = SDK.parent.parent
EXAMPLES = SDK / "examples"

#: How long a node may take to become ready (the database may be busy with migrations).
READY_TIMEOUT = 30.0
#: Poll interval of every wait-for-a-condition.
POLL = 0.02


def bin_dir() -> Path:
    return Path(os.environ.get("LEASEHOLD_BIN_DIR") or REPO / "target" / "debug")


def binary(name: str) -> Path:
    path = bin_dir() / name
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: build the workspace (cargo build --workspace --bins) or set "
            "LEASEHOLD_BIN_DIR"
        )
    return path


def lapsed(info: leasehold.SessionInfo, holder: str) -> bool:
    """Whether `holder`'s lease on a session has lapsed, as a read shows it: claimable, or
    already claimed by another pod (a sidecar's sweep claims a session whose unfinished
    turn has no live owner at once, to resume it)."""
    return info.claimable or (info.owner is not None and info.owner != holder)


def wait_until(
    condition: Callable[[], Any], timeout: float, what: str, *, poll: float = POLL
) -> Any:
    """Poll `condition` until it returns something truthy (returned), failing after
    `timeout` seconds. The only way tests wait: on a condition, with a deadline."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as e:  # the condition may raise while the system settles
            last_error = e
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}") from last_error
        time.sleep(poll)


# -- Postgres ------------------------------------------------------------------------------


def admin_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if not url:
        raise RuntimeError(
            "DATABASE_URL is not set: run the tests with sdk/python/run-tests.sh (it starts a "
            "throwaway Postgres through scripts/with-postgres.sh)"
        )
    return url


def url_for(admin: str, database: str) -> str:
    base, sep, query = admin.partition("?")
    server = base.rsplit("/", 1)[0]
    return f"{server}/{database}" + (f"?{query}" if sep else "")


def create_database() -> str:
    """A fresh, empty database on the test server; its URL."""
    admin = admin_url()
    name = f"lh_py_{uuid.uuid4().hex}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
    return url_for(admin, name)


def stored_checkpoint(database_url: str, key: str) -> tuple[int, bytes] | None:
    """The session's checkpoint straight from the database: (epoch that wrote it, data)."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT epoch, data FROM agent_checkpoints WHERE agent_key = %s", (key,)
        ).fetchone()
    return None if row is None else (int(row[0]), bytes(row[1]))


def stored_history(database_url: str, key: str) -> list[str]:
    stored = stored_checkpoint(database_url, key)
    return [] if stored is None else list(json.loads(stored[1])["history"])


def lease_epoch(database_url: str, key: str) -> int | None:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT epoch FROM agent_leases WHERE agent_key = %s", (key,)).fetchone()
    return None if row is None else int(row[0])


# -- processes ------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the test process dies without its finalizers."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _clean_env() -> dict[str, str]:
    """The environment without anything the sidecar or agents read as configuration."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LEASEHOLD_", "DEMO_AGENT_"))
        and k not in ("DATABASE_URL", "POD_NAME", "POD_IP", "HOSTNAME")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Proc:
    """A child process: its output goes to a log file; signalled and killed by PID."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self._out = open(log, "ab")  # noqa: SIM115 - closed in kill9
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the process freezes mid-whatever (its kernel still accepts connections)."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill9(self) -> None:
        """kill -9 by PID (a stopped process is continued first so it can die)."""
        if self.running():
            self.resume()
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=10)
        self._out.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ThreadedAgent:
    """An agent app served by uvicorn in a thread of the test process, for tests that
    must see what happens inside a handler."""

    def __init__(self, name: str, app: Any, host: str, port: int) -> None:
        import uvicorn

        self.name = name
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="on", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"{name}-agent", daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, f"{name}'s in-process agent to start")
        self.pid = os.getpid()

    def running(self) -> bool:
        return self.thread.is_alive()

    def pause(self) -> None:
        raise NotImplementedError("an in-process agent cannot be frozen")

    resume = pause

    def kill9(self) -> None:
        self.server.should_exit = True
        self.server.force_exit = True  # do not wait for handlers still running
        self.thread.join(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        return "(in-process agent: see the test's captured log)"


_ip_counter = itertools.count(2 + (os.getpid() % 50) * 5)


def next_ip() -> str:
    """127.0.0.x with x in 2..254."""
    return f"127.0.0.{2 + next(_ip_counter) % 253}"


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def _accepts(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class Node:
    name: str
    ip: str
    ports: dict[str, int]
    sidecar: Proc
    agent: Proc | ThreadedAgent
    extra: list[Proc] = field(default_factory=list)
    #: What the admin port's drain is signed with.
    cluster_secret: str = ""

    @property
    def public_url(self) -> str:
        return f"http://{self.ip}:{self.ports['public']}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.ip}:{self.ports['admin']}"

    @property
    def agent_api_url(self) -> str:
        return f"http://{self.ip}:{self.ports['agent_api']}"

    @property
    def agent_url(self) -> str:
        return f"http://{self.ip}:{self.ports['agent']}"

    def kill9(self) -> None:
        """The pod dies: kill -9 of both containers."""
        self.sidecar.kill9()
        self.agent.kill9()

    def ready(self) -> bool:
        try:
            ok = httpx.get(f"{self.admin_url}/readyz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        return ok and _accepts(self.ip, self.ports["agent"])

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not self.sidecar.running():
                raise RuntimeError(
                    f"{self.name}'s sidecar exited before it was ready:\n{self.sidecar.log_tail()}"
                )
            if not self.agent.running():
                raise RuntimeError(
                    f"{self.name}'s agent exited before it was ready:\n{self.agent.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} not ready in {timeout} s:\n{self.sidecar.log_tail()}\n"
                    f"{self.agent.log_tail()}"
                )
            time.sleep(0.05)

    def drain(self) -> dict[str, Any]:
        """Drain the node as hooks and people do: `leasehold-sidecar drain`, which signs
        the admin port's `POST /drain` with the cluster secret; the report it printed."""
        done = subprocess.run(
            [
                str(binary("leasehold-sidecar")),
                "drain",
                "--admin-url",
                self.admin_url,
                "--cluster-secret",
                self.cluster_secret,
            ],
            capture_output=True,
            timeout=60.0,
            env=_clean_env(),
            check=False,
        )
        assert done.returncode == 0, f"drain of {self.name}: {done.stderr.decode()}"
        report: dict[str, Any] = json.loads(done.stdout)
        return report

    def metric(self, name: str, label_filter: str = "") -> float:
        text = httpx.get(f"{self.admin_url}/metrics", timeout=5.0).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and label_filter in line:
                with contextlib.suppress(ValueError):
                    total += float(line.rsplit(" ", 1)[1])
        return total


AgentSpec = Callable[["Node"], list[str]] | Callable[["Node"], Any]


def demo_agent_argv(node: Node) -> list[str]:
    """The Python reference agent (leasehold.demo_agent) as a process."""
    return [
        sys.executable,
        "-m",
        "leasehold.demo_agent",
        "--listen",
        f"{node.ip}:{node.ports['agent']}",
        "--sidecar-url",
        node.agent_api_url,
        "--node-id",
        node.name,
    ]


def langgraph_agent_argv(node: Node) -> list[str]:
    """The LangGraph example agent as a process."""
    return [
        sys.executable,
        str(EXAMPLES / "langgraph_agent.py"),
        "--listen",
        f"{node.ip}:{node.ports['agent']}",
        "--sidecar-url",
        node.agent_api_url,
        "--node-id",
        node.name,
    ]


class Cluster:
    """`nodes` pods, each a real sidecar and an agent, sharing one database.

    `agents` maps a node index to how its agent is started: a function returning an argv
    (a process), an (argv, environment) pair, or an ASGI app (served in this process); the
    default is the Python reference agent as a process."""

    def __init__(
        self,
        database_url: str,
        log_dir: Path,
        *,
        nodes: int = 3,
        lease_ttl_ms: int = 3000,
        heartbeat_ms: int = 500,
        drain_timeout_ms: int = 5000,
        agents: dict[int, Callable[[Node], Any]] | None = None,
        default_agent: Callable[[Node], Any] = demo_agent_argv,
        sidecar_args: list[str] | None = None,
    ) -> None:
        self.database_url = database_url
        #: Extra flags for every sidecar (limits a test wants small).
        self.sidecar_args = list(sidecar_args or [])
        self.log_dir = log_dir
        self.lease_ttl = lease_ttl_ms / 1000
        self.secret = f"secret-{uuid.uuid4().hex}"
        self.nodes: list[Node] = []
        agents = agents or {}
        try:
            for i in range(nodes):
                name = f"node-{chr(ord('a') + i)}"
                node = self._spawn(
                    name, lease_ttl_ms, heartbeat_ms, drain_timeout_ms, agents.get(i, default_agent)
                )
                self.nodes.append(node)
            for node in self.nodes:
                node.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _spawn(
        self,
        name: str,
        ttl_ms: int,
        heartbeat_ms: int,
        drain_ms: int,
        agent: Callable[[Node], Any],
    ) -> Node:
        ip = next_ip()
        ports = {p: free_port(ip) for p in ("public", "peer", "agent_api", "admin", "agent")}
        argv = [
            str(binary("leasehold-sidecar")),
            "--node-id",
            name,
            "--database-url",
            self.database_url,
            "--public-listen",
            f"{ip}:{ports['public']}",
            "--peer-listen",
            f"{ip}:{ports['peer']}",
            "--agent-listen",
            f"{ip}:{ports['agent_api']}",
            "--admin-listen",
            f"{ip}:{ports['admin']}",
            "--advertise-peer-addr",
            f"{ip}:{ports['peer']}",
            "--agent-url",
            f"http://{ip}:{ports['agent']}",
            "--lease-ttl",
            f"{ttl_ms}ms",
            "--heartbeat-interval",
            f"{heartbeat_ms}ms",
            "--drain-timeout",
            f"{drain_ms}ms",
            "--cluster-secret",
            self.secret,
            *self.sidecar_args,
        ]
        env = _clean_env()
        env["LEASEHOLD_LOG"] = "info,leasehold_sidecar=debug"
        sidecar = Proc(f"{name}/sidecar", argv, self.log_dir / f"{name}-sidecar.log", env)
        node = Node(name, ip, ports, sidecar, agent=None, cluster_secret=self.secret)  # type: ignore[arg-type]
        try:
            made = agent(node)
            if isinstance(made, tuple):  # (argv, extra environment)
                log = self.log_dir / f"{name}-agent.log"
                node.agent = Proc(f"{name}/agent", made[0], log, {**_clean_env(), **made[1]})
            elif isinstance(made, list):
                log = self.log_dir / f"{name}-agent.log"
                node.agent = Proc(f"{name}/agent", made, log, _clean_env())
            else:
                node.agent = ThreadedAgent(name, made, ip, ports["agent"])
        except BaseException:
            sidecar.kill9()
            raise
        return node

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    @property
    def public_urls(self) -> list[str]:
        return [n.public_url for n in self.nodes]

    def client(self, *nodes: int, **options: Any) -> leasehold.Client:
        urls = [self.nodes[i].public_url for i in nodes] if nodes else self.public_urls
        return leasehold.Client(urls, **options)

    def stop(self) -> None:
        """Kill every process by PID (agents first, then sidecars)."""
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.agent.kill9()
            with contextlib.suppress(Exception):
                node.sidecar.kill9()

    def dump_logs(self) -> str:
        out = [f"logs in {self.log_dir}"]
        for node in self.nodes:
            for proc in (node.sidecar, node.agent):
                out.append(f"----- {proc.name} (pid {proc.pid})\n{proc.log_tail()}")
        return "\n".join(out)


@contextlib.contextmanager
def cluster(database_url: str, log_dir: Path, **options: Any) -> Iterator[Cluster]:
    c = Cluster(database_url, log_dir, **options)
    try:
        yield c
    except BaseException:
        print(c.dump_logs(), file=sys.stderr)
        raise
    finally:
        c.stop()


def probe_server_features(database_url: str, log_dir: Path) -> dict[str, str | None]:
    """Ask a real one-pod cluster (the Python demo agent behind it) what it implements:

    - `forward_headers`: `leasehold-sidecar --help` lists `--forward-headers` (docs/http-api.md);
    - `turn_journal`: after an acknowledged turn with an Idempotency-Key,
      `GET /v1/sessions/{key}/turns/{that key}` answers 200 (docs/http-api.md, §9);
    - `idempotency`: the same key and body sent again is answered `Leasehold-Replayed: true`;
    - `multitask`: a turn sent with `Leasehold-Multitask: reject` while another of the
      session runs is answered `409 busy`.
    """
    found: dict[str, str | None] = {}
    help_text = subprocess.run(
        [str(binary("leasehold-sidecar")), "--help"], capture_output=True, text=True, check=False
    ).stdout
    found["forward_headers"] = (
        None
        if "--forward-headers" in help_text
        else "`leasehold-sidecar --help` has no --forward-headers: client headers do not "
        "reach the agent"
    )
    probe = Cluster(database_url, log_dir, nodes=1)
    try:
        url = probe.nodes[0].public_url
        key, idem = "probe", f"probe-{uuid.uuid4()}"
        with leasehold.Client([url]) as client:
            first = client.send_turn(key, {"text": "probe", "tokens": 0}, idempotency_key=idem)
            status = httpx.get(f"{url}/v1/sessions/{key}/turns/{idem}", timeout=10).status_code
            found["turn_journal"] = (
                None
                if status == 200
                else f"GET /v1/sessions/{{key}}/turns/{{id}} answered {status} for an "
                "acknowledged turn"
            )
            again = client.send_turn(key, {"text": "probe", "tokens": 0}, idempotency_key=idem)
            found["idempotency"] = (
                None
                if again.replayed and again.content == first.content
                else "a repeated Idempotency-Key was run again (no Leasehold-Replayed: true)"
            )
            running = threading.Thread(
                target=client.send_turn,
                args=(key, {"text": "long", "tokens": 1, "think_ms": 1500}),
                daemon=True,
            )
            with client.stream(key) as stream:
                running.start()
                for event in stream:  # the long turn is running once it has started
                    if event.type == "turn_started" and event.data.get("text") == "long":
                        break
            try:
                client.send_turn(key, {"text": "second", "tokens": 0}, multitask="reject")
                found["multitask"] = (
                    "`Leasehold-Multitask: reject` during a running turn was run, not 409 busy"
                )
            except leasehold.Busy:
                found["multitask"] = None
            running.join(timeout=10)
    finally:
        probe.stop()
    return found
