import { randomUUID } from 'node:crypto';
import { pino } from 'pino';
import { configSchema } from '../../src/adapters/config.js';
import { apiKeysFrom, startService, type Service } from '../../src/adapters/service.js';
import type { EventMetadata, EventStore, NewEvent } from '../../src/domain/event-store.port.js';
import { vmEventSchema, type VmEvent } from '../../src/domain/vm/vm.events.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';

export const ADMIN_KEY = `admin-${'a'.repeat(24)}`;
export const KEYS = { acme: `acme-${'b'.repeat(24)}`, globex: `globex-${'c'.repeat(24)}` } as const;

export interface Harness {
  readonly db: TestDatabase;
  readonly service: Service;
  close(): Promise<void>;
}

/** The real service (stores, runner, read models, API) on a fresh database; no host agents: events are appended directly. */
export async function startHarness(prefix: string): Promise<Harness> {
  const db = await createTestDatabase(prefix);
  try {
    const service = await startService({
      // No reconciler: these tests append synthetic VM histories whose hosts have no agent, and assert exact event sets.
      config: configSchema.parse({ LOG_LEVEL: 'silent', RECONCILER_ENABLED: 'false' }),
      logger: pino({ level: process.env.FLEET_TEST_LOG ?? 'silent' }),
      databaseUrl: db.url,
      tokenEncryptionKey: Buffer.alloc(32, 7),
      apiKeys: apiKeysFrom(
        ADMIN_KEY,
        Object.entries(KEYS).map(([tenant, key]) => ({ tenant, key })),
      ),
      defaultMetrics: false,
      httpLogger: false,
    });
    return {
      db,
      service,
      async close() {
        await service.close();
        await db.drop();
      },
    };
  } catch (err) {
    await db.drop();
    throw err;
  }
}

export interface VmShape {
  readonly cpus?: number;
  readonly ram_mb?: number;
  readonly gpus?: number;
  readonly gpu_kind?: string;
}

/** One VM event, checked against its domain schema before it is stored. */
export function vmEvent(type: VmEvent['type'], data: Record<string, unknown>, meta: EventMetadata = {}): NewEvent {
  const parsed = vmEventSchema.parse({ type, data });
  return { id: randomUUID(), type: parsed.type, data: parsed.data, metadata: { actor: 'test', correlationId: randomUUID(), ...meta } };
}

/** A realistic lifecycle (requested → placed → booting → running → destroying → destroyed, or failed), times from `t0`. */
export function lifecycle(
  vmId: string,
  tenant: string,
  hostId: string,
  times: { requested: Date; booted?: Date; ended?: Date; failed?: boolean },
  shape: VmShape = {},
): NewEvent[] {
  const s = {
    cpus: shape.cpus ?? 2,
    ram_mb: shape.ram_mb ?? 1024,
    gpus: shape.gpus ?? 0,
    ...(shape.gpu_kind ? { gpu_kind: shape.gpu_kind } : {}),
  };
  const iso = (d: Date): string => d.toISOString();
  const t = times.requested.getTime();
  const meta = { tenantId: tenant, actor: `tenant:${tenant}` };
  const events: NewEvent[] = [
    vmEvent('VmRequested', { vm_id: vmId, spec: { ...s, storage_gb: 1 }, tenant_id: tenant, at: iso(times.requested) }, meta),
    vmEvent(
      'VmPlaced',
      {
        vm_id: vmId,
        host_id: hostId,
        decision: {
          host_id: hostId,
          policy: 'spread',
          candidates: 3,
          headroom_cpus: 10,
          headroom_ram: 10_000,
          artifact_local: false,
          artifact_holders: 0,
        },
        reservation: {
          cpus: s.cpus,
          ram_mb: s.ram_mb,
          storage_gb: 1,
          gpus: s.gpus,
          ...(s.gpus > 0 ? { gpu_kind: shape.gpu_kind ?? 'a100' } : {}),
          gpu_uuids: [],
          mig_instance_uuids: [],
        },
        at: iso(new Date(t + 5)),
      },
      meta,
    ),
    vmEvent('VmBootStarted', { vm_id: vmId, host_id: hostId, at: iso(new Date(t + 10)) }, meta),
  ];
  if (times.booted) {
    events.push(
      vmEvent(
        'VmBooted',
        {
          vm_id: vmId,
          url: `http://10.0.0.1:${8000 + (vmId.length % 100)}`,
          endpoints: [],
          boot_ms: times.booted.getTime() - t,
          auth_token_encrypted: 'v1.c2VhbGVk',
          at: iso(times.booted),
        },
        meta,
      ),
    );
  }
  if (times.ended) {
    if (times.failed) {
      events.push(
        vmEvent(
          'VmFailed',
          {
            vm_id: vmId,
            reason: 'host_lost',
            error: 'host stopped answering',
            phase: times.booted ? 'running' : 'booting',
            at: iso(times.ended),
          },
          meta,
        ),
      );
    } else {
      events.push(vmEvent('VmDestroyRequested', { vm_id: vmId, reason: 'client', at: iso(new Date(times.ended.getTime() - 1)) }, meta));
      events.push(vmEvent('VmDestroyed', { vm_id: vmId, reason: 'client', at: iso(times.ended) }, meta));
    }
  }
  return events;
}

/** Appends a VM's events one call per event, as commands would. */
export async function appendLifecycle(store: EventStore, vmId: string, events: readonly NewEvent[]): Promise<string> {
  let position = '';
  for (const e of events) position = (await store.append(`vm-${vmId}`, [e], 'any')).position;
  return position;
}

export async function waitUntil(what: string, check: () => Promise<boolean> | boolean, timeoutMs = 10_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (Date.now() < end) {
    if (await check()) return;
    await new Promise((r) => setTimeout(r, 25));
  }
  throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
}

export function auth(key: string): Record<string, string> {
  return { authorization: `Bearer ${key}` };
}

export interface SseFrame {
  readonly id?: string;
  readonly event?: string;
  readonly data?: string;
}

export interface SseClient {
  readonly status: number;
  readonly frames: SseFrame[];
  readonly comments: string[];
  readonly res: import('node:http').IncomingMessage;
  /** Resolves when the server ends the stream. */
  readonly ended: Promise<void>;
  waitFor(what: string, check: () => boolean, timeoutMs?: number): Promise<void>;
  close(): void;
}

/** A minimal Server-Sent Events client over node:http that keeps every frame and comment it parses. */
export async function openSse(url: string, headers: Record<string, string>, opts: { paused?: boolean } = {}): Promise<SseClient> {
  const http = await import('node:http');
  return new Promise((resolve, reject) => {
    const req = http.get(url, { headers: { accept: 'text/event-stream', ...headers } }, (res) => {
      const frames: SseFrame[] = [];
      const comments: string[] = [];
      let buf = '';
      let endedResolve!: () => void;
      const ended = new Promise<void>((r) => (endedResolve = r));
      res.setEncoding('utf8');
      res.on('data', (chunk: string) => {
        buf += chunk;
        let idx: number;
        while ((idx = buf.indexOf('\n\n')) >= 0) {
          const block = buf.slice(0, idx);
          buf = buf.slice(idx + 2);
          const frame: { id?: string; event?: string; data?: string } = {};
          let isFrame = false;
          for (const line of block.split('\n')) {
            if (line.startsWith(':')) comments.push(line.slice(1).trim());
            else if (line.startsWith('id: ')) {
              frame.id = line.slice(4);
              isFrame = true;
            } else if (line.startsWith('event: ')) {
              frame.event = line.slice(7);
              isFrame = true;
            } else if (line.startsWith('data: ')) {
              frame.data = (frame.data === undefined ? '' : `${frame.data}\n`) + line.slice(6);
              isFrame = true;
            }
          }
          if (isFrame && frame.data !== undefined) frames.push(frame);
        }
      });
      res.on('end', () => endedResolve());
      res.on('close', () => endedResolve());
      res.on('error', () => endedResolve());
      if (opts.paused) res.pause();
      resolve({
        status: res.statusCode ?? 0,
        frames,
        comments,
        res,
        ended,
        waitFor: (what, check, timeoutMs = 10_000) => waitUntil(what, check, timeoutMs),
        close: () => {
          req.destroy();
          res.destroy();
        },
      });
    });
    req.on('error', reject);
  });
}
