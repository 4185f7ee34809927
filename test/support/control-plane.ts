import { randomBytes } from 'node:crypto';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { LightMyRequestResponse } from 'fastify';
import { pino } from 'pino';
import type WebSocket from 'ws';
import { configSchema, type Config } from '../../src/adapters/config.js';
import { apiKeysFrom, startService, type Service } from '../../src/adapters/service.js';
import type { HostAgentConnector } from '../../src/domain/host-agent.port.js';
import {
  featureSkip,
  withTimeout,
  missingPrerequisite,
  prepareImages,
  startAgent,
  uniquePrefix,
  uniqueSubnet,
  type RunningAgent,
} from '../agent/harness.js';
import { createTestDatabase, type TestDatabase } from './postgres.js';

/**
 * The control plane as tests drive it: `startService` on a fresh test
 * database (same wiring as `npm start`), called through `app.inject`, or
 * over a real port with `listen()`. Agents are real host-agent processes
 * (test/agent/harness.ts). `close()` destroys every sandbox the agents hold,
 * stops them and drops the database, and is safe to call after a failure.
 */

export const ADMIN_KEY = `admin-${'a'.repeat(24)}`;
export const TENANT_KEYS = { acme: `acme-${'b'.repeat(24)}`, globex: `globex-${'c'.repeat(24)}` } as const;
export type KeyName = 'admin' | keyof typeof TENANT_KEYS;

export function keyOf(who: KeyName): string {
  return who === 'admin' ? ADMIN_KEY : TENANT_KEYS[who];
}

export interface ControlPlaneOptions {
  /** Overrides of the control plane's environment-style config. */
  readonly env?: Record<string, string>;
  readonly connector?: HostAgentConnector;
  /** pino level for the service's own log (default silent; FLEET_TEST_LOG=debug to see it). */
  readonly logLevel?: string;
  /** The service's logger (e.g. one writing into a buffer the test reads); also turns on the HTTP request log. */
  readonly logger?: import('pino').Logger;
}

export interface Reply {
  readonly status: number;
  readonly headers: Record<string, unknown>;
  readonly body: any;
  readonly raw: LightMyRequestResponse;
}

export interface RequestOptions {
  readonly as?: KeyName | 'none' | { readonly authorization: string };
  readonly body?: unknown;
  /** Sent as-is (no JSON encoding), with this content type. */
  readonly rawBody?: string | Buffer;
  readonly contentType?: string;
  readonly headers?: Record<string, string>;
}

export interface ControlPlane {
  readonly service: Service;
  readonly db: TestDatabase;
  readonly config: Config;
  /** The AES key host tokens are sealed with: a second service on the same database needs it too. */
  readonly tokenKey: Buffer;
  request(method: string, url: string, opts?: RequestOptions): Promise<Reply>;
  /** Listens on 127.0.0.1:<free port>; returns the base URL. */
  listen(): Promise<string>;
  /** Stops the service as a shutdown does and starts another on the same database and keys (`env` over the first's). */
  restart(env?: Record<string, string>): Promise<void>;
  close(): Promise<void>;
}

export async function startControlPlane(opts: ControlPlaneOptions = {}): Promise<ControlPlane> {
  const db = await createTestDatabase('cp');
  // The reconciler acts on its own schedule; API tests that assert the event log must ask for it explicitly.
  const env = { READ_YOUR_WRITES_TIMEOUT_MS: '10000', AGENT_CALL_TIMEOUT_MS: '20000', RECONCILER_ENABLED: 'false', ...opts.env };
  const config = configSchema.parse(env);
  const logger = opts.logger ?? pino({ level: opts.logLevel ?? process.env.FLEET_TEST_LOG ?? 'silent' });
  const tokenKey = randomBytes(32);
  const start = (cfg: Config): Promise<Service> =>
    startService({
      config: cfg,
      logger,
      databaseUrl: db.url,
      tokenEncryptionKey: tokenKey,
      apiKeys: apiKeysFrom(
        ADMIN_KEY,
        Object.entries(TENANT_KEYS).map(([tenant, key]) => ({ tenant, key })),
      ),
      connector: opts.connector,
      defaultMetrics: false,
      httpLogger: opts.logger !== undefined,
    });
  let service: Service;
  try {
    service = await start(config);
  } catch (err) {
    await db.drop();
    throw err;
  }
  let closed = false;
  return {
    get service() {
      return service;
    },
    db,
    config,
    tokenKey,
    async request(method, url, o = {}) {
      const headers: Record<string, string> = { ...o.headers };
      const as = o.as ?? 'admin';
      if (typeof as === 'object') headers.authorization = as.authorization;
      else if (as !== 'none') headers.authorization = `Bearer ${keyOf(as)}`;
      let payload: string | Buffer | undefined;
      if (o.rawBody !== undefined) {
        payload = o.rawBody;
        headers['content-type'] = o.contentType ?? 'application/json';
      } else if (o.body !== undefined) {
        payload = JSON.stringify(o.body);
        headers['content-type'] = 'application/json';
      }
      const raw = await service.app.inject({ method: method as 'GET', url, headers, ...(payload !== undefined ? { payload } : {}) });
      let body: unknown = raw.body;
      if (/json/.test(String(raw.headers['content-type'] ?? ''))) {
        try {
          body = raw.json();
        } catch {
          /* keep the text */
        }
      }
      return { status: raw.statusCode, headers: raw.headers, body, raw };
    },
    async listen() {
      const address = await service.app.listen({ host: '127.0.0.1', port: 0 });
      return address;
    },
    async restart(more = {}) {
      await service.close();
      service = await start(configSchema.parse({ ...env, ...more }));
    },
    async close() {
      if (closed) return;
      closed = true;
      await service.close().catch(() => undefined);
      await db.drop().catch(() => undefined);
    },
  };
}

/** A set of real agent processes (process backend), each a host of its own. */
export interface AgentFleet {
  readonly agents: RunningAgent[];
  start(opts?: { env?: Record<string, string> }): Promise<RunningAgent>;
  /** Starts a stopped or killed agent again on its own data directory, port aside (it picks a new one). */
  restart(agent: RunningAgent): Promise<RunningAgent>;
  /** Destroys every sandbox, prunes, stops the agents and removes their directories. Never throws. */
  close(): Promise<void>;
}

/**
 * Prepares the base image and returns a fleet to start agents in, or a skip
 * reason naming the missing feature (no root, no busybox, no namespaces, or
 * the first sandbox refused by the kernel).
 */
export async function prepareAgents(): Promise<AgentFleet | { skip: string }> {
  const missing = await missingPrerequisite();
  if (missing) return { skip: missing };
  const images = await prepareImages();
  if ('skip' in images) return { skip: images.skip };
  const dirs = [images.imageDir];
  const agents: RunningAgent[] = [];
  return {
    agents,
    async start(o = {}) {
      const dataDir = await mkdtemp(join(tmpdir(), 'cp-agent-'));
      dirs.push(dataDir);
      const agent = await startAgent(
        {
          dataDir,
          imageDir: images.imageDir,
          subnet: uniqueSubnet(),
          bridgePrefix: uniquePrefix(),
          env: { AGENT_LOG_LEVEL: process.env.FLEET_TEST_AGENT_LOG ?? 'warn', ...o.env },
        },
        60_000,
      );
      agents.push(agent);
      return agent;
    },
    async restart(old) {
      await old.kill();
      const agent = await startAgent({ ...old.opts, token: old.token }, 60_000);
      agents[agents.indexOf(old)] = agent;
      return agent;
    },
    async close() {
      for (const agent of agents) {
        if (agent.proc.exitCode === null && agent.proc.signalCode === null) {
          try {
            for (const vm of await agent.client.listVms('', { timeoutMs: 10_000 }))
              await agent.client.destroyVm(vm.name, { force: true, timeoutMs: 20_000 });
            await agent.client.prune({ timeoutMs: 20_000 });
          } catch (err) {
            process.stderr.write(`cleanup of agent ${agent.url} failed: ${String(err)}\n${agent.output().slice(-2000)}\n`);
          }
        }
        await agent.stop().catch(() => undefined);
        await agent.cleanupHost().catch(() => undefined);
      }
      for (const d of dirs) await rm(d, { recursive: true, force: true }).catch(() => undefined);
    },
  };
}

/** Starts one agent and boots a throwaway sandbox on it: a kernel that cannot run the backend becomes a skip reason. */
export async function startCheckedAgent(
  fleet: AgentFleet,
  opts?: { env?: Record<string, string> },
): Promise<RunningAgent | { skip: string }> {
  let agent: RunningAgent | undefined;
  try {
    agent = await fleet.start(opts);
    await agent.client.createVm({ name: 'probe', image: 'base' });
    await agent.client.destroyVm('probe', { force: true });
    return agent;
  } catch (err) {
    const skip = featureSkip(err);
    if (skip) return { skip };
    throw err;
  }
}

/**
 * `prepareAgents` then `startCheckedAgent` n times: the fleet (to close in the
 * caller's `after`, skipped or not) and its agents, or the reason the tests skip.
 */
export async function startCheckedFleet(n = 1): Promise<{ fleet?: AgentFleet; agents: RunningAgent[]; skip?: string }> {
  const fleet = await prepareAgents();
  if ('skip' in fleet) return { agents: [], skip: fleet.skip };
  const agents: RunningAgent[] = [];
  for (let i = 0; i < n; i++) {
    const a = await startCheckedAgent(fleet);
    if ('skip' in a) return { fleet, agents, skip: a.skip };
    agents.push(a);
  }
  return { fleet, agents };
}

/** Registers an agent as host `id` through the API (admin key). */
export async function registerHost(
  cp: ControlPlane,
  id: string,
  agent: Pick<RunningAgent, 'url' | 'token'>,
  extra: Record<string, unknown> = {},
): Promise<Reply> {
  return cp.request('POST', '/v1/hosts', {
    body: { id, url: agent.url, token: agent.token, backend: 'process', region: 'test', ...extra },
  });
}

export function problemOf(r: Reply): { status: number; code: string; detail: string } {
  return r.body as { status: number; code: string; detail: string };
}

/** Polls `fn` until it returns a truthy value or the time is up. */
export async function eventually<T>(fn: () => Promise<T | undefined | false>, ms = 10_000, what = 'condition'): Promise<T> {
  const deadline = Date.now() + ms;
  let last: unknown;
  for (;;) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (err) {
      last = err;
    }
    // eslint-disable-next-line @typescript-eslint/no-base-to-string -- whatever was thrown, printed as JavaScript prints it
    if (Date.now() > deadline) throw new Error(`${what} not reached within ${ms} ms${last ? `: ${String(last)}` : ''}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

export { withTimeout };

/**
 * Waits for a websocket's handshake (10 s at most): resolves once open, rejects
 * with `status` set when the server answered the upgrade with an HTTP status.
 */
export async function handshake(ws: WebSocket): Promise<void> {
  await withTimeout(
    new Promise<void>((resolve, reject) => {
      ws.once('open', () => resolve());
      ws.once('unexpected-response', (_req, res) =>
        reject(Object.assign(new Error(`handshake answered ${res.statusCode}`), { status: res.statusCode })),
      );
      ws.once('error', reject);
    }),
    10_000,
    'websocket handshake',
  );
}
