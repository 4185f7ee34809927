import { spawn, type ChildProcess } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { createServer, request as httpRequest, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { freePort } from '../../src/adapters/postgres/embedded.js';
import {
  exitWithin,
  missingPrerequisite,
  prepareImages,
  REPO_ROOT,
  startAgent,
  uniquePrefix,
  uniqueSubnet,
  type RunningAgent,
} from '../agent/harness.js';

/**
 * Real processes for the reconciler's fault tests: host agents (through
 * test/agent/harness.ts), the control plane itself (`src/main.ts` as a
 * child, SIGKILL-able), and one test double, AgentFaultProxy, that sits in
 * front of a real agent to make it hang or fail destroys on demand.
 */

export const ADMIN_KEY = `admin-${'r'.repeat(24)}`;
export const TOKEN_KEY = randomBytes(32).toString('base64');

export async function skipReason(): Promise<string | undefined> {
  return missingPrerequisite();
}

export interface TestAgent extends RunningAgent {
  readonly dataDir: string;
  /** Starts a fresh process on the same data dir, port and token (as a host restart would). */
  restart(): Promise<TestAgent>;
  dispose(): Promise<void>;
}

export async function startTestAgent(
  imageDir: string,
  reuse?: { dataDir: string; port: number; token: string; subnet: string; bridgePrefix: string },
): Promise<TestAgent> {
  const dataDir = reuse?.dataDir ?? (await mkdtemp(join(tmpdir(), 'rec-agent-')));
  const subnet = reuse?.subnet ?? uniqueSubnet();
  const bridgePrefix = reuse?.bridgePrefix ?? uniquePrefix();
  const agent = await startAgent({
    dataDir,
    imageDir,
    subnet,
    bridgePrefix,
    token: reuse?.token,
    env: reuse ? { AGENT_PORT: String(reuse.port) } : {},
  });
  const self: TestAgent = {
    ...agent,
    dataDir,
    restart: () => startTestAgent(imageDir, { dataDir, port: agent.port, token: agent.token, subnet, bridgePrefix }),
    async dispose() {
      // Destroy what is left, stop, remove host-global leftovers and the data dir.
      const vms = await agent.client.listVms('', { timeoutMs: 10_000 }).catch(() => []);
      for (const v of vms) await agent.client.destroyVm(v.name, { force: true, timeoutMs: 20_000 }).catch(() => undefined);
      await agent.stop();
      await agent.cleanupHost();
      await rm(dataDir, { recursive: true, force: true }).catch(() => undefined);
    },
  };
  return self;
}

export async function prepareTestImages(): Promise<{ imageDir: string } | { skip: string }> {
  return prepareImages();
}

// ---- the control plane as a process -----------------------------------------

export interface ControlPlaneProcess {
  readonly url: string;
  readonly port: number;
  readonly proc: ChildProcess;
  output(): string;
  /** SIGKILL, as a crash would. */
  kill(): Promise<void>;
  /** SIGTERM (graceful), SIGKILL after 10 s. */
  stop(): Promise<void>;
}

export async function spawnControlPlane(opts: {
  databaseUrl: string;
  dataDir: string;
  port?: number;
  env?: Record<string, string>;
}): Promise<ControlPlaneProcess> {
  const port = opts.port ?? (await freePort());
  const proc = spawn(process.execPath, ['--import', 'tsx', join(REPO_ROOT, 'src/main.ts')], {
    cwd: REPO_ROOT,
    env: {
      ...process.env,
      DATABASE_URL: opts.databaseUrl,
      START_LOCAL_AGENT: 'false',
      HOST: '127.0.0.1',
      PORT: String(port),
      DATA_DIR: opts.dataDir,
      ADMIN_API_KEY: ADMIN_KEY,
      TOKEN_ENCRYPTION_KEY: TOKEN_KEY,
      LOG_LEVEL: 'info',
      ...opts.env,
    },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let out = '';
  proc.stdout.on('data', (c: Buffer) => (out += c.toString()));
  proc.stderr.on('data', (c: Buffer) => (out += c.toString()));
  const exited = new Promise<void>((resolve) => proc.once('exit', () => resolve()));
  const url = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 60_000;
  for (;;) {
    if (proc.exitCode !== null || proc.signalCode !== null)
      throw new Error(`control plane exited before it answered:\n${out.slice(-4000)}`);
    const ok = await fetch(`${url}/healthz`).then(
      (r) => r.ok,
      () => false,
    );
    if (ok) break;
    if (Date.now() > deadline) {
      proc.kill('SIGKILL');
      throw new Error(`control plane did not answer /healthz within 60 s:\n${out.slice(-4000)}`);
    }
    await sleep(200);
  }
  const waitExit = (ms: number): Promise<boolean> => exitWithin(proc, exited, ms);
  return {
    url,
    port,
    proc,
    output: () => out,
    async kill() {
      if (proc.exitCode !== null || proc.signalCode !== null) return;
      proc.kill('SIGKILL');
      await waitExit(5000);
    },
    async stop() {
      if (proc.exitCode !== null || proc.signalCode !== null) return;
      proc.kill('SIGTERM');
      if (!(await waitExit(10_000))) {
        proc.kill('SIGKILL');
        await waitExit(5000);
      }
    },
  };
}

export interface ApiReply {
  status: number;
  body: any;
}

export async function api(
  base: string,
  method: string,
  path: string,
  body?: unknown,
  opts: { key?: string; headers?: Record<string, string>; timeoutMs?: number } = {},
): Promise<ApiReply> {
  const res = await fetch(`${base}${path}`, {
    method,
    headers: {
      authorization: `Bearer ${opts.key ?? ADMIN_KEY}`,
      ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
      ...opts.headers,
    },
    body: body !== undefined ? JSON.stringify(body) : undefined,
    signal: AbortSignal.timeout(opts.timeoutMs ?? 60_000),
  });
  const text = await res.text();
  let parsed: unknown = text;
  try {
    parsed = JSON.parse(text);
  } catch {
    /* not JSON */
  }
  return { status: res.status, body: parsed };
}

/** The VM id the control plane derives from an Idempotency-Key (vm-commands.ts), so a test knows it before the create answers. */
export function vmIdFor(tenant: string, key: string): string {
  return createHash('sha256').update(`${tenant}\0${key}`).digest('hex').slice(0, 24);
}

export function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}

/** Polls until `check` returns a truthy value; fails with `what` and the last value after `timeoutMs`. */
export async function waitFor<T>(
  what: string,
  timeoutMs: number,
  check: () => T | undefined | false | Promise<T | undefined | false>,
  everyMs = 250,
): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last: unknown;
  for (;;) {
    try {
      const v = await check();
      if (v) return v;
      last = v;
    } catch (err) {
      last = err;
    }
    if (Date.now() > deadline)
      throw new Error(`${what}: not within ${timeoutMs} ms (last: ${last instanceof Error ? last.message : JSON.stringify(last)})`);
    await sleep(everyMs);
  }
}

export async function tempDir(prefix: string): Promise<{ path: string; remove(): Promise<void> }> {
  const path = await mkdtemp(join(tmpdir(), prefix));
  return { path, remove: () => rm(path, { recursive: true, force: true }) };
}

// ---- TEST DOUBLE: a faulty network in front of a real agent ---------------------

export type FaultMode = 'pass' | 'hang' | 'fail-destroy';

/**
 * TEST DOUBLE, not an agent: an HTTP proxy in front of a real host agent.
 * `pass` forwards everything; `hang` accepts every connection and request
 * and never answers (an agent wedged in a syscall, a black-holed network);
 * `fail-destroy` forwards everything except sandbox destroys, which answer
 * 500 AGENT_ERROR (a destroy that keeps failing). Counts the destroys it
 * saw, so a test can tell a skipped dead letter from a retried one.
 */
export class AgentFaultProxy {
  mode: FaultMode = 'pass';
  destroysSeen = 0;
  private readonly server: Server;
  private readonly sockets = new Set<Socket>();
  private readonly held = new Set<ServerResponse>();

  private constructor(private readonly target: URL) {
    this.server = createServer((req, res) => this.handle(req, res));
    this.server.on('connection', (s) => {
      this.sockets.add(s);
      s.once('close', () => this.sockets.delete(s));
    });
  }

  static async start(targetUrl: string): Promise<AgentFaultProxy> {
    const p = new AgentFaultProxy(new URL(targetUrl));
    await new Promise<void>((resolve) => p.server.listen(0, '127.0.0.1', resolve));
    return p;
  }

  get url(): string {
    return `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
  }

  /** Ends the requests `hang` held (so nothing lingers after the test). */
  release(): void {
    for (const r of this.held) r.destroy();
    this.held.clear();
  }

  async close(): Promise<void> {
    this.release();
    for (const s of this.sockets) s.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }

  private handle(req: IncomingMessage, res: ServerResponse): void {
    const isDestroy = req.method === 'DELETE' && /^\/v1\/vms\/[^/?]+/.test(req.url ?? '');
    if (isDestroy) this.destroysSeen++;
    if (this.mode === 'hang') {
      req.resume();
      this.held.add(res);
      res.once('close', () => this.held.delete(res));
      return;
    }
    if (this.mode === 'fail-destroy' && isDestroy) {
      req.resume();
      res
        .writeHead(500, { 'content-type': 'application/json' })
        .end(JSON.stringify({ code: 'AGENT_ERROR', message: 'TEST DOUBLE: destroy fails on purpose' }));
      return;
    }
    const up = httpRequest(
      { host: this.target.hostname, port: this.target.port, method: req.method, path: req.url, headers: req.headers },
      (upRes) => {
        res.writeHead(upRes.statusCode ?? 502, upRes.headers);
        upRes.pipe(res);
      },
    );
    up.on('error', (err) => {
      if (!res.headersSent) res.writeHead(502, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ code: 'AGENT_ERROR', message: `TEST DOUBLE upstream: ${err.message}` }));
    });
    req.pipe(up);
  }
}
