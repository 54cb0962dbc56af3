/**
 * Real `leasehold-sidecar` processes on loopback addresses for the SDK's tests, like the
 * Rust harness in localcluster/src/cluster.rs: one Postgres database per test on the
 * server `scripts/with-postgres.sh` started (`DATABASE_URL`), each node on its own
 * 127.X.Y.Z with fixed ports, each sidecar's agent either the TypeScript demo agent
 * (a process) or an agent served from this test process. Every process is killed by
 * its PID when the cluster stops (and when this process exits).
 */

import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { randomUUID } from "node:crypto";
import { closeSync, existsSync, mkdtempSync, openSync, readFileSync, readdirSync } from "node:fs";
import { createServer, type Server } from "node:http";
import { connect } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import type { AgentHandler } from "../../src/agent.js";
import { Client, type ClientOptions } from "../../src/index.js";

export const PUBLIC_PORT = 28080;
export const PEER_PORT = 28081;
export const AGENT_API_PORT = 28082;
export const ADMIN_PORT = 29090;
export const AGENT_PORT = 23000;

/** How long a node may take to become ready (migrations of a fresh database included). */
const READY_TIMEOUT_MS = 30_000;

/** The SDK's root (where package.json is), found from this compiled file. */
export const SDK_ROOT = (() => {
  let dir = dirname(fileURLToPath(import.meta.url));
  while (!existsSync(join(dir, "package.json")) || !readFileSync(join(dir, "package.json"), "utf8").includes('"@leasehold/sdk"')) {
    const up = dirname(dir);
    if (up === dir) throw new Error("cannot find the SDK's package.json");
    dir = up;
  }
  return dir;
})();
export const REPO_ROOT = resolve(SDK_ROOT, "../..");

export function binDir(): string {
  return process.env.LEASEHOLD_BIN_DIR ?? join(REPO_ROOT, "target/debug");
}

function binary(name: string): string {
  const path = join(binDir(), name);
  if (!existsSync(path)) throw new Error(`${path} is missing: build the workspace (cargo build --workspace --bins) or set LEASEHOLD_BIN_DIR`);
  return path;
}

export const DEMO_AGENT_JS = join(SDK_ROOT, "dist/examples/demo-agent.js");
export const LANGGRAPH_AGENT_JS = join(SDK_ROOT, "dist/examples/langgraph-agent.js");
export const MINIMAL_AGENT_JS = join(SDK_ROOT, "dist/examples/minimal-agent.js");

// ---------------------------------------------------------------------------------------
// Waiting on conditions

export async function waitFor<T>(what: string, probe: () => Promise<T | undefined | false> | T | undefined | false, timeoutMs = 20_000, intervalMs = 50): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let lastError: unknown;
  for (;;) {
    try {
      const value = await probe();
      if (value !== undefined && value !== false) return value;
    } catch (error) {
      lastError = error;
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${lastError === undefined ? "" : `: ${lastError instanceof Error ? lastError.message : JSON.stringify(lastError)}`}`);
    }
    await new Promise((r) => setTimeout(r, intervalMs));
  }
}

/** A promise and its resolver: a test-controlled gate. */
/**
 * Whether `holder`'s lease on a session has lapsed, as a read shows it: claimable, or
 * already claimed by another pod (a sidecar's sweep claims a session whose unfinished
 * turn has no live owner at once, to resume it).
 */
export function lapsed(info: { owner: string | null; claimable: boolean }, holder: string): boolean {
  return info.claimable || (info.owner !== null && info.owner !== holder);
}

export function gate<T = void>(): { promise: Promise<T>; open: (value: T) => void; opened: () => boolean } {
  let open!: (value: T) => void;
  let isOpen = false;
  const promise = new Promise<T>((resolve) => {
    open = (value: T) => {
      isOpen = true;
      resolve(value);
    };
  });
  return { promise, open, opened: () => isOpen };
}

// ---------------------------------------------------------------------------------------
// Processes

const live = new Set<Proc>();
process.on("exit", () => {
  for (const p of live) p.forceKill();
});

export class Proc {
  readonly name: string;
  readonly log: string;
  private readonly child: ChildProcess;
  private exitCode: number | null | undefined;
  private readonly exited: Promise<void>;

  constructor(name: string, command: string, args: string[], log: string, env: NodeJS.ProcessEnv = process.env) {
    this.name = name;
    this.log = log;
    const out = openSync(log, "a");
    this.child = spawn(command, args, { stdio: ["ignore", out, out], env });
    closeSync(out);
    live.add(this);
    this.exited = new Promise((resolve) => {
      this.child.on("exit", (code, signal) => {
        this.exitCode = code ?? (signal === null ? null : -1);
        live.delete(this);
        resolve();
      });
    });
  }

  get pid(): number {
    return this.child.pid ?? -1;
  }

  get running(): boolean {
    return this.exitCode === undefined;
  }

  signal(signal: NodeJS.Signals): void {
    if (this.running) {
      try {
        process.kill(this.pid, signal);
      } catch {
        // already gone
      }
    }
  }

  /** `kill -9`, and wait until it is gone. */
  async kill9(): Promise<void> {
    this.signal("SIGCONT"); // a stopped process must be able to die
    this.signal("SIGKILL");
    await Promise.race([this.exited, new Promise((r) => setTimeout(r, 10_000))]);
  }

  /** Synchronous best effort (process exit). */
  forceKill(): void {
    this.signal("SIGCONT");
    this.signal("SIGKILL");
  }

  pause(): void {
    this.signal("SIGSTOP");
  }

  resume(): void {
    this.signal("SIGCONT");
  }

  logTail(lines = 40): string {
    try {
      const all = readFileSync(this.log, "utf8").split("\n");
      return all.slice(-lines).join("\n");
    } catch {
      return "";
    }
  }
}

// ---------------------------------------------------------------------------------------
// Postgres

function psql(): string {
  const onPath = spawnSync("sh", ["-c", "command -v psql"], { encoding: "utf8" }).stdout.trim();
  if (onPath) return onPath;
  for (const version of existsSync("/usr/lib/postgresql") ? readdirSync("/usr/lib/postgresql") : []) {
    const path = `/usr/lib/postgresql/${version}/bin/psql`;
    if (existsSync(path)) return path;
  }
  throw new Error("psql not found (scripts/ensure-postgres.sh installs it)");
}

export function adminUrl(): string {
  const url = process.env.DATABASE_URL;
  if (!url) throw new Error("DATABASE_URL is not set: run the tests under scripts/with-postgres.sh (run-tests.sh does)");
  return url;
}

/** A fresh, empty database of this test's own on the test server; its URL. */
export function createDatabase(): string {
  const name = `lh_ts_${randomUUID().replaceAll("-", "")}`;
  const admin = adminUrl();
  const result = spawnSync(psql(), [admin, "-v", "ON_ERROR_STOP=1", "-q", "-c", `CREATE DATABASE ${name}`], { encoding: "utf8" });
  if (result.status !== 0) throw new Error(`CREATE DATABASE failed: ${result.stderr}`);
  const url = new URL(admin);
  url.pathname = `/${name}`;
  return url.toString();
}

// ---------------------------------------------------------------------------------------
// Nodes

let nextIndex = 0;
/** Loopback addresses unique within this process: 127.X.Y.Z, X from the PID (20..99, apart from the Rust tests' 100..199). */
export function nextIp(): string {
  const n = nextIndex++;
  const x = 20 + (process.pid % 80);
  return `127.${x}.${Math.floor(n / 200)}.${(n % 200) + 10}`;
}

/** What a node's agent is: the TypeScript demo agent process, or a handler served here. */
export type AgentSpec =
  | { kind: "demo" }
  /** A compiled example (`dist/examples/*.js`) taking `--listen`, `--sidecar-url`, `--node-id`. */
  | { kind: "program"; script: string }
  | { kind: "in-process"; make: (node: { name: string; agentApiUrl: string }) => AgentHandler };

export interface ClusterOptions {
  nodes?: number;
  leaseTtlMs?: number;
  heartbeatMs?: number;
  drainTimeoutMs?: number;
  agent?: AgentSpec;
  /** Extra sidecar flags. */
  sidecarArgs?: string[];
}

export class Node {
  readonly name: string;
  readonly ip: string;
  sidecar: Proc;
  agent: Proc | undefined;
  /** The in-process agent's server and handler. */
  server: Server | undefined;
  handler: AgentHandler | undefined;

  constructor(name: string, ip: string, sidecar: Proc) {
    this.name = name;
    this.ip = ip;
    this.sidecar = sidecar;
  }

  get publicUrl(): string {
    return `http://${this.ip}:${PUBLIC_PORT}`;
  }
  get adminUrl(): string {
    return `http://${this.ip}:${ADMIN_PORT}`;
  }
  get agentApiUrl(): string {
    return `http://${this.ip}:${AGENT_API_PORT}`;
  }
  get agentUrl(): string {
    return `http://${this.ip}:${AGENT_PORT}`;
  }

  /** The pod dies: kill -9 of the sidecar and of the agent (a process or the in-process server). */
  async kill9(): Promise<void> {
    await this.sidecar.kill9();
    await this.agent?.kill9();
    await this.closeServer();
  }

  async closeServer(): Promise<void> {
    const server = this.server;
    this.server = undefined;
    if (server) {
      server.closeAllConnections();
      await new Promise<void>((resolve) => {
        server.close(() => {
          resolve();
        });
      });
    }
  }

  async waitReady(): Promise<void> {
    await waitFor(
      `${this.name} ready`,
      async () => {
        if (!this.sidecar.running) throw new Error(`${this.name}'s sidecar exited:\n${this.sidecar.logTail(30)}`);
        const ready = await fetch(`${this.adminUrl}/readyz`).then((r) => r.ok, () => false);
        return ready && (await portOpen(this.ip, AGENT_PORT));
      },
      READY_TIMEOUT_MS,
    ).catch((error: unknown) => {
      throw new Error(`${String(error)}\n${this.sidecar.logTail(30)}`);
    });
  }

  /** A Prometheus metric's value summed over the label sets matching `filter`. */
  async metric(name: string, filter = ""): Promise<number> {
    const text = await (await fetch(`${this.adminUrl}/metrics`)).text();
    return text
      .split("\n")
      .filter((l) => l.startsWith(name) && l.includes(filter))
      .map((l) => Number(l.split(" ").pop()))
      .filter((n) => !Number.isNaN(n))
      .reduce((a, b) => a + b, 0);
  }
}

function portOpen(host: string, port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = connect({ host, port });
    socket.once("connect", () => {
      socket.destroy();
      resolve(true);
    });
    socket.once("error", () => {
      resolve(false);
    });
  });
}

/**
 * Drain a node as hooks and people do: `leasehold-sidecar drain`, which signs the admin
 * port's `POST /drain` with the cluster secret; the report it printed.
 */
export async function drain(node: Node, clusterSecret: string): Promise<{ handed_back: number; in_flight_finished: number; in_flight_stood_down: number }> {
  const args = ["drain", "--admin-url", node.adminUrl, "--cluster-secret", clusterSecret];
  const done = await new Promise<{ code: number | null; stdout: string; stderr: string }>((resolveDone) => {
    const child = spawn(binary("leasehold-sidecar"), args, { stdio: ["ignore", "pipe", "pipe"] });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (chunk: Buffer) => {
      stdout += chunk.toString();
    });
    child.stderr.on("data", (chunk: Buffer) => {
      stderr += chunk.toString();
    });
    child.on("close", (code) => {
      resolveDone({ code, stdout, stderr });
    });
  });
  if (done.code !== 0) throw new Error(`drain of ${node.name} failed: ${done.stderr}`);
  return JSON.parse(done.stdout) as { handed_back: number; in_flight_finished: number; in_flight_stood_down: number };
}

export class Cluster {
  readonly nodes: Node[];
  readonly databaseUrl: string;
  readonly logDir: string;
  readonly secret: string;
  readonly options: Required<Omit<ClusterOptions, "agent" | "sidecarArgs">>;

  private constructor(nodes: Node[], databaseUrl: string, logDir: string, secret: string, options: Cluster["options"]) {
    this.nodes = nodes;
    this.databaseUrl = databaseUrl;
    this.logDir = logDir;
    this.secret = secret;
    this.options = options;
  }

  static async start(opts: ClusterOptions = {}): Promise<Cluster> {
    const options = {
      nodes: opts.nodes ?? 3,
      leaseTtlMs: opts.leaseTtlMs ?? 3000,
      heartbeatMs: opts.heartbeatMs ?? 500,
      drainTimeoutMs: opts.drainTimeoutMs ?? 5000,
    };
    const agent = opts.agent ?? { kind: "demo" };
    const databaseUrl = createDatabase();
    const logDir = mkdtempSync(join(tmpdir(), "leasehold-ts-cluster."));
    const secret = `secret-${randomUUID()}`;
    const nodes: Node[] = [];
    const cluster = new Cluster(nodes, databaseUrl, logDir, secret, options);
    try {
      for (let i = 0; i < options.nodes; i++) {
        const name = `node-${String.fromCharCode(97 + i)}`;
        const ip = nextIp();
        const args = [
          "--node-id", name,
          "--database-url", databaseUrl,
          "--public-listen", `${ip}:${PUBLIC_PORT}`,
          "--peer-listen", `${ip}:${PEER_PORT}`,
          "--agent-listen", `${ip}:${AGENT_API_PORT}`,
          "--admin-listen", `${ip}:${ADMIN_PORT}`,
          "--agent-url", `http://${ip}:${AGENT_PORT}`,
          "--lease-ttl", `${options.leaseTtlMs}ms`,
          "--heartbeat-interval", `${options.heartbeatMs}ms`,
          "--drain-timeout", `${options.drainTimeoutMs}ms`,
          "--cluster-secret", secret,
          ...(opts.sidecarArgs ?? []),
        ];
        const env = { ...process.env, LEASEHOLD_LOG: "info,leasehold_sidecar=debug" };
        const sidecar = new Proc(`${name}/sidecar`, binary("leasehold-sidecar"), args, join(logDir, `${name}-sidecar.log`), env);
        const node = new Node(name, ip, sidecar);
        nodes.push(node);
        if (agent.kind === "demo" || agent.kind === "program") {
          node.agent = new Proc(
            `${name}/agent`,
            process.execPath,
            [agent.kind === "demo" ? DEMO_AGENT_JS : agent.script, "--listen", `${ip}:${AGENT_PORT}`, "--sidecar-url", node.agentApiUrl, "--node-id", name],
            join(logDir, `${name}-agent.log`),
            // The same settings by environment, for agents that take no flags.
            { ...process.env, DEMO_AGENT_LISTEN: `${ip}:${AGENT_PORT}`, LEASEHOLD_SIDECAR_URL: node.agentApiUrl, LEASEHOLD_NODE_ID: name },
          );
        } else {
          const handler = agent.make({ name, agentApiUrl: node.agentApiUrl });
          const server = createServer(handler);
          server.keepAliveTimeout = 5_000;
          await new Promise<void>((resolve, reject) => {
            server.once("error", reject);
            server.listen(AGENT_PORT, ip, () => {
              resolve();
            });
          });
          node.server = server;
          node.handler = handler;
        }
      }
      for (const node of nodes) await node.waitReady();
    } catch (error) {
      await cluster.stop();
      throw error;
    }
    return cluster;
  }

  client(options: Omit<ClientOptions, "baseUrls"> = {}, nodes: Node[] = this.nodes): Client {
    return new Client({ ...options, baseUrls: nodes.map((n) => n.publicUrl) });
  }

  node(name: string): Node {
    const node = this.nodes.find((n) => n.name === name);
    if (!node) throw new Error(`no node ${name}`);
    return node;
  }

  /** Every process killed by PID, in-process agents closed. */
  async stop(): Promise<void> {
    for (const node of this.nodes) await node.kill9();
  }

  dumpLogs(): string {
    let out = `logs in ${this.logDir}\n`;
    for (const node of this.nodes) {
      for (const p of [node.sidecar, node.agent]) {
        if (p) out += `----- ${p.name} (pid ${p.pid})\n${p.logTail(40)}\n`;
      }
    }
    return out;
  }
}

/** Run `body` with a started cluster; logs on failure; every process killed after. */
export async function withCluster(options: ClusterOptions, body: (cluster: Cluster) => Promise<void>): Promise<void> {
  const cluster = await Cluster.start(options);
  try {
    await body(cluster);
  } catch (error) {
    console.error(cluster.dumpLogs());
    throw error;
  } finally {
    await cluster.stop();
  }
}
