import type {
  FastifyBaseLogger,
  FastifyInstance,
  FastifyRequest,
  RawReplyDefaultExpression,
  RawRequestDefaultExpression,
  RawServerDefault,
} from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import { AppError, type EgressSpec, type MetricSample } from '@fleet/agent-protocol';
import type { HostCommands } from '../../../commands/host/host-commands.js';
import type { ForkMigrate } from '../../../commands/migrate/fork-migrate.js';
import { holdsGpus } from '../../../commands/migrate/gpu-memory.js';
import type { SnapshotCommands } from '../../../commands/snapshot/snapshot-commands.js';
import { snapshotRequest } from '../../../commands/snapshot/snapshot-request.js';
import { sandboxName, type Actor, type VmCommands } from '../../../commands/vm/vm-commands.js';
import type { VmLifecycle } from '../../../commands/vm/vm-lifecycle.js';
import type { VmMemory } from '../../../commands/vm/vm-memory.js';
import type { Position } from '../../../domain/event-store.port.js';
import type { ExistingVmState } from '../../../domain/vm/vm.decider.js';
import { getSnapshot, listSnapshots } from '../../../projections/snapshots/snapshots.queries.js';
import { cursorTime, decodeCursor, encodeCursor } from '../pagination.js';

/**
 * E2B's memory and observation verbs (pause, fork, snapshots, metrics,
 * network), each a thin translation onto the command our own API uses for
 * it: VmMemory.pause, ForkMigrate.fork, SnapshotCommands.create/delete,
 * VmCommands.changeEgress, and the host agent's per-sandbox samples (what
 * GET /v1/vms/:id/metrics reads). Registered inside the /e2b scope of
 * e2b.routes.ts, so its key check and error shapes apply.
 */

export type E2bApp = FastifyInstance<
  RawServerDefault,
  RawRequestDefaultExpression,
  RawReplyDefaultExpression,
  FastifyBaseLogger,
  ZodTypeProvider
>;

export interface E2bMemoryDeps {
  readonly vms: VmCommands;
  readonly memory: VmMemory;
  readonly forkMigrate: ForkMigrate;
  readonly snapshots: SnapshotCommands;
  readonly hosts: HostCommands;
  readonly lifecycle: VmLifecycle;
  readonly pool: Pool;
}

/** What e2b.routes.ts shares with these routes. */
export interface E2bScope {
  readonly actorOf: (req: FastifyRequest) => Actor;
  /** The sandbox (running or paused) or E2B's 404. */
  readonly live: (id: string, actor: Actor) => Promise<ExistingVmState>;
  readonly sandboxAnswer: (vm: ExistingVmState) => Record<string, unknown>;
  readonly remember: (actor: Actor, position: Position | undefined) => void;
  /** Waits until this replica's read models hold the caller's own writes. */
  readonly caughtUp: (actor: Actor) => Promise<void>;
  /** E2B's allow/deny lists and internet switch as our egress policy (the same mapping a create uses). */
  readonly egressOf: (b: { allow_internet_access?: boolean | undefined; network?: Record<string, unknown> | undefined }) => EgressSpec;
}

const params = z.object({ sandboxID: z.string().min(1).max(64) });
/** Forks per call: each is a whole sandbox, placed like any create. */
const MAX_FORKS = 10;
const timeoutSchema = z
  .number()
  .int()
  .min(1)
  .max(30 * 24 * 3600);

export function registerE2bMemoryRoutes(app: E2bApp, deps: E2bMemoryDeps, scope: E2bScope): void {
  // E2B's memory flag: `false` asks for a filesystem-only pause, which would end the processes: not what pause does here.
  app.post(
    '/sandboxes/:sandboxID/pause',
    { schema: { hide: true, params, body: z.object({ memory: z.boolean().optional() }).strict().optional() } },
    async (req, reply) => {
      if (req.body?.memory === false)
        throw new AppError('E2B_NOT_SUPPORTED', 400, 'memory: false (a filesystem-only pause) is not supported: a pause here keeps memory');
      const actor = scope.actorOf(req);
      const vm = await scope.live(req.params.sandboxID, actor);
      // The SDK reads 409 as "already paused" (pause() returns false).
      if (vm.status === 'paused') return reply.status(409).send({ code: 409, message: `sandbox ${vm.vm_id} is already paused` });
      const r = await deps.memory.pause(vm.vm_id, actor);
      scope.remember(actor, r.position);
      return reply.status(204).send();
    },
  );

  // E2B's older resume verb (Sandbox.connect does the same): a running sandbox is its 409.
  app.post(
    '/sandboxes/:sandboxID/resume',
    { schema: { hide: true, params, body: z.object({ timeout: timeoutSchema.optional() }).strict().optional() } },
    async (req, reply) => {
      const actor = scope.actorOf(req);
      const vm = await scope.live(req.params.sandboxID, actor);
      if (vm.status !== 'paused') return reply.status(409).send({ code: 409, message: `sandbox ${vm.vm_id} is already running` });
      const r = await deps.memory.resume(vm.vm_id, actor);
      scope.remember(actor, r.position);
      let resumed = r.vm;
      if (req.body?.timeout !== undefined) {
        const t = await deps.lifecycle.update(vm.vm_id, { timeout_s: req.body.timeout }, actor);
        scope.remember(actor, t.position);
        resumed = t.vm;
      }
      return reply.status(201).send(scope.sandboxAnswer(resumed));
    },
  );

  app.post(
    '/sandboxes/:sandboxID/fork',
    {
      schema: {
        hide: true,
        params,
        body: z
          .object({ timeout: timeoutSchema.optional(), count: z.number().int().min(1).max(MAX_FORKS).optional() })
          .strict()
          .optional(),
      },
    },
    async (req, reply) => {
      const actor = scope.actorOf(req);
      const src = await scope.live(req.params.sandboxID, actor);
      const count = req.body?.count ?? 1;
      const timeout = req.body?.timeout;
      const results: Array<{ sandbox: Record<string, unknown> } | { error: { code: number; message: string } }> = [];
      let snapshotId: string | undefined;
      const host = src.host_id ? (await deps.hosts.load(src.host_id)).state : undefined;
      if (src.spec.gpus > 0 || (host && holdsGpus(host, src.vm_id))) {
        // A GPU's device state cannot be captured (gpu-memory.ts): the forks boot from a disk capture instead.
        const disk = await deps.snapshots.create(
          src.vm_id,
          snapshotRequest({ mode: 'manual', live: false, comment: `fork of ${src.vm_id}`, metadata: { fork_of: src.vm_id } }),
          actor,
        );
        scope.remember(actor, disk.position);
        snapshotId = disk.snapshot.snapshot_id;
      }
      for (let i = 0; i < count; i++) {
        try {
          // The first fork takes the capture (with memory where the host has CRIU, as E2B's fork keeps the running
          // processes), the others start from that same one.
          const many = await deps.forkMigrate.forkMany(
            src.vm_id,
            { count: 1, ...(snapshotId ? { reuse_snapshot_id: snapshotId } : {}) },
            actor,
          );
          snapshotId = many.snapshotId;
          const r = many.forks[0];
          if (!r?.ok) throw new AppError(r?.error.code ?? 'INTERNAL', r?.error.status ?? 500, r?.error.message ?? 'fork failed');
          scope.remember(actor, r.position);
          let vm = r.vm;
          if (timeout !== undefined) {
            const t = await deps.lifecycle.update(vm.vm_id, { timeout_s: timeout }, actor);
            scope.remember(actor, t.position);
            vm = t.vm;
          }
          results.push({ sandbox: scope.sandboxAnswer(vm) });
        } catch (err) {
          // Nothing was made yet: the whole call fails as E2B's would (404, 409, 503 …).
          if (results.length === 0) throw err;
          const e = err instanceof AppError ? err : new AppError('INTERNAL', 500, 'fork failed');
          results.push({ error: { code: e.code === 'CAPACITY_EXHAUSTED' ? 503 : e.status, message: e.message } });
        }
      }
      return reply.status(201).send(results);
    },
  );

  app.post(
    '/sandboxes/:sandboxID/snapshots',
    {
      schema: {
        hide: true,
        params,
        body: z
          .object({ name: z.string().min(1).max(256).optional() })
          .strict()
          .optional(),
      },
    },
    async (req, reply) => {
      const actor = scope.actorOf(req);
      const vm = await scope.live(req.params.sandboxID, actor);
      if (vm.status !== 'running')
        throw new AppError('VM_NOT_RUNNING', 409, `sandbox ${vm.vm_id} is ${vm.status}: resume it (Sandbox.connect) to snapshot it`);
      const { state: host } = await deps.hosts.load(vm.host_id);
      // With memory where the host can (CRIU, QEMU) and the VM holds no GPU (gpu-memory.ts), else its disk: a sandbox made from it boots from the snapshot's layer either way.
      const live = host.status !== 'unregistered' && host.capacity.live_snapshot === true && !holdsGpus(host, vm.vm_id, vm.spec.gpus);
      const name = req.body?.name;
      const r = await deps.snapshots.create(
        vm.vm_id,
        snapshotRequest({ mode: 'manual', live, comment: 'e2b createSnapshot', metadata: name ? { name } : {} }),
        actor,
      );
      scope.remember(actor, r.position);
      return reply.status(201).send({ snapshotID: r.snapshot.snapshot_id, names: name ? [name] : [] });
    },
  );

  app.get(
    '/snapshots',
    {
      schema: {
        hide: true,
        querystring: z.object({
          sandboxID: z.string().max(64).optional(),
          name: z.string().max(256).optional(),
          limit: z.coerce.number().int().min(1).max(100).default(100),
          nextToken: z.string().max(512).optional(),
        }),
      },
    },
    async (req, reply) => {
      const actor = scope.actorOf(req);
      await scope.caughtUp(actor);
      const q = req.query;
      const rows = await listSnapshots(deps.pool, {
        tenantId: req.caller.admin ? undefined : req.caller.tenantId,
        vmId: q.sandboxID,
        name: q.name,
        state: 'ready',
        mode: 'manual',
        limit: q.limit,
        after: decodeCursor(q.nextToken, z.object({ created_at: cursorTime, id: z.string() })),
      });
      const last = rows.at(-1);
      if (rows.length === q.limit && last) void reply.header('x-next-token', encodeCursor({ created_at: last.created_at, id: last.id }));
      return reply.send(rows.map((s) => ({ snapshotID: s.id, names: s.metadata.name ? [s.metadata.name] : [] })));
    },
  );

  // The SDK deletes a snapshot as the template it is.
  app.delete(
    '/templates/:templateID',
    { schema: { hide: true, params: z.object({ templateID: z.string().min(1).max(256) }) } },
    async (req, reply) => {
      const actor = scope.actorOf(req);
      const notFound = () =>
        reply.status(404).send({ code: 404, message: `template ${req.params.templateID} not found`, error_code: 'TEMPLATE_NOT_FOUND' });
      // The caller's own writes first (a snapshot it just made is found), and whether it is already deleted from its
      // stream, not the read model: a second delete right after the first is a 404 (the SDK's false), never a 204.
      await scope.caughtUp(actor);
      const snap = await getSnapshot(deps.pool, req.params.templateID, req.caller.admin ? undefined : req.caller.tenantId);
      if (!snap || snap.state === 'deleted') return notFound();
      const r = await deps.snapshots.delete(snap.id, actor);
      if (r.position === undefined) return notFound();
      scope.remember(actor, r.position);
      return reply.status(204).send();
    },
  );

  app.put(
    '/sandboxes/:sandboxID/network',
    {
      schema: {
        hide: true,
        params,
        body: z
          .object({
            allowOut: z.unknown().optional(),
            denyOut: z.unknown().optional(),
            egressProxy: z.unknown().optional(),
            rules: z.unknown().optional(),
            allow_internet_access: z.boolean().optional(),
          })
          .strict(),
      },
    },
    async (req, reply) => {
      const actor = scope.actorOf(req);
      const vm = await scope.live(req.params.sandboxID, actor);
      const b = req.body;
      for (const f of ['egressProxy', 'rules'] as const)
        if (b[f] !== undefined)
          throw new AppError('E2B_NOT_SUPPORTED', 400, `${f}: only allowOut, denyOut and allow_internet_access are supported`);
      // E2B replaces the whole policy: what the body omits is cleared.
      const egress = scope.egressOf({
        allow_internet_access: b.allow_internet_access,
        network: {
          ...(b.allowOut !== undefined ? { allowOut: b.allowOut } : {}),
          ...(b.denyOut !== undefined ? { denyOut: b.denyOut } : {}),
        },
      });
      const r = await deps.vms.changeEgress(vm.vm_id, egress, actor);
      scope.remember(actor, r.position);
      return reply.status(204).send();
    },
  );

  app.get(
    '/sandboxes/:sandboxID/metrics',
    {
      schema: {
        hide: true,
        params,
        querystring: z.object({
          start: z.coerce.number().int().nonnegative().optional(),
          end: z.coerce.number().int().nonnegative().optional(),
        }),
      },
    },
    async (req) => {
      const actor = scope.actorOf(req);
      const vm = await scope.live(req.params.sandboxID, actor);
      // A paused sandbox uses no CPU or memory and is sampled by nobody: E2B answers its samples so far; we have none kept.
      if (vm.status !== 'running') return [];
      const agent = await deps.hosts.agentFor(vm.host_id);
      if (!agent.metrics) throw new AppError('NOT_IMPLEMENTED', 501, "this sandbox's host agent does not serve metrics");
      const startMs = req.query.start !== undefined ? req.query.start * 1000 : 0;
      const endMs = req.query.end !== undefined ? req.query.end * 1000 : Infinity;
      // One sample before the window, so the first in it has a CPU delta.
      const m = await agent.metrics(sandboxName(vm.vm_id), Math.max(0, startMs - 1));
      return e2bMetrics(m.samples, vm.spec).filter((s) => s.timestampUnix * 1000 >= startMs && s.timestampUnix * 1000 <= endMs);
    },
  );
}

/**
 * Our cumulative samples as E2B's: CPU as the share of the sandbox's CPUs
 * used since the previous sample (the first sample has no predecessor and
 * is dropped), memory and disk as bytes against the spec's sizes.
 */
export function e2bMetrics(samples: readonly MetricSample[], spec: { cpus: number; ram_mb: number; storage_gb: number }) {
  const out = [];
  let prev: MetricSample | undefined;
  for (const s of samples) {
    const before = prev;
    prev = s;
    if (!before) continue;
    const dtUs = (s.t - before.t) * 1000;
    const cpu = s.cpu_usec !== null && before.cpu_usec !== null && dtUs > 0 ? ((s.cpu_usec - before.cpu_usec) / dtUs / spec.cpus) * 100 : 0;
    out.push({
      timestamp: new Date(s.t).toISOString(),
      timestampUnix: Math.floor(s.t / 1000),
      cpuUsedPct: Math.round(Math.min(100, Math.max(0, cpu)) * 100) / 100,
      cpuCount: spec.cpus,
      memUsed: s.memory_bytes,
      memTotal: spec.ram_mb * 1024 * 1024,
      memCache: 0,
      diskUsed: s.disk_used_bytes ?? 0,
      diskTotal: spec.storage_gb * 1024 * 1024 * 1024,
    });
  }
  return out;
}
